// The engine's pipeline as a whole: the overlapped step takes about its
// slowest stage, not the sum of its stages; serial and overlapped modes agree
// bit for bit; several ranks fail Create together; a step whose collective
// fails is retried to the same result.
//
// Overlap: the stages are made slow by sleeping, not by work, so that the test
// holds on a loaded 2-core machine and under TSan: the host device caps the
// H2D link (runtime/device.h) and FaultStorage delays every NVMe request
// (runtime/testing/fault_storage.h). The same optimizer runs steps in
// PipelineMode::kSerial, where the stages run one at a time, as the baseline.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <functional>
#include <map>
#include <memory>
#include <random>
#include <thread>
#include <vector>

#include "offload/optimizer.h"
#include "runtime/testing/fault_comm.h"
#include "runtime/testing/fault_storage.h"
#include "tests/offload/optimizer_test_util.h"
#include "tests/offload/test_seed.h"

namespace strata {
namespace {

using testing::TestModel;
using testing::TestSeed;

#if defined(__SANITIZE_THREAD__)
constexpr int kCpuThreads = 1;  // oneTBB is not instrumented; 1 thread never enters it
#else
constexpr int kCpuThreads = 2;
#endif

constexpr uint32_t kSubGroups = 16;
constexpr uint64_t kSubGroupElems = 4096;
// Each extent is 48 KiB of state + a 4 KiB header: 4 requests of <= 16 KiB,
// each delayed 1.25 ms, so a read or a write takes ~5 ms.
constexpr uint64_t kBlockBytes = 16384;
constexpr auto kRequestLatency = std::chrono::microseconds(1250);
// 8 KiB of bf16 params per sub-group at 800 KiB/s: ~10 ms per upload, about
// what the NVMe read + write of a sub-group take.
constexpr double kH2dBytesPerSec = 800.0 * 1024;

double SumOfStages(const StageTimes& t) {
  return t.d2h + t.comm + t.read + t.adam + t.write + t.h2d + t.device;
}

std::string Describe(const StageTimes& t) {
  return fmt::format(
      "step {:.1f} ms = d2h {:.1f} + comm {:.1f} + read {:.1f} + adam {:.1f} + "
      "write {:.1f} + h2d {:.1f} + device {:.1f} (sum {:.1f} ms)",
      t.step * 1e3, t.d2h * 1e3, t.comm * 1e3, t.read * 1e3, t.adam * 1e3, t.write * 1e3,
      t.h2d * 1e3, t.device * 1e3, SumOfStages(t) * 1e3);
}

TEST(EngineOverlap, StepTakesAboutItsSlowestStageNotTheSum) {
  const uint64_t seed = TestSeed();
  std::mt19937_64 rng(seed);
  auto device = *CreateHostDevice({.h2d_bytes_per_sec = kH2dBytesPerSec});
  auto storage = testing::FaultStorage::Create(
      CreateMemStorage(), {.seed = seed, .latency_one_in = 1, .latency = kRequestLatency});
  // Tensors that do not line up with the sub-groups (in one group), padded to
  // nothing: exactly kSubGroups sub-groups.
  const std::vector<uint64_t> sizes = {20032, 4096, 30016, 11392};  // 16 x 4096, 64-aligned
  TestModel model(*device, sizes, std::vector<uint32_t>(sizes.size(), 0), DType::kBF16,
                  DType::kF32);
  model.SetParams(rng);
  OffloadConfig config;
  config.param_dtype = DType::kBF16;
  config.device = OffloadDevice::kNvme;
  config.nvme_paths = {"/mem/overlap"};
  config.host_budget_bytes = 0;  // staging only: every sub-group on NVMe
  config.sub_group_elems = kSubGroupElems;
  config.buffer_count = 4;
  config.aio.block_bytes = kBlockBytes;
  config.threads = kCpuThreads;
  config.max_grad_norm = 0;
  const std::vector<GroupHyper> hypers = {{.lr = 1e-3}};
  auto opt_or = OffloadOptimizer::Create({.device = device.get(), .storage = storage.get()}, config,
                                         model.Groups(hypers));
  ASSERT_TRUE(opt_or.ok()) << opt_or.status();
  auto opt = std::move(*opt_or);
  ASSERT_EQ(opt->plan().nvme_sub_groups, kSubGroups);

  // Interleaved, best of three of each: load on the machine only makes a
  // step slower, never faster.
  double best_overlapped_ratio = 1e9, best_serial_ratio = 1e9;
  double best_overlapped_step = 1e9, best_serial_step = 1e9;
  for (int round = 0; round < 3; ++round) {
    model.SetGrads(model.RandomGrads(rng, 0.1f));
    for (PipelineMode mode : {PipelineMode::kOverlapped, PipelineMode::kSerial}) {
      opt->SetPipelineMode(mode);
      const Status s = opt->Step();
      ASSERT_TRUE(s.ok()) << s;
      const StageTimes t = opt->last_step().times;
      const bool serial = mode == PipelineMode::kSerial;
      std::printf("%s: %s\n", serial ? "serial    " : "overlapped", Describe(t).c_str());
      // Every stage did its work in both modes.
      EXPECT_GT(t.read, 0.0);
      EXPECT_GT(t.write, 0.0);
      EXPECT_GT(t.h2d, 0.0);
      EXPECT_GT(t.adam, 0.0);
      EXPECT_GT(t.device, 0.0);
      if (serial) {
        best_serial_ratio = std::min(best_serial_ratio, t.step / SumOfStages(t));
        best_serial_step = std::min(best_serial_step, t.step);
      } else {
        best_overlapped_ratio = std::min(best_overlapped_ratio, t.step / SumOfStages(t));
        best_overlapped_step = std::min(best_overlapped_step, t.step);
      }
    }
  }
  // The stages of a serial step do not overlap: its wall time covers them all.
  EXPECT_GE(best_serial_ratio, 0.95);
  // Overlapped: NVMe (~10 ms per sub-group) and H2D (~10 ms) run at once, so
  // the step is ~half the sum of its stages; 0.75 leaves room for a loaded
  // machine.
  EXPECT_LT(best_overlapped_ratio, 0.75);
  EXPECT_LT(best_overlapped_step, 0.75 * best_serial_step);
}

// The timeline of one overlapped step (runtime/trace.h), with every stage
// made slow by sleeping (capped PCIe links both ways, delayed NVMe requests):
// each sub-group's stages are recorded once with the bytes they moved, and
// stages of different sub-groups run at the same time on different
// resources, as the pipeline is designed to. Also the backward overlap: the
// statistics of a sub-group whose grads were all reported during a simulated
// backward are computed before that backward ends.
TEST(EngineTrace, TheTimelineShowsTheStagesOfDifferentSubGroupsOverlapping) {
  const uint64_t seed = TestSeed();
  std::mt19937_64 rng(seed);
  auto device = *CreateHostDevice(
      {.h2d_bytes_per_sec = kH2dBytesPerSec, .d2h_bytes_per_sec = kH2dBytesPerSec});
  auto storage = testing::FaultStorage::Create(
      CreateMemStorage(), {.seed = seed, .latency_one_in = 1, .latency = kRequestLatency});
  const std::vector<uint64_t> sizes = {20032, 4096, 30016, 11392};  // 16 x 4096
  TestModel model(*device, sizes, std::vector<uint32_t>(sizes.size(), 0), DType::kBF16,
                  DType::kBF16);
  model.SetParams(rng);
  OffloadConfig config;
  config.param_dtype = DType::kBF16;
  config.grad_dtype = DType::kBF16;
  config.device = OffloadDevice::kNvme;
  config.nvme_paths = {"/mem/trace"};
  config.host_budget_bytes = 0;
  config.sub_group_elems = kSubGroupElems;
  config.buffer_count = 4;
  config.aio.block_bytes = kBlockBytes;
  config.threads = kCpuThreads;
  auto trace = *TraceRecorder::Create({.steps = 2});
  const std::vector<GroupHyper> hypers = {{.lr = 1e-3}};
  auto opt = *OffloadOptimizer::Create(
      {.device = device.get(), .storage = storage.get(), .trace = trace.get()}, config,
      model.Groups(hypers));
  trace->SetEnabled(true);
  model.SetGrads(model.RandomGrads(rng, 0.1f));
  // Backward: the last tensors' grads come first, some compute between,
  // and more before the last (the earlier sub-groups' statistics must end
  // before it, on a loaded machine and under TSan too).
  for (uint32_t t = sizes.size(); t-- > 0;) {
    std::this_thread::sleep_for(std::chrono::milliseconds(t == 0 ? 200 : 20));
    ASSERT_TRUE(opt->GradReady(t).ok());
  }
  const uint64_t backward_end = TraceRecorder::Now();
  ASSERT_TRUE(opt->Step().ok());
  trace->SetEnabled(false);
  const std::vector<TraceEvent> events = trace->Events();
  ASSERT_EQ(trace->dropped(), 0u);

  std::map<std::pair<TraceTrack, int32_t>, TraceEvent> slice;  // (track, sub-group)
  for (const TraceEvent& e : events) {
    if (e.kind != TraceKind::kSlice || e.sub_group < 0) continue;
    if (std::string_view(e.name) == "grad stats" || e.track != TraceTrack::kDevice) {
      EXPECT_TRUE(slice.emplace(std::make_pair(e.track, e.sub_group), e).second)
          << e.name << " of sub-group " << e.sub_group << " recorded twice";
    }
    EXPECT_EQ(e.step, 1);
    EXPECT_LE(e.begin_ns, e.end_ns);
  }
  // Step 1 takes its NVMe sub-groups last first: the last 4 (one per
  // buffer) are still in their buffers from the initial writes, not read.
  const int32_t resident_from = static_cast<int32_t>(kSubGroups) - 4;
  EXPECT_EQ(opt->last_step().resident_bytes, 4 * opt->last_step().read_bytes / resident_from);
  for (int32_t i = 0; i < static_cast<int32_t>(kSubGroups); ++i) {
    for (TraceTrack t : {TraceTrack::kDevice, TraceTrack::kD2H, TraceTrack::kCpu, TraceTrack::kH2D,
                         TraceTrack::kNvmeWrite}) {
      ASSERT_TRUE(slice.count({t, i})) << TraceTrackName(t) << " of sub-group " << i;
    }
    EXPECT_EQ(slice.count({TraceTrack::kNvmeRead, i}), i < resident_from ? 1u : 0u)
        << "nvme read of sub-group " << i;
    EXPECT_EQ((slice[{TraceTrack::kD2H, i}].bytes), kSubGroupElems * 2);  // bf16 over PCIe
    EXPECT_EQ((slice[{TraceTrack::kH2D, i}].bytes), kSubGroupElems * 2);
  }
  // Sub-groups whose tensors were all reported before the last one had
  // their statistics done before backward ended (sub-groups 0-4 hold part of
  // tensor 0, reported last).
  for (int32_t i = 5; i < static_cast<int32_t>(kSubGroups); ++i) {
    EXPECT_LT((slice[{TraceTrack::kDevice, i}].end_ns), backward_end) << "sub-group " << i;
  }
  // Some stage of one sub-group overlaps another stage of another sub-group,
  // for each pair of resources the pipeline runs side by side.
  auto overlapping = [&](TraceTrack a, TraceTrack b) {
    for (const auto& [ka, ea] : slice) {
      if (ka.first != a) continue;
      for (const auto& [kb, eb] : slice) {
        if (kb.first != b || kb.second == ka.second) continue;
        if (ea.begin_ns < eb.end_ns && eb.begin_ns < ea.end_ns) return true;
      }
    }
    return false;
  };
  EXPECT_TRUE(overlapping(TraceTrack::kD2H, TraceTrack::kCpu));
  EXPECT_TRUE(overlapping(TraceTrack::kCpu, TraceTrack::kH2D));
  EXPECT_TRUE(overlapping(TraceTrack::kD2H, TraceTrack::kH2D));
  EXPECT_TRUE(overlapping(TraceTrack::kNvmeRead, TraceTrack::kH2D));
  EXPECT_TRUE(overlapping(TraceTrack::kNvmeWrite, TraceTrack::kD2H));
  // And the file opens as Chrome trace JSON.
  const std::string path = ::testing::TempDir() + "/engine_trace.json";
  ASSERT_TRUE(trace->WriteChromeTrace(path, R"({"test": "engine"})").ok());
  std::printf("trace: %zu events in %s\n", events.size(), path.c_str());
}

// Both modes give the same params and state, bit for bit.
TEST(EngineOverlap, SerialAndOverlappedStepsAreBitwiseEqual) {
  const uint64_t seed = TestSeed();
  auto device = *CreateHostDevice();
  const std::vector<uint64_t> sizes = {3000, 17, 5000, 999};
  std::vector<std::unique_ptr<TestModel>> models;
  std::vector<std::unique_ptr<Storage>> storages;
  std::vector<std::unique_ptr<OffloadOptimizer>> opts;
  OffloadConfig config;
  config.param_dtype = DType::kBF16;
  config.device = OffloadDevice::kNvme;
  config.nvme_paths = {"/mem/modes"};
  config.host_budget_bytes = 0;
  config.sub_group_elems = 1024;
  config.buffer_count = 3;
  config.aio.block_bytes = 8192;
  config.threads = kCpuThreads;
  const std::vector<GroupHyper> hypers = {{.lr = 1e-2, .weight_decay = 0.1}};
  for (int k = 0; k < 2; ++k) {
    models.push_back(std::make_unique<TestModel>(
        *device, sizes, std::vector<uint32_t>(sizes.size(), 0), DType::kBF16, DType::kF32));
    std::mt19937_64 same(seed);
    models[k]->SetParams(same);
    storages.push_back(CreateMemStorage());
    auto opt_or = OffloadOptimizer::Create({.device = device.get(), .storage = storages[k].get()},
                                           config, models[k]->Groups(hypers));
    ASSERT_TRUE(opt_or.ok()) << opt_or.status();
    opts.push_back(std::move(*opt_or));
  }
  opts[1]->SetPipelineMode(PipelineMode::kSerial);
  std::mt19937_64 rng(seed + 1);
  for (int step = 0; step < 3; ++step) {
    const auto grads = models[0]->RandomGrads(rng, 0.5f);
    // Alternate the second optimizer's mode: a mode switch between steps is fine.
    opts[1]->SetPipelineMode(step % 2 == 0 ? PipelineMode::kSerial : PipelineMode::kOverlapped);
    for (int k = 0; k < 2; ++k) {
      models[k]->SetGrads(grads);
      const Status s = opts[k]->Step();
      ASSERT_TRUE(s.ok()) << s;
      ASSERT_TRUE(device->Synchronize().ok());
    }
  }
  for (size_t t = 0; t < sizes.size(); ++t) {
    EXPECT_EQ(models[0]->ParamBytes(t), models[1]->ParamBytes(t)) << "tensor " << t;
  }
  for (uint32_t i = 0; i < opts[0]->sub_groups().size(); ++i) {
    const uint64_t n = opts[0]->sub_groups()[i].elems() * opts[0]->StateArrayCount();
    std::vector<float> a(n), b(n);
    ASSERT_TRUE(opts[0]->ReadState(i, a).ok());
    ASSERT_TRUE(opts[1]->ReadState(i, b).ok());
    EXPECT_EQ(0, std::memcmp(a.data(), b.data(), n * 4)) << "sub-group " << i;
  }
}

// A rank whose Create fails makes every rank's Create fail, promptly: no
// rank is left waiting for it in the first collective of Step. The
// rendezvous timeout is short so that a hang would show as a failure here.
enum class FailAt : uint8_t { kPlan, kStateWrite };

void RunCreateFailsOnOneRank(FailAt fail_at) {
  const bool fail_in_plan = fail_at == FailAt::kPlan;
  constexpr int kWorld = 2;
  auto device = *CreateHostDevice();
  auto comms = *CreateLocalGroup(kWorld, *device, {.rendezvous_timeout = std::chrono::seconds(20)});
  const std::vector<uint64_t> sizes = {3000, 5000};
  std::vector<std::unique_ptr<TestModel>> models;
  std::vector<std::unique_ptr<Storage>> storages;
  std::vector<Stream> streams;
  OffloadConfig config;
  config.param_dtype = DType::kBF16;
  config.device = OffloadDevice::kNvme;
  config.nvme_paths = {"/mem/agree"};
  config.sub_group_elems = 1024;
  config.aio.block_bytes = 8192;
  config.threads = kCpuThreads;
  for (int r = 0; r < kWorld; ++r) {
    models.push_back(std::make_unique<TestModel>(*device, sizes, std::vector<uint32_t>{0, 0},
                                                 DType::kBF16, DType::kF32));
    streams.push_back(*device->CreateStream());
  }
  storages.push_back(CreateMemStorage());
  // Rank 1: an impossible budget (the plan refuses), or a drive that fails
  // every write (the initial state cannot be written).
  storages.push_back(fail_in_plan ? CreateMemStorage()
                                  : std::unique_ptr<Storage>(testing::FaultStorage::Create(
                                        CreateMemStorage(), {.write_eio_one_in = 1})));
  std::vector<Status> status(kWorld);
  std::vector<std::thread> threads;
  const auto t0 = std::chrono::steady_clock::now();
  for (int r = 0; r < kWorld; ++r) {
    threads.emplace_back([&, r] {
      OffloadConfig c = config;
      if (r == 1 && fail_in_plan) c.host_budget_bytes = 4096;
      status[r] = OffloadOptimizer::Create({.device = device.get(),
                                            .comm = comms[r].get(),
                                            .storage = storages[r].get(),
                                            .stream = streams[r]},
                                           c, models[r]->Groups(std::vector<GroupHyper>{{}}))
                      .status();
    });
  }
  for (auto& t : threads) t.join();
  const double sec = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  std::printf("rank 0: %s\nrank 1: %s\n", status[0].ToString().c_str(),
              status[1].ToString().c_str());
  EXPECT_LT(sec, 10.0) << "a rank waited for the rendezvous timeout";
  EXPECT_EQ(status[1].code(),
            fail_in_plan ? StatusCode::kResourceExhausted : StatusCode::kInternal);
  EXPECT_EQ(status[0].code(), StatusCode::kFailedPrecondition) << status[0];
  EXPECT_NE(status[0].message().find("another rank failed to create its optimizer"),
            std::string::npos)
      << status[0];
}

// Ranks that register differently are refused at Create on every rank, naming
// the part that differs (it used to compare sizes and dtype only: the same
// sizes under other names, or in other groups, trained silently mixed).
TEST(EngineCreate, RanksThatRegisterDifferentlyAreToldWhatDiffers) {
  struct Case {
    std::string differs;
    std::function<void(std::vector<ParamGroup>&, OffloadConfig&)> change;  // rank 1's
  };
  const std::vector<Case> cases = {
      {"the tensors' sizes or dtype",
       [](std::vector<ParamGroup>& g, OffloadConfig&) { g[0].params[1].elems -= 8; }},
      {"the tensors' names",
       [](std::vector<ParamGroup>& g, OffloadConfig&) {
         std::swap(g[0].params[0].name, g[0].params[1].name);
       }},
      {"which tensor is in which param group",
       [](std::vector<ParamGroup>& g, OffloadConfig&) {
         g[1].params.insert(g[1].params.begin(), g[0].params.back());
         g[0].params.pop_back();
       }},
      {"the sub-groups (sub_group_size)",
       [](std::vector<ParamGroup>&, OffloadConfig& c) { c.sub_group_elems = 2048; }},
      // These two used to pass Create and mismatch the collectives of a step.
      {"the sub-groups kept on the device",
       [](std::vector<ParamGroup>&, OffloadConfig& c) { c.gpu_fraction = 0.5; }},
      {"the sub-groups kept on the device (gpu_fraction, device_budget) or the gradient dtypes",
       [](std::vector<ParamGroup>&, OffloadConfig& c) { c.comm_dtype = DType::kBF16; }},
  };
  constexpr int kWorld = 2;
  for (const Case& k : cases) {
    SCOPED_TRACE(k.differs);
    auto device = *CreateHostDevice();
    auto comms =
        *CreateLocalGroup(kWorld, *device, {.rendezvous_timeout = std::chrono::seconds(20)});
    std::vector<std::unique_ptr<TestModel>> models;
    std::vector<std::unique_ptr<Storage>> storages;
    std::vector<Stream> streams;
    for (int r = 0; r < kWorld; ++r) {
      models.push_back(std::make_unique<TestModel>(*device, std::vector<uint64_t>{3000, 3000, 5000},
                                                   std::vector<uint32_t>{0, 0, 1}, DType::kBF16,
                                                   DType::kF32));
      storages.push_back(CreateMemStorage());
      streams.push_back(*device->CreateStream());
    }
    std::vector<Status> status(kWorld);
    std::vector<std::thread> threads;
    for (int r = 0; r < kWorld; ++r) {
      threads.emplace_back([&, r] {
        OffloadConfig c;
        c.param_dtype = DType::kBF16;
        c.sub_group_elems = 1024;
        c.threads = kCpuThreads;
        std::vector<ParamGroup> groups = models[r]->Groups(std::vector<GroupHyper>{{}, {}});
        if (r == 1) k.change(groups, c);
        status[r] = OffloadOptimizer::Create({.device = device.get(),
                                              .comm = comms[r].get(),
                                              .storage = storages[r].get(),
                                              .stream = streams[r]},
                                             c, groups)
                        .status();
      });
    }
    for (auto& t : threads) t.join();
    for (int r = 0; r < kWorld; ++r) {
      EXPECT_EQ(status[r].code(), StatusCode::kInvalidArgument) << status[r];
      EXPECT_NE(
          status[r].message().find(fmt::format(
              "rank {} registered tensors that differ from another rank's in {}", r, k.differs)),
          std::string::npos)
          << status[r];
    }
  }
}

TEST(EngineCreate, PlanRefusedOnOneRankFailsEveryRank) { RunCreateFailsOnOneRank(FailAt::kPlan); }
TEST(EngineCreate, StateWriteFailingOnOneRankFailsEveryRank) {
  RunCreateFailsOnOneRank(FailAt::kStateWrite);
}

}  // namespace
}  // namespace strata

namespace strata {
namespace {

// Two ranks on one host device, each with a FaultComm over the local group.
class TwoRanks {
 public:
  static constexpr int kWorld = 2;
  explicit TwoRanks(uint64_t seed) {
    device_ = *CreateHostDevice({.h2d_bytes_per_sec = 256.0 * 1024});  // 2 KiB: ~8 ms
    auto comms =
        *CreateLocalGroup(kWorld, *device_, {.rendezvous_timeout = std::chrono::seconds(20)});
    OffloadConfig config;
    config.param_dtype = DType::kBF16;
    config.sub_group_elems = 1024;
    config.buffer_count = 4;
    config.threads = kCpuThreads;
    const std::vector<uint64_t> sizes = {3000, 5000};
    for (int r = 0; r < kWorld; ++r) {
      faults_.push_back(std::make_unique<testing::FaultComm>(std::move(comms[r])));
      models_.push_back(std::make_unique<TestModel>(*device_, sizes, std::vector<uint32_t>{0, 0},
                                                    DType::kBF16, DType::kF32));
      std::mt19937_64 same(seed);
      models_[r]->SetParams(same);
      storages_.push_back(CreateMemStorage());
      streams_.push_back(*device_->CreateStream());
    }
    opts_.resize(kWorld);
    status_ = OnEveryRank([&](int r) -> Status {
      STRATA_ASSIGN_OR_RETURN(
          opts_[r],
          OffloadOptimizer::Create({.device = device_.get(),
                                    .comm = faults_[r].get(),
                                    .storage = storages_[r].get(),
                                    .stream = streams_[r]},
                                   config, models_[r]->Groups(std::vector<GroupHyper>{{}})));
      return OkStatus();
    });
  }
  // fn(rank) on a thread per rank; the status of each.
  std::vector<Status> OnEveryRank(const std::function<Status(int)>& fn) {
    std::vector<Status> status(kWorld);
    std::vector<std::thread> threads;
    for (int r = 0; r < kWorld; ++r) threads.emplace_back([&, r] { status[r] = fn(r); });
    for (auto& t : threads) t.join();
    return status;
  }
  std::vector<Status> create_status() const { return status_; }
  testing::FaultComm& fault(int r) { return *faults_[r]; }
  TestModel& model(int r) { return *models_[r]; }
  // Grads of their own on every rank.
  void SetRandomGrads(std::mt19937_64& rng) {
    for (auto& m : models_) m->SetGrads(m->RandomGrads(rng, 0.5f));
  }
  OffloadOptimizer& opt(int r) { return *opts_[r]; }
  void DestroyOptimizers() { opts_.clear(); }

 private:
  std::unique_ptr<Device> device_;
  std::vector<std::unique_ptr<testing::FaultComm>> faults_;
  std::vector<std::unique_ptr<TestModel>> models_;
  std::vector<std::unique_ptr<Storage>> storages_;
  std::vector<Stream> streams_;
  std::vector<std::unique_ptr<OffloadOptimizer>> opts_;
  std::vector<Status> status_;
};

// A step that fails while params go up (the communicator breaks at the
// second sub-group's all-gather) fails on every rank, naming the broken call;
// the trainer then zeroes its grads, and RetryStep gives bitwise the params
// and state of a step that never failed. Destroying the optimizers at once is
// safe.
TEST(EngineFailure, AStepWhoseAllGatherFailsIsRetriedToTheSameResult) {
  const uint64_t seed = TestSeed();
  TwoRanks failing(seed), clean(seed);
  for (int r = 0; r < TwoRanks::kWorld; ++r) {
    ASSERT_TRUE(failing.create_status()[r].ok()) << failing.create_status()[r];
    ASSERT_TRUE(clean.create_status()[r].ok()) << clean.create_status()[r];
  }
  std::mt19937_64 rng(seed + 1);
  for (int r = 0; r < TwoRanks::kWorld; ++r) {
    const auto grads = failing.model(r).RandomGrads(rng, 0.5f);
    failing.model(r).SetGrads(grads);
    clean.model(r).SetGrads(grads);
  }
  for (const Status& s : clean.OnEveryRank([&](int r) { return clean.opt(r).Step(); })) {
    ASSERT_TRUE(s.ok()) << s;
  }
  for (int r = 0; r < TwoRanks::kWorld; ++r)
    failing.fault(r).Fail(testing::CommCall::kAllGather, 1);
  for (const Status& s : failing.OnEveryRank([&](int r) { return failing.opt(r).Step(); })) {
    EXPECT_FALSE(s.ok());
    EXPECT_NE(s.message().find("the communicator broke"), std::string::npos) << s;
  }
  for (int r = 0; r < TwoRanks::kWorld; ++r) {
    failing.model(r).SetGrads(std::vector<std::vector<float>>{std::vector<float>(3000, 0.0f),
                                                              std::vector<float>(5000, 0.0f)});
  }
  for (const Status& s : failing.OnEveryRank([&](int r) { return failing.opt(r).RetryStep(); })) {
    ASSERT_TRUE(s.ok()) << s;
  }
  for (int r = 0; r < TwoRanks::kWorld; ++r) {
    SCOPED_TRACE("rank " + std::to_string(r));
    for (size_t t = 0; t < 2; ++t) {
      EXPECT_EQ(failing.model(r).ParamBytes(t), clean.model(r).ParamBytes(t)) << "tensor " << t;
    }
    OffloadOptimizer& a = failing.opt(r);
    for (uint32_t i = 0; i < a.sub_groups().size(); ++i) {
      const uint64_t n = a.sub_groups()[i].elems() * a.StateArrayCount();
      std::vector<float> x(n), y(n);
      ASSERT_TRUE(a.ReadState(i, x).ok());
      ASSERT_TRUE(clean.opt(r).ReadState(i, y).ok());
      EXPECT_EQ(0, std::memcmp(x.data(), y.data(), n * 4)) << "sub-group " << i;
    }
  }
  failing.DestroyOptimizers();
}

// A step that fails part way on a communicator that then stops for good
// (NCCL's watchdog aborted it; a local group that failed): RetryStep() and
// every call FailedStepError answers say to rebuild, not to retry.
TEST(EngineFailure, AFailedStepOnAStoppedCommunicatorIsNotOfferedARetry) {
  const uint64_t seed = TestSeed();
  TwoRanks ranks(seed);
  for (const Status& s : ranks.create_status()) ASSERT_TRUE(s.ok()) << s;
  std::mt19937_64 rng(seed + 1);
  ranks.SetRandomGrads(rng);
  for (int r = 0; r < TwoRanks::kWorld; ++r) ranks.fault(r).Fail(testing::CommCall::kAllGather, 1);
  for (const Status& s : ranks.OnEveryRank([&](int r) { return ranks.opt(r).Step(); })) {
    ASSERT_FALSE(s.ok());
  }
  for (int r = 0; r < TwoRanks::kWorld; ++r) {
    ASSERT_EQ(ranks.opt(r).step_state(), StepState::kFailed);
    ranks.fault(r).Stop(UnavailableError("nccl rank 0/2 on cuda:0: all-gather timed out"));
    for (Status s : {ranks.opt(r).RetryStep(), ranks.opt(r).Step(), ranks.opt(r).GradReady(0)}) {
      EXPECT_EQ(s.code(), StatusCode::kUnavailable) << s;
      EXPECT_NE(s.message().find("all-gather timed out"), std::string::npos) << s;
      EXPECT_NE(s.message().find("RetryStep() cannot finish the step"), std::string::npos) << s;
      EXPECT_NE(s.message().find("load the last checkpoint"), std::string::npos) << s;
    }
  }
  ranks.DestroyOptimizers();
}

// Ranks at different steps (one restored its counters alone, as a lone
// checkpoint or state_dict load does) or with different update settings (an
// lr changed on one rank) used to step on, each shard under its own rank's
// values. Now the step fails on every rank before anything is updated.
TEST(EngineFailure, RanksAtDifferentStepsOrSettingsRefuseTheStepOnEveryRank) {
  for (const std::string what : {"step", "lr"}) {
    SCOPED_TRACE(what);
    const uint64_t seed = TestSeed();
    TwoRanks ranks(seed);
    for (const Status& s : ranks.create_status()) ASSERT_TRUE(s.ok()) << s;
    std::mt19937_64 rng(seed + 1);
    ranks.SetRandomGrads(rng);
    if (what == "step") {
      OffloadOptimizer& o = ranks.opt(1);
      ASSERT_TRUE(o.RestoreCounters(5, o.loss_scaler_state()).ok());
    } else {
      ASSERT_TRUE(ranks.opt(1).SetGroupHyper(0, {.lr = 0.5}).ok());
    }
    std::vector<std::vector<std::vector<float>>> before(TwoRanks::kWorld);
    std::vector<std::vector<uint8_t>> params_before;
    for (int r = 0; r < TwoRanks::kWorld; ++r) {
      OffloadOptimizer& o = ranks.opt(r);
      for (uint32_t i = 0; i < o.sub_groups().size(); ++i) {
        before[r].emplace_back(o.sub_groups()[i].elems() * o.StateArrayCount());
        ASSERT_TRUE(o.ReadState(i, before[r].back()).ok());
      }
      for (size_t t = 0; t < 2; ++t) params_before.push_back(ranks.model(r).ParamBytes(t));
    }
    const std::vector<Status> status =
        ranks.OnEveryRank([&](int r) { return ranks.opt(r).Step(); });
    for (int r = 0; r < TwoRanks::kWorld; ++r) {
      SCOPED_TRACE("rank " + std::to_string(r));
      EXPECT_EQ(status[r].code(), StatusCode::kFailedPrecondition) << status[r];
      const std::string expected =
          what == "step" ? fmt::format("rank {} is at step {}, and another rank at a different one",
                                       r, r == 0 ? 1 : 6)
                         : fmt::format("rank {}'s update settings differ from another rank's", r);
      EXPECT_NE(status[r].message().find(expected), std::string::npos) << status[r];
      EXPECT_NE(status[r].message().find("Nothing was updated"), std::string::npos) << status[r];
      OffloadOptimizer& o = ranks.opt(r);
      EXPECT_FALSE(o.step_state() == StepState::kFailed) << "failed before the update";
      for (uint32_t i = 0; i < o.sub_groups().size(); ++i) {
        std::vector<float> now(before[r][i].size());
        ASSERT_TRUE(o.ReadState(i, now).ok());
        EXPECT_EQ(0, std::memcmp(now.data(), before[r][i].data(), now.size() * 4))
            << "sub-group " << i;
      }
      for (size_t t = 0; t < 2; ++t) {
        EXPECT_EQ(ranks.model(r).ParamBytes(t), params_before[r * 2 + t]) << "tensor " << t;
      }
    }
    if (what != "step") continue;
    // Every rank loads (the counters of step 0) and runs a new backward: the
    // step takes the new gradients, as a run that never saw the refused
    // step does. The reductions of the refused step's hand-over used to stay
    // and be taken instead.
    for (int r = 0; r < TwoRanks::kWorld; ++r) {
      OffloadOptimizer& o = ranks.opt(r);
      ASSERT_TRUE(o.RestoreCounters(0, o.loss_scaler_state()).ok());
    }
    ranks.SetRandomGrads(rng);
    for (const Status& s : ranks.OnEveryRank([&](int r) { return ranks.opt(r).Step(); })) {
      ASSERT_TRUE(s.ok()) << s;
    }
    TwoRanks clean(seed);
    std::mt19937_64 same(seed + 1);
    clean.SetRandomGrads(same);  // the refused step's
    clean.SetRandomGrads(same);
    for (const Status& s : clean.OnEveryRank([&](int r) { return clean.opt(r).Step(); })) {
      ASSERT_TRUE(s.ok()) << s;
    }
    for (int r = 0; r < TwoRanks::kWorld; ++r) {
      for (size_t t = 0; t < 2; ++t) {
        EXPECT_EQ(ranks.model(r).ParamBytes(t), clean.model(r).ParamBytes(t))
            << "rank " << r << " tensor " << t;
      }
    }
  }
}

}  // namespace
}  // namespace strata
