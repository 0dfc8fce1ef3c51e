// Host twins of the CUDA kernels: plain element-at-a-time C++, using the
// scalar conversions of runtime/dtype.h. They run on the emulated device's
// stream workers and are the references the CUDA kernels are checked against,
// so they stay simple on purpose. Compiled with -ffp-contract=off (see
// CMakeLists.txt) so no multiply-add is fused, as in the CUDA kernels.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "kernels/kernels.h"
#include "kernels/elem_access.h"
#include "kernels/kernels_internal.h"
#include "runtime/dtype.h"

namespace strata::kernels::internal {
namespace {

}  // namespace

void ConvertHost(const void* src, DType src_dtype, void* dst, DType dst_dtype, size_t elems,
                 float scale, ScaleMode mode) {
  for (size_t i = 0; i < elems; ++i) {
    float v = LoadElem(src, src_dtype, i);
    if (mode == ScaleMode::kMultiply) v = v * scale;
    StoreElem(dst, dst_dtype, i, v);
  }
}

std::vector<ElemRange> PaddingRanges(std::vector<ElemRange> used, size_t bucket_elems) {
  std::sort(used.begin(), used.end(),
            [](const ElemRange& a, const ElemRange& b) { return a.begin < b.begin; });
  std::vector<ElemRange> gaps;
  size_t pos = 0;
  for (const ElemRange& r : used) {
    if (r.begin > pos) gaps.push_back({pos, r.begin});
    pos = std::max(pos, r.end);
  }
  if (pos < bucket_elems) gaps.push_back({pos, bucket_elems});
  return gaps;
}

void PackGradsHost(std::span<const PackEntry> entries, DeviceTensor bucket, float scale) {
  const size_t elem_bytes = DTypeSize(bucket.dtype);
  auto* base = static_cast<std::byte*>(bucket.data);
  std::vector<ElemRange> used;
  used.reserve(entries.size());
  for (const PackEntry& e : entries) {
    ConvertHost(e.tensor.data, e.tensor.dtype, base + e.offset_elems * elem_bytes, bucket.dtype,
                e.tensor.elems, scale, ScaleModeOf(scale));
    used.push_back({e.offset_elems, e.offset_elems + e.tensor.elems});
  }
  // All-zero bits are +0 in fp32, fp16 and bf16.
  for (const ElemRange& gap : PaddingRanges(std::move(used), bucket.elems)) {
    std::memset(base + gap.begin * elem_bytes, 0, (gap.end - gap.begin) * elem_bytes);
  }
}

void UnpackParamsHost(ConstDeviceTensor bucket, std::span<const UnpackEntry> entries) {
  const size_t elem_bytes = DTypeSize(bucket.dtype);
  const auto* base = static_cast<const std::byte*>(bucket.data);
  for (const UnpackEntry& e : entries) {
    ConvertHost(base + e.offset_elems * elem_bytes, bucket.dtype, e.tensor.data, e.tensor.dtype,
                e.tensor.elems, 1.0f, ScaleMode::kNone);
  }
}

void AccumulateHost(ConstDeviceTensor src, DeviceTensor dst) {
  for (size_t i = 0; i < dst.elems; ++i) {
    StoreElem(dst.data, dst.dtype, i, LoadElem(dst.data, dst.dtype, i) + LoadElem(src.data, src.dtype, i));
  }
}

void GradStatsHost(ConstDeviceTensor grad, float grad_scale, void* stats_buffer) {
  // Mirrors kernels_cuda.cu's two passes exactly: per block, kGradStatsThreads
  // strided partial sums, a fixed tree, then the block sums in block order.
  const size_t blocks = (grad.elems + kGradStatsBlockElemsDevice - 1) / kGradStatsBlockElemsDevice;
  double total = 0.0;
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
    total = total + partial[0];
  }
  const double s = static_cast<double>(grad_scale);
  DeviceGradStats result{total * (s * s), nonfinite};
  std::memcpy(stats_buffer, &result, sizeof(result));
}

}  // namespace strata::kernels::internal
