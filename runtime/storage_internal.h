// Shared pieces of the storage backends and wrappers. Not a public header.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <mutex>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "runtime/storage.h"

namespace strata::internal {

// Direct-IO alignment used when the device does not report a larger one.
inline constexpr uint64_t kDirectIoAlignment = 4096;

// InvalidArgument naming the first request of the batch with an empty buffer,
// or (alignment_bytes > 1) a misaligned address, offset or length;
// FailedPrecondition for a write to a file opened FileAccess::kReadOnly.
Status ValidateBatch(const FileInfo& info, std::span<IoRequest> requests);

// FailedPrecondition naming `op` and the file when it was opened read-only.
Status CheckWritable(const FileInfo& info, std::string_view op);

// InvalidArgument for options no backend accepts (kCreate with kReadOnly).
Status ValidateOpenOptions(const std::string& path, const FileOptions& options);

// Clears a request's result before it is submitted.
inline void ResetResult(IoRequest& r) {
  r.status = OkStatus();
  r.transferred_bytes = 0;
  r.retries = 0;
}

// Applies InterpretCompletion() to `r`: records its progress, and its status
// once it is finished (done or failed). kResubmit: the caller issues the
// remainder again.
inline CompletionAction ApplyCompletion(IoRequest& r, std::string_view path, int64_t raw_result) {
  CompletionDecision d = InterpretCompletion(r, path, raw_result);
  r.transferred_bytes = d.transferred_bytes;
  r.retries = d.retries;
  if (d.action != CompletionAction::kResubmit) r.status = std::move(d.status);
  return d.action;
}

// Moves up to completed.size() requests from the front of `ready` into
// `completed`, in order; returns how many.
inline size_t PopCompleted(std::deque<IoRequest*>& ready, std::span<IoRequest*> completed) {
  size_t n = 0;
  while (n < completed.size() && !ready.empty()) {
    completed[n++] = ready.front();
    ready.pop_front();
  }
  return n;
}

// An fd opened for block IO, closed by the destructor.
class Fd {
 public:
  Fd() = default;
  explicit Fd(int fd) : fd_(fd) {}
  Fd(Fd&& o) noexcept : fd_(o.release()) {}
  Fd& operator=(Fd&& o) noexcept;
  ~Fd();
  int get() const { return fd_; }
  int release() {
    int fd = fd_;
    fd_ = -1;
    return fd;
  }

 private:
  int fd_ = -1;
};

struct OpenedFd {
  Fd fd;
  IoMode io_mode;
  uint64_t alignment_bytes;  // 1 when options.direct is kOff
};
// Opens `path` read-write (or read-only: options.access) with O_DIRECT as
// options.direct asks, falling back to buffered IO (one warning) where the
// filesystem refuses O_DIRECT under kAuto.
Result<OpenedFd> OpenBlockFd(const std::string& path, const FileOptions& options);

Status SyncFd(int fd, const std::string& path);
Status ResizeFd(int fd, const std::string& path, uint64_t size_bytes);
Result<uint64_t> FdSizeBytes(int fd, const std::string& path);
Status RemovePath(const std::string& path);
// rename(2), then fsync of the directory of `to`.
Status RenamePath(const std::string& from, const std::string& to);
// A FileLock (runtime/file_lock.h) as a StorageLock.
Result<std::unique_ptr<StorageLock>> LockPath(const std::string& path);

// ---- io_uring buffer registration (pure, so tests can drive every case) ----

// The kernel refuses a registered buffer larger than 1 GiB (EFAULT) and more
// than 16384 buffers per ring (EINVAL).
inline constexpr uint64_t kMaxUringBufferBytes = uint64_t{1} << 30;
inline constexpr size_t kMaxUringBuffers = 16384;

// Tests only: the next `count` io_uring submits fail with -`error` without
// reaching the kernel (their SQEs stay queued), as a kernel short of memory
// (EAGAIN) or a broken ring would. count 0 ends it.
void FailUringSubmitsForTest(int error, int count);
// -error while FailUringSubmitsForTest has submits left to fail (one used), else 0.
int UringSubmitFaultForTest();

// A registered range of addresses [begin, end).
struct RegisteredRange {
  uintptr_t begin = 0;
  uintptr_t end = 0;
};

// Cuts each buffer into consecutive pieces of at most `max_piece_bytes`, at
// multiples of max_piece_bytes from the buffer's start (so a request of a
// power-of-two size <= max_piece_bytes, aligned to its size within the buffer,
// lies inside one piece). Empty buffers are dropped. Order is kept.
std::vector<RegisteredRange> SplitForRegistration(std::span<const std::span<std::byte>> buffers,
                                                  uint64_t max_piece_bytes);

// Index of the first range holding all of [p, p + len), or -1 (none does, or
// the request straddles two pieces: it then goes unregistered).
int FindRegisteredRange(std::span<const RegisteredRange> ranges, const std::byte* p, size_t len);

// What was known when io_uring_register_buffers failed.
struct BufferRegistrationRefusal {
  int error = 0;                              // errno (positive)
  size_t buffers = 0;                         // ranges passed to the kernel
  uint64_t total_bytes = 0;                   // their sum
  uint64_t largest_bytes = 0;                 // the largest one
  uint64_t memlock_limit_bytes = UINT64_MAX;  // RLIMIT_MEMLOCK (soft); UINT64_MAX: unlimited
  bool cap_ipc_lock = false;                  // the process may pin memory past that limit
};

// The warning for a refused registration of buffers for `path`, naming the
// real cause and what to do: the 1 GiB cap per buffer or the 16384-buffer cap
// (EFAULT/EINVAL with a range past them), RLIMIT_MEMLOCK with its value
// (ENOMEM while the limit applies), memory the kernel could not pin (ENOMEM
// otherwise, EFAULT, EOPNOTSUPP), or the errno as is. Ends with the effect:
// IO proceeds without fixed buffers.
std::string DescribeBufferRegistrationRefusal(const BufferRegistrationRefusal& refusal,
                                              std::string_view path);

// RLIMIT_MEMLOCK's soft limit (UINT64_MAX when unlimited) and whether the
// process holds CAP_IPC_LOCK in its effective set.
struct MemlockLimits {
  uint64_t limit_bytes = UINT64_MAX;
  bool cap_ipc_lock = false;
};
MemlockLimits CurrentMemlockLimits();

// A thread-safe list of completed requests that Reap() drains.
class CompletionList {
 public:
  void Push(IoRequest* request);
  // Waits until `min` are available (or `stop()` says to give up), then moves up
  // to out.size() into `out`.
  size_t PopAtLeast(std::span<IoRequest*> out, size_t min);
  size_t size() const;

 private:
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::deque<IoRequest*> done_;
};

}  // namespace strata::internal
