// OffloadOptimizer on the host device: bitwise equal to the all-in-memory
// reference whatever the placement, dtype, optimizer, sub-group size and
// pipeline depth; retry after an NVMe fault; validation.
#include "offload/optimizer.h"

#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <limits>
#include <mutex>
#include <numeric>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "offload/checkpoint.h"
#include "offload/placement.h"
#include "runtime/testing/fault_storage.h"
#include "runtime/testing/test_util.h"
#include "tests/offload/optimizer_test_util.h"
#include "tests/offload/test_seed.h"

namespace strata {
namespace {

using testing::ExpectSameAsReference;
using testing::ExpectStepLikeReference;
using testing::FlatStats;
using testing::ReferenceOptimizer;
using testing::TestModel;
using testing::TestSeed;

enum class Where { kHost, kNvme, kMixed };

// The installed oneTBB is not instrumented: under TSan the CPU optimizer runs
// on the calling thread only (threads = 1 never enters TBB).
#if defined(__SANITIZE_THREAD__)
constexpr int kCpuThreads = 1;
#else
constexpr int kCpuThreads = 2;
#endif

struct Case {
  std::string name{};
  Where where = Where::kHost;
  DType param_dtype = DType::kBF16;
  DType grad_dtype = DType::kF32;
  OptimizerType optimizer = OptimizerType::kAdamW;
  uint32_t buffer_count = 2;
  uint64_t sub_group_elems = 1024;
  double max_grad_norm = 0.0;
  PipelineMode mode = PipelineMode::kOverlapped;
  double gpu_fraction = 0.0;  // partial offload: the first sub-groups on the device
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
  config.threads = kCpuThreads;
  config.aio.block_bytes = 8192;
  config.gpu_fraction = c.gpu_fraction;
  if (c.param_dtype == DType::kF16) config.loss_scaler = {.mode = LossScaleMode::kDynamic};
  if (c.where != Where::kHost) {
    config.device = OffloadDevice::kNvme;
    config.nvme_paths = {"/mem/nvme0"};
  }
  return config;
}

// For kMixed: a host budget that holds the staging and about half the state.
void SetMixedBudget(OffloadConfig& config) {
  std::vector<TensorSpec> specs;
  for (uint64_t n : kSizes) specs.push_back({.elems = n, .dtype = config.param_dtype});
  const FlatLayout layout = *PlanFlatLayout(specs, {.align_elems = config.align_elems});
  auto sgs = *CutSubGroups(*ShardRange(layout, 0), config.sub_group_elems);
  std::vector<uint64_t> sizes;
  for (auto& r : sgs) sizes.push_back(r.elems());
  PlacementInputs in = PlacementInputsFor(config, sizes);
  in.host_budget_bytes = 0;  // staging only
  PlacementPlan staging_only = *PlanPlacement(in);
  config.host_budget_bytes = staging_only.host_staging_bytes + staging_only.nvme_state_bytes / 4;
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
  if (c.where == Where::kMixed) SetMixedBudget(config);
  auto master = model.SetParams(rng);
  auto opt_or = OffloadOptimizer::Create({.device = device.get(), .storage = storage.get()}, config,
                                         model.Groups(kHypers));
  ASSERT_TRUE(opt_or.ok()) << opt_or.status();
  auto opt = std::move(*opt_or);
  EXPECT_EQ(opt->pipeline_mode(), PipelineMode::kOverlapped);
  opt->SetPipelineMode(c.mode);
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
  EXPECT_EQ(plan.device_sub_groups > 0, c.gpu_fraction > 0);
  EXPECT_EQ(plan.device_sub_groups == plan.sub_groups.size(), c.gpu_fraction == 1.0);
  ReferenceOptimizer ref(config, master, kGroupOf, kHypers);
  const auto order = model.FlatOrder();
  for (int step = 0; step < 3; ++step) {
    auto grads = model.SetGrads(model.RandomGrads(rng, 0.5f));
    Status s = opt->Step();
    ASSERT_TRUE(s.ok()) << s;
    const GradStats st = FlatStats(*opt, order, grads);
    ref.Step(grads, st.sum_sq, st.nonfinite_elems);
    EXPECT_EQ(opt->step_count(), ref.step());
    EXPECT_FALSE(opt->last_step().skipped);
    ExpectSameAsReference(*opt, model, ref);
    EXPECT_EQ(opt->last_step().times.device_adam > 0, c.gpu_fraction > 0);
    ASSERT_TRUE(opt->ZeroGrad().ok());
    // The test writes the next grads from the host: wait for the zeroing.
    ASSERT_TRUE(device->Synchronize().ok());
    for (size_t t = 0; t < model.size(); ++t) {
      for (uint8_t b : model.GradBytes(t)) ASSERT_EQ(b, 0) << "ZeroGrad left tensor " << t;
    }
  }
  if (c.where != Where::kHost) {
    // Read, or still in a buffer (with as many buffers as extents, all are).
    EXPECT_GT(opt->last_step().read_bytes + opt->last_step().resident_bytes, 0u);
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
        Case{.name = "host_bf16grads_clipped", .grad_dtype = DType::kBF16, .max_grad_norm = 0.5},
        Case{.name = "mixed_fp16grads_fp16_clipped",
             .where = Where::kMixed,
             .param_dtype = DType::kF16,
             .grad_dtype = DType::kF16,
             .max_grad_norm = 0.5},
        Case{.name = "mixed_bf16grads_depth1_serial",
             .where = Where::kMixed,
             .grad_dtype = DType::kBF16,
             .buffer_count = 1,
             .mode = PipelineMode::kSerial},
        Case{.name = "nvme_clipped_fp16",
             .where = Where::kNvme,
             .param_dtype = DType::kF16,
             .max_grad_norm = 0.5},
        Case{.name = "host_adagrad", .optimizer = OptimizerType::kAdagrad},
        Case{.name = "mixed_lion", .where = Where::kMixed, .optimizer = OptimizerType::kLion},
        Case{.name = "mixed_bf16_adamw_serial",
             .where = Where::kMixed,
             .mode = PipelineMode::kSerial},
        Case{.name = "nvme_fp16_clipped_depth3_serial",
             .where = Where::kNvme,
             .param_dtype = DType::kF16,
             .buffer_count = 3,
             .max_grad_norm = 0.5,
             .mode = PipelineMode::kSerial},
        // Partial offload: the first sub-groups updated by the device Adam.
        Case{.name = "device_half_bf16_adamw", .gpu_fraction = 0.5},
        Case{.name = "device_all_fp32_adam",
             .param_dtype = DType::kF32,
             .optimizer = OptimizerType::kAdam,
             .gpu_fraction = 1.0},
        Case{.name = "device_mixed_fp16grads_fp16_clipped",
             .where = Where::kMixed,
             .param_dtype = DType::kF16,
             .grad_dtype = DType::kF16,
             .max_grad_norm = 0.5,
             .gpu_fraction = 0.3},
        Case{.name = "device_nvme_bf16grads_serial",
             .where = Where::kNvme,
             .grad_dtype = DType::kBF16,
             .buffer_count = 1,
             .mode = PipelineMode::kSerial,
             .gpu_fraction = 0.4},
        Case{.name = "device_bf16grads_clipped_sg300",
             .grad_dtype = DType::kBF16,
             .sub_group_elems = 300,
             .max_grad_norm = 0.5,
             .gpu_fraction = 0.7}),
    [](const ::testing::TestParamInfo<Case>& info) { return info.param.name; });

}  // namespace
}  // namespace strata

namespace strata {
namespace {

using testing::ExpectSameAsReference;
using testing::ExpectStepLikeReference;
using testing::FlatStats;
using testing::ReferenceOptimizer;
using testing::TestModel;
using testing::TestSeed;

Result<std::unique_ptr<OffloadOptimizer>> MakeOptimizer(Device& device, Storage* storage,
                                                        const OffloadConfig& config,
                                                        const TestModel& model,
                                                        Communicator* comm = nullptr,
                                                        StreamRef stream = {}) {
  return OffloadOptimizer::Create(
      {.device = &device, .comm = comm, .storage = storage, .stream = stream}, config,
      model.Groups(kHypers));
}

// One rank of kSizes on the host device (state in DRAM), and its reference.
struct OneRank {
  OneRank(const Case& c, uint64_t seed)
      : rng(seed),
        device(*CreateHostDevice()),
        config(MakeConfig(c)),
        model(*device, kSizes, kGroupOf, c.param_dtype, c.grad_dtype),
        master(model.SetParams(rng)),
        opt(*MakeOptimizer(*device, nullptr, config, model)),
        ref(config, master, kGroupOf, kHypers) {}
  // Sets random grads; returns them as the engine reads them.
  std::vector<std::vector<float>> Grads() { return model.SetGrads(model.RandomGrads(rng, 0.5f)); }
  // The reference's step on `grads` agrees bitwise with the optimizer's last.
  void ExpectStep(const std::vector<std::vector<float>>& grads) {
    ExpectStepLikeReference(*opt, model, ref, grads);
  }

  std::mt19937_64 rng;
  std::unique_ptr<Device> device;
  OffloadConfig config;
  TestModel model;
  std::vector<std::vector<float>> master;
  std::unique_ptr<OffloadOptimizer> opt;
  ReferenceOptimizer ref;
};

// Steps alternate the order of their NVMe sub-groups, so each starts with
// the extents the one before left in the buffers: buffer_count fewer extents
// read per step, the same results bit for bit.
// The optimizer's NVMe state is of no use once it is gone (nothing reopens
// it; checkpoints hold what is kept): destroying the optimizer removes
// strata-rank<r>.state, and only the lock file stays (it used to stay too).
TEST(EngineNvme, DestroyingTheOptimizerRemovesItsStateFile) {
  const uint64_t seed = TestSeed();
  std::mt19937_64 rng(seed);
  auto device = *CreateHostDevice();
  auto storage = CreatePosixStorage();
  testing::TempDir dir;
  OffloadConfig config = MakeConfig(Case{.where = Where::kNvme});
  config.nvme_paths = {dir.path()};
  TestModel model(*device, kSizes, kGroupOf, DType::kBF16, DType::kF32);
  model.SetParams(rng);
  {
    auto opt = MakeOptimizer(*device, storage.get(), config, model);
    ASSERT_TRUE(opt.ok()) << opt.status();
    ASSERT_GT((*opt)->plan().nvme_sub_groups, 0u);
    model.SetGrads(model.RandomGrads(rng, 0.5f));
    ASSERT_TRUE((*opt)->Step().ok());
    EXPECT_TRUE(std::filesystem::exists(dir.File("strata-rank0.state")));
  }
  EXPECT_EQ(testing::DirNames(dir.path()), std::vector<std::string>{"strata-rank0.lock"});
}

// Host memory locked by this process, in bytes (VmLck); -1 if unknown.
int64_t LockedBytes() {
  std::ifstream status("/proc/self/status");
  for (std::string line; std::getline(status, line);) {
    if (line.rfind("VmLck:", 0) == 0) return std::stoll(line.substr(6)) * 1024;
  }
  return -1;
}

// The plan is what the engine pins: every pinned buffer it lists (staging,
// the statistics' mirror and control block, NVMe buffers) and the DRAM
// sub-groups' state, each in whole pages, and nothing else. A budget equal
// to the plan holds (bench step --host-budget auto sets one).
TEST(EnginePlan, TheEnginePinsWhatThePlanSaysInWholePages) {
  auto device = *CreateHostDevice();
  auto storage = CreateMemStorage();
  TestModel model(*device, kSizes, kGroupOf, DType::kBF16, DType::kF32);
  auto pages = [](uint64_t b) { return (b + 4095) / 4096 * 4096; };
  for (const Case& c : {Case{.where = Where::kHost}, Case{.where = Where::kMixed},
                        Case{.where = Where::kNvme, .buffer_count = 3},
                        Case{.where = Where::kMixed, .gpu_fraction = 0.4}}) {
    SCOPED_TRACE(static_cast<int>(c.where));
    OffloadConfig config = MakeConfig(c);
    if (c.where == Where::kMixed) SetMixedBudget(config);
    const int64_t before = LockedBytes();
    auto opt = MakeOptimizer(*device, storage.get(), config, model);
    ASSERT_TRUE(opt.ok()) << opt.status();
    const int64_t after = LockedBytes();
    if (before < 0 || after == before) {
      GTEST_SKIP() << "this process cannot lock memory (VmLck unknown or unchanged: `ulimit -l`), "
                      "so what the engine pins cannot be measured";
    }
    const PlacementPlan& plan = (*opt)->plan();
    uint64_t want = 0;
    for (const StagingBuffer& b : plan.buffers) {
      if (b.tier == Tier::kHost) want += b.count * pages(b.bytes_each);
    }
    for (const SubGroupPlacement& g : plan.sub_groups) {
      if (g.tier == Tier::kHost) want += pages(g.state_bytes);
    }
    EXPECT_EQ(static_cast<uint64_t>(after - before), want) << FormatPlan(plan);
    // The plan's own figure differs from that only by the page rounding.
    EXPECT_LE(plan.host_total_bytes(), want);
    EXPECT_GT(plan.host_total_bytes() + 4096 * (plan.buffers.size() + plan.sub_groups.size()),
              want);
  }
}

// gpu_fraction "auto" measures the Adam rates on a shard-sized probe (8 Mi
// elements at most, 1 Mi at least) and, on the device, in a quarter of
// device_budget at most (1 Mi elements at least): a small model fits on a
// device with little memory (the probe took 144 MiB of it here whatever the
// model and the budget; now 18 MiB).
TEST(EnginePlan, TheAutoFractionProbeFitsTheShardAndTheDeviceBudget) {
  auto device = *CreateHostDevice({.memory_budget_bytes = 32 << 20});
  auto storage = CreateMemStorage();
  TestModel model(*device, kSizes, kGroupOf, DType::kBF16, DType::kF32);
  OffloadConfig config = MakeConfig(Case{.gpu_fraction = 0.0});
  config.gpu_fraction = kGpuFractionAuto;
  for (uint64_t budget : {uint64_t{64} << 20, uint64_t{8} << 20, uint64_t{64} << 10}) {
    SCOPED_TRACE(budget);
    config.device_budget_bytes = budget;
    auto opt = MakeOptimizer(*device, storage.get(), config, model);
    ASSERT_TRUE(opt.ok()) << opt.status();
    EXPECT_GT((*opt)->plan().rates.cpu_adam_elems_per_sec, 0);
    EXPECT_GT((*opt)->plan().rates.device_adam_elems_per_sec, 0);
  }
}

// A forked child (a DataLoader worker) is refused every call that would
// wait on the parent's threads; one that destroys the optimizer and the
// device it inherited returns at once (the destructors joined threads the
// child does not have, and blocked for ever), and leaves the parent's state
// file and lock alone: the parent steps on, bitwise, and a new optimizer can
// take the directory once the parent's is gone, while the child lives.
TEST(EngineNvme, AForkedChildThatDropsTheOptimizerNeitherHangsNorTouchesTheParents) {
#if defined(__SANITIZE_THREAD__)
  GTEST_SKIP() << "fork in a threaded process under TSan";
#else
  const uint64_t seed = TestSeed();
  std::mt19937_64 rng(seed);
  auto device = *CreateHostDevice();
  auto storage = CreatePosixStorage();
  testing::TempDir dir;
  OffloadConfig config = MakeConfig(Case{.where = Where::kNvme});
  config.nvme_paths = {dir.path()};
  TestModel model(*device, kSizes, kGroupOf, DType::kBF16, DType::kF32);
  auto master = model.SetParams(rng);
  auto opt = MakeOptimizer(*device, storage.get(), config, model);
  ASSERT_TRUE(opt.ok()) << opt.status();
  ReferenceOptimizer ref(config, master, kGroupOf, kHypers);
  const auto order = model.FlatOrder();
  auto step = [&] {
    auto grads = model.SetGrads(model.RandomGrads(rng, 0.5f));
    ASSERT_TRUE((*opt)->Step().ok());
    const GradStats st = FlatStats(**opt, order, grads);
    ref.Step(grads, st.sum_sq, st.nonfinite_elems);
    ExpectSameAsReference(**opt, model, ref);
    ASSERT_TRUE((*opt)->ZeroGrad().ok());
    ASSERT_TRUE(device->Synchronize().ok());
  };
  step();
  int go[2], done[2];
  ASSERT_EQ(::pipe(go), 0);
  ASSERT_EQ(::pipe(done), 0);
  const pid_t child = ::fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    ::alarm(20);  // a hang ends the child with SIGALRM, which the parent sees
    // A call that would wait on the parent's threads is refused at once (a
    // step in the child used to hang).
    OffloadOptimizer& o = **opt;
    // Save and load too, before their collective or the save lock.
    const std::string ckpt = dir.File("ckpt");
    for (Status s :
         {o.Step(), o.ReduceGradients(), o.ZeroGrad(),
          o.ReadStateInOrder([](uint32_t, uint32_t, std::span<const float>) { return OkStatus(); }),
          SaveCheckpoint(o, ckpt), LoadCheckpoint(o, ckpt)}) {
      if (s.code() != StatusCode::kFailedPrecondition ||
          s.message().find("this is a child it forked") == std::string_view::npos) {
        ::_exit(2);
      }
    }
    if (std::filesystem::exists(ckpt)) ::_exit(3);
    opt->reset();
    device.reset();
    char c;
    if (::write(done[1], "x", 1) != 1 || ::read(go[0], &c, 1) != 1) ::_exit(1);
    ::_exit(0);
  }
  ::close(done[1]);  // a child that dies ends the read below
  ::close(go[0]);
  char c;
  ASSERT_EQ(::read(done[0], &c, 1), 1) << "the child hung or failed dropping them";
  EXPECT_TRUE(std::filesystem::exists(dir.File("strata-rank0.state")));
  step();
  step();
  opt->reset();  // the parent's own: removes its state, releases the lock
  EXPECT_FALSE(std::filesystem::exists(dir.File("strata-rank0.state")));
  auto next = MakeOptimizer(*device, storage.get(), config, model);
  EXPECT_TRUE(next.ok()) << next.status();
  ASSERT_EQ(::write(go[1], "x", 1), 1);
  int status = 0;
  ::waitpid(child, &status, 0);
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << "child status " << status;
  ::close(go[1]);
  ::close(done[0]);
#endif
}

TEST(EngineNvme, ExtentsStillInTheirBuffersAreNotReadAgain) {
  const uint64_t seed = TestSeed();
  std::mt19937_64 rng(seed);
  auto device = *CreateHostDevice();
  auto storage = CreateMemStorage();
  TestModel model(*device, kSizes, kGroupOf, DType::kBF16, DType::kBF16);
  Case c{.where = Where::kNvme, .grad_dtype = DType::kBF16, .buffer_count = 3,
         .sub_group_elems = 1024, .max_grad_norm = 0.5};
  OffloadConfig config = MakeConfig(c);
  auto master = model.SetParams(rng);
  auto opt = *OffloadOptimizer::Create({.device = device.get(), .storage = storage.get()}, config,
                                       model.Groups(kHypers));
  const uint32_t nvme = opt->plan().nvme_sub_groups;
  ASSERT_EQ(nvme, opt->sub_groups().size());
  ASSERT_GT(nvme, 2 * c.buffer_count);
  ReferenceOptimizer ref(config, master, kGroupOf, kHypers);
  const auto order = model.FlatOrder();
  for (PipelineMode mode : {PipelineMode::kOverlapped, PipelineMode::kSerial}) {
    opt->SetPipelineMode(mode);
    for (int step = 0; step < 3; ++step) {
      SCOPED_TRACE(::testing::Message() << "mode " << static_cast<int>(mode) << " step " << step);
      auto grads = model.SetGrads(model.RandomGrads(rng, 0.5f));
      ASSERT_TRUE(opt->Step().ok());
      const GradStats st = FlatStats(*opt, order, grads);
      ref.Step(grads, st.sum_sq, st.nonfinite_elems);
      // Every extent is written; all but buffer_count are read.
      const StepStats& s = opt->last_step();
      const uint64_t extent = s.write_bytes / nvme;
      EXPECT_EQ(s.write_bytes, nvme * extent);
      EXPECT_EQ(s.resident_bytes, c.buffer_count * extent);
      EXPECT_EQ(s.read_bytes, (nvme - c.buffer_count) * extent);
      ASSERT_TRUE(device->Synchronize().ok());
    }
  }
  // Bitwise the reference's (ReadState too reads what is still in a buffer).
  ExpectSameAsReference(*opt, model, ref);
  // And after ReadState the next step still finds what it left there.
  auto grads = model.SetGrads(model.RandomGrads(rng, 0.5f));
  ASSERT_TRUE(opt->Step().ok());
  const GradStats st = FlatStats(*opt, order, grads);
  ref.Step(grads, st.sum_sq, st.nonfinite_elems);
  ExpectSameAsReference(*opt, model, ref);
}

// Polls `done` for up to 10 s; whether it became true.
bool WaitUntil(const std::function<bool()>& done) {
  const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  while (!done()) {
    if (std::chrono::steady_clock::now() > until) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  return true;
}

// An optimizer with all its state on NVMe (9 sub-groups, 2 extent buffers)
// over a FaultStorage, and the reference it is checked against.
struct NvmeRig {
  explicit NvmeRig(const testing::FaultOptions& faults = {})
      : seed(TestSeed()),
        rng(seed),
        device(*CreateHostDevice()),
        fault(testing::FaultStorage::Create(CreateMemStorage(), WithSeed(faults, seed))),
        model(*device, kSizes, kGroupOf, DType::kBF16, DType::kBF16),
        config(MakeConfig(
            {.where = Where::kNvme, .grad_dtype = DType::kBF16, .sub_group_elems = 1024})),
        ref(config, model.SetParams(rng), kGroupOf, kHypers),
        opt(*OffloadOptimizer::Create({.device = device.get(), .storage = fault.get()}, config,
                                      model.Groups(kHypers))),
        n(opt->plan().nvme_sub_groups),
        k(opt->plan().nvme_buffers) {
    EXPECT_EQ(n, opt->sub_groups().size());
    EXPECT_GE(k, 2u);
    EXPECT_GT(n, 2 * k);
  }
  static testing::FaultOptions WithSeed(testing::FaultOptions o, uint64_t seed) {
    o.seed = seed;
    return o;
  }
  // One step of the optimizer and of the reference.
  void Step() {
    auto grads = model.SetGrads(model.RandomGrads(rng, 0.5f));
    ASSERT_TRUE(opt->Step().ok());
    const GradStats st = FlatStats(*opt, model.FlatOrder(), grads);
    ref.Step(grads, st.sum_sq, st.nonfinite_elems);
  }
  std::vector<float> State(uint32_t i) {
    std::vector<float> s(opt->sub_groups()[i].elems() * opt->StateArrayCount());
    EXPECT_TRUE(opt->ReadState(i, s).ok());
    return s;
  }
  uint64_t read_bytes() const { return fault->stats().read_bytes.load(); }

  uint64_t seed;
  std::mt19937_64 rng;
  std::unique_ptr<Device> device;
  std::unique_ptr<testing::FaultStorage> fault;
  TestModel model;
  OffloadConfig config;
  ReferenceOptimizer ref;
  std::unique_ptr<OffloadOptimizer> opt;
  uint32_t n, k;  // NVMe sub-groups (all of them), extent buffers
};

// Checkpoints walk the state in index order. ReadStateInOrder reads the next
// NVMe extents (one per buffer) while the caller handles one, reads each
// once, and leaves no read in flight, also when the caller fails part way.
TEST(EngineNvme, InOrderReadsRunAheadOfTheVisitAndLeaveNoneInFlight) {
  NvmeRig rig;
  OffloadOptimizer& opt = *rig.opt;
  const uint32_t n = rig.n, k = rig.k;
  rig.Step();
  const uint64_t extent = opt.last_step().write_bytes / n;
  // The last k extents in their buffers: the walk must read every extent.
  for (uint32_t i = n - k; i < n; ++i) rig.State(i);
  const uint64_t before = rig.read_bytes();
  auto read = [&] { return rig.read_bytes() - before; };
  std::vector<std::vector<float>> seen(n);
  for (uint32_t i = 0; i < n; ++i) {
    seen[i].resize(opt.sub_groups()[i].elems() * opt.StateArrayCount());
  }
  bool late = false;  // one wait timed out: the others are not waited for
  Status s = opt.ReadStateInOrder([&](uint32_t i, uint32_t a, std::span<const float> state) {
    const uint64_t elems = opt.sub_groups()[i].elems();
    EXPECT_EQ(state.size(), elems) << "sub-group " << i << " array " << a;
    std::copy(state.begin(), state.end(), seen[i].begin() + a * elems);
    const uint64_t queued = std::min(i + k, n) * extent;
    if (a == 0 && !late && !WaitUntil([&] { return read() >= queued; })) {
      late = true;
      ADD_FAILURE() << "while sub-group " << i << " is handled, extents up to "
                    << std::min(i + k, n) - 1 << " are read: " << read() / extent
                    << " extents read";
    }
    return OkStatus();
  });
  ASSERT_TRUE(s.ok()) << s;
  EXPECT_EQ(read(), n * extent) << "each extent read once";
  for (uint32_t i = 0; i < n; ++i) EXPECT_EQ(rig.State(i), seen[i]) << "sub-group " << i;

  // A visit that fails: its error as is; the reads queued ahead are waited
  // for, and the buffers they filled are not taken for committed state.
  s = opt.ReadStateInOrder([&](uint32_t i, uint32_t a, std::span<const float>) -> Status {
    if (i == 1 && a == 2) return DataLossError("the checkpoint drive failed");
    if (i == 1 && a == 1) return UnavailableError("the checkpoint drive is gone");
    return OkStatus();
  });
  EXPECT_EQ(s.code(), StatusCode::kUnavailable) << "the lowest array's error: " << s;
  EXPECT_EQ(s.message(), "the checkpoint drive is gone");
  ExpectSameAsReference(opt, rig.model, rig.ref);
  rig.Step();
  ExpectSameAsReference(opt, rig.model, rig.ref);
}

// Checkpoints copy and hash each array's file on a thread of its own: the
// calls for one sub-group's arrays run at once on the optimizer's threads
// (2 here), and the next sub-group's start after all of them returned.
TEST(EngineNvme, InOrderCallsForOneSubGroupsArraysRunConcurrently) {
  if (kCpuThreads < 2) GTEST_SKIP() << "the CPU optimizer runs on one thread under TSan";
  if (std::thread::hardware_concurrency() < 2) GTEST_SKIP() << "one hardware thread";
  NvmeRig rig;
  OffloadOptimizer& opt = *rig.opt;
  const uint32_t n = rig.n, arrays = opt.StateArrayCount();
  rig.Step();
  std::mutex mu;
  std::condition_variable cv;
  std::vector<uint32_t> entered(n), returned(n);
  int alone = 0, early = 0;
  // Each call waits until a second call of its sub-group is inside too.
  auto meet = [&](uint32_t i) {
    std::unique_lock<std::mutex> lock(mu);
    for (uint32_t j = 0; j < i; ++j) early += returned[j] != arrays;
    ++entered[i];
    cv.notify_all();
    if (alone == 0 &&
        !cv.wait_for(lock, std::chrono::seconds(10), [&] { return entered[i] >= 2; })) {
      ++alone;
    }
    ++returned[i];
  };
  auto expect_met = [&](const char* what) {
    EXPECT_EQ(alone, 0) << what << ": a call waited 10 s for another of its sub-group";
    EXPECT_EQ(early, 0) << what << ": a call began before the sub-group before it returned";
    for (uint32_t i = 0; i < n; ++i) EXPECT_EQ(returned[i], arrays) << what << " " << i;
    std::fill(entered.begin(), entered.end(), 0);
    std::fill(returned.begin(), returned.end(), 0);
    alone = early = 0;
  };
  std::vector<std::vector<float>> state(n);
  Status s = opt.ReadStateInOrder([&](uint32_t i, uint32_t a, std::span<const float> view) {
    meet(i);
    std::lock_guard<std::mutex> lock(mu);
    state[i].resize(view.size() * arrays);
    std::copy(view.begin(), view.end(), state[i].begin() + a * view.size());
    return OkStatus();
  });
  ASSERT_TRUE(s.ok()) << s;
  expect_met("read");
  for (uint32_t i = 0; i < n; ++i) EXPECT_EQ(rig.State(i), state[i]) << "sub-group " << i;

  // Written back as read: the state and the next step are unchanged.
  s = opt.WriteStateInOrder([&](uint32_t i, uint32_t a, uint64_t begin, std::span<float> piece) {
    meet(i);
    const uint64_t elems = opt.sub_groups()[i].elems();
    std::copy_n(state[i].begin() + a * elems + begin, piece.size(), piece.begin());
    return OkStatus();
  });
  ASSERT_TRUE(s.ok()) << s;
  expect_met("write");
  ExpectSameAsReference(opt, rig.model, rig.ref);
  rig.Step();
  ExpectSameAsReference(opt, rig.model, rig.ref);
}

// UploadParams walks the masters opposite to the next step's NVMe order
// (steps alternate it), and what it read last stays in the buffers: the next
// step, odd (its NVMe sub-groups in reverse) or even (in index order), reads
// those extents no more.
TEST(EngineNvme, UploadParamsLeavesTheExtentsItReadLastForTheNextStep) {
  for (int steps_before : {2, 1, 3}) {
    SCOPED_TRACE(std::to_string(steps_before) + " steps before the upload");
    NvmeRig rig;
    OffloadOptimizer& opt = *rig.opt;
    for (int s = 0; s < steps_before; ++s) rig.Step();
    const uint64_t extent = opt.last_step().write_bytes / rig.n;
    const uint64_t before = rig.read_bytes();
    ASSERT_TRUE(opt.UploadParams().ok());
    // The step before ended at the other end: none of its extents is where
    // the walk begins, and the walk displaces them all.
    EXPECT_EQ(rig.read_bytes() - before, rig.n * extent) << "each extent read once";
    rig.Step();
    EXPECT_EQ(opt.last_step().resident_bytes, rig.k * extent);
    EXPECT_EQ(opt.last_step().read_bytes, (rig.n - rig.k) * extent);
    ExpectSameAsReference(opt, rig.model, rig.ref);
  }
}

// WriteStateInOrder writes each NVMe sub-group while the next one is filled
// (its write is held here until that fill begins: a write waited for in
// place would time out), returns once all are written, and after a failed
// fill keeps what it wrote before it and the committed state after it.
TEST(EngineNvme, InOrderWritesRunBehindTheNextFill) {
  std::mutex mu;
  std::condition_variable cv;
  bool hold = false;
  int timeouts = 0;
  auto gate = [&](IoOp op, const std::string&, std::span<const std::byte>) {
    if (op != IoOp::kWrite) return;
    std::unique_lock<std::mutex> lock(mu);
    if (!cv.wait_for(lock, std::chrono::seconds(10), [&] { return !hold; })) ++timeouts;
  };
  NvmeRig rig({.before_io = gate});
  OffloadOptimizer* opt = rig.opt.get();
  const uint32_t n = rig.n;
  const uint32_t arrays = opt->StateArrayCount();
  auto value = [](uint32_t i, uint32_t a, uint64_t e, int round) {
    return static_cast<float>(round * 100000 + i * 1000 + a * 100) + 1e-3f * static_cast<float>(e);
  };
  auto fill_round = [&](int round) {
    return [&, round](uint32_t i, uint32_t a, uint64_t begin, std::span<float> piece) -> Status {
      if (i == 1 && a == 0) {
        std::lock_guard<std::mutex> lock(mu);
        hold = false;
        cv.notify_all();
      }
      if (round == 2 && i == n - 1) return InvalidArgumentError("the saved file ended early");
      for (uint64_t e = 0; e < piece.size(); ++e) piece[e] = value(i, a, begin + e, round);
      return OkStatus();
    };
  };
  auto expect_round = [&](uint32_t i, int round) {
    const uint64_t elems = opt->sub_groups()[i].elems();
    const std::vector<float> s = rig.State(i);
    for (uint32_t a = 0; a < arrays; ++a) {
      for (uint64_t e = 0; e < elems; ++e) {
        ASSERT_EQ(s[a * elems + e], value(i, a, e, round))
            << "sub-group " << i << " array " << a << " elem " << e << " round " << round;
      }
    }
  };
  hold = true;
  Status s = opt->WriteStateInOrder(fill_round(1));
  ASSERT_TRUE(s.ok()) << s;
  EXPECT_EQ(timeouts, 0) << "sub-group 0's write waited for in place, before sub-group 1's fill";
  for (uint32_t i = 0; i < n; ++i) expect_round(i, 1);

  s = opt->WriteStateInOrder(fill_round(2));
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("the saved file ended early"), std::string::npos) << s;
  for (uint32_t i = 0; i + 1 < n; ++i) expect_round(i, 2);
  expect_round(n - 1, 1);
}

// Rank r of N gets its own grads; the reference sees their average, summed
// in rank order in fp32 as the local communicator does. With `shuffled_ready`
// each rank reports its tensors ready (GradReady) in its own random order
// before every hand-over, as ranks whose backwards complete tensors in
// different orders do.
void RunRanks(int world, double max_grad_norm, DType grad_dtype = DType::kF32,
              double gpu_fraction = 0.0, int micro_steps = 1, bool shuffled_ready = false,
              bool odd_ranks_serial = false) {
  const uint64_t seed = TestSeed();
  auto device = *CreateHostDevice();
  auto comms = *CreateLocalGroup(world, *device);
  Case c{.where = Where::kMixed,
         .grad_dtype = grad_dtype,
         .buffer_count = 2,
         .sub_group_elems = 512,
         .max_grad_norm = max_grad_norm,
         .gpu_fraction = gpu_fraction};
  OffloadConfig config = MakeConfig(c);
  config.host_budget_bytes = 64 * 1024;  // a few sub-groups of each rank stay in DRAM
  config.nvme_paths = {"/mem/nvme"};
  if (gpu_fraction == kGpuFractionAuto) config.device_budget_bytes = 16 << 20;  // all fit
  constexpr int kSteps = 3;
  // Every rank's grads of every step, drawn up front from one generator.
  std::mt19937_64 rng(seed);
  std::vector<std::unique_ptr<TestModel>> models;
  std::vector<std::vector<std::vector<float>>> master(world);
  for (int r = 0; r < world; ++r) {
    models.push_back(
        std::make_unique<TestModel>(*device, kSizes, kGroupOf, c.param_dtype, c.grad_dtype));
    std::mt19937_64 same(seed ^ 0x5eed);  // identical initial params on every rank
    master[r] = models[r]->SetParams(same);
  }
  // grads[s][m][r]: step s, micro-step m, rank r.
  std::vector<std::vector<std::vector<std::vector<std::vector<float>>>>> grads(kSteps);
  for (int s = 0; s < kSteps; ++s) {
    grads[s].resize(micro_steps);
    for (int m = 0; m < micro_steps; ++m) {
      for (int r = 0; r < world; ++r) {
        // The values the trainer's dtype holds: what every rank reduces.
        grads[s][m].push_back(models[r]->SetGrads(models[r]->RandomGrads(rng, 0.5f)));
      }
    }
  }
  std::vector<std::unique_ptr<Storage>> storages;
  for (int r = 0; r < world; ++r) storages.push_back(CreateMemStorage());
  // Each rank its own trainer stream: Device::Synchronize would also wait for
  // the other ranks' collectives.
  std::vector<Stream> streams;
  for (int r = 0; r < world; ++r) streams.push_back(*device->CreateStream());
  std::vector<std::unique_ptr<OffloadOptimizer>> opts(world);
  std::vector<Status> status(world);
  std::vector<std::thread> threads;
  for (int r = 0; r < world; ++r) {
    threads.emplace_back([&, r] {
      status[r] = [&]() -> Status {
        StreamRef stream = streams[r];
        STRATA_ASSIGN_OR_RETURN(opts[r], MakeOptimizer(*device, storages[r].get(), config,
                                                       *models[r], comms[r].get(), stream));
        if (gpu_fraction > 0 && opts[r]->plan().device_sub_groups == 0) {
          return InternalError("the plan keeps no sub-group on the device");
        }
        if (odd_ranks_serial && r % 2 == 1) opts[r]->SetPipelineMode(PipelineMode::kSerial);
        for (int s = 0; s < kSteps; ++s) {
          for (int m = 0; m < micro_steps; ++m) {
            models[r]->SetGrads(grads[s][m][r]);
            if (shuffled_ready) {
              std::vector<uint32_t> order(kSizes.size());
              std::iota(order.begin(), order.end(), 0u);
              std::mt19937_64 mine(seed + 1000 * r + 10 * s + m);
              std::shuffle(order.begin(), order.end(), mine);
              for (uint32_t t : order) STRATA_RETURN_IF_ERROR(opts[r]->GradReady(t));
            }
            if (micro_steps > 1) {
              STRATA_RETURN_IF_ERROR(opts[r]->ReduceGradients());
              STRATA_RETURN_IF_ERROR(device->StreamSynchronize(stream));
            }
          }
          STRATA_RETURN_IF_ERROR(opts[r]->Step());
          STRATA_RETURN_IF_ERROR(device->StreamSynchronize(stream));
        }
        return OkStatus();
      }();
    });
  }
  for (auto& t : threads) t.join();
  for (int r = 0; r < world; ++r) ASSERT_TRUE(status[r].ok()) << "rank " << r << ": " << status[r];
  if (gpu_fraction == kGpuFractionAuto) {
    // The Adam rates were measured on every rank, and every rank planned with
    // the slowest's: the same sub-groups on the device everywhere.
    const PlacementPlan& p0 = opts[0]->plan();
    EXPECT_GT(p0.rates.cpu_adam_elems_per_sec, 0);
    EXPECT_GT(p0.rates.device_adam_elems_per_sec, 0);
    for (int r = 1; r < world; ++r) {
      EXPECT_EQ(opts[r]->plan().rates.cpu_adam_elems_per_sec, p0.rates.cpu_adam_elems_per_sec);
      EXPECT_EQ(opts[r]->plan().rates.device_adam_elems_per_sec,
                p0.rates.device_adam_elems_per_sec);
      EXPECT_EQ(opts[r]->plan().device_sub_groups, p0.device_sub_groups) << "rank " << r;
    }
  }

  ReferenceOptimizer ref(config, master[0], kGroupOf, kHypers);
  const float inv = 1.0f / static_cast<float>(world);
  for (int s = 0; s < kSteps; ++s) {
    // Per micro-step the rank-ordered average; micro-steps summed in fp32.
    std::vector<std::vector<float>> avg(kSizes.size());
    for (size_t t = 0; t < kSizes.size(); ++t) {
      avg[t].assign(kSizes[t], 0.0f);
      for (uint64_t k = 0; k < kSizes[t]; ++k) {
        for (int m = 0; m < micro_steps; ++m) {
          float acc = grads[s][m][0][t][k] * inv;
          for (int r = 1; r < world; ++r) acc += grads[s][m][r][t][k] * inv;
          avg[t][k] = m == 0 ? acc : avg[t][k] + acc;
        }
      }
    }
    // The statistics of each rank's shard, then over ranks in rank order
    // (the all-reduce), exactly as the engine defines them.
    GradStats st;
    for (int r = 0; r < world; ++r) {
      const GradStats part = testing::ShardStats(opts[r]->layout(), opts[r]->sub_groups(),
                                                 models[0]->FlatOrder(), avg);
      st.sum_sq += part.sum_sq;
      st.nonfinite_elems += part.nonfinite_elems;
    }
    ref.Step(avg, st.sum_sq, st.nonfinite_elems);
  }
  for (int r = 0; r < world; ++r) {
    SCOPED_TRACE("rank " + std::to_string(r));
    EXPECT_EQ(opts[r]->step_count(), kSteps);
    if (max_grad_norm > 0) {
      EXPECT_LT(opts[r]->last_step().clip_coef, 1.0f);
    }
    // Bitwise the reference's with the rank-ordered average, clipped or not:
    // the statistics follow one defined order on every path.
    ExpectSameAsReference(*opts[r], *models[r], ref);
  }
  // Every rank holds the full params after the all-gather.
  for (int r = 1; r < world; ++r) {
    for (size_t t = 0; t < kSizes.size(); ++t) {
      EXPECT_EQ(models[r]->ParamBytes(t), models[0]->ParamBytes(t))
          << "rank " << r << " tensor " << t;
    }
  }
}

TEST(EngineRanks, OneRankMatchesTheReference) { RunRanks(1, 0.0); }
TEST(EngineRanks, TwoRanksMatchTheRankOrderedAverage) { RunRanks(2, 0.0); }
TEST(EngineRanks, FourRanksMatchTheRankOrderedAverage) { RunRanks(4, 0.0); }
TEST(EngineRanks, TwoRanksClippedMatchBitwise) { RunRanks(2, 0.05); }
TEST(EngineRanks, FourRanksClippedMatchBitwise) { RunRanks(4, 0.05); }
TEST(EngineRanks, TwoRanksBf16GradsClippedMatchBitwise) { RunRanks(2, 0.05, DType::kBF16); }
TEST(EngineRanks, FourRanksBf16GradsMatchBitwise) { RunRanks(4, 0.0, DType::kBF16); }
TEST(EngineRanks, TwoRanksAccumulatedMatchBitwise) { RunRanks(2, 0.05, DType::kF32, 0.0, 3); }
// The pipeline mode is each rank's own (a benchmark's, a retry's): the
// serial mode all-gathered the device sub-groups' params before the CPU
// ones', the overlapped mode after, so ranks in different modes exchanged
// one sub-group's params for another's.
TEST(EngineRanks, RanksInDifferentPipelineModesMatchBitwise) {
  RunRanks(2, 0.05, DType::kBF16, 0.5, 1, false, true);
  RunRanks(4, 0.0, DType::kF32, 0.5, 1, false, true);
}
// Partial offload with several ranks: the reduced block stays on the device,
// the device Adam updates it, the publish stream all-gathers it first.
TEST(EngineRanks, OneRankHalfOnTheDeviceMatchesTheReference) {
  RunRanks(1, 0.05, DType::kBF16, 0.5);
}
TEST(EngineRanks, TwoRanksHalfOnTheDeviceClippedMatchBitwise) {
  RunRanks(2, 0.05, DType::kF32, 0.5);
}
TEST(EngineRanks, FourRanksBf16GradsMostlyOnTheDeviceMatchBitwise) {
  RunRanks(4, 0.0, DType::kBF16, 0.8);
}
TEST(EngineRanks, TwoRanksAccumulatedOnTheDeviceMatchBitwise) {
  RunRanks(2, 0.05, DType::kBF16, 0.5, 3);
}
// "auto" with no strata.rates: each rank measures its Adam rates, all plan
// with the slowest's.
TEST(EngineRanks, TwoRanksAutoFractionAgreeAndMatchBitwise) {
  RunRanks(2, 0.05, DType::kBF16, kGpuFractionAuto);
}
// The reduce-scatters are collectives matched by issue order: ranks whose
// tensors complete in different orders still issue them in one order (they
// paired different sub-groups: same-sized ones silently summed wrong ones).
TEST(EngineRanks, RanksReportingGradientsInDifferentOrdersMatchBitwise) {
  RunRanks(2, 0.05, DType::kBF16, 0.0, 1, true);
  RunRanks(4, 0.0, DType::kF32, 0.5, 2, true);
}

TEST(EngineRanks, OneRankAccumulatedOnTheDeviceMatchesTheReference) {
  RunRanks(1, 0.05, DType::kBF16, 0.5, 2);
}

// An inf in any one sub-group's gradient is caught by the device statistics
// before anything is applied: the fp16 step is skipped on every placement,
// and no param, master weight or moment changes.
void RunInfSkips(double gpu_fraction) {
  const uint64_t seed = TestSeed();
  std::mt19937_64 rng(seed);
  auto device = *CreateHostDevice();
  auto storage = CreateMemStorage();
  Case c{.where = Where::kMixed, .param_dtype = DType::kF16, .grad_dtype = DType::kF16,
         .max_grad_norm = 1.0, .gpu_fraction = gpu_fraction};
  OffloadConfig config = MakeConfig(c);
  SetMixedBudget(config);
  config.loss_scaler = {.mode = LossScaleMode::kDynamic, .initial_scale_power = 24,
                        .hysteresis = 1};
  TestModel model(*device, kSizes, kGroupOf, c.param_dtype, c.grad_dtype);
  model.SetParams(rng);
  auto opt = *MakeOptimizer(*device, storage.get(), config, model);
  ASSERT_GT(opt->plan().nvme_sub_groups, 0u);
  ASSERT_GT(opt->plan().host_sub_groups, 0u);
  ASSERT_EQ(opt->plan().device_sub_groups > 0, gpu_fraction > 0);
  // One clean step, so the moments are not zero.
  model.SetGrads(model.RandomGrads(rng, 0.5f));
  ASSERT_TRUE(opt->Step().ok());
  ASSERT_TRUE(device->Synchronize().ok());
  const uint32_t arrays = opt->StateArrayCount();
  auto snapshot = [&] {
    std::vector<std::vector<float>> s;
    for (uint32_t i = 0; i < opt->sub_groups().size(); ++i) {
      s.emplace_back(opt->sub_groups()[i].elems() * arrays);
      EXPECT_TRUE(opt->ReadState(i, s.back()).ok());
    }
    return s;
  };
  const auto order = model.FlatOrder();
  for (uint32_t i = 0; i < opt->sub_groups().size(); ++i) {
    SCOPED_TRACE("inf in sub-group " + std::to_string(i));
    const std::vector<TensorPiece> pieces = *PiecesInRange(opt->layout(), opt->sub_groups()[i]);
    const TensorPiece* piece = nullptr;
    for (const TensorPiece& p : pieces) {
      if (p.elems > 0) piece = &p;
    }
    if (piece == nullptr) continue;  // all padding
    auto grads = model.RandomGrads(rng, 0.5f);
    grads[order[piece->tensor]][piece->tensor_offset_elems + piece->elems / 2] =
        std::numeric_limits<float>::infinity();
    model.SetGrads(grads);
    const auto state_before = snapshot();
    std::vector<std::vector<uint8_t>> params_before;
    for (size_t t = 0; t < model.size(); ++t) params_before.push_back(model.ParamBytes(t));
    const double scale = opt->loss_scale();
    Status s = opt->Step();
    ASSERT_TRUE(s.ok()) << s;
    ASSERT_TRUE(device->Synchronize().ok());
    EXPECT_TRUE(opt->last_step().skipped);
    EXPECT_EQ(opt->step_count(), 1);
    EXPECT_EQ(opt->loss_scale(), scale / 2);
    EXPECT_EQ(opt->last_step().write_bytes, 0u) << "a skipped step writes no state";
    EXPECT_EQ(opt->last_step().d2h_bytes, 0u) << "a skipped step copies no gradient down";
    for (size_t t = 0; t < model.size(); ++t) EXPECT_EQ(model.ParamBytes(t), params_before[t]);
    const auto state_after = snapshot();
    for (uint32_t k = 0; k < state_after.size(); ++k) {
      ASSERT_EQ(std::memcmp(state_after[k].data(), state_before[k].data(),
                            state_after[k].size() * 4),
                0)
          << "state of sub-group " << k << " changed";
    }
  }
}

TEST(EngineLossScaler, AnInfInAnySubGroupSkipsTheStepAndChangesNothing) { RunInfSkips(0.0); }
TEST(EngineLossScaler, AnInfInAnyTierWithDeviceSubGroupsSkipsTheStep) { RunInfSkips(0.3); }

// Without a loss scaler (bf16/fp32) a step with NaN/inf gradients is skipped
// and changes nothing; it used to be silent, so a run could skip every step
// unseen. The first skip warns, then at most one warning per 100 skips,
// each saying how many; last_step() counts the non-finite elements.
TEST(EngineLossScaler, SkipsWithoutAScalerWarnTheFirstThenOncePerHundred) {
  const uint64_t seed = TestSeed();
  std::mt19937_64 rng(seed);
  auto device = *CreateHostDevice();
  auto storage = CreateMemStorage();
  const OffloadConfig config = MakeConfig(Case{.param_dtype = DType::kF32});
  ASSERT_EQ(config.loss_scaler.mode, LossScaleMode::kNone);
  TestModel model(*device, kSizes, kGroupOf, DType::kF32, DType::kF32);
  model.SetParams(rng);
  auto opt = *MakeOptimizer(*device, storage.get(), config, model);
  auto grads = model.RandomGrads(rng, 0.5f);
  grads[0][3] = std::numeric_limits<float>::quiet_NaN();
  grads[2][5] = std::numeric_limits<float>::infinity();
  model.SetGrads(grads);
  testing::LogCapture log(LogLevel::kWarning);
  for (int s = 0; s < 250; ++s) {
    ASSERT_TRUE(opt->Step().ok());
    EXPECT_TRUE(opt->last_step().skipped);
    EXPECT_EQ(opt->last_step().nonfinite_elems, 2u);
  }
  EXPECT_EQ(opt->step_count(), 0);
  EXPECT_NE(FormatStepStats(opt->last_step()).find("2 non-finite grads"), std::string::npos);
  const auto warned = log.Find(LogLevel::kWarning, "gradient elements are NaN or inf");
  ASSERT_EQ(warned.size(), 3u);
  EXPECT_NE(warned[0].find("step 1 skipped: 2 gradient elements are NaN or inf"), std::string::npos)
      << warned[0];
  EXPECT_NE(warned[0].find("no loss scaler to back off; 1 step skipped"), std::string::npos)
      << warned[0];
  EXPECT_NE(warned[1].find("101 steps skipped for non-finite gradients so far (100 since the "
                           "last warning)"),
            std::string::npos)
      << warned[1];
  EXPECT_NE(warned[2].find("201 steps skipped"), std::string::npos) << warned[2];
  // A clean step goes through and reports no non-finite gradients.
  model.SetGrads(model.RandomGrads(rng, 0.5f));
  ASSERT_TRUE(opt->Step().ok());
  EXPECT_FALSE(opt->last_step().skipped);
  EXPECT_EQ(opt->last_step().nonfinite_elems, 0u);
  EXPECT_EQ(opt->step_count(), 1);
}

// A dynamic scaler's skips above its minimum back the scale off, which is
// its normal work, unlogged; at the minimum with min_scale_overflow "skip"
// nothing backs off, and the skips went unseen (1333 of 4000 steps in a
// soak). Those warn as a skip without a scaler does.
TEST(EngineLossScaler, SkipsAtTheMinimumScaleWarn) {
  const uint64_t seed = TestSeed();
  std::mt19937_64 rng(seed);
  auto device = *CreateHostDevice();
  OffloadConfig config = MakeConfig(Case{.param_dtype = DType::kF16, .grad_dtype = DType::kF16});
  config.loss_scaler = {.mode = LossScaleMode::kDynamic,
                        .initial_scale_power = 2,
                        .hysteresis = 1,
                        .min_scale = 1.0,
                        .min_scale_overflow = MinScaleOverflow::kSkipStep};
  TestModel model(*device, kSizes, kGroupOf, DType::kF16, DType::kF16);
  model.SetParams(rng);
  auto opt = *MakeOptimizer(*device, nullptr, config, model);
  auto grads = model.RandomGrads(rng, 0.5f);
  grads[1][0] = std::numeric_limits<float>::infinity();
  model.SetGrads(grads);
  testing::LogCapture log(LogLevel::kWarning);
  for (int s = 0; s < 4; ++s) {  // scales 4, 2, 1 (backing off), then 1 again
    ASSERT_TRUE(opt->Step().ok());
    EXPECT_TRUE(opt->last_step().skipped);
  }
  EXPECT_EQ(opt->loss_scale(), 1.0);
  const auto warned = log.Find(LogLevel::kWarning, "gradient elements are NaN or inf");
  ASSERT_EQ(warned.size(), 1u) << "the skips at scales 4 and 2 back off; those at 1 warn";
  EXPECT_NE(warned[0].find("at the dynamic loss scale's minimum 1, which cannot back off"),
            std::string::npos)
      << warned[0];
  EXPECT_EQ(warned[0].find("needs a dynamic loss scale"), std::string::npos) << warned[0];
}

// An overflow at min_scale fails the step (FailedPrecondition, as DeepSpeed
// raises); last_step() keeps that step's statistics, so the overflow is
// visible (it was blanked: step 0, grad norm 0).
TEST(EngineLossScaler, AnOverflowAtMinScaleKeepsItsStatisticsInLastStep) {
  const uint64_t seed = TestSeed();
  std::mt19937_64 rng(seed);
  auto device = *CreateHostDevice();
  auto storage = CreateMemStorage();
  OffloadConfig config = MakeConfig(Case{.param_dtype = DType::kF16, .grad_dtype = DType::kF16});
  config.loss_scaler = {.mode = LossScaleMode::kDynamic, .initial_scale_power = 0, .hysteresis = 1};
  TestModel model(*device, kSizes, kGroupOf, DType::kF16, DType::kF16);
  model.SetParams(rng);
  auto opt = *MakeOptimizer(*device, storage.get(), config, model);
  model.SetGrads(model.RandomGrads(rng, 0.5f));
  ASSERT_TRUE(opt->Step().ok());
  auto grads = model.RandomGrads(rng, 0.5f);
  grads[0][3] = std::numeric_limits<float>::infinity();
  model.SetGrads(grads);
  Status s = opt->Step();
  ASSERT_EQ(s.code(), StatusCode::kFailedPrecondition) << s;
  const StepStats& last = opt->last_step();
  EXPECT_EQ(last.step, 1);
  EXPECT_TRUE(last.skipped);
  EXPECT_EQ(last.nonfinite_elems, 1u);
  EXPECT_EQ(last.loss_scale, 1.0);
  EXPECT_TRUE(std::isinf(last.grad_norm)) << last.grad_norm;
  EXPECT_NE(FormatStepStats(last).find("1 non-finite grads"), std::string::npos)
      << FormatStepStats(last);
}

TEST(EngineLossScaler, InfOnOneRankSkipsTheStepOnEveryRank) {
  const uint64_t seed = TestSeed();
  std::mt19937_64 rng(seed);
  constexpr int kWorld = 2;
  auto device = *CreateHostDevice();
  auto comms = *CreateLocalGroup(kWorld, *device);
  Case c{.param_dtype = DType::kF16};
  OffloadConfig config = MakeConfig(c);
  config.loss_scaler = {
      .mode = LossScaleMode::kDynamic, .initial_scale_power = 10, .hysteresis = 1};
  std::vector<std::unique_ptr<TestModel>> models;
  for (int r = 0; r < kWorld; ++r) {
    models.push_back(
        std::make_unique<TestModel>(*device, kSizes, kGroupOf, DType::kF16, DType::kF32));
    std::mt19937_64 same(seed);
    models[r]->SetParams(same);
  }
  std::vector<std::vector<uint8_t>> before;
  for (size_t t = 0; t < kSizes.size(); ++t) before.push_back(models[0]->ParamBytes(t));
  std::vector<StepStats> stats(kWorld);
  std::vector<double> next_scale(kWorld);
  std::vector<Status> status(kWorld);
  std::vector<std::thread> threads;
  for (int r = 0; r < kWorld; ++r) {
    auto g = models[r]->RandomGrads(rng, 0.5f);
    if (r == 1) g[2][17] = std::numeric_limits<float>::infinity();
    models[r]->SetGrads(g);
  }
  for (int r = 0; r < kWorld; ++r) {
    threads.emplace_back([&, r] {
      status[r] = [&]() -> Status {
        STRATA_ASSIGN_OR_RETURN(Stream stream, device->CreateStream());
        STRATA_ASSIGN_OR_RETURN(
            auto opt, MakeOptimizer(*device, nullptr, config, *models[r], comms[r].get(), stream));
        STRATA_RETURN_IF_ERROR(opt->Step());
        STRATA_RETURN_IF_ERROR(device->StreamSynchronize(stream));
        stats[r] = opt->last_step();
        next_scale[r] = opt->loss_scale();
        return OkStatus();
      }();
    });
  }
  for (auto& t : threads) t.join();
  for (int r = 0; r < kWorld; ++r) {
    ASSERT_TRUE(status[r].ok()) << status[r];
    EXPECT_TRUE(stats[r].skipped) << "rank " << r;
    EXPECT_EQ(stats[r].step, 0) << "rank " << r;
    EXPECT_EQ(stats[r].loss_scale, 1024.0) << "rank " << r;
    EXPECT_EQ(next_scale[r], 512.0) << "rank " << r;
    for (size_t t = 0; t < kSizes.size(); ++t) {
      EXPECT_EQ(models[r]->ParamBytes(t), before[t]) << "rank " << r << " tensor " << t;
    }
  }
}

// fp16 with a dynamic scaler over several steps, one with an overflow: the
// engine's decisions and params follow the reference scaler exactly.
TEST(EngineLossScaler, ScaledStepsMatchTheReference) {
  const uint64_t seed = TestSeed();
  std::mt19937_64 rng(seed);
  auto device = *CreateHostDevice();
  Case c{.param_dtype = DType::kF16, .max_grad_norm = 1.0};
  OffloadConfig config = MakeConfig(c);
  config.loss_scaler = {.mode = LossScaleMode::kDynamic,
                        .initial_scale_power = 8,
                        .growth_interval = 2,
                        .hysteresis = 1};
  TestModel model(*device, kSizes, kGroupOf, DType::kF16, DType::kF32);
  auto master = model.SetParams(rng);
  auto opt = *MakeOptimizer(*device, nullptr, config, model);
  ReferenceOptimizer ref(config, master, kGroupOf, kHypers);
  for (int s = 0; s < 5; ++s) {
    // The trainer's grads carry the current scale.
    auto g = model.RandomGrads(rng, 0.5f * static_cast<float>(opt->loss_scale()));
    if (s == 2) g[0][3] = std::numeric_limits<float>::quiet_NaN();
    auto grads = model.SetGrads(g);
    ASSERT_TRUE(opt->Step().ok());
    const GradStats st = FlatStats(*opt, model.FlatOrder(), grads);
    const bool skipped = ref.Step(grads, st.sum_sq, st.nonfinite_elems);
    EXPECT_EQ(opt->last_step().skipped, skipped) << "step " << s;
    EXPECT_EQ(opt->loss_scale(), ref.scale()) << "step " << s;
    ExpectSameAsReference(*opt, model, ref);
  }
  EXPECT_EQ(opt->step_count(), 4);
}

// What the engine's fp32 accumulation holds after one more micro-step `g`.
void AddMicroStep(std::vector<std::vector<float>>& sum, const std::vector<std::vector<float>>& g) {
  if (sum.empty()) {
    sum = g;
    return;
  }
  for (size_t t = 0; t < g.size(); ++t) {
    for (size_t k = 0; k < g[t].size(); ++k) sum[t][k] += g[t][k];
  }
}

TEST(EngineGradients, AccumulationEqualsOneStepOnTheSummedGradient) {
  const uint64_t seed = TestSeed();
  std::mt19937_64 rng(seed);
  auto device = *CreateHostDevice();
  auto storage = CreateMemStorage();
  Case c{.where = Where::kNvme, .buffer_count = 3, .max_grad_norm = 1.0};
  OffloadConfig config = MakeConfig(c);
  TestModel model(*device, kSizes, kGroupOf, c.param_dtype, c.grad_dtype);
  auto master = model.SetParams(rng);
  auto opt = *MakeOptimizer(*device, storage.get(), config, model);
  ReferenceOptimizer ref(config, master, kGroupOf, kHypers);
  for (int s = 0; s < 2; ++s) {
    std::vector<std::vector<float>> sum;
    for (int micro = 0; micro < 3; ++micro) {
      AddMicroStep(sum, model.SetGrads(model.RandomGrads(rng, 0.5f)));
      if (micro == 1) {
        // Hand this micro-step over bucket by bucket, in backward order.
        for (uint32_t i = static_cast<uint32_t>(kSizes.size()); i-- > 0;) {
          ASSERT_TRUE(opt->GradReady(i).ok());
        }
      }
      ASSERT_TRUE(opt->ReduceGradients().ok());
      // The trainer may reuse the grad tensors now.
      ASSERT_TRUE(device->Synchronize().ok());
    }
    ASSERT_TRUE(opt->Step().ok());
    EXPECT_EQ(opt->last_step().micro_steps, 3u);
    ExpectStepLikeReference(*opt, model, ref, sum);
  }
}

// Sub-groups over a million elements: the fp32 additions of accumulation
// run over the optimizer's threads in blocks (GradPathOptions::cpu), with the
// sums of the one-thread loop.
TEST(EngineGradients, AccumulationOverTheOptimizersThreadsMatchesBitwise) {
  const uint64_t seed = TestSeed();
  std::mt19937_64 rng(seed);
  auto device = *CreateHostDevice();
  const std::vector<uint64_t> sizes = {3'000'000, 17, 1'500'001};
  const std::vector<uint32_t> group_of = {0, 1, 0};
  Case c{.grad_dtype = DType::kBF16, .sub_group_elems = 4u << 20};
  OffloadConfig config = MakeConfig(c);
  TestModel model(*device, sizes, group_of, c.param_dtype, c.grad_dtype);
  auto master = model.SetParams(rng);
  auto opt = *MakeOptimizer(*device, nullptr, config, model);
  ReferenceOptimizer ref(config, master, group_of, kHypers);
  for (int s = 0; s < 2; ++s) {
    std::vector<std::vector<float>> sum;
    for (int micro = 0; micro < 2; ++micro) {
      AddMicroStep(sum, model.SetGrads(model.RandomGrads(rng, 0.5f)));
      ASSERT_TRUE(opt->ReduceGradients().ok());
      ASSERT_TRUE(device->Synchronize().ok());
    }
    ASSERT_TRUE(opt->Step().ok());
    ExpectStepLikeReference(*opt, model, ref, sum);
  }
}

// The last micro-step of an accumulation reported with GradReady (some
// params) and no ReduceGradients joins the sum whatever the sub-group size.
// It joined only when a report completed a sub-group: with both reported
// params' tensors and others in one sub-group, the micro-step was dropped.
TEST(EngineGradients, ALastMicroStepReportedInPartJoinsTheSumAtAnySubGroupSize) {
  for (const uint64_t sub_group : {uint64_t{1024}, uint64_t{1} << 20}) {
    SCOPED_TRACE("sub-group " + std::to_string(sub_group));
    OneRank r(Case{.sub_group_elems = sub_group}, TestSeed());
    std::vector<std::vector<float>> sum;
    AddMicroStep(sum, r.Grads());
    ASSERT_TRUE(r.opt->ReduceGradients().ok());
    ASSERT_TRUE(r.device->Synchronize().ok());
    AddMicroStep(sum, r.Grads());
    ASSERT_TRUE(r.opt->GradReady(3).ok());  // the one-element tensor, alone in no sub-group
    ASSERT_TRUE(r.opt->GradReady(0).ok());
    ASSERT_TRUE(r.opt->Step().ok());
    EXPECT_EQ(r.opt->last_step().micro_steps, 2u);
    r.ExpectStep(sum);
  }
}

// A device call that fails at enqueue (the nth host task from the start of
// the micro-step's hand-over) part way through an accumulation: some
// sub-groups held the micro-step and others not, and a second
// ReduceGradients added it again to the first ones. Now the sum refuses
// until ZeroGrad; where the failure came before any addition, the retry
// adds the micro-step once.
TEST(EngineGradients, AnAccumulationThatFailsPartWayIsRefusedUntilZeroGrad) {
  int torn = 0;
  for (int nth = 1; nth <= 24; ++nth) {
    SCOPED_TRACE("host task " + std::to_string(nth));
    OneRank r(Case{.gpu_fraction = 0.3}, TestSeed() + nth);
    const auto& opt = r.opt;
    const auto& device = r.device;
    std::vector<std::vector<float>> sum;
    AddMicroStep(sum, r.Grads());
    ASSERT_TRUE(opt->ReduceGradients().ok());
    ASSERT_TRUE(device->Synchronize().ok());
    AddMicroStep(sum, r.Grads());
    internal::FailHostTaskForTest(nth);
    const Status failed = opt->ReduceGradients();
    internal::FailHostTaskForTest(0);
    ASSERT_TRUE(device->Synchronize().ok());
    if (failed.ok()) continue;
    const Status again = opt->ReduceGradients();
    if (!again.ok()) {
      ++torn;
      EXPECT_EQ(again.code(), StatusCode::kFailedPrecondition) << again;
      EXPECT_NE(again.message().find("the accumulated gradients are incomplete"), std::string::npos)
          << again;
      const Status step = opt->Step();
      EXPECT_EQ(step.code(), StatusCode::kFailedPrecondition) << step;
      EXPECT_EQ(opt->step_count(), 0);
      ASSERT_TRUE(opt->ZeroGrad().ok());
      ASSERT_TRUE(device->Synchronize().ok());
      sum.clear();
      for (int micro = 0; micro < 2; ++micro) {
        AddMicroStep(sum, r.Grads());
        ASSERT_TRUE(opt->ReduceGradients().ok());
        ASSERT_TRUE(device->Synchronize().ok());
      }
    }
    ASSERT_TRUE(device->Synchronize().ok());
    const Status stepped = opt->Step();
    ASSERT_TRUE(stepped.ok()) << stepped;
    EXPECT_EQ(opt->last_step().micro_steps, 2u);
    r.ExpectStep(sum);
  }
  EXPECT_GT(torn, 0) << "no failure came part way through the additions";
}

// A step whose nth host task fails at enqueue (partial offload: the device
// Adam's too), then the trainer zeroes its grads: a failed step's retry
// finishes it (a device sub-group queued before the failure is done, not
// updated twice; the gradients not applied were kept), a step refused before
// its update is taken again; either way bitwise the clean step.
TEST(EngineFaults, AStepWhoseDeviceCallFailsAtEnqueueIsFinishedOnce) {
  int retried = 0;
  for (int nth = 1; nth <= 80; ++nth) {
    SCOPED_TRACE("host task " + std::to_string(nth));
    OneRank r(Case{.gpu_fraction = 0.5}, TestSeed() + nth);
    const auto& opt = r.opt;
    const auto& device = r.device;
    auto grads = r.Grads();
    internal::FailHostTaskForTest(nth);
    const Status failed = opt->Step();
    internal::FailHostTaskForTest(0);
    (void)device->Synchronize();
    if (!failed.ok()) {
      std::printf("host task %d: %s (%s)\n", nth, failed.ToString().c_str(),
                  opt->step_state() == StepState::kFailed ? "retried" : "stepped again");
      if (opt->step_state() == StepState::kFailed) {
        ++retried;
        ASSERT_TRUE(opt->ZeroGrad().ok());
        ASSERT_TRUE(device->Synchronize().ok());
        const Status retry = opt->RetryStep();
        ASSERT_TRUE(retry.ok()) << failed << "; the retry: " << retry;
      } else {
        const Status again = opt->Step();
        ASSERT_TRUE(again.ok()) << failed << "; again: " << again;
      }
    }
    ASSERT_TRUE(device->Synchronize().ok());
    EXPECT_EQ(opt->step_count(), 1);
    r.ExpectStep(grads);
  }
  EXPECT_GT(retried, 0) << "no failure came after the update began";
}

// A backward that adds into the grad tensors clears them between
// micro-steps: ZeroGradTensors keeps what ReduceGradients summed, ZeroGrad
// drops it, warning once (a C trainer's natural loop once stepped on zeros
// with no word).
TEST(EngineGradients, ZeroGradTensorsKeepsTheSumAndZeroGradDropsItWarningOnce) {
  OneRank r(Case{.max_grad_norm = 1.0}, TestSeed());
  testing::LogCapture log(LogLevel::kWarning);
  std::vector<std::vector<float>> sum;
  for (int micro = 0; micro < 2; ++micro) {
    AddMicroStep(sum, r.Grads());
    ASSERT_TRUE(r.opt->ReduceGradients().ok());
    ASSERT_TRUE(r.opt->ZeroGradTensors().ok());
    ASSERT_TRUE(r.device->Synchronize().ok());
    for (size_t t = 0; t < r.model.size(); ++t) {
      const std::vector<uint8_t> bytes = r.model.GradBytes(t);
      EXPECT_EQ(std::count(bytes.begin(), bytes.end(), uint8_t{0}),
                static_cast<ptrdiff_t>(bytes.size()))
          << "tensor " << t;
    }
  }
  ASSERT_TRUE(r.opt->Step().ok());
  EXPECT_EQ(r.opt->last_step().micro_steps, 2u);
  r.ExpectStep(sum);
  EXPECT_TRUE(log.Find(LogLevel::kWarning, "zero grad").empty());

  for (int round = 0; round < 2; ++round) {
    r.Grads();
    ASSERT_TRUE(r.opt->ReduceGradients().ok());
    ASSERT_TRUE(r.opt->ZeroGrad().ok());        // dropped: the step takes the next grads alone
    ASSERT_TRUE(r.device->Synchronize().ok());  // the zeroing is on the stream
    sum.clear();
    AddMicroStep(sum, r.Grads());
    ASSERT_TRUE(r.opt->Step().ok());
    EXPECT_EQ(r.opt->last_step().micro_steps, 1u);
    r.ExpectStep(sum);
    ASSERT_TRUE(r.device->Synchronize().ok());
  }
  const auto warned = log.Find(LogLevel::kWarning, "zero grad: dropped the gradients of 1 ");
  ASSERT_EQ(warned.size(), 1u) << "warned once";
  EXPECT_NE(warned[0].find("call ZeroGradTensors()"), std::string::npos) << warned[0];
}

// Accumulation keeps the device sub-groups' sums in fp32 device memory the
// plan does not hold: beyond device_budget the first ReduceGradients is
// refused before it reads anything (it used to exceed the budget by a third),
// and the optimizer steps on as before.
TEST(EngineGradients, AccumulationBeyondTheDeviceBudgetIsRefused) {
  std::mt19937_64 rng(TestSeed());
  auto device = *CreateHostDevice();
  Case c{.gpu_fraction = 0.5};
  OffloadConfig config = MakeConfig(c);
  TestModel model(*device, kSizes, kGroupOf, c.param_dtype, c.grad_dtype);
  model.SetParams(rng);
  uint64_t total = 0, elems = 0;
  {
    auto probe = *MakeOptimizer(*device, nullptr, config, model);
    total = probe->plan().device_total_bytes();
    elems = probe->plan().device_elems;
  }
  ASSERT_GT(elems, 0u);
  config.device_budget_bytes = total;  // the plan fits; its sums do not
  auto opt = *MakeOptimizer(*device, nullptr, config, model);
  ASSERT_EQ(opt->plan().device_elems, elems);
  model.SetGrads(model.RandomGrads(rng, 0.5f));
  Status s = opt->ReduceGradients();
  EXPECT_EQ(s.code(), StatusCode::kResourceExhausted) << s;
  EXPECT_NE(s.message().find("raise device_budget to at least"), std::string::npos) << s;
  ASSERT_TRUE(opt->Step().ok());
  EXPECT_EQ(opt->last_step().micro_steps, 1u);
  EXPECT_NE(FormatPlan(opt->plan()).find("gradient accumulation (ReduceGradients) adds"),
            std::string::npos);
  // Room for the sums: accumulation runs.
  config.device_budget_bytes = total + 4 * elems;
  opt = *MakeOptimizer(*device, nullptr, config, model);
  ASSERT_TRUE(opt->ReduceGradients().ok());
  ASSERT_TRUE(opt->Step().ok());
  EXPECT_EQ(opt->last_step().micro_steps, 1u);
}

// A device with exactly the plan's device bytes holds what Create allocates
// there (the trainer's tensors are host memory here, outside the budget).
// The gradient statistics were planned as one piece per sub-group, 32 B
// short for each further tensor: with thousands of small tensors the plan
// said "fits" and Create then ran out of the device's memory.
TEST(EnginePlan, ADeviceOfThePlansBytesHoldsTheEngine) {
  constexpr uint32_t kTensors = 3000;
  OffloadConfig config = MakeConfig({.grad_dtype = DType::kBF16, .sub_group_elems = 1 << 14});
  std::vector<std::vector<uint16_t>> data(kTensors), grad(kTensors);
  std::vector<ParamGroup> groups(1);
  ParamGroup& group = groups[0];
  for (uint32_t i = 0; i < kTensors; ++i) {
    const uint64_t elems = 1 + i % 97;
    data[i].assign(elems, 0x3f80);  // 1.0 in bf16
    grad[i].assign(elems, 0x3c00);  // 2^-7
    group.params.push_back({.data = data[i].data(), .grad = grad[i].data(), .elems = elems});
  }
  auto create = [&](Device& device) {
    return OffloadOptimizer::Create({.device = &device}, config, groups);
  };
  uint64_t planned = 0;
  {
    auto unlimited = *CreateHostDevice({.external_memory = ExternalMemory::kAccept});
    auto probe = create(*unlimited);
    ASSERT_TRUE(probe.ok()) << probe.status();
    planned = (*probe)->plan().device_total_bytes();
  }
  auto device = *CreateHostDevice(
      {.memory_budget_bytes = planned, .external_memory = ExternalMemory::kAccept});
  auto opt = create(*device);
  ASSERT_TRUE(opt.ok()) << opt.status() << " (the plan's device bytes: " << planned << ")";
  ASSERT_TRUE((*opt)->Step().ok());
  EXPECT_EQ((*opt)->step_count(), 1);
}

TEST(EngineGradients, GradReadyInAnyOrderGivesTheSameStep) {
  OneRank r(Case{.sub_group_elems = 300}, TestSeed());
  auto grads = r.Grads();
  std::vector<uint32_t> order(kSizes.size());
  std::iota(order.begin(), order.end(), 0u);
  std::shuffle(order.begin(), order.end(), r.rng);
  for (uint32_t i : order) ASSERT_TRUE(r.opt->GradReady(i).ok());
  EXPECT_EQ(r.opt->GradReady(static_cast<uint32_t>(kSizes.size())).code(), StatusCode::kOutOfRange);
  ASSERT_TRUE(r.opt->Step().ok());
  EXPECT_EQ(r.opt->last_step().micro_steps, 1u);
  r.ExpectStep(grads);
}

// A param reported ready, then accumulated into and reported again: the first
// report started its statistics, so the step would clip and check NaN on the
// first value and apply the second. The repeat is refused, and so is the step
// until ZeroGrad; then a clean hand-over steps as the reference.
TEST(EngineGradients, GradReadyTwiceRefusesTheStepUntilZeroGrad) {
  OneRank r(Case{.sub_group_elems = 300, .max_grad_norm = 1.0}, TestSeed());
  std::vector<std::vector<uint8_t>> params_before;
  for (size_t t = 0; t < kSizes.size(); ++t) params_before.push_back(r.model.ParamBytes(t));
  r.Grads();
  ASSERT_TRUE(r.opt->GradReady(1).ok());
  ASSERT_TRUE(r.device->Synchronize().ok());            // the report's statistics were taken
  r.model.SetGrads(r.model.RandomGrads(r.rng, 50.0f));  // more gradient, after the report
  const Status twice = r.opt->GradReady(1);
  EXPECT_EQ(twice.code(), StatusCode::kFailedPrecondition) << twice;
  EXPECT_NE(twice.message().find("param 1 was reported ready twice"), std::string::npos) << twice;
  for (Status s : {r.opt->Step(), r.opt->ReduceGradients()}) {
    EXPECT_EQ(s.code(), StatusCode::kFailedPrecondition) << s;
    EXPECT_NE(s.message().find("ZeroGrad()"), std::string::npos) << s;
  }
  EXPECT_EQ(r.opt->step_count(), 0);
  for (size_t t = 0; t < kSizes.size(); ++t) EXPECT_EQ(r.model.ParamBytes(t), params_before[t]);
  ASSERT_TRUE(r.opt->ZeroGrad().ok());
  ASSERT_TRUE(r.device->Synchronize().ok());  // the zeroing is queued on the trainer's stream
  auto grads = r.Grads();
  ASSERT_TRUE(r.opt->GradReady(1).ok());
  ASSERT_TRUE(r.opt->Step().ok());
  r.ExpectStep(grads);
}

// An NVMe fault mid-step: a clear error naming the file and offset, no state
// lost, the optimizer refuses a new step, a save and a state read while the
// failed step is unfinished, and RetryStep() gives bitwise the clean run's
// params and state.
void RunFaultRetry(testing::FaultOptions faults, double gpu_fraction = 0.0) {
  const uint64_t seed = TestSeed();
  auto device = *CreateHostDevice();
  auto fault = testing::FaultStorage::Create(CreateMemStorage(), {.seed = seed});
  Case c{.where = Where::kMixed, .buffer_count = 2, .max_grad_norm = 1.0,
         .gpu_fraction = gpu_fraction};
  OffloadConfig config = MakeConfig(c);
  SetMixedBudget(config);
  std::mt19937_64 rng(seed);
  TestModel model(*device, kSizes, kGroupOf, c.param_dtype, c.grad_dtype);
  auto master = model.SetParams(rng);
  auto opt = *MakeOptimizer(*device, fault.get(), config, model);
  ASSERT_GT(opt->plan().host_sub_groups, 0u);
  ReferenceOptimizer ref(config, master, kGroupOf, kHypers);
  int64_t taken = 0;  // steps the optimizer took
  auto expect_step = [&](const std::vector<std::vector<float>>& grads) {
    const GradStats st = FlatStats(*opt, model.FlatOrder(), grads);
    ref.Step(grads, st.sum_sq, st.nonfinite_elems);
    ++taken;
    ExpectSameAsReference(*opt, model, ref);
    EXPECT_EQ(opt->step_count(), taken);
  };
  for (int s = 0; s < 3; ++s) {
    auto grads = model.SetGrads(model.RandomGrads(rng, 0.5f));
    if (s == 1) {
      faults.seed = seed + 1;
      fault->SetOptions(faults);
      // Random faults may spare a whole step: that step is a clean one; go
      // on until one fails.
      Status failed = opt->Step();
      for (int spared = 0; failed.ok() && spared < 100; ++spared) {
        fault->SetOptions({});  // the check reads the state back
        expect_step(grads);
        ++faults.seed;
        fault->SetOptions(faults);
        grads = model.SetGrads(model.RandomGrads(rng, 0.5f));
        failed = opt->Step();
      }
      ASSERT_FALSE(failed.ok());
      std::printf("failed step: %s\n", failed.ToString().c_str());
      EXPECT_NE(failed.message().find("strata-rank0.state@"), std::string::npos) << failed;
      EXPECT_NE(failed.message().find("EIO"), std::string::npos) << failed;
      EXPECT_NE(failed.message().find("step " + std::to_string(taken + 1)), std::string::npos)
          << failed;
      EXPECT_EQ(opt->step_count(), taken);
      EXPECT_EQ(opt->step_state(), StepState::kFailed);
      EXPECT_EQ(opt->step_failure(), failed);
      // Nothing that would mix two steps is accepted while it is unfinished.
      fault->SetOptions({});
      const std::string failed_step = "step " + std::to_string(taken + 1) + " failed part way";
      for (Status refused :
           {opt->Step(), opt->Save(::testing::TempDir() + "/never_written"),
            [&] {
              std::vector<float> st(opt->sub_groups()[0].elems() * opt->StateArrayCount());
              return opt->ReadState(0, st);
            }()}) {
        EXPECT_EQ(refused.code(), StatusCode::kFailedPrecondition) << refused;
        EXPECT_NE(refused.message().find(failed_step), std::string::npos) << refused;
        EXPECT_NE(refused.message().find("RetryStep()"), std::string::npos) << refused;
      }
      EXPECT_FALSE(std::filesystem::exists(::testing::TempDir() + "/never_written"));
      EXPECT_EQ(opt->step_count(), taken);
      // A second failure while retrying changes nothing either. Every IO of
      // the faulty kind fails now, so the retry cannot succeed by chance.
      testing::FaultOptions always = faults;
      if (always.read_eio_one_in > 0) always.read_eio_one_in = 1;
      if (always.write_eio_one_in > 0) always.write_eio_one_in = 1;
      fault->SetOptions(always);
      ASSERT_FALSE(opt->RetryStep().ok());
      EXPECT_EQ(opt->step_count(), taken);
      EXPECT_EQ(opt->step_state(), StepState::kFailed);
      fault->SetOptions({});
      ASSERT_TRUE(device->Synchronize().ok());
      // The trainer may zero the grad tensors, or move a param (the old
      // tensors are freed): the failed step keeps its own gradients and the
      // retry writes every param where it now lives.
      ASSERT_TRUE(opt->ZeroGrad().ok());
      ASSERT_TRUE(device->Synchronize().ok());
      {
        const size_t t = model.FlatOrder()[1];
        uint32_t index = 0;
        while (opt->params()[index].name != "t" + std::to_string(t)) ++index;
        auto [data, grad] = model.Relocate(t);
        Status rebound = opt->RebindParam(index, data, grad);
        ASSERT_TRUE(rebound.ok()) << rebound;
      }
      // A scheduler changes the lr before the retry: that is the next step's;
      // the retry finishes this one with the lr it began with.
      GroupHyper next = opt->group_hyper(0);
      next.lr *= 10;
      ASSERT_TRUE(opt->SetGroupHyper(0, next).ok());
      EXPECT_EQ(opt->group_hyper(0).lr, next.lr);
      Status retried = opt->RetryStep();
      ASSERT_TRUE(retried.ok()) << retried;
      EXPECT_EQ(opt->step_state(), StepState::kReady);
      EXPECT_TRUE(opt->step_failure().ok());
      expect_step(grads);
      ASSERT_TRUE(opt->SetGroupHyper(0, kHypers[0]).ok());  // the reference's, from here on
      Status nothing = opt->RetryStep();
      EXPECT_EQ(nothing.code(), StatusCode::kFailedPrecondition) << nothing;
      continue;
    }
    Status ok = opt->Step();
    ASSERT_TRUE(ok.ok()) << ok;
    expect_step(grads);
  }
}

TEST(EngineFaults, WriteEioMidStepIsRetried) { RunFaultRetry({.write_eio_one_in = 3}); }
TEST(EngineFaults, ReadEioMidStepIsRetried) { RunFaultRetry({.read_eio_one_in = 4}); }
// The device sub-groups are done when the NVMe ones fail: the retry
// republishes them (into a moved tensor too) and updates only the rest.
TEST(EngineFaults, WriteEioWithDeviceSubGroupsIsRetried) {
  RunFaultRetry({.write_eio_one_in = 3}, 0.3);
}

// A load that fails part way (a bad chunk, the disk) after a failed step
// used to drop the failed step first and then leave the optimizer ready:
// its state mixed the failed step's two halves and whatever the load had
// written, yet Step, Save and RetryStep ("no step failed") took it. Now the
// whole state refuses until it is written whole again, and so does a read of
// a host sub-group the write left partly set.
TEST(EngineFaults, AFailedLoadLeavesTheStateRefusedUntilItIsWrittenWhole) {
  const uint64_t seed = TestSeed();
  auto device = *CreateHostDevice();
  auto fault = testing::FaultStorage::Create(CreateMemStorage(), {.seed = seed});
  Case c{.where = Where::kMixed, .buffer_count = 2};
  OffloadConfig config = MakeConfig(c);
  SetMixedBudget(config);
  std::mt19937_64 rng(seed);
  TestModel model(*device, kSizes, kGroupOf, c.param_dtype, c.grad_dtype);
  model.SetParams(rng);
  auto opt = *MakeOptimizer(*device, fault.get(), config, model);
  const auto n = static_cast<uint32_t>(opt->sub_groups().size());
  ASSERT_GE(n, 3u);
  // The load fails in the second host sub-group (the first is written).
  std::vector<uint32_t> host;
  for (uint32_t i = 0; i < n; ++i) {
    if (opt->plan().sub_groups[i].tier == Tier::kHost) host.push_back(i);
  }
  ASSERT_GE(host.size(), 2u);
  const uint32_t bad = host[1];
  model.SetGrads(model.RandomGrads(rng, 0.5f));
  ASSERT_TRUE(opt->Step().ok());
  // The "checkpoint": the state after step 1.
  std::vector<std::vector<float>> saved(n);
  for (uint32_t i = 0; i < n; ++i) {
    saved[i].resize(opt->sub_groups()[i].elems() * opt->StateArrayCount());
    ASSERT_TRUE(opt->ReadState(i, saved[i]).ok());
  }
  model.SetGrads(model.RandomGrads(rng, 0.5f));
  Status failed;
  for (uint64_t k = 1; failed.ok() && k < 100; ++k) {
    fault->SetOptions({.seed = seed + k, .write_eio_one_in = 3});
    failed = opt->Step();
  }
  fault->SetOptions({});
  ASSERT_EQ(opt->step_state(), StepState::kFailed) << "no step failed";
  auto fill = [&](uint32_t i, uint32_t a, uint64_t begin, std::span<float> piece) -> Status {
    if (i == bad && a == 1) return DataLossError("chunk 7 of the checkpoint fails its checksum");
    const uint64_t elems = opt->sub_groups()[i].elems();
    std::copy_n(saved[i].begin() + a * elems + begin, piece.size(), piece.begin());
    return OkStatus();
  };
  const Status load = opt->WriteStateInOrder(fill);
  ASSERT_EQ(load.code(), StatusCode::kDataLoss) << load;
  EXPECT_EQ(opt->step_state(), StepState::kFailed);
  EXPECT_NE(opt->incomplete_state().find("chunk 7"), std::string::npos) << opt->incomplete_state();
  auto read = [&](uint32_t i) {
    std::vector<float> st(saved[i].size());
    return opt->ReadState(i, st);
  };
  auto expect_refused = [&](const Status& s, const std::string& count) {
    EXPECT_EQ(s.code(), StatusCode::kFailedPrecondition) << s;
    EXPECT_NE(
        s.message().find("the state of " + count + " of " + std::to_string(n) + " sub-groups"),
        std::string::npos)
        << s;
    EXPECT_NE(s.message().find("may mix two states"), std::string::npos) << s;
    EXPECT_NE(s.message().find("load a checkpoint"), std::string::npos) << s;
  };
  const std::string all = std::to_string(n);
  expect_refused(opt->Step(), all);
  expect_refused(opt->RetryStep(), all);  // not "no step failed"
  expect_refused(opt->Save(::testing::TempDir() + "/never_written"), all);
  expect_refused(
      opt->ReadStateInOrder([](uint32_t, uint32_t, std::span<const float>) { return OkStatus(); }),
      all);
  expect_refused(read(bad), all);   // partly set
  EXPECT_TRUE(read(host[0]).ok());  // whole, if not in line with the rest
  EXPECT_FALSE(std::filesystem::exists(::testing::TempDir() + "/never_written"));
  // Written again sub-group by sub-group: each one written reads; the
  // state is whole once the last one is.
  for (uint32_t i = 0; i < n; ++i) {
    ASSERT_TRUE(opt->WriteState(i, saved[i]).ok());
    EXPECT_TRUE(read(i).ok());
    if (i + 1 < n) expect_refused(opt->Step(), std::to_string(n - 1 - i));
  }
  EXPECT_EQ(opt->step_state(), StepState::kReady);
  EXPECT_TRUE(opt->step_failure().ok());
  EXPECT_EQ(opt->incomplete_state(), "");
  ASSERT_TRUE(opt->RestoreCounters(1, opt->loss_scaler_state()).ok());
  for (uint32_t i = 0; i < n; ++i) {
    std::vector<float> st(saved[i].size());
    ASSERT_TRUE(opt->ReadState(i, st).ok());
    EXPECT_EQ(st, saved[i]) << "sub-group " << i;
  }
  // A single host write that fails tears its own sub-group only (an NVMe one
  // keeps its committed state); a reset from the params makes the whole
  // state one again.
  const Status one = opt->WriteState(bad, [](uint32_t, uint64_t, std::span<float>) {
    return InternalError("the source went away");
  });
  EXPECT_FALSE(one.ok());
  expect_refused(opt->Step(), "1");
  expect_refused(read(bad), "1");
  EXPECT_TRUE(read(host[0]).ok());
  ASSERT_TRUE(opt->ResetStateFromParams().ok());
  EXPECT_EQ(opt->step_state(), StepState::kReady);
  model.SetGrads(model.RandomGrads(rng, 0.5f));
  EXPECT_TRUE(opt->Step().ok());
}

// The NVMe queue itself breaks mid-step (which requests completed is
// unknown): the step fails with the store's error, the retry says the same
// instead of "IO already in flight", nothing mixes two steps, and the
// optimizer is destroyed without hanging.
TEST(EngineFaults, BrokenQueueStopsTheOptimizerWithAClearError) {
  const uint64_t seed = TestSeed();
  auto device = *CreateHostDevice();
  auto fault = testing::FaultStorage::Create(CreatePosixStorage(), {.seed = seed});
  Case c{.where = Where::kMixed, .buffer_count = 2, .max_grad_norm = 1.0};
  OffloadConfig config = MakeConfig(c);
  SetMixedBudget(config);
  testing::TempDir dir;  // posix: worker threads still hold requests when it breaks
  ASSERT_TRUE(dir.ok());
  config.nvme_paths = {dir.path()};
  std::mt19937_64 rng(seed);
  TestModel model(*device, kSizes, kGroupOf, c.param_dtype, c.grad_dtype);
  model.SetParams(rng);
  auto opt = *MakeOptimizer(*device, fault.get(), config, model);
  ASSERT_GT(opt->plan().nvme_sub_groups, 0u);
  model.SetGrads(model.RandomGrads(rng, 0.5f));
  ASSERT_TRUE(opt->Step().ok());
  model.SetGrads(model.RandomGrads(rng, 0.5f));
  fault->SetOptions({.seed = seed + 1, .queue_fail_one_in = 1});
  const Status failed = opt->Step();
  ASSERT_FALSE(failed.ok());
  std::printf("failed step: %s\n", failed.ToString().c_str());
  EXPECT_GT(fault->stats().queue_failures.load(), 0u);
  for (std::string_view part : {"IO queue of", "strata-rank0.state", "load the last checkpoint"}) {
    EXPECT_NE(failed.message().find(part), std::string_view::npos) << part << ": " << failed;
  }
  EXPECT_EQ(opt->step_state(), StepState::kFailed);
  EXPECT_EQ(opt->step_count(), 1);
  fault->SetOptions({});
  const Status retried = opt->RetryStep();
  ASSERT_FALSE(retried.ok());
  EXPECT_NE(retried.message().find("IO queue of"), std::string_view::npos) << retried;
  EXPECT_EQ(retried.message().find("already has IO in flight"), std::string_view::npos) << retried;
  EXPECT_EQ(opt->step_state(), StepState::kFailed);
  EXPECT_EQ(opt->step_count(), 1);
  EXPECT_EQ(opt->Step().code(), StatusCode::kFailedPrecondition);
  opt.reset();
}

// A trainer replaces a param's storage between steps (model.to(), p.data =
// ...): after RebindParam the engine reads and writes only the new tensors
// (the old ones are freed: ASan would see a stale access) and the results stay
// bitwise the reference's.
TEST(EngineRebind, NewStorageIsUsedAndResultsStayBitwise) {
  const uint64_t seed = TestSeed();
  std::mt19937_64 rng(seed);
  auto device = *CreateHostDevice();
  auto storage = CreateMemStorage();
  Case c{.where = Where::kMixed, .buffer_count = 2, .max_grad_norm = 1.0};
  OffloadConfig config = MakeConfig(c);
  SetMixedBudget(config);
  TestModel model(*device, kSizes, kGroupOf, c.param_dtype, c.grad_dtype);
  auto master = model.SetParams(rng);
  auto opt = *MakeOptimizer(*device, storage.get(), config, model);
  ReferenceOptimizer ref(config, master, kGroupOf, kHypers);
  const auto order = model.FlatOrder();
  for (int step = 0; step < 3; ++step) {
    // Move different tensors each step, one alone and from step 1 on two
    // at once; find their engine indexes by name.
    std::vector<ParamBinding> moves;
    for (int k = 0; k <= std::min(step, 1); ++k) {
      const size_t t = order[(step * 3 + 1 + 4 * k) % order.size()];
      uint32_t index = 0;
      while (opt->params()[index].name != "t" + std::to_string(t)) ++index;
      auto [data, grad] = model.Relocate(t);
      moves.push_back({.index = index, .data = data, .grad = grad});
    }
    Status rebound = moves.size() == 1
                         ? opt->RebindParam(moves[0].index, moves[0].data, moves[0].grad)
                         : opt->RebindParams(moves);
    ASSERT_TRUE(rebound.ok()) << rebound;
    for (const ParamBinding& b : moves) EXPECT_EQ(opt->params()[b.index].data, b.data);
    auto grads = model.SetGrads(model.RandomGrads(rng, 0.5f));
    Status s = opt->Step();
    ASSERT_TRUE(s.ok()) << s;
    const GradStats st = FlatStats(*opt, order, grads);
    ref.Step(grads, st.sum_sq, st.nonfinite_elems);
    ExpectSameAsReference(*opt, model, ref);
    ASSERT_TRUE(opt->ZeroGrad().ok());
    ASSERT_TRUE(device->Synchronize().ok());
  }
  // Bad rebinds name the param and change nothing.
  const Param p0 = opt->params()[0];
  const Param p1 = opt->params()[1];
  Status bad = opt->RebindParam(99, p0.data, p0.grad);
  EXPECT_EQ(bad.code(), StatusCode::kOutOfRange) << bad;
  bad = opt->RebindParam(0, nullptr, p0.grad);
  EXPECT_EQ(bad.code(), StatusCode::kInvalidArgument) << bad;
  EXPECT_NE(bad.message().find("new data pointer is null"), std::string::npos) << bad;
  bad = opt->RebindParam(0, p0.grad, p0.grad);  // create refuses the same, so must rebind
  EXPECT_EQ(bad.code(), StatusCode::kInvalidArgument) << bad;
  EXPECT_NE(bad.message().find("data and grad are the same pointer"), std::string::npos) << bad;
  bad = opt->RebindParam(0, p1.data, p0.grad);
  EXPECT_EQ(bad.code(), StatusCode::kInvalidArgument) << bad;
  EXPECT_NE(bad.message().find("the data of param 1 (" + p1.name + ")"), std::string::npos) << bad;
  EXPECT_NE(bad.message().find("overlaps the data of param 0 (" + p0.name + ")"),
            std::string::npos)
      << bad;
  // Overlap, not only the same pointer: one element into another param's grad.
  bad = opt->RebindParam(0, p0.data,
                         static_cast<std::byte*>(p1.grad) + DTypeSize(config.grad_dtype));
  EXPECT_EQ(bad.code(), StatusCode::kInvalidArgument) << bad;
  EXPECT_NE(bad.message().find("the grad of param 1"), std::string::npos) << bad;
  EXPECT_NE(bad.message().find("overlaps the grad of param 0"), std::string::npos) << bad;
  bad = opt->RebindParam(0, static_cast<std::byte*>(p0.data) + 1, p0.grad);
  EXPECT_NE(bad.message().find("is not aligned"), std::string::npos) << bad;
  // A batch is all or none, and names each param once.
  std::vector<float> spare(2 * p1.elems);  // room for p1 in any dtype
  std::vector<ParamBinding> batch = {
      {.index = 1, .data = spare.data(), .grad = spare.data() + p1.elems},
      {.index = 0, .data = nullptr, .grad = p0.grad}};
  bad = opt->RebindParams(batch);
  EXPECT_EQ(bad.code(), StatusCode::kInvalidArgument) << bad;
  EXPECT_EQ(opt->params()[1].data, p1.data);  // the valid first move was not applied
  batch = {batch[0], batch[0]};
  bad = opt->RebindParams(batch);
  EXPECT_NE(bad.message().find("named twice"), std::string::npos) << bad;
  EXPECT_EQ(opt->params()[0].data, p0.data);
}

TEST(EngineValidation, BadGroupsAreInvalidArgumentNamingTheParam) {
  auto device = *CreateHostDevice();
  TestModel model(*device, kSizes, kGroupOf, DType::kBF16, DType::kF32);
  OffloadConfig config = MakeConfig(Case{});
  auto expect_invalid = [&](std::vector<ParamGroup> groups, std::string_view needle) {
    auto r = OffloadOptimizer::Create(
        {.device = device.get(), .comm = nullptr, .storage = nullptr, .stream = {}}, config,
        groups);
    ASSERT_FALSE(r.ok()) << needle;
    EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument) << r.status();
    EXPECT_NE(r.status().message().find(needle), std::string::npos) << r.status();
  };
  expect_invalid({}, "no param groups");
  auto groups = model.Groups(kHypers);
  groups[1].params.clear();
  expect_invalid(groups, "param group 1 has no tensors");
  groups = model.Groups(kHypers);
  groups[0].params[2].grad = nullptr;
  expect_invalid(groups, "param group 0 tensor 2 (t3) has 1 elems but a null grad pointer");
  groups = model.Groups(kHypers);
  groups[1].params[0].data = groups[0].params[0].data;
  expect_invalid(groups, "the data of param 4 (t2) (8192 bytes at");
  expect_invalid(groups, "overlaps the data of param 0 (t0)");
  // Overlap, not only the same pointer: a grad that starts inside a data tensor.
  groups = model.Groups(kHypers);
  groups[1].params[2].grad = static_cast<std::byte*>(groups[0].params[1].data) + 4;
  expect_invalid(groups, "the grad of param 6 (t5)");
  expect_invalid(groups, "overlaps the data of param 1 (t1) (74 bytes at");
  // Element alignment: a bf16 tensor at an odd address, an fp32 grad at 2 mod 4.
  groups = model.Groups(kHypers);
  groups[0].params[3].data = static_cast<std::byte*>(groups[0].params[3].data) + 1;
  expect_invalid(groups, "the data of param 3 (t6) at");
  expect_invalid(groups, "is not aligned to its 2-byte bf16 elements");
  groups = model.Groups(kHypers);
  groups[1].params[0].grad = static_cast<std::byte*>(groups[1].params[0].grad) + 2;
  expect_invalid(groups, "the grad of param 4 (t2) at");
  expect_invalid(groups, "is not aligned to its 4-byte fp32 elements");
  // Names are JSON text in checkpoints and exports (nlohmann's dump throws on
  // bytes that are not UTF-8): a bad one is refused here, a good one is kept.
  for (std::string bad : {std::string("w\xff"), std::string("\xc3"), std::string("\xc0\xaf"),
                          std::string("\xed\xa0\x80"), std::string("\xf4\x90\x80\x80")}) {
    groups = model.Groups(kHypers);
    groups[1].params[0].name = bad;
    expect_invalid(groups, "param group 1 tensor 0 has a name that is not UTF-8");
  }
  groups = model.Groups(kHypers);
  groups[0].params[0].name = "\xc3\xa9t\xc3\xa9.\xe2\x82\xac.\xf0\x9f\x98\x80";  // été.€.😀
  {
    auto ok = OffloadOptimizer::Create(
        {.device = device.get(), .comm = nullptr, .storage = nullptr, .stream = {}}, config,
        groups);
    ASSERT_TRUE(ok.ok()) << ok.status();
    EXPECT_EQ((*ok)->params()[0].name, groups[0].params[0].name);
  }
  groups = model.Groups(kHypers);
  groups[1].hyper.beta2 = 1.0;
  expect_invalid(groups, "param group 1: beta2 is 1");
  groups = model.Groups(kHypers);
  groups[0].hyper.lr = -1;
  expect_invalid(groups, "lr is -1");
  auto r = OffloadOptimizer::Create({}, config, model.Groups(kHypers));
  EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
}

// Checkpoints and exports key tensors by name: two params of one name (as
// per-submodule named_parameters() give) used to train and save, and
// state_dict_from_checkpoint then silently kept only one of them.
TEST(EngineValidation, ParamsOfOneNameAreRefusedNamingBoth) {
  auto device = *CreateHostDevice();
  TestModel model(*device, kSizes, kGroupOf, DType::kBF16, DType::kF32);
  OffloadConfig config = MakeConfig(Case{});
  auto create = [&](const std::vector<ParamGroup>& groups) {
    return OffloadOptimizer::Create(
        {.device = device.get(), .comm = nullptr, .storage = nullptr, .stream = {}}, config,
        groups);
  };
  auto groups = model.Groups(kHypers);
  groups[0].params[1].name = "weight";
  groups[1].params[2].name = "weight";
  auto r = create(groups);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument) << r.status();
  EXPECT_NE(r.status().message().find("params 1 (group 0) and 6 (group 1) are both named 'weight'"),
            std::string::npos)
      << r.status();
  EXPECT_NE(r.status().message().find("give every param a unique name"), std::string::npos)
      << r.status();
  // A name an unnamed param gets in exports ("param.<i>") is taken too.
  groups = model.Groups(kHypers);
  groups[0].params[2].name = "";
  groups[1].params[0].name = "param.2";
  r = create(groups);
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("param 4 is named 'param.2', the name unnamed param 2 gets"),
            std::string::npos)
      << r.status();
  // Unnamed params may be many.
  groups = model.Groups(kHypers);
  for (ParamGroup& g : groups) {
    for (Param& p : g.params) p.name.clear();
  }
  r = create(groups);
  EXPECT_TRUE(r.ok()) << r.status();
}

TEST(EngineValidation, AccessorsAndSetters) {
  auto device = *CreateHostDevice();
  TestModel model(*device, kSizes, kGroupOf, DType::kBF16, DType::kF32);
  OffloadConfig config = MakeConfig(Case{});
  auto opt = *MakeOptimizer(*device, nullptr, config, model);
  EXPECT_EQ(opt->num_groups(), 2u);
  ASSERT_EQ(opt->params().size(), std::size(kSizes));
  const std::vector<size_t> order = model.FlatOrder();
  for (uint32_t i = 0; i < opt->params().size(); ++i) {
    EXPECT_EQ(opt->params()[i].name, "t" + std::to_string(order[i]));
    EXPECT_EQ(opt->params()[i].elems, kSizes[order[i]]);
    EXPECT_EQ(opt->param_group(i), kGroupOf[order[i]]);
  }
  EXPECT_EQ(opt->group_hyper(1).lr, kHypers[1].lr);
  EXPECT_EQ(opt->SetGroupHyper(2, kHypers[0]).code(), StatusCode::kOutOfRange);
  EXPECT_EQ(opt->SetGroupHyper(0, {.eps = 0}).code(), StatusCode::kInvalidArgument);
  // Finite in double, not in the fp32 update (NaN params under an OK status).
  for (const GroupHyper& h : {GroupHyper{.lr = 1e39}, GroupHyper{.eps = 1e-50},
                              GroupHyper{.beta2 = 1 - 1e-10}, GroupHyper{.beta1 = 1 - 1e-9},
                              GroupHyper{.weight_decay = 1e39}}) {
    const Status s = opt->SetGroupHyper(0, h);
    EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s;
    EXPECT_NE(s.message().find("fp32"), std::string_view::npos) << s;
  }
  ASSERT_TRUE(opt->SetGroupHyper(0, {.lr = 0.5}).ok());
  EXPECT_EQ(opt->group_hyper(0).lr, 0.5);
  // A field the update does not read need only be finite (a checkpoint
  // keeps it): Lion's eps (eps = 0 was refused, Lion has none), Adagrad's
  // betas; NaN still not, nor what the update reads.
  const GroupHyper nan_eps{.eps = std::numeric_limits<double>::quiet_NaN()};
  EXPECT_TRUE(ValidateGroupHyper({.eps = 0}, "", OptimizerType::kLion).ok());
  EXPECT_EQ(ValidateGroupHyper(nan_eps, "", OptimizerType::kLion).code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(ValidateGroupHyper({.beta1 = 1.0}, "", OptimizerType::kLion).code(),
            StatusCode::kInvalidArgument);
  EXPECT_TRUE(ValidateGroupHyper({.beta1 = 1.0, .beta2 = 5.0}, "", OptimizerType::kAdagrad).ok());
  EXPECT_EQ(ValidateGroupHyper({.eps = 0}, "", OptimizerType::kAdagrad).code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(opt->world_size(), 1);
  EXPECT_EQ(opt->rank(), 0);
  EXPECT_EQ(opt->comm(), nullptr);
  EXPECT_EQ(opt->StateArrayCount(), 3u);
  EXPECT_EQ(opt->shard().elems(), opt->layout().shard_elems);
  std::vector<float> wrong(5);
  EXPECT_EQ(opt->ReadState(0, wrong).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(opt->ReadState(99, wrong).code(), StatusCode::kOutOfRange);
  // WriteState then ReadState round-trips.
  const uint64_t n = opt->sub_groups()[1].elems() * 3;
  std::vector<float> state(n);
  for (uint64_t k = 0; k < n; ++k) state[k] = static_cast<float>(k) * 0.25f;
  ASSERT_TRUE(opt->WriteState(1, state).ok());
  std::vector<float> back(n);
  ASSERT_TRUE(opt->ReadState(1, back).ok());
  EXPECT_EQ(back, state);
  EXPECT_EQ(opt->RestoreCounters(-1, opt->loss_scaler_state()).code(),
            StatusCode::kInvalidArgument);
  ASSERT_TRUE(opt->RestoreCounters(7, opt->loss_scaler_state()).ok());
  EXPECT_EQ(opt->step_count(), 7);
  const std::string line = FormatStepStats(opt->last_step());
  EXPECT_NE(line.find("step 0"), std::string::npos) << line;
  EXPECT_EQ(DefaultGroupHyper(config).lr, config.adam.lr);
}

}  // namespace
}  // namespace strata
