// The io_uring backend: one ring per file, the fd in the ring's registered file
// table, caller buffers registered for READ_FIXED/WRITE_FIXED (in pieces of at
// most 1 GiB, the kernel's cap per buffer), one io_uring_submit per batch,
// never more SQEs in flight than the ring holds.
#include <liburing.h>
#include <sys/uio.h>

#include <algorithm>
#include <chrono>
#include <deque>
#include <thread>
#include <vector>

#include "runtime/log.h"
#include "runtime/storage.h"
#include "runtime/storage_internal.h"

namespace strata {
namespace {

constexpr unsigned kSqPollIdleMs = 50;
// The most one SQE moves: its length field has 32 bits.
constexpr uint64_t kMaxSqeBytes = internal::kMaxUringBufferBytes;
// How often (1 ms apart) a submit the kernel refuses as busy is retried when
// nothing is in flight to wait for instead.
constexpr int kBusySubmitAttempts = 1000;

class UringFile final : public File {
 public:
  static Result<std::unique_ptr<File>> Create(internal::OpenedFd opened, const std::string& path,
                                              const FileOptions& options, SqPoll sqpoll) {
    std::unique_ptr<UringFile> f(new UringFile(std::move(opened), path, options));
    STRATA_RETURN_IF_ERROR(f->Init(sqpoll));
    return std::unique_ptr<File>(std::move(f));
  }

  ~UringFile() override {
    if (!ring_ok_) return;
    // Requests the kernel took write into caller memory: wait for them. SQEs
    // it never took (unsubmitted_) go with the ring, unread.
    while (sqes_in_flight_ > 0) {
      io_uring_cqe* cqe = nullptr;
      int rc;
      do {
        rc = io_uring_wait_cqe(&ring_, &cqe);
      } while (rc == -EINTR);
      if (rc != 0) break;
      io_uring_cqe_seen(&ring_, cqe);
      --sqes_in_flight_;
    }
    io_uring_queue_exit(&ring_);
  }

  const FileInfo& info() const override { return info_; }

  Status Submit(std::span<IoRequest> requests) override {
    STRATA_RETURN_IF_ERROR(internal::ValidateBatch(info_, requests));
    if (!broken_.ok()) {
      return FailedPreconditionError("submit to " + info_.path +
                                     ": this file's io_uring queue stopped at an earlier error (" +
                                     std::string(broken_.message()) +
                                     "), which its requests then in flight failed with; close and "
                                     "reopen the file");
    }
    for (IoRequest& r : requests) {
      internal::ResetResult(r);
      pending_.push_back(&r);
    }
    in_flight_ += requests.size();
    return Pump();
  }

  Result<size_t> Reap(std::span<IoRequest*> completed, size_t min_completions) override {
    const size_t want = std::min({min_completions, in_flight_, completed.size()});
    for (;;) {
      STRATA_RETURN_IF_ERROR(DrainCqes(ready_.size() < want ? Block::kWaitForOne : Block::kNo));
      STRATA_RETURN_IF_ERROR(Pump());
      if (ready_.size() >= want) break;
    }
    const size_t n = internal::PopCompleted(ready_, completed);
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

  Status RegisterBuffers(std::span<const std::span<std::byte>> buffers) override {
    if (in_flight_ != 0) {
      return FailedPreconditionError("register buffers on " + info_.path + ": " +
                                     std::to_string(in_flight_) +
                                     " requests in flight; reap them first");
    }
    if (!registered_.empty()) {
      io_uring_unregister_buffers(&ring_);
      registered_.clear();
      info_.fixed_buffers = false;
      info_.fixed_buffer_ranges = 0;
    }
    if (buffers.empty()) return OkStatus();
    std::vector<internal::RegisteredRange> ranges =
        internal::SplitForRegistration(buffers, internal::kMaxUringBufferBytes);
    if (ranges.empty()) return OkStatus();
    std::vector<iovec> iov;
    iov.reserve(ranges.size());
    internal::BufferRegistrationRefusal refusal{.buffers = ranges.size()};
    for (const internal::RegisteredRange& r : ranges) {
      const uint64_t len = r.end - r.begin;
      iov.push_back({reinterpret_cast<void*>(r.begin), len});
      refusal.total_bytes += len;
      refusal.largest_bytes = std::max(refusal.largest_bytes, len);
    }
    const int rc = io_uring_register_buffers(&ring_, iov.data(), static_cast<unsigned>(iov.size()));
    if (rc < 0) {
      refusal.error = -rc;
      const internal::MemlockLimits limits = internal::CurrentMemlockLimits();
      refusal.memlock_limit_bytes = limits.limit_bytes;
      refusal.cap_ipc_lock = limits.cap_ipc_lock;
      WarnOnce("uring-register-buffers",
               internal::DescribeBufferRegistrationRefusal(refusal, info_.path));
      return OkStatus();
    }
    registered_ = std::move(ranges);
    info_.fixed_buffer_ranges = static_cast<uint32_t>(registered_.size());
    info_.fixed_buffers = true;
    return OkStatus();
  }

 private:
  UringFile(internal::OpenedFd opened, const std::string& path, const FileOptions& options)
      : fd_(std::move(opened.fd)) {
    info_.path = path;
    info_.backend = "uring";
    info_.io_mode = opened.io_mode;
    info_.access = options.access;
    info_.alignment_bytes = opened.alignment_bytes;
    info_.queue_depth = std::clamp<uint32_t>(options.queue_depth, 1, 4096);
  }

  Status Init(SqPoll sqpoll) {
    io_uring_params params{};
    if (sqpoll == SqPoll::kOn) {
      params.flags |= IORING_SETUP_SQPOLL;
      params.sq_thread_idle = kSqPollIdleMs;
    }
    // Completions are picked up when this thread next enters the kernel (it
    // always does, to reap) instead of interrupting it: fewer IPIs and
    // context switches on busy cores. Kernels before 5.19 refuse the flag.
    io_uring_params coop = params;
    coop.flags |= IORING_SETUP_COOP_TASKRUN;
    int rc = io_uring_queue_init_params(info_.queue_depth, &ring_, &coop);
    if (rc == -EINVAL) rc = io_uring_queue_init_params(info_.queue_depth, &ring_, &params);
    if (rc < 0) {
      return ErrnoError(-rc, "io_uring_queue_init (depth " + std::to_string(info_.queue_depth) +
                                 ") for " + info_.path);
    }
    ring_ok_ = true;
    const int fd = fd_.get();
    fixed_file_ = io_uring_register_files(&ring_, &fd, 1) == 0;
    info_.fixed_file = fixed_file_;
    return OkStatus();
  }

  // Moves pending requests into SQEs while the ring has room, then submits
  // the SQEs the kernel has not taken. Requests it cannot start fail with the
  // submit's error (in their status); the file then refuses new batches.
  Status Pump() {
    if (!broken_.ok()) {
      // A resumed short transfer after the failure: another submit would
      // also start the SQEs the failed one left in the ring.
      FailUnstarted();
      return OkStatus();
    }
    while (!pending_.empty() && sqes_in_flight_ + unsubmitted_.size() < info_.queue_depth) {
      io_uring_sqe* sqe = io_uring_get_sqe(&ring_);
      if (sqe == nullptr) break;
      IoRequest* r = pending_.front();
      pending_.pop_front();
      std::byte* p = r->buffer.data() + r->transferred_bytes;
      // An SQE's length is 32 bits, and the kernel moves less than 2 GiB per
      // call anyway: larger requests go in pieces (a short transfer resumes).
      const auto len = static_cast<unsigned>(
          std::min<uint64_t>(r->buffer.size() - r->transferred_bytes, kMaxSqeBytes));
      const uint64_t off = r->offset_bytes + r->transferred_bytes;
      const int fd = fixed_file_ ? 0 : fd_.get();
      const int idx = internal::FindRegisteredRange(registered_, p, len);
      if (r->op == IoOp::kRead) {
        if (idx >= 0)
          io_uring_prep_read_fixed(sqe, fd, p, len, off, idx);
        else
          io_uring_prep_read(sqe, fd, p, len, off);
      } else {
        if (idx >= 0)
          io_uring_prep_write_fixed(sqe, fd, p, len, off, idx);
        else
          io_uring_prep_write(sqe, fd, p, len, off);
      }
      if (fixed_file_) sqe->flags |= IOSQE_FIXED_FILE;
      io_uring_sqe_set_data(sqe, r);
      unsubmitted_.push_back(r);
    }
    return SubmitSqes();
  }

  // io_uring_submit until the kernel has taken some SQEs or nothing is left.
  // It takes them in order; what it leaves goes at the next Pump. With none
  // in flight, a busy kernel (EAGAIN: no memory for requests; EBUSY: full
  // completion backlog) is waited for a while; any other error fails every
  // request not yet in the kernel.
  Status SubmitSqes() {
    for (int attempt = 0; !unsubmitted_.empty(); ++attempt) {
      int rc;
      do {
        rc = internal::UringSubmitFaultForTest();
        if (rc == 0) rc = io_uring_submit(&ring_);
      } while (rc == -EINTR);
      if (rc > 0) {
        const size_t taken = std::min<size_t>(static_cast<size_t>(rc), unsubmitted_.size());
        unsubmitted_.erase(unsubmitted_.begin(), unsubmitted_.begin() + taken);
        sqes_in_flight_ += static_cast<unsigned>(taken);
        return OkStatus();
      }
      const bool busy = rc == 0 || rc == -EAGAIN || rc == -EBUSY;
      if (busy && sqes_in_flight_ > 0) return OkStatus();  // again after a completion
      if (busy && attempt < kBusySubmitAttempts) {
        std::this_thread::sleep_for(std::chrono::milliseconds(1));
        continue;
      }
      broken_ = ErrnoError(rc < 0 ? -rc : EAGAIN, "io_uring_submit for " + info_.path);
      FailUnstarted();
    }
    return OkStatus();
  }

  // After a failed submit: the requests not in the kernel complete with its
  // error (their SQEs stay in the ring, never submitted).
  void FailUnstarted() {
    for (std::deque<IoRequest*>* q : {&unsubmitted_, &pending_}) {
      for (IoRequest* r : *q) {
        r->status = broken_;
        ready_.push_back(r);
      }
      q->clear();
    }
  }

  enum class Block : uint8_t { kNo, kWaitForOne };
  // Handles every available CQE; with kWaitForOne, blocks for at least one first.
  Status DrainCqes(Block block) {
    if (block == Block::kWaitForOne && sqes_in_flight_ > 0) {
      io_uring_cqe* cqe = nullptr;
      int rc;
      do {
        rc = io_uring_wait_cqe(&ring_, &cqe);
      } while (rc == -EINTR);
      if (rc < 0) return ErrnoError(-rc, "io_uring_wait_cqe for " + info_.path);
    }
    io_uring_cqe* cqes[64];
    for (;;) {
      const unsigned n = io_uring_peek_batch_cqe(&ring_, cqes, 64);
      if (n == 0) return OkStatus();
      for (unsigned i = 0; i < n; ++i) {
        auto* r = static_cast<IoRequest*>(io_uring_cqe_get_data(cqes[i]));
        if (internal::ApplyCompletion(*r, info_.path, cqes[i]->res) ==
            CompletionAction::kResubmit) {
          pending_.push_front(r);
        } else {
          ready_.push_back(r);
        }
      }
      io_uring_cq_advance(&ring_, n);
      sqes_in_flight_ -= n;
    }
  }

  internal::Fd fd_;
  FileInfo info_;
  io_uring ring_{};
  bool ring_ok_ = false;
  bool fixed_file_ = false;
  std::vector<internal::RegisteredRange> registered_;  // index = buffer index in the ring
  std::deque<IoRequest*> pending_;                     // submitted, not yet in an SQE
  std::deque<IoRequest*> unsubmitted_;                 // in an SQE the kernel has not taken
  std::deque<IoRequest*> ready_;                       // complete, not yet reaped
  size_t in_flight_ = 0;                               // submitted and not reaped
  unsigned sqes_in_flight_ = 0;                        // taken by the kernel, CQE not seen
  Status broken_;                                      // a failed submit; refuses new batches
};

class UringStorage final : public Storage {
 public:
  explicit UringStorage(SqPoll sqpoll) : sqpoll_(sqpoll) {}
  std::string_view name() const override { return "uring"; }
  Result<std::unique_ptr<File>> Open(const std::string& path, const FileOptions& options) override {
    STRATA_ASSIGN_OR_RETURN(auto opened, internal::OpenBlockFd(path, options));
    return UringFile::Create(std::move(opened), path, options, sqpoll_);
  }
  Status Remove(const std::string& path) override { return internal::RemovePath(path); }
  Status Rename(const std::string& from, const std::string& to) override {
    return internal::RenamePath(from, to);
  }
  Result<std::unique_ptr<StorageLock>> Lock(const std::string& path) override {
    return internal::LockPath(path);
  }

 private:
  SqPoll sqpoll_;
};

}  // namespace

bool UringAvailable() {
  io_uring ring;
  if (io_uring_queue_init(4, &ring, 0) < 0) return false;
  io_uring_queue_exit(&ring);
  return true;
}

Result<std::unique_ptr<Storage>> CreateUringStorage(SqPoll sqpoll) {
  io_uring ring;
  int rc = io_uring_queue_init(4, &ring, 0);
  if (rc < 0) {
    return Status(
        StatusCode::kUnavailable,
        std::string(
            ErrnoError(-rc, "io_uring refused by the kernel: io_uring_queue_init").message()));
  }
  io_uring_queue_exit(&ring);
  return std::unique_ptr<Storage>(std::make_unique<UringStorage>(sqpoll));
}

}  // namespace strata
