// cpu_adam's contract beyond bit-equality with the reference: argument
// errors, the formulas themselves (against double-precision math written
// from the header), skipping a step on non-finite grads, and thread options.

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <random>
#include <vector>

#include "cpu_adam/cpu_adam.h"
#include "cpu_adam/cpu_adam_reference.h"
#include "runtime/dtype.h"
#include "tests/cpu_adam/cpu_adam_test_util.h"

namespace strata {
namespace {

using ::testing::HasSubstr;

struct Adam3 {
  explicit Adam3(size_t n) : p(n, 0.5f), m(n, 0.0f), v(n, 0.0f), g(n, 0.1f) {}
  AdamState state() { return {p, m, v}; }
  std::vector<float> p, m, v, g;
};

TEST(CpuAdamArgs, MismatchedLengthsAreInvalidArgument) {
  Adam3 a(8);
  std::vector<float> short_v(7);
  Status s = AdamStep(AdamHyper{}, {a.p, a.m, short_v}, GradView::F32(a.g), OutView::None());
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(s.message()), HasSubstr("exp_avg_sq has 7 elems but params has 8"));

  std::vector<float> g7(7);
  s = AdamStep(AdamHyper{}, a.state(), GradView::F32(g7), OutView::None());
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(s.message()), HasSubstr("grad has 7 elems"));

  std::vector<uint16_t> out9(9);
  s = AdamStep(AdamHyper{}, a.state(), GradView::F32(a.g), OutView::BF16(out9));
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(s.message()), HasSubstr("output has 9 elems"));
  // Nothing was written.
  EXPECT_EQ(a.p[0], 0.5f);
  EXPECT_EQ(a.m[0], 0.0f);
}

TEST(CpuAdamArgs, NullPointersAndBadDTypes) {
  Adam3 a(4);
  Status s = AdamStep(AdamHyper{}, a.state(), GradView{DType::kF32, nullptr, 4}, OutView::None());
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(s.message()), HasSubstr("grad is null with 4 elems"));

  s = AdamStep(AdamHyper{}, {std::span<float>(static_cast<float*>(nullptr), 4), a.m, a.v},
               GradView::F32(a.g), OutView::None());
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(s.message()), HasSubstr("params is null"));

  s = AdamStep(AdamHyper{}, a.state(), GradView{DType::kF64, a.g.data(), 4}, OutView::None());
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(s.message()), HasSubstr("grad dtype fp64 is not supported"));

  std::vector<int32_t> out(4);
  s = AdamStep(AdamHyper{}, a.state(), GradView::F32(a.g), OutView{DType::kI32, out.data(), 4});
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(s.message()), HasSubstr("output dtype i32 is not supported"));

  s = AdamStep(AdamHyper{}, a.state(), GradView::F32(a.g), OutView{DType::kF16, nullptr, 4});
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(s.message()), HasSubstr("output is null"));

  auto st = ComputeGradStats(GradView{DType::kBF16, nullptr, 3}, 1.0f);
  EXPECT_EQ(st.status().code(), StatusCode::kInvalidArgument);
}

TEST(CpuAdamArgs, BadHyperparameters) {
  Adam3 a(4);
  auto bad = [&](AdamHyper h, const char* text) {
    Status s = AdamStep(h, a.state(), GradView::F32(a.g), OutView::None());
    EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << text;
    EXPECT_THAT(std::string(s.message()), HasSubstr(text));
  };
  bad(AdamHyper{.step = 0}, "step = 0");
  bad(AdamHyper{.beta1 = 1.0}, "beta1 = 1 is outside [0, 1)");
  bad(AdamHyper{.beta2 = -0.1}, "beta2");
  bad(AdamHyper{.eps = 0.0}, "eps = 0 must be > 0");
  bad(AdamHyper{.lr = std::numeric_limits<double>::quiet_NaN()}, "lr is nan");
  bad(AdamHyper{.grad_scale = std::numeric_limits<float>::infinity()}, "grad_scale is inf");
  // beta1 = 0 (no momentum) is valid, with and without bias correction.
  EXPECT_TRUE(
      AdamStep(AdamHyper{.beta1 = 0.0}, a.state(), GradView::F32(a.g), OutView::None()).ok());
  EXPECT_TRUE(AdamStep(AdamHyper{.beta1 = 0.0, .bias_correction = BiasCorrection::kOff}, a.state(),
                       GradView::F32(a.g), OutView::None())
                  .ok());

  std::vector<float> s(4);
  EXPECT_EQ(AdagradStep(AdagradHyper{.lr_decay = -1.0, .step = 3}, {a.p, s}, GradView::F32(a.g),
                        OutView::None())
                .code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(
      LionStep(LionHyper{.beta2 = 1.5}, {a.p, a.m}, GradView::F32(a.g), OutView::None()).code(),
      StatusCode::kInvalidArgument);
  EXPECT_EQ(CpuAdam::Create({.threads = 100000}).status().code(), StatusCode::kInvalidArgument);
}

TEST(CpuAdamArgs, EmptySpansAreFine) {
  std::vector<float> e;
  EXPECT_TRUE(AdamStep(AdamHyper{}, {e, e, e}, GradView::F32(e), OutView::None()).ok());
  auto opt = CpuAdam::Create({.threads = 2});
  ASSERT_TRUE(opt.ok());
  // Capped at the hardware threads this process may use (threads = 0: all
  // of them), which oneTBB's arena would not exceed anyway.
  const int all = (*CpuAdam::Create({.threads = 0}))->threads();
  EXPECT_EQ((*opt)->threads(), std::min(2, all));
  EXPECT_EQ((*CpuAdam::Create({.threads = 4096}))->threads(), all);
  EXPECT_TRUE((*opt)->Step(AdamHyper{}, {e, e, e}, GradView::F32(e), OutView::None()).ok());
  auto st = (*opt)->ComputeGradStats(GradView::F32(e), 1.0f);
  ASSERT_TRUE(st.ok());
  EXPECT_EQ(st->sum_sq, 0.0);
  EXPECT_TRUE(st->finite());
}

// The reference (and so every target) against the formulas of cpu_adam.h
// evaluated in double: agreement within fp32 rounding over 20 steps.
TEST(CpuAdamFormula, AdamAndAdamWFollowTorchFormulas) {
  const uint64_t seed = cpu_adam_test::TestSeed();
  std::mt19937_64 rng(seed);
  for (WeightDecayMode mode : {WeightDecayMode::kDecoupled, WeightDecayMode::kL2}) {
    for (BiasCorrection bc : {BiasCorrection::kOn, BiasCorrection::kOff}) {
      const size_t n = 257;
      std::vector<float> p(n), m(n, 0.0f), v(n, 0.0f), g(n);
      std::vector<double> dp(n), dm(n, 0.0), dv(n, 0.0);
      for (size_t i = 0; i < n; ++i) dp[i] = p[i] = cpu_adam_test::SmallValue(rng, 1.0f);
      AdamHyper h{.lr = 1e-2,
                  .weight_decay = 0.1,
                  .weight_decay_mode = mode,
                  .bias_correction = bc,
                  .grad_scale = 0.5f};
      for (int64_t step = 1; step <= 20; ++step) {
        h.step = step;
        for (size_t i = 0; i < n; ++i) g[i] = cpu_adam_test::SmallValue(rng, 1.0f);
        ASSERT_TRUE(AdamStep(h, {p, m, v}, GradView::F32(g), OutView::None()).ok());
        for (size_t i = 0; i < n; ++i) {
          double gg = static_cast<double>(g[i]) * 0.5;
          if (mode == WeightDecayMode::kL2) gg += 0.1 * dp[i];
          if (mode == WeightDecayMode::kDecoupled) dp[i] *= 1.0 - 1e-2 * 0.1;
          dm[i] = 0.9 * dm[i] + 0.1 * gg;
          dv[i] = 0.999 * dv[i] + 0.001 * gg * gg;
          double step_size = 1e-2, c2 = 1.0;
          if (bc == BiasCorrection::kOn) {
            step_size = 1e-2 / (1.0 - std::pow(0.9, step));
            c2 = std::sqrt(1.0 - std::pow(0.999, step));
          }
          dp[i] -= step_size * dm[i] / (std::sqrt(dv[i]) / c2 + 1e-8);
        }
      }
      for (size_t i = 0; i < n; ++i) {
        ASSERT_NEAR(p[i], dp[i], 1e-5 * (1.0 + std::fabs(dp[i]))) << i << " seed " << seed;
        // m and v sum signed terms of size ~0.5 and ~2.5e-4: absolute fp32 error.
        ASSERT_NEAR(m[i], dm[i], 1e-6 + 1e-5 * std::fabs(dm[i])) << i;
        ASSERT_NEAR(v[i], dv[i], 1e-9 + 1e-5 * std::fabs(dv[i])) << i;
      }
    }
  }
}

TEST(CpuAdamFormula, FirstAdamStepMovesByLrTimesSign) {
  // Step 1 with bias correction: m_hat = g, v_hat = g^2, so p -= lr * g / (|g| + eps).
  std::vector<float> p = {1.0f, 1.0f, 1.0f, 0.0f};
  std::vector<float> m(4, 0.0f), v(4, 0.0f);
  std::vector<float> g = {0.3f, -2.0f, 1e-3f, 0.0f};
  ASSERT_TRUE(AdamStep(AdamHyper{.lr = 0.1, .weight_decay = 0.0}, {p, m, v}, GradView::F32(g),
                       OutView::None())
                  .ok());
  EXPECT_NEAR(p[0], 0.9f, 1e-6);
  EXPECT_NEAR(p[1], 1.1f, 1e-6);
  EXPECT_NEAR(p[2], 0.9f, 1e-5);
  EXPECT_EQ(p[3], 0.0f);
}

TEST(CpuAdamFormula, AdagradAndLionFollowTheirFormulas) {
  std::vector<float> p = {1.0f, -1.0f, 0.5f}, s = {0.0f, 1.0f, 0.0f};
  std::vector<float> g = {2.0f, 1.0f, 0.0f};
  ASSERT_TRUE(AdagradStep(AdagradHyper{.lr = 0.1, .lr_decay = 0.5, .eps = 1e-10, .step = 3}, {p, s},
                          GradView::F32(g), OutView::None())
                  .ok());
  // clr = 0.1 / (1 + 2 * 0.5) = 0.05; s = {4, 2, 0}.
  EXPECT_NEAR(p[0], 1.0f - 0.05f * 2.0f / 2.0f, 1e-7);
  EXPECT_NEAR(p[1], -1.0f - 0.05f / std::sqrt(2.0f), 1e-7);
  EXPECT_EQ(p[2], 0.5f);
  EXPECT_EQ(s[1], 2.0f);

  std::vector<float> lp = {1.0f, 1.0f, 1.0f}, lm = {0.0f, 1.0f, 0.0f};
  std::vector<float> lg = {-1.0f, -0.5f, 0.0f};
  ASSERT_TRUE(LionStep(LionHyper{.lr = 0.01, .beta1 = 0.9, .beta2 = 0.99, .weight_decay = 0.5},
                       {lp, lm}, GradView::F32(lg), OutView::None())
                  .ok());
  const float decayed = 1.0f * static_cast<float>(1.0 - 0.01 * 0.5);
  EXPECT_FLOAT_EQ(lp[0], decayed + 0.01f);  // sign(-0.1) = -1
  EXPECT_FLOAT_EQ(lp[1], decayed - 0.01f);  // sign(0.9 - 0.05) = +1
  EXPECT_FLOAT_EQ(lp[2], decayed);          // sign(0) = 0
  EXPECT_FLOAT_EQ(lm[0], -0.01f);
  EXPECT_FLOAT_EQ(lm[1], 0.99f - 0.005f);
}

// The engine's overflow path: the statistic reports the non-finite grads and
// the caller skips the step, leaving the state untouched; the same grads
// applied would have poisoned it.
TEST(CpuAdamNonFinite, StatsReportAndSkippedStepLeavesStateUntouched) {
  for (DType gd : {DType::kF32, DType::kF16, DType::kBF16}) {
    const size_t n = 1000;
    std::vector<std::byte> grad(n * 4);
    std::mt19937_64 rng(cpu_adam_test::TestSeed());
    cpu_adam_test::FillGrad(rng, gd, grad.data(), n, /*nonfinite_every=*/250);
    const GradView gv{gd, grad.data(), n};
    auto opt = CpuAdam::Create({.threads = 2});
    ASSERT_TRUE(opt.ok());
    auto st = (*opt)->ComputeGradStats(gv, 1.0f / 1024.0f);
    ASSERT_TRUE(st.ok());
    EXPECT_EQ(st->nonfinite_elems, 4u) << DTypeName(gd);
    EXPECT_FALSE(st->finite());

    Adam3 a(n), before(n);
    if (st->finite()) {
      ASSERT_TRUE((*opt)->Step(AdamHyper{}, a.state(), gv, OutView::None()).ok());
    }
    EXPECT_EQ(a.p, before.p);
    EXPECT_EQ(a.m, before.m);
    EXPECT_EQ(a.v, before.v);

    ASSERT_TRUE((*opt)->Step(AdamHyper{}, a.state(), gv, OutView::None()).ok());
    EXPECT_TRUE(std::isnan(a.p[249]));
    EXPECT_TRUE(std::isfinite(a.p[0]));
  }
}

TEST(CpuAdamStats, ScaleAndValue) {
  std::vector<float> g = {3.0f, 4.0f};
  auto st = ComputeGradStats(GradView::F32(g), 0.5f);
  ASSERT_TRUE(st.ok());
  EXPECT_EQ(st->sum_sq, 25.0 * 0.25);
  std::vector<uint16_t> h = {F32ToBF16(3.0f), F32ToBF16(-4.0f)};
  st = ComputeGradStats(GradView::BF16(h), 2.0f);
  ASSERT_TRUE(st.ok());
  EXPECT_EQ(st->sum_sq, 100.0);
}

TEST(CpuAdamThreads, DefaultUsesEveryHardwareThread) {
  auto opt = CpuAdam::Create({});
  ASSERT_TRUE(opt.ok());
  EXPECT_GE((*opt)->threads(), 1);
}

}  // namespace
}  // namespace strata

namespace strata {
namespace {

// The benchmark baseline touches every element of every array and keeps
// finite state as it was; out receives the truncated params.
TEST(CpuAdamBaseline, TouchesEveryArrayAndKeepsState) {
  const size_t n = 3 * kUpdateChunkElems + 11;
  std::vector<float> p(n), m(n), v(n);
  std::vector<uint16_t> g(n), out(n, 0);
  for (size_t i = 0; i < n; ++i) {
    p[i] = 1.0f + static_cast<float>(i % 100) * 0.01f;
    m[i] = 0.5f;
    v[i] = 0.25f;
    g[i] = F32ToBF16(static_cast<float>(i % 7));
  }
  const std::vector<float> p0(p), m0(m), v0(v);
  auto opt = CpuAdam::Create({.threads = 2});
  ASSERT_TRUE(opt.ok());
  ASSERT_TRUE((*opt)->TrafficBaseline({p, m, v}, GradView::BF16(g), OutView::BF16(out)).ok());
  EXPECT_EQ(p, p0);
  EXPECT_EQ(m, m0);
  EXPECT_EQ(v, v0);
  for (size_t i = 0; i < n; ++i) {
    ASSERT_EQ(out[i], std::bit_cast<uint32_t>(p[i]) >> 16) << i;
  }
  std::vector<float> short_m(n - 1);
  EXPECT_EQ((*opt)->TrafficBaseline({p, short_m, v}, GradView::BF16(g), OutView::None()).code(),
            StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace strata
