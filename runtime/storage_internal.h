// Shared pieces of the storage backends and wrappers. Not a public header.
#pragma once

#include <condition_variable>
#include <deque>
#include <mutex>
#include <span>
#include <string>

#include "runtime/storage.h"

namespace strata::internal {

// Direct-IO alignment used when the device does not report a larger one.
inline constexpr uint64_t kDirectIoAlignment = 4096;

// InvalidArgument naming the first request of the batch with an empty buffer,
// or (alignment_bytes > 1) a misaligned address, offset or length.
Status ValidateBatch(const FileInfo& info, std::span<IoRequest> requests);

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
// Opens `path` read-write with O_DIRECT as options.direct asks, falling back to
// buffered IO (one warning) where the filesystem refuses O_DIRECT under kAuto.
Result<OpenedFd> OpenBlockFd(const std::string& path, const FileOptions& options);

Status SyncFd(int fd, const std::string& path);
Status ResizeFd(int fd, const std::string& path, uint64_t size_bytes);
Result<uint64_t> FdSizeBytes(int fd, const std::string& path);
Status RemovePath(const std::string& path);
// rename(2), then fsync of the directory of `to`.
Status RenamePath(const std::string& from, const std::string& to);
// A FileLock (runtime/file_lock.h) as a StorageLock.
Result<std::unique_ptr<StorageLock>> LockPath(const std::string& path);

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
