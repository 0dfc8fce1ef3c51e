// cpu_adam: the fused SIMD CPU optimizers that update the fp32 master state
// kept in host memory (Adam, AdamW, Adagrad, Lion), and the one-pass gradient
// statistic (squared L2 norm + non-finite count) used for clipping and the fp16
// loss scaler.
//
// Each update is one pass over the elements: read the gradient (fp32, fp16 or
// bf16), multiply it by one scalar (1/loss_scale x clip coefficient), update
// the fp32 master weight and the optimizer state in place, and write the new
// param as fp32, fp16 or bf16 into a separate output buffer (or not at all).
// The pass is bound by memory bandwidth, not arithmetic.
//
//   STRATA_ASSIGN_OR_RETURN(auto opt, CpuAdam::Create({.threads = 0}));  // all cores
//   STRATA_ASSIGN_OR_RETURN(GradStats st, opt->ComputeGradStats(GradView::BF16(g), 1.0f / scale));
//   if (st.nonfinite_elems > 0) return SkipStep();       // overflow: lower the loss scale
//   AdamHyper h{.lr = 1e-4, .weight_decay = 0.01, .step = step,
//               .grad_scale = static_cast<float>(clip_coef / scale)};
//   STRATA_RETURN_IF_ERROR(opt->Step(h, AdamState{master, exp_avg, exp_avg_sq},
//                                    GradView::BF16(g), OutView::BF16(params16)));
//
// Formulas (PyTorch's torch.optim.AdamW / Adam, non-`foreach`-specific order of
// operations, `maximize=False`, `amsgrad=False`). All element arithmetic is
// fp32, with no fused multiply-add; scalars derived from the step number are
// computed once per call in double, then rounded to fp32:
//
//   g   = float(grad) * grad_scale
//   Adam (L2):      g = g + weight_decay * p             (only if weight_decay != 0)
//   AdamW (decoupled): p = p * (1 - lr * weight_decay)   (only if weight_decay != 0)
//   m   = m * beta1 + (1 - beta1) * g
//   v   = v * beta2 + ((1 - beta2) * g) * g
//   bias correction on:  step_size = lr / (1 - beta1^step), c2 = sqrt(1 - beta2^step)
//   bias correction off: step_size = lr,                    c2 = 1
//   p   = p + (-step_size) * (m / (sqrt(v) / c2 + eps))
//   out = convert(p)
//
//   Adagrad (torch.optim.Adagrad, L2 decay):
//   g = float(grad) * grad_scale;  g = g + weight_decay * p  (if weight_decay != 0)
//   s = s + g * g;  p = p + (-clr) * (g / (sqrt(s) + eps)),  clr = lr / (1 + (step - 1) * lr_decay)
//
//   Lion (Chen et al. 2023, decoupled decay):
//   g = float(grad) * grad_scale;  p = p * (1 - lr * weight_decay)  (if weight_decay != 0)
//   p = p + (-lr) * sign(m * beta1 + (1 - beta1) * g);  m = m * beta2 + (1 - beta2) * g
//   (sign(0) = 0, sign(NaN) = NaN)
//
// Dtypes: grads fp32/fp16/bf16 (DType::kF32/kF16/kBF16, fp16/bf16 as raw
// uint16_t bits); outputs the same three or none. fp16 and bf16 outputs round
// to nearest, ties to even, overflow to +-inf, fp16 keeps subnormals, NaN
// stays a (quiet) NaN: bit for bit F32ToF16/F32ToBF16 of runtime/dtype.h.
//
// Accuracy: every SIMD target (Highway dynamic dispatch: AVX-512, AVX2, SSE4,
// SSSE3, scalar, ...) performs the same sequence of IEEE fp32 operations as the
// scalar reference in cpu_adam/cpu_adam_reference.h (no FMA contraction; div
// and sqrt are correctly rounded), so p, m, v and the outputs agree with it
// bit for bit (0 ulp; the contract promised to callers is <= 1 ulp). The
// statistic sums squares in double; it is within a relative
// 2 * (kGradStatsBlockElems + blocks) * 2^-53 of the exact sum, and bitwise
// identical for every thread count (fixed blocks combined in a fixed order).
//
// Threading: a CpuAdam owns a oneTBB task arena of `threads` threads; its
// calls split the span into chunks whose boundaries are 64-byte aligned for
// the master-weight array (and for every array whose base has the same
// alignment), so threads never write the same cache line. Results never depend
// on the thread count. Calls on one CpuAdam from several threads are safe; they
// share its arena. The free functions run on the calling thread only (for an
// engine that drives its own threads) and are thread-safe on disjoint spans.
//
// Spans: any length (0 included) and any alignment of their element type
// (4 bytes for float, 2 for uint16_t); no vector alignment is needed. Params,
// state, grad and output must not overlap one another.
//
// Errors (all InvalidArgument, checked once per call, nothing is written):
// state/grad/output lengths that differ, a null pointer with elems > 0, a grad
// dtype other than fp32/fp16/bf16, an output dtype other than fp32/fp16/bf16,
// step < 1, beta outside [0, 1), eps <= 0 (Adam, Adagrad), a non-finite
// hyperparameter.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string_view>

#include "runtime/dtype.h"
#include "runtime/status.h"

namespace strata {

// Read-only gradient elements of one dtype. Not owning.
struct GradView {
  DType dtype = DType::kF32;
  const void* data = nullptr;
  size_t elems = 0;

  static GradView F32(std::span<const float> g) { return {DType::kF32, g.data(), g.size()}; }
  static GradView F16(std::span<const uint16_t> g) { return {DType::kF16, g.data(), g.size()}; }
  static GradView BF16(std::span<const uint16_t> g) { return {DType::kBF16, g.data(), g.size()}; }
};

// Where the updated params are written, converted to `dtype`. Not owning.
// OutView::None() (elems == 0, data == nullptr) writes nothing.
struct OutView {
  DType dtype = DType::kF32;
  void* data = nullptr;
  size_t elems = 0;

  static OutView None() { return {}; }
  static OutView F32(std::span<float> o) { return {DType::kF32, o.data(), o.size()}; }
  static OutView F16(std::span<uint16_t> o) { return {DType::kF16, o.data(), o.size()}; }
  static OutView BF16(std::span<uint16_t> o) { return {DType::kBF16, o.data(), o.size()}; }
  bool is_none() const { return data == nullptr && elems == 0; }
};

enum class WeightDecayMode : uint8_t {
  kDecoupled = 0,  // AdamW: p *= 1 - lr * weight_decay before the update
  kL2 = 1,         // Adam: g += weight_decay * p
};

enum class BiasCorrection : uint8_t { kOn = 0, kOff = 1 };

// Per-call Adam/AdamW hyperparameters. Defaults are torch.optim.AdamW's.
struct AdamHyper {
  double lr = 1e-3;
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = 1e-8;
  double weight_decay = 1e-2;
  WeightDecayMode weight_decay_mode = WeightDecayMode::kDecoupled;
  BiasCorrection bias_correction = BiasCorrection::kOn;
  int64_t step = 1;         // 1 for the first update (after incrementing)
  float grad_scale = 1.0f;  // 1/loss_scale x clip coefficient
};

struct AdagradHyper {
  double lr = 1e-2;
  double lr_decay = 0.0;
  double eps = 1e-10;
  double weight_decay = 0.0;  // L2, as torch.optim.Adagrad
  int64_t step = 1;
  float grad_scale = 1.0f;
};

struct LionHyper {
  double lr = 1e-4;
  double beta1 = 0.9;
  double beta2 = 0.99;
  double weight_decay = 0.0;  // decoupled
  float grad_scale = 1.0f;
};

// The fp32 state, updated in place. All spans have the same length.
struct AdamState {
  std::span<float> params;      // fp32 master weights
  std::span<float> exp_avg;     // m
  std::span<float> exp_avg_sq;  // v
};
struct AdagradState {
  std::span<float> params;
  std::span<float> sum_sq;  // torch's state["sum"]
};
struct LionState {
  std::span<float> params;
  std::span<float> exp_avg;
};

// The gradient statistic: sum_sq = grad_scale^2 * sum(float(g_i)^2) in double
// (inf/NaN when non-finite grads are present), nonfinite_elems = how many
// g_i are inf or NaN (before scaling).
struct GradStats {
  double sum_sq = 0.0;
  uint64_t nonfinite_elems = 0;
  bool finite() const { return nonfinite_elems == 0; }
};

// Elements per block of the statistic; partial sums are combined in index order.
inline constexpr size_t kGradStatsBlockElems = 16384;

// Elements per parallel chunk of an update (a multiple of 64, so chunks of
// 64-byte aligned arrays start on cache lines).
inline constexpr size_t kUpdateChunkElems = 32768;

// ---- Single-threaded, on the calling thread --------------------------------

Status AdamStep(const AdamHyper& hyper, const AdamState& state, GradView grad, OutView out);
Status AdagradStep(const AdagradHyper& hyper, const AdagradState& state, GradView grad,
                   OutView out);
Status LionStep(const LionHyper& hyper, const LionState& state, GradView grad, OutView out);
Result<GradStats> ComputeGradStats(GradView grad, float grad_scale);

// Name of the SIMD target the running CPU dispatches to ("AVX2", "AVX3", ...).
std::string_view CpuAdamTargetName();

// ---- Multi-threaded ---------------------------------------------------------

struct CpuAdamOptions {
  int threads = 0;  // <= 0: every hardware thread this process may use; never more
};

// Runs the kernels above over a oneTBB task arena. Move-only through
// unique_ptr; the destructor waits for nothing (calls are synchronous).
class CpuAdam {
 public:
  // InvalidArgument for threads > 4096.
  static Result<std::unique_ptr<CpuAdam>> Create(const CpuAdamOptions& options);
  ~CpuAdam();
  CpuAdam(const CpuAdam&) = delete;
  CpuAdam& operator=(const CpuAdam&) = delete;

  // The threads it runs: options.threads, at most the hardware threads this
  // process may use (oneTBB's arena has no more).
  int threads() const;

  Status Step(const AdamHyper& hyper, const AdamState& state, GradView grad, OutView out);
  Status StepAdagrad(const AdagradHyper& hyper, const AdagradState& state, GradView grad,
                     OutView out);
  Status StepLion(const LionHyper& hyper, const LionState& state, GradView grad, OutView out);
  Result<GradStats> ComputeGradStats(GradView grad, float grad_scale);

  // For benchmarks: a streaming pass with exactly Step's memory traffic (reads
  // grad, reads and writes params/exp_avg/exp_avg_sq, writes out; same dtypes,
  // chunks and threads) and trivial arithmetic: p, m, v are rewritten with
  // their own values (x + 0 * g) and `out` gets the truncated params. Same
  // errors as Step.
  Status TrafficBaseline(const AdamState& state, GradView grad, OutView out);

  // Runs body(begin, count) over [0, n) in blocks of at least `grain`
  // elements on the optimizer's threads (its arena): for work at memory speed
  // beside the step, such as filling the initial state. Returns when all ran.
  void ParallelFor(size_t n, size_t grain, const std::function<void(size_t, size_t)>& body);

 private:
  struct Impl;
  explicit CpuAdam(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace strata
