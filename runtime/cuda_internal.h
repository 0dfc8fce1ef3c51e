// Internal to the CUDA and NCCL backends and the CUDA kernels (compiled only
// when STRATA_HAVE_CUDA): turning cudaError_t into a Status,
// reaching the cudaStream_t behind a StreamRef of a CUDA device, and making a
// device current for one call without leaving it current afterwards.
//
//   internal::CudaDeviceGuard device_guard;
//   STRATA_RETURN_IF_CUDA_ERROR(device_guard.Select(ordinal), "copy on cuda:1: select device");
//   STRATA_RETURN_IF_CUDA_ERROR(cudaMemcpyAsync(...), "copy on cuda:1");
//   // the thread's current device is back to what it was here
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <string_view>

#include "runtime/device.h"
#include "runtime/status.h"

namespace strata::internal {

// OK for cudaSuccess. Otherwise "<op>: cudaErrorXxx (description)" with
// cudaErrorMemoryAllocation -> ResourceExhausted, no device/driver ->
// Unavailable, invalid value/handle -> InvalidArgument,
// cudaErrorNoKernelImageForDevice -> FailedPrecondition, a sticky error
// (IsStickyCudaError) -> DataLoss saying the context is unusable (see
// runtime/device.h IsDeviceLost), the rest -> Internal.
// A failed call also leaves its error as the thread's last error, which the
// next kernel launch's cudaGetLastError() would report as its own; so this
// clears it. That hides nothing: a sticky error is not cleared by
// cudaGetLastError and is returned again by every later call.
Status CudaError(cudaError_t err, std::string_view op);

// CudaError's mapping alone: it changes no CUDA state (cudaGetErrorName and
// cudaGetErrorString are table lookups that work with no GPU or driver), so
// it is unit-tested on any machine.
Status CudaErrorStatus(cudaError_t err, std::string_view op);

// Whether `err` leaves the CUDA context unusable for the rest of the
// process: the errors driver_types.h documents with "any further CUDA work
// will return the same error ... the process must be terminated and
// relaunched" (illegal address, launch timeout, device assert, hardware
// stack error, illegal instruction, misaligned address, invalid address
// space, invalid PC, launch failure, tensor memory leak, contained error,
// external device error, MPS client terminated), and
// cudaErrorECCUncorrectable, which driver_types.h does not describe so but
// which NVIDIA's Xid guidance (Xid 48, a double-bit ECC error) treats as
// fatal to the running application: the memory it hit is corrupt. Not
// cudaErrorNvlinkUncorrectable, which is not documented as sticky (it stays
// Internal). The primary context is shared with torch: its calls fail too.
bool IsStickyCudaError(cudaError_t err);

// What Allocate's out-of-memory error adds: the GPU's free and total memory
// as cudaMemGetInfo gives them, and the use of Strata's own memory pool.
struct CudaMemoryFigures {
  bool have_gpu = false;  // cudaMemGetInfo answered
  size_t free_bytes = 0;
  size_t total_bytes = 0;
  bool have_pool = false;  // the device allocates from a pool of its own
  uint64_t pool_reserved_bytes = 0;
  uint64_t pool_used_bytes = 0;
};

// `oom` (ResourceExhausted) with the figures appended, and what to do:
// "...; cuda:0 has 1.20 GiB free of 79.1 GiB (memory that other allocators in
// this process keep cached, torch's included, counts as used:
// torch.cuda.empty_cache() hands torch's back); Strata's memory pool holds
// 2.00 GiB, 1.50 GiB of it in use". Figures not given are left out.
Status OutOfDeviceMemoryError(const Status& oom, std::string_view device,
                              const CudaMemoryFigures& figures);

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
