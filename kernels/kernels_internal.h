// Internal to kernels/, its tests and its benchmark: the host twins (run
// synchronously on the calling thread; the launchers in kernels.cc enqueue
// them on a stream), their scalar references, the traffic baselines of the
// benchmark, and the CUDA launch functions of kernels_cuda.cu.
// No CUDA headers here: a cudaStream_t travels as void*, a cudaError_t as int.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "kernels/kernels.h"
#include "runtime/status.h"

namespace strata::kernels::internal {

// Whether a conversion multiplies by its scale (skipped for scale == 1 so
// plain casts are exact copies of the bits dtype.h's functions produce).
enum class ScaleMode : uint8_t { kNone = 0, kMultiply = 1 };

inline ScaleMode ScaleModeOf(float scale) {
  return scale == 1.0f ? ScaleMode::kNone : ScaleMode::kMultiply;
}

// ---- Host twins: the references of the CUDA kernels ------------------------
// Vectorized with Highway (kernels_host.cc, dynamic dispatch to the best SIMD
// target of the CPU), single-threaded, and bit for bit the scalar references
// below, except that a same-dtype conversion with ScaleMode::kNone is a plain
// copy of the bits (memcpy; the reference quiets 16-bit NaNs on the way).

// dst[i] = convert(float(src[i]) [* scale]) for i < elems.
void ConvertHost(const void* src, DType src_dtype, void* dst, DType dst_dtype, size_t elems,
                 float scale, ScaleMode mode);
// Entries must already be validated (in range, disjoint).
void PackGradsHost(std::span<const PackEntry> entries, DeviceTensor bucket, float scale);
void UnpackParamsHost(ConstDeviceTensor bucket, std::span<const UnpackEntry> entries);
void AccumulateHost(ConstDeviceTensor src, DeviceTensor dst);
// Writes a DeviceGradStats at stats_buffer (the host twin needs no scratch).
void GradStatsHost(ConstDeviceTensor grad, float grad_scale, void* stats_buffer);
// The Highway target the twins dispatch to ("AVX2", "AVX3", ...).
std::string_view HostTwinTarget();

// ---- Scalar references (kernels_reference.cc) -------------------------------
// Element at a time through elem_access.h: what the twins must equal.
void ConvertReference(const void* src, DType src_dtype, void* dst, DType dst_dtype, size_t elems,
                      float scale, ScaleMode mode);
void AccumulateReference(ConstDeviceTensor src, DeviceTensor dst);
void GradStatsReference(ConstDeviceTensor grad, float grad_scale, void* stats_buffer);

// ---- Traffic baselines of the benchmark (kernels_host.cc) -------------------
// Vectorized streams with a twin's memory traffic and trivial arithmetic, so
// a twin's bytes/s can be judged against what the memory system gives one
// core in the same run. Element widths are 2 or 4 bytes. The values are
// unchanged or meaningless: these are for timing only.
enum class BaselineKind : uint8_t {
  kWrite,         // dst[i] = narrow/widen(src[i]): a conversion's traffic
  kReadModWrite,  // dst[i] |= narrow/widen(src[i]) & 0: accumulate's traffic
  kReadOnly,      // sum of src: grad stats' traffic (dst unused)
};
// Returns a value derived from the data, to keep the compiler honest.
uint64_t TrafficBaselineHost(BaselineKind kind, const void* src, size_t src_elem_bytes, void* dst,
                             size_t dst_elem_bytes, size_t elems);

// A [begin, end) range of bucket elements.
struct ElemRange {
  size_t begin = 0;
  size_t end = 0;
};
// The ranges of [0, bucket_elems) covered by none of `used` (disjoint, in
// range, any order), in increasing order.
std::vector<ElemRange> PaddingRanges(std::vector<ElemRange> used, size_t bucket_elems);

// ---- CUDA (kernels_cuda.cu; only when the build has CUDA) ------------------

// The per-element fp32 scalars of an Adam update (cpu_adam's derived
// coefficients, see cpu_adam/cpu_adam_internal.h).
struct AdamKernelCoeffs {
  float grad_scale;
  float beta1, one_minus_beta1;
  float beta2, one_minus_beta2;
  float eps;
  float bc2_sqrt;
  float neg_step_size;
  float l2_decay;
  float decay_factor;
  int decay;  // 0 none, 1 L2, 2 decoupled (cpu_adam_internal::Decay)
};

// Each returns a cudaError_t as int (0: launched). `stream` is a cudaStream_t.
// A kernel's launch error is read with cudaGetLastError() right after it, so
// the caller clears the thread's last error first (LaunchCuda does).
int CudaConvert(void* stream, const void* src, DType src_dtype, void* dst, DType dst_dtype,
                size_t elems, float scale, ScaleMode mode);
int CudaZero(void* stream, void* dst, size_t bytes);
int CudaAccumulate(void* stream, const void* src, DType src_dtype, void* dst, DType dst_dtype,
                   size_t elems);
int CudaGradStats(void* stream, const void* grad, DType dtype, size_t elems, float grad_scale,
                  void* stats_buffer);
int CudaAdamStep(void* stream, const AdamKernelCoeffs& coeffs, const DeviceAdamState& state,
                 const void* grad, DType grad_dtype, void* out, DType out_dtype);
// cudaFuncGetAttributes of a kernel of kernels_cuda.cu on the current device:
// cudaErrorNoKernelImageForDevice (or cudaErrorInvalidDeviceFunction) when the
// build has no image for it. Launches nothing.
int CudaCheckKernelImage();

// ---- Launch errors (kernels.cc; host code, tested without a GPU) ------------

// A launch of `op` on `device` that found no kernel image for the GPU
// (cudaErrorNoKernelImageForDevice): FailedPrecondition naming its compute
// capability cc_major.cc_minor, the architectures the build has
// (`built_architectures`, CMAKE_CUDA_ARCHITECTURES) and
// -DCMAKE_CUDA_ARCHITECTURES=<major><minor> to rebuild with.
Status NoKernelImageError(std::string_view op, std::string_view device, int cc_major, int cc_minor,
                          std::string_view built_architectures);
// CMAKE_CUDA_ARCHITECTURES of this build ("80;90"); "" in a build without CUDA.
std::string BuiltCudaArchitectures();

}  // namespace strata::kernels::internal
