// Element load/store by run-time dtype, shared by the host twins and the CUDA
// kernels so both convert exactly alike (the conversions are the constexpr
// functions of runtime/dtype.h). Not a public header.
#pragma once

#include <cstddef>
#include <cstdint>

#include "runtime/dtype.h"

#if defined(__CUDACC__)
#define STRATA_ELEM_FN __host__ __device__ __forceinline__
#else
#define STRATA_ELEM_FN inline
#endif

namespace strata::kernels::internal {

// fp16/bf16 are raw uint16_t bits; any other dtype is read as fp32.
STRATA_ELEM_FN float LoadElem(const void* p, DType dtype, size_t i) {
  switch (dtype) {
    case DType::kF16:
      return F16ToF32(static_cast<const uint16_t*>(p)[i]);
    case DType::kBF16:
      return BF16ToF32(static_cast<const uint16_t*>(p)[i]);
    default:
      return static_cast<const float*>(p)[i];
  }
}

STRATA_ELEM_FN void StoreElem(void* p, DType dtype, size_t i, float v) {
  switch (dtype) {
    case DType::kF16:
      static_cast<uint16_t*>(p)[i] = F32ToF16(v);
      break;
    case DType::kBF16:
      static_cast<uint16_t*>(p)[i] = F32ToBF16(v);
      break;
    default:
      static_cast<float*>(p)[i] = v;
      break;
  }
}

}  // namespace strata::kernels::internal

#undef STRATA_ELEM_FN
