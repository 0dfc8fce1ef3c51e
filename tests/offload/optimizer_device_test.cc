// OffloadOptimizer driven the way a trainer on a GPU must drive it: the
// params and grads live in device memory, and this test reads and writes them
// only through the device API (pinned staging from AllocateHost, CopyAsync on
// the trainer's stream, events, StreamSynchronize), never by dereferencing a
// device pointer. Every case is bitwise against the all-in-memory reference
// (tests/offload/optimizer_test_util.h).
//
// Built twice, like the device conformance suite: offload_optimizer_device_test
// runs it on the host device (label unit), offload_optimizer_device_gpu_test on
// cuda:0 (label gpu; built where the build has CUDA), where every test is
// skipped, visibly, when there is no CUDA device. ctest names a test by its
// gtest name, so each build's instantiations carry its backend as a prefix:
// Host/... and Cuda/... . The host instance adds a fixed latency to every
// copy, so a wait that the engine or the test misses shows up as stale data,
// and it range-checks the device side of every copy (a copy kind that names
// host memory as device memory is refused).
//
// Cases: dtypes bf16/fp32, bf16/bf16 (clipped), fp16/fp16 (dynamic loss
// scaler) and fp32/fp32; partial offload (gpu_fraction 0.5); accumulation of
// two micro-steps; GradReady per tensor in reverse flat order during a
// "backward"; a ZeroGrad / write / Step loop on the trainer's own stream and
// on the "no stream" default (the legacy default stream on CUDA) with no host
// synchronization between them; a NaN skipping an fp16 step; the NVMe tier
// in a real temporary directory; a failed Create's device memory (CUDA).
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <limits>
#include <memory>
#include <optional>
#include <random>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "offload/optimizer.h"
#include "runtime/device.h"
#include "runtime/dtype.h"
#include "runtime/testing/fault_storage.h"
#include "runtime/testing/test_util.h"
#include "runtime/units.h"
#include "tests/offload/optimizer_test_util.h"
#include "tests/offload/test_seed.h"

#ifndef STRATA_TEST_BACKEND
#define STRATA_TEST_BACKEND "host"
#endif
#ifndef STRATA_TEST_GPU
#define STRATA_TEST_GPU 0
#endif
#if STRATA_TEST_GPU
#include <cuda_runtime_api.h>
#endif
static_assert((std::string_view(STRATA_TEST_BACKEND) == "cuda") == (STRATA_TEST_GPU != 0),
              "STRATA_TEST_GPU=1 goes with STRATA_TEST_BACKEND=\"cuda\"");

// INSTANTIATE_TEST_SUITE_P with the build's prefix. The prefix goes through
// one more macro so that it is expanded before gtest pastes and stringifies it.
#if STRATA_TEST_GPU
#define STRATA_BACKEND_PREFIX Cuda
#else
#define STRATA_BACKEND_PREFIX Host
#endif
#define STRATA_INSTANTIATE_WITH_PREFIX(prefix, ...) INSTANTIATE_TEST_SUITE_P(prefix, __VA_ARGS__)
#define STRATA_INSTANTIATE(...) STRATA_INSTANTIATE_WITH_PREFIX(STRATA_BACKEND_PREFIX, __VA_ARGS__)

namespace strata {
namespace {

using testing::FlatStats;
using testing::ReferenceOptimizer;
using testing::TestSeed;

// The installed oneTBB is not instrumented: under TSan the CPU optimizer runs
// on the calling thread only (threads = 1 never enters TBB).
#if defined(__SANITIZE_THREAD__)
constexpr int kCpuThreads = 1;
#else
constexpr int kCpuThreads = 2;
#endif

// optimizer_test.cc's tensors: tensor and group boundaries inside
// sub-groups, a 0-elem tensor, one longer than a sub-group.
const std::vector<uint64_t> kSizes = {1000, 37, 4096, 1, 0, 2500, 777, 64};
const std::vector<uint32_t> kGroupOf = {0, 0, 1, 0, 1, 1, 0, 1};
const std::vector<GroupHyper> kHypers = {
    {.lr = 1e-2, .beta1 = 0.9, .beta2 = 0.999, .eps = 1e-8, .weight_decay = 0.1},
    {.lr = 3e-3, .beta1 = 0.8, .beta2 = 0.99, .eps = 1e-6, .weight_decay = 0.0}};

// Long enough that work the engine failed to order after a copy runs
// before the copy lands; short enough that the suite takes seconds.
constexpr double kHostCopyLatencySec = 300e-6;

Result<std::unique_ptr<Device>> OpenBackend(const std::string& backend) {
  if (backend == "host") return CreateHostDevice({.copy_latency_sec = kHostCopyLatencySec});
  if (backend == "cuda") return CreateCudaDevice(0);
  return InvalidArgumentError("unknown backend " + backend);
}

// The trainer's tensors of one rank in device memory, touched only through
// the Device API, so that the same code is valid on a GPU. Each tensor has
// pinned staging of its own for param writes, grad writes and reads; a write
// waits (an event) for the last copy out of its staging before refilling it,
// and never for anything else, so the engine's ordering is what the test
// sees. The device pointers are handed to the engine and to CopyAsync,
// nothing else.
class DeviceModel {
 public:
  DeviceModel(Device& device, DType param_dtype, DType grad_dtype)
      : device_(device), param_dtype_(param_dtype), grad_dtype_(grad_dtype) {
    for (uint64_t n : kSizes) {
      Tensor& t = tensors_.emplace_back();
      t.elems = n;
      t.data = Must(device.Allocate(std::max<uint64_t>(n, 1) * DTypeSize(param_dtype)));
      t.grad = Must(device.Allocate(std::max<uint64_t>(n, 1) * DTypeSize(grad_dtype)));
      t.param_in = Must(device.AllocateHost(std::max<uint64_t>(n, 1) * DTypeSize(param_dtype)));
      t.grad_in = Must(device.AllocateHost(std::max<uint64_t>(n, 1) * DTypeSize(grad_dtype)));
      t.out = Must(device.AllocateHost(std::max<uint64_t>(n, 1) *
                                       std::max(DTypeSize(param_dtype), DTypeSize(grad_dtype))));
      t.param_in_free = Must(device.CreateEvent());
      t.grad_in_free = Must(device.CreateEvent());
    }
  }
  // Work queued on the device may still use the tensors and the staging (a
  // last ZeroGrad on the trainer's stream): wait for all of it before they
  // are freed.
  ~DeviceModel() {
    const Status s = device_.Synchronize();
    EXPECT_TRUE(s.ok()) << s;
  }
  DeviceModel(const DeviceModel&) = delete;
  DeviceModel& operator=(const DeviceModel&) = delete;

  size_t size() const { return tensors_.size(); }

  // Draws params, copies them up on `stream` (no wait); returns float(param)
  // per tensor, what the master weights start as.
  Result<std::vector<std::vector<float>>> SetParams(std::mt19937_64& rng, StreamRef stream) {
    std::normal_distribution<float> d(0.0f, 1.0f);
    std::vector<std::vector<float>> out;
    for (size_t t = 0; t < size(); ++t) {
      std::vector<float> v(tensors_[t].elems);
      for (float& x : v) x = d(rng);
      STRATA_ASSIGN_OR_RETURN(std::vector<float> back, Write(t, Which::kParam, v, stream));
      out.push_back(std::move(back));
    }
    return out;
  }
  // Copies tensor t's grad up on `stream` (no wait); returns float(grad).
  Result<std::vector<float>> WriteGrad(size_t t, std::span<const float> g, StreamRef stream) {
    return Write(t, Which::kGrad, g, stream);
  }
  Result<std::vector<std::vector<float>>> WriteGrads(const std::vector<std::vector<float>>& g,
                                                     StreamRef stream) {
    std::vector<std::vector<float>> out;
    for (size_t t = 0; t < size(); ++t) {
      STRATA_ASSIGN_OR_RETURN(std::vector<float> back, WriteGrad(t, g[t], stream));
      out.push_back(std::move(back));
    }
    return out;
  }
  std::vector<std::vector<float>> RandomGrads(std::mt19937_64& rng, float stddev) const {
    std::normal_distribution<float> d(0.0f, stddev);
    std::vector<std::vector<float>> g;
    for (const Tensor& t : tensors_) {
      std::vector<float> v(t.elems);
      for (float& x : v) x = d(rng);
      g.push_back(std::move(v));
    }
    return g;
  }

  // The raw bytes of every param (or grad), copied down on `stream` after
  // the work enqueued there, then the stream synchronized.
  Result<std::vector<std::vector<uint8_t>>> ReadParams(StreamRef stream) {
    return Read(Which::kParam, stream);
  }
  Result<std::vector<std::vector<uint8_t>>> ReadGrads(StreamRef stream) {
    return Read(Which::kGrad, stream);
  }

  std::vector<ParamGroup> Groups() const {
    std::vector<ParamGroup> groups(kHypers.size());
    for (size_t g = 0; g < kHypers.size(); ++g) groups[g].hyper = kHypers[g];
    for (size_t t = 0; t < size(); ++t) {
      std::string name = "t";
      name += std::to_string(t);
      groups[kGroupOf[t]].params.push_back({.name = std::move(name),
                                            .data = tensors_[t].data.data(),
                                            .grad = tensors_[t].grad.data(),
                                            .elems = tensors_[t].elems});
    }
    return groups;
  }
  // Tensors in the engine's flat order (groups in order, tensors in order inside).
  static std::vector<size_t> FlatOrder() {
    std::vector<size_t> order;
    for (uint32_t g = 0; g < kHypers.size(); ++g) {
      for (size_t t = 0; t < kSizes.size(); ++t) {
        if (kGroupOf[t] == g) order.push_back(t);
      }
    }
    return order;
  }

 private:
  enum class Which : uint8_t { kParam, kGrad };
  struct Tensor {
    uint64_t elems = 0;
    DeviceBuffer data, grad;            // device memory: never dereferenced here
    HostAllocation param_in, grad_in;   // staging of the copies up
    HostAllocation out;                 // staging of the copies down
    Event param_in_free, grad_in_free;  // the last copy out of param_in / grad_in
  };

  template <typename T>
  static T Must(Result<T> r) {
    STRATA_CHECK_OK(r);
    return *std::move(r);
  }

  Result<std::vector<float>> Write(size_t t, Which which, std::span<const float> values,
                                   StreamRef stream) {
    Tensor& x = tensors_[t];
    const DType dtype = which == Which::kParam ? param_dtype_ : grad_dtype_;
    HostAllocation& staging = which == Which::kParam ? x.param_in : x.grad_in;
    Event& free = which == Which::kParam ? x.param_in_free : x.grad_in_free;
    STRATA_CHECK(values.size() == x.elems) << "tensor " << t;
    STRATA_RETURN_IF_ERROR(device_.EventSynchronize(free));
    std::vector<float> back = testing::StoreAs(values, staging.data(), dtype);
    if (x.elems == 0) return back;
    void* dst = which == Which::kParam ? x.data.data() : x.grad.data();
    STRATA_RETURN_IF_ERROR(device_.CopyAsync(dst, staging.data(), x.elems * DTypeSize(dtype),
                                             CopyKind::kHostToDevice, stream));
    STRATA_RETURN_IF_ERROR(device_.RecordEvent(free, stream));
    return back;
  }

  Result<std::vector<std::vector<uint8_t>>> Read(Which which, StreamRef stream) {
    const DType dtype = which == Which::kParam ? param_dtype_ : grad_dtype_;
    for (Tensor& x : tensors_) {
      if (x.elems == 0) continue;
      const void* src = which == Which::kParam ? x.data.data() : x.grad.data();
      STRATA_RETURN_IF_ERROR(device_.CopyAsync(x.out.data(), src, x.elems * DTypeSize(dtype),
                                               CopyKind::kDeviceToHost, stream));
    }
    STRATA_RETURN_IF_ERROR(device_.StreamSynchronize(stream));
    std::vector<std::vector<uint8_t>> bytes;
    for (const Tensor& x : tensors_) {
      const auto* p = static_cast<const uint8_t*>(x.out.data());
      bytes.emplace_back(p, p + x.elems * DTypeSize(dtype));
    }
    return bytes;
  }

  Device& device_;
  DType param_dtype_, grad_dtype_;
  std::vector<Tensor> tensors_;
};

std::vector<std::vector<float>> Zeros() {
  std::vector<std::vector<float>> z;
  for (uint64_t n : kSizes) z.emplace_back(n, 0.0f);
  return z;
}

// Where two byte strings first differ, for a readable failure.
std::string FirstDifference(const std::vector<uint8_t>& got, const std::vector<uint8_t>& want) {
  if (got.size() != want.size()) {
    return "size " + std::to_string(got.size()) + " != " + std::to_string(want.size());
  }
  size_t n = 0, first = 0;
  for (size_t i = got.size(); i-- > 0;) {
    if (got[i] != want[i]) {
      ++n;
      first = i;
    }
  }
  return std::to_string(n) + " bytes differ, the first at byte " + std::to_string(first);
}

// The engine's params (read on the trainer's stream: Step made it wait for
// the updates) and state against the reference, bit for bit.
void ExpectSameAsReference(OffloadOptimizer& opt, DeviceModel& model, const ReferenceOptimizer& ref,
                           StreamRef trainer) {
  auto params = model.ReadParams(trainer);
  ASSERT_TRUE(params.ok()) << params.status();
  for (size_t t = 0; t < model.size(); ++t) {
    ASSERT_TRUE((*params)[t] == ref.out(t))
        << "params of tensor " << t << ": " << FirstDifference((*params)[t], ref.out(t));
  }
  testing::ExpectStateSameAsReference(opt, DeviceModel::FlatOrder(), ref);
}

struct Case {
  std::string name;
  DType param_dtype = DType::kBF16;
  DType grad_dtype = DType::kF32;
  double max_grad_norm = 0.0;
  double gpu_fraction = 0.0;
};
void PrintTo(const Case& c, std::ostream* os) { *os << c.name; }

// Where the state of the cases parameterized by gpu_fraction lives: all of
// it offloaded (host DRAM or NVMe), or the first half of the sub-groups in
// device memory, updated by the device Adam (partial offload).
const auto kPlacements = ::testing::Values(0.0, 0.5);
std::string PlacementName(const ::testing::TestParamInfo<double>& info) {
  return info.param > 0 ? "half_offloaded" : "all_offloaded";
}

// bf16 params and grads, clipped: the cases that vary the placement alone.
Case ClippedBf16(std::string name, double gpu_fraction) {
  return {.name = std::move(name),
          .param_dtype = DType::kBF16,
          .grad_dtype = DType::kBF16,
          .max_grad_norm = 1.0,
          .gpu_fraction = gpu_fraction};
}

OffloadConfig MakeConfig(const Case& c) {
  OffloadConfig config;
  config.optimizer = OptimizerType::kAdamW;
  config.param_dtype = c.param_dtype;
  config.grad_dtype = c.grad_dtype;
  config.buffer_count = 2;
  config.sub_group_elems = 1024;
  config.max_grad_norm = c.max_grad_norm;
  config.threads = kCpuThreads;
  config.aio.block_bytes = 8192;
  config.gpu_fraction = c.gpu_fraction;
  if (c.param_dtype == DType::kF16) {
    // Grows every 2 good steps, backs off at the first overflow: both show
    // within a few steps.
    config.loss_scaler = {.mode = LossScaleMode::kDynamic,
                          .initial_scale_power = 8,
                          .growth_interval = 2,
                          .hysteresis = 1};
  }
  return config;
}

// The grads a trainer hands over carry the loss scale of the backward.
std::vector<std::vector<float>> ScaledGrads(const DeviceModel& model, const OffloadOptimizer& opt,
                                            std::mt19937_64& rng) {
  return model.RandomGrads(rng, 0.5f * static_cast<float>(opt.loss_scale()));
}

class EngineOnDevice : public ::testing::Test {
 protected:
  void SetUp() override {
    auto dev = OpenBackend(STRATA_TEST_BACKEND);
    if (!dev.ok()) {
      if (std::string(STRATA_TEST_BACKEND) == "cuda" &&
          dev.status().code() == StatusCode::kUnavailable) {
        GTEST_SKIP() << "no CUDA device: " << dev.status();
      }
      FAIL() << dev.status();
    }
    device_ = *std::move(dev);
    ASSERT_EQ(DeviceKindName(device_->caps().kind), STRATA_TEST_BACKEND);
    seed_ = TestSeed();
  }

  Stream NewStream() {
    auto s = device_->CreateStream();
    STRATA_CHECK_OK(s);
    return *std::move(s);
  }
  // The engine opens its own NVMe storage where the config asks for it.
  Result<std::unique_ptr<OffloadOptimizer>> MakeOptimizer(const OffloadConfig& config,
                                                          const DeviceModel& model,
                                                          StreamRef stream) {
    return OffloadOptimizer::Create({.device = device_.get(), .stream = stream}, config,
                                    model.Groups());
  }

  // Sets the model's params on `trainer` (then waits for them when
  // `sync_params`), builds the engine on `engine_stream` and the reference
  // from the same values.
  void Build(DeviceModel& model, const OffloadConfig& config, std::mt19937_64& rng,
             StreamRef trainer, StreamRef engine_stream, bool sync_params,
             std::unique_ptr<OffloadOptimizer>& opt, std::optional<ReferenceOptimizer>& ref) {
    auto master = model.SetParams(rng, trainer);
    ASSERT_TRUE(master.ok()) << master.status();
    if (sync_params) {
      ASSERT_TRUE(device_->StreamSynchronize(trainer).ok());
    }
    auto made = MakeOptimizer(config, model, engine_stream);
    ASSERT_TRUE(made.ok()) << made.status();
    opt = *std::move(made);
    ref.emplace(config, *master, kGroupOf, kHypers);
  }

  std::unique_ptr<Device> device_;
  uint64_t seed_ = 0;
};

// ---- 1, 2: dtypes, clipping, loss scaler, partial offload -------------------

class EngineOnDeviceBitwise : public EngineOnDevice, public ::testing::WithParamInterface<Case> {};

// Three steps of write grads / Step / compare / ZeroGrad, with the trainer
// synchronizing its stream after each write as a careful trainer would; the
// zeroing is read back through the device.
TEST_P(EngineOnDeviceBitwise, ThreeStepsMatchTheReference) {
  const Case& c = GetParam();
  std::mt19937_64 rng(seed_);
  Stream trainer = NewStream();
  DeviceModel model(*device_, c.param_dtype, c.grad_dtype);
  const OffloadConfig config = MakeConfig(c);
  std::unique_ptr<OffloadOptimizer> opt;
  std::optional<ReferenceOptimizer> ref;
  ASSERT_NO_FATAL_FAILURE(Build(model, config, rng, trainer, trainer, true, opt, ref));
  EXPECT_EQ(opt->plan().device_sub_groups > 0, c.gpu_fraction > 0);
  EXPECT_LT(opt->plan().device_sub_groups, opt->sub_groups().size());
  const auto order = DeviceModel::FlatOrder();
  for (int step = 0; step < 3; ++step) {
    SCOPED_TRACE("step " + std::to_string(step));
    auto grads = model.WriteGrads(ScaledGrads(model, *opt, rng), trainer);
    ASSERT_TRUE(grads.ok()) << grads.status();
    ASSERT_TRUE(device_->StreamSynchronize(trainer).ok());
    Status s = opt->Step();
    ASSERT_TRUE(s.ok()) << s;
    const GradStats st = FlatStats(*opt, order, *grads);
    ASSERT_FALSE(ref->Step(*grads, st.sum_sq, st.nonfinite_elems));
    const StepStats& last = opt->last_step();
    EXPECT_FALSE(last.skipped);
    EXPECT_EQ(opt->step_count(), ref->step());
    EXPECT_EQ(opt->loss_scale(), ref->scale());
    if (c.max_grad_norm > 0) {
      EXPECT_LT(last.clip_coef, 1.0f) << "the grads' norm " << last.grad_norm;
    } else {
      EXPECT_EQ(last.clip_coef, 1.0f);
    }
    EXPECT_EQ(last.times.device_adam > 0, c.gpu_fraction > 0);
    ASSERT_NO_FATAL_FAILURE(ExpectSameAsReference(*opt, model, *ref, trainer));
    ASSERT_TRUE(opt->ZeroGrad().ok());
    auto zeroed = model.ReadGrads(trainer);
    ASSERT_TRUE(zeroed.ok()) << zeroed.status();
    for (size_t t = 0; t < model.size(); ++t) {
      EXPECT_TRUE(
          std::all_of((*zeroed)[t].begin(), (*zeroed)[t].end(), [](uint8_t b) { return b == 0; }))
          << "ZeroGrad left tensor " << t;
    }
  }
  if (c.param_dtype == DType::kF16) {
    EXPECT_EQ(opt->loss_scale(), 512.0) << "256, grown after two good steps";
  }
}

STRATA_INSTANTIATE(
    EngineOnDeviceBitwise,
    ::testing::Values(Case{.name = "bf16_params_fp32_grads"},
                      Case{.name = "bf16_params_bf16_grads_clipped",
                           .grad_dtype = DType::kBF16,
                           .max_grad_norm = 1.0},
                      Case{.name = "fp16_params_fp16_grads_scaled",
                           .param_dtype = DType::kF16,
                           .grad_dtype = DType::kF16},
                      Case{.name = "fp32_params_fp32_grads", .param_dtype = DType::kF32},
                      // Partial offload: the first sub-groups updated by the device Adam.
                      Case{.name = "half_offloaded_bf16_fp32", .gpu_fraction = 0.5},
                      Case{.name = "half_offloaded_fp16_fp16_scaled_clipped",
                           .param_dtype = DType::kF16,
                           .grad_dtype = DType::kF16,
                           .max_grad_norm = 1.0,
                           .gpu_fraction = 0.5}),
    [](const ::testing::TestParamInfo<Case>& info) { return info.param.name; });

// ---- 3: gradient accumulation -----------------------------------------------

class EngineOnDeviceAccumulation : public EngineOnDevice,
                                   public ::testing::WithParamInterface<double> {};

// Two micro-steps per step, each handed over with ReduceGradients; the
// second micro-step's grads are written on the trainer's stream right after
// the first's ReduceGradients, with no host wait (the engine's reads of the
// grad tensors are ordered before them). The reference sees the fp32 sum.
TEST_P(EngineOnDeviceAccumulation, TwoMicroStepsMatchTheSummedGradient) {
  const double gpu_fraction = GetParam();
  std::mt19937_64 rng(seed_);
  Stream trainer = NewStream();
  const Case c = ClippedBf16("accumulated", gpu_fraction);
  DeviceModel model(*device_, c.param_dtype, c.grad_dtype);
  const OffloadConfig config = MakeConfig(c);
  std::unique_ptr<OffloadOptimizer> opt;
  std::optional<ReferenceOptimizer> ref;
  ASSERT_NO_FATAL_FAILURE(Build(model, config, rng, trainer, trainer, false, opt, ref));
  ASSERT_EQ(opt->plan().device_sub_groups > 0, gpu_fraction > 0);
  for (int step = 0; step < 3; ++step) {
    SCOPED_TRACE("step " + std::to_string(step));
    std::vector<std::vector<float>> sum;
    for (int micro = 0; micro < 2; ++micro) {
      auto g = model.WriteGrads(model.RandomGrads(rng, 0.5f), trainer);
      ASSERT_TRUE(g.ok()) << g.status();
      if (micro == 0) {
        sum = *g;
      } else {
        for (size_t t = 0; t < sum.size(); ++t) {
          for (size_t k = 0; k < sum[t].size(); ++k) sum[t][k] += (*g)[t][k];
        }
      }
      Status s = opt->ReduceGradients();
      ASSERT_TRUE(s.ok()) << s;
    }
    Status s = opt->Step();
    ASSERT_TRUE(s.ok()) << s;
    EXPECT_EQ(opt->last_step().micro_steps, 2u);
    const GradStats st = FlatStats(*opt, DeviceModel::FlatOrder(), sum);
    ASSERT_FALSE(ref->Step(sum, st.sum_sq, st.nonfinite_elems));
    EXPECT_LT(opt->last_step().clip_coef, 1.0f);
    ASSERT_NO_FATAL_FAILURE(ExpectSameAsReference(*opt, model, *ref, trainer));
    ASSERT_TRUE(opt->ZeroGrad().ok());
  }
}

STRATA_INSTANTIATE(EngineOnDeviceAccumulation, kPlacements, PlacementName);

// ---- 4: GradReady during a backward ----------------------------------------

// A "backward": the last tensor's grad is written first, each reported
// ready right after its copy is enqueued on the trainer's stream (no host
// wait), so the statistics of a sub-group start while later copies are
// still queued. Small sub-groups: most complete before the backward ends.
class EngineOnDeviceBackward : public EngineOnDevice,
                               public ::testing::WithParamInterface<double> {};

TEST_P(EngineOnDeviceBackward, GradReadyInReverseFlatOrderMatchesTheReference) {
  const double gpu_fraction = GetParam();
  std::mt19937_64 rng(seed_);
  Stream trainer = NewStream();
  const Case c = ClippedBf16("backward", gpu_fraction);
  DeviceModel model(*device_, c.param_dtype, c.grad_dtype);
  OffloadConfig config = MakeConfig(c);
  config.sub_group_elems = 300;
  std::unique_ptr<OffloadOptimizer> opt;
  std::optional<ReferenceOptimizer> ref;
  ASSERT_NO_FATAL_FAILURE(Build(model, config, rng, trainer, trainer, false, opt, ref));
  ASSERT_GT(opt->sub_groups().size(), 20u);
  ASSERT_EQ(opt->plan().device_sub_groups > 0, gpu_fraction > 0);
  const auto order = DeviceModel::FlatOrder();
  for (int step = 0; step < 3; ++step) {
    SCOPED_TRACE("step " + std::to_string(step));
    const auto drawn = model.RandomGrads(rng, 0.5f);
    std::vector<std::vector<float>> grads(model.size());
    for (uint32_t i = static_cast<uint32_t>(order.size()); i-- > 0;) {
      const size_t t = order[i];
      auto g = model.WriteGrad(t, drawn[t], trainer);
      ASSERT_TRUE(g.ok()) << g.status();
      grads[t] = *std::move(g);
      Status ready = opt->GradReady(i);
      ASSERT_TRUE(ready.ok()) << "param " << i << ": " << ready;
    }
    Status s = opt->Step();
    ASSERT_TRUE(s.ok()) << s;
    EXPECT_EQ(opt->last_step().micro_steps, 1u);
    const GradStats st = FlatStats(*opt, order, grads);
    ASSERT_FALSE(ref->Step(grads, st.sum_sq, st.nonfinite_elems));
    ASSERT_NO_FATAL_FAILURE(ExpectSameAsReference(*opt, model, *ref, trainer));
    ASSERT_TRUE(opt->ZeroGrad().ok());
  }
}

STRATA_INSTANTIATE(EngineOnDeviceBackward, kPlacements, PlacementName);

// ---- 5: the trainer's stream, and no stream --------------------------------

enum class TrainerStream : uint8_t { kOwn, kNone };
void PrintTo(TrainerStream s, std::ostream* os) {
  *os << (s == TrainerStream::kOwn ? "a stream of its own" : "no stream");
}

class EngineOnDeviceStreams : public EngineOnDevice,
                              public ::testing::WithParamInterface<TrainerStream> {};

// A training loop that never waits on the host between its own work and the
// engine's: the params are written on the trainer's stream just before
// Create, and each step's ZeroGrad, grad writes and Step follow one another
// with no synchronization. Some tensors get no grad in some steps (a param
// the step's forward did not use): they must read as ZeroGrad left them.
// With no stream given the engine orders on Device::DefaultStream() (the
// legacy default stream on CUDA), where this trainer then works.
TEST_P(EngineOnDeviceStreams, ZeroGradWriteStepLoopMatchesTheReference) {
  std::mt19937_64 rng(seed_);
  Stream own = NewStream();
  const bool none = GetParam() == TrainerStream::kNone;
  const StreamRef trainer = none ? device_->DefaultStream() : StreamRef(own);
  const Case c{
      .name = "loop", .param_dtype = DType::kBF16, .grad_dtype = DType::kF32, .max_grad_norm = 1.0};
  DeviceModel model(*device_, c.param_dtype, c.grad_dtype);
  const OffloadConfig config = MakeConfig(c);
  std::unique_ptr<OffloadOptimizer> opt;
  std::optional<ReferenceOptimizer> ref;
  ASSERT_NO_FATAL_FAILURE(
      Build(model, config, rng, trainer, none ? StreamRef{} : trainer, false, opt, ref));
  // A first step leaves non-zero grads behind for ZeroGrad to clear.
  auto first = model.WriteGrads(model.RandomGrads(rng, 0.5f), trainer);
  ASSERT_TRUE(first.ok()) << first.status();
  ASSERT_TRUE(opt->Step().ok());
  {
    const GradStats st = FlatStats(*opt, DeviceModel::FlatOrder(), *first);
    ASSERT_FALSE(ref->Step(*first, st.sum_sq, st.nonfinite_elems));
  }
  for (int step = 1; step < 5; ++step) {
    SCOPED_TRACE("step " + std::to_string(step));
    ASSERT_TRUE(opt->ZeroGrad().ok());
    const auto drawn = model.RandomGrads(rng, 0.5f);
    std::vector<std::vector<float>> grads = Zeros();
    for (size_t t = 0; t < model.size(); ++t) {
      if ((t + step) % 3 == 0) continue;  // unused this step
      auto g = model.WriteGrad(t, drawn[t], trainer);
      ASSERT_TRUE(g.ok()) << g.status();
      grads[t] = *std::move(g);
    }
    Status s = opt->Step();
    ASSERT_TRUE(s.ok()) << s;
    const GradStats st = FlatStats(*opt, DeviceModel::FlatOrder(), grads);
    ASSERT_FALSE(ref->Step(grads, st.sum_sq, st.nonfinite_elems));
    ASSERT_NO_FATAL_FAILURE(ExpectSameAsReference(*opt, model, *ref, trainer));
  }
  EXPECT_EQ(opt->step_count(), 5);
}

STRATA_INSTANTIATE(EngineOnDeviceStreams,
                   ::testing::Values(TrainerStream::kOwn, TrainerStream::kNone),
                   [](const ::testing::TestParamInfo<TrainerStream>& info) {
                     return info.param == TrainerStream::kOwn ? std::string("trainer_stream")
                                                              : std::string("no_stream_default");
                   });

// ---- 6: a NaN skips an fp16 step --------------------------------------------

class EngineOnDeviceNan : public EngineOnDevice, public ::testing::WithParamInterface<double> {};

// fp16 with the dynamic loss scaler: after a clean step, a NaN in one
// tensor's grad skips the step (the scale halves, no param byte and no state
// changes), and the next clean step matches the reference, which skipped too.
// With half the sub-groups on the device the NaN is in one of those.
TEST_P(EngineOnDeviceNan, ANanSkipsTheStepAndTheNextMatchesTheReference) {
  const double gpu_fraction = GetParam();
  std::mt19937_64 rng(seed_);
  Stream trainer = NewStream();
  const Case c{.name = "nan",
               .param_dtype = DType::kF16,
               .grad_dtype = DType::kF16,
               .max_grad_norm = 1.0,
               .gpu_fraction = gpu_fraction};
  DeviceModel model(*device_, c.param_dtype, c.grad_dtype);
  const OffloadConfig config = MakeConfig(c);
  std::unique_ptr<OffloadOptimizer> opt;
  std::optional<ReferenceOptimizer> ref;
  ASSERT_NO_FATAL_FAILURE(Build(model, config, rng, trainer, trainer, false, opt, ref));
  const auto order = DeviceModel::FlatOrder();
  // The NaN: tensor 0 (first in the flat order: a device sub-group when
  // there are any), else tensor 2 (group 1: host sub-groups).
  const size_t nan_tensor = gpu_fraction > 0 ? 0 : 2;
  const uint64_t nan_elem = kSizes[nan_tensor] / 2;
  {
    const uint32_t flat =
        static_cast<uint32_t>(std::find(order.begin(), order.end(), nan_tensor) - order.begin());
    const uint64_t at = opt->layout().tensors[flat].offset_elems + nan_elem;
    uint32_t sg = 0;
    while (!(opt->sub_groups()[sg].begin <= at && at < opt->sub_groups()[sg].end)) ++sg;
    ASSERT_EQ(sg<opt->plan().device_sub_groups, gpu_fraction> 0) << "sub-group " << sg;
  }
  auto step = [&](const std::vector<std::vector<float>>& drawn, bool expect_skip) {
    auto grads = model.WriteGrads(drawn, trainer);
    ASSERT_TRUE(grads.ok()) << grads.status();
    Status s = opt->Step();
    ASSERT_TRUE(s.ok()) << s;
    const GradStats st = FlatStats(*opt, order, *grads);
    EXPECT_EQ(ref->Step(*grads, st.sum_sq, st.nonfinite_elems), expect_skip);
    EXPECT_EQ(opt->last_step().skipped, expect_skip);
    EXPECT_EQ(opt->last_step().nonfinite_elems, expect_skip ? 1u : 0u);
    EXPECT_EQ(opt->loss_scale(), ref->scale());
    ASSERT_TRUE(opt->ZeroGrad().ok());
  };
  ASSERT_NO_FATAL_FAILURE(step(ScaledGrads(model, *opt, rng), false));
  ASSERT_NO_FATAL_FAILURE(ExpectSameAsReference(*opt, model, *ref, trainer));
  ASSERT_EQ(opt->step_count(), 1);

  auto params_before = model.ReadParams(trainer);
  ASSERT_TRUE(params_before.ok()) << params_before.status();
  auto snapshot = [&] {
    std::vector<std::vector<float>> s;
    for (uint32_t i = 0; i < opt->sub_groups().size(); ++i) {
      s.emplace_back(opt->sub_groups()[i].elems() * opt->StateArrayCount());
      Status read = opt->ReadState(i, s.back());
      EXPECT_TRUE(read.ok()) << read;
    }
    return s;
  };
  const auto state_before = snapshot();
  const double scale = opt->loss_scale();
  auto with_nan = ScaledGrads(model, *opt, rng);
  with_nan[nan_tensor][nan_elem] = std::numeric_limits<float>::quiet_NaN();
  ASSERT_NO_FATAL_FAILURE(step(with_nan, true));
  EXPECT_EQ(opt->step_count(), 1);
  EXPECT_EQ(opt->loss_scale(), scale / 2);
  EXPECT_EQ(opt->last_step().write_bytes, 0u);
  EXPECT_EQ(opt->last_step().h2d_bytes, 0u) << "a skipped step uploads no param";
  auto params_after = model.ReadParams(trainer);
  ASSERT_TRUE(params_after.ok()) << params_after.status();
  for (size_t t = 0; t < model.size(); ++t) {
    EXPECT_TRUE((*params_after)[t] == (*params_before)[t])
        << "tensor " << t << " changed in a skipped step: "
        << FirstDifference((*params_after)[t], (*params_before)[t]);
  }
  const auto state_after = snapshot();
  for (uint32_t i = 0; i < state_after.size(); ++i) {
    EXPECT_EQ(std::memcmp(state_after[i].data(), state_before[i].data(),
                          state_after[i].size() * sizeof(float)),
              0)
        << "state of sub-group " << i << " changed in a skipped step";
  }

  ASSERT_NO_FATAL_FAILURE(step(ScaledGrads(model, *opt, rng), false));
  EXPECT_EQ(opt->step_count(), 2);
  ASSERT_NO_FATAL_FAILURE(ExpectSameAsReference(*opt, model, *ref, trainer));
}

STRATA_INSTANTIATE(EngineOnDeviceNan, kPlacements, PlacementName);

// ---- 7: the NVMe tier in a real directory ----------------------------------

// The offloaded state on "NVMe": files in a temporary directory, opened by
// the engine itself (io_uring, or the POSIX pool where refused), as in
// training. Steps read back what earlier ones wrote.
class EngineOnDeviceNvme : public EngineOnDevice, public ::testing::WithParamInterface<double> {};

TEST_P(EngineOnDeviceNvme, RealDirectoryMatchesTheReference) {
  const double gpu_fraction = GetParam();
  std::mt19937_64 rng(seed_);
  testing::TempDir dir;
  ASSERT_TRUE(dir.ok());
  Stream trainer = NewStream();
  const Case c = ClippedBf16("nvme", gpu_fraction);
  DeviceModel model(*device_, c.param_dtype, c.grad_dtype);
  OffloadConfig config = MakeConfig(c);
  config.device = OffloadDevice::kNvme;
  config.nvme_paths = {dir.path()};
  config.host_budget_bytes = 0;  // staging only: every offloaded sub-group on NVMe
  std::unique_ptr<OffloadOptimizer> opt;
  std::optional<ReferenceOptimizer> ref;
  ASSERT_NO_FATAL_FAILURE(Build(model, config, rng, trainer, trainer, false, opt, ref));
  {
    const uint32_t nvme = opt->plan().nvme_sub_groups;
    ASSERT_EQ(opt->plan().device_sub_groups > 0, gpu_fraction > 0);
    ASSERT_EQ(nvme + opt->plan().device_sub_groups, opt->sub_groups().size());
    ASSERT_GT(nvme, config.buffer_count);  // so that some extents are read, not resident
    EXPECT_TRUE(std::filesystem::exists(dir.File("strata-rank0.state")));
    for (int step = 0; step < 3; ++step) {
      SCOPED_TRACE("step " + std::to_string(step));
      auto grads = model.WriteGrads(model.RandomGrads(rng, 0.5f), trainer);
      ASSERT_TRUE(grads.ok()) << grads.status();
      Status s = opt->Step();
      ASSERT_TRUE(s.ok()) << s;
      const GradStats st = FlatStats(*opt, DeviceModel::FlatOrder(), *grads);
      ASSERT_FALSE(ref->Step(*grads, st.sum_sq, st.nonfinite_elems));
      const StepStats& last = opt->last_step();
      EXPECT_GT(last.read_bytes, 0u);
      EXPECT_GT(last.write_bytes, 0u);
      ASSERT_NO_FATAL_FAILURE(ExpectSameAsReference(*opt, model, *ref, trainer));
      ASSERT_TRUE(opt->ZeroGrad().ok());
    }
  }
  opt.reset();
  EXPECT_FALSE(std::filesystem::exists(dir.File("strata-rank0.state")))
      << "the optimizer removes its state file";
}

STRATA_INSTANTIATE(EngineOnDeviceNvme, kPlacements, PlacementName);

// ---- 8: a failed Create gives its device memory back -----------------------

#if STRATA_TEST_GPU
size_t FreeDeviceBytes() {
  size_t free_bytes = 0, total_bytes = 0;
  EXPECT_EQ(cudaMemGetInfo(&free_bytes, &total_bytes), cudaSuccess);
  return free_bytes;
}
#endif

// A Create that fails once it has allocated (its initial NVMe state cannot
// be written) frees its buffers and then hands the allocator's cache back to
// the driver, as a Create that works does with the rate probe's buffers: a
// trainer that keeps the device (torch, a retried Create) finds the memory
// free. On CUDA the engine's pool kept it cached until the device was
// destroyed.
class EngineOnDeviceCreate : public EngineOnDevice, public ::testing::WithParamInterface<double> {};

TEST_P(EngineOnDeviceCreate, AFailedCreateLeavesNoDeviceMemoryCached) {
  // With gpu_fraction 0.5, half the sub-groups keep their 12 bytes of state
  // per element in device memory: 384 MiB on CUDA, far above the driver's
  // granularity.
  const uint64_t elems = STRATA_TEST_GPU ? uint64_t{64} << 20 : uint64_t{1} << 20;
  testing::TestModel model(*device_, {elems / 2, elems / 2}, {0, 0}, DType::kBF16, DType::kBF16);
  OffloadConfig config = MakeConfig(ClippedBf16("failed create", GetParam()));
  config.device = OffloadDevice::kNvme;
  config.nvme_paths = {"/mem/failed-create"};
  config.sub_group_elems = elems / 8;
  ASSERT_TRUE(device_->Synchronize().ok());
#if STRATA_TEST_GPU
  const size_t free_before = FreeDeviceBytes();
#endif
  auto storage = testing::FaultStorage::Create(CreateMemStorage(), {.write_eio_one_in = 1});
  Stream engine = NewStream();
  auto opt = OffloadOptimizer::Create(
      {.device = device_.get(), .storage = storage.get(), .stream = engine}, config,
      model.Groups(std::vector<GroupHyper>{{}}));
  ASSERT_FALSE(opt.ok()) << "every NVMe write fails; Create should have too";
  EXPECT_EQ(opt.status().code(), StatusCode::kInternal) << opt.status();
#if STRATA_TEST_GPU
  const size_t free_after = FreeDeviceBytes();
  EXPECT_GT(free_after + (size_t{64} << 20), free_before)
      << "the failed Create left " << FormatBytes(free_before - free_after)
      << " of device memory cached (free before: " << FormatBytes(free_before) << ")";
#else
  GTEST_SKIP() << "the host device caches no freed memory; the memory check runs on CUDA "
                  "(offload_optimizer_device_gpu_test), the Create's failure was checked here";
#endif
}

STRATA_INSTANTIATE(EngineOnDeviceCreate, ::testing::Values(0.5), PlacementName);

}  // namespace
}  // namespace strata
