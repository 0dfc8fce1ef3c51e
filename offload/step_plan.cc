#include "offload/step_plan.h"

#include <algorithm>
#include <cmath>

namespace strata::internal {

Result<StepDecision> DecideStep(LossScaler& scaler, const GradStats& global,
                                double max_grad_norm, int64_t steps_taken) {
  STRATA_ASSIGN_OR_RETURN(LossScaleDecision d, scaler.Update(global.nonfinite_elems));
  StepDecision out;
  out.loss_scale = d.scale_used;
  out.grad_norm = std::sqrt(global.sum_sq) / d.scale_used;
  out.step = steps_taken;
  if (d.skip_step) {
    out.skip = true;
    return out;
  }
  out.step = steps_taken + 1;
  out.grad_scale = GradMultiplier(d.scale_used, global.sum_sq, max_grad_norm);
  out.clip_coef =
      ClipCoefficient(global.sum_sq / (d.scale_used * d.scale_used), max_grad_norm);
  return out;
}

PipelineSchedule MakeSchedule(std::span<const int32_t> nvme_extent, uint32_t slots,
                              uint32_t nvme_buffers, PipelineMode mode) {
  const uint32_t n = static_cast<uint32_t>(nvme_extent.size());
  PipelineSchedule s;
  s.slots = std::max<uint32_t>(1, std::min(slots, std::max<uint32_t>(n, 1)));
  std::vector<uint32_t> nvme;  // extent -> sub-group
  for (uint32_t i = 0; i < n; ++i) {
    if (nvme_extent[i] >= 0) nvme.push_back(i);
  }
  const bool serial = mode == PipelineMode::kSerial;
  const uint32_t k = std::max<uint32_t>(1, nvme_buffers);
  if (!serial) {
    for (uint32_t e = 0; e < nvme.size() && e < k; ++e) s.initial_reads.push_back(nvme[e]);
  }
  for (uint32_t p = 0; p < n; ++p) {
    ScheduledUpdate u{.sub_group = p, .slot = p % s.slots};
    if (serial) {
      u.fetch.push_back(p);
    } else if (p == 0) {
      for (uint32_t q = 0; q < s.slots && q < n; ++q) u.fetch.push_back(q);
    } else if (p + s.slots - 1 < n) {
      u.fetch.push_back(p + s.slots - 1);
    }
    const int32_t e = nvme_extent[p];
    if (!serial && e >= 0 && static_cast<uint32_t>(e) + k < nvme.size()) {
      u.read_after.push_back(nvme[e + k]);
    }
    s.updates.push_back(std::move(u));
  }
  return s;
}

}  // namespace strata::internal
