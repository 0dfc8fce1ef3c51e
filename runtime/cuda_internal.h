// Internal to the CUDA and NCCL backends (compiled only when STRATA_HAVE_CUDA):
// turning cudaError_t / ncclResult_t into a Status, and reaching the
// cudaStream_t behind a StreamRef of a CUDA device.
#pragma once

#include <cuda_runtime_api.h>
#if STRATA_HAVE_NCCL
#include <nccl.h>
#endif

#include <string_view>

#include "runtime/device.h"
#include "runtime/status.h"

namespace strata::internal {

// OK for cudaSuccess. Otherwise "<op>: cudaErrorXxx (description)" with
// cudaErrorMemoryAllocation -> ResourceExhausted, no device/driver ->
// Unavailable, invalid value/handle -> InvalidArgument, the rest -> Internal.
Status CudaError(cudaError_t err, std::string_view op);

#if STRATA_HAVE_NCCL
// OK for ncclSuccess. Otherwise "<op>: ncclXxx (ncclGetErrorString)";
// ncclInvalidArgument/ncclInvalidUsage -> InvalidArgument,
// ncclSystemError/ncclRemoteError -> Unavailable, the rest -> Internal.
Status NcclError(ncclResult_t result, std::string_view op);
#endif

// The CUDA stream behind `stream`, or InvalidArgument when it is null or not
// a stream of a CUDA device.
Result<cudaStream_t> CudaStreamOf(StreamRef stream);

// The ordinal of a CUDA device; InvalidArgument for other devices.
Result<int> CudaOrdinalOf(const Device& device);

}  // namespace strata::internal

#define STRATA_RETURN_IF_CUDA_ERROR(expr, op)                                   \
  do {                                                                          \
    if (cudaError_t strata_cuda_err_ = (expr); strata_cuda_err_ != cudaSuccess) \
      return ::strata::internal::CudaError(strata_cuda_err_, (op));             \
  } while (false)
