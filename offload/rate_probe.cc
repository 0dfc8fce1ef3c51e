#include "offload/rate_probe.h"

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdlib>
#include <memory>
#include <vector>

#include "kernels/kernels.h"

namespace strata {
namespace {

constexpr int kPasses = 4;

// Small, varied, finite values in `dtype`.
std::vector<std::byte> Gradients(uint64_t n, DType dtype) {
  std::vector<std::byte> g(n * DTypeSize(dtype));
  for (uint64_t i = 0; i < n; ++i) {
    const float x = (static_cast<float>((i * 2654435761u) % 2000u) * 1e-3f - 1.0f) * 1e-2f;
    if (dtype == DType::kF32) {
      reinterpret_cast<float*>(g.data())[i] = x;
    } else {
      reinterpret_cast<uint16_t*>(g.data())[i] = dtype == DType::kBF16 ? F32ToBF16(x) : F32ToF16(x);
    }
  }
  return g;
}

template <typename Pass>
Result<double> BestRate(uint64_t elems, Pass pass) {
  double best = 0;
  for (int i = 0; i < kPasses; ++i) {
    const auto t0 = std::chrono::steady_clock::now();
    STRATA_RETURN_IF_ERROR(pass());
    const double sec = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (i > 0 && sec > 0) best = std::max(best, static_cast<double>(elems) / sec);
  }
  return best;
}

}  // namespace

Result<double> MeasureCpuAdamRate(CpuAdam& cpu, const AdamShape& shape, uint64_t elems) {
  const size_t n = static_cast<size_t>(std::max<uint64_t>(elems, 1));
  std::vector<float> state(3 * n, 0.0f);
  const std::vector<std::byte> grad = Gradients(n, shape.grad);
  // Page-aligned, as the engine's param slots are: the update streams an
  // aligned output (cpu_adam-inl.h), and the probe should see that rate.
  const size_t out_bytes = n * DTypeSize(shape.out);
  constexpr size_t kPage = 4096;
  const std::unique_ptr<std::byte, decltype(&std::free)> out(
      static_cast<std::byte*>(std::aligned_alloc(kPage, (out_bytes + kPage - 1) / kPage * kPage)),
      &std::free);
  if (out == nullptr) {
    return ResourceExhaustedError("measure the CPU Adam rate: out of host memory");
  }
  const AdamState s{.params = {state.data(), n},
                    .exp_avg = {state.data() + n, n},
                    .exp_avg_sq = {state.data() + 2 * n, n}};
  AdamHyper hyper{.lr = 1e-3, .step = 0};
  return BestRate(n, [&] {
    ++hyper.step;
    return cpu.Step(hyper, s, GradView{shape.grad, grad.data(), n},
                    OutView{shape.out, out.get(), n});
  });
}

Result<DeviceAdamProbe> DeviceAdamProbe::Create(Device& device, const AdamShape& shape,
                                                uint64_t elems) {
  DeviceAdamProbe p(device, shape, std::max<uint64_t>(elems, 1));
  const size_t n = static_cast<size_t>(p.n_);
  const size_t out_elems = shape.device_writes_params ? n : 0;
  STRATA_ASSIGN_OR_RETURN(p.state_, device.Allocate(3 * n * sizeof(float)));
  STRATA_ASSIGN_OR_RETURN(p.grad_, device.Allocate(n * DTypeSize(shape.grad)));
  STRATA_ASSIGN_OR_RETURN(p.out_,
                          device.Allocate(std::max<size_t>(out_elems * DTypeSize(shape.out), 1)));
  STRATA_ASSIGN_OR_RETURN(p.stream_, device.CreateStream());
  // Zero state (PackGrads of no entries zero-fills its bucket), the gradients copied up.
  STRATA_RETURN_IF_ERROR(
      kernels::PackGrads(device, p.stream_, {}, {p.state_.data(), 3 * n, DType::kF32}));
  const std::vector<std::byte> g = Gradients(n, shape.grad);
  STRATA_RETURN_IF_ERROR(
      device.CopyAsync(p.grad_.data(), g.data(), g.size(), CopyKind::kHostToDevice, p.stream_));
  STRATA_RETURN_IF_ERROR(device.StreamSynchronize(p.stream_));
  return p;
}

Status DeviceAdamProbe::Launch() {
  const size_t n = static_cast<size_t>(n_);
  const size_t out_elems = shape_.device_writes_params ? n : 0;
  float* s = state_.as<float>();
  const AdamHyper hyper{.lr = 1e-3, .step = static_cast<int64_t>(++step_)};
  return kernels::AdamStep(
      *device_, stream_, hyper, {s, s + n, s + 2 * n, n}, {grad_.data(), n, shape_.grad},
      {shape_.device_writes_params ? out_.data() : nullptr, out_elems, shape_.out});
}

Status DeviceAdamProbe::Wait() { return device_->StreamSynchronize(stream_); }

Result<double> MeasureDeviceAdamRate(Device& device, const AdamShape& shape, uint64_t elems) {
  STRATA_ASSIGN_OR_RETURN(DeviceAdamProbe probe, DeviceAdamProbe::Create(device, shape, elems));
  return BestRate(probe.elems(), [&]() -> Status {
    STRATA_RETURN_IF_ERROR(probe.Launch());
    return probe.Wait();
  });
}

}  // namespace strata
