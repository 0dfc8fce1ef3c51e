#include "offload/rate_probe.h"

#include <algorithm>
#include <chrono>
#include <cstddef>
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
      reinterpret_cast<uint16_t*>(g.data())[i] =
          dtype == DType::kBF16 ? F32ToBF16(x) : F32ToF16(x);
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
  std::vector<std::byte> out(n * DTypeSize(shape.out));
  const AdamState s{.params = {state.data(), n},
                    .exp_avg = {state.data() + n, n},
                    .exp_avg_sq = {state.data() + 2 * n, n}};
  AdamHyper hyper{.lr = 1e-3, .step = 0};
  return BestRate(n, [&] {
    ++hyper.step;
    return cpu.Step(hyper, s, GradView{shape.grad, grad.data(), n},
                    OutView{shape.out, out.data(), n});
  });
}

Result<double> MeasureDeviceAdamRate(Device& device, const AdamShape& shape, uint64_t elems) {
  const size_t n = static_cast<size_t>(std::max<uint64_t>(elems, 1));
  const size_t out_elems = shape.device_writes_params ? n : 0;
  STRATA_ASSIGN_OR_RETURN(DeviceBuffer state, device.Allocate(3 * n * sizeof(float)));
  STRATA_ASSIGN_OR_RETURN(DeviceBuffer grad, device.Allocate(n * DTypeSize(shape.grad)));
  STRATA_ASSIGN_OR_RETURN(DeviceBuffer out,
                          device.Allocate(std::max<size_t>(out_elems * DTypeSize(shape.out), 1)));
  STRATA_ASSIGN_OR_RETURN(Stream stream, device.CreateStream());
  // Zero state (PackGrads of no entries zero-fills its bucket), the gradients copied up.
  STRATA_RETURN_IF_ERROR(
      kernels::PackGrads(device, stream, {}, {state.data(), 3 * n, DType::kF32}));
  const std::vector<std::byte> g = Gradients(n, shape.grad);
  STRATA_RETURN_IF_ERROR(
      device.CopyAsync(grad.data(), g.data(), g.size(), CopyKind::kHostToDevice, stream));
  STRATA_RETURN_IF_ERROR(device.StreamSynchronize(stream));
  float* s = state.as<float>();
  AdamHyper hyper{.lr = 1e-3, .step = 0};
  return BestRate(n, [&]() -> Status {
    ++hyper.step;
    STRATA_RETURN_IF_ERROR(kernels::AdamStep(
        device, stream, hyper, {s, s + n, s + 2 * n, n}, {grad.data(), n, shape.grad},
        {shape.device_writes_params ? out.data() : nullptr, out_elems, shape.out}));
    return device.StreamSynchronize(stream);
  });
}

}  // namespace strata
