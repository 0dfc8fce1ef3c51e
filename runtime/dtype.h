// Element types Strata moves and computes with, and the scalar conversions
// between fp32 and the 16-bit float formats.
//
//   DType t = *ParseDType("bf16");              // DType::kBF16
//   uint16_t h = F32ToBF16(1.0f);               // 0x3F80
//   float f = F16ToF32(F32ToF16(0.1f));         // 0.0999755859375f
//
// The conversions are the scalar reference every vector and GPU path is
// tested against:
//   - fp32 -> fp16 and fp32 -> bf16 round to nearest, ties to even; values
//     past the largest finite result become +-inf; fp16 keeps subnormals.
//   - NaN stays NaN (the sign is kept and the result is a quiet NaN).
//   - fp16/bf16 -> fp32 is exact.
// All functions are pure and thread-safe.
#pragma once

#include <bit>
#include <cstddef>
#include <cstdint>
#include <string_view>

#include "runtime/status.h"

namespace strata {

enum class DType : uint8_t {
  kF32 = 0,
  kF16 = 1,
  kBF16 = 2,
  kF64 = 3,
  kU8 = 4,
  kI32 = 5,
  kI64 = 6,
};

constexpr size_t DTypeSize(DType t) {
  switch (t) {
    case DType::kF32: return 4;
    case DType::kF16: return 2;
    case DType::kBF16: return 2;
    case DType::kF64: return 8;
    case DType::kU8: return 1;
    case DType::kI32: return 4;
    case DType::kI64: return 8;
  }
  return 0;
}

// "fp32", "fp16", "bf16", "fp64", "u8", "i32", "i64".
std::string_view DTypeName(DType t);
// Accepts the names above and "float32"/"f32", "float16"/"half"/"f16",
// "bfloat16", "float64"/"double"/"f64". InvalidArgument otherwise.
Result<DType> ParseDType(std::string_view name);

constexpr uint16_t F32ToBF16(float f) {
  uint32_t u = std::bit_cast<uint32_t>(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x0040u);
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

constexpr float BF16ToF32(uint16_t h) { return std::bit_cast<float>(static_cast<uint32_t>(h) << 16); }

constexpr uint16_t F32ToF16(float f) {
  uint32_t x = std::bit_cast<uint32_t>(f);
  const uint16_t sign = static_cast<uint16_t>((x >> 16) & 0x8000u);
  x &= 0x7fffffffu;
  if (x > 0x7f800000u) return sign | 0x7e00u;  // NaN -> quiet NaN
  if (x >= 0x477ff000u) return sign | 0x7c00u;  // >= 65520 (and inf) -> inf
  if (x >= 0x38800000u) {                       // normal fp16
    // Rebias the exponent (127 -> 15) and round the 13 dropped bits to even.
    x += 0xc8000fffu + ((x >> 13) & 1u);
    return sign | static_cast<uint16_t>(x >> 13);
  }
  // Subnormal or zero: adding 0.5f aligns the value so the FPU's own
  // round-to-nearest-even drops exactly the bits fp16 cannot hold.
  const float aligned = std::bit_cast<float>(x) + 0.5f;
  return sign | static_cast<uint16_t>(std::bit_cast<uint32_t>(aligned) - 0x3f000000u);
}

constexpr float F16ToF32(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1fu;
  const uint32_t mant = h & 0x3ffu;
  if (exp == 0) {
    // Zero or subnormal: mant * 2^-24 is exact in fp32.
    const float v = static_cast<float>(mant) * 0x1p-24f;
    return std::bit_cast<float>(std::bit_cast<uint32_t>(v) | sign);
  }
  if (exp == 31) return std::bit_cast<float>(sign | 0x7f800000u | (mant << 13));
  return std::bit_cast<float>(sign | ((exp + 112u) << 23) | (mant << 13));
}

}  // namespace strata
