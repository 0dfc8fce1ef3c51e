// Internal to the CUDA and NCCL backends and the CUDA kernels (compiled only
// when STRATA_HAVE_CUDA): turning cudaError_t / ncclResult_t into a Status,
// reaching the cudaStream_t behind a StreamRef of a CUDA device, and making a
// device current for one call without leaving it current afterwards.
//
//   internal::CudaDeviceGuard device_guard;
//   STRATA_RETURN_IF_CUDA_ERROR(device_guard.Select(ordinal), "copy on cuda:1: select device");
//   STRATA_RETURN_IF_CUDA_ERROR(cudaMemcpyAsync(...), "copy on cuda:1");
//   // the thread's current device is back to what it was here
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
// Unavailable, invalid value/handle -> InvalidArgument,
// cudaErrorNoKernelImageForDevice -> FailedPrecondition, the rest -> Internal.
// A failed call also leaves its error as the thread's last error, which the
// next kernel launch's cudaGetLastError() would report as its own; so this
// clears it. That hides nothing: a sticky error (the context is unusable:
// illegal address, launch failure, ...) is not cleared by cudaGetLastError
// and is returned again by every later call.
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

// Makes a device the calling thread's current device for the guard's scope.
// The current device is per-thread state of the driver, shared with every
// other CUDA runtime in the process (torch's included), so Strata must not
// leave it changed: Select() switches only when another device is current,
// and the destructor switches back. One exception, the one torch's own
// device guards make: when the previous device has no active primary
// context (a thread that never chose a device reads as device 0), switching
// back would create a context there (cudaSetDevice initializes it since
// CUDA 12), taking memory on a GPU nobody uses; the thread then stays on
// the selected device. Not movable; one Select() per guard.
class CudaDeviceGuard {
 public:
  CudaDeviceGuard() = default;
  CudaDeviceGuard(const CudaDeviceGuard&) = delete;
  CudaDeviceGuard& operator=(const CudaDeviceGuard&) = delete;
  ~CudaDeviceGuard();

  // cudaSuccess, or the error of cudaGetDevice/cudaSetDevice (nothing to
  // restore then).
  cudaError_t Select(int ordinal);

 private:
  int restore_ = -1;  // the device to make current again; -1: none
};

}  // namespace strata::internal

#define STRATA_RETURN_IF_CUDA_ERROR(expr, op)                                   \
  do {                                                                          \
    if (cudaError_t strata_cuda_err_ = (expr); strata_cuda_err_ != cudaSuccess) \
      return ::strata::internal::CudaError(strata_cuda_err_, (op));             \
  } while (false)
