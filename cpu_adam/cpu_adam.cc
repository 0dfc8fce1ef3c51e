// cpu_adam: dispatch to the best SIMD target and the oneTBB parallel driver.
// The kernels themselves are in cpu_adam-inl.h.

#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "cpu_adam/cpu_adam.cc"
// foreach_target.h must come before the -inl.h it re-includes.
// clang-format off
#include "hwy/foreach_target.h"  // IWYU pragma: keep
#include "cpu_adam/cpu_adam-inl.h"
#include "hwy/highway.h"
// clang-format on

#if HWY_ONCE

#include "cpu_adam/cpu_adam.h"

#include <fmt/format.h>
#include <oneapi/tbb/blocked_range.h>
#include <oneapi/tbb/info.h>
#include <oneapi/tbb/parallel_for.h>
#include <oneapi/tbb/partitioner.h>
#include <oneapi/tbb/task_arena.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <vector>

#include "cpu_adam/cpu_adam_internal.h"

namespace strata {

HWY_EXPORT(AdamRange);
HWY_EXPORT(AdagradRange);
HWY_EXPORT(LionRange);
HWY_EXPORT(BaselineRange);
HWY_EXPORT(StatsRange);
HWY_EXPORT(TargetNameOfThisTarget);

namespace {

namespace cai = cpu_adam_internal;

constexpr int kMaxThreads = 4096;

// Chunk layout of an update over n elements: the first chunk ends where the
// params array reaches a 64-byte boundary, the others are kUpdateChunkElems
// long, so chunks of arrays aligned like params start on their own cache lines.
struct Chunks {
  size_t n = 0;
  size_t head = 0;  // elements in the first (alignment) chunk, < 16
  size_t count() const {
    if (n == 0) return 0;
    const size_t rest = n - std::min(head, n);
    return (head > 0 ? 1 : 0) + (rest + kUpdateChunkElems - 1) / kUpdateChunkElems;
  }
  // [begin, end) of chunk k.
  std::pair<size_t, size_t> operator[](size_t k) const {
    if (head > 0) {
      if (k == 0) return {0, std::min(head, n)};
      --k;
    }
    const size_t begin = head + k * kUpdateChunkElems;
    return {begin, std::min(n, begin + kUpdateChunkElems)};
  }
};

Chunks ChunksFor(const float* params, size_t n) {
  Chunks c;
  c.n = n;
  const uintptr_t addr = reinterpret_cast<uintptr_t>(params);
  if (addr % sizeof(float) == 0) c.head = ((64 - addr % 64) % 64) / sizeof(float);
  c.head = std::min(c.head, n);
  return c;
}

struct AdamCall {
  cai::AdamCoeffs coeffs;
  cai::KernelArgs args;
  size_t n;
};

Result<AdamCall> PrepareAdam(const AdamHyper& hyper, const AdamState& state, GradView grad,
                             OutView out) {
  STRATA_ASSIGN_OR_RETURN(const cai::AdamCoeffs c, cai::DeriveAdam(hyper));
  const std::array<std::span<float>, 3> spans = {state.params, state.exp_avg, state.exp_avg_sq};
  static constexpr std::array<const char*, 3> kNames = {"params", "exp_avg", "exp_avg_sq"};
  STRATA_RETURN_IF_ERROR(cai::CheckSpans("adam step", spans, kNames, grad, out));
  return AdamCall{c,
                  {state.params.data(), state.exp_avg.data(), state.exp_avg_sq.data(), grad.data,
                   grad.dtype, out.data, cai::OutKindOf(out)},
                  state.params.size()};
}

struct AdagradCall {
  cai::AdagradCoeffs coeffs;
  cai::KernelArgs args;
  size_t n;
};

Result<AdagradCall> PrepareAdagrad(const AdagradHyper& hyper, const AdagradState& state,
                                   GradView grad, OutView out) {
  STRATA_ASSIGN_OR_RETURN(const cai::AdagradCoeffs c, cai::DeriveAdagrad(hyper));
  const std::array<std::span<float>, 2> spans = {state.params, state.sum_sq};
  static constexpr std::array<const char*, 2> kNames = {"params", "sum_sq"};
  STRATA_RETURN_IF_ERROR(cai::CheckSpans("adagrad step", spans, kNames, grad, out));
  return AdagradCall{c,
                     {state.params.data(), state.sum_sq.data(), nullptr, grad.data, grad.dtype,
                      out.data, cai::OutKindOf(out)},
                     state.params.size()};
}

struct LionCall {
  cai::LionCoeffs coeffs;
  cai::KernelArgs args;
  size_t n;
};

Result<LionCall> PrepareLion(const LionHyper& hyper, const LionState& state, GradView grad,
                             OutView out) {
  STRATA_ASSIGN_OR_RETURN(const cai::LionCoeffs c, cai::DeriveLion(hyper));
  const std::array<std::span<float>, 2> spans = {state.params, state.exp_avg};
  static constexpr std::array<const char*, 2> kNames = {"params", "exp_avg"};
  STRATA_RETURN_IF_ERROR(cai::CheckSpans("lion step", spans, kNames, grad, out));
  return LionCall{c,
                  {state.params.data(), state.exp_avg.data(), nullptr, grad.data, grad.dtype,
                   out.data, cai::OutKindOf(out)},
                  state.params.size()};
}

size_t StatsBlocks(size_t n) { return (n + kGradStatsBlockElems - 1) / kGradStatsBlockElems; }

cai::StatsPartial StatsBlock(GradView grad, size_t b) {
  const size_t begin = b * kGradStatsBlockElems;
  const size_t count = std::min(kGradStatsBlockElems, grad.elems - begin);
  return HWY_DYNAMIC_DISPATCH(StatsRange)(grad.data, grad.dtype, begin, count);
}

// Combines block partials in index order: the result depends only on the
// block decomposition, never on which thread ran which block.
GradStats CombineStats(const std::vector<cai::StatsPartial>& partials, float grad_scale) {
  GradStats st;
  double sum = 0.0;
  for (const cai::StatsPartial& p : partials) {
    sum += p.sum;
    st.nonfinite_elems += p.nonfinite;
  }
  const double s = static_cast<double>(grad_scale);
  st.sum_sq = sum * (s * s);
  return st;
}

}  // namespace

Status AdamStep(const AdamHyper& hyper, const AdamState& state, GradView grad, OutView out) {
  STRATA_ASSIGN_OR_RETURN(const AdamCall call, PrepareAdam(hyper, state, grad, out));
  if (call.n > 0) HWY_DYNAMIC_DISPATCH(AdamRange)(call.coeffs, call.args, 0, call.n);
  return OkStatus();
}

Status AdagradStep(const AdagradHyper& hyper, const AdagradState& state, GradView grad,
                   OutView out) {
  STRATA_ASSIGN_OR_RETURN(const AdagradCall call, PrepareAdagrad(hyper, state, grad, out));
  if (call.n > 0) HWY_DYNAMIC_DISPATCH(AdagradRange)(call.coeffs, call.args, 0, call.n);
  return OkStatus();
}

Status LionStep(const LionHyper& hyper, const LionState& state, GradView grad, OutView out) {
  STRATA_ASSIGN_OR_RETURN(const LionCall call, PrepareLion(hyper, state, grad, out));
  if (call.n > 0) HWY_DYNAMIC_DISPATCH(LionRange)(call.coeffs, call.args, 0, call.n);
  return OkStatus();
}

Result<GradStats> ComputeGradStats(GradView grad, float grad_scale) {
  STRATA_RETURN_IF_ERROR(cai::CheckGrad("grad stats", grad));
  std::vector<cai::StatsPartial> partials(StatsBlocks(grad.elems));
  for (size_t b = 0; b < partials.size(); ++b) partials[b] = StatsBlock(grad, b);
  return CombineStats(partials, grad_scale);
}

std::string_view CpuAdamTargetName() { return HWY_DYNAMIC_DISPATCH(TargetNameOfThisTarget)(); }

// ---- CpuAdam ------------------------------------------------------------------

struct CpuAdam::Impl {
  int threads = 1;
  tbb::task_arena arena;

  // Runs body(begin, count) over the chunks of an update of n elements.
  template <class Body>
  void ForChunks(const float* params, size_t n, const Body& body) {
    const Chunks chunks = ChunksFor(params, n);
    const size_t k = chunks.count();
    if (threads == 1 || k <= 1) {
      if (n > 0) body(size_t{0}, n);
      return;
    }
    arena.execute([&] {
      tbb::parallel_for(
          tbb::blocked_range<size_t>(0, k, 1),
          [&](const tbb::blocked_range<size_t>& r) {
            for (size_t i = r.begin(); i != r.end(); ++i) {
              const auto [begin, end] = chunks[i];
              body(begin, end - begin);
            }
          },
          tbb::simple_partitioner());
    });
  }
};

CpuAdam::CpuAdam(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
CpuAdam::~CpuAdam() = default;

Result<std::unique_ptr<CpuAdam>> CpuAdam::Create(const CpuAdamOptions& options) {
  if (options.threads > kMaxThreads) {
    return InvalidArgumentError(fmt::format(
        "create cpu adam: threads = {} is more than {}; pass <= 0 for every hardware thread",
        options.threads, kMaxThreads));
  }
  auto impl = std::make_unique<Impl>();
  // More than the process may run on would not run: oneTBB caps an arena's
  // workers there (and warns on stderr). threads() says what runs.
  impl->threads = std::min(options.threads > 0 ? options.threads : tbb::info::default_concurrency(),
                           tbb::info::default_concurrency());
  impl->threads = std::max(1, impl->threads);
  impl->arena.initialize(impl->threads);
  return std::unique_ptr<CpuAdam>(new CpuAdam(std::move(impl)));
}

int CpuAdam::threads() const { return impl_->threads; }

Status CpuAdam::Step(const AdamHyper& hyper, const AdamState& state, GradView grad, OutView out) {
  STRATA_ASSIGN_OR_RETURN(const AdamCall call, PrepareAdam(hyper, state, grad, out));
  const auto fn = HWY_DYNAMIC_DISPATCH(AdamRange);
  impl_->ForChunks(call.args.s0, call.n,
                   [&](size_t begin, size_t count) { fn(call.coeffs, call.args, begin, count); });
  return OkStatus();
}

Status CpuAdam::StepAdagrad(const AdagradHyper& hyper, const AdagradState& state, GradView grad,
                            OutView out) {
  STRATA_ASSIGN_OR_RETURN(const AdagradCall call, PrepareAdagrad(hyper, state, grad, out));
  const auto fn = HWY_DYNAMIC_DISPATCH(AdagradRange);
  impl_->ForChunks(call.args.s0, call.n,
                   [&](size_t begin, size_t count) { fn(call.coeffs, call.args, begin, count); });
  return OkStatus();
}

Status CpuAdam::StepLion(const LionHyper& hyper, const LionState& state, GradView grad,
                         OutView out) {
  STRATA_ASSIGN_OR_RETURN(const LionCall call, PrepareLion(hyper, state, grad, out));
  const auto fn = HWY_DYNAMIC_DISPATCH(LionRange);
  impl_->ForChunks(call.args.s0, call.n,
                   [&](size_t begin, size_t count) { fn(call.coeffs, call.args, begin, count); });
  return OkStatus();
}

Status CpuAdam::TrafficBaseline(const AdamState& state, GradView grad, OutView out) {
  const std::array<std::span<float>, 3> spans = {state.params, state.exp_avg, state.exp_avg_sq};
  static constexpr std::array<const char*, 3> kNames = {"params", "exp_avg", "exp_avg_sq"};
  STRATA_RETURN_IF_ERROR(cai::CheckSpans("traffic baseline", spans, kNames, grad, out));
  const cai::KernelArgs args{state.params.data(), state.exp_avg.data(), state.exp_avg_sq.data(),
                             grad.data,           grad.dtype,           out.data,
                             cai::OutKindOf(out)};
  const auto fn = HWY_DYNAMIC_DISPATCH(BaselineRange);
  impl_->ForChunks(args.s0, state.params.size(),
                   [&](size_t begin, size_t count) { fn(0.0f, args, begin, count); });
  return OkStatus();
}

void CpuAdam::ParallelFor(size_t n, size_t grain,
                          const std::function<void(size_t, size_t)>& body) {
  grain = std::max<size_t>(grain, 1);
  if (impl_->threads == 1 || n <= grain) {
    if (n > 0) body(0, n);
    return;
  }
  impl_->arena.execute([&] {
    tbb::parallel_for(tbb::blocked_range<size_t>(0, n, grain),
                      [&](const tbb::blocked_range<size_t>& r) {
                        body(r.begin(), r.end() - r.begin());
                      });
  });
}

Result<GradStats> CpuAdam::ComputeGradStats(GradView grad, float grad_scale) {
  STRATA_RETURN_IF_ERROR(cai::CheckGrad("grad stats", grad));
  std::vector<cai::StatsPartial> partials(StatsBlocks(grad.elems));
  if (impl_->threads == 1 || partials.size() <= 1) {
    for (size_t b = 0; b < partials.size(); ++b) partials[b] = StatsBlock(grad, b);
  } else {
    impl_->arena.execute([&] {
      tbb::parallel_for(tbb::blocked_range<size_t>(0, partials.size(), 1),
                        [&](const tbb::blocked_range<size_t>& r) {
                          for (size_t b = r.begin(); b != r.end(); ++b) {
                            partials[b] = StatsBlock(grad, b);
                          }
                        });
    });
  }
  return CombineStats(partials, grad_scale);
}

}  // namespace strata

#endif  // HWY_ONCE
