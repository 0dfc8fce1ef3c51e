#include "runtime/machine.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <string>

#include "runtime/storage.h"
#include "runtime/units.h"

namespace strata {
namespace {

namespace fs = std::filesystem;

class ScratchDir {
 public:
  ScratchDir() : path_(fs::temp_directory_path() / ("strata-machine-" + std::to_string(getpid()))) {
    fs::remove_all(path_);
    fs::create_directories(path_);
  }
  ~ScratchDir() {
    std::error_code ec;
    fs::remove_all(path_, ec);
  }
  std::string str() const { return path_.string(); }

 private:
  fs::path path_;
};

TEST(MachineTest, HostMemoryIsSane) {
  Result<HostMemory> m = ProbeHostMemory();
  ASSERT_TRUE(m.ok()) << m.status();
  EXPECT_GT(m->total_bytes, 64 * kMiB);
  EXPECT_GT(m->available_bytes, 0u);
  EXPECT_LE(m->available_bytes, m->total_bytes);
  EXPECT_GT(m->memlock_limit_bytes, 0u);
  if (m->memlock_limit_bytes == kUnlimitedBytes) {
    EXPECT_EQ(m->memlock, MemlockLimit::kUnlimited);
  }
}

TEST(MachineTest, Cpus) {
  const CpuInfo c = ProbeCpus();
  EXPECT_GE(c.usable, 1u);
  EXPECT_LE(c.usable, c.online);
}

TEST(MachineTest, PinningASmallBufferWorks) {
  // 4 KiB is under every default `ulimit -l` (8 MiB on Debian, 64 KiB at least elsewhere).
  EXPECT_TRUE(ProbePinning(4096).ok());
  EXPECT_TRUE(ProbePinning(0).ok());
}

TEST(MachineTest, DirectoryIoChecksLeaveNothingBehind) {
  ScratchDir dir;
  const DirectoryProbe d = ProbeDirectory(dir.str(), DirectoryChecks::kIo);
  EXPECT_TRUE(d.exists);
  EXPECT_EQ(d.probed_path, fs::absolute(dir.str()).string());
  ASSERT_TRUE(d.space.ok()) << d.space;
  EXPECT_GT(d.free_bytes, 0u);
  EXPECT_GE(d.total_bytes, d.free_bytes);
  EXPECT_FALSE(d.filesystem.empty());
  // O_DIRECT works or says why (tmpfs refuses it with EINVAL).
  if (!d.o_direct.ok()) {
    EXPECT_NE(d.o_direct.message().find("O_DIRECT"), std::string_view::npos) << d.o_direct;
  }
  if (UringAvailable()) {
    EXPECT_TRUE(d.io_uring.ok()) << d.io_uring;
  } else {
    EXPECT_EQ(d.io_uring.code(), StatusCode::kUnavailable);
  }
  EXPECT_TRUE(fs::is_empty(dir.str())) << "the scratch files must be removed";
}

TEST(MachineTest, MissingDirectoryAnswersWithItsNearestAncestor) {
  ScratchDir dir;
  const DirectoryProbe d = ProbeDirectory(dir.str() + "/a/b/c", DirectoryChecks::kIo);
  EXPECT_FALSE(d.exists);
  EXPECT_EQ(d.probed_path, fs::absolute(dir.str()).string());
  EXPECT_TRUE(d.space.ok()) << d.space;
  EXPECT_GT(d.free_bytes, 0u);
  EXPECT_EQ(d.o_direct.code(), StatusCode::kNotFound);
  const DirectoryProbe cheap = ProbeDirectory(dir.str(), DirectoryChecks::kSpace);
  EXPECT_EQ(cheap.o_direct.code(), StatusCode::kUnimplemented);
  EXPECT_EQ(cheap.device_id, d.device_id);
}

TEST(MachineTest, CreateDirectories) {
  ScratchDir dir;
  const std::string nested = dir.str() + "/x/y/z";
  ASSERT_TRUE(CreateDirectories(nested).ok());
  EXPECT_TRUE(fs::is_directory(nested));
  EXPECT_TRUE(CreateDirectories(nested).ok()) << "an existing directory is fine";
  const std::string file = dir.str() + "/file";
  std::ofstream(file) << "x";
  Status on_file = CreateDirectories(file);
  EXPECT_EQ(on_file.code(), StatusCode::kFailedPrecondition);
  EXPECT_NE(on_file.message().find(file), std::string_view::npos) << on_file;
  Status under_file = CreateDirectories(file + "/sub");
  EXPECT_FALSE(under_file.ok());
  EXPECT_NE(under_file.message().find("create directory " + file + "/sub"),
            std::string_view::npos)
      << under_file;
}

TEST(MachineTest, FileAllocatedBytes) {
  ScratchDir dir;
  EXPECT_EQ(FileAllocatedBytes(dir.str() + "/missing"), 0u);
  const std::string f = dir.str() + "/data";
  std::ofstream(f) << std::string(1 << 16, 'x');
  EXPECT_GE(FileAllocatedBytes(f), uint64_t{1} << 16);
  EXPECT_EQ(FileAllocatedBytes(dir.str()), 0u) << "a directory is not a file";
}

TEST(MachineTest, VersionFormats) {
  EXPECT_EQ(FormatCudaVersion(13000), "13.0");
  EXPECT_EQ(FormatCudaVersion(12040), "12.4");
  EXPECT_EQ(FormatCudaVersion(0), "");
  EXPECT_EQ(FormatNcclVersion(22809), "2.28.9");
  EXPECT_EQ(FormatNcclVersion(2804), "2.8.4");
  EXPECT_EQ(FormatNcclVersion(0), "");
  const BackendVersions v = ProbeBackendVersions();
  EXPECT_GE(v.cuda_runtime, 0);
  EXPECT_GE(v.nccl, 0);
}

}  // namespace
}  // namespace strata
