// Scalar reference: one element at a time, in the written order. Compiled
// with -ffp-contract=off (see CMakeLists.txt) so no multiply-add is fused.
#include "cpu_adam/cpu_adam_reference.h"

#include <array>
#include <cmath>

#include "cpu_adam/cpu_adam_internal.h"
#include "runtime/dtype.h"

namespace strata::reference {
namespace {

using cpu_adam_internal::Decay;

float LoadGrad(const GradView& g, size_t i) {
  switch (g.dtype) {
    case DType::kF16:
      return F16ToF32(static_cast<const uint16_t*>(g.data)[i]);
    case DType::kBF16:
      return BF16ToF32(static_cast<const uint16_t*>(g.data)[i]);
    default:
      return static_cast<const float*>(g.data)[i];
  }
}

void StoreOut(const OutView& o, size_t i, float p) {
  if (o.is_none()) return;
  switch (o.dtype) {
    case DType::kF16:
      static_cast<uint16_t*>(o.data)[i] = F32ToF16(p);
      break;
    case DType::kBF16:
      static_cast<uint16_t*>(o.data)[i] = F32ToBF16(p);
      break;
    default:
      static_cast<float*>(o.data)[i] = p;
      break;
  }
}

float Sign(float c) {
  if (c > 0.0f) return 1.0f;
  if (c < 0.0f) return -1.0f;
  return c;  // +-0 and NaN stay
}

}  // namespace

Status AdamStep(const AdamHyper& hyper, const AdamState& state, GradView grad, OutView out) {
  STRATA_ASSIGN_OR_RETURN(const auto c, cpu_adam_internal::DeriveAdam(hyper));
  const std::array<std::span<float>, 3> spans = {state.params, state.exp_avg, state.exp_avg_sq};
  static constexpr std::array<const char*, 3> kNames = {"params", "exp_avg", "exp_avg_sq"};
  STRATA_RETURN_IF_ERROR(cpu_adam_internal::CheckSpans("adam step", spans, kNames, grad, out));
  for (size_t i = 0; i < state.params.size(); ++i) {
    float g = LoadGrad(grad, i) * c.grad_scale;
    float p = state.params[i];
    if (c.decay == Decay::kL2) g = g + c.l2_decay * p;
    if (c.decay == Decay::kDecoupled) p = p * c.decay_factor;
    const float m = state.exp_avg[i] * c.beta1 + c.one_minus_beta1 * g;
    const float v = state.exp_avg_sq[i] * c.beta2 + (c.one_minus_beta2 * g) * g;
    const float denom = std::sqrt(v) / c.bc2_sqrt + c.eps;
    p = p + c.neg_step_size * (m / denom);
    state.params[i] = p;
    state.exp_avg[i] = m;
    state.exp_avg_sq[i] = v;
    StoreOut(out, i, p);
  }
  return OkStatus();
}

Status AdagradStep(const AdagradHyper& hyper, const AdagradState& state, GradView grad,
                   OutView out) {
  STRATA_ASSIGN_OR_RETURN(const auto c, cpu_adam_internal::DeriveAdagrad(hyper));
  const std::array<std::span<float>, 2> spans = {state.params, state.sum_sq};
  static constexpr std::array<const char*, 2> kNames = {"params", "sum_sq"};
  STRATA_RETURN_IF_ERROR(cpu_adam_internal::CheckSpans("adagrad step", spans, kNames, grad, out));
  for (size_t i = 0; i < state.params.size(); ++i) {
    float g = LoadGrad(grad, i) * c.grad_scale;
    float p = state.params[i];
    if (c.decay == Decay::kL2) g = g + c.l2_decay * p;
    const float s = state.sum_sq[i] + g * g;
    const float std_dev = std::sqrt(s) + c.eps;
    p = p + c.neg_clr * (g / std_dev);
    state.params[i] = p;
    state.sum_sq[i] = s;
    StoreOut(out, i, p);
  }
  return OkStatus();
}

Status LionStep(const LionHyper& hyper, const LionState& state, GradView grad, OutView out) {
  STRATA_ASSIGN_OR_RETURN(const auto c, cpu_adam_internal::DeriveLion(hyper));
  const std::array<std::span<float>, 2> spans = {state.params, state.exp_avg};
  static constexpr std::array<const char*, 2> kNames = {"params", "exp_avg"};
  STRATA_RETURN_IF_ERROR(cpu_adam_internal::CheckSpans("lion step", spans, kNames, grad, out));
  for (size_t i = 0; i < state.params.size(); ++i) {
    const float g = LoadGrad(grad, i) * c.grad_scale;
    float p = state.params[i];
    if (c.decay == Decay::kDecoupled) p = p * c.decay_factor;
    const float m = state.exp_avg[i];
    const float update = Sign(m * c.beta1 + c.one_minus_beta1 * g);
    p = p + c.neg_lr * update;
    state.params[i] = p;
    state.exp_avg[i] = m * c.beta2 + c.one_minus_beta2 * g;
    StoreOut(out, i, p);
  }
  return OkStatus();
}

Result<GradStats> ComputeGradStats(GradView grad, float grad_scale) {
  STRATA_RETURN_IF_ERROR(cpu_adam_internal::CheckGrad("grad stats", grad));
  GradStats st;
  double sum = 0.0;
  for (size_t i = 0; i < grad.elems; ++i) {
    const float g = LoadGrad(grad, i);
    if (!std::isfinite(g)) ++st.nonfinite_elems;
    sum += static_cast<double>(g) * static_cast<double>(g);
  }
  const double s = static_cast<double>(grad_scale);
  st.sum_sq = sum * (s * s);
  return st;
}

}  // namespace strata::reference
