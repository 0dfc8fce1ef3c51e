// Launchers: validate once, then enqueue the host twin (emulated device) or
// launch the CUDA kernel (CUDA device) in stream order.
#include "kernels/kernels.h"

#include <fmt/format.h>

#include <algorithm>
#include <string>
#include <utility>
#include <vector>

#include "cpu_adam/cpu_adam_internal.h"
#include "kernels/kernels_internal.h"
#include "runtime/units.h"

#if STRATA_HAVE_CUDA
#include "runtime/cuda_internal.h"
#endif

namespace strata::kernels {
namespace {

using internal::ElemRange;

bool IsFloatType(DType t) { return t == DType::kF32 || t == DType::kF16 || t == DType::kBF16; }

std::string Describe(DType dtype, size_t elems) {
  return fmt::format("{} x {}", DTypeName(dtype), elems);
}

Status CheckTensor(std::string_view op, std::string_view name, const void* data, size_t elems,
                   DType dtype) {
  if (!IsFloatType(dtype)) {
    return InvalidArgumentError(
        fmt::format("{}: {} has dtype {}; only fp32, fp16 and bf16 are "
                    "supported",
                    op, name, DTypeName(dtype)));
  }
  if (data == nullptr && elems > 0) {
    return InvalidArgumentError(
        fmt::format("{}: {} ({}) has a null data pointer", op, name, Describe(dtype, elems)));
  }
  return OkStatus();
}

Status CheckSameLength(std::string_view op, std::string_view a, size_t a_elems, std::string_view b,
                       size_t b_elems) {
  if (a_elems != b_elems) {
    return InvalidArgumentError(
        fmt::format("{}: {} has {} elems but {} has {}; pass tensors of the same length", op, a,
                    a_elems, b, b_elems));
  }
  return OkStatus();
}

// Checks every entry's range against the bucket and against the others.
template <typename Entry>
Status CheckEntries(std::string_view op, std::span<const Entry> entries, size_t bucket_elems) {
  std::vector<std::pair<ElemRange, size_t>> ranges;  // range, entry index
  ranges.reserve(entries.size());
  for (size_t i = 0; i < entries.size(); ++i) {
    const Entry& e = entries[i];
    const std::string name = fmt::format("entry {}", i);
    STRATA_RETURN_IF_ERROR(CheckTensor(op, name, e.tensor.data, e.tensor.elems, e.tensor.dtype));
    if (e.offset_elems > bucket_elems || e.tensor.elems > bucket_elems - e.offset_elems) {
      return InvalidArgumentError(fmt::format(
          "{}: entry {} ({} at offset {}) ends past the bucket of {} elems; size the bucket to "
          "cover every entry",
          op, i, Describe(e.tensor.dtype, e.tensor.elems), e.offset_elems, bucket_elems));
    }
    if (e.tensor.elems > 0) {
      ranges.push_back({{e.offset_elems, e.offset_elems + e.tensor.elems}, i});
    }
  }
  std::sort(ranges.begin(), ranges.end(),
            [](const auto& a, const auto& b) { return a.first.begin < b.first.begin; });
  for (size_t k = 1; k < ranges.size(); ++k) {
    if (ranges[k].first.begin < ranges[k - 1].first.end) {
      return InvalidArgumentError(fmt::format(
          "{}: entry {} [{}, {}) overlaps entry {} [{}, {}) in the bucket; give each tensor its "
          "own range",
          op, ranges[k].second, ranges[k].first.begin, ranges[k].first.end, ranges[k - 1].second,
          ranges[k - 1].first.begin, ranges[k - 1].first.end));
    }
  }
  return OkStatus();
}

Status CheckStream(std::string_view op, const Device& device, StreamRef stream) {
  if (!stream) return InvalidArgumentError(fmt::format("{} on {}: null stream", op, device.name()));
  if (stream.impl()->owner() != &device) {
    return InvalidArgumentError(fmt::format("{} on {}: the stream belongs to device {}", op,
                                            device.name(), stream.impl()->owner()->name()));
  }
  return OkStatus();
}

bool RunsOnHost(const Device& device) { return device.caps().host_addressable_memory; }

// Enqueues a host twin in stream order.
template <typename Fn>
Status EnqueueHost(Device& device, StreamRef stream, Fn fn) {
  return device.LaunchHostTask(stream, [fn = std::move(fn)]() mutable -> Status {
    fn();
    return OkStatus();
  });
}

#if STRATA_HAVE_CUDA
// The error of a launch on `device` that found no kernel image for it: names
// its compute capability (internal::NoKernelImageError).
Status NoKernelImage(std::string_view op, const Device& device) {
  const int ordinal = device.caps().ordinal;
  int major = 0;
  int minor = 0;
  if (cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, ordinal) != cudaSuccess ||
      cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, ordinal) != cudaSuccess) {
    return strata::internal::CudaError(cudaErrorNoKernelImageForDevice,
                                       fmt::format("{} on {}: launch", op, device.name()));
  }
  return internal::NoKernelImageError(op, device.name(), major, minor,
                                      internal::BuiltCudaArchitectures());
}

// Runs `launch(cudaStream_t as void*)` with the device current (and the
// thread's previous current device restored afterwards); returns the launch
// error as a Status naming `op`.
template <typename Fn>
Status LaunchCuda(std::string_view op, Device& device, StreamRef stream, Fn launch) {
  STRATA_ASSIGN_OR_RETURN(cudaStream_t s, strata::internal::CudaStreamOf(stream));
  strata::internal::CudaDeviceGuard device_guard;
  STRATA_RETURN_IF_CUDA_ERROR(device_guard.Select(device.caps().ordinal),
                              fmt::format("{} on {}: select device", op, device.name()));
  // The launchers report cudaGetLastError() after each launch: an error an
  // earlier call on this thread left behind (a failed allocation, an ignored
  // return) must not read as this launch's. A sticky error is not cleared by
  // this and fails the launch itself.
  (void)cudaGetLastError();
  const auto err = static_cast<cudaError_t>(launch(static_cast<void*>(s)));
  // Strata's kernels always exist, so "invalid device function" too means
  // "not compiled for this device's architecture" (driver_types.h).
  if (err == cudaErrorNoKernelImageForDevice || err == cudaErrorInvalidDeviceFunction) {
    (void)cudaGetLastError();
    return NoKernelImage(op, device);
  }
  return strata::internal::CudaError(err, fmt::format("{} on {}: launch", op, device.name()));
}
#else
template <typename Fn>
Status LaunchCuda(std::string_view op, Device& device, StreamRef, Fn) {
  return UnimplementedError(
      fmt::format("{} on {}: this build has no CUDA kernels; rebuild with "
                  "STRATA_CUDA=ON",
                  op, device.name()));
}
#endif

}  // namespace

namespace internal {

Status NoKernelImageError(std::string_view op, std::string_view device, int cc_major, int cc_minor,
                          std::string_view built_architectures) {
  return FailedPreconditionError(fmt::format(
      "{} on {}: launch: cudaErrorNoKernelImageForDevice: this build's CUDA kernels are for "
      "CMAKE_CUDA_ARCHITECTURES={}, which has no kernel image for this GPU's compute "
      "capability {}.{}; rebuild Strata with -DCMAKE_CUDA_ARCHITECTURES={}{} (or a list that "
      "includes it, such as \"{}{};90\")",
      op, device, built_architectures.empty() ? "(none)" : built_architectures, cc_major, cc_minor,
      cc_major, cc_minor, cc_major, cc_minor));
}

std::string BuiltCudaArchitectures() {
#ifdef STRATA_CUDA_ARCHITECTURES
  // CMake passes its ;-list with commas (a ; would split the definition).
  std::string archs = STRATA_CUDA_ARCHITECTURES;
  std::replace(archs.begin(), archs.end(), ',', ';');
  return archs;
#else
  return "";
#endif
}

}  // namespace internal

Status CheckKernelsRunOn(Device& device) {
  if (RunsOnHost(device)) return OkStatus();
  return LaunchCuda("check kernels", device, device.DefaultStream(),
                    [](void*) { return internal::CudaCheckKernelImage(); });
}

Status PackGrads(Device& device, StreamRef stream, std::span<const PackEntry> entries,
                 DeviceTensor bucket, float scale) {
  constexpr std::string_view kOp = "pack grads";
  STRATA_RETURN_IF_ERROR(CheckStream(kOp, device, stream));
  STRATA_RETURN_IF_ERROR(CheckTensor(kOp, "bucket", bucket.data, bucket.elems, bucket.dtype));
  STRATA_RETURN_IF_ERROR(CheckEntries(kOp, entries, bucket.elems));
  std::vector<PackEntry> copy(entries.begin(), entries.end());
  if (RunsOnHost(device)) {
    return EnqueueHost(device, stream, [copy = std::move(copy), bucket, scale] {
      internal::PackGradsHost(copy, bucket, scale);
    });
  }
  return LaunchCuda(kOp, device, stream, [&](void* s) {
    const size_t elem_bytes = DTypeSize(bucket.dtype);
    auto* base = static_cast<std::byte*>(bucket.data);
    std::vector<ElemRange> used;
    for (const PackEntry& e : copy) {
      if (e.tensor.elems == 0) continue;
      const int err = internal::CudaConvert(s, e.tensor.data, e.tensor.dtype,
                                            base + e.offset_elems * elem_bytes, bucket.dtype,
                                            e.tensor.elems, scale, internal::ScaleModeOf(scale));
      if (err != 0) return err;
      used.push_back({e.offset_elems, e.offset_elems + e.tensor.elems});
    }
    for (const ElemRange& gap : internal::PaddingRanges(std::move(used), bucket.elems)) {
      const int err =
          internal::CudaZero(s, base + gap.begin * elem_bytes, (gap.end - gap.begin) * elem_bytes);
      if (err != 0) return err;
    }
    return 0;
  });
}

Status UnpackParams(Device& device, StreamRef stream, ConstDeviceTensor bucket,
                    std::span<const UnpackEntry> entries) {
  constexpr std::string_view kOp = "unpack params";
  STRATA_RETURN_IF_ERROR(CheckStream(kOp, device, stream));
  STRATA_RETURN_IF_ERROR(CheckTensor(kOp, "bucket", bucket.data, bucket.elems, bucket.dtype));
  STRATA_RETURN_IF_ERROR(CheckEntries(kOp, entries, bucket.elems));
  std::vector<UnpackEntry> copy(entries.begin(), entries.end());
  if (RunsOnHost(device)) {
    return EnqueueHost(device, stream, [copy = std::move(copy), bucket] {
      internal::UnpackParamsHost(bucket, copy);
    });
  }
  return LaunchCuda(kOp, device, stream, [&](void* s) {
    const size_t elem_bytes = DTypeSize(bucket.dtype);
    const auto* base = static_cast<const std::byte*>(bucket.data);
    for (const UnpackEntry& e : copy) {
      if (e.tensor.elems == 0) continue;
      const int err =
          internal::CudaConvert(s, base + e.offset_elems * elem_bytes, bucket.dtype, e.tensor.data,
                                e.tensor.dtype, e.tensor.elems, 1.0f, internal::ScaleMode::kNone);
      if (err != 0) return err;
    }
    return 0;
  });
}

namespace {

// Cast and Scale are one element-wise convert: dst = convert(src) (x scale).
Status LaunchConvert(std::string_view op, Device& device, StreamRef stream, const void* src,
                     DType src_dtype, void* dst, DType dst_dtype, size_t elems, float scale,
                     internal::ScaleMode mode) {
  if (RunsOnHost(device)) {
    return EnqueueHost(device, stream, [=] {
      internal::ConvertHost(src, src_dtype, dst, dst_dtype, elems, scale, mode);
    });
  }
  return LaunchCuda(op, device, stream, [&](void* s) {
    if (elems == 0) return 0;
    return internal::CudaConvert(s, src, src_dtype, dst, dst_dtype, elems, scale, mode);
  });
}

}  // namespace

Status Cast(Device& device, StreamRef stream, ConstDeviceTensor src, DeviceTensor dst) {
  constexpr std::string_view kOp = "cast";
  STRATA_RETURN_IF_ERROR(CheckStream(kOp, device, stream));
  STRATA_RETURN_IF_ERROR(CheckTensor(kOp, "src", src.data, src.elems, src.dtype));
  STRATA_RETURN_IF_ERROR(CheckTensor(kOp, "dst", dst.data, dst.elems, dst.dtype));
  STRATA_RETURN_IF_ERROR(CheckSameLength(kOp, "src", src.elems, "dst", dst.elems));
  return LaunchConvert(kOp, device, stream, src.data, src.dtype, dst.data, dst.dtype, dst.elems,
                       1.0f, internal::ScaleMode::kNone);
}

Status CastOnHost(ConstDeviceTensor src, DeviceTensor dst) {
  constexpr std::string_view kOp = "cast on host";
  STRATA_RETURN_IF_ERROR(CheckTensor(kOp, "src", src.data, src.elems, src.dtype));
  STRATA_RETURN_IF_ERROR(CheckTensor(kOp, "dst", dst.data, dst.elems, dst.dtype));
  STRATA_RETURN_IF_ERROR(CheckSameLength(kOp, "src", src.elems, "dst", dst.elems));
  internal::ConvertHost(src.data, src.dtype, dst.data, dst.dtype, dst.elems, 1.0f,
                        internal::ScaleMode::kNone);
  return OkStatus();
}

Status Scale(Device& device, StreamRef stream, DeviceTensor x, float scale) {
  constexpr std::string_view kOp = "scale";
  STRATA_RETURN_IF_ERROR(CheckStream(kOp, device, stream));
  STRATA_RETURN_IF_ERROR(CheckTensor(kOp, "x", x.data, x.elems, x.dtype));
  return LaunchConvert(kOp, device, stream, x.data, x.dtype, x.data, x.dtype, x.elems, scale,
                       internal::ScaleMode::kMultiply);
}

Status Accumulate(Device& device, StreamRef stream, ConstDeviceTensor src, DeviceTensor dst) {
  constexpr std::string_view kOp = "accumulate";
  STRATA_RETURN_IF_ERROR(CheckStream(kOp, device, stream));
  STRATA_RETURN_IF_ERROR(CheckTensor(kOp, "src", src.data, src.elems, src.dtype));
  STRATA_RETURN_IF_ERROR(CheckTensor(kOp, "dst", dst.data, dst.elems, dst.dtype));
  STRATA_RETURN_IF_ERROR(CheckSameLength(kOp, "src", src.elems, "dst", dst.elems));
  if (RunsOnHost(device)) {
    return EnqueueHost(device, stream, [src, dst] { internal::AccumulateHost(src, dst); });
  }
  return LaunchCuda(kOp, device, stream, [&](void* s) {
    if (dst.elems == 0) return 0;
    return internal::CudaAccumulate(s, src.data, src.dtype, dst.data, dst.dtype, dst.elems);
  });
}

size_t GradStatsBufferBytes(size_t elems) {
  const size_t blocks = (elems + kGradStatsBlockElemsDevice - 1) / kGradStatsBlockElemsDevice;
  return sizeof(DeviceGradStats) + blocks * sizeof(DeviceGradStats);
}

Result<DeviceGradStats> GradStatsOnHost(ConstDeviceTensor grad, float grad_scale) {
  STRATA_RETURN_IF_ERROR(CheckTensor("grad stats on host", "grad", grad.data, grad.elems,
                                     grad.dtype));
  DeviceGradStats out;
  internal::GradStatsHost(grad, grad_scale, &out);  // the host twin needs no scratch
  return out;
}

Status GradStats(Device& device, StreamRef stream, ConstDeviceTensor grad, float grad_scale,
                 void* stats_buffer, size_t stats_buffer_bytes) {
  constexpr std::string_view kOp = "grad stats";
  STRATA_RETURN_IF_ERROR(CheckStream(kOp, device, stream));
  STRATA_RETURN_IF_ERROR(CheckTensor(kOp, "grad", grad.data, grad.elems, grad.dtype));
  const size_t need = GradStatsBufferBytes(grad.elems);
  if (stats_buffer == nullptr || stats_buffer_bytes < need) {
    return InvalidArgumentError(fmt::format(
        "{}: stats buffer of {} bytes{} for {} grad elems; pass GradStatsBufferBytes() = {} bytes",
        kOp, stats_buffer_bytes, stats_buffer == nullptr ? " (null)" : "", grad.elems, need));
  }
  if (reinterpret_cast<uintptr_t>(stats_buffer) % alignof(DeviceGradStats) != 0) {
    return InvalidArgumentError(
        fmt::format("{}: stats buffer {} is not 8-byte aligned", kOp, stats_buffer));
  }
  if (RunsOnHost(device)) {
    return EnqueueHost(device, stream, [grad, grad_scale, stats_buffer] {
      internal::GradStatsHost(grad, grad_scale, stats_buffer);
    });
  }
  return LaunchCuda(kOp, device, stream, [&](void* s) {
    return internal::CudaGradStats(s, grad.data, grad.dtype, grad.elems, grad_scale, stats_buffer);
  });
}

Status AdamStep(Device& device, StreamRef stream, const AdamHyper& hyper,
                const DeviceAdamState& state, ConstDeviceTensor grad, DeviceTensor out) {
  constexpr std::string_view kOp = "adam step";
  STRATA_RETURN_IF_ERROR(CheckStream(kOp, device, stream));
  STRATA_ASSIGN_OR_RETURN(const cpu_adam_internal::AdamCoeffs c,
                          cpu_adam_internal::DeriveAdam(hyper));
  const size_t n = state.elems;
  STRATA_RETURN_IF_ERROR(CheckTensor(kOp, "params", state.params, n, DType::kF32));
  STRATA_RETURN_IF_ERROR(CheckTensor(kOp, "exp_avg", state.exp_avg, n, DType::kF32));
  STRATA_RETURN_IF_ERROR(CheckTensor(kOp, "exp_avg_sq", state.exp_avg_sq, n, DType::kF32));
  STRATA_RETURN_IF_ERROR(CheckTensor(kOp, "grad", grad.data, grad.elems, grad.dtype));
  STRATA_RETURN_IF_ERROR(CheckSameLength(kOp, "grad", grad.elems, "state", n));
  const bool has_out = !(out.data == nullptr && out.elems == 0);
  if (has_out) {
    STRATA_RETURN_IF_ERROR(CheckTensor(kOp, "out", out.data, out.elems, out.dtype));
    STRATA_RETURN_IF_ERROR(CheckSameLength(kOp, "out", out.elems, "state", n));
  }
  if (RunsOnHost(device)) {
    return device.LaunchHostTask(stream, [hyper, state, grad, out, has_out]() -> Status {
      const AdamState s{{state.params, state.elems},
                        {state.exp_avg, state.elems},
                        {state.exp_avg_sq, state.elems}};
      const GradView g{grad.dtype, grad.data, grad.elems};
      const OutView o = has_out ? OutView{out.dtype, out.data, out.elems} : OutView::None();
      return strata::AdamStep(hyper, s, g, o);
    });
  }
  const internal::AdamKernelCoeffs k{c.grad_scale,
                                     c.beta1,
                                     c.one_minus_beta1,
                                     c.beta2,
                                     c.one_minus_beta2,
                                     c.eps,
                                     c.bc2_sqrt,
                                     c.neg_step_size,
                                     c.l2_decay,
                                     c.decay_factor,
                                     static_cast<int>(c.decay)};
  return LaunchCuda(kOp, device, stream, [&](void* s) {
    if (n == 0) return 0;
    return internal::CudaAdamStep(s, k, state, grad.data, grad.dtype, has_out ? out.data : nullptr,
                                  out.dtype);
  });
}

}  // namespace strata::kernels
