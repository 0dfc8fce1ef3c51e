// Helpers for the checkpoint tests: optimizers of 1..N ranks (one thread per
// rank, the local communicator) on the host device, deterministic gradients,
// and the optimizer state gathered tensor by tensor so that runs with
// different world sizes compare bit for bit.
#pragma once

#include <gtest/gtest.h>

#include <bit>
#include <cstdint>
#include <fstream>
#include <functional>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "offload/checkpoint.h"
#include "offload/optimizer.h"
#include "offload/placement.h"
#include "runtime/comm.h"
#include "runtime/device.h"
#include "runtime/storage.h"
#include "tests/offload/optimizer_test_util.h"

namespace strata::testing {

enum class Where { kHost, kNvme, kMixed };

// Tensor and group boundaries inside sub-groups, a 0-elem tensor, and a
// tensor longer than a sub-group.
inline const std::vector<uint64_t> kCkptSizes = {1000, 37, 4096, 1, 0, 2500, 777, 64};
inline const std::vector<uint32_t> kCkptGroupOf = {0, 0, 1, 0, 1, 1, 0, 1};
inline const std::vector<GroupHyper> kCkptHypers = {
    {.lr = 1e-2, .beta1 = 0.9, .beta2 = 0.999, .eps = 1e-8, .weight_decay = 0.1},
    {.lr = 3e-3, .beta1 = 0.8, .beta2 = 0.99, .eps = 1e-6, .weight_decay = 0.0}};

inline OffloadConfig CkptConfig(Where where, OptimizerType optimizer = OptimizerType::kAdamW,
                                uint64_t sub_group_elems = 1024, uint32_t world = 1) {
  OffloadConfig config;
  config.optimizer = optimizer;
  config.param_dtype = DType::kBF16;
  config.grad_dtype = DType::kF32;
  config.buffer_count = 2;
  config.sub_group_elems = sub_group_elems;
  config.max_grad_norm = 0.0;  // no global norm: N ranks sum it in another order
  config.threads = 1;
  config.aio.block_bytes = 8192;
  if (where != Where::kHost) {
    config.device = OffloadDevice::kNvme;
    config.nvme_paths = {"/mem/nvme0"};
  }
  if (where == Where::kMixed) {
    // The staging plus about a quarter of the state: some sub-groups stay in
    // DRAM, the others go to NVMe.
    std::vector<TensorSpec> specs;
    for (uint64_t n : kCkptSizes) specs.push_back({.elems = n, .dtype = config.param_dtype});
    FlatLayout layout =
        *PlanFlatLayout(specs, {.align_elems = config.align_elems, .world_size = world});
    auto sgs = *CutSubGroups(*ShardRange(layout, 0), config.sub_group_elems);
    std::vector<uint64_t> sizes;
    for (auto& r : sgs) sizes.push_back(r.elems());
    PlacementInputs in = PlacementInputsFor(config, sizes, world);
    in.host_budget_bytes = 0;  // staging only
    PlacementPlan staging_only = *PlanPlacement(in);
    config.host_budget_bytes = staging_only.host_staging_bytes + staging_only.nvme_state_bytes / 4;
  }
  return config;
}

// Wraps rank r's communicator (a test's fault injection).
using CommWrapper =
    std::function<std::unique_ptr<Communicator>(int rank, std::unique_ptr<Communicator>)>;

// The trainers of `world` ranks: one model, one optimizer and one stream each.
class Cluster {
 public:
  Cluster(int world, const OffloadConfig& config, uint64_t param_seed,
          const std::vector<uint64_t>& sizes = kCkptSizes, const CommWrapper& wrap = {})
      : world_(world) {
    device_ = std::move(*CreateHostDevice());
    if (world > 1) comms_ = std::move(*CreateLocalGroup(world, *device_));
    if (wrap) {
      for (int r = 0; r < static_cast<int>(comms_.size()); ++r)
        comms_[r] = wrap(r, std::move(comms_[r]));
    }
    for (int r = 0; r < world; ++r) {
      storages_.push_back(CreateMemStorage());
      streams_.push_back(std::move(*device_->CreateStream()));
      models_.push_back(std::make_unique<TestModel>(*device_, sizes, kCkptGroupOf,
                                                    config.param_dtype, config.grad_dtype));
      std::mt19937_64 rng(param_seed);  // identical params on every rank
      models_[r]->SetParams(rng);
    }
    opts_.resize(world);
    status_ = Run([&](int r) -> Status {
      STRATA_ASSIGN_OR_RETURN(
          opts_[r], OffloadOptimizer::Create({.device = device_.get(),
                                              .comm = world > 1 ? comms_[r].get() : nullptr,
                                              .storage = storages_[r].get(),
                                              .stream = streams_[r]},
                                             config, models_[r]->Groups(kCkptHypers)));
      return OkStatus();
    });
  }

  // Runs fn(rank) on one thread per rank; the first error, with its rank.
  Status Run(const std::function<Status(int)>& fn) {
    std::vector<Status> status(world_);
    std::vector<std::thread> threads;
    for (int r = 0; r < world_; ++r) {
      threads.emplace_back([&, r] { status[r] = fn(r); });
    }
    for (auto& t : threads) t.join();
    for (int r = 0; r < world_; ++r) {
      if (!status[r].ok()) return status[r].WithContext("rank " + std::to_string(r));
    }
    return OkStatus();
  }

  // `steps` steps; step s gives rank 0 the grads world x G(s) and the others
  // zero, where G has few mantissa bits: the rank-ordered average is exactly
  // G(s), so every world size computes bitwise what one rank computes.
  Status Train(uint64_t grad_seed, int steps) {
    return Run([&](int r) -> Status {
      for (int s = 0; s < steps; ++s) {
        const int64_t step = opts_[r]->step_count() + 1;
        models_[r]->SetGrads(Grads(grad_seed, step, r == 0 ? world_ : 0));
        STRATA_RETURN_IF_ERROR(opts_[r]->Step());
        STRATA_RETURN_IF_ERROR(device_->StreamSynchronize(streams_[r]));
      }
      return OkStatus();
    });
  }

  static std::vector<std::vector<float>> Grads(uint64_t seed, int64_t step, int mult) {
    std::mt19937_64 rng(seed * 1000003 + static_cast<uint64_t>(step));
    std::vector<std::vector<float>> g;
    for (uint64_t n : kCkptSizes) {
      std::vector<float> v(n);
      for (float& x : v) {
        x = static_cast<float>(static_cast<int>(rng() % 64) - 32) / 16.0f *
            static_cast<float>(mult);
      }
      g.push_back(std::move(v));
    }
    return g;
  }

  Status Save(const std::string& dir, const SaveOptions& o = {}) {
    return Run([&](int r) { return SaveCheckpoint(*opts_[r], dir, o); });
  }
  Status Load(const std::string& dir, const LoadOptions& o = {}) {
    return Run([&](int r) -> Status {
      STRATA_RETURN_IF_ERROR(LoadCheckpoint(*opts_[r], dir, o));
      return device_->StreamSynchronize(streams_[r]);
    });
  }

  int world() const { return world_; }
  Status status() const { return status_; }
  OffloadOptimizer& opt(int r) { return *opts_[r]; }
  TestModel& model(int r) { return *models_[r]; }
  Device& device() { return *device_; }

 private:
  int world_;
  std::unique_ptr<Device> device_;
  std::vector<std::unique_ptr<Communicator>> comms_;
  std::vector<std::unique_ptr<Storage>> storages_;
  std::vector<Stream> streams_;
  std::vector<std::unique_ptr<TestModel>> models_;
  std::vector<std::unique_ptr<OffloadOptimizer>> opts_;
  Status status_;
};

// state[array][tensor] in registration (flat) order, as raw bits.
using TensorState = std::vector<std::vector<std::vector<uint32_t>>>;

// The state of every rank, tensor by tensor, plus the step and scaler.
struct Snapshot {
  TensorState state;
  int64_t step = 0;
  LossScalerState scaler;
  std::vector<GroupHyper> hypers;
};

inline Result<Snapshot> TakeSnapshot(Cluster& c) {
  Snapshot snap;
  OffloadOptimizer& o0 = c.opt(0);
  const uint32_t arrays = o0.StateArrayCount();
  snap.state.assign(arrays, {});
  for (uint32_t a = 0; a < arrays; ++a) {
    for (const TensorSlot& t : o0.layout().tensors)
      snap.state[a].emplace_back(t.elems, 0xFFFFFFFFu);
  }
  for (int r = 0; r < c.world(); ++r) {
    OffloadOptimizer& o = c.opt(r);
    for (uint32_t i = 0; i < o.sub_groups().size(); ++i) {
      const ElemRange sg = o.sub_groups()[i];
      std::vector<float> s(sg.elems() * arrays);
      STRATA_RETURN_IF_ERROR(o.ReadState(i, s));
      STRATA_ASSIGN_OR_RETURN(auto pieces, PiecesInRange(o.layout(), sg));
      for (const TensorPiece& p : pieces) {
        for (uint32_t a = 0; a < arrays; ++a) {
          for (uint64_t k = 0; k < p.elems; ++k) {
            snap.state[a][p.tensor][p.tensor_offset_elems + k] =
                std::bit_cast<uint32_t>(s[a * sg.elems() + p.flat_offset_elems - sg.begin + k]);
          }
        }
      }
    }
  }
  snap.step = o0.step_count();
  snap.scaler = o0.loss_scaler_state();
  for (uint32_t g = 0; g < o0.num_groups(); ++g) snap.hypers.push_back(o0.group_hyper(g));
  return snap;
}

inline void ExpectSameSnapshot(const Snapshot& got, const Snapshot& want) {
  EXPECT_EQ(got.step, want.step);
  EXPECT_EQ(got.scaler, want.scaler);
  ASSERT_EQ(got.hypers.size(), want.hypers.size());
  for (size_t g = 0; g < got.hypers.size(); ++g) {
    EXPECT_EQ(got.hypers[g].lr, want.hypers[g].lr) << "group " << g;
    EXPECT_EQ(got.hypers[g].weight_decay, want.hypers[g].weight_decay) << "group " << g;
  }
  ASSERT_EQ(got.state.size(), want.state.size());
  for (size_t a = 0; a < got.state.size(); ++a) {
    for (size_t t = 0; t < got.state[a].size(); ++t) {
      ASSERT_EQ(got.state[a][t], want.state[a][t]) << "array " << a << " tensor " << t;
    }
  }
}

// XORs the byte at `at` in `path` with `mask` (nonzero): always a change,
// whatever the byte held.
inline void FlipBits(const std::string& path, uint64_t at, uint8_t mask) {
  std::fstream io(path, std::ios::in | std::ios::out | std::ios::binary);
  io.seekg(static_cast<std::streamoff>(at));
  char b = 0;
  io.read(&b, 1);
  b = static_cast<char>(b ^ mask);
  io.seekp(static_cast<std::streamoff>(at));
  io.write(&b, 1);
}

// Every rank's param tensors hold the cast of the master weights.
inline void ExpectParamsAreMaster(Cluster& c, const Snapshot& snap) {
  ASSERT_TRUE(c.device().Synchronize().ok());
  const std::vector<size_t> order = c.model(0).FlatOrder();
  const DType dtype = c.opt(0).config().param_dtype;
  for (int r = 0; r < c.world(); ++r) {
    for (size_t i = 0; i < order.size(); ++i) {
      std::vector<float> master(snap.state[0][i].size());
      for (size_t k = 0; k < master.size(); ++k)
        master[k] = std::bit_cast<float>(snap.state[0][i][k]);
      std::vector<uint8_t> want(master.size() * DTypeSize(dtype));
      StoreAs(master, want.data(), dtype);
      ASSERT_EQ(c.model(r).ParamBytes(order[i]), want) << "rank " << r << " tensor " << i;
    }
  }
}

// What the crash test's child process trains and saves (small chunks, so a
// save is many writes and a kill lands between them).
inline OffloadConfig CrashTestConfig() { return CkptConfig(Where::kMixed); }
inline const SaveOptions kCrashTestSave{.chunk_bytes = 4096, .queue_depth = 1};

}  // namespace strata::testing
