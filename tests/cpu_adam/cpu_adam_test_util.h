// Helpers shared by the cpu_adam tests: seeded inputs, buffers at chosen
// misalignments, and bitwise comparisons (NaN equals NaN).
#pragma once

#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "cpu_adam/cpu_adam.h"
#include "runtime/dtype.h"

namespace strata::cpu_adam_test {

// A byte buffer whose span starts `offset_bytes` past a 64-byte boundary.
class Buffer {
 public:
  Buffer(size_t bytes, size_t offset_bytes) : storage_(bytes + offset_bytes + 128) {
    const auto base = reinterpret_cast<uintptr_t>(storage_.data());
    data_ = storage_.data() + ((64 - base % 64) % 64) + offset_bytes;
  }
  template <class T>
  std::span<T> As(size_t elems) {
    return {reinterpret_cast<T*>(data_), elems};
  }

 private:
  std::vector<std::byte> storage_;
  std::byte* data_;
};

// A value whose magnitude spans many binades (fp16 subnormals to past the
// fp16 range), with zeros and both signs.
inline float WideValue(std::mt19937_64& rng) {
  std::uniform_real_distribution<float> exp_dist(-30.0f, 18.0f);
  std::uniform_int_distribution<int> kind(0, 31);
  const int k = kind(rng);
  if (k == 0) return 0.0f;
  if (k == 1) return -0.0f;
  const float mag = std::exp2(exp_dist(rng));
  return (k & 2) ? -mag : mag;
}

inline float SmallValue(std::mt19937_64& rng, float scale) {
  std::normal_distribution<float> nd(0.0f, scale);
  return nd(rng);
}

// Fills a grad of `dtype` with n values: mostly N(0, 0.01), some wide values.
// non-finite values only when `nonfinite_every` > 0.
inline void FillGrad(std::mt19937_64& rng, DType dtype, void* data, size_t n,
                     size_t nonfinite_every = 0) {
  std::uniform_int_distribution<int> pick(0, 9);
  for (size_t i = 0; i < n; ++i) {
    float g = pick(rng) == 0 ? WideValue(rng) * 1e-3f : SmallValue(rng, 0.01f);
    if (nonfinite_every > 0 && i % nonfinite_every == nonfinite_every - 1) {
      g = (i / nonfinite_every) % 2 ? std::numeric_limits<float>::infinity()
                                    : std::numeric_limits<float>::quiet_NaN();
    }
    switch (dtype) {
      case DType::kF16:
        static_cast<uint16_t*>(data)[i] = F32ToF16(g);
        break;
      case DType::kBF16:
        static_cast<uint16_t*>(data)[i] = F32ToBF16(g);
        break;
      default:
        static_cast<float*>(data)[i] = g;
        break;
    }
  }
}

inline bool SameBits(float a, float b) {
  if (std::isnan(a) && std::isnan(b)) return true;
  return std::bit_cast<uint32_t>(a) == std::bit_cast<uint32_t>(b);
}
inline bool SameHalf(uint16_t a, uint16_t b, DType t) {
  auto is_nan = [t](uint16_t h) {
    return t == DType::kF16 ? (h & 0x7fff) > 0x7c00 : (h & 0x7fff) > 0x7f80;
  };
  if (is_nan(a) && is_nan(b)) return true;
  return a == b;
}

// Distance in units in the last place between two floats (0 when equal).
inline int64_t UlpDistance(float a, float b) {
  if (std::isnan(a) || std::isnan(b)) return (std::isnan(a) && std::isnan(b)) ? 0 : INT64_MAX;
  auto key = [](float f) {
    const int32_t i = std::bit_cast<int32_t>(f);
    return i < 0 ? static_cast<int64_t>(INT32_MIN) - i : static_cast<int64_t>(i);
  };
  const int64_t d = key(a) - key(b);
  return d < 0 ? -d : d;
}

// The tolerance the SIMD kernels are held to against the scalar reference,
// in ulps: they run the same IEEE operations, so they agree exactly.
inline constexpr int64_t kMaxUlpVsReference = 0;

// Expects float spans equal within kMaxUlpVsReference; reports the first miss.
inline ::testing::AssertionResult FloatsMatch(std::span<const float> got,
                                              std::span<const float> want,
                                              const std::string& what) {
  if (got.size() != want.size()) return ::testing::AssertionFailure() << what << ": size";
  for (size_t i = 0; i < got.size(); ++i) {
    if (UlpDistance(got[i], want[i]) > kMaxUlpVsReference) {
      return ::testing::AssertionFailure()
             << what << "[" << i << "] = " << got[i] << " (0x" << std::hex
             << std::bit_cast<uint32_t>(got[i]) << "), reference " << want[i] << " (0x"
             << std::bit_cast<uint32_t>(want[i]) << std::dec << ")";
    }
  }
  return ::testing::AssertionSuccess();
}

inline ::testing::AssertionResult OutMatch(const OutView& got, const OutView& want, size_t n,
                                           const std::string& what) {
  if (got.is_none()) return ::testing::AssertionSuccess();
  if (got.dtype == DType::kF32) {
    return FloatsMatch({static_cast<const float*>(got.data), n},
                       {static_cast<const float*>(want.data), n}, what);
  }
  const auto* a = static_cast<const uint16_t*>(got.data);
  const auto* b = static_cast<const uint16_t*>(want.data);
  for (size_t i = 0; i < n; ++i) {
    if (!SameHalf(a[i], b[i], got.dtype)) {
      return ::testing::AssertionFailure() << what << "[" << i << "] = 0x" << std::hex << a[i]
                                           << ", reference 0x" << b[i] << std::dec;
    }
  }
  return ::testing::AssertionSuccess();
}

inline uint64_t TestSeed() {
  static const uint64_t seed = [] {
    const char* env = std::getenv("STRATA_TEST_SEED");
    const uint64_t s = env ? std::strtoull(env, nullptr, 10) : std::random_device{}();
    std::printf("cpu_adam tests: seed %llu (set STRATA_TEST_SEED to repeat)\n",
                static_cast<unsigned long long>(s));
    return s;
  }();
  return seed;
}

inline const char* OutName(const OutView& o) {
  return o.is_none() ? "none" : DTypeName(o.dtype).data();
}

}  // namespace strata::cpu_adam_test
