// Shared by the SIMD kernels (cpu_adam.cc, cpu_adam-inl.h) and the scalar
// reference (cpu_adam_reference.cc): the fp32 coefficients an update uses,
// derived once per call from the hyperparameters, and argument checks.
// Not a public header: it is included by cpu_adam sources and tests only.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string_view>

#include "cpu_adam/cpu_adam.h"
#include "runtime/status.h"

namespace strata::cpu_adam_internal {

enum class Decay : uint8_t { kNone = 0, kL2 = 1, kDecoupled = 2 };

// Every per-element scalar, already rounded to fp32 from double.
struct AdamCoeffs {
  float grad_scale;
  float beta1, one_minus_beta1;
  float beta2, one_minus_beta2;
  float eps;
  float bc2_sqrt;       // sqrt(1 - beta2^step), or 1
  float neg_step_size;  // -lr / (1 - beta1^step), or -lr
  float l2_decay;       // weight_decay (kL2)
  float decay_factor;   // 1 - lr * weight_decay (kDecoupled)
  Decay decay;
};

struct AdagradCoeffs {
  float grad_scale;
  float eps;
  float neg_clr;  // -lr / (1 + (step - 1) * lr_decay)
  float l2_decay;
  Decay decay;
};

struct LionCoeffs {
  float grad_scale;
  float beta1, one_minus_beta1;
  float beta2, one_minus_beta2;
  float neg_lr;
  float decay_factor;
  Decay decay;
};

// InvalidArgument naming the bad hyperparameter.
Result<AdamCoeffs> DeriveAdam(const AdamHyper& h);
Result<AdagradCoeffs> DeriveAdagrad(const AdagradHyper& h);
Result<LionCoeffs> DeriveLion(const LionHyper& h);

// Checks that every state span has `n` elements and is non-null when n > 0,
// and that grad/out have matching lengths and supported dtypes. `op` names
// the call in the message ("adam step").
Status CheckSpans(std::string_view op, std::span<const std::span<float>> state,
                  std::span<const char* const> state_names, GradView grad, OutView out);
Status CheckGrad(std::string_view op, GradView grad);

}  // namespace strata::cpu_adam_internal

namespace strata::cpu_adam_internal {

// What a kernel range call gets: base pointers (index 0 of the whole span)
// and dtypes. s0..s2 are the fp32 state arrays in the order of the
// optimizer's state struct (unused ones are null).
enum class OutKind : uint8_t { kNone = 0, kF32 = 1, kF16 = 2, kBF16 = 3 };

struct KernelArgs {
  float* s0 = nullptr;
  float* s1 = nullptr;
  float* s2 = nullptr;
  const void* grad = nullptr;
  DType grad_dtype = DType::kF32;
  void* out = nullptr;
  OutKind out_kind = OutKind::kNone;
};

inline OutKind OutKindOf(const OutView& out) {
  if (out.is_none()) return OutKind::kNone;
  switch (out.dtype) {
    case DType::kF16:
      return OutKind::kF16;
    case DType::kBF16:
      return OutKind::kBF16;
    default:
      return OutKind::kF32;
  }
}

struct StatsPartial {
  double sum = 0.0;  // sum of float(g)^2, unscaled
  uint64_t nonfinite = 0;
};

}  // namespace strata::cpu_adam_internal
