#include "offload/loss_scaler.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>

namespace strata {
namespace {

Status RangeError(std::string_view field, double value, std::string_view allowed) {
  return InvalidArgumentError(
      fmt::format("loss scaler option {} = {}: must be {}", field, value, allowed));
}

double InitialScale(const LossScalerOptions& o) {
  switch (o.mode) {
    case LossScaleMode::kNone:
      return 1.0;
    case LossScaleMode::kStatic:
      return o.static_scale;
    case LossScaleMode::kDynamic:
      return std::ldexp(1.0, o.initial_scale_power);
  }
  return 1.0;
}

}  // namespace

Status ValidateLossScalerOptions(const LossScalerOptions& o) {
  if (o.mode == LossScaleMode::kStatic && !(o.static_scale > 0 && std::isfinite(o.static_scale))) {
    return RangeError("static_scale", o.static_scale, "finite and > 0");
  }
  if (o.mode != LossScaleMode::kDynamic) return OkStatus();
  if (o.initial_scale_power < 0 || o.initial_scale_power > 127) {
    return RangeError("initial_scale_power", o.initial_scale_power, "in [0, 127]");
  }
  if (o.growth_interval < 1) return RangeError("growth_interval", o.growth_interval, ">= 1");
  if (o.hysteresis < 1) return RangeError("hysteresis", o.hysteresis, ">= 1");
  if (!(o.min_scale > 0 && std::isfinite(o.min_scale))) {
    return RangeError("min_scale", o.min_scale, "finite and > 0");
  }
  if (!(o.growth_factor > 1 && std::isfinite(o.growth_factor))) {
    return RangeError("growth_factor", o.growth_factor, "finite and > 1");
  }
  if (!(o.backoff_factor > 0 && o.backoff_factor < 1)) {
    return RangeError("backoff_factor", o.backoff_factor, "in (0, 1)");
  }
  if (InitialScale(o) < o.min_scale) {
    return InvalidArgumentError(fmt::format(
        "loss scaler: initial scale 2^{} = {} is below min_scale {}; raise initial_scale_power "
        "or lower min_scale",
        o.initial_scale_power, InitialScale(o), o.min_scale));
  }
  return OkStatus();
}

LossScaler::LossScaler(const LossScalerOptions& options) : options_(options) {
  state_.scale = InitialScale(options);
  state_.hysteresis_left = options.mode == LossScaleMode::kDynamic ? options.hysteresis : 1;
}

Result<LossScaler> LossScaler::Create(const LossScalerOptions& options) {
  STRATA_RETURN_IF_ERROR(ValidateLossScalerOptions(options));
  return LossScaler(options);
}

Result<LossScaleDecision> LossScaler::Update(uint64_t nonfinite_elems) {
  const bool overflow = nonfinite_elems > 0;
  LossScaleDecision d{
      .skip_step = overflow, .scale_used = state_.scale, .next_scale = state_.scale};
  if (options_.mode != LossScaleMode::kDynamic) {
    ++state_.iteration;
    if (overflow) state_.last_overflow_iteration = state_.iteration - 1;
    return d;
  }
  LossScalerState next = state_;
  if (overflow) {
    if (options_.hysteresis == 1 || next.hysteresis_left == 1) {
      if (next.scale == options_.min_scale &&
          options_.min_scale_overflow == MinScaleOverflow::kError) {
        return FailedPreconditionError(fmt::format(
            "loss scaler at iteration {}: {} non-finite gradient elements while the loss "
            "scale already is min_scale {}; training diverged (lower the learning rate, or "
            "lower fp16.min_loss_scale; the step keeps these gradients: zero them, zero_grad, "
            "and run the backward again)",
            next.iteration, nonfinite_elems, options_.min_scale));
      }
      next.scale = std::max(next.scale * options_.backoff_factor, options_.min_scale);
    } else {
      --next.hysteresis_left;
    }
    next.last_overflow_iteration = next.iteration;
  } else {
    if (options_.consecutive_hysteresis == ConsecutiveHysteresis::kOn) {
      next.hysteresis_left = options_.hysteresis;
    }
    if ((next.iteration - next.last_overflow_iteration) % options_.growth_interval == 0) {
      if (options_.consecutive_hysteresis == ConsecutiveHysteresis::kOff) {
        next.hysteresis_left = options_.hysteresis;
      }
      next.scale *= options_.growth_factor;
    }
  }
  ++next.iteration;
  state_ = next;
  d.next_scale = state_.scale;
  return d;
}

Status LossScaler::Restore(const LossScalerState& state) {
  const uint32_t max_hysteresis =
      options_.mode == LossScaleMode::kDynamic ? options_.hysteresis : 1;
  if (!(state.scale > 0 && std::isfinite(state.scale))) {
    return InvalidArgumentError(
        fmt::format("restore loss scaler: scale {} must be finite and > 0", state.scale));
  }
  if (state.hysteresis_left < 1 || state.hysteresis_left > max_hysteresis) {
    return InvalidArgumentError(
        fmt::format("restore loss scaler: hysteresis_left {} must be in [1, {}]",
                    state.hysteresis_left, max_hysteresis));
  }
  if (state.iteration < 0 || state.last_overflow_iteration < -1 ||
      state.last_overflow_iteration >= state.iteration) {
    return InvalidArgumentError(fmt::format(
        "restore loss scaler: iteration {} must be >= 0 and last_overflow_iteration {} in "
        "[-1, iteration)",
        state.iteration, state.last_overflow_iteration));
  }
  if (options_.mode != LossScaleMode::kDynamic && state.scale != InitialScale(options_)) {
    return InvalidArgumentError(fmt::format(
        "restore loss scaler: scale {} differs from the static scale {}; a static scaler "
        "cannot change its scale",
        state.scale, InitialScale(options_)));
  }
  state_ = state;
  return OkStatus();
}

float ClipCoefficient(double global_sq_norm, double max_grad_norm, double eps) {
  if (!(max_grad_norm > 0)) return 1.0f;
  // torch computes the norm and the coefficient as fp32 tensors.
  const float total = static_cast<float>(std::sqrt(global_sq_norm));
  const float coef = static_cast<float>(max_grad_norm) / (total + static_cast<float>(eps));
  return coef > 1.0f ? 1.0f : coef;
}

float GradMultiplier(double loss_scale, double scaled_sq_norm, double max_grad_norm) {
  const double unscaled_sq = scaled_sq_norm / (loss_scale * loss_scale);
  return static_cast<float>(ClipCoefficient(unscaled_sq, max_grad_norm) / loss_scale);
}

}  // namespace strata
