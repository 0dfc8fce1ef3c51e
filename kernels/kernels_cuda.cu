// CUDA kernels behind kernels.h. Each mirrors its host twin in
// kernels_host.cc (and its scalar reference, kernels_reference.cc) operation
// for operation: element conversions call the same
// constexpr functions of runtime/dtype.h (--expt-relaxed-constexpr), float
// arithmetic uses explicit round-to-nearest intrinsics (and --fmad=false), so
// results are bit for bit those of the twins. Dtypes are dispatched per
// element at run time instead of by template to keep nvcc time small; the
// branch is uniform across a warp and the kernels are bound by memory.
#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/elem_access.h"
#include "kernels/kernels_internal.h"
#include "runtime/dtype.h"

namespace strata::kernels::internal {
namespace {

constexpr int kThreads = 256;
constexpr unsigned kMaxBlocks = 65535u * 8u;

unsigned GridFor(size_t elems) {
  const size_t blocks = (elems + kThreads - 1) / kThreads;
  return static_cast<unsigned>(blocks < kMaxBlocks ? blocks : kMaxBlocks);
}

__global__ void ConvertKernel(const void* src, DType src_dtype, void* dst, DType dst_dtype,
                              size_t elems, float scale, ScaleMode mode) {
  const size_t stride = static_cast<size_t>(gridDim.x) * blockDim.x;
  for (size_t i = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < elems;
       i += stride) {
    float v = LoadElem(src, src_dtype, i);
    if (mode == ScaleMode::kMultiply) v = __fmul_rn(v, scale);
    StoreElem(dst, dst_dtype, i, v);
  }
}

__global__ void AccumulateKernel(const void* src, DType src_dtype, void* dst, DType dst_dtype,
                                 size_t elems) {
  const size_t stride = static_cast<size_t>(gridDim.x) * blockDim.x;
  for (size_t i = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < elems;
       i += stride) {
    StoreElem(dst, dst_dtype, i, __fadd_rn(LoadElem(dst, dst_dtype, i), LoadElem(src, src_dtype, i)));
  }
}

// Thread t's (sum, count) combined over the block's kGradStatsThreads threads
// by the fixed tree (stride 128, 64, ..., 1): the totals, for thread 0.
__device__ DeviceGradStats TreeSum(double acc, unsigned long long nonfinite) {
  __shared__ double sums[kGradStatsThreads];
  __shared__ unsigned long long counts[kGradStatsThreads];
  sums[threadIdx.x] = acc;
  counts[threadIdx.x] = nonfinite;
  __syncthreads();
  for (unsigned stride = kGradStatsThreads / 2; stride > 0; stride /= 2) {
    if (threadIdx.x < stride) {
      sums[threadIdx.x] = __dadd_rn(sums[threadIdx.x], sums[threadIdx.x + stride]);
      counts[threadIdx.x] += counts[threadIdx.x + stride];
    }
    __syncthreads();
  }
  return DeviceGradStats{sums[0], counts[0]};
}

// Pass 1: one CUDA block per kGradStatsBlockElemsDevice elements; writes the
// block's sum and non-finite count to scratch[block].
__global__ void GradStatsBlockKernel(const void* grad, DType dtype, size_t elems,
                                     DeviceGradStats* scratch) {
  const size_t begin = static_cast<size_t>(blockIdx.x) * kGradStatsBlockElemsDevice;
  const size_t end =
      begin + kGradStatsBlockElemsDevice < elems ? begin + kGradStatsBlockElemsDevice : elems;
  double acc = 0.0;
  unsigned long long nonfinite = 0;
  for (size_t i = begin + threadIdx.x; i < end; i += kGradStatsThreads) {
    const float g = LoadElem(grad, dtype, i);
    if (!isfinite(g)) ++nonfinite;
    const double d = static_cast<double>(g);
    acc = __dadd_rn(acc, __dmul_rn(d, d));
  }
  const DeviceGradStats block = TreeSum(acc, nonfinite);
  if (threadIdx.x == 0) scratch[blockIdx.x] = block;
}

// Pass 2, one block: thread t adds the results of blocks t, t + 256, ... in
// order, the same fixed tree combines the threads (the order the host twin
// uses), then grad_scale^2. One thread adding every block in turn was a
// serial chain of dependent loads, ~2 per 4096 elements.
__global__ void GradStatsFinalKernel(const DeviceGradStats* scratch, size_t blocks,
                                     float grad_scale, DeviceGradStats* result) {
  double acc = 0.0;
  unsigned long long nonfinite = 0;
  for (size_t b = threadIdx.x; b < blocks; b += kGradStatsThreads) {
    acc = __dadd_rn(acc, scratch[b].sum_sq);
    nonfinite += scratch[b].nonfinite_elems;
  }
  const DeviceGradStats total = TreeSum(acc, nonfinite);
  if (threadIdx.x == 0) {
    const double s = static_cast<double>(grad_scale);
    *result = DeviceGradStats{__dmul_rn(total.sum_sq, __dmul_rn(s, s)), total.nonfinite_elems};
  }
}

__global__ void AdamKernel(AdamKernelCoeffs c, float* params, float* exp_avg, float* exp_avg_sq,
                           size_t elems, const void* grad, DType grad_dtype, void* out,
                           DType out_dtype) {
  const size_t stride = static_cast<size_t>(gridDim.x) * blockDim.x;
  for (size_t i = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < elems;
       i += stride) {
    float g = __fmul_rn(LoadElem(grad, grad_dtype, i), c.grad_scale);
    float p = params[i];
    if (c.decay == 1) g = __fadd_rn(g, __fmul_rn(c.l2_decay, p));
    if (c.decay == 2) p = __fmul_rn(p, c.decay_factor);
    const float m = __fadd_rn(__fmul_rn(exp_avg[i], c.beta1), __fmul_rn(c.one_minus_beta1, g));
    const float v =
        __fadd_rn(__fmul_rn(exp_avg_sq[i], c.beta2), __fmul_rn(__fmul_rn(c.one_minus_beta2, g), g));
    const float denom = __fadd_rn(__fdiv_rn(__fsqrt_rn(v), c.bc2_sqrt), c.eps);
    p = __fadd_rn(p, __fmul_rn(c.neg_step_size, __fdiv_rn(m, denom)));
    params[i] = p;
    exp_avg[i] = m;
    exp_avg_sq[i] = v;
    if (out != nullptr) StoreElem(out, out_dtype, i, p);
  }
}

}  // namespace

int CudaConvert(void* stream, const void* src, DType src_dtype, void* dst, DType dst_dtype,
                size_t elems, float scale, ScaleMode mode) {
  if (src_dtype == dst_dtype && mode == ScaleMode::kNone) {
    // A copy of the bits, as the host twin's memcpy (NaN payloads included).
    return static_cast<int>(cudaMemcpyAsync(dst, src, elems * DTypeSize(dst_dtype),
                                            cudaMemcpyDeviceToDevice,
                                            static_cast<cudaStream_t>(stream)));
  }
  ConvertKernel<<<GridFor(elems), kThreads, 0, static_cast<cudaStream_t>(stream)>>>(
      src, src_dtype, dst, dst_dtype, elems, scale, mode);
  return static_cast<int>(cudaGetLastError());
}

int CudaZero(void* stream, void* dst, size_t bytes) {
  return static_cast<int>(cudaMemsetAsync(dst, 0, bytes, static_cast<cudaStream_t>(stream)));
}

int CudaAccumulate(void* stream, const void* src, DType src_dtype, void* dst, DType dst_dtype,
                   size_t elems) {
  AccumulateKernel<<<GridFor(elems), kThreads, 0, static_cast<cudaStream_t>(stream)>>>(
      src, src_dtype, dst, dst_dtype, elems);
  return static_cast<int>(cudaGetLastError());
}

int CudaGradStats(void* stream, const void* grad, DType dtype, size_t elems, float grad_scale,
                  void* stats_buffer) {
  auto* result = static_cast<DeviceGradStats*>(stats_buffer);
  DeviceGradStats* scratch = result + 1;
  const size_t blocks = (elems + kGradStatsBlockElemsDevice - 1) / kGradStatsBlockElemsDevice;
  const auto s = static_cast<cudaStream_t>(stream);
  if (blocks > 0) {
    if (blocks > 0x7fffffffu) return static_cast<int>(cudaErrorInvalidValue);
    GradStatsBlockKernel<<<static_cast<unsigned>(blocks), kGradStatsThreads, 0, s>>>(
        grad, dtype, elems, scratch);
    if (cudaError_t err = cudaGetLastError(); err != cudaSuccess) return static_cast<int>(err);
  }
  GradStatsFinalKernel<<<1, kGradStatsThreads, 0, s>>>(scratch, blocks, grad_scale, result);
  return static_cast<int>(cudaGetLastError());
}

int CudaAdamStep(void* stream, const AdamKernelCoeffs& coeffs, const DeviceAdamState& state,
                 const void* grad, DType grad_dtype, void* out, DType out_dtype) {
  AdamKernel<<<GridFor(state.elems), kThreads, 0, static_cast<cudaStream_t>(stream)>>>(
      coeffs, state.params, state.exp_avg, state.exp_avg_sq, state.elems, grad, grad_dtype, out,
      out_dtype);
  return static_cast<int>(cudaGetLastError());
}

int CudaCheckKernelImage() {
  // Every kernel here is in one fatbinary with the same architectures, so
  // one of them answers for all.
  cudaFuncAttributes attributes{};
  return static_cast<int>(cudaFuncGetAttributes(&attributes, ConvertKernel));
}

}  // namespace strata::kernels::internal
