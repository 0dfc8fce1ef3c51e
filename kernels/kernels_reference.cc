// The scalar references of the host twins: plain element-at-a-time C++ with
// the conversions of runtime/dtype.h, the code the emulated device ran
// before its twins were vectorized (kernels_host.cc). The tests and the
// benchmark check the twins against these bit for bit; they stay simple on
// purpose. Compiled with -ffp-contract=off (see CMakeLists.txt) so no
// multiply-add is fused, as in the CUDA kernels.
#include <algorithm>
#include <cmath>
#include <cstring>

#include "kernels/elem_access.h"
#include "kernels/kernels.h"
#include "kernels/kernels_internal.h"
#include "runtime/dtype.h"

namespace strata::kernels::internal {

void ConvertReference(const void* src, DType src_dtype, void* dst, DType dst_dtype, size_t elems,
                      float scale, ScaleMode mode) {
  for (size_t i = 0; i < elems; ++i) {
    float v = LoadElem(src, src_dtype, i);
    if (mode == ScaleMode::kMultiply) v = v * scale;
    StoreElem(dst, dst_dtype, i, v);
  }
}

void AccumulateReference(ConstDeviceTensor src, DeviceTensor dst) {
  for (size_t i = 0; i < dst.elems; ++i) {
    StoreElem(dst.data, dst.dtype, i,
              LoadElem(dst.data, dst.dtype, i) + LoadElem(src.data, src.dtype, i));
  }
}

void GradStatsReference(ConstDeviceTensor grad, float grad_scale, void* stats_buffer) {
  // Mirrors kernels_cuda.cu's two passes exactly: per block, kGradStatsThreads
  // strided partial sums and a fixed tree; then the block sums the same way:
  // lane t adds blocks t, t + 256, ... in order, and the same fixed tree.
  const size_t blocks = (grad.elems + kGradStatsBlockElemsDevice - 1) / kGradStatsBlockElemsDevice;
  double lanes[kGradStatsThreads] = {};
  uint64_t nonfinite = 0;
  for (size_t b = 0; b < blocks; ++b) {
    const size_t begin = b * kGradStatsBlockElemsDevice;
    const size_t end = std::min(grad.elems, begin + kGradStatsBlockElemsDevice);
    double partial[kGradStatsThreads];
    for (size_t t = 0; t < kGradStatsThreads; ++t) {
      double acc = 0.0;
      for (size_t i = begin + t; i < end; i += kGradStatsThreads) {
        const float g = LoadElem(grad.data, grad.dtype, i);
        if (!std::isfinite(g)) ++nonfinite;
        const double d = static_cast<double>(g);
        acc = acc + d * d;
      }
      partial[t] = acc;
    }
    for (size_t stride = kGradStatsThreads / 2; stride > 0; stride /= 2) {
      for (size_t t = 0; t < stride; ++t) partial[t] = partial[t] + partial[t + stride];
    }
    double& lane = lanes[b % kGradStatsThreads];
    lane = lane + partial[0];
  }
  for (size_t stride = kGradStatsThreads / 2; stride > 0; stride /= 2) {
    for (size_t t = 0; t < stride; ++t) lanes[t] = lanes[t] + lanes[t + stride];
  }
  const double total = lanes[0];
  const double s = static_cast<double>(grad_scale);
  DeviceGradStats result{total * (s * s), nonfinite};
  std::memcpy(stats_buffer, &result, sizeof(result));
}

}  // namespace strata::kernels::internal
