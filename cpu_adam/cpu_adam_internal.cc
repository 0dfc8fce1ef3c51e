#include "cpu_adam/cpu_adam_internal.h"

#include <fmt/format.h>

#include <cmath>
#include <string>

namespace strata::cpu_adam_internal {
namespace {

Status CheckFinite(std::string_view op, std::string_view name, double x) {
  if (!std::isfinite(x)) {
    return InvalidArgumentError(fmt::format("{}: {} is {}; pass a finite value", op, name, x));
  }
  return OkStatus();
}

Status CheckBeta(std::string_view op, std::string_view name, double beta) {
  if (!(beta >= 0.0 && beta < 1.0)) {
    return InvalidArgumentError(fmt::format("{}: {} = {} is outside [0, 1)", op, name, beta));
  }
  return OkStatus();
}

Status CheckStep(std::string_view op, int64_t step) {
  if (step < 1) {
    return InvalidArgumentError(
        fmt::format("{}: step = {}; steps count from 1 (increment before the update)", op, step));
  }
  return OkStatus();
}

Status CheckScale(std::string_view op, float grad_scale) {
  return CheckFinite(op, "grad_scale", grad_scale);
}

std::string_view DTypeText(DType t) { return DTypeName(t); }

bool IsFloatDType(DType t) { return t == DType::kF32 || t == DType::kF16 || t == DType::kBF16; }

}  // namespace

Result<AdamCoeffs> DeriveAdam(const AdamHyper& h) {
  constexpr std::string_view op = "adam step";
  STRATA_RETURN_IF_ERROR(CheckFinite(op, "lr", h.lr));
  STRATA_RETURN_IF_ERROR(CheckFinite(op, "eps", h.eps));
  STRATA_RETURN_IF_ERROR(CheckFinite(op, "weight_decay", h.weight_decay));
  STRATA_RETURN_IF_ERROR(CheckBeta(op, "beta1", h.beta1));
  STRATA_RETURN_IF_ERROR(CheckBeta(op, "beta2", h.beta2));
  STRATA_RETURN_IF_ERROR(CheckStep(op, h.step));
  STRATA_RETURN_IF_ERROR(CheckScale(op, h.grad_scale));
  if (!(h.eps > 0.0)) {
    return InvalidArgumentError(fmt::format("{}: eps = {} must be > 0", op, h.eps));
  }
  AdamCoeffs c{};
  c.grad_scale = h.grad_scale;
  c.beta1 = static_cast<float>(h.beta1);
  c.one_minus_beta1 = static_cast<float>(1.0 - h.beta1);
  c.beta2 = static_cast<float>(h.beta2);
  c.one_minus_beta2 = static_cast<float>(1.0 - h.beta2);
  c.eps = static_cast<float>(h.eps);
  const double step = static_cast<double>(h.step);
  if (h.bias_correction == BiasCorrection::kOn) {
    const double bc1 = 1.0 - std::pow(h.beta1, step);
    const double bc2 = 1.0 - std::pow(h.beta2, step);
    // beta in [0, 1) makes both corrections > 0.
    c.neg_step_size = static_cast<float>(-(h.lr / bc1));
    c.bc2_sqrt = static_cast<float>(std::sqrt(bc2));
  } else {
    c.neg_step_size = static_cast<float>(-h.lr);
    c.bc2_sqrt = 1.0f;
  }
  c.decay = Decay::kNone;
  if (h.weight_decay != 0.0) {
    if (h.weight_decay_mode == WeightDecayMode::kL2) {
      c.decay = Decay::kL2;
      c.l2_decay = static_cast<float>(h.weight_decay);
    } else {
      c.decay = Decay::kDecoupled;
      c.decay_factor = static_cast<float>(1.0 - h.lr * h.weight_decay);
    }
  }
  return c;
}

Result<AdagradCoeffs> DeriveAdagrad(const AdagradHyper& h) {
  constexpr std::string_view op = "adagrad step";
  STRATA_RETURN_IF_ERROR(CheckFinite(op, "lr", h.lr));
  STRATA_RETURN_IF_ERROR(CheckFinite(op, "lr_decay", h.lr_decay));
  STRATA_RETURN_IF_ERROR(CheckFinite(op, "eps", h.eps));
  STRATA_RETURN_IF_ERROR(CheckFinite(op, "weight_decay", h.weight_decay));
  STRATA_RETURN_IF_ERROR(CheckStep(op, h.step));
  STRATA_RETURN_IF_ERROR(CheckScale(op, h.grad_scale));
  if (!(h.eps > 0.0)) {
    return InvalidArgumentError(fmt::format("{}: eps = {} must be > 0", op, h.eps));
  }
  const double denom = 1.0 + static_cast<double>(h.step - 1) * h.lr_decay;
  if (!(denom > 0.0)) {
    return InvalidArgumentError(fmt::format(
        "{}: 1 + (step - 1) * lr_decay = {} must be > 0 (lr_decay = {})", op, denom, h.lr_decay));
  }
  AdagradCoeffs c{};
  c.grad_scale = h.grad_scale;
  c.eps = static_cast<float>(h.eps);
  c.neg_clr = static_cast<float>(-(h.lr / denom));
  c.decay = h.weight_decay != 0.0 ? Decay::kL2 : Decay::kNone;
  c.l2_decay = static_cast<float>(h.weight_decay);
  return c;
}

Result<LionCoeffs> DeriveLion(const LionHyper& h) {
  constexpr std::string_view op = "lion step";
  STRATA_RETURN_IF_ERROR(CheckFinite(op, "lr", h.lr));
  STRATA_RETURN_IF_ERROR(CheckFinite(op, "weight_decay", h.weight_decay));
  STRATA_RETURN_IF_ERROR(CheckBeta(op, "beta1", h.beta1));
  STRATA_RETURN_IF_ERROR(CheckBeta(op, "beta2", h.beta2));
  STRATA_RETURN_IF_ERROR(CheckScale(op, h.grad_scale));
  LionCoeffs c{};
  c.grad_scale = h.grad_scale;
  c.beta1 = static_cast<float>(h.beta1);
  c.one_minus_beta1 = static_cast<float>(1.0 - h.beta1);
  c.beta2 = static_cast<float>(h.beta2);
  c.one_minus_beta2 = static_cast<float>(1.0 - h.beta2);
  c.neg_lr = static_cast<float>(-h.lr);
  c.decay = h.weight_decay != 0.0 ? Decay::kDecoupled : Decay::kNone;
  c.decay_factor = static_cast<float>(1.0 - h.lr * h.weight_decay);
  return c;
}

Status CheckGrad(std::string_view op, GradView grad) {
  if (!IsFloatDType(grad.dtype)) {
    return InvalidArgumentError(
        fmt::format("{}: grad dtype {} is not supported; pass fp32, fp16 or bf16 grads", op,
                    DTypeText(grad.dtype)));
  }
  if (grad.elems > 0 && grad.data == nullptr) {
    return InvalidArgumentError(
        fmt::format("{}: grad is null with {} elems; pass the gradient buffer", op, grad.elems));
  }
  return OkStatus();
}

Status CheckSpans(std::string_view op, std::span<const std::span<float>> state,
                  std::span<const char* const> state_names, GradView grad, OutView out) {
  const size_t n = state.empty() ? 0 : state[0].size();
  for (size_t i = 0; i < state.size(); ++i) {
    if (state[i].size() != n) {
      return InvalidArgumentError(fmt::format(
          "{}: {} has {} elems but {} has {}; every state span must have the same length", op,
          state_names[i], state[i].size(), state_names[0], n));
    }
    if (n > 0 && state[i].data() == nullptr) {
      return InvalidArgumentError(
          fmt::format("{}: {} is null with {} elems", op, state_names[i], n));
    }
  }
  STRATA_RETURN_IF_ERROR(CheckGrad(op, grad));
  if (grad.elems != n) {
    return InvalidArgumentError(fmt::format(
        "{}: grad has {} elems but {} has {}; pass the gradient of exactly these params", op,
        grad.elems, state_names[0], n));
  }
  if (!out.is_none()) {
    if (!IsFloatDType(out.dtype)) {
      return InvalidArgumentError(fmt::format(
          "{}: output dtype {} is not supported; write fp32, fp16 or bf16 params, or none", op,
          DTypeText(out.dtype)));
    }
    if (out.elems != n) {
      return InvalidArgumentError(
          fmt::format("{}: output has {} elems but {} has {}; pass an output of the same length or "
                      "OutView::None()",
                      op, out.elems, state_names[0], n));
    }
    if (out.data == nullptr) {
      return InvalidArgumentError(fmt::format("{}: output is null with {} elems", op, out.elems));
    }
  }
  return OkStatus();
}

}  // namespace strata::cpu_adam_internal
