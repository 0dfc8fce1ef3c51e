// The host twins on every SIMD target this CPU supports (Highway's
// HWY_EXPORT_AND_TEST_P makes one test per target and makes the library
// dispatch to it) against their scalar references (kernels_reference.cc), bit
// for bit: every dtype pair, odd lengths, unaligned starts, NaN/inf/subnormal
// and rounding-tie patterns (every pair of them for the two-input kernels),
// scale 1 and not 1, in place; same-dtype conversions without a scale are
// copies of the bits; grad stats with the documented order (same bits as the
// reference, exact non-finite counts).

#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "tests/kernels/kernels_simd_test.cc"
// clang-format off
#include "hwy/foreach_target.h"  // IWYU pragma: keep
#include "hwy/highway.h"
#include "hwy/tests/hwy_gtest.h"
// clang-format on

#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "kernels/kernels.h"
#include "kernels/kernels_internal.h"
#include "runtime/dtype.h"
#include "tests/kernels/kernels_test_util.h"

HWY_BEFORE_NAMESPACE();
// Not strata::kernels: its `testing` namespace would hide gtest's from the
// HWY_EXPORT_AND_TEST_P macros.
namespace strata::kernels_simd_test {
namespace HWY_NAMESPACE {
namespace {

namespace ki = ::strata::kernels::internal;
namespace kt = ::strata::kernels::testing;
using ki::ScaleMode;
using kt::FirstAccumulateDifference;
using kt::FirstBitDifference;
using kt::kFloatTypes;
using kt::RandomTensor;
using ::strata::kernels::ConstDeviceTensor;
using ::strata::kernels::DeviceGradStats;
using ::strata::kernels::GradStatsBufferBytes;
using ::strata::kernels::kGradStatsBlockElemsDevice;
using ::strata::kernels::kGradStatsThreads;
using ::strata::kernels::PackEntry;
using ::strata::kernels::UnpackEntry;

// Shorter than, equal to and longer than one or two vectors of every target,
// a GradStats block, and more.
constexpr size_t kLengths[] = {0,  1,  2,  3,  7,   8,   15,  16,   17,  31,
                               33, 63, 64, 65, 127, 129, 257, 1000, 4097};
// Element offsets of the first element from a 64-byte boundary.
constexpr size_t kSrcMisalign[] = {0, 1, 3};
constexpr size_t kDstMisalign[] = {0, 2};
// Guard elements before and after every destination: must stay untouched.
constexpr size_t kGuard = 16;

std::string Where(DType s, DType d, size_t n) {
  return std::string(DTypeName(s)) + "->" + std::string(DTypeName(d)) + " n=" + std::to_string(n) +
         " target " + hwy::TargetName(HWY_TARGET);
}

// `elems` elements starting `misalign` elements past a 64-byte boundary,
// with kGuard guard elements on each side filled with 0x5a.
class Placed {
 public:
  Placed(DType dtype, size_t elems, size_t misalign)
      : dtype_(dtype),
        elems_(elems),
        words_((elems + 2 * kGuard + misalign) * DTypeSize(dtype) / 8 + 16),
        begin_(reinterpret_cast<std::byte*>(Align64(words_.data())) +
               (misalign + kGuard) * DTypeSize(dtype)) {
    std::memset(words_.data(), 0x5a, words_.size() * 8);
  }
  Placed(DType dtype, const std::vector<std::byte>& values, size_t misalign)
      : Placed(dtype, values.size() / DTypeSize(dtype), misalign) {
    if (!values.empty()) std::memcpy(begin_, values.data(), values.size());
  }
  std::byte* data() { return begin_; }
  std::vector<std::byte> Values() const {
    return std::vector<std::byte>(begin_, begin_ + elems_ * DTypeSize(dtype_));
  }
  bool GuardsIntact() const {
    const size_t g = kGuard * DTypeSize(dtype_);
    for (size_t i = 0; i < g; ++i) {
      if (begin_[-1 - static_cast<ptrdiff_t>(i)] != std::byte{0x5a}) return false;
      if (begin_[elems_ * DTypeSize(dtype_) + i] != std::byte{0x5a}) return false;
    }
    return true;
  }

 private:
  static uint64_t* Align64(uint64_t* p) {
    return reinterpret_cast<uint64_t*>((reinterpret_cast<uintptr_t>(p) + 63) / 64 * 64);
  }
  DType dtype_;
  size_t elems_;
  std::vector<uint64_t> words_;
  std::byte* begin_;
};

// What a conversion must produce: the scalar reference, or the bits
// themselves for a same-dtype conversion without a scale.
std::vector<std::byte> ExpectedConvert(const std::vector<std::byte>& src, DType s, DType d,
                                       float scale, ScaleMode mode) {
  const size_t n = src.size() / DTypeSize(s);
  if (s == d && mode == ScaleMode::kNone) return src;
  std::vector<std::byte> want(n * DTypeSize(d));
  ki::ConvertReference(src.data(), s, want.data(), d, n, scale, mode);
  return want;
}

struct ScaleCase {
  float scale;
  ScaleMode mode;
};
// 1 without and with the multiply (Scale(x, 1) multiplies), ordinary scales,
// one that makes fp16 subnormals of normals, one that overflows, -0.
const ScaleCase kScales[] = {{1.0f, ScaleMode::kNone},         {1.0f, ScaleMode::kMultiply},
                             {0.25f, ScaleMode::kMultiply},    {3.0f, ScaleMode::kMultiply},
                             {0x1p-20f, ScaleMode::kMultiply}, {1e30f, ScaleMode::kMultiply},
                             {-0.0f, ScaleMode::kMultiply}};

void TestDispatchesToThisTarget() {
  EXPECT_EQ(std::string(ki::HostTwinTarget()), std::string(hwy::TargetName(HWY_TARGET)));
}

void TestConvertMatchesReference() {
  std::mt19937_64 rng(kt::TestSeed());
  for (DType s : kFloatTypes) {
    for (DType d : kFloatTypes) {
      for (size_t n : kLengths) {
        for (const ScaleCase& sc : kScales) {
          const auto src = RandomTensor(s, n, rng);
          const auto want = ExpectedConvert(src, s, d, sc.scale, sc.mode);
          for (size_t ms : kSrcMisalign) {
            for (size_t md : kDstMisalign) {
              SCOPED_TRACE(Where(s, d, n) + " scale " + std::to_string(sc.scale) +
                           (sc.mode == ScaleMode::kNone ? " (none)" : "") + " misalign " +
                           std::to_string(ms) + "/" + std::to_string(md));
              Placed in(s, src, ms);
              Placed out(d, n, md);
              ki::ConvertHost(in.data(), s, out.data(), d, n, sc.scale, sc.mode);
              const auto got = out.Values();
              ASSERT_EQ(FirstBitDifference(got.data(), want.data(), d, n), "");
              ASSERT_TRUE(out.GuardsIntact());
            }
          }
        }
      }
    }
  }
}

void TestScaleInPlaceMatchesReference() {
  std::mt19937_64 rng(kt::TestSeed());
  for (DType t : kFloatTypes) {
    for (size_t n : kLengths) {
      for (const ScaleCase& sc : kScales) {
        SCOPED_TRACE(Where(t, t, n) + " in place, scale " + std::to_string(sc.scale));
        const auto x = RandomTensor(t, n, rng);
        const auto want = ExpectedConvert(x, t, t, sc.scale, ScaleMode::kMultiply);
        Placed io(t, x, 1);
        ki::ConvertHost(io.data(), t, io.data(), t, n, sc.scale, ScaleMode::kMultiply);
        const auto got = io.Values();
        ASSERT_EQ(FirstBitDifference(got.data(), want.data(), t, n), "");
        ASSERT_TRUE(io.GuardsIntact());
      }
    }
  }
}

// Every special value of a dtype (SpecialF32Bits / SpecialHalfBits) as a tensor.
std::vector<std::byte> Specials(DType t) {
  std::vector<std::byte> out;
  if (t == DType::kF32) {
    for (uint32_t b : kt::SpecialF32Bits()) {
      out.resize(out.size() + 4);
      std::memcpy(out.data() + out.size() - 4, &b, 4);
    }
  } else {
    for (uint16_t b : kt::SpecialHalfBits(t)) {
      out.resize(out.size() + 2);
      std::memcpy(out.data() + out.size() - 2, &b, 2);
    }
  }
  return out;
}

// Tensors a, b of every pair (special value of `ta`, special value of `tb`),
// repeated to `min_elems` or more so the vector path sees them all.
void SpecialPairs(DType ta, DType tb, size_t min_elems, std::vector<std::byte>* a,
                  std::vector<std::byte>* b) {
  const auto sa = Specials(ta), sb = Specials(tb);
  const size_t ka = sa.size() / DTypeSize(ta), kb = sb.size() / DTypeSize(tb);
  const size_t n = (min_elems + ka * kb - 1) / (ka * kb) * (ka * kb);
  a->resize(n * DTypeSize(ta));
  b->resize(n * DTypeSize(tb));
  for (size_t i = 0; i < n; ++i) {
    const size_t pair = i % (ka * kb);
    std::memcpy(a->data() + i * DTypeSize(ta), sa.data() + (pair / kb) * DTypeSize(ta),
                DTypeSize(ta));
    std::memcpy(b->data() + i * DTypeSize(tb), sb.data() + (pair % kb) * DTypeSize(tb),
                DTypeSize(tb));
  }
}

void TestAccumulateMatchesReference() {
  std::mt19937_64 rng(kt::TestSeed());
  for (DType s : kFloatTypes) {
    for (DType d : kFloatTypes) {
      for (size_t n : kLengths) {
        const auto src = RandomTensor(s, n, rng);
        const auto dst0 = RandomTensor(d, n, rng);
        auto want = dst0;
        ki::AccumulateReference({src.data(), n, s}, {want.data(), n, d});
        for (size_t ms : kSrcMisalign) {
          for (size_t md : kDstMisalign) {
            SCOPED_TRACE(Where(s, d, n) + " misalign " + std::to_string(ms) + "/" +
                         std::to_string(md));
            Placed in(s, src, ms);
            Placed io(d, dst0, md);
            ki::AccumulateHost({in.data(), n, s}, {io.data(), n, d});
            ASSERT_EQ(FirstAccumulateDifference(io.Values(), want, src, dst0, s, d), "");
            ASSERT_TRUE(io.GuardsIntact());
          }
        }
      }
    }
  }
}

// NaN + NaN (whose payload survives), inf + -inf, subnormal sums, ties: every
// pair of special values, through the vector path.
void TestAccumulateEveryPairOfSpecialValues() {
  for (DType s : kFloatTypes) {
    for (DType d : kFloatTypes) {
      std::vector<std::byte> dst, src;
      SpecialPairs(d, s, 1024, &dst, &src);
      const size_t n = dst.size() / DTypeSize(d);
      SCOPED_TRACE(Where(s, d, n) + " special pairs");
      const auto dst0 = dst;
      auto want = dst;
      ki::AccumulateReference({src.data(), n, s}, {want.data(), n, d});
      ki::AccumulateHost({src.data(), n, s}, {dst.data(), n, d});
      EXPECT_EQ(FirstAccumulateDifference(dst, want, src, dst0, s, d), "");
    }
  }
}

// Special values times special-ish scales, every dtype pair.
void TestConvertSpecialValuesTimesScales() {
  for (DType s : kFloatTypes) {
    for (DType d : kFloatTypes) {
      std::vector<std::byte> src = Specials(s);
      while (src.size() < 512 * DTypeSize(s)) src.insert(src.end(), src.begin(), src.end());
      const size_t n = src.size() / DTypeSize(s);
      for (float scale :
           {0.5f, 2.0f, 65536.0f, 0x1p-24f, std::numeric_limits<float>::infinity(), -1.0f}) {
        SCOPED_TRACE(Where(s, d, n) + " specials x " + std::to_string(scale));
        const auto want = ExpectedConvert(src, s, d, scale, ScaleMode::kMultiply);
        std::vector<std::byte> got(n * DTypeSize(d));
        ki::ConvertHost(src.data(), s, got.data(), d, n, scale, ScaleMode::kMultiply);
        EXPECT_EQ(FirstBitDifference(got.data(), want.data(), d, n), "");
      }
    }
  }
}

// Exhaustive over the 16-bit formats: every fp16/bf16 pattern to fp32, and
// every fp32 value at, just below, on and just above the rounding midpoint
// between two neighbouring 16-bit values, to fp16/bf16. NaNs come in their own
// vectors, so the vectors without one take the hardware fp16 conversion where
// the target has it, and the ones with NaNs the integer path.
void TestHalfConversionsExhaustive() {
  for (DType h : {DType::kF16, DType::kBF16}) {
    auto to_f32 = [h](uint16_t bits) {
      return h == DType::kF16 ? F16ToF32(bits) : BF16ToF32(bits);
    };
    std::vector<uint16_t> finite, nans;
    for (uint32_t b = 0; b <= 0xffff; ++b) {
      const auto bits = static_cast<uint16_t>(b);
      (std::isnan(to_f32(bits)) ? nans : finite).push_back(bits);
    }
    for (const auto* set : {&finite, &nans}) {
      const size_t n = set->size();
      SCOPED_TRACE(std::string(DTypeName(h)) + (set == &nans ? " NaNs" : " non-NaNs") + " target " +
                   hwy::TargetName(HWY_TARGET));
      std::vector<std::byte> src(n * 2);
      std::memcpy(src.data(), set->data(), n * 2);
      const auto want = ExpectedConvert(src, h, DType::kF32, 1.0f, ScaleMode::kNone);
      std::vector<std::byte> got(n * 4);
      ki::ConvertHost(src.data(), h, got.data(), DType::kF32, n, 1.0f, ScaleMode::kNone);
      ASSERT_EQ(FirstBitDifference(got.data(), want.data(), DType::kF32, n), "");
      // fp32 around each value's upper rounding midpoint: v, mid - 1ulp, mid,
      // mid + 1ulp (the fp32 neighbours of the midpoint).
      std::vector<uint32_t> f32;
      for (size_t i = 0; i < n; ++i) {
        const uint32_t v = std::bit_cast<uint32_t>(to_f32((*set)[i]));
        const uint32_t mid = h == DType::kBF16 ? v + 0x8000u : v + 0x1000u;
        for (uint32_t b : {v, mid - 1, mid, mid + 1}) f32.push_back(b);
      }
      std::vector<std::byte> wide(f32.size() * 4);
      std::memcpy(wide.data(), f32.data(), wide.size());
      const auto want16 = ExpectedConvert(wide, DType::kF32, h, 1.0f, ScaleMode::kNone);
      std::vector<std::byte> got16(f32.size() * 2);
      ki::ConvertHost(wide.data(), DType::kF32, got16.data(), h, f32.size(), 1.0f,
                      ScaleMode::kNone);
      ASSERT_EQ(FirstBitDifference(got16.data(), want16.data(), h, f32.size()), "");
    }
  }
}

void TestPackAndUnpackMatchReference() {
  std::mt19937_64 rng(kt::TestSeed());
  // Odd sizes at odd offsets: every entry starts unaligned somewhere.
  const std::vector<DType> dtypes = {DType::kBF16, DType::kF32, DType::kF16, DType::kBF16};
  const std::vector<size_t> elems = {1001, 3, 517, 64};
  const std::vector<size_t> offsets = {1700, 1, 9, 2900};  // gaps before, between, after
  const size_t bucket_elems = 2999;
  for (DType bt : kFloatTypes) {
    for (float scale : {1.0f, 0.5f}) {
      SCOPED_TRACE(std::string("bucket ") + std::string(DTypeName(bt)) + " scale " +
                   std::to_string(scale) + " target " + hwy::TargetName(HWY_TARGET));
      const ScaleMode mode = ki::ScaleModeOf(scale);
      std::vector<std::vector<std::byte>> srcs;
      std::vector<PackEntry> entries;
      std::vector<std::byte> want(bucket_elems * DTypeSize(bt), std::byte{0});
      for (size_t k = 0; k < dtypes.size(); ++k) {
        srcs.push_back(RandomTensor(dtypes[k], elems[k], rng));
        const auto part = ExpectedConvert(srcs[k], dtypes[k], bt, scale, mode);
        std::memcpy(want.data() + offsets[k] * DTypeSize(bt), part.data(), part.size());
      }
      for (size_t k = 0; k < dtypes.size(); ++k) {
        entries.push_back({{srcs[k].data(), elems[k], dtypes[k]}, offsets[k]});
      }
      std::vector<std::byte> bucket(want.size(), std::byte{0xff});
      ki::PackGradsHost(entries, {bucket.data(), bucket_elems, bt}, scale);
      ASSERT_EQ(FirstBitDifference(bucket.data(), want.data(), bt, bucket_elems), "");

      std::vector<std::vector<std::byte>> outs;
      std::vector<UnpackEntry> un;
      for (size_t k = 0; k < dtypes.size(); ++k) {
        outs.emplace_back(elems[k] * DTypeSize(dtypes[k]), std::byte{0x77});
      }
      for (size_t k = 0; k < dtypes.size(); ++k) {
        un.push_back({{outs[k].data(), elems[k], dtypes[k]}, offsets[k]});
      }
      ki::UnpackParamsHost({bucket.data(), bucket_elems, bt}, un);
      for (size_t k = 0; k < dtypes.size(); ++k) {
        const std::vector<std::byte> part(
            bucket.begin() + static_cast<ptrdiff_t>(offsets[k] * DTypeSize(bt)),
            bucket.begin() + static_cast<ptrdiff_t>((offsets[k] + elems[k]) * DTypeSize(bt)));
        const auto expect = ExpectedConvert(part, bt, dtypes[k], 1.0f, ScaleMode::kNone);
        EXPECT_EQ(FirstBitDifference(outs[k].data(), expect.data(), dtypes[k], elems[k]), "")
            << "entry " << k;
      }
    }
  }
}

DeviceGradStats StatsOf(void (*fn)(ConstDeviceTensor, float, void*), const void* data, size_t n,
                        DType t, float scale) {
  std::vector<std::byte> buf(GradStatsBufferBytes(n), std::byte{0xee});
  fn({data, n, t}, scale, buf.data());
  DeviceGradStats st;
  std::memcpy(&st, buf.data(), sizeof(st));
  return st;
}

// Same bits as the reference for finite sums (the order of the additions is
// the documented one); a NaN sum is NaN on both (which NaN payload wins
// when two meet is the compiler's choice of operand order).
void ExpectSameStats(const DeviceGradStats& got, const DeviceGradStats& want) {
  EXPECT_EQ(got.nonfinite_elems, want.nonfinite_elems);
  if (std::isnan(want.sum_sq)) {
    EXPECT_TRUE(std::isnan(got.sum_sq)) << got.sum_sq;
  } else {
    EXPECT_EQ(std::bit_cast<uint64_t>(got.sum_sq), std::bit_cast<uint64_t>(want.sum_sq))
        << got.sum_sq << " vs " << want.sum_sq;
  }
}

void TestGradStatsMatchesReferenceBitwise() {
  std::mt19937_64 rng(kt::TestSeed());
  const size_t block = kGradStatsBlockElemsDevice;
  for (DType t : kFloatTypes) {
    for (size_t n : {size_t{0}, size_t{1}, size_t{255}, size_t{256}, size_t{257}, block - 1, block,
                     block + 1, 3 * block + 100, size_t{100003},
                     // More blocks than threads: lanes of the block sums wrap.
                     kGradStatsThreads * block + 5 * block + 17}) {
      for (float stddev : {1e-3f, 3.0f, 3e4f}) {
        for (float scale : {1.0f, 0.125f, 3.0f}) {
          SCOPED_TRACE(std::string(DTypeName(t)) + " n=" + std::to_string(n) + " stddev " +
                       std::to_string(stddev) + " scale " + std::to_string(scale) + " target " +
                       hwy::TargetName(HWY_TARGET));
          // Finite values of very different magnitudes, so the order of the
          // additions shows in the last bits.
          auto g = kt::FiniteTensor(t, n, stddev, rng);
          for (size_t i = 0; i < n; i += 97) {
            kt::StoreRef(g.data(), t, i, kt::LoadRef(g.data(), t, i) * 1000.0f);
          }
          Placed placed(t, g, 1);
          ExpectSameStats(StatsOf(ki::GradStatsHost, placed.data(), n, t, scale),
                          StatsOf(ki::GradStatsReference, g.data(), n, t, scale));
        }
      }
    }
  }
}

void TestGradStatsCountsNonFiniteExactly() {
  std::mt19937_64 rng(kt::TestSeed());
  const float inf = std::numeric_limits<float>::infinity();
  for (DType t : kFloatTypes) {
    for (size_t n : {size_t{5}, size_t{4096}, size_t{4097}, size_t{20000}}) {
      SCOPED_TRACE(std::string(DTypeName(t)) + " n=" + std::to_string(n) + " target " +
                   hwy::TargetName(HWY_TARGET));
      // Random bit patterns (NaN, inf, subnormal, huge: fp32 specials first).
      const auto bits = RandomTensor(t, n, rng);
      ExpectSameStats(StatsOf(ki::GradStatsHost, bits.data(), n, t, 0.5f),
                      StatsOf(ki::GradStatsReference, bits.data(), n, t, 0.5f));
      // Only infinities: the sum is inf, not NaN.
      auto g = kt::FiniteTensor(t, n, 1.0f, rng);
      kt::StoreRef(g.data(), t, 0, inf);
      kt::StoreRef(g.data(), t, n - 1, -inf);
      const DeviceGradStats st = StatsOf(ki::GradStatsHost, g.data(), n, t, 1.0f);
      EXPECT_EQ(st.nonfinite_elems, n == 1 ? 1u : 2u);
      EXPECT_TRUE(std::isinf(st.sum_sq));
      ExpectSameStats(st, StatsOf(ki::GradStatsReference, g.data(), n, t, 1.0f));
    }
  }
}

}  // namespace
// NOLINTNEXTLINE(google-readability-namespace-comments)
}  // namespace HWY_NAMESPACE
}  // namespace strata::kernels_simd_test
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace strata::kernels_simd_test {
namespace {
HWY_BEFORE_TEST(KernelsSimdTest);
HWY_EXPORT_AND_TEST_P(KernelsSimdTest, TestDispatchesToThisTarget);
HWY_EXPORT_AND_TEST_P(KernelsSimdTest, TestConvertMatchesReference);
HWY_EXPORT_AND_TEST_P(KernelsSimdTest, TestScaleInPlaceMatchesReference);
HWY_EXPORT_AND_TEST_P(KernelsSimdTest, TestAccumulateMatchesReference);
HWY_EXPORT_AND_TEST_P(KernelsSimdTest, TestAccumulateEveryPairOfSpecialValues);
HWY_EXPORT_AND_TEST_P(KernelsSimdTest, TestConvertSpecialValuesTimesScales);
HWY_EXPORT_AND_TEST_P(KernelsSimdTest, TestHalfConversionsExhaustive);
HWY_EXPORT_AND_TEST_P(KernelsSimdTest, TestPackAndUnpackMatchReference);
HWY_EXPORT_AND_TEST_P(KernelsSimdTest, TestGradStatsMatchesReferenceBitwise);
HWY_EXPORT_AND_TEST_P(KernelsSimdTest, TestGradStatsCountsNonFiniteExactly);
}  // namespace
}  // namespace strata::kernels_simd_test
#endif
