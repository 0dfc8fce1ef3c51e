#include "runtime/dtype.h"

#include <string>

namespace strata {

std::string_view DTypeName(DType t) {
  switch (t) {
    case DType::kF32: return "fp32";
    case DType::kF16: return "fp16";
    case DType::kBF16: return "bf16";
    case DType::kF64: return "fp64";
    case DType::kU8: return "u8";
    case DType::kI32: return "i32";
    case DType::kI64: return "i64";
  }
  return "unknown";
}

Result<DType> ParseDType(std::string_view n) {
  if (n == "fp32" || n == "f32" || n == "float32" || n == "float") return DType::kF32;
  if (n == "fp16" || n == "f16" || n == "float16" || n == "half") return DType::kF16;
  if (n == "bf16" || n == "bfloat16") return DType::kBF16;
  if (n == "fp64" || n == "f64" || n == "float64" || n == "double") return DType::kF64;
  if (n == "u8" || n == "uint8") return DType::kU8;
  if (n == "i32" || n == "int32") return DType::kI32;
  if (n == "i64" || n == "int64") return DType::kI64;
  return InvalidArgumentError("parse dtype '" + std::string(n) +
                              "': expected fp32, fp16, bf16, fp64, u8, i32 or i64");
}

}  // namespace strata
