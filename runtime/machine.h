// What this machine offers: CPUs, memory, the page-lock limit, and per
// directory free space and whether O_DIRECT and io_uring work there; the
// versions of the CUDA runtime, driver and NCCL this build talks to. The
// planner's preflight (offload/placement.h) and `strata info` read these.
//
//   STRATA_ASSIGN_OR_RETURN(HostMemory mem, ProbeHostMemory());
//   if (plan.host_total_bytes() > mem.available_bytes) { ... refuse ... }
//   DirectoryProbe d = ProbeDirectory("/local_nvme", DirectoryChecks::kIo);
//   if (!d.o_direct.ok()) LogWarning(d.o_direct.message());
//
// Each probe reads the machine as it is now (memory available changes from
// one call to the next); they are thread-safe and allocate little. Only
// ProbeDirectory(kIo) and ProbePinning do IO or lock memory, and they undo
// what they did (a scratch file is removed, locked memory is unlocked and
// unmapped). Nothing here depends on the build's backends except the
// versions, which are 0 where a backend is not built or not present.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "runtime/status.h"

namespace strata {

inline constexpr uint64_t kUnlimitedBytes = ~uint64_t{0};

// How much page-locked memory this process may hold.
enum class MemlockLimit : uint8_t {
  kLimited = 0,    // RLIMIT_MEMLOCK applies: memlock_limit_bytes
  kUnlimited = 1,  // RLIMIT_MEMLOCK is unlimited, or the process has CAP_IPC_LOCK
};

// The memory limit of this process's control groups (a container's
// `--memory`, a Kubernetes limit, systemd's MemoryMax, a batch scheduler's
// job): the cgroup, or the ancestor, with the least room under its limit.
// Its page cache that can be dropped at once (inactive files) counts as room,
// as the kernel reclaims it before it kills.
struct CgroupMemory {
  std::string path;              // the cgroup as /proc/self/cgroup names it ("" when none limits)
  uint64_t limit_bytes = kUnlimitedBytes;  // memory.max (v2) or memory.limit_in_bytes (v1)
  uint64_t used_bytes = 0;       // its usage less inactive page cache
};

struct HostMemory {
  // MemTotal, or a tighter cgroup limit.
  uint64_t total_bytes = 0;
  // MemAvailable (what can be taken without swapping), or the room under a
  // tighter cgroup limit.
  uint64_t available_bytes = 0;
  uint64_t memlock_limit_bytes = 0;  // soft RLIMIT_MEMLOCK (kUnlimitedBytes: unlimited)
  MemlockLimit memlock = MemlockLimit::kLimited;
  CgroupMemory cgroup;  // limit_bytes kUnlimitedBytes: no cgroup limit applies
  // "" or ", limited by cgroup /docker/3f2a (memory limit 8.00 GiB)": what
  // total_bytes and available_bytes stand for, to append to them in messages.
  std::string limit_note() const;
};

// /proc/meminfo, the cgroup limits and getrlimit; Unavailable when
// /proc/meminfo cannot be read.
Result<HostMemory> ProbeHostMemory();

namespace internal {
// The tightest memory limit, from /proc/self/cgroup's text and the cgroup
// filesystem mounted at `cgroup_root` (/sys/fs/cgroup: cgroup v2 there, v1
// in its memory/ folder). A cgroup path that is not under the mount (a
// container shows its own cgroup as the root) is looked up at the root.
CgroupMemory ReadCgroupMemory(std::string_view proc_self_cgroup,
                              const std::string& cgroup_root);
}  // namespace internal

// CPUs this process may run on (sched_getaffinity), and the machine's.
struct CpuInfo {
  uint32_t usable = 0;
  uint32_t online = 0;
  std::string model;  // "model name" of /proc/cpuinfo, "" when absent
};
CpuInfo ProbeCpus();

// Locks `bytes` of fresh anonymous memory and releases it: OK when mlock
// works, the errno otherwise ("mlock 64.00 MiB: EPERM ...").
Status ProbePinning(uint64_t bytes);

enum class DirectoryChecks : uint8_t {
  kSpace = 0,  // statvfs only: cheap, no IO
  kIo = 1,     // also write and read a 4 KiB scratch file with O_DIRECT and with io_uring
};

// What is at a path meant to be a directory.
enum class PathKind : uint8_t {
  kMissing = 0,       // nothing yet: the engine creates it (mkdir -p) on first use
  kDirectory = 1,     // an existing directory
  kNotDirectory = 2,  // something else (a file, a device): unusable as a directory
};
std::string_view PathKindName(PathKind kind);  // "missing", "directory", "not a directory"

struct DirectoryProbe {
  std::string path;         // as given
  std::string probed_path;  // the directory statvfs looked at: `path`, or its
                            // nearest existing ancestor when `path` does not exist yet
  PathKind kind = PathKind::kMissing;
  bool exists = false;  // `path` itself is an existing directory (kind == kDirectory)
  // Whether this user can create files in `path` (kDirectory), or create
  // `path` in probed_path (kMissing): access(W_OK | X_OK), checked with both
  // kinds of checks. FailedPrecondition naming the cause otherwise: "not
  // writable by this user (uid 1000): EACCES", "on a read-only filesystem:
  // EROFS", "exists and is not a directory", "... is not a directory".
  Status writable;
  int writable_errno = 0;   // the errno behind `writable` (EACCES, EPERM, EROFS); 0 when none
  uint64_t free_bytes = 0;  // available to this user (f_bavail)
  uint64_t total_bytes = 0;
  uint64_t device_id = 0;   // st_dev: paths with the same id share their free space
  std::string filesystem;   // "ext4", "xfs", "tmpfs", "overlay", ... ("" when unknown)
  Status space;             // statvfs's outcome
  Status o_direct;          // kIo: a 4 KiB O_DIRECT write and read; Unimplemented with kSpace;
                            // not tried (the `writable` error) where the user cannot write
  Status io_uring;          // kIo: the same through io_uring; Unimplemented with kSpace
};

DirectoryProbe ProbeDirectory(const std::string& path, DirectoryChecks checks);

// Creates `path` and its missing parents (mode 0755, like `mkdir -p`). OK when
// it already is a directory; FailedPrecondition when it exists as something
// else; the errno naming the path otherwise ("create directory /x: EACCES ...",
// with what to do for EACCES, EPERM and EROFS).
Status CreateDirectories(const std::string& path);

// Bytes a file occupies on disk (st_blocks x 512; 0 when it does not exist).
uint64_t FileAllocatedBytes(const std::string& path);

// Versions as the libraries report them (CUDA: 1000 x major + 10 x minor,
// e.g. 13000; NCCL: its NCCL_VERSION_CODE, e.g. 22809); 0 when not built or,
// for the driver, when none is loaded. NCCL is loaded at its first use (this
// probe loads it): nccl_library is the file, nccl_error why it could not be.
struct BackendVersions {
  int cuda_runtime = 0;
  int cuda_driver = 0;
  int nccl = 0;
  std::string nccl_library;
  std::string nccl_error;
};
BackendVersions ProbeBackendVersions();

// "13.0" from 13000; "" for 0.
std::string FormatCudaVersion(int version);
// "2.28.9" from 22809; "" for 0.
std::string FormatNcclVersion(int version);

}  // namespace strata
