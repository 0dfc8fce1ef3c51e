// Conformance suite for Communicator: every backend must pass it. Built
// twice: comm_conformance_test runs the local backend with 1, 2 and 4 ranks
// (plus the rendezvous-file helpers); comm_conformance_gpu_test (ctest label
// `gpu`) runs nccl with 1 rank and is skipped, visibly, without a GPU.
//
// Results are compared against a plain reference below: reduction in rank
// order, fp16/bf16 summed in fp32 and rounded once, integers wrapping.
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <future>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "runtime/comm.h"
#include "runtime/units.h"

#ifndef STRATA_TEST_BACKEND
#define STRATA_TEST_BACKEND "local"
#endif

namespace strata {
namespace {

using ::testing::HasSubstr;
using namespace std::chrono_literals;
using Bytes = std::vector<uint8_t>;

enum class Op { kAllReduce, kReduceScatter, kAllGather };

const char* OpName(Op op) {
  switch (op) {
    case Op::kAllReduce:
      return "all-reduce";
    case Op::kReduceScatter:
      return "reduce-scatter";
    case Op::kAllGather:
      return "all-gather";
  }
  return "?";
}

constexpr DType kAllDTypes[] = {DType::kF32, DType::kF64, DType::kF16, DType::kBF16,
                                DType::kU8,  DType::kI32, DType::kI64};

// ---- the plain reference ----------------------------------------------------

template <typename T>
T Get(const Bytes& b, size_t i) {
  T v;
  std::memcpy(&v, b.data() + i * sizeof(T), sizeof(T));
  return v;
}
template <typename T>
void Put(Bytes& b, size_t i, T v) {
  std::memcpy(b.data() + i * sizeof(T), &v, sizeof(T));
}

// Element i of the reduction of `blocks` (each from rank 0, 1, ...), starting
// at element `first` of every block.
void RefReduceElement(DType dtype, ReduceOp op, const std::vector<Bytes>& blocks, size_t first,
                      size_t i, Bytes& out) {
  const size_t k = first + i;
  const bool sum = op == ReduceOp::kSum;
  auto maxf = [](auto a, auto b) { return (b > a || b != b) ? b : a; };
  switch (dtype) {
    case DType::kF32: {
      float acc = Get<float>(blocks[0], k);
      for (size_t r = 1; r < blocks.size(); ++r)
        acc = sum ? acc + Get<float>(blocks[r], k) : maxf(acc, Get<float>(blocks[r], k));
      return Put(out, i, acc);
    }
    case DType::kF64: {
      double acc = Get<double>(blocks[0], k);
      for (size_t r = 1; r < blocks.size(); ++r)
        acc = sum ? acc + Get<double>(blocks[r], k) : maxf(acc, Get<double>(blocks[r], k));
      return Put(out, i, acc);
    }
    case DType::kF16:
    case DType::kBF16: {
      auto load = [&](size_t r) {
        const uint16_t h = Get<uint16_t>(blocks[r], k);
        return dtype == DType::kF16 ? F16ToF32(h) : BF16ToF32(h);
      };
      float acc = load(0);
      for (size_t r = 1; r < blocks.size(); ++r) acc = sum ? acc + load(r) : maxf(acc, load(r));
      return Put<uint16_t>(out, i, dtype == DType::kF16 ? F32ToF16(acc) : F32ToBF16(acc));
    }
    case DType::kU8: {
      unsigned acc = Get<uint8_t>(blocks[0], k);
      for (size_t r = 1; r < blocks.size(); ++r) {
        const unsigned v = Get<uint8_t>(blocks[r], k);
        acc = sum ? (acc + v) & 0xffu : std::max(acc, v);
      }
      return Put<uint8_t>(out, i, static_cast<uint8_t>(acc));
    }
    case DType::kI32: {
      int64_t acc = Get<int32_t>(blocks[0], k);
      for (size_t r = 1; r < blocks.size(); ++r) {
        const int64_t v = Get<int32_t>(blocks[r], k);
        acc = sum ? static_cast<int32_t>(static_cast<uint32_t>(acc) + static_cast<uint32_t>(v))
                  : std::max(acc, v);
      }
      return Put<int32_t>(out, i, static_cast<int32_t>(acc));
    }
    case DType::kI64: {
      int64_t acc = Get<int64_t>(blocks[0], k);
      for (size_t r = 1; r < blocks.size(); ++r) {
        const int64_t v = Get<int64_t>(blocks[r], k);
        acc = sum ? static_cast<int64_t>(static_cast<uint64_t>(acc) + static_cast<uint64_t>(v))
                  : std::max(acc, v);
      }
      return Put<int64_t>(out, i, acc);
    }
  }
}

// What rank `rank` receives.
Bytes Reference(Op op, DType dtype, ReduceOp rop, const std::vector<Bytes>& sends, size_t count,
                int rank) {
  const size_t es = DTypeSize(dtype);
  const int world = static_cast<int>(sends.size());
  if (op == Op::kAllGather) {
    Bytes out;
    for (int r = 0; r < world; ++r)
      out.insert(out.end(), sends[r].begin(), sends[r].begin() + count * es);
    return out;
  }
  Bytes out(count * es);
  const size_t first = op == Op::kReduceScatter ? rank * count : 0;
  for (size_t i = 0; i < count; ++i) RefReduceElement(dtype, rop, sends, first, i, out);
  return out;
}

Bytes RandomInput(DType dtype, size_t elems, std::mt19937_64& rng) {
  Bytes b(elems * DTypeSize(dtype));
  std::uniform_real_distribution<double> uni(-100.0, 100.0);
  for (size_t i = 0; i < elems; ++i) {
    switch (dtype) {
      case DType::kF32:
        Put<float>(b, i, static_cast<float>(uni(rng)));
        break;
      case DType::kF64:
        Put<double>(b, i, uni(rng));
        break;
      case DType::kF16:
        Put<uint16_t>(b, i, F32ToF16(static_cast<float>(uni(rng) / 16)));
        break;
      case DType::kBF16:
        Put<uint16_t>(b, i, F32ToBF16(static_cast<float>(uni(rng))));
        break;
      case DType::kU8:
        Put<uint8_t>(b, i, static_cast<uint8_t>(rng()));
        break;
      case DType::kI32:
        Put<int32_t>(b, i, static_cast<int32_t>(rng()));
        break;
      case DType::kI64:
        Put<int64_t>(b, i, static_cast<int64_t>(rng()));
        break;
    }
  }
  return b;
}

// ---- the fixture ------------------------------------------------------------

struct CommParam {
  std::string backend;
  int world_size;
};

void PrintTo(const CommParam& p, std::ostream* os) { *os << p.backend << " x" << p.world_size; }

class CommConformance : public ::testing::TestWithParam<CommParam> {
 protected:
  void SetUp() override {
    const CommParam& p = GetParam();
    if (p.backend == "local") {
      auto dev = CreateHostDevice();
      ASSERT_TRUE(dev.ok()) << dev.status();
      device_ = *std::move(dev);
      auto comms = CreateLocalGroup(p.world_size, *device_, {.rendezvous_timeout = 20s});
      ASSERT_TRUE(comms.ok()) << comms.status();
      comms_ = *std::move(comms);
    } else {
      auto dev = CreateCudaDevice(0);
      if (!dev.ok()) GTEST_SKIP() << "no CUDA device: " << dev.status();
      device_ = *std::move(dev);
      auto id = NewNcclUniqueId();
      if (!id.ok()) GTEST_SKIP() << "no NCCL: " << id.status();
      ASSERT_EQ(p.world_size, 1) << "one process drives one nccl rank here";
      auto comm = CreateNcclCommunicator(*id, 0, 1, *device_);
      ASSERT_TRUE(comm.ok()) << comm.status();
      comms_.push_back(*std::move(comm));
    }
    for (int r = 0; r < p.world_size; ++r) {
      auto s = device_->CreateStream();
      ASSERT_TRUE(s.ok()) << s.status();
      streams_.push_back(*std::move(s));
    }
  }

  void TearDown() override {
    comms_.clear();
    streams_.clear();
  }

  int world() const { return GetParam().world_size; }

  // Runs fn(rank) on one thread per rank, as a trainer would.
  void OnEveryRank(const std::function<void(int)>& fn) {
    std::vector<std::thread> threads;
    for (int r = 0; r < world(); ++r) threads.emplace_back(fn, r);
    for (auto& t : threads) t.join();
  }

  // Stages each rank's input in device memory, runs the collective, and
  // returns what each rank received.
  std::vector<Bytes> Run(Op op, DType dtype, ReduceOp rop, const std::vector<Bytes>& sends,
                         size_t count) {
    const size_t es = DTypeSize(dtype);
    const size_t recv_bytes = (op == Op::kAllGather ? count * world() : count) * es;
    std::vector<Bytes> out(world());
    std::vector<Status> status(world());
    OnEveryRank([&](int r) {
      status[r] = [&]() -> Status {
        StreamRef s = streams_[r];
        STRATA_ASSIGN_OR_RETURN(HostAllocation h_send, device_->AllocateHost(sends[r].size()));
        STRATA_ASSIGN_OR_RETURN(HostAllocation h_recv, device_->AllocateHost(recv_bytes));
        STRATA_ASSIGN_OR_RETURN(DeviceBuffer d_send, device_->Allocate(sends[r].size()));
        STRATA_ASSIGN_OR_RETURN(DeviceBuffer d_recv, device_->Allocate(recv_bytes));
        std::memcpy(h_send.data(), sends[r].data(), sends[r].size());
        STRATA_RETURN_IF_ERROR(device_->CopyAsync(d_send.data(), h_send.data(), sends[r].size(),
                                                  CopyKind::kHostToDevice, s));
        Communicator& c = *comms_[r];
        switch (op) {
          case Op::kAllReduce:
            STRATA_RETURN_IF_ERROR(c.AllReduce(d_send.data(), d_recv.data(), count, dtype, rop, s));
            break;
          case Op::kReduceScatter:
            STRATA_RETURN_IF_ERROR(
                c.ReduceScatter(d_send.data(), d_recv.data(), count, dtype, rop, s));
            break;
          case Op::kAllGather:
            STRATA_RETURN_IF_ERROR(c.AllGather(d_send.data(), d_recv.data(), count, dtype, s));
            break;
        }
        STRATA_RETURN_IF_ERROR(device_->CopyAsync(h_recv.data(), d_recv.data(), recv_bytes,
                                                  CopyKind::kDeviceToHost, s));
        STRATA_RETURN_IF_ERROR(device_->StreamSynchronize(s));
        out[r].assign(static_cast<uint8_t*>(h_recv.data()),
                      static_cast<uint8_t*>(h_recv.data()) + recv_bytes);
        return OkStatus();
      }();
    });
    for (int r = 0; r < world(); ++r)
      EXPECT_TRUE(status[r].ok()) << "rank " << r << ": " << status[r];
    return out;
  }

  std::unique_ptr<Device> device_;
  std::vector<std::unique_ptr<Communicator>> comms_;
  std::vector<Stream> streams_;
};

TEST_P(CommConformance, AHealthyCommunicatorSaysSo) {
  for (int r = 0; r < world(); ++r) EXPECT_TRUE(comms_[r]->health().ok()) << "rank " << r;
}

TEST_P(CommConformance, RanksKnowWhoTheyAre) {
  for (int r = 0; r < world(); ++r) {
    EXPECT_EQ(comms_[r]->rank(), r);
    EXPECT_EQ(comms_[r]->world_size(), world());
    EXPECT_EQ(comms_[r]->backend(), GetParam().backend);
    EXPECT_EQ(&comms_[r]->device(), device_.get());
  }
}

TEST_P(CommConformance, EveryCollectiveDTypeAndOpMatchesTheReference) {
  const uint64_t seed = std::random_device{}();
  std::printf("seed=%llu\n", static_cast<unsigned long long>(seed));
  std::mt19937_64 rng(seed);
  constexpr size_t kCount = 1001;
  for (Op op : {Op::kAllReduce, Op::kReduceScatter, Op::kAllGather}) {
    for (DType dtype : kAllDTypes) {
      for (ReduceOp rop : {ReduceOp::kSum, ReduceOp::kMax}) {
        if (op == Op::kAllGather && rop == ReduceOp::kMax) continue;
        SCOPED_TRACE(::testing::Message() << OpName(op) << " " << DTypeName(dtype) << " "
                                          << ReduceOpName(rop) << " seed=" << seed);
        const size_t send_elems = op == Op::kReduceScatter ? kCount * world() : kCount;
        std::vector<Bytes> sends;
        for (int r = 0; r < world(); ++r) sends.push_back(RandomInput(dtype, send_elems, rng));
        std::vector<Bytes> got = Run(op, dtype, rop, sends, kCount);
        for (int r = 0; r < world(); ++r) {
          const Bytes want = Reference(op, dtype, rop, sends, kCount, r);
          ASSERT_EQ(got[r].size(), want.size()) << "rank " << r;
          ASSERT_TRUE(got[r] == want) << "rank " << r << " differs from the reference";
        }
      }
    }
  }
}

TEST_P(CommConformance, CollectivesWorkInPlace) {
  std::mt19937_64 rng(7);
  constexpr size_t kCount = 257;
  const size_t es = sizeof(float);
  std::vector<Bytes> inputs;
  for (int r = 0; r < world(); ++r)
    inputs.push_back(RandomInput(DType::kF32, kCount * world(), rng));
  std::vector<Bytes> all_reduce(world()), reduce_scatter(world()), all_gather(world());
  std::vector<Status> status(world());
  OnEveryRank([&](int r) {
    status[r] = [&]() -> Status {
      StreamRef s = streams_[r];
      const size_t bytes = kCount * world() * es;
      STRATA_ASSIGN_OR_RETURN(HostAllocation h, device_->AllocateHost(bytes));
      STRATA_ASSIGN_OR_RETURN(DeviceBuffer d, device_->Allocate(bytes));
      auto* dp = static_cast<uint8_t*>(d.data());
      auto run = [&](auto&& collective, Bytes& out) -> Status {
        std::memcpy(h.data(), inputs[r].data(), bytes);
        STRATA_RETURN_IF_ERROR(
            device_->CopyAsync(d.data(), h.data(), bytes, CopyKind::kHostToDevice, s));
        STRATA_RETURN_IF_ERROR(collective());
        STRATA_RETURN_IF_ERROR(
            device_->CopyAsync(h.data(), d.data(), bytes, CopyKind::kDeviceToHost, s));
        STRATA_RETURN_IF_ERROR(device_->StreamSynchronize(s));
        out.assign(static_cast<uint8_t*>(h.data()), static_cast<uint8_t*>(h.data()) + bytes);
        return OkStatus();
      };
      Communicator& c = *comms_[r];
      STRATA_RETURN_IF_ERROR(
          run([&] { return c.AllReduce(dp, dp, kCount * world(), DType::kF32, ReduceOp::kSum, s); },
              all_reduce[r]));
      STRATA_RETURN_IF_ERROR(run(
          [&] {
            return c.ReduceScatter(dp, dp + r * kCount * es, kCount, DType::kF32, ReduceOp::kSum,
                                   s);
          },
          reduce_scatter[r]));
      STRATA_RETURN_IF_ERROR(
          run([&] { return c.AllGather(dp + r * kCount * es, dp, kCount, DType::kF32, s); },
              all_gather[r]));
      return OkStatus();
    }();
  });
  for (int r = 0; r < world(); ++r)
    ASSERT_TRUE(status[r].ok()) << "rank " << r << ": " << status[r];
  const Bytes sum =
      Reference(Op::kAllReduce, DType::kF32, ReduceOp::kSum, inputs, kCount * world(), 0);
  for (int r = 0; r < world(); ++r) {
    EXPECT_TRUE(all_reduce[r] == sum) << "rank " << r;
    const Bytes shard =
        Reference(Op::kReduceScatter, DType::kF32, ReduceOp::kSum, inputs, kCount, r);
    EXPECT_EQ(std::memcmp(reduce_scatter[r].data() + r * kCount * es, shard.data(), shard.size()),
              0)
        << "rank " << r;
    std::vector<Bytes> blocks;
    for (int q = 0; q < world(); ++q) {
      blocks.emplace_back(inputs[q].begin() + q * kCount * es,
                          inputs[q].begin() + (q + 1) * kCount * es);
    }
    EXPECT_TRUE(all_gather[r] ==
                Reference(Op::kAllGather, DType::kF32, ReduceOp::kSum, blocks, kCount, r))
        << "rank " << r;
  }
}

TEST_P(CommConformance, BarrierOrdersHostWorkAcrossRanks) {
  std::atomic<int> arrived{0};
  std::vector<int> seen(world(), -1);
  std::vector<Status> status(world());
  OnEveryRank([&](int r) {
    status[r] = [&]() -> Status {
      StreamRef s = streams_[r];
      STRATA_RETURN_IF_ERROR(device_->LaunchHostFunc(s, [&arrived, r] {
        std::this_thread::sleep_for(std::chrono::milliseconds(10 * r));
        arrived.fetch_add(1);
      }));
      STRATA_RETURN_IF_ERROR(comms_[r]->Barrier(s));
      STRATA_RETURN_IF_ERROR(
          device_->LaunchHostFunc(s, [&arrived, &seen, r] { seen[r] = arrived.load(); }));
      return device_->StreamSynchronize(s);
    }();
  });
  for (int r = 0; r < world(); ++r) {
    ASSERT_TRUE(status[r].ok()) << status[r];
    EXPECT_EQ(seen[r], world()) << "rank " << r
                                << " passed the barrier before every rank reached it";
  }
}

TEST_P(CommConformance, CollectivesAreEnqueuedNotRunInline) {
  if (GetParam().backend != "local")
    GTEST_SKIP() << "host-addressable buffers of the local backend";
  // Each rank's stream is blocked by a gate, then a host func writes the
  // input; the all-reduce enqueued behind it must see that input, and the
  // calls must return while the gates are still closed.
  std::vector<std::promise<void>> gates(world());
  std::vector<DeviceBuffer> bufs;
  for (int r = 0; r < world(); ++r) {
    bufs.push_back(*device_->Allocate(16 * sizeof(float)));
    std::memset(bufs[r].data(), 0, 16 * sizeof(float));
  }
  const auto t0 = std::chrono::steady_clock::now();
  OnEveryRank([&](int r) {
    StreamRef s = streams_[r];
    std::shared_future<void> gate = gates[r].get_future().share();
    float* p = bufs[r].as<float>();
    EXPECT_TRUE(device_
                    ->LaunchHostFunc(s,
                                     [gate, p, r] {
                                       gate.wait_for(5s);
                                       for (int i = 0; i < 16; ++i)
                                         p[i] = static_cast<float>(r + 1);
                                     })
                    .ok());
    EXPECT_TRUE(comms_[r]->AllReduce(p, p, 16, DType::kF32, ReduceOp::kSum, s).ok());
  });
  EXPECT_LT(std::chrono::steady_clock::now() - t0, 2s) << "a collective waited for its stream";
  for (auto& g : gates) g.set_value();
  const float want = static_cast<float>(world() * (world() + 1) / 2);
  for (int r = 0; r < world(); ++r) {
    ASSERT_TRUE(device_->StreamSynchronize(streams_[r]).ok());
    for (int i = 0; i < 16; ++i)
      ASSERT_EQ(bufs[r].as<float>()[i], want) << "rank " << r << " element " << i;
  }
}

TEST_P(CommConformance, MismatchedCallsFailOnEveryRank) {
  if (GetParam().backend != "local" || world() < 2) GTEST_SKIP() << "needs 2+ local ranks";
  std::vector<DeviceBuffer> bufs;
  for (int r = 0; r < world(); ++r) bufs.push_back(*device_->Allocate(256));
  std::vector<Status> status(world());
  OnEveryRank([&](int r) {
    StreamRef s = streams_[r];
    Status st =
        comms_[r]->AllReduce(bufs[r].data(), bufs[r].data(), 4 + r, DType::kF32, ReduceOp::kSum, s);
    status[r] = st.ok() ? device_->StreamSynchronize(s) : st;
  });
  for (int r = 0; r < world(); ++r) {
    EXPECT_EQ(status[r].code(), StatusCode::kFailedPrecondition)
        << "rank " << r << ": " << status[r];
    EXPECT_THAT(std::string(status[r].message()), HasSubstr("same count, dtype and op"));
    // The group stays failed, and every rank's communicator says so.
    EXPECT_EQ(comms_[r]->health().code(), StatusCode::kFailedPrecondition) << "rank " << r;
  }
}

TEST_P(CommConformance, AMissingRankTimesOut) {
  if (GetParam().backend != "local" || world() < 2) GTEST_SKIP() << "needs 2+ local ranks";
  auto comms = CreateLocalGroup(world(), *device_, {.rendezvous_timeout = 100ms});
  ASSERT_TRUE(comms.ok());
  EXPECT_TRUE((*comms)[1]->health().ok());
  ASSERT_TRUE((*comms)[0]->Barrier(streams_[0]).ok());
  Status s = device_->StreamSynchronize(streams_[0]);
  EXPECT_EQ((*comms)[1]->health().code(), StatusCode::kUnavailable);
  EXPECT_EQ(s.code(), StatusCode::kUnavailable) << s;
  EXPECT_THAT(std::string(s.message()), HasSubstr("did not arrive within 100 ms"));
  EXPECT_THAT(std::string(s.message()), HasSubstr("rank(s) 1"));
}

TEST_P(CommConformance, RejectsBadArguments) {
  EXPECT_EQ(
      comms_[0]->AllReduce(nullptr, nullptr, 4, DType::kF32, ReduceOp::kSum, streams_[0]).code(),
      StatusCode::kInvalidArgument);
  EXPECT_EQ(comms_[0]->Barrier(StreamRef()).code(), StatusCode::kInvalidArgument);
}

std::vector<CommParam> Params() {
  if (std::string(STRATA_TEST_BACKEND) == "nccl") return {{"nccl", 1}};
  return {{"local", 1}, {"local", 2}, {"local", 4}};
}

INSTANTIATE_TEST_SUITE_P(Backend, CommConformance, ::testing::ValuesIn(Params()),
                         [](const auto& info) {
                           return info.param.backend + "_" + std::to_string(info.param.world_size) +
                                  "ranks";
                         });

#if STRATA_TEST_GPU
// ncclCommInitRank waits for every rank and has no timeout of its own: rank
// 0 of 2, whose peer never calls it, fails after the communicator's timeout
// with what happened, instead of waiting forever.
TEST(NcclCreate, ARankThatNeverJoinsFailsTheOthersAfterTheTimeout) {
  auto dev = CreateCudaDevice(0);
  if (!dev.ok()) GTEST_SKIP() << "no CUDA device: " << dev.status();
  auto id = NewNcclUniqueId();
  if (!id.ok()) GTEST_SKIP() << "no NCCL: " << id.status();
  const auto t0 = std::chrono::steady_clock::now();
  auto comm = CreateNcclCommunicator(*id, 0, 2, **dev, {.timeout = 2s});
  const auto waited = std::chrono::steady_clock::now() - t0;
  ASSERT_FALSE(comm.ok());
  EXPECT_EQ(comm.status().code(), StatusCode::kUnavailable) << comm.status();
  EXPECT_THAT(std::string(comm.status().message()),
              HasSubstr("not every rank joined within 2000 ms"));
  EXPECT_GE(waited, 2s);
  EXPECT_LT(waited, 60s);
}
#endif  // STRATA_TEST_GPU

#if !STRATA_TEST_GPU
// Backend-independent helpers: only in the non-GPU binary.
TEST(LocalGroup, RejectsBadGroups) {
  auto dev = CreateHostDevice();
  ASSERT_TRUE(dev.ok());
  EXPECT_EQ(CreateLocalGroup(0, **dev).status().code(), StatusCode::kInvalidArgument);
  std::vector<Device*> two = {dev->get(), dev->get()};
  auto g = CreateLocalGroup(3, two);
  EXPECT_EQ(g.status().code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(g.status().message()), HasSubstr("2 devices given"));
}

TEST(LocalGroup, RanksMayLiveOnDifferentDevices) {
  auto a = CreateHostDevice();
  auto b = CreateHostDevice();
  ASSERT_TRUE(a.ok() && b.ok());
  std::vector<Device*> devices = {a->get(), b->get()};
  auto comms = CreateLocalGroup(2, devices);
  ASSERT_TRUE(comms.ok()) << comms.status();
  std::vector<Status> status(2);
  std::vector<std::vector<int32_t>> got(2);
  std::vector<std::thread> threads;
  for (int r = 0; r < 2; ++r) {
    threads.emplace_back([&, r] {
      status[r] = [&]() -> Status {
        Device& dev = *devices[r];
        STRATA_ASSIGN_OR_RETURN(Stream s, dev.CreateStream());
        STRATA_ASSIGN_OR_RETURN(DeviceBuffer buf, dev.Allocate(8 * sizeof(int32_t)));
        for (int i = 0; i < 8; ++i) buf.as<int32_t>()[i] = (r + 1) * 100 + i;
        STRATA_RETURN_IF_ERROR(
            (*comms)[r]->AllReduce(buf.data(), buf.data(), 8, DType::kI32, ReduceOp::kMax, s));
        STRATA_RETURN_IF_ERROR(dev.StreamSynchronize(s));
        got[r].assign(buf.as<int32_t>(), buf.as<int32_t>() + 8);
        return OkStatus();
      }();
    });
  }
  for (auto& t : threads) t.join();
  for (int r = 0; r < 2; ++r) {
    ASSERT_TRUE(status[r].ok()) << status[r];
    for (int i = 0; i < 8; ++i) EXPECT_EQ(got[r][i], 200 + i) << "rank " << r;
  }
}

class NcclIdFile : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = std::filesystem::temp_directory_path() /
           ("strata_nccl_id_" + std::to_string(::getpid()) + "_" +
            ::testing::UnitTest::GetInstance()->current_test_info()->name());
    std::filesystem::create_directories(dir_);
  }
  void TearDown() override { std::filesystem::remove_all(dir_); }
  std::filesystem::path dir_;
};

TEST_F(NcclIdFile, RoundTripsThroughAnAtomicWrite) {
  NcclUniqueId id;
  for (size_t i = 0; i < id.bytes.size(); ++i) id.bytes[i] = static_cast<uint8_t>(i * 7 + 3);
  const std::string path = dir_ / "id";
  // The reader starts first and waits for the writer.
  std::thread writer([&] {
    std::this_thread::sleep_for(50ms);
    EXPECT_TRUE(WriteNcclUniqueIdFile(path, id).ok());
  });
  auto got = ReadNcclUniqueIdFile(path, 5s);
  writer.join();
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ(got->bytes, id.bytes);
  // Only the published file remains: no temporary left behind.
  int files = 0;
  for ([[maybe_unused]] const auto& e : std::filesystem::directory_iterator(dir_)) ++files;
  EXPECT_EQ(files, 1);
}

TEST_F(NcclIdFile, MissingFileTimesOutWithAClearError) {
  const std::string path = dir_ / "never";
  const auto t0 = std::chrono::steady_clock::now();
  auto got = ReadNcclUniqueIdFile(path, 100ms);
  EXPECT_GE(std::chrono::steady_clock::now() - t0, 100ms);
  ASSERT_FALSE(got.ok());
  EXPECT_EQ(got.status().code(), StatusCode::kUnavailable);
  EXPECT_THAT(std::string(got.status().message()), HasSubstr(path));
  EXPECT_THAT(std::string(got.status().message()), HasSubstr("did not appear within 100 ms"));
}

TEST_F(NcclIdFile, WrongSizeIsDataLoss) {
  const std::string path = dir_ / "short";
  FILE* f = std::fopen(path.c_str(), "w");
  ASSERT_NE(f, nullptr);
  std::fputs("not an id", f);
  std::fclose(f);
  auto got = ReadNcclUniqueIdFile(path, 1s);
  ASSERT_FALSE(got.ok());
  EXPECT_EQ(got.status().code(), StatusCode::kDataLoss);
  EXPECT_THAT(std::string(got.status().message()), HasSubstr("9 bytes, expected 128"));
}

#endif  // !STRATA_TEST_GPU

}  // namespace
}  // namespace strata
