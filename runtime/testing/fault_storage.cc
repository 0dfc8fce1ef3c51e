#include "runtime/testing/fault_storage.h"

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <list>
#include <thread>

#include "runtime/storage_internal.h"

namespace strata::testing {
namespace {

// One attempt forwarded to the base file on behalf of a caller's request.
struct Attempt {
  IoRequest inner;
  IoRequest* outer;
  bool torn;  // a torn write: report the whole remainder although only a prefix was written
};

class FaultFile final : public File {
 public:
  FaultFile(FaultStorage* storage, std::unique_ptr<File> base)
      : storage_(storage), base_(std::move(base)), info_(base_->info()) {
    info_.backend = "fault(" + info_.backend + ")";
  }

  ~FaultFile() override {
    // The base file waits for its own requests; attempts must outlive them.
    std::vector<IoRequest*> done(64);
    while (base_->InFlight() > 0) {
      if (!base_->Reap(done, 1).ok()) break;
    }
  }

  const FileInfo& info() const override { return info_; }

  Status Submit(std::span<IoRequest> requests) override {
    STRATA_RETURN_IF_ERROR(internal::ValidateBatch(info_, requests));
    for (IoRequest& r : requests) {
      internal::ResetResult(r);
      ++in_flight_;
      STRATA_RETURN_IF_ERROR(Dispatch(&r));
    }
    return OkStatus();
  }

  Result<size_t> Reap(std::span<IoRequest*> completed, size_t min_completions) override {
    if (in_flight_ > 0 && storage_->Draw(&FaultOptions::queue_fail_one_in)) {
      storage_->mutable_stats().queue_failures.fetch_add(1);
      return ErrnoError(EIO, "reap " + info_.path).WithContext("injected queue failure");
    }
    const size_t want = std::min({min_completions, in_flight_, completed.size()});
    std::vector<IoRequest*> base_done(64);
    for (;;) {
      const bool need = ready_.size() < want;
      if (need && base_->InFlight() == 0) {
        return InternalError("reap " + info_.path + ": a request was lost by the fault wrapper");
      }
      STRATA_ASSIGN_OR_RETURN(size_t n, base_->Reap(base_done, need ? 1 : 0));
      for (size_t i = 0; i < n; ++i) STRATA_RETURN_IF_ERROR(OnAttemptDone(base_done[i]));
      if (!need) break;
    }
    const size_t n = internal::PopCompleted(ready_, completed);
    in_flight_ -= n;
    return n;
  }

  size_t InFlight() const override { return in_flight_; }

  Status Sync() override {
    if (storage_->Draw(&FaultOptions::sync_eio_one_in)) {
      storage_->mutable_stats().injected_errors.fetch_add(1);
      return ErrnoError(EIO, "sync " + info_.path).WithContext("injected");
    }
    STRATA_RETURN_IF_ERROR(base_->Sync());
    storage_->ForgetWrites(info_.path);
    return OkStatus();
  }
  Status Resize(uint64_t size_bytes) override { return base_->Resize(size_bytes); }
  Result<uint64_t> SizeBytes() override { return base_->SizeBytes(); }
  Status RegisterBuffers(std::span<const std::span<std::byte>> buffers) override {
    if (in_flight_ != 0)
      return FailedPreconditionError("register buffers on " + info_.path + ": IO in flight");
    Status s = base_->RegisterBuffers(buffers);
    info_.fixed_buffers = base_->info().fixed_buffers;
    info_.fixed_buffer_ranges = base_->info().fixed_buffer_ranges;
    return s;
  }

 private:
  // Applies a raw result to the caller's request: finished, or go again.
  Status Apply(IoRequest* r, int64_t raw) {
    if (internal::ApplyCompletion(*r, info_.path, raw) == CompletionAction::kResubmit) {
      return Dispatch(r);
    }
    ready_.push_back(r);
    return OkStatus();
  }

  // Starts (or restarts) the remainder of `r`, possibly with a fault.
  Status Dispatch(IoRequest* r) {
    FaultStats& stats = storage_->mutable_stats();
    if (auto gate = storage_->options().before_io) {
      gate(r->op, info_.path, r->buffer.subspan(r->transferred_bytes));
    }
    if (storage_->Draw(&FaultOptions::latency_one_in)) {
      stats.delays.fetch_add(1);
      std::this_thread::sleep_for(storage_->options().latency);
    }
    const bool is_read = r->op == IoOp::kRead;
    if (storage_->Draw(is_read ? &FaultOptions::read_eio_one_in
                               : &FaultOptions::write_eio_one_in)) {
      stats.injected_errors.fetch_add(1);
      return Apply(r, -EIO);
    }
    if (!is_read && storage_->Draw(&FaultOptions::write_enospc_one_in)) {
      stats.injected_errors.fetch_add(1);
      return Apply(r, -ENOSPC);
    }
    if (storage_->Draw(&FaultOptions::eintr_one_in)) {
      stats.eintr.fetch_add(1);
      return Apply(r, -EINTR);
    }
    const uint64_t remaining = r->buffer.size() - r->transferred_bytes;
    const uint64_t align = std::max<uint64_t>(1, info_.alignment_bytes);
    // A prefix that keeps the alignment the base demands; none if too small.
    const uint64_t half = (remaining / 2) / align * align;
    uint64_t len = remaining;
    bool torn = false;
    if (half > 0 && storage_->Draw(&FaultOptions::short_io_one_in)) {
      stats.short_io.fetch_add(1);
      len = half;
    } else if (!is_read && half > 0 && storage_->Draw(&FaultOptions::torn_write_one_in)) {
      stats.torn_writes.fetch_add(1);
      len = half;
      torn = true;
    }
    attempts_.push_back(Attempt{IoRequest{r->op,
                                          r->offset_bytes + r->transferred_bytes,
                                          r->buffer.subspan(r->transferred_bytes, len),
                                          0,
                                          {},
                                          0,
                                          0},
                                r, torn});
    Attempt& a = attempts_.back();
    a.inner.user_data = reinterpret_cast<uintptr_t>(&a);
    Status s = base_->Submit(std::span<IoRequest>(&a.inner, 1));
    if (!s.ok()) {
      attempts_.pop_back();
      return s;
    }
    if (!is_read && storage_->options().drop_unsynced == DropUnsynced::kOn) {
      // A torn write may still reach the drive in full before a crash: the
      // whole remainder is at risk.
      storage_->RecordWrite(info_.path, a.inner.offset_bytes, remaining);
    }
    return OkStatus();
  }

  Status OnAttemptDone(IoRequest* inner) {
    auto* a = reinterpret_cast<Attempt*>(inner->user_data);
    IoRequest* r = a->outer;
    const bool torn = a->torn;
    const uint64_t remaining = r->buffer.size() - r->transferred_bytes;
    Status inner_status = inner->status;
    const uint64_t moved = inner->transferred_bytes;
    if (inner->op == IoOp::kRead) storage_->mutable_stats().read_bytes.fetch_add(moved);
    for (auto it = attempts_.begin(); it != attempts_.end(); ++it) {
      if (&*it == a) {
        attempts_.erase(it);
        break;
      }
    }
    if (!inner_status.ok()) {
      r->transferred_bytes += moved;
      r->status = std::move(inner_status);
      ready_.push_back(r);
      return OkStatus();
    }
    return Apply(r, static_cast<int64_t>(torn ? remaining : moved));
  }

  FaultStorage* storage_;
  std::unique_ptr<File> base_;
  FileInfo info_;
  std::list<Attempt> attempts_;  // stable addresses while the base holds them
  std::deque<IoRequest*> ready_;
  size_t in_flight_ = 0;
};

}  // namespace

FaultStorage::FaultStorage(std::unique_ptr<Storage> base, const FaultOptions& options)
    : base_(std::move(base)),
      name_("fault(" + std::string(base_->name()) + ")"),
      options_(options),
      rng_(options.seed) {}

FaultStorage::~FaultStorage() = default;

std::unique_ptr<FaultStorage> FaultStorage::Create(std::unique_ptr<Storage> base,
                                                   const FaultOptions& options) {
  return std::unique_ptr<FaultStorage>(new FaultStorage(std::move(base), options));
}

Result<std::unique_ptr<File>> FaultStorage::Open(const std::string& path,
                                                 const FileOptions& options) {
  STRATA_ASSIGN_OR_RETURN(auto file, base_->Open(path, options));
  return std::unique_ptr<File>(std::make_unique<FaultFile>(this, std::move(file)));
}

Status FaultStorage::Remove(const std::string& path) {
  ForgetWrites(path);
  return base_->Remove(path);
}

Status FaultStorage::Rename(const std::string& from, const std::string& to) {
  STRATA_RETURN_IF_ERROR(base_->Rename(from, to));
  // What was not synced under the old name is still not synced under the new one.
  std::lock_guard<std::mutex> lock(mu_);
  auto it = unsynced_.find(from);
  if (it != unsynced_.end()) {
    unsynced_[to] = std::move(it->second);
    unsynced_.erase(it);
  } else {
    unsynced_.erase(to);
  }
  return OkStatus();
}

void FaultStorage::SetOptions(const FaultOptions& options) {
  std::lock_guard<std::mutex> lock(mu_);
  options_ = options;
}

FaultOptions FaultStorage::options() const {
  std::lock_guard<std::mutex> lock(mu_);
  return options_;
}

bool FaultStorage::Draw(uint32_t FaultOptions::*kind) {
  std::lock_guard<std::mutex> lock(mu_);
  const uint32_t n = options_.*kind;
  if (n == 0) return false;
  return rng_() % n == 0;
}

void FaultStorage::RecordWrite(const std::string& path, uint64_t offset_bytes,
                               uint64_t size_bytes) {
  std::lock_guard<std::mutex> lock(mu_);
  unsynced_[path].emplace_back(offset_bytes, size_bytes);
}

void FaultStorage::ForgetWrites(const std::string& path) {
  std::lock_guard<std::mutex> lock(mu_);
  unsynced_.erase(path);
}

Status FaultStorage::SimulateCrash() {
  std::map<std::string, std::vector<std::pair<uint64_t, uint64_t>>> lost;
  {
    std::lock_guard<std::mutex> lock(mu_);
    lost.swap(unsynced_);
  }
  for (const auto& [path, ranges] : lost) {
    STRATA_ASSIGN_OR_RETURN(auto file,
                            base_->Open(path, {.direct = DirectIo::kOff, .queue_depth = 1}));
    for (const auto& [offset, size] : ranges) {
      std::vector<std::byte> poison(size, std::byte{0xDB});
      IoRequest req = IoRequest::Write(offset, poison);
      STRATA_RETURN_IF_ERROR(file->Submit(std::span<IoRequest>(&req, 1)));
      IoRequest* done[1];
      STRATA_ASSIGN_OR_RETURN(size_t n, file->Reap(done, 1));
      if (n != 1) return InternalError("simulate crash: " + path + ": write was not reaped");
      STRATA_RETURN_IF_ERROR(req.status);
    }
  }
  return OkStatus();
}

}  // namespace strata::testing
