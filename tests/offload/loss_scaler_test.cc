// Loss scaler and clipping: hand-computed sequences (DeepSpeed's
// DynamicLossScaler semantics), static mode, errors, state restore, and
// torch.nn.utils.clip_grad_norm_'s coefficient.
#include "offload/loss_scaler.h"

#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <random>
#include <vector>

#include "tests/offload/test_seed.h"

namespace strata {
namespace {

LossScaler Make(const LossScalerOptions& o) {
  Result<LossScaler> s = LossScaler::Create(o);
  EXPECT_TRUE(s.ok()) << s.status();
  return std::move(s).value();
}

TEST(LossScalerTest, GrowsAfterWindowOfGoodSteps) {
  LossScaler s = Make({.initial_scale_power = 4, .growth_interval = 3, .hysteresis = 1});
  EXPECT_EQ(s.scale(), 16.0);
  // iterations 0, 1: (iter - (-1)) % 3 != 0; iteration 2: 3 % 3 == 0 -> grow.
  std::vector<double> next;
  for (int i = 0; i < 6; ++i) {
    LossScaleDecision d = s.Update(0).value();
    EXPECT_FALSE(d.skip_step);
    next.push_back(d.next_scale);
  }
  EXPECT_EQ(next, (std::vector<double>{16, 16, 32, 32, 32, 64}));
}

TEST(LossScalerTest, HandComputedSequenceWithHysteresis) {
  // DeepSpeed: init 2^4, window 2, hysteresis 2, min 2.
  LossScaler s =
      Make({.initial_scale_power = 4, .growth_interval = 2, .hysteresis = 2, .min_scale = 2.0});
  struct Step {
    uint64_t nonfinite;
    bool skip;
    double used, next;
  };
  const std::vector<Step> want = {
      {0, false, 16, 16},  // it0: (0+1)%2 != 0
      {0, false, 16, 32},  // it1: (1+1)%2 == 0 -> grow, hysteresis reset to 2
      {5, true, 32, 32},   // it2: overflow, hysteresis 2 -> 1, last_overflow 2
      {1, true, 32, 16},   // it3: overflow, hysteresis 1 -> back off; last_overflow 3
      {0, false, 16, 16},  // it4: (4-3)%2 != 0
      {0, false, 16, 32},  // it5: (5-3)%2 == 0 -> grow, hysteresis 2
      {1, true, 32, 32},   // it6: hysteresis 2 -> 1
      {0, false, 32, 32},  // it7: (7-6)%2 != 0; consecutive off: hysteresis stays 1
      {1, true, 32, 16},   // it8: hysteresis 1 -> back off
      {1, true, 16, 8},    // it9: back off again
      {1, true, 8, 4},    {1, true, 4, 2},
  };
  for (size_t i = 0; i < want.size(); ++i) {
    SCOPED_TRACE(i);
    LossScaleDecision d = s.Update(want[i].nonfinite).value();
    EXPECT_EQ(d.skip_step, want[i].skip);
    EXPECT_EQ(d.scale_used, want[i].used);
    EXPECT_EQ(d.next_scale, want[i].next);
  }
  // Overflow at min_scale is an error by default (DeepSpeed raises) and
  // leaves the state unchanged.
  const LossScalerState before = s.state();
  Result<LossScaleDecision> at_min = s.Update(3);
  EXPECT_EQ(at_min.status().code(), StatusCode::kFailedPrecondition);
  // The step keeps the gradients it refused: the message says to zero them.
  EXPECT_NE(at_min.status().message().find("zero_grad"), std::string_view::npos)
      << at_min.status();
  EXPECT_NE(at_min.status().message().find("min_scale 2"), std::string_view::npos);
  EXPECT_EQ(s.state(), before);
}

TEST(LossScalerTest, ConsecutiveHysteresisResetsOnEveryGoodStep) {
  LossScaler s = Make({.initial_scale_power = 3,
                       .growth_interval = 100,
                       .hysteresis = 2,
                       .consecutive_hysteresis = ConsecutiveHysteresis::kOn});
  EXPECT_EQ(s.Update(1)->next_scale, 8.0);  // 2 -> 1
  EXPECT_EQ(s.Update(0)->next_scale, 8.0);  // reset to 2
  EXPECT_EQ(s.Update(1)->next_scale, 8.0);  // 2 -> 1 again: no back off
  EXPECT_EQ(s.Update(1)->next_scale, 4.0);  // now back off
}

TEST(LossScalerTest, SkipModeKeepsMinScale) {
  LossScaler s = Make({.initial_scale_power = 1,
                       .hysteresis = 1,
                       .min_scale = 1.0,
                       .min_scale_overflow = MinScaleOverflow::kSkipStep});
  EXPECT_EQ(s.Update(1)->next_scale, 1.0);
  LossScaleDecision d = s.Update(1).value();
  EXPECT_TRUE(d.skip_step);
  EXPECT_EQ(d.next_scale, 1.0);
}

TEST(LossScalerTest, StaticAndNoneModesSkipButKeepScale) {
  LossScaler st = Make({.mode = LossScaleMode::kStatic, .static_scale = 128});
  EXPECT_EQ(st.scale(), 128.0);
  for (int i = 0; i < 2000; ++i) ASSERT_EQ(st.Update(0)->next_scale, 128.0);
  LossScaleDecision d = st.Update(7).value();
  EXPECT_TRUE(d.skip_step);
  EXPECT_EQ(d.next_scale, 128.0);
  LossScaler none = Make({.mode = LossScaleMode::kNone});
  EXPECT_EQ(none.scale(), 1.0);
  EXPECT_TRUE(none.Update(1)->skip_step);
  EXPECT_FALSE(none.Update(0)->skip_step);
}

TEST(LossScalerTest, BadOptionsNameTheField) {
  struct Case {
    LossScalerOptions o;
    std::string_view field;
  };
  const std::vector<Case> cases = {
      {{.mode = LossScaleMode::kStatic, .static_scale = 0}, "static_scale"},
      {{.initial_scale_power = 200}, "initial_scale_power"},
      {{.growth_interval = 0}, "growth_interval"},
      {{.hysteresis = 0}, "hysteresis"},
      {{.min_scale = -1}, "min_scale"},
      {{.growth_factor = 1.0}, "growth_factor"},
      {{.backoff_factor = 1.0}, "backoff_factor"},
      {{.initial_scale_power = 2, .min_scale = 8}, "below min_scale"},
  };
  for (const Case& c : cases) {
    Result<LossScaler> s = LossScaler::Create(c.o);
    EXPECT_EQ(s.status().code(), StatusCode::kInvalidArgument) << c.field;
    EXPECT_NE(s.status().message().find(c.field), std::string_view::npos) << s.status();
  }
}

TEST(LossScalerTest, RestoreContinuesIdentically) {
  const uint64_t seed = testing::TestSeed();
  std::mt19937_64 rng(seed);
  std::vector<uint64_t> inputs(400);
  for (auto& x : inputs) x = rng() % 5 == 0 ? 1 : 0;
  LossScaler a = Make({.initial_scale_power = 10,
                       .growth_interval = 4,
                       .hysteresis = 2,
                       .min_scale_overflow = MinScaleOverflow::kSkipStep});
  LossScaler b = a;  // a second "rank" with the same inputs
  LossScaler c = Make(a.options());
  for (size_t i = 0; i < inputs.size(); ++i) {
    LossScaleDecision da = a.Update(inputs[i]).value();
    LossScaleDecision db = b.Update(inputs[i]).value();
    ASSERT_EQ(da.skip_step, db.skip_step) << "seed " << seed;
    ASSERT_EQ(da.next_scale, db.next_scale);
    if (i == 200) {
      ASSERT_TRUE(c.Restore(a.state()).ok());
    } else if (i > 200) {
      ASSERT_EQ(c.Update(inputs[i])->next_scale, da.next_scale) << "seed " << seed;
    }
  }
  EXPECT_EQ(c.Restore({.scale = 0}).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(c.Restore({.scale = 4, .hysteresis_left = 3}).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(c.Restore({.scale = 4, .iteration = 3, .last_overflow_iteration = 3}).code(),
            StatusCode::kInvalidArgument);
}

TEST(ClipTest, FollowsTorchClipGradNorm) {
  // total norm 5 (3-4-5), max 1: 1 / (5 + 1e-6) in fp32.
  EXPECT_EQ(ClipCoefficient(25.0, 1.0), 1.0f / (5.0f + 1e-6f));
  EXPECT_FLOAT_EQ(ClipCoefficient(25.0, 1.0), 0.19999996f);
  // Norm below max: clamped to 1.
  EXPECT_EQ(ClipCoefficient(0.25, 1.0), 1.0f);
  EXPECT_EQ(ClipCoefficient(0.0, 1.0), 1.0f);
  // Disabled.
  EXPECT_EQ(ClipCoefficient(1e10, 0.0), 1.0f);
  // Infinite norm: 0; NaN stays NaN, as torch.
  EXPECT_EQ(ClipCoefficient(std::numeric_limits<double>::infinity(), 1.0), 0.0f);
  EXPECT_TRUE(std::isnan(ClipCoefficient(std::nan(""), 1.0)));
}

TEST(ClipTest, GradMultiplierCombinesUnscaleAndClip) {
  // Scaled grads with norm 5 * 1024 under scale 1024: unscaled norm 5.
  const double scale = 1024.0;
  const double sq = 25.0 * scale * scale;
  EXPECT_FLOAT_EQ(GradMultiplier(scale, sq, 1.0), (1.0f / (5.0f + 1e-6f)) / 1024.0f);
  EXPECT_EQ(GradMultiplier(scale, sq, 10.0), 1.0f / 1024.0f);
  EXPECT_EQ(GradMultiplier(1.0, 4.0, 0.0), 1.0f);
}

}  // namespace
}  // namespace strata
