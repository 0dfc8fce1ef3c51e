// Highway kernels of cpu_adam, compiled once per SIMD target by
// cpu_adam.cc (foreach_target). Internal: include only from cpu_adam sources.
//
// Every kernel performs, per lane, exactly the fp32 operations of the scalar
// reference (cpu_adam_reference.cc) in the same order; fp16/bf16 conversions
// use integer operations that mirror runtime/dtype.h bit for bit (Highway
// 1.0.3's bf16 DemoteTo truncates, and hardware fp16 conversions differ from
// the reference in NaN payloads). The last partial vector of a range goes
// through the same vector code on a padded copy, so every element takes the
// SIMD path.

#if defined(STRATA_CPU_ADAM_INL_H_) == defined(HWY_TARGET_TOGGLE)
#ifdef STRATA_CPU_ADAM_INL_H_
#undef STRATA_CPU_ADAM_INL_H_
#else
#define STRATA_CPU_ADAM_INL_H_
#endif

#include <cstring>

#include "cpu_adam/cpu_adam_internal.h"
#include "hwy/highway.h"

HWY_BEFORE_NAMESPACE();
namespace strata {
namespace HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;
namespace cai = ::strata::cpu_adam_internal;

using DF = hn::ScalableTag<float>;
using DU = hn::RebindToUnsigned<DF>;
using DI = hn::RebindToSigned<DF>;
using DU16 = hn::Rebind<uint16_t, DF>;
using VF = hn::Vec<DF>;
using VU = hn::Vec<DU>;

// Largest vector of this architecture, in floats: the tail buffers' size.
constexpr size_t kMaxLanes = HWY_MAX_BYTES / sizeof(float);

// ---- Conversions (u32 lanes hold the 16-bit values) -------------------------

template <class D>
HWY_INLINE hn::Vec<hn::RebindToFloat<D>> F16BitsToF32(D du, hn::Vec<D> h) {
  const hn::RebindToFloat<D> df;
  const hn::RebindToSigned<D> di;
  const auto sign = hn::ShiftLeft<16>(hn::And(h, hn::Set(du, 0x8000u)));
  const auto exp = hn::And(hn::ShiftRight<10>(h), hn::Set(du, 0x1fu));
  const auto mant = hn::And(h, hn::Set(du, 0x3ffu));
  const auto mant13 = hn::ShiftLeft<13>(mant);
  // Zero/subnormal: mant * 2^-24 is exact in fp32.
  const auto sub =
      hn::BitCast(du, hn::Mul(hn::ConvertTo(df, hn::BitCast(di, mant)), hn::Set(df, 0x1p-24f)));
  const auto inf_nan = hn::Or(hn::Set(du, 0x7f800000u), mant13);
  const auto normal = hn::Or(hn::ShiftLeft<23>(hn::Add(exp, hn::Set(du, 112u))), mant13);
  const auto exp_i = hn::BitCast(di, exp);
  auto r = hn::IfThenElse(hn::RebindMask(du, hn::Eq(exp_i, hn::Zero(di))), sub, normal);
  r = hn::IfThenElse(hn::RebindMask(du, hn::Eq(exp_i, hn::Set(di, 31))), inf_nan, r);
  return hn::BitCast(df, hn::Or(r, sign));
}

// fp32 bits -> bf16 bits (in u32 lanes), round to nearest even, NaN quieted.
template <class D>
HWY_INLINE hn::Vec<D> F32BitsToBF16(D du, hn::Vec<D> u) {
  const hn::RebindToSigned<D> di;
  const auto abs = hn::BitCast(di, hn::And(u, hn::Set(du, 0x7fffffffu)));
  const auto is_nan = hn::RebindMask(du, hn::Gt(abs, hn::Set(di, 0x7f800000)));
  const auto hi = hn::ShiftRight<16>(u);
  const auto nan_bits = hn::Or(hi, hn::Set(du, 0x40u));
  const auto lsb = hn::And(hi, hn::Set(du, 1u));
  const auto rounded = hn::ShiftRight<16>(hn::Add(hn::Add(u, hn::Set(du, 0x7fffu)), lsb));
  return hn::IfThenElse(is_nan, nan_bits, rounded);
}

// fp32 bits -> fp16 bits (in u32 lanes), as F32ToF16 of runtime/dtype.h.
template <class D>
HWY_INLINE hn::Vec<D> F32BitsToF16(D du, hn::Vec<D> x) {
  const hn::RebindToSigned<D> di;
  const hn::RebindToFloat<D> df;
  const auto sign = hn::And(hn::ShiftRight<16>(x), hn::Set(du, 0x8000u));
  const auto a = hn::And(x, hn::Set(du, 0x7fffffffu));
  const auto ai = hn::BitCast(di, a);
  const auto is_nan = hn::RebindMask(du, hn::Gt(ai, hn::Set(di, 0x7f800000)));
  const auto is_inf = hn::RebindMask(du, hn::Gt(ai, hn::Set(di, 0x477fefff)));
  const auto is_normal = hn::RebindMask(du, hn::Gt(ai, hn::Set(di, 0x387fffff)));
  const auto normal = hn::ShiftRight<13>(hn::Add(hn::Add(a, hn::Set(du, 0xc8000fffu)),
                                                 hn::And(hn::ShiftRight<13>(a), hn::Set(du, 1u))));
  const auto aligned = hn::Add(hn::BitCast(df, a), hn::Set(df, 0.5f));
  const auto sub = hn::Sub(hn::BitCast(du, aligned), hn::Set(du, 0x3f000000u));
  auto r = hn::IfThenElse(is_normal, normal, sub);
  r = hn::IfThenElse(is_inf, hn::Set(du, 0x7c00u), r);
  r = hn::IfThenElse(is_nan, hn::Set(du, 0x7e00u), r);
  return hn::Or(r, sign);
}

// u32 lanes holding values <= 0xffff -> u16 stored at `dst`.
HWY_INLINE void StoreU16(VU bits, uint16_t* HWY_RESTRICT dst) {
  const DI di;
  const DU16 du16;
  hn::StoreU(hn::DemoteTo(du16, hn::BitCast(di, bits)), du16, dst);
}

template <DType G>
HWY_INLINE VF LoadGrad(const void* HWY_RESTRICT base, size_t i) {
  const DF df;
  const DU du;
  if constexpr (G == DType::kF32) {
    return hn::LoadU(df, static_cast<const float*>(base) + i);
  } else {
    const DU16 du16;
    const VU h = hn::PromoteTo(du, hn::LoadU(du16, static_cast<const uint16_t*>(base) + i));
    if constexpr (G == DType::kBF16) {
      return hn::BitCast(df, hn::ShiftLeft<16>(h));
    } else {
      return F16BitsToF32(du, h);
    }
  }
}

template <cai::OutKind O>
HWY_INLINE void StoreOut(VF p, void* HWY_RESTRICT base, size_t i) {
  const DF df;
  const DU du;
  if constexpr (O == cai::OutKind::kF32) {
    hn::StoreU(p, df, static_cast<float*>(base) + i);
  } else if constexpr (O == cai::OutKind::kBF16) {
    StoreU16(F32BitsToBF16(du, hn::BitCast(du, p)), static_cast<uint16_t*>(base) + i);
  } else if constexpr (O == cai::OutKind::kF16) {
    StoreU16(F32BitsToF16(du, hn::BitCast(du, p)), static_cast<uint16_t*>(base) + i);
  }
}

template <DType G>
using GradElem = std::conditional_t<G == DType::kF32, float, uint16_t>;
template <cai::OutKind O>
using OutElem = std::conditional_t<O == cai::OutKind::kF32, float, uint16_t>;

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
    VF prev = vec(local, i);
    for (i += N; i + N <= end; i += N) {
      const VF p = vec(local, i);
      if constexpr (kConvertOut) StoreOut<O>(prev, local.out, i - N);
      prev = p;
    }
    if constexpr (kConvertOut) StoreOut<O>(prev, local.out, i - N);
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
  const VF p = vec(t, 0);
  if constexpr (kConvertOut) StoreOut<O>(p, t.out, 0);
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
  ForEachVector<G, O, 3>(args, begin, count, [&](const cai::KernelArgs& a, size_t i) {
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
  ForEachVector<G, O, 2>(args, begin, count, [&](const cai::KernelArgs& a, size_t i) {
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
  ForEachVector<G, O, 2>(args, begin, count, [&](const cai::KernelArgs& a, size_t i) {
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
  ForEachVector<G, O, 3, false>(args, begin, count, [&](const cai::KernelArgs& a, size_t i) {
    const VF g = hn::Mul(LoadGrad<G>(a.grad, i), k);
    const VF p = hn::Add(hn::LoadU(df, a.s0 + i), g);
    hn::StoreU(p, df, a.s0 + i);
    hn::StoreU(hn::Add(hn::LoadU(df, a.s1 + i), g), df, a.s1 + i);
    hn::StoreU(hn::Add(hn::LoadU(df, a.s2 + i), g), df, a.s2 + i);
    if constexpr (O == cai::OutKind::kF32) {
      hn::StoreU(p, df, static_cast<float*>(a.out) + i);
    } else if constexpr (O != cai::OutKind::kNone) {
      // Truncation: same bytes as the rounded conversion, less arithmetic.
      StoreU16(hn::ShiftRight<16>(hn::BitCast(du, p)), static_cast<uint16_t*>(a.out) + i);
    }
    return p;
  });
}

// ---- Gradient statistic ------------------------------------------------------

template <DType G>
HWY_NOINLINE cai::StatsPartial StatsLoop(const void* grad, size_t begin, size_t count) {
  const hn::ScalableTag<double> dd;
  const hn::Rebind<float, decltype(dd)> dfh;
  const hn::Rebind<uint32_t, decltype(dd)> duh;
  const hn::Rebind<uint16_t, decltype(dd)> du16h;
  const size_t N = hn::Lanes(dd);
  using GE = GradElem<G>;
  const GE* g = static_cast<const GE*>(grad);
  auto load = [&](const GE* ptr) {
    hn::Vec<decltype(dfh)> f;
    if constexpr (G == DType::kF32) {
      f = hn::LoadU(dfh, ptr);
    } else {
      const auto h = hn::PromoteTo(duh, hn::LoadU(du16h, ptr));
      if constexpr (G == DType::kBF16) {
        f = hn::BitCast(dfh, hn::ShiftLeft<16>(h));
      } else {
        f = F16BitsToF32(duh, h);
      }
    }
    return hn::PromoteTo(dd, f);
  };
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
