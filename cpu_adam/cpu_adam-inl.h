// Highway kernels of cpu_adam, compiled once per SIMD target by
// cpu_adam.cc (foreach_target). Internal: include only from cpu_adam sources.
//
// Every kernel performs, per lane, exactly the fp32 operations of the scalar
// reference (cpu_adam_reference.cc) in the same order; fp16/bf16 conversions
// are runtime/dtype-inl.h's, bit for bit runtime/dtype.h. The last partial
// vector of a range goes through the same vector code on a padded copy, so
// every element takes the SIMD path.

#if defined(STRATA_CPU_ADAM_INL_H_) == defined(HWY_TARGET_TOGGLE)
#ifdef STRATA_CPU_ADAM_INL_H_
#undef STRATA_CPU_ADAM_INL_H_
#else
#define STRATA_CPU_ADAM_INL_H_
#endif

#include <cstring>

#include "cpu_adam/cpu_adam_internal.h"
#include "hwy/cache_control.h"
#include "hwy/highway.h"
#include "runtime/dtype-inl.h"

HWY_BEFORE_NAMESPACE();
namespace strata {
namespace HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;
namespace cai = ::strata::cpu_adam_internal;

using DF = hn::ScalableTag<float>;
using DU = hn::RebindToUnsigned<DF>;
using DI = hn::RebindToSigned<DF>;
using VF = hn::Vec<DF>;
using VU = hn::Vec<DU>;

// Largest vector of this architecture, in floats: the tail buffers' size.
constexpr size_t kMaxLanes = HWY_MAX_BYTES / sizeof(float);

// ---- Conversions: runtime/dtype-inl.h -----------------------------------------

template <DType G>
HWY_INLINE VF LoadGrad(const void* HWY_RESTRICT base, size_t i) {
  return LoadAsF32<G>(DF(), base, i);
}

template <cai::OutKind O>
constexpr DType kOutDType = O == cai::OutKind::kF32    ? DType::kF32
                            : O == cai::OutKind::kBF16 ? DType::kBF16
                                                       : DType::kF16;

template <cai::OutKind O>
using OutElem = std::conditional_t<O == cai::OutKind::kF32, float, uint16_t>;

// Stores the params' copy of lanes [i, i + N) as `kind` (see ForEachVector),
// converted as runtime/dtype.h does.
template <cai::OutKind O>
HWY_INLINE void StoreOut(StoreKind kind, VF p, void* HWY_RESTRICT base, size_t i) {
  if constexpr (O != cai::OutKind::kNone) {
    const hn::Rebind<OutElem<O>, DF> d;
    StoreAs(kind, ConvertFromF32<kOutDType<O>>(DF(), p), d, static_cast<OutElem<O>*>(base) + i);
  }
}

template <DType G>
using GradElem = StoredElem<G>;

// Runs `vec(args, i)` over [begin, begin + count) in whole vectors; `vec`
// updates the state of lanes [i, i + N) and returns the new params, which
// this function converts and stores to the output. The last partial vector
// runs on zero-padded copies of the arrays and only its `count % N` elements
// are copied back.
//
// The output of vector i is converted while vector i + 1 is computed
// (software pipelining): the conversion's integer ops then do not queue
// behind the long sqrt/div chain, which otherwise fills the scheduler and
// makes fp16/bf16 output cost ~2x on one core.
//
// The output is write-only here and is next read by another stage (a copy to
// the device, or the trainer): where the whole vectors of this range start
// aligned it is streamed (runtime/dtype-inl.h, StoreKind), which spares the
// DRAM the reads of its lines before they are written. `vec` gets that
// decision as its third argument.
// kConvertOut = false: `vec` writes the output itself (the baseline).
template <DType G, cai::OutKind O, int kStates, bool kConvertOut = true, class VecFn>
HWY_INLINE void ForEachVector(const cai::KernelArgs& a, size_t begin, size_t count,
                              const VecFn& vec) {
  const DF df;
  const size_t N = hn::Lanes(df);
  size_t i = begin;
  const size_t end = begin + count;
  if (i + N <= end) {
    // A local copy: stores through the float pointers cannot alias it, so the
    // pointers stay in registers.
    const cai::KernelArgs local = a;
    StoreKind out_store = StoreKind::kCached;
    if constexpr (O != cai::OutKind::kNone) {
      out_store = StoreKindFrom(hn::Rebind<OutElem<O>, DF>(), static_cast<OutElem<O>*>(a.out) + i);
    }
    VF prev = vec(local, i, out_store);
    for (i += N; i + N <= end; i += N) {
      const VF p = vec(local, i, out_store);
      if constexpr (kConvertOut) StoreOut<O>(out_store, prev, local.out, i - N);
      prev = p;
    }
    if constexpr (kConvertOut) StoreOut<O>(out_store, prev, local.out, i - N);
    if (out_store == StoreKind::kStream) hwy::FlushStream();
  }
  const size_t rem = end - i;
  if (rem == 0) return;
  using GE = GradElem<G>;
  using OE = OutElem<O>;
  alignas(64) float s_buf[3][kMaxLanes] = {};
  alignas(64) GE g_buf[kMaxLanes] = {};
  alignas(64) OE o_buf[kMaxLanes] = {};
  float* const states[3] = {a.s0, a.s1, a.s2};
  cai::KernelArgs t = a;
  float** t_states[3] = {&t.s0, &t.s1, &t.s2};
  for (int s = 0; s < kStates; ++s) {
    std::memcpy(s_buf[s], states[s] + i, rem * sizeof(float));
    *t_states[s] = s_buf[s];
  }
  std::memcpy(g_buf, static_cast<const GE*>(a.grad) + i, rem * sizeof(GE));
  t.grad = g_buf;
  t.out = o_buf;
  const VF p = vec(t, 0, StoreKind::kCached);
  if constexpr (kConvertOut) StoreOut<O>(StoreKind::kCached, p, t.out, 0);
  for (int s = 0; s < kStates; ++s) std::memcpy(states[s] + i, s_buf[s], rem * sizeof(float));
  if constexpr (O != cai::OutKind::kNone) {
    std::memcpy(static_cast<OE*>(a.out) + i, o_buf, rem * sizeof(OE));
  }
}

// ---- Adam / AdamW -----------------------------------------------------------

template <DType G, cai::OutKind O>
HWY_NOINLINE void AdamLoop(const cai::AdamCoeffs& c, const cai::KernelArgs& args, size_t begin,
                           size_t count) {
  const DF df;
  const VF scale = hn::Set(df, c.grad_scale);
  const VF b1 = hn::Set(df, c.beta1), omb1 = hn::Set(df, c.one_minus_beta1);
  const VF b2 = hn::Set(df, c.beta2), omb2 = hn::Set(df, c.one_minus_beta2);
  const VF eps = hn::Set(df, c.eps), bc2 = hn::Set(df, c.bc2_sqrt);
  const VF neg_step = hn::Set(df, c.neg_step_size);
  const VF l2 = hn::Set(df, c.l2_decay), decay = hn::Set(df, c.decay_factor);
  const cai::Decay mode = c.decay;
  ForEachVector<G, O, 3>(args, begin, count, [&](const cai::KernelArgs& a, size_t i, StoreKind) {
    VF g = hn::Mul(LoadGrad<G>(a.grad, i), scale);
    VF p = hn::LoadU(df, a.s0 + i);
    if (mode == cai::Decay::kL2) g = hn::Add(g, hn::Mul(l2, p));
    if (mode == cai::Decay::kDecoupled) p = hn::Mul(p, decay);
    const VF m = hn::Add(hn::Mul(hn::LoadU(df, a.s1 + i), b1), hn::Mul(omb1, g));
    const VF v = hn::Add(hn::Mul(hn::LoadU(df, a.s2 + i), b2), hn::Mul(hn::Mul(omb2, g), g));
    const VF denom = hn::Add(hn::Div(hn::Sqrt(v), bc2), eps);
    p = hn::Add(p, hn::Mul(neg_step, hn::Div(m, denom)));
    hn::StoreU(p, df, a.s0 + i);
    hn::StoreU(m, df, a.s1 + i);
    hn::StoreU(v, df, a.s2 + i);
    return p;
  });
}

// ---- Adagrad ----------------------------------------------------------------

template <DType G, cai::OutKind O>
HWY_NOINLINE void AdagradLoop(const cai::AdagradCoeffs& c, const cai::KernelArgs& args,
                              size_t begin, size_t count) {
  const DF df;
  const VF scale = hn::Set(df, c.grad_scale);
  const VF eps = hn::Set(df, c.eps), neg_clr = hn::Set(df, c.neg_clr);
  const VF l2 = hn::Set(df, c.l2_decay);
  const cai::Decay mode = c.decay;
  ForEachVector<G, O, 2>(args, begin, count, [&](const cai::KernelArgs& a, size_t i, StoreKind) {
    VF g = hn::Mul(LoadGrad<G>(a.grad, i), scale);
    VF p = hn::LoadU(df, a.s0 + i);
    if (mode == cai::Decay::kL2) g = hn::Add(g, hn::Mul(l2, p));
    const VF s = hn::Add(hn::LoadU(df, a.s1 + i), hn::Mul(g, g));
    const VF std_dev = hn::Add(hn::Sqrt(s), eps);
    p = hn::Add(p, hn::Mul(neg_clr, hn::Div(g, std_dev)));
    hn::StoreU(p, df, a.s0 + i);
    hn::StoreU(s, df, a.s1 + i);
    return p;
  });
}

// ---- Lion -------------------------------------------------------------------

template <DType G, cai::OutKind O>
HWY_NOINLINE void LionLoop(const cai::LionCoeffs& c, const cai::KernelArgs& args, size_t begin,
                           size_t count) {
  const DF df;
  const VF scale = hn::Set(df, c.grad_scale);
  const VF b1 = hn::Set(df, c.beta1), omb1 = hn::Set(df, c.one_minus_beta1);
  const VF b2 = hn::Set(df, c.beta2), omb2 = hn::Set(df, c.one_minus_beta2);
  const VF neg_lr = hn::Set(df, c.neg_lr), decay = hn::Set(df, c.decay_factor);
  const VF zero = hn::Zero(df), one = hn::Set(df, 1.0f), minus_one = hn::Set(df, -1.0f);
  const cai::Decay mode = c.decay;
  ForEachVector<G, O, 2>(args, begin, count, [&](const cai::KernelArgs& a, size_t i, StoreKind) {
    const VF g = hn::Mul(LoadGrad<G>(a.grad, i), scale);
    VF p = hn::LoadU(df, a.s0 + i);
    if (mode == cai::Decay::kDecoupled) p = hn::Mul(p, decay);
    const VF m = hn::LoadU(df, a.s1 + i);
    const VF interp = hn::Add(hn::Mul(m, b1), hn::Mul(omb1, g));
    // sign(): +-1, and +-0 or NaN unchanged.
    VF sign = hn::IfThenElse(hn::Gt(interp, zero), one, interp);
    sign = hn::IfThenElse(hn::Lt(interp, zero), minus_one, sign);
    p = hn::Add(p, hn::Mul(neg_lr, sign));
    hn::StoreU(p, df, a.s0 + i);
    hn::StoreU(hn::Add(hn::Mul(m, b2), hn::Mul(omb2, g)), df, a.s1 + i);
    return p;
  });
}

// ---- Traffic baseline: Adam's loads and stores, trivial arithmetic ---------

// `coeff` is a run-time 0 from the caller: the compiler cannot drop the
// arithmetic, and finite state keeps its values (x + 0 * g == x).
template <DType G, cai::OutKind O>
HWY_NOINLINE void BaselineLoop(float coeff, const cai::KernelArgs& args, size_t begin,
                               size_t count) {
  const DF df;
  const DU du;
  const VF k = hn::Set(df, coeff);
  ForEachVector<G, O, 3, false>(args, begin, count, [&](const cai::KernelArgs& a, size_t i,
                                                         StoreKind out_store) {
    const VF g = hn::Mul(LoadGrad<G>(a.grad, i), k);
    const VF p = hn::Add(hn::LoadU(df, a.s0 + i), g);
    hn::StoreU(p, df, a.s0 + i);
    hn::StoreU(hn::Add(hn::LoadU(df, a.s1 + i), g), df, a.s1 + i);
    hn::StoreU(hn::Add(hn::LoadU(df, a.s2 + i), g), df, a.s2 + i);
    if constexpr (O == cai::OutKind::kF32) {
      StoreAs(out_store, p, df, static_cast<float*>(a.out) + i);
    } else if constexpr (O != cai::OutKind::kNone) {
      // Truncation: same bytes as the rounded conversion, less arithmetic.
      StoreAs(out_store, NarrowToU16(du, hn::ShiftRight<16>(hn::BitCast(du, p))),
              hn::Rebind<uint16_t, DF>(), static_cast<uint16_t*>(a.out) + i);
    }
    return p;
  });
}

// ---- Gradient statistic ------------------------------------------------------

template <DType G>
HWY_NOINLINE cai::StatsPartial StatsLoop(const void* grad, size_t begin, size_t count) {
  const hn::ScalableTag<double> dd;
  const hn::Rebind<float, decltype(dd)> dfh;
  const size_t N = hn::Lanes(dd);
  using GE = GradElem<G>;
  const GE* g = static_cast<const GE*>(grad);
  auto load = [&](const GE* ptr) { return hn::PromoteTo(dd, LoadAsF32<G>(dfh, ptr, 0)); };
  const auto zero = hn::Zero(dd);
  auto sum0 = zero, sum1 = zero;
  uint64_t finite = 0;
  size_t i = begin;
  const size_t end = begin + count;
  for (; i + 2 * N <= end; i += 2 * N) {
    const auto x0 = load(g + i);
    const auto x1 = load(g + i + N);
    sum0 = hn::Add(sum0, hn::Mul(x0, x0));
    sum1 = hn::Add(sum1, hn::Mul(x1, x1));
    // x - x is 0 exactly when x is finite (inf - inf and NaN are NaN).
    finite += hn::CountTrue(dd, hn::Eq(hn::Sub(x0, x0), zero));
    finite += hn::CountTrue(dd, hn::Eq(hn::Sub(x1, x1), zero));
  }
  size_t padded = 0;
  while (i < end) {
    alignas(64) GE buf[kMaxLanes] = {};
    const size_t rem = end - i < N ? end - i : N;
    std::memcpy(buf, g + i, rem * sizeof(GE));
    const auto x = load(buf);
    sum0 = hn::Add(sum0, hn::Mul(x, x));
    finite += hn::CountTrue(dd, hn::Eq(hn::Sub(x, x), zero));
    padded += N - rem;
    i += rem;
  }
  cai::StatsPartial r;
  r.sum = hn::GetLane(hn::SumOfLanes(dd, hn::Add(sum0, sum1)));
  r.nonfinite = count - (finite - padded);
  return r;
}

// ---- Entry points (one per exported function) --------------------------------

#define STRATA_CPU_ADAM_SWITCH_OUT(LOOP, G, ...) \
  switch (o) {                                   \
    case cai::OutKind::kNone:                    \
      LOOP<G, cai::OutKind::kNone>(__VA_ARGS__); \
      break;                                     \
    case cai::OutKind::kF32:                     \
      LOOP<G, cai::OutKind::kF32>(__VA_ARGS__);  \
      break;                                     \
    case cai::OutKind::kF16:                     \
      LOOP<G, cai::OutKind::kF16>(__VA_ARGS__);  \
      break;                                     \
    case cai::OutKind::kBF16:                    \
      LOOP<G, cai::OutKind::kBF16>(__VA_ARGS__); \
      break;                                     \
  }

#define STRATA_CPU_ADAM_SWITCH(LOOP, ...)                                  \
  {                                                                        \
    const cai::OutKind o = a.out_kind;                                     \
    switch (a.grad_dtype) {                                                \
      case DType::kF16:                                                    \
        STRATA_CPU_ADAM_SWITCH_OUT(LOOP, DType::kF16, __VA_ARGS__) break;  \
      case DType::kBF16:                                                   \
        STRATA_CPU_ADAM_SWITCH_OUT(LOOP, DType::kBF16, __VA_ARGS__) break; \
      default:                                                             \
        STRATA_CPU_ADAM_SWITCH_OUT(LOOP, DType::kF32, __VA_ARGS__) break;  \
    }                                                                      \
  }

void AdamRange(const cai::AdamCoeffs& c, const cai::KernelArgs& a, size_t begin, size_t count) {
  STRATA_CPU_ADAM_SWITCH(AdamLoop, c, a, begin, count)
}
void AdagradRange(const cai::AdagradCoeffs& c, const cai::KernelArgs& a, size_t begin,
                  size_t count) {
  STRATA_CPU_ADAM_SWITCH(AdagradLoop, c, a, begin, count)
}
void LionRange(const cai::LionCoeffs& c, const cai::KernelArgs& a, size_t begin, size_t count) {
  STRATA_CPU_ADAM_SWITCH(LionLoop, c, a, begin, count)
}
void BaselineRange(float coeff, const cai::KernelArgs& a, size_t begin, size_t count){
    STRATA_CPU_ADAM_SWITCH(BaselineLoop, coeff, a, begin, count)} cai::StatsPartial
    StatsRange(const void* grad, DType dtype, size_t begin, size_t count) {
  switch (dtype) {
    case DType::kF16:
      return StatsLoop<DType::kF16>(grad, begin, count);
    case DType::kBF16:
      return StatsLoop<DType::kBF16>(grad, begin, count);
    default:
      return StatsLoop<DType::kF32>(grad, begin, count);
  }
}
const char* TargetNameOfThisTarget() { return hwy::TargetName(HWY_TARGET); }

#undef STRATA_CPU_ADAM_SWITCH
#undef STRATA_CPU_ADAM_SWITCH_OUT

}  // namespace HWY_NAMESPACE
}  // namespace strata
HWY_AFTER_NAMESPACE();

#endif  // STRATA_CPU_ADAM_INL_H_
