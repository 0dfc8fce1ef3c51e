// Shared by the kernels tests: seeded random tensors with the awkward values
// (NaN, inf, subnormals, rounding ties, fp16 overflow), a plain element
// reference of the conversions, and bitwise comparison.
#pragma once

#include <gtest/gtest.h>

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <iostream>
#include <random>
#include <string>
#include <vector>

#include "runtime/dtype.h"

namespace strata::kernels::testing {

inline constexpr DType kFloatTypes[] = {DType::kF32, DType::kF16, DType::kBF16};

// The seed of the random tests: STRATA_TEST_SEED if set, else a fixed one.
// Printed so a failure can be replayed.
inline uint64_t TestSeed() {
  uint64_t seed = 20261122;
  if (const char* env = std::getenv("STRATA_TEST_SEED")) seed = std::strtoull(env, nullptr, 10);
  std::cout << "[ seed ] STRATA_TEST_SEED=" << seed << "\n";
  return seed;
}

inline float LoadRef(const void* p, DType dtype, size_t i) {
  if (dtype == DType::kF16) return F16ToF32(static_cast<const uint16_t*>(p)[i]);
  if (dtype == DType::kBF16) return BF16ToF32(static_cast<const uint16_t*>(p)[i]);
  return static_cast<const float*>(p)[i];
}

inline void StoreRef(void* p, DType dtype, size_t i, float v) {
  if (dtype == DType::kF16) {
    static_cast<uint16_t*>(p)[i] = F32ToF16(v);
  } else if (dtype == DType::kBF16) {
    static_cast<uint16_t*>(p)[i] = F32ToBF16(v);
  } else {
    static_cast<float*>(p)[i] = v;
  }
}

// fp32 bit patterns every conversion must get right.
inline const std::vector<uint32_t>& SpecialF32Bits() {
  static const std::vector<uint32_t> bits = {
      0x00000000u, 0x80000000u,  // +-0
      0x3f800000u, 0xbf800000u,  // +-1
      0x7f800000u, 0xff800000u,  // +-inf
      0x7fc00000u, 0xffc00000u,  // quiet NaN
      0x7f800001u, 0xff812345u,  // signalling NaN payloads
      0x00000001u, 0x807fffffu,  // fp32 subnormals
      0x477fe000u, 0x477ff000u,  // 65504 (fp16 max), 65520 (rounds to inf)
      0x33800000u, 0x33000000u,  // fp16 subnormal range, half of the smallest
      0x3f808000u, 0x3f818000u,  // bf16 ties (to even: down, up)
      0x3f801000u, 0x3f803000u,  // fp16 ties
      0x7f7fffffu, 0xff7fffffu,  // fp32 max (bf16 rounds to inf)
  };
  return bits;
}

// fp16 and bf16 bit patterns every conversion must get right.
inline const std::vector<uint16_t>& SpecialHalfBits(DType dtype) {
  static const std::vector<uint16_t> f16 = {
      0x0000u, 0x8000u,  // +-0
      0x0001u, 0x83ffu,  // smallest subnormal, largest negative subnormal
      0x0400u, 0x7bffu,  // smallest normal, 65504
      0x7c00u, 0xfc00u,  // +-inf
      0x7e00u, 0xfe01u,  // quiet NaN, with a payload
      0x7c01u, 0xfd55u,  // signalling NaN payloads
      0x3c00u, 0x3c01u,  // 1 and the next value
  };
  static const std::vector<uint16_t> bf16 = {
      0x0000u, 0x8000u,  // +-0
      0x0001u, 0x807fu,  // subnormals
      0x0080u, 0x7f7fu,  // smallest normal, largest finite
      0x7f80u, 0xff80u,  // +-inf
      0x7fc0u, 0xffc1u,  // quiet NaN, with a payload
      0x7f81u, 0xffa5u,  // signalling NaN payloads
      0x3f80u, 0x3f81u,  // 1 and the next value
  };
  return dtype == DType::kF16 ? f16 : bf16;
}

// `elems` elements of `dtype`: the special values first (SpecialF32Bits or
// SpecialHalfBits), then, for fp32, a mix of normal values and random bit
// patterns; for fp16/bf16, random bits.
inline std::vector<std::byte> RandomTensor(DType dtype, size_t elems, std::mt19937_64& rng) {
  std::vector<std::byte> out(elems * DTypeSize(dtype));
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (size_t i = 0; i < elems; ++i) {
    if (dtype == DType::kF32) {
      uint32_t bits;
      if (i < SpecialF32Bits().size()) {
        bits = SpecialF32Bits()[i];
      } else if (rng() % 4 == 0) {
        bits = static_cast<uint32_t>(rng());
      } else {
        const float f = normal(rng) * static_cast<float>(1 << (rng() % 12));
        std::memcpy(&bits, &f, 4);
      }
      std::memcpy(out.data() + 4 * i, &bits, 4);
    } else {
      const auto& special = SpecialHalfBits(dtype);
      const auto bits = i < special.size() ? special[i] : static_cast<uint16_t>(rng());
      std::memcpy(out.data() + 2 * i, &bits, 2);
    }
  }
  return out;
}

// Finite, moderate values (for Adam, where NaN would hide a wrong formula).
inline std::vector<std::byte> FiniteTensor(DType dtype, size_t elems, float stddev,
                                           std::mt19937_64& rng) {
  std::vector<std::byte> out(elems * DTypeSize(dtype));
  std::normal_distribution<float> normal(0.0f, stddev);
  for (size_t i = 0; i < elems; ++i) StoreRef(out.data(), dtype, i, normal(rng));
  return out;
}

// Empty when equal; else the first differing element, described.
// Random fp32 Adam state of `elems` elements: params ~ N(0, 1), m ~ N(0, 0.1),
// v = |N(0, 0.01)|.
struct AdamStateVectors {
  std::vector<float> p, m, v;
};
inline AdamStateVectors RandomAdamState(size_t elems, std::mt19937_64& rng) {
  AdamStateVectors s{std::vector<float>(elems), std::vector<float>(elems),
                     std::vector<float>(elems)};
  std::normal_distribution<float> nd(0.0f, 1.0f);
  for (size_t i = 0; i < elems; ++i) {
    s.p[i] = nd(rng);
    s.m[i] = 0.1f * nd(rng);
    s.v[i] = std::abs(0.01f * nd(rng));
  }
  return s;
}

inline std::string FirstBitDifference(const void* a, const void* b, DType dtype, size_t elems) {
  const size_t size = DTypeSize(dtype);
  for (size_t i = 0; i < elems; ++i) {
    if (std::memcmp(static_cast<const std::byte*>(a) + i * size,
                    static_cast<const std::byte*>(b) + i * size, size) != 0) {
      return "element " + std::to_string(i) + ": " + std::to_string(LoadRef(a, dtype, i)) + " vs " +
             std::to_string(LoadRef(b, dtype, i));
    }
  }
  return "";
}

// Like FirstBitDifference, but two NaNs are equal whatever their sign and
// payload: arithmetic on a NaN yields a NaN whose bits differ between CPUs
// and GPUs (x86 keeps the input's payload and sign, CUDA returns 0x7fffffff).
inline std::string FirstDifferenceAnyNaN(const void* a, const void* b, DType dtype, size_t elems) {
  const size_t size = DTypeSize(dtype);
  for (size_t i = 0; i < elems; ++i) {
    const float x = LoadRef(a, dtype, i);
    const float y = LoadRef(b, dtype, i);
    if (std::isnan(x) && std::isnan(y)) continue;
    if (std::memcmp(static_cast<const std::byte*>(a) + i * size,
                    static_cast<const std::byte*>(b) + i * size, size) != 0) {
      return "element " + std::to_string(i) + ": " + std::to_string(x) + " vs " + std::to_string(y);
    }
  }
  return "";
}

// Empty when accumulate's result `got` equals the reference's `want` bit for
// bit, except where both inputs are NaN: x86 returns the NaN of the add's
// first operand and C++ leaves the operand order of a commutative add to the
// compiler, so the NaN of either input (quieted, converted) is accepted there.
inline std::string FirstAccumulateDifference(const std::vector<std::byte>& got,
                                             const std::vector<std::byte>& want,
                                             const std::vector<std::byte>& src,
                                             const std::vector<std::byte>& dst0, DType s, DType d) {
  const size_t n = got.size() / DTypeSize(d);
  const size_t size = DTypeSize(d);
  auto quiet_nan_as_d = [&](const std::vector<std::byte>& v, DType t, size_t i) {
    const float x =
        std::bit_cast<float>(std::bit_cast<uint32_t>(LoadRef(v.data(), t, i)) | 0x00400000u);
    std::vector<std::byte> out(size);
    StoreRef(out.data(), d, 0, x);
    return out;
  };
  for (size_t i = 0; i < n; ++i) {
    const std::byte* g = got.data() + i * size;
    if (std::memcmp(g, want.data() + i * size, size) == 0) continue;
    if (std::isnan(LoadRef(src.data(), s, i)) && std::isnan(LoadRef(dst0.data(), d, i)) &&
        (std::memcmp(g, quiet_nan_as_d(src, s, i).data(), size) == 0 ||
         std::memcmp(g, quiet_nan_as_d(dst0, d, i).data(), size) == 0)) {
      continue;
    }
    return FirstBitDifference(g, want.data() + i * size, d, 1) + " at element " + std::to_string(i);
  }
  return "";
}

}  // namespace strata::kernels::testing
