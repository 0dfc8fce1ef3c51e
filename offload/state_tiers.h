// StateTiers: where each sub-group's fp32 state (master weights and moments,
// one array after the other) lives, behind one interface: device memory
// (partial offload: updated there by the device Adam, DeviceState), pinned
// DRAM, or an NVMe extent that is read into one of `nvme_buffers` pinned
// extent buffers, updated there in place (O_DIRECT reads and writes straight
// from the buffer the optimizer updates: no copy) and written back. Internal
// to offload/.
//
//   tiers.StartRead(i);                        // NVMe read-ahead (any time)
//   STRATA_ASSIGN_OR_RETURN(std::span<float> s, tiers.Acquire(i));  // waits for it
//   ... update s ...
//   tiers.StartWrite(i);                       // write-behind
//   tiers.StartRead(j);                        // j reuses i's buffer: runs after i's write
//   STRATA_RETURN_IF_ERROR(tiers.FinishWrites(on_done));
//
// The k-th NVMe sub-group (in index order) is extent k and uses buffer
// k % nvme_buffers. IO runs on one thread of its own; a read queued after a
// write of the same buffer starts after that write completed, so the
// pipeline may queue the next read of a buffer right after its write.
//
// Resident extents: a buffer whose write completed (FinishWrites, WaitWrite)
// and that nothing changed since holds that extent's committed copy, bitwise;
// reading that extent again is skipped (StartRead does nothing, Acquire
// returns the buffer). Steps alternate the order of their NVMe sub-groups
// (MakeSchedule's reverse_nvme), so each step starts with the extents the
// step before ended with: nvme_buffers fewer extents read per step. A read
// of another extent into the buffer, an Acquire (the caller updates it), a
// Fill and a failed write end it; Read leaves it (and starts it: what it read
// and verified is the committed copy).
//
// Errors: the store's (offload/state_store.h), with the sub-group named.
// Not thread-safe: the engine's driving thread calls it.
#pragma once

#include <functional>
#include <future>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <vector>

#include "cpu_adam/cpu_adam.h"
#include "offload/config.h"
#include "offload/engine_internal.h"
#include "offload/engine_io.h"
#include "offload/layout.h"
#include "offload/placement.h"
#include "offload/state_store.h"
#include "runtime/device.h"
#include "runtime/storage.h"

namespace strata::internal {

struct StateTiersOptions {
  Device* device = nullptr;
  Storage* storage = nullptr;  // null: the tiers open io_uring (POSIX fallback) when needed
  const OffloadConfig* config = nullptr;
  uint32_t rank = 0;
  std::span<const ElemRange> sub_groups;
  const PlacementPlan* plan = nullptr;
  uint32_t arrays = 3;
  uint32_t nvme_buffers = 2;
  TraceContext* trace = nullptr;
  StreamRef device_stream;  // device state: its copies (and the engine's updates of it)
  CpuAdam* cpu = nullptr;   // its threads hash the NVMe payloads (null: the calling thread)
};

struct TierFigures {
  double read_sec = 0, write_sec = 0;  // the requests' times (they overlap)
  double busy_sec = 0;                 // wall time with a request in flight
  uint64_t read_bytes = 0, write_bytes = 0;
  uint64_t resident_bytes = 0;  // reads skipped: the extent was still in its buffer
};

// How StateTiers::Write runs.
struct StateWriteMode {
  bool wait = true;                // an NVMe write is waited for
  bool concurrent_arrays = false;  // the arrays' fills run as ForEachArray runs them
};

class StateTiers {
 public:
  static Result<std::unique_ptr<StateTiers>> Create(const StateTiersOptions& options);
  ~StateTiers();
  StateTiers(const StateTiers&) = delete;
  StateTiers& operator=(const StateTiers&) = delete;

  bool on_nvme(uint32_t i) const { return extent_[i] >= 0; }
  bool on_device(uint32_t i) const { return i < device_count_; }
  uint32_t device_count() const { return device_count_; }
  // A device sub-group's state in device memory (elems x arrays floats).
  float* DeviceState(uint32_t i) const {
    return device_state_.as<float>() + device_offset_[i] * o_.arrays;
  }
  int32_t extent(uint32_t i) const { return extent_[i]; }
  uint32_t nvme_count() const { return static_cast<uint32_t>(nvme_order_.size()); }
  uint32_t nvme_buffers() const { return static_cast<uint32_t>(buffers_.size()); }
  std::span<const uint32_t> nvme_order() const { return nvme_order_; }
  // "sub-group 3 (host)", "sub-group 5 (nvme extent 2)", "sub-group 0 (device)".
  std::string Name(uint32_t i) const;

  // A host sub-group's state (its elems x arrays floats).
  std::span<float> HostState(uint32_t i) const;
  // NVMe: queues the read of i into its buffer, unless one is queued.
  void StartRead(uint32_t i);
  // The state to update: the host arrays, or the NVMe buffer once its read
  // completed (queued now if it was not). Not for device sub-groups.
  Result<std::span<float>> Acquire(uint32_t i);
  // The committed state to read, not change: the host arrays, or the NVMe
  // buffer read and verified unless resident (it stays resident). Not for
  // device sub-groups.
  Result<std::span<const float>> View(uint32_t i);
  // NVMe: queues the write of i's buffer (a new committed generation).
  void StartWrite(uint32_t i);
  // Waits for the write of i queued last (serial mode); OK for a host one.
  Status WaitWrite(uint32_t i);
  // Waits for every write queued and not waited for; `done(i, status)` for each.
  Status FinishWrites(const std::function<void(uint32_t, const Status&)>& done);
  // Waits for reads queued and never acquired (after an error).
  void DrainReads();
  // Sequential access between steps (checkpoints visit the sub-groups in
  // index order): queues the reads of the NVMe sub-groups from i on that
  // have buffers of their own, at most nvme_buffers extents (the buffers of
  // the ones before, which the caller is done with, take the later ones),
  // so Read of each finds it read or in flight. DrainReads afterwards waits
  // for any that no Read took. `reverse`: the same for a walk in reverse
  // index order (the NVMe sub-groups from i down).
  void ReadAhead(uint32_t i, bool reverse = false);

  // Sets i's whole state (not a device one: Write): `fill` writes every one
  // of its elems x arrays floats in place; an NVMe one is then queued for
  // writing (its buffer's previous write is waited for first), unless `fill`
  // failed. FinishWrites or WaitWrite(i) waits.
  Status Fill(uint32_t i, const std::function<Status(std::span<float>)>& fill);

  // State access between steps (checkpoints, tests); a device sub-group's
  // is a copy in order on device_stream, waited for. Read: the whole state,
  // or out.size() elems of one array from elem `begin` (an NVMe extent is
  // read and verified whole into its buffer once, then stays resident).
  // Write: the whole state from `fill(array, begin, piece)` calls that cover
  // every array in order: in place for host and NVMe state (one call per
  // array); a device one through a host buffer of at most `piece_elems`.
  // NVMe: written as a new generation once every fill succeeded; a failed
  // fill leaves the committed one. Host: a failed fill leaves it partly set.
  // Without `mode.wait` an NVMe write is left in flight (write-behind: the
  // next Fill of its buffer or FinishWrites waits for it); with
  // `mode.concurrent_arrays` the fills of host and NVMe state run as
  // ForEachArray runs them. The caller checks the ranges.
  Status Read(uint32_t i, std::span<float> out);
  Status Read(uint32_t i, uint32_t array, uint64_t begin, std::span<float> out);
  using StateFill = std::function<Status(uint32_t array, uint64_t begin, std::span<float> piece)>;
  Status Write(uint32_t i, const StateFill& fill, uint64_t piece_elems, StateWriteMode mode = {});
  // fn(0) ... fn(arrays - 1) on the CPU optimizer's threads, all of them
  // (a checkpoint's arrays, whose files are independent); without those
  // threads, or when not `concurrent`, in order on the calling thread until
  // one fails. The lowest array's error is returned.
  Status ForEachArray(bool concurrent, const std::function<Status(uint32_t array)>& fn) const;
  // Changes one array in place: `update(begin, piece)` sees the committed
  // values and returns whether it changed any. One piece for host and NVMe
  // state; a device one's through a host buffer of at most `piece_elems`.
  // Only what changed is written back (NVMe: a new generation when any
  // piece did); a failed update leaves NVMe state as committed.
  using StateUpdate = std::function<Result<bool>(uint64_t begin, std::span<float> piece)>;
  Status Update(uint32_t i, uint32_t array, const StateUpdate& update, uint64_t piece_elems);

  TierFigures TakeFigures();

 private:
  explicit StateTiers(const StateTiersOptions& options) : o_(options) {}
  Status Init();
  std::span<std::byte> Buffer(uint32_t i) const;
  // The store's parallel_for: the CPU optimizer's threads.
  std::function<void(size_t, const std::function<void(size_t, size_t)>&)> ParallelFor() const;
  uint32_t BufferIndex(uint32_t i) const {
    return static_cast<uint32_t>(extent_[i]) % static_cast<uint32_t>(buffers_.size());
  }
  // i's buffer holds i's committed copy (a read of i queued since cleared it).
  bool Resident(uint32_t i) const {
    return on_nvme(i) && holds_[BufferIndex(i)] == extent_[i];
  }
  // The buffer of i is about to change (a read of i, an update, a fill).
  void Release(uint32_t i) {
    holds_[BufferIndex(i)] = -1;
    writing_[BufferIndex(i)] = -1;
  }
  // The write of i finished with `s`: its buffer holds i if nothing changed it.
  void WriteDone(uint32_t i, const Status& s);
  std::span<float> NvmeState(uint32_t i) const;
  // An NVMe sub-group's committed state in its buffer, read and verified
  // unless resident; it stays resident.
  Result<std::span<float>> Committed(uint32_t i);
  // Through a host buffer of at most `piece_elems`: `each(begin, device
  // state of the piece, host piece)` for the pieces of `array`, in order.
  Status DevicePieces(uint32_t i, uint32_t array, uint64_t piece_elems,
                      const std::function<Status(uint64_t, float*, std::span<float>)>& each);
  // A device sub-group's copy, in order on device_stream, waited for.
  Status CopyDeviceState(void* dst, const void* src, size_t bytes, CopyKind kind);
  // Writes carry the payload's hash (computed by the caller); reads are
  // verified by Acquire.
  std::future<Status> Job(IoOp op, uint32_t i, uint64_t payload_hash = 0);

  StateTiersOptions o_;
  std::vector<int32_t> extent_;      // per sub-group: NVMe extent or -1
  std::vector<uint32_t> nvme_order_;  // extent -> sub-group
  std::vector<PinnedBuffer> host_;    // per sub-group (empty for NVMe and device)
  uint32_t device_count_ = 0;         // the first sub-groups (the plan's step 0)
  DeviceBuffer device_state_;         // theirs, one after the other
  std::vector<uint64_t> device_offset_;  // per device sub-group: elems before it
  std::vector<PinnedBuffer> buffers_;
  std::unique_ptr<Storage> owned_storage_;
  std::vector<std::unique_ptr<StorageLock>> dir_locks_;  // nvme_path, when no state is there
  std::unique_ptr<StateStore> store_;
  std::unique_ptr<IoPump> io_;
  std::vector<std::future<Status>> reads_;   // per extent
  std::vector<std::future<Status>> writes_;  // per extent
  // Per NVMe buffer: the extent whose committed copy it holds (-1: none),
  // and the extent whose write from it is in flight, the buffer unchanged
  // since (-1: none): it holds that extent once the write succeeded.
  std::vector<int32_t> holds_, writing_;
  std::mutex mu_;                            // figures (the IO thread adds)
  TierFigures figures_;
};

}  // namespace strata::internal
