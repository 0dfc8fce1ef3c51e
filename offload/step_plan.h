// The two pure parts of a step (internal to offload/): the decision taken
// from the global gradient statistics, and the schedule of the sub-group
// pipeline. No device, no IO: unit-tested alone (tests/offload/step_plan_test.cc).
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "cpu_adam/cpu_adam.h"
#include "offload/loss_scaler.h"
#include "offload/optimizer.h"
#include "runtime/status.h"

namespace strata::internal {

// What a step does with its gradients.
struct StepDecision {
  bool skip = false;       // non-finite gradients: no update (the scaler moved)
  int64_t step = 0;        // the step number of the update (skipped: the last one taken)
  double loss_scale = 1;   // the scale the gradients carry
  float grad_scale = 1;    // the optimizer's multiplier: clip coefficient / loss scale
  float clip_coef = 1;     // 1 when not clipped
  double grad_norm = 0;    // L2 norm of the unscaled gradients, before clipping
  uint32_t micro_steps = 1;  // gradients accumulated into the step (for StepStats)
  uint64_t nonfinite_elems = 0;  // NaN or inf gradient elements, over all ranks
};

// From the global statistics of the scaled gradients (summed over ranks):
// advances the scaler (its error at min_scale is returned) and derives the
// clip coefficient and the multiplier, as LossScaler and ClipCoefficient
// define them. `steps_taken` is the optimizer's step count before this step.
Result<StepDecision> DecideStep(LossScaler& scaler, const GradStats& global,
                                double max_grad_norm, int64_t steps_taken);

// The ranks agree on a value x (the step number, a digest of the update
// settings) when sum(x)^2 == world * sum(x^2) over them: exact in doubles
// while world * x^2 < 2^53. x is taken modulo this, the largest power of
// two that keeps it so for `world` ranks (2^20 up to 8192 ranks, 2^18 at
// 65536).
uint64_t AgreeModulus(uint32_t world);

// One position of the pipeline: the sub-group updated there, its ring slot
// (the gradient slot and the param staging slot), the gradients to start
// fetching before waiting for its own (positions, so slot = position %
// slots), and the NVMe reads to queue right after its update (the write of
// its buffer is queued by then; the IO thread runs a read of a buffer after
// the write of that buffer).
struct ScheduledUpdate {
  uint32_t sub_group = 0;
  uint32_t slot = 0;
  std::vector<uint32_t> fetch{};       // positions
  std::vector<uint32_t> read_after{};  // sub-groups
};

struct PipelineSchedule {
  uint32_t slots = 1;
  std::vector<uint32_t> initial_reads;  // sub-groups: queued when the step starts
  std::vector<ScheduledUpdate> updates;
};

// Sub-groups are updated in index order, except that with `reverse_nvme`
// the NVMe ones take the NVMe positions last extent first (the DRAM ones keep
// theirs). Steps alternate the two: the last `nvme_buffers` extents a step
// updates are still in their buffers when the next step starts with them
// (StateTiers skips those reads). kOverlapped: the first `slots` gradients
// are fetched up front and each update frees a slot for the next fetch; the
// first `nvme_buffers` NVMe sub-groups in update order are read when the
// step starts (before the decision: state reads do not depend on gradients)
// and each NVMe update queues the read that reuses its buffer (extent e uses
// buffer e % nvme_buffers, so the one nvme_buffers later in either order).
// kSerial: each fetch at its own position, no read-ahead (Acquire reads on
// demand). `nvme_extent[i]` is sub-group i's extent (-1: DRAM); extents are
// numbered in index order.
PipelineSchedule MakeSchedule(std::span<const int32_t> nvme_extent, uint32_t slots,
                              uint32_t nvme_buffers, PipelineMode mode,
                              bool reverse_nvme = false);

}  // namespace strata::internal
