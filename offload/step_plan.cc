#include "offload/step_plan.h"

#include <algorithm>
#include <cmath>

namespace strata::internal {

uint64_t AgreeModulus(uint32_t world) {
  uint32_t bits = 20;  // enough for a step number to wrap rarely; a digest's 1 in 10^6
  while (bits > 1 &&
         static_cast<long double>(std::max<uint32_t>(world, 1)) * std::ldexp(1.0L, 2 * bits) >
             std::ldexp(1.0L, 53)) {
    --bits;
  }
  return uint64_t{1} << bits;
}

Result<StepDecision> DecideStep(LossScaler& scaler, const GradStats& global,
                                double max_grad_norm, int64_t steps_taken) {
  STRATA_ASSIGN_OR_RETURN(LossScaleDecision d, scaler.Update(global.nonfinite_elems));
  StepDecision out;
  out.loss_scale = d.scale_used;
  out.grad_norm = std::sqrt(global.sum_sq) / d.scale_used;
  out.step = steps_taken;
  out.nonfinite_elems = global.nonfinite_elems;
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
                              uint32_t nvme_buffers, PipelineMode mode, bool reverse_nvme) {
  const uint32_t n = static_cast<uint32_t>(nvme_extent.size());
  PipelineSchedule s;
  s.slots = std::max<uint32_t>(1, std::min(slots, std::max<uint32_t>(n, 1)));
  std::vector<uint32_t> nvme;  // the NVMe sub-groups in update order
  for (uint32_t i = 0; i < n; ++i) {
    if (nvme_extent[i] >= 0) nvme.push_back(i);
  }
  if (reverse_nvme) std::reverse(nvme.begin(), nvme.end());
  const bool serial = mode == PipelineMode::kSerial;
  const uint32_t k = std::max<uint32_t>(1, nvme_buffers);
  if (!serial) {
    for (uint32_t q = 0; q < nvme.size() && q < k; ++q) s.initial_reads.push_back(nvme[q]);
  }
  uint32_t q = 0;  // NVMe positions so far
  for (uint32_t p = 0; p < n; ++p) {
    const bool on_nvme = nvme_extent[p] >= 0;
    ScheduledUpdate u{.sub_group = on_nvme ? nvme[q] : p, .slot = p % s.slots};
    if (serial) {
      u.fetch.push_back(p);
    } else if (p == 0) {
      for (uint32_t f = 0; f < s.slots && f < n; ++f) u.fetch.push_back(f);
    } else if (p + s.slots - 1 < n) {
      u.fetch.push_back(p + s.slots - 1);
    }
    if (on_nvme) {
      if (!serial && q + k < nvme.size()) u.read_after.push_back(nvme[q + k]);
      ++q;
    }
    s.updates.push_back(std::move(u));
  }
  return s;
}

}  // namespace strata::internal
