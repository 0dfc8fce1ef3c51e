// A kernel that faults, for runtime_cuda_device_gpu_test: a store to an
// address no allocation maps, which CUDA reports as a sticky error
// (cudaErrorIllegalAddress) at the next synchronization. Nothing of the
// project is included: the test sees only this function.
#include <cuda_runtime_api.h>

namespace {

__global__ void StoreToUnmappedAddress(int* p) { *p = 1; }

}  // namespace

// Launches the faulting kernel on `stream` (a cudaStream_t; null: the legacy
// default stream) of the current device; the launch's own error.
int LaunchFaultingKernel(void* stream) {
  // Page 0 is never mapped for device access.
  StoreToUnmappedAddress<<<1, 1, 0, static_cast<cudaStream_t>(stream)>>>(reinterpret_cast<int*>(16));
  return static_cast<int>(cudaGetLastError());
}
