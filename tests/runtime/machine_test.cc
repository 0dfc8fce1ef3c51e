#include "runtime/machine.h"

#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
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

// Control-group memory limits from a fake cgroup filesystem: v2 with a
// tighter parent, v1, no limit, and a container whose own cgroup is the
// mount's root.
TEST(MachineTest, CgroupMemoryLimits) {
  ScratchDir dir;
  auto write = [&](const std::string& rel, const std::string& text) {
    const fs::path p = fs::path(dir.str()) / rel;
    fs::create_directories(p.parent_path());
    std::ofstream(p) << text;
  };
  const std::string root = dir.str();
  // v2: the job's limit is 1 GiB with 384 MiB used (512 MiB less 128 MiB of
  // inactive page cache); its parent has max.
  write("user.slice/memory.max", "max\n");
  write("user.slice/job/memory.max", "1073741824\n");
  write("user.slice/job/memory.current", "536870912\n");
  write("user.slice/job/memory.stat", "anon 1\ninactive_file 134217728\nactive_file 5\n");
  CgroupMemory m = internal::ReadCgroupMemory("0::/user.slice/job\n", root);
  EXPECT_EQ(m.path, "/user.slice/job");
  EXPECT_EQ(m.limit_bytes, 1 * kGiB);
  EXPECT_EQ(m.used_bytes, 384 * kMiB);
  // The parent leaves less room (768 MiB limit, 700 MiB used): it decides.
  write("user.slice/memory.max", "805306368\n");
  write("user.slice/memory.current", "734003200\n");
  m = internal::ReadCgroupMemory("0::/user.slice/job\n", root);
  EXPECT_EQ(m.path, "/user.slice");
  EXPECT_EQ(m.limit_bytes, 768 * kMiB);
  EXPECT_EQ(m.used_bytes, 700 * kMiB);
  // No limit anywhere.
  m = internal::ReadCgroupMemory("0::/other\n", root + "/none");
  EXPECT_EQ(m.limit_bytes, kUnlimitedBytes);
  EXPECT_EQ(m.path, "");
  // v1 (the memory controller on its own line, or sharing one), "no limit"
  // written as the largest page-aligned long.
  write("v1/memory/docker/abc/memory.limit_in_bytes", "314572800\n");
  write("v1/memory/docker/abc/memory.usage_in_bytes", "104857600\n");
  write("v1/memory/docker/abc/memory.stat", "cache 7\ntotal_inactive_file 0\n");
  write("v1/memory/docker/memory.limit_in_bytes", "9223372036854771712\n");
  m = internal::ReadCgroupMemory("5:cpu,cpuacct:/\n4:memory:/docker/abc\n0::/\n",
                                 root + "/v1");
  EXPECT_EQ(m.path, "/docker/abc");
  EXPECT_EQ(m.limit_bytes, 300 * kMiB);
  EXPECT_EQ(m.used_bytes, 100 * kMiB);
  m = internal::ReadCgroupMemory("4:memory,blkio:/docker/abc\n", root + "/v1");
  EXPECT_EQ(m.limit_bytes, 300 * kMiB);
  // A container: /proc/self/cgroup names the host's path, the mount shows the
  // container's cgroup as its root.
  write("ns/memory.max", "2147483648\n");
  write("ns/memory.current", "0\n");
  m = internal::ReadCgroupMemory("0::/kubepods/pod1/c1\n", root + "/ns");
  EXPECT_EQ(m.path, "/");
  EXPECT_EQ(m.limit_bytes, 2 * kGiB);
  // The probe applies what it finds: never more available than total.
  Result<HostMemory> mem = ProbeHostMemory();
  ASSERT_TRUE(mem.ok()) << mem.status();
  EXPECT_LE(mem->available_bytes, mem->total_bytes);
  if (mem->cgroup.limit_bytes != kUnlimitedBytes) {
    EXPECT_LE(mem->total_bytes, mem->cgroup.limit_bytes);
    EXPECT_NE(mem->limit_note().find("limited by cgroup"), std::string::npos);
  } else {
    EXPECT_EQ(mem->limit_note(), "");
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

// A file where a directory is meant is named as such, not as a directory
// "to be created"; so is a path under a file, which can never be created.
TEST(MachineTest, AFileIsNotADirectory) {
  ScratchDir dir;
  const std::string file = dir.str() + "/file";
  std::ofstream(file) << "x";
  const DirectoryProbe d = ProbeDirectory(file, DirectoryChecks::kIo);
  EXPECT_EQ(d.kind, PathKind::kNotDirectory);
  EXPECT_FALSE(d.exists);
  EXPECT_EQ(d.writable.code(), StatusCode::kFailedPrecondition);
  EXPECT_NE(d.writable.message().find(file + ": exists and is not a directory (a file)"),
            std::string_view::npos)
      << d.writable;
  EXPECT_EQ(d.o_direct.code(), StatusCode::kFailedPrecondition) << d.o_direct;
  const DirectoryProbe under = ProbeDirectory(file + "/sub", DirectoryChecks::kSpace);
  EXPECT_EQ(under.kind, PathKind::kMissing);
  EXPECT_NE(under.writable.message().find("cannot be created: " + file + " is not a directory"),
            std::string_view::npos)
      << under.writable;
  EXPECT_EQ(under.writable_errno, 0);
  const DirectoryProbe fine = ProbeDirectory(dir.str() + "/new", DirectoryChecks::kSpace);
  EXPECT_EQ(fine.kind, PathKind::kMissing);
  EXPECT_TRUE(fine.writable.ok()) << fine.writable;
}

// A directory this user cannot write is named as a permissions problem, not
// as one of O_DIRECT or io_uring (whose scratch files it refuses with the
// same EACCES). As root, the probe runs in a child switched to nobody.
TEST(MachineTest, AnUnwritableDirectoryIsAPermissionsProblem) {
  ScratchDir dir;
  const std::string locked = dir.str() + "/locked";
  fs::create_directories(locked);
  fs::permissions(locked, fs::perms::owner_read | fs::perms::owner_exec | fs::perms::group_read |
                              fs::perms::group_exec | fs::perms::others_read |
                              fs::perms::others_exec);
  // 0: as expected; 1-5: which expectation failed.
  auto probe = [&]() -> int {
    const DirectoryProbe d = ProbeDirectory(locked, DirectoryChecks::kIo);
    if (d.kind != PathKind::kDirectory) return 1;
    if (d.writable.code() != StatusCode::kFailedPrecondition) return 2;
    if (d.writable.message().find("not writable by this user") == std::string_view::npos) return 3;
    if (d.writable_errno != EACCES) return 4;
    if (d.o_direct.message().find("O_DIRECT not checked") == std::string_view::npos) return 5;
    const DirectoryProbe sub = ProbeDirectory(locked + "/sub", DirectoryChecks::kSpace);
    if (sub.writable.message().find("cannot be created in " + locked) == std::string_view::npos)
      return 6;
    return 0;
  };
  int result = 0;
  if (::geteuid() != 0) {
    result = probe();
  } else {
    const pid_t pid = ::fork();
    if (pid == 0) {
      constexpr uid_t kNobody = 65534;
      if (::setgid(kNobody) != 0 || ::setuid(kNobody) != 0) ::_exit(100);
      ::_exit(probe());
    }
    int status = 0;
    ASSERT_EQ(::waitpid(pid, &status, 0), pid);
    ASSERT_TRUE(WIFEXITED(status)) << status;
    result = WEXITSTATUS(status);
    if (result == 100) GTEST_SKIP() << "cannot switch to uid 65534";
  }
  EXPECT_EQ(result, 0) << "expectation " << result << " failed";
  fs::permissions(locked, fs::perms::owner_all);
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
