#include "runtime/machine.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <sched.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/statfs.h>
#include <sys/statvfs.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "runtime/storage.h"
#include "runtime/units.h"

#if STRATA_HAVE_CUDA
#include <cuda_runtime_api.h>
#endif
#if STRATA_HAVE_NCCL
#include "runtime/nccl_internal.h"
#endif

namespace strata {
namespace {

constexpr uint64_t kProbeBytes = 4096;

// "MemTotal:       24576000 kB" -> bytes; 0 when the key is absent.
uint64_t MeminfoBytes(const std::string& text, std::string_view key) {
  const size_t at = text.find(std::string(key) + ":");
  if (at == std::string::npos) return 0;
  return std::strtoull(text.c_str() + at + key.size() + 1, nullptr, 10) * 1024;
}

bool HasCapIpcLock() {
  std::ifstream in("/proc/self/status");
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind("CapEff:", 0) == 0) {
      const uint64_t caps = std::strtoull(line.c_str() + 7, nullptr, 16);
      return (caps >> 14) & 1;  // CAP_IPC_LOCK
    }
  }
  return false;
}

std::string FilesystemName(int64_t magic) {
  switch (static_cast<uint64_t>(magic)) {
    case 0xEF53: return "ext4";  // ext2/3/4 share the magic
    case 0x58465342: return "xfs";
    case 0x9123683E: return "btrfs";
    case 0x01021994: return "tmpfs";
    case 0x794C7630: return "overlay";
    case 0x6969: return "nfs";
    case 0x2FC12FC1: return "zfs";
    case 0xF2F52010: return "f2fs";
    case 0x65735546: return "fuse";
    case 0x858458F6: return "ramfs";
    case 0x9FA0:
      return "proc";
    case 0x62656572:
      return "sysfs";
    default: return fmt::format("0x{:x}", static_cast<uint64_t>(magic));
  }
}

// A page-aligned 4 KiB buffer with a recognizable pattern.
struct AlignedPage {
  std::byte* data = nullptr;
  AlignedPage() {
    data = static_cast<std::byte*>(std::aligned_alloc(kProbeBytes, kProbeBytes));
    for (uint64_t i = 0; i < kProbeBytes; ++i) data[i] = static_cast<std::byte>(i * 7 + 3);
  }
  ~AlignedPage() { std::free(data); }
  AlignedPage(const AlignedPage&) = delete;
  AlignedPage& operator=(const AlignedPage&) = delete;
  std::span<std::byte> span() { return {data, kProbeBytes}; }
};

std::string ScratchName(const std::string& dir, std::string_view what) {
  return fmt::format("{}/.strata-probe-{}-{}", dir, what, ::getpid());
}

// Writes and reads back one page with O_DIRECT, by hand: what the kernel and
// the filesystem allow, with no fallback in the way.
Status CheckODirect(const std::string& dir) {
  const std::string path = ScratchName(dir, "odirect");
  const int fd = ::open(path.c_str(), O_RDWR | O_CREAT | O_TRUNC | O_DIRECT | O_CLOEXEC, 0600);
  if (fd < 0) {
    return ErrnoError(errno, fmt::format("open {} with O_DIRECT", path));
  }
  AlignedPage out, in;
  std::memset(in.data, 0, kProbeBytes);
  Status result;
  if (::pwrite(fd, out.data, kProbeBytes, 0) != static_cast<ssize_t>(kProbeBytes)) {
    result = ErrnoError(errno, fmt::format("write 4 KiB to {} with O_DIRECT", path));
  } else if (::pread(fd, in.data, kProbeBytes, 0) != static_cast<ssize_t>(kProbeBytes)) {
    result = ErrnoError(errno, fmt::format("read 4 KiB from {} with O_DIRECT", path));
  } else if (std::memcmp(in.data, out.data, kProbeBytes) != 0) {
    result = DataLossError(fmt::format("read back {} with O_DIRECT: the data differ", path));
  }
  ::close(fd);
  ::unlink(path.c_str());
  return result;
}

Status RoundTrip(File& file, IoRequest request) {
  std::array<IoRequest, 1> reqs = {request};
  STRATA_RETURN_IF_ERROR(file.Submit(reqs));
  std::array<IoRequest*, 1> done{};
  STRATA_ASSIGN_OR_RETURN(size_t n, file.Reap(done, 1));
  if (n != 1) return InternalError("io_uring probe: no completion");
  return done[0]->status;
}

Status CheckUring(const std::string& dir) {
  if (!UringAvailable()) {
    return UnavailableError(
        "io_uring: not built in, or refused by the kernel (seccomp in a container, "
        "kernel.io_uring_disabled, or a kernel older than 5.6)");
  }
  STRATA_ASSIGN_OR_RETURN(std::unique_ptr<Storage> storage, CreateUringStorage(SqPoll::kOff));
  const std::string path = ScratchName(dir, "uring");
  Status result = [&]() -> Status {
    STRATA_ASSIGN_OR_RETURN(std::unique_ptr<File> file,
                            storage->Open(path, {.create = FileCreate::kCreate}));
    STRATA_RETURN_IF_ERROR(file->Resize(kProbeBytes));
    AlignedPage out, in;
    std::memset(in.data, 0, kProbeBytes);
    STRATA_RETURN_IF_ERROR(RoundTrip(*file, IoRequest::Write(0, out.span())));
    STRATA_RETURN_IF_ERROR(RoundTrip(*file, IoRequest::Read(0, in.span())));
    if (std::memcmp(in.data, out.data, kProbeBytes) != 0) {
      return DataLossError(fmt::format("read back {} through io_uring: the data differ", path));
    }
    return OkStatus();
  }();
  ::unlink(path.c_str());
  return result;
}

// Whether this user may create entries in the directory `dir`; `what`
// names it in the message ("/d", or "/d/new: cannot be created in /d").
Status CheckWritable(const std::string& dir, const std::string& what, int& err_out) {
  if (::access(dir.c_str(), W_OK | X_OK) == 0) return OkStatus();
  const int err = errno;
  err_out = err;
  std::string cause;
  if (err == EROFS) {
    cause = "on a read-only filesystem";
  } else if (err == EACCES || err == EPERM) {
    cause = fmt::format("not writable by this user (uid {})", ::geteuid());
  } else {
    cause = "not writable";
  }
  return FailedPreconditionError(
      fmt::format("{}: {}: {} ({})", what, cause, ErrnoName(err), std::strerror(err)));
}

}  // namespace

std::string_view PathKindName(PathKind kind) {
  switch (kind) {
    case PathKind::kMissing:
      return "missing";
    case PathKind::kDirectory:
      return "directory";
    case PathKind::kNotDirectory:
      return "not a directory";
  }
  return "?";
}

namespace internal {
namespace {

// The first number of a cgroup file ("max" and absent files: unlimited).
uint64_t CgroupNumber(const std::filesystem::path& file) {
  std::ifstream in(file);
  std::string word;
  if (!(in >> word) || word == "max") return kUnlimitedBytes;
  char* end = nullptr;
  const uint64_t v = std::strtoull(word.c_str(), &end, 10);
  return end != word.c_str() ? v : kUnlimitedBytes;
}

// A key of memory.stat ("inactive_file 4096"); 0 when absent.
uint64_t CgroupStat(const std::filesystem::path& file, std::string_view key) {
  std::ifstream in(file);
  std::string k;
  uint64_t v = 0;
  while (in >> k >> v) {
    if (k == key) return v;
  }
  return 0;
}

}  // namespace

CgroupMemory ReadCgroupMemory(std::string_view proc_self_cgroup,
                              const std::string& cgroup_root) {
  namespace fs = std::filesystem;
  // "0::/path" (v2) or "4:memory:/path" (v1; the memory controller may share
  // its line with others).
  std::string v1_path, v2_path;
  bool have_v1 = false, have_v2 = false;
  std::istringstream lines{std::string(proc_self_cgroup)};
  for (std::string line; std::getline(lines, line);) {
    const size_t a = line.find(':');
    const size_t b = a == std::string::npos ? a : line.find(':', a + 1);
    if (b == std::string::npos) continue;
    const std::string controllers = line.substr(a + 1, b - a - 1);
    const std::string path = line.substr(b + 1);
    if (controllers.empty() && line.compare(0, a, "0") == 0) {
      v2_path = path, have_v2 = true;
    } else if (("," + controllers + ",").find(",memory,") != std::string::npos) {
      v1_path = path, have_v1 = true;
    }
  }
  struct Layout {
    fs::path mount;
    std::string path;
    const char* limit;
    const char* usage;
    const char* inactive;
  };
  std::vector<Layout> layouts;
  if (have_v1) {
    layouts.push_back({fs::path(cgroup_root) / "memory", v1_path, "memory.limit_in_bytes",
                       "memory.usage_in_bytes", "total_inactive_file"});
  }
  if (have_v2) {
    layouts.push_back(
        {fs::path(cgroup_root), v2_path, "memory.max", "memory.current", "inactive_file"});
  }
  CgroupMemory best;
  uint64_t best_room = kUnlimitedBytes;
  std::error_code ec;
  for (const Layout& l : layouts) {
    if (!fs::is_directory(l.mount, ec)) continue;
    // The cgroup and its ancestors up to the mount; a path the mount does not
    // show (another cgroup namespace) stands for the mount itself.
    fs::path rel = fs::path(l.path).relative_path();
    if (!fs::is_directory(l.mount / rel, ec)) rel.clear();
    for (;;) {
      const fs::path dir = l.mount / rel;
      const uint64_t limit = CgroupNumber(dir / l.limit);
      // v1 writes "no limit" as the largest page-aligned long.
      if (limit < (uint64_t{1} << 62)) {
        const uint64_t usage = CgroupNumber(dir / l.usage);
        const uint64_t inactive = CgroupStat(dir / "memory.stat", l.inactive);
        const uint64_t used =
            usage == kUnlimitedBytes ? 0 : usage - std::min(usage, inactive);
        const uint64_t room = limit - std::min(limit, used);
        if (room < best_room) {
          best_room = room;
          best = {.path = "/" + rel.generic_string(), .limit_bytes = limit, .used_bytes = used};
        }
      }
      if (rel.empty()) break;
      rel = rel.parent_path();
      if (rel == rel.root_path()) rel.clear();
    }
  }
  return best;
}

}  // namespace internal

std::string HostMemory::limit_note() const {
  if (cgroup.limit_bytes == kUnlimitedBytes) return "";
  return fmt::format(", limited by cgroup {} (memory limit {}, {} in use)", cgroup.path,
                     FormatBytes(cgroup.limit_bytes), FormatBytes(cgroup.used_bytes));
}

Result<HostMemory> ProbeHostMemory() {
  std::ifstream in("/proc/meminfo");
  if (!in) return UnavailableError("read /proc/meminfo: cannot open it");
  std::stringstream text;
  text << in.rdbuf();
  HostMemory m;
  m.total_bytes = MeminfoBytes(text.str(), "MemTotal");
  m.available_bytes = MeminfoBytes(text.str(), "MemAvailable");
  if (m.total_bytes == 0) return UnavailableError("read /proc/meminfo: no MemTotal line");
  if (m.available_bytes == 0) m.available_bytes = MeminfoBytes(text.str(), "MemFree");
  // In a container or a job with a memory limit, the limit is what there is:
  // past it the kernel kills the process, however much the machine has.
  std::ifstream cgroup_file("/proc/self/cgroup");
  std::stringstream cgroup_text;
  cgroup_text << cgroup_file.rdbuf();
  const CgroupMemory cg = internal::ReadCgroupMemory(cgroup_text.str(), "/sys/fs/cgroup");
  if (cg.limit_bytes < m.total_bytes ||
      cg.limit_bytes - std::min(cg.limit_bytes, cg.used_bytes) < m.available_bytes) {
    m.cgroup = cg;
    m.total_bytes = std::min(m.total_bytes, cg.limit_bytes);
    m.available_bytes =
        std::min(m.available_bytes, cg.limit_bytes - std::min(cg.limit_bytes, cg.used_bytes));
  }
  rlimit lim{};
  if (::getrlimit(RLIMIT_MEMLOCK, &lim) == 0) {
    m.memlock_limit_bytes = lim.rlim_cur == RLIM_INFINITY ? kUnlimitedBytes : lim.rlim_cur;
  }
  m.memlock = m.memlock_limit_bytes == kUnlimitedBytes || HasCapIpcLock()
                  ? MemlockLimit::kUnlimited
                  : MemlockLimit::kLimited;
  return m;
}

CpuInfo ProbeCpus() {
  CpuInfo c;
  cpu_set_t set;
  CPU_ZERO(&set);
  if (::sched_getaffinity(0, sizeof(set), &set) == 0) c.usable = CPU_COUNT(&set);
  const long online = ::sysconf(_SC_NPROCESSORS_ONLN);
  c.online = online > 0 ? static_cast<uint32_t>(online) : c.usable;
  if (c.usable == 0) c.usable = c.online;
  std::ifstream in("/proc/cpuinfo");
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind("model name", 0) == 0) {
      const size_t colon = line.find(':');
      if (colon != std::string::npos) c.model = line.substr(line.find_first_not_of(' ', colon + 1));
      break;
    }
  }
  return c;
}

Status ProbePinning(uint64_t bytes) {
  if (bytes == 0) return OkStatus();
  void* p = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED) return ErrnoError(errno, fmt::format("map {}", FormatBytes(bytes)));
  // The raw system call: sanitizer runtimes replace mlock(3) with a no-op.
  Status result;
  if (::syscall(SYS_mlock, p, bytes) != 0) {
    result = ErrnoError(errno, fmt::format("mlock {}", FormatBytes(bytes)));
  } else {
    ::syscall(SYS_munlock, p, bytes);
  }
  ::munmap(p, bytes);
  return result;
}

DirectoryProbe ProbeDirectory(const std::string& path, DirectoryChecks checks) {
  namespace fs = std::filesystem;
  DirectoryProbe d;
  d.path = path;
  std::error_code ec;
  struct stat path_st {};
  if (::stat(path.c_str(), &path_st) == 0) {
    d.kind = S_ISDIR(path_st.st_mode) ? PathKind::kDirectory : PathKind::kNotDirectory;
  }
  d.exists = d.kind == PathKind::kDirectory;
  // The nearest existing ancestor answers for space when `path` is yet to be made.
  fs::path at = fs::absolute(path, ec);
  while (!at.empty() && !fs::exists(at, ec) && at.has_parent_path() && at != at.parent_path()) {
    at = at.parent_path();
  }
  d.probed_path = at.string();
  switch (d.kind) {
    case PathKind::kDirectory:
      d.writable = CheckWritable(path, path, d.writable_errno);
      break;
    case PathKind::kNotDirectory:
      d.writable =
          FailedPreconditionError(fmt::format("{}: exists and is not a directory (a {})", path,
                                              S_ISREG(path_st.st_mode) ? "file" : "special file"));
      break;
    case PathKind::kMissing:
      if (!fs::is_directory(d.probed_path, ec)) {
        d.writable = FailedPreconditionError(
            fmt::format("{}: cannot be created: {} is not a directory", path, d.probed_path));
      } else {
        d.writable = CheckWritable(d.probed_path,
                                   fmt::format("{}: cannot be created in {}", path, d.probed_path),
                                   d.writable_errno);
      }
      break;
  }
  struct statvfs vfs {};
  struct statfs sfs {};
  struct stat st {};
  if (::statvfs(d.probed_path.c_str(), &vfs) != 0) {
    d.space = ErrnoError(errno, fmt::format("statvfs {}", d.probed_path));
  } else {
    d.free_bytes = uint64_t{vfs.f_bavail} * vfs.f_frsize;
    d.total_bytes = uint64_t{vfs.f_blocks} * vfs.f_frsize;
  }
  if (::statfs(d.probed_path.c_str(), &sfs) == 0) d.filesystem = FilesystemName(sfs.f_type);
  if (::stat(d.probed_path.c_str(), &st) == 0) d.device_id = st.st_dev;

  if (checks == DirectoryChecks::kSpace) {
    d.o_direct = UnimplementedError("O_DIRECT: not checked");
    d.io_uring = UnimplementedError("io_uring: not checked");
  } else if (d.kind == PathKind::kNotDirectory) {
    d.o_direct = d.writable;
    d.io_uring = d.writable;
  } else if (!d.exists) {
    d.o_direct = NotFoundError(fmt::format("{}: not a directory (yet)", path));
    d.io_uring = d.o_direct;
  } else if (!d.writable.ok()) {
    // Opening a scratch file would fail with the same errno and read as
    // an O_DIRECT or io_uring problem.
    d.o_direct =
        FailedPreconditionError(fmt::format("O_DIRECT not checked: {}", d.writable.message()));
    d.io_uring =
        FailedPreconditionError(fmt::format("io_uring not checked: {}", d.writable.message()));
  } else {
    d.o_direct = CheckODirect(path);
    d.io_uring = CheckUring(path);
  }
  return d;
}

Status CreateDirectories(const std::string& path) {
  namespace fs = std::filesystem;
  std::error_code ec;
  if (fs::is_directory(path, ec)) return OkStatus();
  if (fs::exists(path, ec)) {
    return FailedPreconditionError(
        fmt::format("create directory {}: it exists and is not a directory", path));
  }
  fs::create_directories(path, ec);
  if (ec) {
    const Status cause = ErrnoError(ec.value(), fmt::format("create directory {}", path));
    const int err = ec.value();
    if (err != EROFS && err != EACCES && err != EPERM) return cause;
    return Status(cause.code(),
                  fmt::format("{}: {}", cause.message(),
                              err == EROFS ? "it is on a read-only filesystem; give a directory "
                                             "on a writable one"
                                           : "this user may not create it there; give a "
                                             "directory this user can write, or create it "
                                             "with the right owner first"));
  }
  return OkStatus();
}

uint64_t FileAllocatedBytes(const std::string& path) {
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0 || !S_ISREG(st.st_mode)) return 0;
  return uint64_t(st.st_blocks) * 512;
}

BackendVersions ProbeBackendVersions() {
  BackendVersions v;
#if STRATA_HAVE_CUDA
  int x = 0;
  if (cudaRuntimeGetVersion(&x) == cudaSuccess) v.cuda_runtime = x;
  x = 0;
  if (cudaDriverGetVersion(&x) == cudaSuccess) v.cuda_driver = x;
#endif
#if STRATA_HAVE_NCCL
  if (Result<const internal::NcclApi*> nccl = internal::LoadNccl(); nccl.ok()) {
    v.nccl = (*nccl)->version;
    v.nccl_library = (*nccl)->path;
  } else {
    v.nccl_error = std::string(nccl.status().message());
  }
#endif
  return v;
}

std::string FormatCudaVersion(int version) {
  if (version <= 0) return "";
  return fmt::format("{}.{}", version / 1000, (version % 1000) / 10);
}

std::string FormatNcclVersion(int version) {
  if (version <= 0) return "";
  // NCCL >= 2.9 codes are major*10000 + minor*100 + patch; older ones *1000 + *100.
  if (version >= 20900) {
    return fmt::format("{}.{}.{}", version / 10000, (version % 10000) / 100, version % 100);
  }
  return fmt::format("{}.{}.{}", version / 1000, (version % 1000) / 100, version % 100);
}

}  // namespace strata
