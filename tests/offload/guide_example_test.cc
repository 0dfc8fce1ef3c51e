// The complete example of docs/guide.md, compiled and run: if this test
// needs a change, so does the guide.
#include <gtest/gtest.h>
#include <stdlib.h>
#include <unistd.h>

#include <filesystem>
#include <string>

// ---- docs/guide.md, "A complete example", from here ----
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "offload/config.h"
#include "offload/optimizer.h"
#include "runtime/device.h"
#include "runtime/dtype.h"
#include "runtime/log.h"
#include "runtime/status.h"

namespace example {

using namespace strata;

// A toy "model": bf16 weights and their bf16 grads in device memory. With a
// real framework these are its tensors' device pointers.
struct Tensor {
  std::string name;
  DeviceBuffer data{}, grad{};
  uint64_t elems = 0;
};

Status Train(const std::string& nvme_dir, int steps) {
  // 1. The device. The host device stands in for a GPU (CreateCudaDevice(0)
  //    on a GPU machine; OpenDevice("auto") picks one).
  STRATA_ASSIGN_OR_RETURN(std::unique_ptr<Device> device, CreateHostDevice());

  // 2. The config: DeepSpeed keys, plus Strata's own "strata" section. The
  //    struct's fields can be set as well.
  STRATA_ASSIGN_OR_RETURN(OffloadConfig config, ParseConfigJson(R"({
    "zero_optimization": {
      "stage": 2,
      "sub_group_size": 5e4,
      "offload_optimizer": {"device": "nvme", "nvme_path": "/local_nvme", "buffer_count": 4}
    },
    "aio": {"block_size": 262144, "queue_depth": 8},
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "betas": [0.9, 0.95],
                                              "weight_decay": 0.1}},
    "gradient_clipping": 1.0,
    "bf16": {"enabled": true},
    "strata": {"host_budget": "3500KiB", "threads": 0}
  })"));
  config.nvme_paths = {nvme_dir};  // here: the directory the caller gives

  // 3. The tensors, in two param groups: weights with decay, biases without.
  std::vector<Tensor> model;
  for (auto [name, elems] : {std::pair<const char*, uint64_t>{"fc1.weight", 512 * 256},
                             {"fc1.bias", 512},
                             {"fc2.weight", 256 * 512},
                             {"fc2.bias", 256}}) {
    Tensor t{.name = name, .elems = elems};
    STRATA_ASSIGN_OR_RETURN(t.data, device->Allocate(elems * 2));
    STRATA_ASSIGN_OR_RETURN(t.grad, device->Allocate(elems * 2));
    auto* w = static_cast<uint16_t*>(t.data.data());  // host device: host-addressable
    for (uint64_t i = 0; i < elems; ++i) w[i] = F32ToBF16(std::sin(0.01f * i) * 0.05f);
    model.push_back(std::move(t));
  }
  std::vector<ParamGroup> groups(2);
  groups[0].hyper = DefaultGroupHyper(config);  // the config's optimizer section
  groups[1].hyper = DefaultGroupHyper(config);
  groups[1].hyper.weight_decay = 0.0;
  for (Tensor& t : model) {
    const bool bias = t.name.ends_with(".bias");
    groups[bias ? 1 : 0].params.push_back(
        {.name = t.name, .data = t.data.data(), .grad = t.grad.data(), .elems = t.elems});
  }

  // 4. The optimizer: plans where the state lives (and logs the plan), opens
  //    the NVMe files, copies the params into the fp32 master weights.
  STRATA_ASSIGN_OR_RETURN(std::unique_ptr<OffloadOptimizer> opt,
                          OffloadOptimizer::Create({.device = device.get()}, config, groups));

  // 5. The training loop.
  for (int step = 0; step < steps; ++step) {
    // forward + backward(loss * opt->loss_scale()) write the grads; here, made up:
    for (Tensor& t : model) {
      auto* g = static_cast<uint16_t*>(t.grad.data());
      for (uint64_t i = 0; i < t.elems; ++i) g[i] = F32ToBF16(std::cos(0.1f * i + step) * 1e-2f);
    }
    // A learning-rate schedule: change a group's hyperparameters between steps.
    GroupHyper h = opt->group_hyper(0);
    h.lr = 1e-3 * std::min(1.0, (step + 1) / 2.0);  // warm-up
    STRATA_RETURN_IF_ERROR(opt->SetGroupHyper(0, h));

    STRATA_RETURN_IF_ERROR(opt->Step());  // params updated in place, ordered on the stream
    STRATA_RETURN_IF_ERROR(opt->ZeroGrad());
    LogInfo(FormatStepStats(opt->last_step()));  // stage times, loss scale, grad norm
  }
  // Before the host reads the params: wait for the device (the default stream).
  return device->Synchronize();
}

}  // namespace example
// ---- to here ----

namespace strata {
namespace {

// Runs, and places the state as the guide says: 5 of 6 sub-groups on NVMe.
TEST(GuideExample, RunsWithThePlacementTheGuideShows) {
  char tmpl[] = "/tmp/strata-guide-XXXXXX";
  ASSERT_NE(::mkdtemp(tmpl), nullptr);
  const std::string dir = tmpl;
  std::string log;
  LogSink previous = SetLogSink([&](LogLevel level, std::string_view message) {
    log.append(message).append("\n");
    WriteLogToStderr(level, message);
  });
  const Status s = example::Train(dir, 3);
  SetLogSink(std::move(previous));
  EXPECT_TRUE(s.ok()) << s;
  EXPECT_NE(log.find("sub-groups: 0-4 nvme, 5 host"), std::string::npos) << log;
  EXPECT_NE(log.find("nvme read 592.00 KiB write 2.89 MiB"), std::string::npos) << log;
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace strata
