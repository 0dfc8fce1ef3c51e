#include "runtime/testing/manual_storage.h"

#include <algorithm>
#include <deque>

#include "runtime/storage_internal.h"

namespace strata::testing {

class ManualFile final : public File {
 public:
  ManualFile(ManualStorage* storage, std::unique_ptr<File> base)
      : storage_(storage), base_(std::move(base)) {
    info_ = base_->info();
    info_.backend = "manual";
  }
  ~ManualFile() override { storage_->ForgetFile(this); }

  const FileInfo& info() const override { return info_; }

  Status Submit(std::span<IoRequest> requests) override {
    STRATA_RETURN_IF_ERROR(internal::ValidateBatch(info_, requests));
    for (IoRequest& r : requests) {
      internal::ResetResult(r);
      storage_->AddPending(&r, this, base_.get());
    }
    in_flight_ += requests.size();
    return OkStatus();
  }

  Result<size_t> Reap(std::span<IoRequest*> completed, size_t min_completions) override {
    std::lock_guard<std::mutex> lock(mu_);
    const size_t want = std::min({min_completions, in_flight_, completed.size()});
    if (ready_.size() < want) {
      return FailedPreconditionError("reap " + info_.path + ": waits for " + std::to_string(want) +
                                     " completions but the test completed only " +
                                     std::to_string(ready_.size()) + " (would hang)");
    }
    const size_t n = internal::PopCompleted(ready_, completed);
    in_flight_ -= n;
    return n;
  }

  size_t InFlight() const override { return in_flight_; }
  Status Sync() override { return base_->Sync(); }
  Status Resize(uint64_t size_bytes) override { return base_->Resize(size_bytes); }
  Result<uint64_t> SizeBytes() override { return base_->SizeBytes(); }
  Status RegisterBuffers(std::span<const std::span<std::byte>> buffers) override {
    return base_->RegisterBuffers(buffers);
  }

  void MakeReady(IoRequest* r) {
    std::lock_guard<std::mutex> lock(mu_);
    ready_.push_back(r);
  }

 private:
  ManualStorage* storage_;
  std::unique_ptr<File> base_;
  FileInfo info_;
  std::mutex mu_;
  std::deque<IoRequest*> ready_;
  size_t in_flight_ = 0;
};

ManualStorage::ManualStorage() : base_(CreateMemStorage()) {}

std::unique_ptr<ManualStorage> ManualStorage::Create() {
  return std::unique_ptr<ManualStorage>(new ManualStorage());
}

Result<std::unique_ptr<File>> ManualStorage::Open(const std::string& path,
                                                  const FileOptions& options) {
  STRATA_ASSIGN_OR_RETURN(auto base, base_->Open(path, options));
  return std::unique_ptr<File>(std::make_unique<ManualFile>(this, std::move(base)));
}

std::vector<IoRequest*> ManualStorage::Pending() const {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<IoRequest*> out;
  for (const Entry& e : pending_) out.push_back(e.request);
  return out;
}

void ManualStorage::AddPending(IoRequest* request, ManualFile* file, File* base_file) {
  bool now;
  {
    std::lock_guard<std::mutex> lock(mu_);
    pending_.push_back({request, file, base_file});
    now = auto_complete_ == AutoComplete::kOn;
  }
  if (now) STRATA_CHECK_OK(Complete(request));
}

void ManualStorage::SetAutoComplete(AutoComplete mode) {
  std::lock_guard<std::mutex> lock(mu_);
  auto_complete_ = mode;
}

void ManualStorage::ForgetFile(ManualFile* file) {
  std::lock_guard<std::mutex> lock(mu_);
  std::erase_if(pending_, [&](const Entry& e) { return e.file == file; });
}

Result<ManualStorage::Entry> ManualStorage::Take(IoRequest* request) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = std::find_if(pending_.begin(), pending_.end(),
                         [&](const Entry& e) { return e.request == request; });
  if (it == pending_.end()) return NotFoundError("manual storage: the request is not pending");
  Entry e = *it;
  pending_.erase(it);
  return e;
}

Status ManualStorage::Complete(IoRequest* request) {
  STRATA_ASSIGN_OR_RETURN(Entry e, Take(request));
  // The mem file completes inside Submit; its Reap hands the request back.
  STRATA_RETURN_IF_ERROR(e.base_file->Submit(std::span<IoRequest>(request, 1)));
  IoRequest* done[1];
  STRATA_ASSIGN_OR_RETURN(size_t n, e.base_file->Reap(done, 1));
  if (n != 1) return InternalError("manual storage: the mem file did not complete the request");
  e.file->MakeReady(request);
  return OkStatus();
}

Status ManualStorage::Fail(IoRequest* request, Status status) {
  STRATA_ASSIGN_OR_RETURN(Entry e, Take(request));
  request->status = std::move(status);
  e.file->MakeReady(request);
  return OkStatus();
}

}  // namespace strata::testing
