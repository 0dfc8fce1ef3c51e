// One optimizer step through an installed Strata: the headers, the static
// libraries and their dependencies all come from find_package(strata).
#include <cstdio>
#include <memory>
#include <vector>

#include "offload/config.h"
#include "offload/optimizer.h"
#include "runtime/device.h"

int main() {
  using namespace strata;
  Result<std::unique_ptr<Device>> device = CreateHostDevice();
  if (!device.ok()) return 1;
  constexpr uint64_t kElems = 4096;
  Result<DeviceBuffer> data = (*device)->Allocate(kElems * 4);
  Result<DeviceBuffer> grad = (*device)->Allocate(kElems * 4);
  if (!data.ok() || !grad.ok()) return 1;
  auto* w = static_cast<float*>(data->data());
  auto* g = static_cast<float*>(grad->data());
  for (uint64_t i = 0; i < kElems; ++i) w[i] = 1.0f, g[i] = 1.0f;
  std::vector<ParamGroup> groups(1);
  groups[0].params.push_back({.name = "w", .data = w, .grad = g, .elems = kElems});
  groups[0].hyper.lr = 0.5;
  OffloadConfig config;
  config.max_grad_norm = 0;
  EngineContext context;
  context.device = device->get();
  Result<std::unique_ptr<OffloadOptimizer>> opt = OffloadOptimizer::Create(context, config, groups);
  if (!opt.ok()) {
    std::fprintf(stderr, "%s\n", opt.status().ToString().c_str());
    return 1;
  }
  Status s = (*opt)->Step();
  if (s.ok()) s = (*device)->Synchronize();
  if (!s.ok()) {
    std::fprintf(stderr, "%s\n", s.ToString().c_str());
    return 1;
  }
  // Adam's first step moves every weight by lr against the gradient's sign.
  std::printf("consumer: w[0] %.3f after one step\n", w[0]);
  return w[0] < 0.6f && w[0] > 0.4f ? 0 : 2;
}
