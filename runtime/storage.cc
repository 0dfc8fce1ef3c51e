// Completion interpretation, request validation, fd helpers, backend selection
// and the counting wrapper.
#include "runtime/storage.h"

#include <fcntl.h>
#include <linux/capability.h>
#include <linux/fs.h>
#include <sys/ioctl.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <string>

#include "runtime/file_lock.h"
#include "runtime/log.h"
#include "runtime/storage_internal.h"
#include "runtime/units.h"

namespace strata {
namespace {

std::string CompactBytes(uint64_t bytes) {
  if (bytes != 0 && bytes % kGiB == 0) return std::to_string(bytes / kGiB) + "GiB";
  if (bytes != 0 && bytes % kMiB == 0) return std::to_string(bytes / kMiB) + "MiB";
  if (bytes != 0 && bytes % kKiB == 0) return std::to_string(bytes / kKiB) + "KiB";
  return std::to_string(bytes);
}

std::string_view OpName(IoOp op) { return op == IoOp::kRead ? "read" : "write"; }

}  // namespace

std::string IoObjectName(std::string_view path, uint64_t offset_bytes, uint64_t size_bytes) {
  std::string s(path);
  s += '@';
  s += std::to_string(offset_bytes);
  s += '+';
  s += CompactBytes(size_bytes);
  return s;
}

CompletionDecision InterpretCompletion(const IoRequest& request, std::string_view path,
                                       int64_t raw_result) {
  const uint64_t size = request.buffer.size();
  const uint64_t done = request.transferred_bytes;
  auto object = [&] {
    std::string s(OpName(request.op));
    s += ' ';
    s += IoObjectName(path, request.offset_bytes, size);
    return s;
  };
  if (raw_result < 0) {
    const int err = static_cast<int>(-raw_result);
    if (err == EINTR || err == EAGAIN) {
      if (request.retries + 1 > kMaxIoRetries) {
        return {CompletionAction::kFail, done, request.retries + 1,
                ErrnoError(err, object())
                    .WithContext("gave up after " + std::to_string(kMaxIoRetries) + " retries")};
      }
      return {CompletionAction::kResubmit, done, request.retries + 1, OkStatus()};
    }
    std::string op = object();
    if (done > 0) op += " (after " + std::to_string(done) + " bytes)";
    return {CompletionAction::kFail, done, request.retries, ErrnoError(err, op)};
  }
  const uint64_t moved = static_cast<uint64_t>(raw_result);
  if (moved > size - done) {
    return {CompletionAction::kFail, done, request.retries,
            InternalError(object() + ": the kernel reported " + std::to_string(moved) +
                          " bytes for a remainder of " + std::to_string(size - done))};
  }
  const uint64_t total = done + moved;
  if (total == size) return {CompletionAction::kDone, total, request.retries, OkStatus()};
  if (moved == 0) {
    if (request.op == IoOp::kRead) {
      return {CompletionAction::kFail, total, request.retries,
              OutOfRangeError(object() + ": end of file after " + std::to_string(total) +
                              " bytes; the file is shorter than expected (truncated?)")};
    }
    if (request.retries + 1 > kMaxIoRetries) {
      return {CompletionAction::kFail, total, request.retries + 1,
              UnavailableError(object() + ": no progress after " + std::to_string(kMaxIoRetries) +
                               " zero-byte writes")};
    }
    return {CompletionAction::kResubmit, total, request.retries + 1, OkStatus()};
  }
  // Progress was made: a short transfer is resumed, and only stalls count.
  return {CompletionAction::kResubmit, total, request.retries, OkStatus()};
}

namespace internal {

Status CheckWritable(const FileInfo& info, std::string_view op) {
  if (info.access != FileAccess::kReadOnly) return OkStatus();
  return FailedPreconditionError(std::string(op) +
                                 ": the file was opened read-only (FileAccess::kReadOnly); "
                                 "open it with FileAccess::kReadWrite to change it");
}

Status ValidateOpenOptions(const std::string& path, const FileOptions& options) {
  if (options.create == FileCreate::kCreate && options.access == FileAccess::kReadOnly) {
    return InvalidArgumentError("open " + path +
                                ": FileCreate::kCreate with FileAccess::kReadOnly; a file is "
                                "created to be written: open it with FileAccess::kReadWrite");
  }
  return OkStatus();
}

Status ValidateBatch(const FileInfo& info, std::span<IoRequest> requests) {
  const uint64_t align = info.alignment_bytes;
  for (const IoRequest& r : requests) {
    auto object = [&] {
      return std::string(OpName(r.op)) + " " +
             IoObjectName(info.path, r.offset_bytes, r.buffer.size());
    };
    if (r.op == IoOp::kWrite) STRATA_RETURN_IF_ERROR(CheckWritable(info, object()));
    if (r.buffer.empty() || r.buffer.data() == nullptr) {
      return InvalidArgumentError(object() + ": empty buffer");
    }
    if (align <= 1) continue;
    const std::string hint = " is not a multiple of " + std::to_string(align) +
                             " (O_DIRECT); align buffers, offsets and sizes to " +
                             std::to_string(align) + " or open the file with DirectIo::kOff";
    if (reinterpret_cast<uintptr_t>(r.buffer.data()) % align != 0) {
      char addr[32];
      std::snprintf(addr, sizeof(addr), "%p", static_cast<const void*>(r.buffer.data()));
      return InvalidArgumentError(object() + ": buffer address " + addr + hint);
    }
    if (r.offset_bytes % align != 0) {
      return InvalidArgumentError(object() + ": offset " + std::to_string(r.offset_bytes) + hint);
    }
    if (r.buffer.size() % align != 0) {
      return InvalidArgumentError(object() + ": length " + std::to_string(r.buffer.size()) + hint);
    }
  }
  return OkStatus();
}

std::vector<RegisteredRange> SplitForRegistration(std::span<const std::span<std::byte>> buffers,
                                                  uint64_t max_piece_bytes) {
  std::vector<RegisteredRange> ranges;
  for (std::span<std::byte> b : buffers) {
    const auto begin = reinterpret_cast<uintptr_t>(b.data());
    for (uint64_t off = 0; off < b.size(); off += max_piece_bytes) {
      const uint64_t len = std::min<uint64_t>(max_piece_bytes, b.size() - off);
      ranges.push_back({begin + off, begin + off + len});
    }
  }
  return ranges;
}

namespace {
std::atomic<int> submit_fault_error{0};
std::atomic<int> submit_faults_left{0};
}  // namespace

void FailUringSubmitsForTest(int error, int count) {
  submit_fault_error.store(error);
  submit_faults_left.store(count);
}

int UringSubmitFaultForTest() {
  int left = submit_faults_left.load(std::memory_order_relaxed);
  while (left > 0 && !submit_faults_left.compare_exchange_weak(left, left - 1)) {
  }
  return left > 0 ? -submit_fault_error.load() : 0;
}

int FindRegisteredRange(std::span<const RegisteredRange> ranges, const std::byte* p, size_t len) {
  const auto b = reinterpret_cast<uintptr_t>(p);
  for (size_t i = 0; i < ranges.size(); ++i) {
    if (b >= ranges[i].begin && b + len <= ranges[i].end) return static_cast<int>(i);
  }
  return -1;
}

std::string DescribeBufferRegistrationRefusal(const BufferRegistrationRefusal& r,
                                              std::string_view path) {
  // "register ... for <path>: ENAME (text)", then the cause and what to do.
  std::string m(ErrnoError(r.error, "register " + std::to_string(r.buffers) + " buffers (" +
                                        FormatBytes(r.total_bytes) + ") with io_uring for " +
                                        std::string(path))
                    .message());
  if (r.error == EFAULT && r.largest_bytes > kMaxUringBufferBytes) {
    m += ": a buffer of " + FormatBytes(r.largest_bytes) +
         " is larger than io_uring's limit of 1 GiB per registered buffer; register it in "
         "pieces of at most 1 GiB";
  } else if (r.error == EINVAL && r.buffers > kMaxUringBuffers) {
    m += ": " + std::to_string(r.buffers) + " buffers are more than io_uring's limit of " +
         std::to_string(kMaxUringBuffers) + " per ring; register fewer, larger buffers";
  } else if (r.error == ENOMEM && !r.cap_ipc_lock && r.memlock_limit_bytes != UINT64_MAX) {
    m += ": RLIMIT_MEMLOCK (`ulimit -l`) is " + FormatBytes(r.memlock_limit_bytes) +
         " and io_uring pins " + FormatBytes(r.total_bytes) +
         " here, counted against that limit together with every other ring of this user; "
         "raise the limit (`ulimit -l unlimited`, LimitMEMLOCK=infinity for a systemd service, "
         "`--ulimit memlock=-1` for docker) or run with CAP_IPC_LOCK";
  } else if (r.error == ENOMEM) {
    m += std::string(": the kernel could not pin that much memory although RLIMIT_MEMLOCK does "
                     "not apply (") +
         (r.cap_ipc_lock ? "CAP_IPC_LOCK" : "unlimited") +
         "): the machine is short of memory; lower the host budget or the buffer sizes";
  } else if (r.error == EFAULT || r.error == EOPNOTSUPP) {
    m += ": io_uring could not pin a buffer; registered buffers must be mapped anonymous or "
         "huge-page memory (not a file mapping)";
  }
  return m + "; IO proceeds without fixed buffers (correct, with more kernel work per request)";
}

MemlockLimits CurrentMemlockLimits() {
  MemlockLimits limits;
  rlimit rl{};
  if (getrlimit(RLIMIT_MEMLOCK, &rl) == 0 && rl.rlim_cur != RLIM_INFINITY) {
    limits.limit_bytes = rl.rlim_cur;
  }
  // CapEff in /proc/self/status is the effective capability set, in hex.
  std::ifstream status("/proc/self/status");
  std::string line;
  while (std::getline(status, line)) {
    if (line.rfind("CapEff:", 0) == 0) {
      const uint64_t caps = std::strtoull(line.c_str() + 7, nullptr, 16);
      limits.cap_ipc_lock = ((caps >> CAP_IPC_LOCK) & 1u) != 0;
      break;
    }
  }
  return limits;
}

Fd& Fd::operator=(Fd&& o) noexcept {
  if (this != &o) {
    if (fd_ >= 0) ::close(fd_);
    fd_ = o.release();
  }
  return *this;
}

Fd::~Fd() {
  if (fd_ >= 0) ::close(fd_);
}

namespace {
bool ODirectRefusedByEnv() {
  const char* v = std::getenv("STRATA_O_DIRECT_REFUSE");
  return v != nullptr && v[0] != '\0' && v[0] != '0';
}

// FailedPrecondition unless `mode` is a regular file's or a block device's.
Status CheckFileType(const std::string& path, mode_t mode) {
  if (S_ISREG(mode) || S_ISBLK(mode)) return OkStatus();
  const char* kind = S_ISFIFO(mode)   ? "FIFO"
                     : S_ISSOCK(mode) ? "socket"
                     : S_ISCHR(mode)  ? "character device"
                     : S_ISDIR(mode)  ? "directory"
                                      : "special file";
  return FailedPreconditionError("open " + path + ": not a regular file (a " + kind +
                                 "); Strata reads and writes regular files (or a block "
                                 "device): put the file back, or give another path");
}
}  // namespace

Result<OpenedFd> OpenBlockFd(const std::string& path, const FileOptions& options) {
  STRATA_RETURN_IF_ERROR(ValidateOpenOptions(path, options));
  // Checked before open too: O_DIRECT on a FIFO fails with EINVAL, which
  // would read as the filesystem refusing it.
  if (struct stat pre; ::stat(path.c_str(), &pre) == 0) {
    STRATA_RETURN_IF_ERROR(CheckFileType(path, pre.st_mode));
  }
  // O_NONBLOCK: a FIFO in a file's place (a checkpoint file replaced by
  // `mkfifo`) would block open() until a writer came; with it, open returns
  // and the type check below refuses it. Regular files and block devices
  // ignore the flag; it is cleared all the same.
  int flags =
      (options.access == FileAccess::kReadOnly ? O_RDONLY : O_RDWR) | O_CLOEXEC | O_NONBLOCK;
  if (options.create == FileCreate::kCreate) flags |= O_CREAT;
  const bool want_direct = options.direct != DirectIo::kOff;
  int fd = -1;
  if (want_direct && ODirectRefusedByEnv()) {
    errno = EINVAL;  // what tmpfs and some overlay filesystems answer
  } else {
    fd = ::open(path.c_str(), flags | (want_direct ? O_DIRECT : 0), 0644);
  }
  IoMode mode = want_direct ? IoMode::kDirect : IoMode::kBuffered;
  if (fd < 0 && errno == EINVAL && want_direct) {
    if (options.direct == DirectIo::kRequire) {
      return InvalidArgumentError("open " + path +
                                  ": the filesystem refuses O_DIRECT (EINVAL); put the file on "
                                  "a filesystem that supports it (ext4, xfs) or allow buffered IO");
    }
    fd = ::open(path.c_str(), flags, 0644);
    if (fd >= 0) {
      mode = IoMode::kBuffered;
      WarnOnce("o_direct-refused",
               "O_DIRECT refused by the filesystem of " + path +
                   "; using buffered IO there (slower, goes through the page cache)");
    }
  }
  if (fd < 0) {
    const int err = errno;
    Status s = ErrnoError(err, "open " + path);
    if (err == ENOENT && options.create == FileCreate::kOpenExisting) {
      return NotFoundError(std::string(s.message()) + "; create it or check the path");
    }
    return s;
  }
  OpenedFd out{Fd(fd), mode, want_direct ? kDirectIoAlignment : 1};
  struct stat st;
  if (::fstat(fd, &st) != 0) return ErrnoError(errno, "open " + path + ": fstat");
  STRATA_RETURN_IF_ERROR(CheckFileType(path, st.st_mode));
  if (const int fl = ::fcntl(fd, F_GETFL); fl >= 0) ::fcntl(fd, F_SETFL, fl & ~O_NONBLOCK);
  if (want_direct && S_ISBLK(st.st_mode)) {
    int logical = 0;
    if (::ioctl(fd, BLKSSZGET, &logical) == 0 &&
        static_cast<uint64_t>(logical) > out.alignment_bytes) {
      out.alignment_bytes = static_cast<uint64_t>(logical);
    }
  }
  return out;
}

Status SyncFd(int fd, const std::string& path) {
  if (::fdatasync(fd) != 0) return ErrnoError(errno, "sync " + path);
  return OkStatus();
}

Status ResizeFd(int fd, const std::string& path, uint64_t size_bytes) {
  const std::string what = "resize " + path + " to " + std::to_string(size_bytes) + " bytes";
  struct stat st;
  if (::fstat(fd, &st) != 0) return ErrnoError(errno, what);
  if (size_bytes > static_cast<uint64_t>(st.st_size)) {
    // Reserve the space now: a sparse file would find the disk full only at
    // the write that needs a block (mid-step, after the preflight said it fit).
    int err = 0;
    do {
      err = ::fallocate(fd, 0, 0, static_cast<off_t>(size_bytes)) == 0 ? 0 : errno;
    } while (err == EINTR);
    if (err == 0) return OkStatus();
    // EOPNOTSUPP/ENOSYS: no fallocate on this filesystem; EINVAL: some
    // refuse the call's form. Those grow sparse, as before.
    if (err != EOPNOTSUPP && err != ENOSYS && err != EINVAL) {
      Status s = ErrnoError(err, what + " (reserving the space on the disk)");
      if (err == ENOSPC) {
        return Status(s.code(), std::string(s.message()) +
                                    "; free space on that filesystem or put the file elsewhere");
      }
      return s;
    }
  }
  if (::ftruncate(fd, static_cast<off_t>(size_bytes)) != 0) return ErrnoError(errno, what);
  return OkStatus();
}

Result<uint64_t> FdSizeBytes(int fd, const std::string& path) {
  struct stat st;
  if (::fstat(fd, &st) != 0) return ErrnoError(errno, "stat " + path);
  return static_cast<uint64_t>(st.st_size);
}

Status RemovePath(const std::string& path) {
  if (::unlink(path.c_str()) != 0) return ErrnoError(errno, "remove " + path);
  return OkStatus();
}

Status RenamePath(const std::string& from, const std::string& to) {
  if (::rename(from.c_str(), to.c_str()) != 0) {
    return ErrnoError(errno, "rename " + from + " to " + to);
  }
  const size_t slash = to.find_last_of('/');
  const std::string dir = slash == std::string::npos ? "." : slash == 0 ? "/" : to.substr(0, slash);
  const int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) return ErrnoError(errno, "open directory " + dir + " to sync the rename of " + to);
  Status s;
  if (::fsync(fd) != 0) s = ErrnoError(errno, "fsync directory " + dir + " after renaming " + to);
  ::close(fd);
  return s;
}

namespace {
class FileStorageLock final : public StorageLock {
 public:
  explicit FileStorageLock(FileLock lock) : lock_(std::move(lock)) {}

 private:
  FileLock lock_;
};
}  // namespace

Result<std::unique_ptr<StorageLock>> LockPath(const std::string& path) {
  STRATA_ASSIGN_OR_RETURN(FileLock lock, FileLock::Acquire(path));
  return std::unique_ptr<StorageLock>(std::make_unique<FileStorageLock>(std::move(lock)));
}

void CompletionList::Push(IoRequest* request) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    done_.push_back(request);
  }
  cv_.notify_all();
}

size_t CompletionList::PopAtLeast(std::span<IoRequest*> out, size_t min) {
  std::unique_lock<std::mutex> lock(mu_);
  cv_.wait(lock, [&] { return done_.size() >= min; });
  size_t n = 0;
  while (n < out.size() && !done_.empty()) {
    out[n++] = done_.front();
    done_.pop_front();
  }
  return n;
}

size_t CompletionList::size() const {
  std::lock_guard<std::mutex> lock(mu_);
  return done_.size();
}

}  // namespace internal

namespace {

bool UringRefusedByEnv() {
  const char* v = std::getenv("STRATA_URING_REFUSE");
  return v != nullptr && v[0] != '\0' && v[0] != '0';
}

class CountingFile final : public File {
 public:
  CountingFile(std::unique_ptr<File> base, std::shared_ptr<IoCounters> counters)
      : base_(std::move(base)), counters_(std::move(counters)), info_(base_->info()) {
    info_.backend = "counting(" + info_.backend + ")";
  }
  const FileInfo& info() const override { return info_; }
  Status Submit(std::span<IoRequest> requests) override { return base_->Submit(requests); }
  Result<size_t> Reap(std::span<IoRequest*> completed, size_t min_completions) override {
    STRATA_ASSIGN_OR_RETURN(size_t n, base_->Reap(completed, min_completions));
    for (size_t i = 0; i < n; ++i) {
      const IoRequest& r = *completed[i];
      if (!r.status.ok()) {
        counters_->errors.fetch_add(1, std::memory_order_relaxed);
      } else if (r.op == IoOp::kRead) {
        counters_->reads.fetch_add(1, std::memory_order_relaxed);
        counters_->read_bytes.fetch_add(r.transferred_bytes, std::memory_order_relaxed);
      } else {
        counters_->writes.fetch_add(1, std::memory_order_relaxed);
        counters_->write_bytes.fetch_add(r.transferred_bytes, std::memory_order_relaxed);
      }
    }
    return n;
  }
  size_t InFlight() const override { return base_->InFlight(); }
  Status Sync() override {
    counters_->syncs.fetch_add(1, std::memory_order_relaxed);
    return base_->Sync();
  }
  Status Resize(uint64_t size_bytes) override { return base_->Resize(size_bytes); }
  Result<uint64_t> SizeBytes() override { return base_->SizeBytes(); }
  Status RegisterBuffers(std::span<const std::span<std::byte>> buffers) override {
    Status s = base_->RegisterBuffers(buffers);
    info_.fixed_buffers = base_->info().fixed_buffers;
    info_.fixed_buffer_ranges = base_->info().fixed_buffer_ranges;
    return s;
  }

 private:
  std::unique_ptr<File> base_;
  std::shared_ptr<IoCounters> counters_;
  FileInfo info_;
};

class CountingStorage final : public Storage {
 public:
  CountingStorage(std::unique_ptr<Storage> base, std::shared_ptr<IoCounters> counters)
      : base_(std::move(base)),
        counters_(std::move(counters)),
        name_("counting(" + std::string(base_->name()) + ")") {}
  std::string_view name() const override { return name_; }
  Result<std::unique_ptr<File>> Open(const std::string& path, const FileOptions& options) override {
    STRATA_ASSIGN_OR_RETURN(auto file, base_->Open(path, options));
    counters_->opens.fetch_add(1, std::memory_order_relaxed);
    if (options.access == FileAccess::kReadOnly) {
      counters_->read_only_opens.fetch_add(1, std::memory_order_relaxed);
    }
    return std::unique_ptr<File>(std::make_unique<CountingFile>(std::move(file), counters_));
  }
  Status Remove(const std::string& path) override { return base_->Remove(path); }
  Status Rename(const std::string& from, const std::string& to) override {
    return base_->Rename(from, to);
  }
  Result<std::unique_ptr<StorageLock>> Lock(const std::string& path) override {
    return base_->Lock(path);
  }

 private:
  std::unique_ptr<Storage> base_;
  std::shared_ptr<IoCounters> counters_;
  std::string name_;
};

}  // namespace

std::unique_ptr<Storage> CreateCountingStorage(std::unique_ptr<Storage> base,
                                               std::shared_ptr<IoCounters> counters) {
  return std::make_unique<CountingStorage>(std::move(base), std::move(counters));
}

#if !STRATA_HAVE_URING
Result<std::unique_ptr<Storage>> CreateUringStorage(SqPoll) {
  return UnavailableError(
      "io_uring backend: not built (liburing-dev was missing at configure time)");
}
bool UringAvailable() { return false; }
#endif

Result<std::unique_ptr<Storage>> CreateStorage(const StorageOptions& options) {
  switch (options.backend) {
    case StorageBackend::kMem:
      return CreateMemStorage();
    case StorageBackend::kPosix:
      return CreatePosixStorage();
    case StorageBackend::kUring:
      break;
  }
  Result<std::unique_ptr<Storage>> uring =
      UringRefusedByEnv() ? Result<std::unique_ptr<Storage>>(UnavailableError(
                                "io_uring refused: STRATA_URING_REFUSE is set in the environment"))
                          : CreateUringStorage(options.sqpoll);
  if (uring.ok()) return uring;
  if (options.fallback == UringFallback::kFail) return std::move(uring).status();
  WarnOnce("uring-fallback", std::string(uring.status().message()) +
                                 "; using the posix (pread/pwrite thread pool) backend");
  return CreatePosixStorage();
}

}  // namespace strata
