#include "runtime/dtype.h"

#include <cmath>
#include <cstdio>
#include <limits>
#include <random>

#include <gtest/gtest.h>

namespace strata {
namespace {

// Independent reference: round |f| to the nearest multiple of the format's
// spacing at that magnitude, in double, ties to even, then encode.
double RoundToFormat(double a, int mant_bits, int min_exp, double max_finite) {
  if (a == 0) return 0;
  int e = std::ilogb(a);
  if (e < min_exp) e = min_exp;  // subnormal spacing
  const double ulp = std::ldexp(1.0, e - mant_bits);
  double q = a / ulp;
  double r = std::nearbyint(q);  // default rounding: to nearest, ties to even
  double v = r * ulp;
  // The halfway point past max_finite rounds up (to inf) only when it ties
  // on an odd mantissa, which the nearest-even rule above already decides.
  const double limit = max_finite + std::ldexp(1.0, std::ilogb(max_finite) - mant_bits) / 2;
  if (a >= limit) return std::numeric_limits<double>::infinity();
  return v;
}

float RefF16(float f) {
  if (std::isnan(f)) return f;
  double v = RoundToFormat(std::fabs(static_cast<double>(f)), 10, -14, 65504.0);
  return static_cast<float>(std::copysign(v, static_cast<double>(f)));
}

float RefBF16(float f) {
  if (std::isnan(f)) return f;
  double v = RoundToFormat(std::fabs(static_cast<double>(f)), 7, -126,
                           static_cast<double>(std::numeric_limits<float>::max()));
  return static_cast<float>(std::copysign(v, static_cast<double>(f)));
}

void ExpectSameFloat(float got, float want, float input) {
  if (std::isnan(want)) {
    EXPECT_TRUE(std::isnan(got)) << "input " << input;
    return;
  }
  EXPECT_EQ(std::bit_cast<uint32_t>(got), std::bit_cast<uint32_t>(want))
      << "input " << std::hexfloat << input << " got " << got << " want " << want;
}

TEST(DType, NamesRoundTrip) {
  for (DType t : {DType::kF32, DType::kF16, DType::kBF16, DType::kF64, DType::kU8, DType::kI32,
                  DType::kI64}) {
    EXPECT_EQ(*ParseDType(DTypeName(t)), t);
  }
  EXPECT_EQ(*ParseDType("bfloat16"), DType::kBF16);
  Result<DType> bad = ParseDType("fp8");
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("'fp8'"), std::string_view::npos);
}

TEST(DType, F16ExhaustiveRoundTrip) {
  for (uint32_t h = 0; h < 65536; ++h) {
    const float f = F16ToF32(static_cast<uint16_t>(h));
    if (std::isnan(f)) {
      EXPECT_EQ((h & 0x7c00u), 0x7c00u);
      EXPECT_NE((h & 0x3ffu), 0u);
      EXPECT_TRUE(std::isnan(F16ToF32(F32ToF16(f))));
      continue;
    }
    EXPECT_EQ(F32ToF16(f), h) << "h=" << h;
  }
}

TEST(DType, BF16ExhaustiveRoundTrip) {
  for (uint32_t h = 0; h < 65536; ++h) {
    const float f = BF16ToF32(static_cast<uint16_t>(h));
    if (std::isnan(f)) {
      EXPECT_TRUE(std::isnan(BF16ToF32(F32ToBF16(f))));
      EXPECT_EQ(F32ToBF16(f) & 0x8000u, h & 0x8000u) << "sign of NaN kept";
      continue;
    }
    EXPECT_EQ(F32ToBF16(f), h) << "h=" << h;
  }
}

TEST(DType, RoundingEdgeCases) {
  // Ties to even in fp16: 1 + 2^-11 is halfway between 1 and 1 + 2^-10.
  EXPECT_EQ(F32ToF16(1.0f + 0x1p-11f), 0x3c00u);
  EXPECT_EQ(F32ToF16(1.0f + 3 * 0x1p-11f), 0x3c02u);  // rounds up to even
  EXPECT_EQ(F32ToF16(65504.0f), 0x7bffu);
  EXPECT_EQ(F32ToF16(65519.0f), 0x7bffu);
  EXPECT_EQ(F32ToF16(65520.0f), 0x7c00u);  // tie on odd mantissa -> inf
  EXPECT_EQ(F32ToF16(-1e9f), 0xfc00u);
  EXPECT_EQ(F32ToF16(0x1p-24f), 0x0001u);   // smallest subnormal
  EXPECT_EQ(F32ToF16(0x1p-25f), 0x0000u);   // tie -> even (zero)
  EXPECT_EQ(F32ToF16(0x1.8p-25f), 0x0001u);
  EXPECT_EQ(F32ToF16(-0.0f), 0x8000u);
  // bf16 ties to even and overflow.
  EXPECT_EQ(F32ToBF16(std::bit_cast<float>(0x3f808000u)), 0x3f80u);
  EXPECT_EQ(F32ToBF16(std::bit_cast<float>(0x3f818000u)), 0x3f82u);
  EXPECT_EQ(F32ToBF16(std::numeric_limits<float>::max()), 0x7f80u);
  EXPECT_EQ(F32ToBF16(std::numeric_limits<float>::infinity()), 0x7f80u);
  EXPECT_TRUE(std::isnan(BF16ToF32(F32ToBF16(std::numeric_limits<float>::quiet_NaN()))));
  // A signalling NaN whose payload sits in the low bits must stay NaN, not become inf.
  EXPECT_TRUE(std::isnan(BF16ToF32(F32ToBF16(std::bit_cast<float>(0x7f800001u)))));
  EXPECT_TRUE(std::isnan(F16ToF32(F32ToF16(std::bit_cast<float>(0x7f800001u)))));
}

TEST(DType, RandomAgainstDoubleReference) {
  const uint32_t seed = std::random_device{}();
  std::printf("seed %u\n", seed);
  std::mt19937 rng(seed);
  for (int i = 0; i < 2000000; ++i) {
    const float f = std::bit_cast<float>(static_cast<uint32_t>(rng()));
    ExpectSameFloat(F16ToF32(F32ToF16(f)), RefF16(f), f);
    ExpectSameFloat(BF16ToF32(F32ToBF16(f)), RefBF16(f), f);
    if (HasFailure()) {
      FAIL() << "seed " << seed;
    }
  }
}

}  // namespace
}  // namespace strata
