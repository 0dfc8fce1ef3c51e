// The mem backend: files are byte vectors owned by the storage, so they outlive
// the File handles (a test can close and reopen). Requests complete inside
// Submit(); Reap() hands them back.
#include <algorithm>
#include <cstring>
#include <deque>
#include <map>
#include <mutex>
#include <set>
#include <vector>

#include "runtime/file_lock.h"
#include "runtime/storage.h"
#include "runtime/storage_internal.h"

namespace strata {
namespace {

struct MemData {
  std::mutex mu;
  std::vector<std::byte> bytes;
};

class MemFile final : public File {
 public:
  MemFile(std::shared_ptr<MemData> data, const std::string& path, const FileOptions& options)
      : data_(std::move(data)) {
    info_.path = path;
    info_.backend = "mem";
    info_.io_mode = IoMode::kBuffered;
    info_.access = options.access;
    // Alignment is enforced as for a real file, so tests on mem catch it too.
    info_.alignment_bytes = options.direct == DirectIo::kOff ? 1 : internal::kDirectIoAlignment;
    info_.queue_depth = options.queue_depth;
  }

  const FileInfo& info() const override { return info_; }

  Status Submit(std::span<IoRequest> requests) override {
    STRATA_RETURN_IF_ERROR(internal::ValidateBatch(info_, requests));
    for (IoRequest& r : requests) {
      internal::ResetResult(r);
      Execute(r);
      done_.push_back(&r);
    }
    return OkStatus();
  }

  Result<size_t> Reap(std::span<IoRequest*> completed, size_t) override {
    const size_t n = internal::PopCompleted(done_, completed);
    return n;
  }

  size_t InFlight() const override { return done_.size(); }
  Status Sync() override { return OkStatus(); }
  Status Resize(uint64_t size_bytes) override {
    STRATA_RETURN_IF_ERROR(internal::CheckWritable(info_, "resize " + info_.path));
    std::lock_guard<std::mutex> lock(data_->mu);
    data_->bytes.resize(size_bytes);
    return OkStatus();
  }
  Result<uint64_t> SizeBytes() override {
    std::lock_guard<std::mutex> lock(data_->mu);
    return static_cast<uint64_t>(data_->bytes.size());
  }
  Status RegisterBuffers(std::span<const std::span<std::byte>>) override {
    if (!done_.empty()) {
      return FailedPreconditionError("register buffers on " + info_.path + ": IO in flight");
    }
    return OkStatus();
  }

 private:
  void Execute(IoRequest& r) {
    std::lock_guard<std::mutex> lock(data_->mu);
    std::vector<std::byte>& bytes = data_->bytes;
    for (;;) {
      const uint64_t off = r.offset_bytes + r.transferred_bytes;
      const uint64_t len = r.buffer.size() - r.transferred_bytes;
      std::byte* p = r.buffer.data() + r.transferred_bytes;
      int64_t raw;
      if (r.op == IoOp::kRead) {
        const uint64_t avail = off < bytes.size() ? std::min<uint64_t>(len, bytes.size() - off) : 0;
        if (avail > 0) std::memcpy(p, bytes.data() + off, avail);
        raw = static_cast<int64_t>(avail);
      } else {
        if (off + len > bytes.size()) bytes.resize(off + len);
        std::memcpy(bytes.data() + off, p, len);
        raw = static_cast<int64_t>(len);
      }
      if (internal::ApplyCompletion(r, info_.path, raw) == CompletionAction::kResubmit) continue;
      return;
    }
  }

  std::shared_ptr<MemData> data_;
  FileInfo info_;
  std::deque<IoRequest*> done_;
};

class MemStorage final : public Storage {
 public:
  std::string_view name() const override { return "mem"; }
  Result<std::unique_ptr<File>> Open(const std::string& path, const FileOptions& options) override {
    STRATA_RETURN_IF_ERROR(internal::ValidateOpenOptions(path, options));
    std::lock_guard<std::mutex> lock(mu_);
    auto it = files_.find(path);
    if (it == files_.end()) {
      if (options.create == FileCreate::kOpenExisting) {
        return NotFoundError("open " + path + ": ENOENT (no such file in the mem storage)");
      }
      it = files_.emplace(path, std::make_shared<MemData>()).first;
    }
    return std::unique_ptr<File>(std::make_unique<MemFile>(it->second, path, options));
  }
  Status Remove(const std::string& path) override {
    std::lock_guard<std::mutex> lock(mu_);
    if (files_.erase(path) == 0) return NotFoundError("remove " + path + ": ENOENT (no such file)");
    return OkStatus();
  }
  Status Rename(const std::string& from, const std::string& to) override {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = files_.find(from);
    if (it == files_.end()) {
      return NotFoundError("rename " + from + " to " + to + ": ENOENT (no such file)");
    }
    std::shared_ptr<MemData> data = std::move(it->second);
    files_.erase(it);
    files_[to] = std::move(data);
    return OkStatus();
  }
  Result<std::unique_ptr<StorageLock>> Lock(const std::string& path) override {
    std::lock_guard<std::mutex> lock(locks_->mu);
    if (!locks_->held.insert(path).second) {
      return FailedPreconditionError("lock " + path + std::string(kLockHeldText) +
                                     "this process (mem storage)");
    }
    return std::unique_ptr<StorageLock>(std::make_unique<MemLock>(locks_, path));
  }

 private:
  struct Locks {
    std::mutex mu;
    std::set<std::string> held;
  };
  class MemLock final : public StorageLock {
   public:
    MemLock(std::shared_ptr<Locks> locks, std::string path)
        : locks_(std::move(locks)), path_(std::move(path)) {}
    ~MemLock() override {
      std::lock_guard<std::mutex> lock(locks_->mu);
      locks_->held.erase(path_);
    }

   private:
    std::shared_ptr<Locks> locks_;
    std::string path_;
  };

  std::mutex mu_;
  std::map<std::string, std::shared_ptr<MemData>> files_;
  std::shared_ptr<Locks> locks_ = std::make_shared<Locks>();
};

}  // namespace

std::unique_ptr<Storage> CreateMemStorage() { return std::make_unique<MemStorage>(); }

}  // namespace strata
