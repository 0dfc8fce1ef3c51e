// kernels: the few element-wise kernels the offload engine runs on device
// memory (pack gradients into flat buckets and unpack params back, cast,
// scale, accumulate, gradient statistic, fused Adam), as launchers that
// enqueue work on a stream of a Device.
//
// Every launcher dispatches on the device kind:
//   - CUDA: launches the kernel of kernels/*.cu on the stream's cudaStream_t.
//   - host (emulated, caps().host_addressable_memory): enqueues the kernel's
//     host twin (kernels/kernels_host.cc, plain C++) with
//     Device::LaunchHostTask, so it runs on the stream's worker thread in
//     stream order, never inline in the caller.
// The host twins are also the references the CUDA kernels are tested against
// (tests/kernels): cast, pack, unpack, scale and accumulate are bit for bit
// equal, except that a NaN produced by arithmetic (scale, accumulate, a
// scaled pack) is a NaN of unspecified sign and payload (x86 keeps the
// input's, CUDA returns the canonical NaN); GradStats uses the same blocking and reduction order on
// both; Adam runs cpu_adam's formula with the same fp32 operations (see docs/kernels.md for the
// stated tolerances).
//
//   STRATA_ASSIGN_OR_RETURN(auto dev, OpenDevice("auto"));
//   std::vector<PackEntry> entries = {{{g0, n0, DType::kBF16}, 0},
//                                     {{g1, n1, DType::kBF16}, 1024}};
//   STRATA_RETURN_IF_ERROR(PackGrads(*dev, stream, entries,
//                                    {bucket, bucket_elems, DType::kF32}, 1.0f / scale));
//   // stats_buf: device memory of GradStatsBufferBytes(bucket_elems) bytes.
//   STRATA_RETURN_IF_ERROR(GradStats(*dev, stream, {bucket, bucket_elems, DType::kF32},
//                                    1.0f, stats_buf, GradStatsBufferBytes(bucket_elems)));
//   STRATA_RETURN_IF_ERROR(dev->StreamSynchronize(stream));
//
// Ordering and lifetime: a launcher returns as soon as the work is enqueued
// (before it runs). Every pointer passed must be device memory of `device`
// (on the host device: any host memory) and stay valid until the stream has
// run the work; the argument vectors (entries) are copied by the launcher.
// Results become visible to other streams or the host after the stream (or
// an event recorded after the launch) is synchronized.
//
// Errors: InvalidArgument, returned synchronously, before anything is
// enqueued, for a null or foreign stream, a null pointer with elems > 0, an
// unsupported dtype (only fp32, fp16 and bf16 are accepted; fp16/bf16 as raw
// 16-bit patterns), length mismatches, pack/unpack ranges outside the bucket
// or overlapping one another, a too small stats buffer, and bad Adam
// hyperparameters (cpu_adam's checks). CUDA launch failures return the
// CUDA error as a Status (see runtime/cuda_internal.h); a GPU this build has
// no kernel image for (CMAKE_CUDA_ARCHITECTURES) is FailedPrecondition naming
// its compute capability and the flag to rebuild with. An error of the work
// itself becomes the stream's sticky error (runtime/device.h).
//
// Current device: on CUDA a launcher makes the stream's device current for
// the launch and then restores the calling thread's previous one.
//
// Alignment: element alignment only (4 bytes for fp32, 2 for fp16/bf16).
// Overlap: sources and destinations of one call must not overlap, except
// Scale, which is in place.
// Thread-safety: the launchers are thread-safe (they only enqueue).
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>

#include "cpu_adam/cpu_adam.h"
#include "runtime/device.h"
#include "runtime/dtype.h"
#include "runtime/status.h"

namespace strata::kernels {

// A tensor in device memory: `elems` elements of `dtype`. Not owning.
struct DeviceTensor {
  void* data = nullptr;
  size_t elems = 0;
  DType dtype = DType::kF32;
};
struct ConstDeviceTensor {
  const void* data = nullptr;
  size_t elems = 0;
  DType dtype = DType::kF32;
};

// One tensor of a flat bucket: it occupies bucket elements
// [offset_elems, offset_elems + tensor.elems).
struct PackEntry {
  ConstDeviceTensor tensor;
  size_t offset_elems = 0;
};
struct UnpackEntry {
  DeviceTensor tensor;
  size_t offset_elems = 0;
};

// OK when this build's kernels can run on `device`: always on the host
// device; on CUDA, when the build has a kernel image for the GPU's compute
// capability. Otherwise the FailedPrecondition a launch would return (see
// Errors above), so a caller can refuse the device before any work instead
// of failing inside it. Enqueues nothing.
Status CheckKernelsRunOn(Device& device);

// Gathers each entry's tensor into `bucket` at its offset, converted to the
// bucket's dtype: bucket[off + i] = convert(float(src[i]) * scale) (the
// multiply is skipped when scale == 1, so fp16/bf16 -> fp32 and same-dtype
// packs are exact copies). Bucket elements covered by no entry (padding) are
// set to +0. Entries may come in any order; their ranges must lie inside
// the bucket and not overlap.
Status PackGrads(Device& device, StreamRef stream, std::span<const PackEntry> entries,
                 DeviceTensor bucket, float scale = 1.0f);

// The reverse scatter: dst[i] = convert(bucket[off + i]) for every entry.
// Same range rules as PackGrads; bucket elements covered by no entry are
// not read.
Status UnpackParams(Device& device, StreamRef stream, ConstDeviceTensor bucket,
                    std::span<const UnpackEntry> entries);

// dst[i] = convert(src[i]) between fp32, fp16 and bf16 (also same dtype:
// a copy). Conversions are bit for bit runtime/dtype.h's F32ToF16,
// F32ToBF16, F16ToF32, BF16ToF32 (round to nearest even, NaN kept quiet,
// overflow to inf); fp16 <-> bf16 goes through fp32. Lengths must match.
Status Cast(Device& device, StreamRef stream, ConstDeviceTensor src, DeviceTensor dst);

// Cast run synchronously on the calling thread, over host memory: the host
// twin, vectorized, the same bits as Cast on any backend. For data that is
// already on the host (a checkpoint's fp32 master weights exported as
// bf16/fp16). InvalidArgument as Cast.
Status CastOnHost(ConstDeviceTensor src, DeviceTensor dst);

// x[i] = convert(float(x[i]) * scale), in place.
Status Scale(Device& device, StreamRef stream, DeviceTensor x, float scale);

// dst[i] = convert(float(dst[i]) + float(src[i])) (gradient accumulation
// across micro-batches; any dtype pair). Lengths must match.
Status Accumulate(Device& device, StreamRef stream, ConstDeviceTensor src, DeviceTensor dst);

// The result GradStats writes at the start of its stats buffer (16 bytes,
// 8-byte aligned). Same meaning as cpu_adam's GradStats. A trivial type:
// it is the layout of device memory, copied with memcpy.
struct DeviceGradStats {
  double sum_sq;             // grad_scale^2 * sum(float(g_i)^2), summed in double
  uint64_t nonfinite_elems;  // g_i that are inf or NaN
};
static_assert(sizeof(DeviceGradStats) == 16);

// Threads per block and elements per block of GradStats: thread t of a block
// sums elements t, t + 256, ... of its block in order, the 256 partial sums
// are combined by a fixed tree (stride 128, 64, ..., 1); the block sums are
// combined the same way (thread t adds blocks t, t + 256, ... in order, then
// the same tree). The host twin does exactly the same.
inline constexpr size_t kGradStatsThreads = 256;
inline constexpr size_t kGradStatsBlockElemsDevice = 16 * kGradStatsThreads;

// Bytes of device memory GradStats needs for `elems` gradient elements: the
// DeviceGradStats followed by scratch for the per-block partials.
size_t GradStatsBufferBytes(size_t elems);

// Computes the squared L2 norm and the non-finite count of `grad` into
// `stats_buffer` (device memory, 8-byte aligned, at least
// GradStatsBufferBytes(grad.elems) bytes; it starts with a DeviceGradStats).
// Deterministic: the result does not depend on timing or on the backend
// beyond the rounding of double additions, which both do in the same order.
Status GradStats(Device& device, StreamRef stream, ConstDeviceTensor grad, float grad_scale,
                 void* stats_buffer, size_t stats_buffer_bytes);

// GradStats's host twin run synchronously on the calling thread, over host
// memory: the same result bit for bit as GradStats on any backend. For
// gradients that already are on the host (the engine's fp32 accumulation
// buffer) and for references in tests. InvalidArgument as GradStats.
Result<DeviceGradStats> GradStatsOnHost(ConstDeviceTensor grad, float grad_scale);

// The fp32 Adam state of `elems` elements in device memory.
struct DeviceAdamState {
  float* params = nullptr;
  float* exp_avg = nullptr;
  float* exp_avg_sq = nullptr;
  size_t elems = 0;
};

// Fused Adam/AdamW, cpu_adam's formula and order of operations
// (cpu_adam/cpu_adam.h), for the part of the optimizer state kept on the
// GPU. `out` receives the updated params converted to its dtype; an `out`
// with data == nullptr and elems == 0 writes nothing. Grad and out lengths
// must equal state.elems. The host twin is cpu_adam's single-threaded
// AdamStep.
Status AdamStep(Device& device, StreamRef stream, const AdamHyper& hyper,
                const DeviceAdamState& state, ConstDeviceTensor grad, DeviceTensor out);

}  // namespace strata::kernels
