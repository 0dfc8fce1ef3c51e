// The gradient path alone (offload/grad_path.h), on the host device with one
// rank: statistics as defined piece by piece, the D2H of a sub-group into a
// ring slot (bytes as the trainer holds them, padding zero), accumulation in
// fp32, and gradients kept across the trainer's zeroing.
#include "offload/grad_path.h"

#include <gtest/gtest.h>

#include <cstring>
#include <limits>
#include <random>

#include "kernels/kernels.h"
#include "tests/offload/optimizer_test_util.h"
#include "tests/offload/test_seed.h"

namespace strata::internal {
namespace {

using strata::testing::TestModel;

struct Fixture {
  explicit Fixture(DType grad_dtype) : grad_dtype(grad_dtype) {
    device = *CreateHostDevice();
    model = std::make_unique<TestModel>(*device, sizes, std::vector<uint32_t>(sizes.size(), 0),
                                        DType::kBF16, grad_dtype);
    for (const ParamGroup& g : model->Groups(std::vector<GroupHyper>{{}})) {
      for (const Param& p : g.params) params.push_back(p);
    }
    std::vector<TensorSpec> specs;
    for (uint64_t n : sizes) specs.push_back({.elems = n});
    layout = *PlanFlatLayout(specs, {.align_elems = 64});
    shard = *ShardRange(layout, 0);
    sub_groups = *CutSubGroups(shard, 1000);
    map = *TensorMap::Build({.layout = &layout,
                             .shard = shard,
                             .sub_groups = sub_groups,
                             .params = params,
                             .grad_dtype = grad_dtype,
                             .param_dtype = DType::kBF16});
    stream = *device->CreateStream();
    path = *GradPath::Create({.device = device.get(),
                              .stream = stream,
                              .user_stream = device->DefaultStream(),
                              .map = &map,
                              .params = &params,
                              .sub_groups = sub_groups,
                              .shard = shard,
                              .grad_dtype = grad_dtype,
                              .slots = 2,
                              .trace = &trace});
  }
  // Sizes that leave padding inside sub-groups (64-element alignment).
  const std::vector<uint64_t> sizes = {1500, 37, 800, 1};
  DType grad_dtype;
  std::unique_ptr<Device> device;
  std::unique_ptr<TestModel> model;
  std::vector<Param> params;
  FlatLayout layout;
  ElemRange shard;
  std::vector<ElemRange> sub_groups;
  TensorMap map;
  Stream stream;
  TraceContext trace;
  std::unique_ptr<GradPath> path;
};

std::vector<size_t> Identity(size_t n) {
  std::vector<size_t> v(n);
  for (size_t i = 0; i < n; ++i) v[i] = i;
  return v;
}

// The expected host image of sub-group i: the trainer's grad bytes at each
// piece, zero elsewhere.
std::vector<uint8_t> Image(const Fixture& f, uint32_t i) {
  const size_t b = DTypeSize(f.grad_dtype);
  std::vector<uint8_t> out(f.sub_groups[i].elems() * b, 0);
  for (const TensorMap::Piece& p : f.map.own(i)) {
    const std::vector<uint8_t> g = f.model->GradBytes(p.tensor);
    std::memcpy(out.data() + p.offset_elems * b, g.data() + p.tensor_offset_elems * b,
                p.elems * b);
  }
  return out;
}

TEST(GradPath, StatisticsAndRingSlotsMatchTheTrainersGradients) {
  std::mt19937_64 rng(strata::testing::TestSeed());
  Fixture f(DType::kBF16);
  const auto grads = f.model->SetGrads(f.model->RandomGrads(rng, 1.0f));
  ASSERT_EQ(f.path->wire_dtype(), DType::kBF16);
  // Sub-groups 1 and 0 become complete first (any order); the rest at the step.
  ASSERT_TRUE(f.path->Ready(1).ok());
  ASSERT_TRUE(f.path->Ready(0).ok());
  Result<GradStats> st = f.path->LocalStats();
  ASSERT_TRUE(st.ok()) << st.status();
  const GradStats want =
      strata::testing::ShardStats(f.layout, f.sub_groups, Identity(f.sizes.size()), grads);
  EXPECT_EQ(st->sum_sq, want.sum_sq);  // bit for bit: the same defined order
  EXPECT_EQ(st->nonfinite_elems, 0u);
  // Slot 0 first holds sub-group 1 (no padding at its end), then sub-group 2
  // (padding): whatever the slot held there must read as zero.
  for (uint32_t i : {1u, 2u, 0u}) {
    SCOPED_TRACE("sub-group " + std::to_string(i));
    ASSERT_TRUE(f.path->Fetch(i, 0).ok());
    Result<GradView> g = f.path->Wait(i, 0);
    ASSERT_TRUE(g.ok()) << g.status();
    EXPECT_EQ(g->dtype, DType::kBF16);
    ASSERT_EQ(g->elems, f.sub_groups[i].elems());
    const std::vector<uint8_t> want_bytes = Image(f, i);
    EXPECT_EQ(std::memcmp(g->data, want_bytes.data(), want_bytes.size()), 0);
  }
  uint64_t fetched_bytes = 0;  // the pieces only: padding never crosses PCIe
  for (uint32_t i : {1u, 2u, 0u}) {
    for (const TensorMap::Piece& p : f.map.own(i)) fetched_bytes += p.elems * 2;
  }
  EXPECT_EQ(f.path->TakeTimes().d2h_bytes, fetched_bytes);
}

TEST(GradPath, AnInfInOnePieceIsCounted) {
  std::mt19937_64 rng(strata::testing::TestSeed());
  Fixture f(DType::kF16);
  auto g = f.model->RandomGrads(rng, 1.0f);
  g[2][799] = std::numeric_limits<float>::infinity();
  f.model->SetGrads(g);
  Result<GradStats> st = f.path->LocalStats();
  ASSERT_TRUE(st.ok());
  EXPECT_EQ(st->nonfinite_elems, 1u);
}

TEST(GradPath, AccumulationSumsInFp32AndTakesItsStatisticsThere) {
  std::mt19937_64 rng(strata::testing::TestSeed());
  Fixture f(DType::kBF16);
  // The trainer's stream waits for the copies that read its tensors: the
  // host writes the next grads once that stream is done.
  const auto g1 = f.model->SetGrads(f.model->RandomGrads(rng, 1.0f));
  ASSERT_TRUE(f.path->Accumulate().ok());
  ASSERT_TRUE(f.device->StreamSynchronize(f.device->DefaultStream()).ok());
  const auto g2 = f.model->SetGrads(f.model->RandomGrads(rng, 1.0f));
  ASSERT_TRUE(f.path->Accumulate().ok());
  EXPECT_EQ(f.path->micro_steps(), 2u);
  std::vector<std::vector<float>> sum = g1;
  for (size_t t = 0; t < sum.size(); ++t) {
    for (size_t k = 0; k < sum[t].size(); ++k) sum[t][k] += g2[t][k];
  }
  Result<GradStats> st = f.path->LocalStats();
  ASSERT_TRUE(st.ok());
  EXPECT_EQ(st->sum_sq, strata::testing::ShardStats(f.layout, f.sub_groups,
                                                    Identity(f.sizes.size()), sum)
                            .sum_sq);
  for (uint32_t i = 0; i < f.sub_groups.size(); ++i) {
    ASSERT_TRUE(f.path->Fetch(i, 0).ok());  // a no-op: the buffer holds it
    Result<GradView> v = f.path->Wait(i, 0);
    ASSERT_TRUE(v.ok());
    ASSERT_EQ(v->dtype, DType::kF32);
    const float* got = static_cast<const float*>(v->data);
    for (const TensorMap::Piece& p : f.map.own(i)) {
      for (uint64_t k = 0; k < p.elems; ++k) {
        ASSERT_EQ(got[p.offset_elems + k], sum[p.tensor][p.tensor_offset_elems + k]);
      }
    }
    for (const ElemRange& pad : f.map.padding(i)) {
      for (uint64_t k = pad.begin; k < pad.end; ++k) ASSERT_EQ(got[k], 0.0f);
    }
  }
  f.path->Consume();
  EXPECT_EQ(f.path->micro_steps(), 0u);
}

TEST(GradPath, KeptGradientsSurviveTheTrainersZeroing) {
  std::mt19937_64 rng(strata::testing::TestSeed());
  Fixture f(DType::kBF16);
  f.model->SetGrads(f.model->RandomGrads(rng, 1.0f));
  const std::vector<uint8_t> before = Image(f, 2);
  ASSERT_TRUE(f.path->Keep(2).ok());
  std::vector<std::vector<float>> zeros;
  for (uint64_t n : f.sizes) zeros.emplace_back(n, 0.0f);
  f.model->SetGrads(zeros);
  ASSERT_TRUE(f.path->Fetch(2, 1).ok());  // a no-op: it is kept
  Result<GradView> g = f.path->Wait(2, 1);
  ASSERT_TRUE(g.ok());
  EXPECT_EQ(std::memcmp(g->data, before.data(), before.size()), 0);
  f.path->Consume();  // the step that used it is done
  ASSERT_TRUE(f.path->Fetch(2, 1).ok());
  g = f.path->Wait(2, 1);
  ASSERT_TRUE(g.ok());
  const std::vector<uint8_t> now = Image(f, 2);
  EXPECT_EQ(std::memcmp(g->data, now.data(), now.size()), 0);
}

}  // namespace
}  // namespace strata::internal
