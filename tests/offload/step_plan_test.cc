// The pure parts of a step: the decision from the global statistics, and the
// pipeline schedule (hand-computed cases, then its invariants over random
// tier layouts, slot and buffer counts).
#include "offload/step_plan.h"

#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <random>

#include "tests/offload/test_seed.h"

namespace strata::internal {
namespace {

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
    const PipelineSchedule s = MakeSchedule(extents, slots, buffers, PipelineMode::kOverlapped);
    ASSERT_EQ(s.updates.size(), n);
    ASSERT_LE(s.slots, slots);
    std::vector<int> fetched_at(n, -1);  // position where each position's gradient is fetched
    std::vector<int> read_at(n, -2);     // -1: initial; else the position that queued it
    for (uint32_t r : s.initial_reads) {
      ASSERT_EQ(read_at[r], -2) << "read twice: " << r;
      read_at[r] = -1;
    }
    for (uint32_t p = 0; p < n; ++p) {
      const ScheduledUpdate& u = s.updates[p];
      ASSERT_EQ(u.sub_group, p);  // index order
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
        ASSERT_EQ(extents[r] - static_cast<int32_t>(buffers), extents[p]);
        read_at[r] = static_cast<int>(p);
      }
    }
    for (uint32_t i : nvme) {
      ASSERT_NE(read_at[i], -2) << "NVMe sub-group " << i << " never read ahead";
      ASSERT_LT(read_at[i], static_cast<int>(i));  // queued before its update
      if (extents[i] < static_cast<int32_t>(buffers)) ASSERT_EQ(read_at[i], -1);
    }
  }
}

}  // namespace
}  // namespace strata::internal
