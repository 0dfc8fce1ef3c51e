// Highway versions of runtime/dtype.h's conversions, bit for bit the scalar
// functions there (round to nearest even, NaN kept quiet with its sign, fp16
// subnormals). Highway 1.0.3's bf16 DemoteTo truncates, so bf16 is written
// with integer operations; fp16 uses the hardware conversion (F16C) where the
// target has it, except for vectors holding a NaN (the hardware's NaN bits
// differ from dtype.h's), which take the integer path as targets without
// F16C do. Internal: included, per SIMD target, by the
// Highway sources of cpu_adam and kernels (foreach_target), never by a public
// header. Users link hwy::hwy themselves.
//
//   const hn::ScalableTag<float> df;
//   VF v = LoadAsF32<DType::kBF16>(src, i);     // lanes [i, i + Lanes(df))
//   StoreFromF32<DType::kF16>(v, dst, i);
//
// 16-bit values travel in u32 lanes (F16BitsToF32, F32BitsToBF16,
// F32BitsToF16) so the same code serves full and half-width tags.

#if defined(STRATA_RUNTIME_DTYPE_INL_H_) == defined(HWY_TARGET_TOGGLE)
#ifdef STRATA_RUNTIME_DTYPE_INL_H_
#undef STRATA_RUNTIME_DTYPE_INL_H_
#else
#define STRATA_RUNTIME_DTYPE_INL_H_
#endif

#include <cstddef>
#include <cstdint>
#include <type_traits>

#include "hwy/highway.h"
#include "runtime/dtype.h"

HWY_BEFORE_NAMESPACE();
namespace strata {
namespace HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

// fp16 bits (in u32 lanes) -> fp32, as F16ToF32.
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

// fp32 bits -> bf16 bits (in u32 lanes), as F32ToBF16.
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

// fp32 bits -> fp16 bits (in u32 lanes), as F32ToF16.
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

// u32 lanes holding values <= 0xffff -> as many u16 lanes.
template <class D>
HWY_INLINE auto NarrowToU16(D du, hn::Vec<D> bits) {
  const hn::RebindToSigned<D> di;
  const hn::Rebind<uint16_t, D> du16;
  return hn::DemoteTo(du16, hn::BitCast(di, bits));
}

// u32 lanes holding values <= 0xffff -> u16 stored at `dst` (unaligned).
template <class D>
HWY_INLINE void StoreU16(D du, hn::Vec<D> bits, uint16_t* HWY_RESTRICT dst) {
  hn::StoreU(NarrowToU16(du, bits), hn::Rebind<uint16_t, D>(), dst);
}

// Whether this target converts fp16 in hardware (F16C: AVX2 and up on x86).
// Bit for bit dtype.h for every non-NaN value (round to nearest even, fp16
// subnormals, overflow to inf); NaNs differ (the hardware quiets signalling
// NaNs and keeps fp32 payload bits), so a vector holding a NaN takes the
// integer path instead.
#undef STRATA_DTYPE_HW_F16  // defined once per target
#if HWY_ARCH_X86 && HWY_TARGET <= HWY_AVX2 && !defined(HWY_DISABLE_F16C)
#define STRATA_DTYPE_HW_F16 1
#else
#define STRATA_DTYPE_HW_F16 0
#endif

// The element type of a float dtype in memory: fp16/bf16 are raw bits.
template <DType T>
using StoredElem = std::conditional_t<T == DType::kF32, float, uint16_t>;

// Lanes [i, i + Lanes(df)) of a `T` array, converted to fp32 (exact). `df`
// may be any float tag (full or half width).
template <DType T, class DF>
HWY_INLINE hn::Vec<DF> LoadAsF32(DF df, const void* HWY_RESTRICT base, size_t i) {
  if constexpr (T == DType::kF32) {
    return hn::LoadU(df, static_cast<const float*>(base) + i);
  } else {
    const hn::RebindToUnsigned<DF> du;
    const hn::Rebind<uint16_t, DF> du16;
    const auto raw = hn::LoadU(du16, static_cast<const uint16_t*>(base) + i);
    if constexpr (T == DType::kBF16) {
      return hn::BitCast(df, hn::ShiftLeft<16>(hn::PromoteTo(du, raw)));
    } else {
#if STRATA_DTYPE_HW_F16
      const hn::Rebind<hwy::float16_t, DF> df16;
      const auto f = hn::PromoteTo(df, hn::BitCast(df16, raw));
      if (HWY_LIKELY(hn::AllFalse(df, hn::IsNaN(f)))) return f;
#endif
      return F16BitsToF32(du, hn::PromoteTo(du, raw));
    }
  }
}

// fp32 lanes -> the lanes of a `T` array, converted as dtype.h does: fp32
// itself, or fp16/bf16 bits in as many u16 lanes. `df` may be any float tag.
template <DType T, class DF>
HWY_INLINE auto ConvertFromF32(DF df, hn::Vec<DF> v) {
  if constexpr (T == DType::kF32) {
    return v;
  } else {
    const hn::RebindToUnsigned<DF> du;
    const auto u = hn::BitCast(du, v);
    if constexpr (T == DType::kBF16) {
      return NarrowToU16(du, F32BitsToBF16(du, u));
    } else {
#if STRATA_DTYPE_HW_F16
      if (HWY_LIKELY(hn::AllFalse(df, hn::IsNaN(v)))) {
        const hn::Rebind<uint16_t, DF> du16;
        const hn::Rebind<hwy::float16_t, DF> df16;
        return hn::BitCast(du16, hn::DemoteTo(df16, v));
      }
#endif
      return NarrowToU16(du, F32BitsToF16(du, u));
    }
  }
}

// Stores fp32 lanes `v` at [i, i + Lanes(df)) of a `T` array, converted as
// dtype.h does.
template <DType T, class DF>
HWY_INLINE void StoreFromF32(DF df, hn::Vec<DF> v, void* HWY_RESTRICT base, size_t i) {
  const hn::Rebind<StoredElem<T>, DF> d;
  hn::StoreU(ConvertFromF32<T>(df, v), d, static_cast<StoredElem<T>*>(base) + i);
}

// How a vector goes to memory. kStream: a non-temporal store, which writes
// the line without reading it first, so write-only output that nobody reads
// soon costs one byte of DRAM traffic per byte instead of two. Only on x86,
// only whole vectors of 16 bytes or more (narrower ones would store 16), at
// an address aligned to the vector; the writer calls hwy::FlushStream()
// before another thread may read what it wrote.
enum class StoreKind : uint8_t { kCached, kStream };

template <class D>
constexpr bool kCanStream = HWY_ARCH_X86 && HWY_TARGET != HWY_EMU128 &&
                            HWY_TARGET != HWY_SCALAR &&
                            hn::MaxLanes(D()) * sizeof(hn::TFromD<D>) >= 16;

// kStream where vectors of `d` stored from `dst` on, in whole-vector steps,
// may all be streamed; else kCached.
template <class D>
HWY_INLINE StoreKind StoreKindFrom(D d, const void* dst) {
  if constexpr (kCanStream<D>) {
    const size_t vector_bytes = hn::MaxLanes(d) * sizeof(hn::TFromD<D>);
    if (reinterpret_cast<uintptr_t>(dst) % vector_bytes == 0) return StoreKind::kStream;
  }
  return StoreKind::kCached;
}

// Stores `v` at `dst` as `kind` says (kStream only as StoreKindFrom allows).
template <class D>
HWY_INLINE void StoreAs(StoreKind kind, hn::Vec<D> v, D d, hn::TFromD<D>* HWY_RESTRICT dst) {
  if constexpr (kCanStream<D>) {
    if (kind == StoreKind::kStream) {
      hn::Stream(v, d, dst);
      return;
    }
  }
  hn::StoreU(v, d, dst);
}

}  // namespace HWY_NAMESPACE
}  // namespace strata
HWY_AFTER_NAMESPACE();

#endif  // STRATA_RUNTIME_DTYPE_INL_H_
