// GradPath: the gradients of this rank's shard, from the trainer's tensors to
// host memory the CPU optimizer reads. Internal to offload/ (docs/offload.md,
// "The gradient path").
//
//   hand-over   Ready(i) once sub-group i's tensors are complete (GradReady
//               during backward), ReduceRest at the step: on the device,
//               the statistics of every piece (sum of squares, non-finite
//               count); with several ranks first pack + reduce-scatter in the
//               wire dtype and the D2H of the rank's block into the host
//               shard buffer. The reduce-scatters are collectives, matched
//               by the order ranks issue them, so every rank issues them in
//               one order, descending sub-group index (a backward's own),
//               whatever order its tensors complete in: a sub-group that
//               completes early waits for the higher ones.
//   step        LocalStats() -> the decision; then per sub-group, in the
//               pipeline: Fetch(i, slot) (one rank: the D2H of the trainer's
//               tensors straight into a ring slot, no device pass) and
//               Wait(i, slot) -> the gradient as the optimizer reads it.
//   accumulate  Accumulate() (ReduceGradients) adds the micro-step into an
//               fp32 host buffer (pageable, allocated on first use); a step
//               after it reads that buffer and takes its statistics there.
//   keep        Keep(i) copies a gradient the failed step did not apply to
//               the host, so RetryStep can finish the step after the trainer
//               zeroed or reused its tensors.
//
// Sources of Wait(i): the ring slot (one rank, streamed), the host shard
// buffer (several ranks), the fp32 accumulation buffer, the kept buffer.
//
// Device sub-groups (partial offload: the first `device_sub_groups`) never
// come down: DeviceGrad(i) is where the device Adam reads them. One rank:
// the trainer's tensors; several: a device buffer the reduced block is
// copied to (D2D instead of D2H); accumulated: an fp32 device buffer
// (kernels::Cast / Accumulate, the same fp32 sums as the host's); kept for a
// retry: a device copy. The host buffers (ring, shard, accumulation, kept)
// cover the other sub-groups only.
//
// The statistics are defined piece by piece, so every backend and path gives
// the same numbers bit for bit: for each sub-group in order, for each of its
// tensor pieces in order, kernels::GradStats (its documented block order)
// over the piece's gradient as the optimizer will read it (the trainer's
// dtype with one rank, the reduced wire dtype with several, fp32 when
// accumulated), the piece sums added in that order in double; then ranks in
// rank order (the all-reduce).
//
// Streams: everything is enqueued on `stream` (the engine's grad stream),
// ordered after the trainer's stream by OrderAfterUser(). Not thread-safe:
// the thread that drives the optimizer calls it.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include "cpu_adam/cpu_adam.h"
#include "offload/layout.h"
#include "offload/optimizer.h"
#include "offload/engine_internal.h"
#include "offload/tensor_map.h"
#include "runtime/comm.h"
#include "runtime/device.h"
#include "runtime/pinned.h"

namespace strata::internal {

struct GradPathOptions {
  Device* device = nullptr;
  Communicator* comm = nullptr;  // world > 1 only
  int rank = 0;
  int world = 1;
  StreamRef stream;       // the engine's grad stream
  StreamRef user_stream;  // the trainer's
  uint32_t device_sub_groups = 0;  // the first ones: updated on the device
  const TensorMap* map = nullptr;
  const std::vector<Param>* params = nullptr;  // read at every use (RebindParam)
  std::span<const ElemRange> sub_groups;
  ElemRange shard;
  DType grad_dtype = DType::kF32;  // the trainer's
  DType wire_dtype = DType::kF32;  // several ranks: the reduce-scatter's dtype
  uint32_t slots = 2;              // ring slots (one rank)
  // Accumulation's fp32 additions run over its threads (element-wise, so
  // the sums are the same); null: on the stream's host thread alone (on
  // CUDA one driver thread, which the GPU's stream waits behind).
  CpuAdam* cpu = nullptr;
  PinnedPool* pool = nullptr;
  TraceContext* trace = nullptr;
};

// Busy time per stage, summed since the last TakeTimes().
// A device sub-group's gradient in device memory: `base` (sub-group
// relative, `dtype`), or with base == nullptr the trainer's grad tensors.
struct DeviceGradView {
  const std::byte* base = nullptr;
  DType dtype = DType::kF32;
};

struct GradPathTimes {
  double d2h = 0, comm = 0, device = 0, host_stats = 0;
  uint64_t d2h_bytes = 0;
};

class GradPath {
 public:
  static Result<std::unique_ptr<GradPath>> Create(const GradPathOptions& options);
  ~GradPath();
  GradPath(const GradPath&) = delete;
  GradPath& operator=(const GradPath&) = delete;

  // The dtype the optimizer reads from a ring slot or the shard buffer.
  DType wire_dtype() const { return wire_; }

  // ---- hand-over ----
  // Work enqueued next waits for what the trainer enqueued so far.
  Status OrderAfterUser();
  bool reduced(uint32_t i) const { return reduced_[i] != 0; }
  uint32_t reduced_count() const { return reduced_count_; }
  // Sub-group i's tensors are complete: reduces it now (one rank), or with
  // several ranks every complete sub-group the descending order reaches.
  Status Ready(uint32_t i);
  // Reduces every sub-group not reduced yet, in descending order.
  Status ReduceRest();
  // ReduceGradients(): completes the micro-step and adds it to the fp32
  // buffer (micro_steps() + 1).
  Status Accumulate();
  uint32_t micro_steps() const { return micro_steps_; }

  // ---- the step ----
  // The shard's statistics (this rank's part, summed in the defined order);
  // waits for the hand-over to finish.
  Result<GradStats> LocalStats();
  // Starts bringing sub-group i's gradient to `slot` (one rank, streamed;
  // a no-op for the other sources). The slot must be free: Wait(j, slot) of
  // its last user returned and the optimizer is done with that gradient.
  // A failed Fetch has waited for the copies it queued: the slot is free.
  Status Fetch(uint32_t i, uint32_t slot);
  // Sub-group i's gradient on the host, as the optimizer reads it.
  Result<GradView> Wait(uint32_t i, uint32_t slot);
  // A device sub-group's gradient for the device Adam (after LocalStats).
  DeviceGradView DeviceGrad(uint32_t i) const;
  // Copies sub-group i's gradient (not applied by a failed step) to the kept
  // buffer; the next step of the same decision reads it from there.
  Status Keep(uint32_t i);
  // After a step that consumed the gradients (or ZeroGrad): nothing handed
  // over, nothing kept.
  void Consume();
  // ZeroGrad: forget the reductions of the current micro-step.
  void ResetMicroStep();

  GradPathTimes TakeTimes();

 private:
  enum class Source : uint8_t { kRing, kShard, kAccum, kKept };
  explicit GradPath(const GradPathOptions& options) : o_(options) {}
  // Accumulate's additions of the micro-step, sub-group by sub-group.
  Status AddMicroStep();
  Status Init();
  Source SourceOf(uint32_t i) const;
  bool on_device(uint32_t i) const { return i < o_.device_sub_groups; }
  // Offset in the shard, and in the host buffers (which start after the
  // device sub-groups).
  uint64_t Rel(uint32_t i) const { return o_.sub_groups[i].begin - o_.shard.begin; }
  uint64_t HostRel(uint32_t i) const { return Rel(i) - device_elems_; }
  Status EnsureDeviceBuffer(DeviceBuffer& buf, uint64_t bytes);
  Status Reduce(uint32_t i);
  // Enqueues the D2H of sub-group i's own pieces (one rank) into `dst`
  // (wire dtype, padding zeroed here).
  Status CopyDown(uint32_t i, std::byte* dst, const char* what);
  Status StatsOfPieces(uint32_t i, const std::byte* base, DType dtype);

  GradPathOptions o_;
  DType wire_ = DType::kF32;
  size_t wire_bytes_ = 4;
  uint64_t max_elems_ = 0;
  uint64_t device_elems_ = 0;  // elements of the device sub-groups
  std::vector<PinnedBuffer> ring_;  // one rank
  std::vector<Event> ring_events_;
  Event user_event_;  // the trainer's stream, recorded at each hand-over
  Event done_event_;  // the grad stream, for the trainer's stream to wait on
  PinnedBuffer shard_buf_;  // several ranks: the reduced shard, wire dtype
  DeviceBuffer bucket_;     // several ranks: pack + reduce-scatter
  // Statistics: one region per piece of device memory, mirrored to pinned
  // memory in one copy.
  DeviceBuffer stats_dev_;
  PinnedBuffer stats_host_;
  std::vector<uint64_t> stats_offset_;  // per piece (flat over sub-groups), bytes
  std::vector<uint64_t> piece_base_;    // per sub-group: index of its first piece
  uint64_t device_stats_bytes_ = 0;     // the device sub-groups' regions (the first)
  DeviceBuffer dev_grad_;   // device sub-groups: reduced (several ranks) or kept (one)
  DeviceBuffer dev_accum_;  // device sub-groups: fp32 accumulation, on first use
  std::vector<float> accum_;            // fp32 accumulation (pageable)
  std::vector<uint8_t> accum_has_;      // per sub-group: holds a micro-step already
  std::vector<std::byte> kept_;         // wire dtype, shard-sized, on demand
  std::vector<uint8_t> kept_has_;
  std::vector<uint8_t> reduced_;
  uint32_t reduced_count_ = 0;
  std::vector<uint8_t> complete_;  // several ranks: Ready() but not reduced yet
  uint32_t next_ = 0;              // several ranks: sub-groups [0, next_) wait their turn
  uint32_t micro_steps_ = 0;
  // An Accumulate that failed after it began adding: some sub-groups hold
  // one micro-step more than the others. Accumulate and LocalStats refuse
  // with it until Consume (ZeroGrad) drops the sum.
  Status torn_sum_;
  GradStats host_stats_;  // accumulation: computed at LocalStats
  StageClock d2h_clock_, comm_clock_, device_clock_;
  double host_stats_sec_ = 0;
  uint64_t d2h_bytes_ = 0;
};

}  // namespace strata::internal
