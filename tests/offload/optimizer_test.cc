// OffloadOptimizer on the host device: bitwise equal to the all-in-memory
// reference whatever the placement, dtype, optimizer, sub-group size and
// pipeline depth; retry after an NVMe fault; validation.
#include "offload/optimizer.h"

#include <gtest/gtest.h>

#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "offload/placement.h"
#include "runtime/testing/fault_storage.h"
#include "tests/offload/optimizer_test_util.h"
#include "tests/offload/test_seed.h"

namespace strata {
namespace {

using testing::ExpectSameAsReference;
using testing::FlatStats;
using testing::ReferenceOptimizer;
using testing::TestModel;
using testing::TestSeed;

enum class Where { kHost, kNvme, kMixed };

struct Case {
  std::string name;
  Where where = Where::kHost;
  DType param_dtype = DType::kBF16;
  DType grad_dtype = DType::kF32;
  OptimizerType optimizer = OptimizerType::kAdamW;
  uint32_t buffer_count = 2;
  uint64_t sub_group_elems = 1024;
  double max_grad_norm = 0.0;
};

// Tensor sizes that put tensor and group boundaries inside sub-groups, a
// 0-elem tensor, and one longer than a sub-group.
const std::vector<uint64_t> kSizes = {1000, 37, 4096, 1, 0, 2500, 777, 64};
const std::vector<uint32_t> kGroupOf = {0, 0, 1, 0, 1, 1, 0, 1};
const std::vector<GroupHyper> kHypers = {
    {.lr = 1e-2, .beta1 = 0.9, .beta2 = 0.999, .eps = 1e-8, .weight_decay = 0.1},
    {.lr = 3e-3, .beta1 = 0.8, .beta2 = 0.99, .eps = 1e-6, .weight_decay = 0.0}};

OffloadConfig MakeConfig(const Case& c) {
  OffloadConfig config;
  config.optimizer = c.optimizer;
  config.param_dtype = c.param_dtype;
  config.grad_dtype = c.grad_dtype;
  config.buffer_count = c.buffer_count;
  config.sub_group_elems = c.sub_group_elems;
  config.max_grad_norm = c.max_grad_norm;
  config.threads = 2;
  config.aio.block_bytes = 8192;
  if (c.param_dtype == DType::kF16) config.loss_scaler = {.mode = LossScaleMode::kDynamic};
  if (c.where != Where::kHost) {
    config.device = OffloadDevice::kNvme;
    config.nvme_paths = {"/mem/nvme0"};
  }
  return config;
}

// For kMixed: a host budget that holds the staging and about half the state.
void SetMixedBudget(OffloadConfig& config, uint64_t total_tensor_elems) {
  FlatLayout layout = *PlanFlatLayout(std::vector<TensorSpec>(kSizes.size() + 0, TensorSpec{}),
                                      {.align_elems = config.align_elems});
  (void)layout;
  std::vector<TensorSpec> specs;
  for (uint64_t n : kSizes) specs.push_back({.elems = n, .dtype = config.param_dtype});
  layout = *PlanFlatLayout(specs, {.align_elems = config.align_elems});
  auto sgs = *CutSubGroups(*ShardRange(layout, 0), config.sub_group_elems);
  std::vector<uint64_t> sizes;
  for (auto& r : sgs) sizes.push_back(r.elems());
  PlacementInputs in = PlacementInputsFor(config, sizes);
  in.host_budget_bytes = 0;  // staging only
  PlacementPlan staging_only = *PlanPlacement(in);
  config.host_budget_bytes = staging_only.host_staging_bytes + staging_only.nvme_state_bytes / 4;
  (void)total_tensor_elems;
}

class EngineBitwiseTest : public ::testing::TestWithParam<Case> {};

TEST_P(EngineBitwiseTest, MatchesTheInMemoryReference) {
  const Case& c = GetParam();
  const uint64_t seed = TestSeed();
  std::mt19937_64 rng(seed);
  auto device = *CreateHostDevice();
  auto storage = CreateMemStorage();
  TestModel model(*device, kSizes, kGroupOf, c.param_dtype, c.grad_dtype);
  OffloadConfig config = MakeConfig(c);
  if (c.where == Where::kMixed) SetMixedBudget(config, 0);
  auto master = model.SetParams(rng);
  auto opt_or = OffloadOptimizer::Create({.device = device.get(), .storage = storage.get()}, config,
                                         model.Groups(kHypers));
  ASSERT_TRUE(opt_or.ok()) << opt_or.status();
  auto opt = std::move(*opt_or);
  const PlacementPlan& plan = opt->plan();
  switch (c.where) {
    case Where::kHost:
      EXPECT_EQ(plan.nvme_sub_groups, 0u);
      break;
    case Where::kNvme:
      EXPECT_EQ(plan.host_sub_groups, 0u);
      break;
    case Where::kMixed:
      EXPECT_GT(plan.host_sub_groups, 0u);
      EXPECT_GT(plan.nvme_sub_groups, 0u);
      break;
  }
  ReferenceOptimizer ref(config, master, kGroupOf, kHypers);
  const auto order = model.FlatOrder();
  for (int step = 0; step < 3; ++step) {
    auto grads = model.SetGrads(model.RandomGrads(rng, 0.5f));
    Status s = opt->Step();
    ASSERT_TRUE(s.ok()) << s;
    const GradStats st = FlatStats(opt->layout(), order, grads);
    ref.Step(grads, st.sum_sq, st.nonfinite_elems);
    EXPECT_EQ(opt->step_count(), ref.step());
    EXPECT_FALSE(opt->last_step().skipped);
    ExpectSameAsReference(*opt, model, ref);
    ASSERT_TRUE(opt->ZeroGrad().ok());
    // The test writes the next grads from the host: wait for the zeroing.
    ASSERT_TRUE(device->Synchronize().ok());
    for (size_t t = 0; t < model.size(); ++t) {
      for (uint8_t b : model.GradBytes(t)) ASSERT_EQ(b, 0) << "ZeroGrad left tensor " << t;
    }
  }
  if (c.where != Where::kHost) {
    EXPECT_GT(opt->last_step().read_bytes, 0u);
    EXPECT_GT(opt->last_step().write_bytes, 0u);
  }
}

INSTANTIATE_TEST_SUITE_P(
    Placements, EngineBitwiseTest,
    ::testing::Values(
        Case{.name = "host_bf16_adamw"}, Case{.name = "nvme_bf16_adamw", .where = Where::kNvme},
        Case{.name = "mixed_bf16_adamw", .where = Where::kMixed},
        Case{.name = "host_fp32_adam",
             .param_dtype = DType::kF32,
             .optimizer = OptimizerType::kAdam},
        Case{.name = "nvme_fp16_adam_depth1",
             .where = Where::kNvme,
             .param_dtype = DType::kF16,
             .optimizer = OptimizerType::kAdam,
             .buffer_count = 1},
        Case{.name = "mixed_fp32_adamw_depth4_sg700",
             .where = Where::kMixed,
             .param_dtype = DType::kF32,
             .buffer_count = 4,
             .sub_group_elems = 700},
        Case{.name = "nvme_bf16grads_depth3_sg4096",
             .where = Where::kNvme,
             .grad_dtype = DType::kBF16,
             .buffer_count = 3,
             .sub_group_elems = 4096},
        Case{.name = "host_clipped", .max_grad_norm = 1.0},
        Case{.name = "nvme_clipped_fp16",
             .where = Where::kNvme,
             .param_dtype = DType::kF16,
             .max_grad_norm = 0.5},
        Case{.name = "host_adagrad", .optimizer = OptimizerType::kAdagrad},
        Case{.name = "mixed_lion", .where = Where::kMixed, .optimizer = OptimizerType::kLion}),
    [](const ::testing::TestParamInfo<Case>& info) { return info.param.name; });

}  // namespace
}  // namespace strata
