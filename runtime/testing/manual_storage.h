// ManualStorage: a Storage whose requests wait until the test completes them,
// in any order, so tests can check what a caller does while IO is in flight
// and when completions arrive out of order.
//
//   auto storage = ManualStorage::Create();
//   auto file = storage->Open("x", {.create = FileCreate::kCreate}).value();
//   ... submit requests, then:
//   for (IoRequest* r : storage->Pending()) ASSERT_OK(storage->Complete(r));  // or Fail(r, ...)
//
// Completing performs the IO on an in-memory file (the data is real), then
// lets the request's file reap it. A Reap() that needs more completions than
// the test has made returns FailedPrecondition instead of hanging.
// Thread-safe; meant to be driven from one test thread.
#pragma once

#include <memory>
#include <mutex>
#include <vector>

#include "runtime/storage.h"

namespace strata::testing {

class ManualFile;

// kOn: requests complete as they are submitted (for setup IO); kOff: they wait.
enum class AutoComplete : uint8_t { kOff, kOn };

class ManualStorage final : public Storage {
 public:
  static std::unique_ptr<ManualStorage> Create();

  std::string_view name() const override { return "manual"; }
  Result<std::unique_ptr<File>> Open(const std::string& path, const FileOptions& options) override;
  Status Remove(const std::string& path) override { return base_->Remove(path); }
  Status Rename(const std::string& from, const std::string& to) override {
    return base_->Rename(from, to);
  }
  Result<std::unique_ptr<StorageLock>> Lock(const std::string& path) override {
    return base_->Lock(path);
  }

  void SetAutoComplete(AutoComplete mode);

  // Submitted requests not yet completed, oldest first, over all files.
  std::vector<IoRequest*> Pending() const;
  // Performs the IO and makes the request reapable. NotFound if not pending.
  Status Complete(IoRequest* request);
  // Makes the request reapable with `status` and no IO done.
  Status Fail(IoRequest* request, Status status);

  // Internal, for the files.
  void AddPending(IoRequest* request, ManualFile* file, File* base_file);
  void ForgetFile(ManualFile* file);

 private:
  ManualStorage();
  struct Entry {
    IoRequest* request;
    ManualFile* file;
    File* base_file;
  };
  Result<Entry> Take(IoRequest* request);

  std::unique_ptr<Storage> base_;
  mutable std::mutex mu_;
  std::vector<Entry> pending_;
  AutoComplete auto_complete_ = AutoComplete::kOff;
};

}  // namespace strata::testing
