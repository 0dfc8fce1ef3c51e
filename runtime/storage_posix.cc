// The posix backend: a pread/pwrite thread pool per file. The reference for
// the other backends, and the fallback where io_uring is refused.
#include <unistd.h>

#include <algorithm>
#include <condition_variable>
#include <deque>
#include <mutex>
#include <thread>
#include <vector>

#include "runtime/storage.h"
#include "runtime/storage_internal.h"

namespace strata {
namespace {

constexpr uint32_t kMaxPosixThreads = 16;

class PosixFile final : public File {
 public:
  PosixFile(internal::OpenedFd opened, const std::string& path, const FileOptions& options)
      : fd_(std::move(opened.fd)) {
    const uint32_t queue_depth = options.queue_depth;
    info_.path = path;
    info_.backend = "posix";
    info_.io_mode = opened.io_mode;
    info_.access = options.access;
    info_.alignment_bytes = opened.alignment_bytes;
    info_.queue_depth = std::max<uint32_t>(1, queue_depth);
    const uint32_t threads = std::min(info_.queue_depth, kMaxPosixThreads);
    for (uint32_t i = 0; i < threads; ++i) workers_.emplace_back([this] { WorkerLoop(); });
  }

  ~PosixFile() override {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stopping_ = true;
    }
    cv_.notify_all();
    // Workers finish the queue before they exit, so no request is left behind.
    for (std::thread& t : workers_) t.join();
  }

  const FileInfo& info() const override { return info_; }

  Status Submit(std::span<IoRequest> requests) override {
    STRATA_RETURN_IF_ERROR(internal::ValidateBatch(info_, requests));
    {
      std::lock_guard<std::mutex> lock(mu_);
      for (IoRequest& r : requests) {
        internal::ResetResult(r);
        queue_.push_back(&r);
      }
    }
    in_flight_ += requests.size();
    cv_.notify_all();
    return OkStatus();
  }

  Result<size_t> Reap(std::span<IoRequest*> completed, size_t min_completions) override {
    const size_t min = std::min({min_completions, in_flight_, completed.size()});
    const size_t n = done_.PopAtLeast(completed, min);
    in_flight_ -= n;
    return n;
  }

  size_t InFlight() const override { return in_flight_; }
  Status Sync() override { return internal::SyncFd(fd_.get(), info_.path); }
  Status Resize(uint64_t size_bytes) override {
    STRATA_RETURN_IF_ERROR(internal::CheckWritable(info_, "resize " + info_.path));
    return internal::ResizeFd(fd_.get(), info_.path, size_bytes);
  }
  Result<uint64_t> SizeBytes() override { return internal::FdSizeBytes(fd_.get(), info_.path); }
  Status RegisterBuffers(std::span<const std::span<std::byte>>) override {
    if (in_flight_ != 0) {
      return FailedPreconditionError("register buffers on " + info_.path + ": IO in flight");
    }
    return OkStatus();
  }

 private:
  void WorkerLoop() {
    for (;;) {
      IoRequest* r;
      {
        std::unique_lock<std::mutex> lock(mu_);
        cv_.wait(lock, [&] { return stopping_ || !queue_.empty(); });
        if (queue_.empty()) return;
        r = queue_.front();
        queue_.pop_front();
      }
      Execute(*r);
      done_.Push(r);
    }
  }

  void Execute(IoRequest& r) {
    for (;;) {
      std::byte* p = r.buffer.data() + r.transferred_bytes;
      const size_t len = r.buffer.size() - r.transferred_bytes;
      const off_t off = static_cast<off_t>(r.offset_bytes + r.transferred_bytes);
      ssize_t n =
          r.op == IoOp::kRead ? ::pread(fd_.get(), p, len, off) : ::pwrite(fd_.get(), p, len, off);
      const int64_t raw = n < 0 ? -static_cast<int64_t>(errno) : static_cast<int64_t>(n);
      if (internal::ApplyCompletion(r, info_.path, raw) == CompletionAction::kResubmit) continue;
      return;
    }
  }

  internal::Fd fd_;
  FileInfo info_;
  size_t in_flight_ = 0;  // touched by the driving thread only
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<IoRequest*> queue_;
  bool stopping_ = false;
  internal::CompletionList done_;
  std::vector<std::thread> workers_;
};

class PosixStorage final : public Storage {
 public:
  std::string_view name() const override { return "posix"; }
  Result<std::unique_ptr<File>> Open(const std::string& path, const FileOptions& options) override {
    STRATA_ASSIGN_OR_RETURN(auto opened, internal::OpenBlockFd(path, options));
    return std::unique_ptr<File>(std::make_unique<PosixFile>(std::move(opened), path, options));
  }
  Status Remove(const std::string& path) override { return internal::RemovePath(path); }
  Status Rename(const std::string& from, const std::string& to) override {
    return internal::RenamePath(from, to);
  }
  Result<std::unique_ptr<StorageLock>> Lock(const std::string& path) override {
    return internal::LockPath(path);
  }
};

}  // namespace

std::unique_ptr<Storage> CreatePosixStorage() { return std::make_unique<PosixStorage>(); }

}  // namespace strata
