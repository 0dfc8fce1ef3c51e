// FaultStorage: a forwarding Storage wrapper that injects failures, for tests.
//
// Each operation draws from one seeded generator; a fault of a kind fires on
// about one in N operations of that kind (N = the `*_one_in` option, 0 = off).
// Faults and what the caller sees:
//   read_eio / write_eio / write_enospc  the request fails with that errno
//                          (Internal / ResourceExhausted), nothing is written
//   eintr                  an attempt fails with EINTR; the file retries it
//                          (InterpretCompletion), the caller sees success
//   short_io               an attempt moves only part of the buffer; the file
//                          resumes the remainder, the caller sees success
//   torn_write             the write reports success but only a prefix
//                          reached the file (what a crash mid-write leaves)
//   latency                the operation is delayed by `latency`
//   before_io              (not a fault) called before each attempt is
//                          dispatched: a test's gate that holds some IO back
//   sync_eio               Sync() fails with EIO
//   queue_fail             Reap() of a file with requests in flight fails with
//                          EIO, as when the queue itself broke (an io_uring
//                          wait or submit failed): which requests completed is
//                          unknown; they stay in flight, and the file drains
//                          them when it is closed
// With DropUnsynced::kOn the storage remembers, per path, what was written
// since the last successful Sync of that file; SimulateCrash() overwrites
// those ranges with 0xDB bytes, as if the machine lost power (close the files
// first, then reopen them as a restarted process would).
//
//   auto fault = FaultStorage::Create(CreateMemStorage(), {.seed = 7, .write_eio_one_in = 10});
//   ... use *fault as a Storage ...
//   EXPECT_GT(fault->stats().injected_errors.load(), 0u);
//
// Thread-safe like any Storage; the sequence of faults is deterministic for a
// seed when one thread drives the files.
#pragma once

#include <atomic>
#include <chrono>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <random>
#include <span>
#include <vector>

#include "runtime/storage.h"

namespace strata::testing {

enum class DropUnsynced : uint8_t { kOff, kOn };

struct FaultOptions {
  uint64_t seed = 1;
  uint32_t read_eio_one_in = 0;
  uint32_t write_eio_one_in = 0;
  uint32_t write_enospc_one_in = 0;
  uint32_t eintr_one_in = 0;
  uint32_t short_io_one_in = 0;
  uint32_t torn_write_one_in = 0;
  uint32_t latency_one_in = 0;
  std::chrono::microseconds latency{100};
  uint32_t sync_eio_one_in = 0;
  uint32_t queue_fail_one_in = 0;
  DropUnsynced drop_unsynced = DropUnsynced::kOff;
  // On the thread that submits the request, before the faults are drawn;
  // `buffer`: what this attempt reads into or writes from.
  std::function<void(IoOp op, const std::string& path, std::span<const std::byte> buffer)>
      before_io{};
};

struct FaultStats {
  std::atomic<uint64_t> injected_errors{0};  // EIO/ENOSPC on reads, writes, syncs
  std::atomic<uint64_t> eintr{0};
  std::atomic<uint64_t> short_io{0};
  std::atomic<uint64_t> torn_writes{0};
  std::atomic<uint64_t> delays{0};
  std::atomic<uint64_t> queue_failures{0};
  std::atomic<uint64_t> read_bytes{0};  // what reads moved, faulted or not
};

class FaultStorage final : public Storage {
 public:
  static std::unique_ptr<FaultStorage> Create(std::unique_ptr<Storage> base,
                                              const FaultOptions& options);
  ~FaultStorage() override;

  std::string_view name() const override { return name_; }
  Result<std::unique_ptr<File>> Open(const std::string& path, const FileOptions& options) override;
  Status Remove(const std::string& path) override;
  Status Rename(const std::string& from, const std::string& to) override;
  Result<std::unique_ptr<StorageLock>> Lock(const std::string& path) override {
    return base_->Lock(path);
  }

  // Replaces the fault rates (the generator keeps its state): e.g. all zero to
  // read back what survived.
  void SetOptions(const FaultOptions& options);
  const FaultStats& stats() const { return stats_; }

  // Overwrites every range written and not synced with 0xDB, through the base
  // storage, and forgets them. Close the files first.
  Status SimulateCrash();

  // Internal, for the files: draws "does a fault that fires one in `n` fire now".
  bool Draw(uint32_t FaultOptions::*kind);
  FaultOptions options() const;
  FaultStats& mutable_stats() { return stats_; }
  void RecordWrite(const std::string& path, uint64_t offset_bytes, uint64_t size_bytes);
  void ForgetWrites(const std::string& path);
  Storage& base() { return *base_; }

 private:
  FaultStorage(std::unique_ptr<Storage> base, const FaultOptions& options);

  std::unique_ptr<Storage> base_;
  std::string name_;
  mutable std::mutex mu_;
  FaultOptions options_;
  std::mt19937_64 rng_;
  FaultStats stats_;
  std::map<std::string, std::vector<std::pair<uint64_t, uint64_t>>> unsynced_;
};

}  // namespace strata::testing
