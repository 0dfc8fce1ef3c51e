// The pure parts of a step: the decision from the global statistics, and the
// pipeline schedule (hand-computed cases, then its invariants over random
// tier layouts, slot and buffer counts).
#include "offload/step_plan.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <random>

#include "tests/offload/test_seed.h"

namespace strata::internal {
namespace {

// The ranks' agreement sums stay exact at every world size the planner
// takes (2^20 held only up to 8192 ranks), and keep as many bits as they can.
TEST(AgreeModulus, KeepsWorldTimesTheSquareWithinADoublesMantissa) {
  for (const uint32_t world : {1u, 2u, 8u, 1000u, 8192u, 8193u, 65536u, 1u << 20}) {
    SCOPED_TRACE(world);
    const uint64_t m = AgreeModulus(world);
    const long double largest = static_cast<long double>(m - 1);
    EXPECT_LE(world * largest * largest, std::ldexp(1.0L, 53));
    EXPECT_LE(m, uint64_t{1} << 20);
    if (m < (uint64_t{1} << 20)) {
      const long double doubled = static_cast<long double>(2 * m - 1);
      EXPECT_GT(world * doubled * doubled, std::ldexp(1.0L, 53)) << "could keep more bits";
    }
  }
  EXPECT_EQ(AgreeModulus(8192), uint64_t{1} << 20);
  EXPECT_EQ(AgreeModulus(65536), uint64_t{1} << 18);
}

TEST(DecideStep, ClipsAndUnscalesWithOneMultiplier) {
  LossScaler scaler = *LossScaler::Create({.mode = LossScaleMode::kStatic, .static_scale = 8});
  // Scaled gradients: norm 8 x 2 = 16, so the true norm is 2 and clipping to
  // 1 halves them.
  Result<StepDecision> d = DecideStep(scaler, {.sum_sq = 256.0, .nonfinite_elems = 0}, 1.0, 4);
  ASSERT_TRUE(d.ok()) << d.status();
  EXPECT_FALSE(d->skip);
  EXPECT_EQ(d->step, 5);
  EXPECT_EQ(d->loss_scale, 8.0);
  EXPECT_DOUBLE_EQ(d->grad_norm, 2.0);
  EXPECT_EQ(d->clip_coef, ClipCoefficient(4.0, 1.0));
  EXPECT_EQ(d->grad_scale, GradMultiplier(8.0, 256.0, 1.0));
  EXPECT_NEAR(d->grad_scale, 0.5f / 8, 1e-6f);
}

TEST(DecideStep, NoClippingMeansOnlyTheUnscale) {
  LossScaler scaler = *LossScaler::Create({.mode = LossScaleMode::kNone});
  Result<StepDecision> d = DecideStep(scaler, {.sum_sq = 1e6, .nonfinite_elems = 0}, 0.0, 0);
  ASSERT_TRUE(d.ok());
  EXPECT_EQ(d->clip_coef, 1.0f);
  EXPECT_EQ(d->grad_scale, 1.0f);
  EXPECT_EQ(d->step, 1);
}

TEST(DecideStep, NonFiniteGradientsSkipAndLowerTheScale) {
  LossScaler scaler = *LossScaler::Create(
      {.mode = LossScaleMode::kDynamic, .initial_scale_power = 4, .hysteresis = 1});
  Result<StepDecision> d = DecideStep(
      scaler, {.sum_sq = std::numeric_limits<double>::infinity(), .nonfinite_elems = 3}, 1.0, 7);
  ASSERT_TRUE(d.ok());
  EXPECT_TRUE(d->skip);
  EXPECT_EQ(d->step, 7);  // not advanced
  EXPECT_EQ(d->loss_scale, 16.0);
  EXPECT_EQ(scaler.scale(), 8.0);
}

TEST(DecideStep, OverflowAtMinScaleIsTheScalersError) {
  LossScaler scaler = *LossScaler::Create(
      {.mode = LossScaleMode::kDynamic, .initial_scale_power = 0, .hysteresis = 1});
  Result<StepDecision> d = DecideStep(scaler, {.sum_sq = 0, .nonfinite_elems = 1}, 1.0, 0);
  EXPECT_EQ(d.status().code(), StatusCode::kFailedPrecondition) << d.status();
}

TEST(MakeSchedule, HandComputedOverlapped) {
  // Five sub-groups, 1-3 on NVMe (extents 0-2), two slots, two NVMe buffers.
  const std::vector<int32_t> extents = {-1, 0, 1, 2, -1};
  const PipelineSchedule s = MakeSchedule(extents, 2, 2, PipelineMode::kOverlapped);
  EXPECT_EQ(s.slots, 2u);
  EXPECT_EQ(s.initial_reads, (std::vector<uint32_t>{1, 2}));
  ASSERT_EQ(s.updates.size(), 5u);
  EXPECT_EQ(s.updates[0].fetch, (std::vector<uint32_t>{0, 1}));
  EXPECT_EQ(s.updates[1].fetch, (std::vector<uint32_t>{2}));
  EXPECT_EQ(s.updates[4].fetch, (std::vector<uint32_t>{}));
  EXPECT_EQ(s.updates[3].slot, 1u);
  // Extent 0's buffer is reused by extent 2 (sub-group 3) after its update.
  EXPECT_EQ(s.updates[1].read_after, (std::vector<uint32_t>{3}));
  EXPECT_TRUE(s.updates[2].read_after.empty());
}

TEST(MakeSchedule, ReversedNvmeStartsWithTheExtentsTheForwardStepEndedWith) {
  // Sub-group 0 in DRAM, 1-4 on NVMe (extents 0-3), 5 in DRAM; two buffers.
  const std::vector<int32_t> extents = {-1, 0, 1, 2, 3, -1};
  const PipelineSchedule f = MakeSchedule(extents, 2, 2, PipelineMode::kOverlapped, false);
  const PipelineSchedule r = MakeSchedule(extents, 2, 2, PipelineMode::kOverlapped, true);
  std::vector<uint32_t> forward, reverse;
  for (const ScheduledUpdate& u : f.updates) forward.push_back(u.sub_group);
  for (const ScheduledUpdate& u : r.updates) reverse.push_back(u.sub_group);
  EXPECT_EQ(forward, (std::vector<uint32_t>{0, 1, 2, 3, 4, 5}));
  EXPECT_EQ(reverse, (std::vector<uint32_t>{0, 4, 3, 2, 1, 5}));
  // The forward step ends with 3 and 4 in the buffers; the reversed one
  // starts with them (and ends with 2 and 1, where the next forward starts).
  EXPECT_EQ(r.initial_reads, (std::vector<uint32_t>{4, 3}));
  EXPECT_EQ(f.initial_reads, (std::vector<uint32_t>{1, 2}));
  EXPECT_EQ(r.updates[1].read_after, (std::vector<uint32_t>{2}));  // 4's buffer, 2's next
  EXPECT_EQ(r.updates[2].read_after, (std::vector<uint32_t>{1}));
  EXPECT_TRUE(r.updates[3].read_after.empty());
  EXPECT_EQ(r.updates[1].slot, 1u);  // slots follow positions
}

TEST(MakeSchedule, SerialFetchesAndReadsOnDemand) {
  const std::vector<int32_t> extents = {0, 1, -1};
  const PipelineSchedule s = MakeSchedule(extents, 4, 2, PipelineMode::kSerial);
  EXPECT_TRUE(s.initial_reads.empty());
  for (uint32_t p = 0; p < 3; ++p) {
    EXPECT_EQ(s.updates[p].fetch, (std::vector<uint32_t>{p}));
    EXPECT_TRUE(s.updates[p].read_after.empty());
  }
}

// The invariants the step loop relies on, for any layout.
TEST(MakeSchedule, InvariantsHoldForRandomLayouts) {
  const uint64_t seed = testing::TestSeed();
  std::mt19937_64 rng(seed);
  for (int iter = 0; iter < 2000; ++iter) {
    SCOPED_TRACE(::testing::Message() << "seed " << seed << " iter " << iter);
    const uint32_t n = 1 + rng() % 24;
    const uint32_t slots = 1 + rng() % 6;
    const uint32_t buffers = 1 + rng() % 5;
    std::vector<int32_t> extents(n, -1);
    std::vector<uint32_t> nvme;
    for (uint32_t i = 0; i < n; ++i) {
      if (rng() % 2) {
        extents[i] = static_cast<int32_t>(nvme.size());
        nvme.push_back(i);
      }
    }
    const bool reverse = rng() % 2;
    const PipelineSchedule s =
        MakeSchedule(extents, slots, buffers, PipelineMode::kOverlapped, reverse);
    ASSERT_EQ(s.updates.size(), n);
    // The NVMe sub-groups in update order; position_of[i]: where i is updated.
    std::vector<uint32_t> seq = nvme;
    if (reverse) std::reverse(seq.begin(), seq.end());
    std::vector<int> position_of(n, -1);
    ASSERT_LE(s.slots, slots);
    std::vector<int> fetched_at(n, -1);  // position where each position's gradient is fetched
    std::vector<int> read_at(n, -2);     // -1: initial; else the position that queued it
    for (uint32_t r : s.initial_reads) {
      ASSERT_EQ(read_at[r], -2) << "read twice: " << r;
      read_at[r] = -1;
    }
    for (uint32_t p = 0; p < n; ++p) {
      const ScheduledUpdate& u = s.updates[p];
      // Index order, the NVMe positions taken by `seq` in its order.
      if (extents[p] < 0) {
        ASSERT_EQ(u.sub_group, p);
      } else {
        const size_t q = static_cast<size_t>(
            std::count_if(extents.begin(), extents.begin() + p, [](int32_t e) { return e >= 0; }));
        ASSERT_EQ(u.sub_group, seq[q]);
      }
      ASSERT_EQ(position_of[u.sub_group], -1) << "updated twice: " << u.sub_group;
      position_of[u.sub_group] = static_cast<int>(p);
      ASSERT_EQ(u.slot, p % s.slots);
      for (uint32_t q : u.fetch) {
        ASSERT_LT(q, n);
        ASSERT_EQ(fetched_at[q], -1) << "fetched twice: " << q;
        // Its slot's previous user was updated before this position.
        ASSERT_TRUE(q < s.slots || q - s.slots < p) << "slot of " << q << " busy at " << p;
        fetched_at[q] = static_cast<int>(p);
      }
      // Its own gradient is on its way before it is waited for.
      ASSERT_GE(fetched_at[p], 0) << "position " << p << " never fetched";
      ASSERT_LE(fetched_at[p], static_cast<int>(p));
      for (uint32_t r : u.read_after) {
        ASSERT_EQ(read_at[r], -2) << "read twice: " << r;
        ASSERT_GE(extents[r], 0);
        // The buffer's previous user is this very update.
        ASSERT_EQ(extents[r] + (reverse ? 1 : -1) * static_cast<int32_t>(buffers),
                  extents[u.sub_group]);
        read_at[r] = static_cast<int>(p);
      }
    }
    for (size_t q = 0; q < seq.size(); ++q) {
      const uint32_t i = seq[q];
      ASSERT_NE(read_at[i], -2) << "NVMe sub-group " << i << " never read ahead";
      ASSERT_LT(read_at[i], position_of[i]);  // queued before its update
      if (q < buffers) {
        ASSERT_EQ(read_at[i], -1);
      }
    }
  }
}

}  // namespace
}  // namespace strata::internal
