// Host twins of the CUDA kernels, the kernels the emulated host device runs
// on its stream workers: vectorized with Highway (compiled once per SIMD
// target by foreach_target, dispatched at run time), single-threaded, and bit
// for bit their scalar references (kernels_reference.cc), which the tests
// check on every target the CPU has.
//
// How each keeps the reference's bits:
//   - conversions are runtime/dtype-inl.h's integer code, bit for bit
//     runtime/dtype.h; a scale is one fp32 multiply per element, as in the
//     reference (-ffp-contract=off, see CMakeLists.txt); the last partial
//     vector of a range runs the reference itself.
//   - a same-dtype conversion without a scale is a memcpy.
//   - Accumulate: where both inputs are NaN, the result is the NaN of either
//     (see AccumulateLoop); every other element is the reference's bits.
//   - GradStats vectorizes across the 256 "threads" of a block: lane t of the
//     accumulators is thread t and adds elements t, t + 256, ... in order, the
//     fixed tree adds lanes t and t + stride as the reference does (vectors
//     while the stride spans whole vectors, scalar below); block sums are
//     combined the same way (lane t adds blocks t, t + 256, ... in order, then
//     the fixed tree). Squares of fp32 values are exact in double, so
//     only the order of the additions matters, and it is the reference's.
//     Non-finite elements are counted only in blocks whose sum is not finite
//     (a block sum is finite exactly when all its elements are).

#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "kernels/kernels_host.cc"
// foreach_target.h must come before the -inl.h it re-includes.
// clang-format off
#include "hwy/foreach_target.h"  // IWYU pragma: keep
#include "hwy/highway.h"
#include "hwy/cache_control.h"
#include "runtime/dtype-inl.h"
// clang-format on

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "kernels/elem_access.h"
#include "kernels/kernels.h"
#include "kernels/kernels_internal.h"
#include "runtime/dtype.h"

HWY_BEFORE_NAMESPACE();
namespace strata::kernels {
namespace HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;
namespace sd = ::strata::HWY_NAMESPACE;  // runtime/dtype-inl.h
using internal::ScaleMode;

template <DType T>
HWY_INLINE const void* ElemPtr(const void* base, size_t i) {
  return static_cast<const sd::StoredElem<T>*>(base) + i;
}
template <DType T>
HWY_INLINE void* ElemPtr(void* base, size_t i) {
  return static_cast<sd::StoredElem<T>*>(base) + i;
}

// ---- Convert (cast, scale, pack, unpack) ------------------------------------

// src and dst may be the same array (Scale is in place): no restrict.
template <DType S, DType D, ScaleMode M>
HWY_NOINLINE void ConvertLoop(const void* src, void* dst, size_t n, float scale) {
  const hn::ScalableTag<float> df;
  const size_t N = hn::Lanes(df);
  const auto vscale = hn::Set(df, scale);
  size_t i = 0;
  for (; i + 2 * N <= n; i += 2 * N) {
    auto v0 = sd::LoadAsF32<S>(df, src, i);
    auto v1 = sd::LoadAsF32<S>(df, src, i + N);
    if constexpr (M == ScaleMode::kMultiply) {
      v0 = hn::Mul(v0, vscale);
      v1 = hn::Mul(v1, vscale);
    }
    sd::StoreFromF32<D>(df, v0, dst, i);
    sd::StoreFromF32<D>(df, v1, dst, i + N);
  }
  if (i < n) {
    internal::ConvertReference(ElemPtr<S>(src, i), S, ElemPtr<D>(dst, i), D, n - i, scale, M);
  }
}

template <DType S, ScaleMode M>
HWY_INLINE void ConvertTo(const void* src, void* dst, DType d, size_t n, float scale) {
  switch (d) {
    case DType::kF16:
      return ConvertLoop<S, DType::kF16, M>(src, dst, n, scale);
    case DType::kBF16:
      return ConvertLoop<S, DType::kBF16, M>(src, dst, n, scale);
    default:
      return ConvertLoop<S, DType::kF32, M>(src, dst, n, scale);
  }
}

template <ScaleMode M>
HWY_INLINE void ConvertFrom(const void* src, DType s, void* dst, DType d, size_t n, float scale) {
  switch (s) {
    case DType::kF16:
      return ConvertTo<DType::kF16, M>(src, dst, d, n, scale);
    case DType::kBF16:
      return ConvertTo<DType::kBF16, M>(src, dst, d, n, scale);
    default:
      return ConvertTo<DType::kF32, M>(src, dst, d, n, scale);
  }
}

void ConvertRange(const void* src, DType s, void* dst, DType d, size_t n, float scale,
                  ScaleMode mode) {
  if (mode == ScaleMode::kMultiply) {
    ConvertFrom<ScaleMode::kMultiply>(src, s, dst, d, n, scale);
  } else {
    ConvertFrom<ScaleMode::kNone>(src, s, dst, d, n, scale);
  }
}

// ---- Accumulate ---------------------------------------------------------------

template <DType S, DType D>
HWY_NOINLINE void AccumulateLoop(const void* HWY_RESTRICT src, void* HWY_RESTRICT dst, size_t n) {
  const hn::ScalableTag<float> df;
  const size_t N = hn::Lanes(df);
  size_t i = 0;
  for (; i + 2 * N <= n; i += 2 * N) {
    // When both are NaN, x86 returns the add's first operand's NaN, and C++
    // leaves the operand order of a commutative add to the compiler (GCC 12
    // orders the reference's adds differently per dtype pair): the sum is
    // then the NaN of either input, the one case not fixed bit for bit.
    const auto v0 = hn::Add(sd::LoadAsF32<D>(df, dst, i), sd::LoadAsF32<S>(df, src, i));
    const auto v1 = hn::Add(sd::LoadAsF32<D>(df, dst, i + N), sd::LoadAsF32<S>(df, src, i + N));
    sd::StoreFromF32<D>(df, v0, dst, i);
    sd::StoreFromF32<D>(df, v1, dst, i + N);
  }
  if (i < n) {
    internal::AccumulateReference({ElemPtr<S>(src, i), n - i, S}, {ElemPtr<D>(dst, i), n - i, D});
  }
}

template <DType S>
HWY_INLINE void AccumulateTo(const void* src, void* dst, DType d, size_t n) {
  switch (d) {
    case DType::kF16:
      return AccumulateLoop<S, DType::kF16>(src, dst, n);
    case DType::kBF16:
      return AccumulateLoop<S, DType::kBF16>(src, dst, n);
    default:
      return AccumulateLoop<S, DType::kF32>(src, dst, n);
  }
}

void AccumulateRange(const void* src, DType s, void* dst, DType d, size_t n) {
  switch (s) {
    case DType::kF16:
      return AccumulateTo<DType::kF16>(src, dst, d, n);
    case DType::kBF16:
      return AccumulateTo<DType::kBF16>(src, dst, d, n);
    default:
      return AccumulateTo<DType::kF32>(src, dst, d, n);
  }
}

// ---- GradStats --------------------------------------------------------------------

constexpr size_t kThreads = kGradStatsThreads;
constexpr size_t kBlockElems = kGradStatsBlockElemsDevice;
constexpr size_t kRows = kBlockElems / kThreads;  // elements per thread

// Software prefetch distance of GradStats, in blocks: the conversions and
// the in-order adds keep too few loads in flight for the hardware
// prefetcher alone to reach memory bandwidth on one core.
constexpr size_t kPrefetchBlocks = 2;

// Elements [i, i + 2N) of a `T` array as two vectors of N doubles (exact).
// One full fp32 vector converted, then widened half by half, where the target
// has halves; two half-width loads otherwise (HWY_SCALAR).
template <class DD>
struct Widened {
  hn::Vec<DD> lo, hi;
};
template <DType T, class DD>
HWY_INLINE Widened<DD> LoadTwoAsF64(DD dd, const sd::StoredElem<T>* HWY_RESTRICT p, size_t i) {
#if HWY_TARGET == HWY_SCALAR
  const hn::Rebind<float, DD> dfr;
  const size_t N = hn::Lanes(dd);
  return {hn::PromoteTo(dd, sd::LoadAsF32<T>(dfr, p, i)),
          hn::PromoteTo(dd, sd::LoadAsF32<T>(dfr, p, i + N))};
#else
  const hn::Repartition<float, DD> df;  // twice the lanes of dd
  const hn::Half<decltype(df)> dfh;
  const auto f = sd::LoadAsF32<T>(df, p, i);
  return {hn::PromoteTo(dd, hn::LowerHalf(dfh, f)), hn::PromoteTo(dd, hn::UpperHalf(dfh, f))};
#endif
}

// The sum of one full block of kBlockElems elements, in the reference's order;
// prefetches the block at `ahead` (or nothing) meanwhile.
template <DType T>
HWY_INLINE double BlockSum(const sd::StoredElem<T>* HWY_RESTRICT block,
                           const sd::StoredElem<T>* ahead, double* HWY_RESTRICT partial) {
  const hn::ScalableTag<double> dd;
  const size_t N = hn::Lanes(dd);
  // Row by row: lane t of partial[] is thread t; each row adds one element
  // to every thread, in row order, so each thread's additions stay in order.
  // The rows stream through memory in address order.
  for (size_t j = 0; j < kThreads; j += 2 * N) {
    const auto x = LoadTwoAsF64<T>(dd, block, j);
    hn::Store(hn::Mul(x.lo, x.lo), dd, partial + j);  // +0 + x^2 is x^2
    hn::Store(hn::Mul(x.hi, x.hi), dd, partial + j + N);
  }
  for (size_t k = 1; k < kRows; ++k) {
    if (ahead != nullptr) {
      const auto* row = reinterpret_cast<const char*>(ahead + k * kThreads);
      for (size_t b = 0; b < kThreads * sizeof(*block); b += 64) hwy::Prefetch(row + b);
    }
    for (size_t j = 0; j < kThreads; j += 2 * N) {
      const auto x = LoadTwoAsF64<T>(dd, block, k * kThreads + j);
      hn::Store(hn::Add(hn::Load(dd, partial + j), hn::Mul(x.lo, x.lo)), dd, partial + j);
      hn::Store(hn::Add(hn::Load(dd, partial + j + N), hn::Mul(x.hi, x.hi)), dd, partial + j + N);
    }
  }
  size_t stride = kThreads / 2;
  for (; stride >= N; stride /= 2) {
    for (size_t t = 0; t < stride; t += N) {
      hn::Store(hn::Add(hn::Load(dd, partial + t), hn::Load(dd, partial + t + stride)), dd,
                partial + t);
    }
  }
  for (; stride > 0; stride /= 2) {
    for (size_t t = 0; t < stride; ++t) partial[t] = partial[t] + partial[t + stride];
  }
  return partial[0];
}

template <DType T>
uint64_t CountNonFinite(const sd::StoredElem<T>* block, size_t n) {
  uint64_t count = 0;
  for (size_t i = 0; i < n; ++i) count += std::isfinite(internal::LoadElem(block, T, i)) ? 0 : 1;
  return count;
}

template <DType T>
HWY_NOINLINE DeviceGradStats GradStatsLoop(const void* grad, size_t elems) {
  static_assert(kThreads % (8 * HWY_MAX_BYTES / sizeof(double)) == 0);
  using E = sd::StoredElem<T>;
  const E* g = static_cast<const E*>(grad);
  alignas(HWY_MAX_BYTES) double partial[kThreads];
  double lanes[kThreads] = {};  // lane t: the sums of blocks t, t + 256, ...
  uint64_t nonfinite = 0;
  size_t begin = 0;
  size_t block = 0;
  for (; begin + kBlockElems <= elems; begin += kBlockElems, ++block) {
    const size_t ahead = begin + kPrefetchBlocks * kBlockElems;
    const double sum =
        BlockSum<T>(g + begin, ahead + kBlockElems <= elems ? g + ahead : nullptr, partial);
    if (!std::isfinite(sum)) nonfinite += CountNonFinite<T>(g + begin, kBlockElems);
    double& lane = lanes[block % kThreads];
    lane = lane + sum;
  }
  if (begin < elems) {
    // The last, partial block on a zero-padded copy: a thread past the end
    // adds +0 to +0, one inside adds +0 after its last element, and x + 0 is
    // x for every sum of squares (>= +0, inf or NaN): the reference's bits.
    alignas(HWY_MAX_BYTES) E padded[kBlockElems] = {};
    std::memcpy(padded, g + begin, (elems - begin) * sizeof(E));
    const double sum = BlockSum<T>(padded, nullptr, partial);
    if (!std::isfinite(sum)) nonfinite += CountNonFinite<T>(padded, elems - begin);
    double& lane = lanes[block % kThreads];
    lane = lane + sum;
  }
  for (size_t stride = kThreads / 2; stride > 0; stride /= 2) {
    for (size_t t = 0; t < stride; ++t) lanes[t] = lanes[t] + lanes[t + stride];
  }
  return DeviceGradStats{lanes[0], nonfinite};
}

// Unscaled: the caller multiplies by grad_scale^2.
DeviceGradStats GradStatsRange(const void* grad, DType dtype, size_t elems) {
  switch (dtype) {
    case DType::kF16:
      return GradStatsLoop<DType::kF16>(grad, elems);
    case DType::kBF16:
      return GradStatsLoop<DType::kBF16>(grad, elems);
    default:
      return GradStatsLoop<DType::kF32>(grad, elems);
  }
}

// ---- Traffic baselines ----------------------------------------------------------

// Same element width: the bytes themselves.
HWY_NOINLINE uint64_t BaselineSameWidth(internal::BaselineKind kind, const uint8_t* src,
                                        uint8_t* dst, size_t bytes, uint8_t zero) {
  const hn::ScalableTag<uint8_t> d8;
  const size_t N = hn::Lanes(d8);
  const auto k = hn::Set(d8, zero);
  size_t i = 0;
  if (kind == internal::BaselineKind::kReadOnly) {
    const hn::ScalableTag<uint64_t> d64;
    auto sum = hn::Zero(d64);
    for (; i + N <= bytes; i += N) {
      sum = hn::Add(sum, hn::SumsOf8(hn::LoadU(d8, src + i)));
    }
    uint64_t s = hn::GetLane(hn::SumOfLanes(d64, sum));
    for (; i < bytes; ++i) s += src[i];
    return s;
  }
  if (kind == internal::BaselineKind::kWrite) {
    for (; i + N <= bytes; i += N) hn::StoreU(hn::LoadU(d8, src + i), d8, dst + i);
    for (; i < bytes; ++i) dst[i] = src[i];
  } else {
    for (; i + N <= bytes; i += N) {
      hn::StoreU(hn::Or(hn::LoadU(d8, dst + i), hn::And(hn::LoadU(d8, src + i), k)), d8, dst + i);
    }
    for (; i < bytes; ++i) dst[i] = static_cast<uint8_t>(dst[i] | (src[i] & zero));
  }
  return dst[0];
}

// Elements of 4 bytes to 2 (their high half) or of 2 bytes to 4 (shifted
// into the high half), in u32 lanes.
template <class SrcT, class DstT>
HWY_NOINLINE uint64_t BaselineResize(internal::BaselineKind kind, const SrcT* src, DstT* dst,
                                     size_t n, uint32_t zero) {
  static_assert(sizeof(SrcT) + sizeof(DstT) == 6);
  const hn::ScalableTag<uint32_t> du;
  const hn::Rebind<uint16_t, decltype(du)> du16;
  const size_t N = hn::Lanes(du);
  const auto k = hn::Set(du, zero);
  auto load = [&](const auto* p) {
    if constexpr (sizeof(*p) == 4) {
      return hn::LoadU(du, p);
    } else {
      return hn::PromoteTo(du, hn::LoadU(du16, p));
    }
  };
  auto resize = [](auto v) {
    if constexpr (sizeof(SrcT) == 4) {
      return hn::ShiftRight<16>(v);
    } else {
      return hn::ShiftLeft<16>(v);
    }
  };
  size_t i = 0;
  for (; i + N <= n; i += N) {
    auto x = resize(load(src + i));
    if (kind == internal::BaselineKind::kReadModWrite) x = hn::Or(load(dst + i), hn::And(x, k));
    if constexpr (sizeof(DstT) == 4) {
      hn::StoreU(x, du, dst + i);
    } else {
      sd::StoreU16(du, x, dst + i);
    }
  }
  for (; i < n; ++i) {
    const uint32_t v = src[i];
    const auto x = static_cast<DstT>(sizeof(SrcT) == 4 ? v >> 16 : v << 16);
    dst[i] = kind == internal::BaselineKind::kWrite ? x : static_cast<DstT>(dst[i] | (x & zero));
  }
  return dst[0];
}

uint64_t TrafficBaselineRange(internal::BaselineKind kind, const void* src, size_t src_elem_bytes,
                              void* dst, size_t dst_elem_bytes, size_t elems, uint32_t zero) {
  if (kind == internal::BaselineKind::kReadOnly || src_elem_bytes == dst_elem_bytes) {
    return BaselineSameWidth(kind, static_cast<const uint8_t*>(src), static_cast<uint8_t*>(dst),
                             elems * src_elem_bytes, static_cast<uint8_t>(zero));
  }
  if (src_elem_bytes == 4) {
    return BaselineResize(kind, static_cast<const uint32_t*>(src), static_cast<uint16_t*>(dst),
                          elems, zero);
  }
  return BaselineResize(kind, static_cast<const uint16_t*>(src), static_cast<uint32_t*>(dst), elems,
                        zero);
}

const char* TargetOfThisTarget() { return hwy::TargetName(HWY_TARGET); }

// NOLINTNEXTLINE(google-readability-namespace-comments)
}  // namespace HWY_NAMESPACE
}  // namespace strata::kernels
HWY_AFTER_NAMESPACE();

#if HWY_ONCE

namespace strata::kernels {

HWY_EXPORT(ConvertRange);
HWY_EXPORT(AccumulateRange);
HWY_EXPORT(GradStatsRange);
HWY_EXPORT(TrafficBaselineRange);
HWY_EXPORT(TargetOfThisTarget);

namespace internal {

void ConvertHost(const void* src, DType src_dtype, void* dst, DType dst_dtype, size_t elems,
                 float scale, ScaleMode mode) {
  if (elems == 0) return;
  if (src_dtype == dst_dtype && mode == ScaleMode::kNone) {
    std::memcpy(dst, src, elems * DTypeSize(dst_dtype));
    return;
  }
  HWY_DYNAMIC_DISPATCH(ConvertRange)(src, src_dtype, dst, dst_dtype, elems, scale, mode);
}

std::vector<ElemRange> PaddingRanges(std::vector<ElemRange> used, size_t bucket_elems) {
  std::sort(used.begin(), used.end(),
            [](const ElemRange& a, const ElemRange& b) { return a.begin < b.begin; });
  std::vector<ElemRange> gaps;
  size_t pos = 0;
  for (const ElemRange& r : used) {
    if (r.begin > pos) gaps.push_back({pos, r.begin});
    pos = std::max(pos, r.end);
  }
  if (pos < bucket_elems) gaps.push_back({pos, bucket_elems});
  return gaps;
}

void PackGradsHost(std::span<const PackEntry> entries, DeviceTensor bucket, float scale) {
  const size_t elem_bytes = DTypeSize(bucket.dtype);
  auto* base = static_cast<std::byte*>(bucket.data);
  std::vector<ElemRange> used;
  used.reserve(entries.size());
  for (const PackEntry& e : entries) {
    ConvertHost(e.tensor.data, e.tensor.dtype, base + e.offset_elems * elem_bytes, bucket.dtype,
                e.tensor.elems, scale, ScaleModeOf(scale));
    used.push_back({e.offset_elems, e.offset_elems + e.tensor.elems});
  }
  // All-zero bits are +0 in fp32, fp16 and bf16.
  for (const ElemRange& gap : PaddingRanges(std::move(used), bucket.elems)) {
    std::memset(base + gap.begin * elem_bytes, 0, (gap.end - gap.begin) * elem_bytes);
  }
}

void UnpackParamsHost(ConstDeviceTensor bucket, std::span<const UnpackEntry> entries) {
  const size_t elem_bytes = DTypeSize(bucket.dtype);
  const auto* base = static_cast<const std::byte*>(bucket.data);
  for (const UnpackEntry& e : entries) {
    ConvertHost(base + e.offset_elems * elem_bytes, bucket.dtype, e.tensor.data, e.tensor.dtype,
                e.tensor.elems, 1.0f, ScaleMode::kNone);
  }
}

void AccumulateHost(ConstDeviceTensor src, DeviceTensor dst) {
  if (dst.elems == 0) return;
  HWY_DYNAMIC_DISPATCH(AccumulateRange)(src.data, src.dtype, dst.data, dst.dtype, dst.elems);
}

void GradStatsHost(ConstDeviceTensor grad, float grad_scale, void* stats_buffer) {
  DeviceGradStats result = HWY_DYNAMIC_DISPATCH(GradStatsRange)(grad.data, grad.dtype, grad.elems);
  const double s = static_cast<double>(grad_scale);
  result.sum_sq = result.sum_sq * (s * s);
  std::memcpy(stats_buffer, &result, sizeof(result));
}

std::string_view HostTwinTarget() { return HWY_DYNAMIC_DISPATCH(TargetOfThisTarget)(); }

uint64_t TrafficBaselineHost(BaselineKind kind, const void* src, size_t src_elem_bytes, void* dst,
                             size_t dst_elem_bytes, size_t elems) {
  // A zero the compiler cannot see, so the baselines' stores cannot be elided.
  static volatile uint32_t zero = 0;
  return HWY_DYNAMIC_DISPATCH(TrafficBaselineRange)(kind, src, src_elem_bytes, dst, dst_elem_bytes,
                                                    elems, zero);
}

}  // namespace internal
}  // namespace strata::kernels

#endif  // HWY_ONCE
