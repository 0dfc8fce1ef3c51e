// Every SIMD target this CPU supports (Highway's HWY_EXPORT_AND_TEST_P makes
// one test per target and makes the library dispatch to it) against the
// scalar reference, bit for bit: Adam/AdamW/Adagrad/Lion for every grad and
// output dtype, odd lengths, unaligned spans, many steps; fp16/bf16 rounding
// edge cases through the update; the gradient statistic; the streamed output.

#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "tests/cpu_adam/cpu_adam_simd_test.cc"
// clang-format off
#include "hwy/foreach_target.h"  // IWYU pragma: keep
#include "hwy/highway.h"
#include "hwy/tests/hwy_gtest.h"
// clang-format on

#include <array>
#include <cmath>
#include <functional>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "cpu_adam/cpu_adam.h"
#include "cpu_adam/cpu_adam_reference.h"
#include "runtime/dtype.h"
#include "tests/cpu_adam/cpu_adam_test_util.h"
// clang-format off
#include "runtime/dtype-inl.h"  // per target: StoreKindFrom
// clang-format on

HWY_BEFORE_NAMESPACE();
namespace strata {
namespace HWY_NAMESPACE {
namespace {

using cpu_adam_test::Buffer;
using cpu_adam_test::FloatsMatch;
using cpu_adam_test::OutMatch;

constexpr std::array<DType, 3> kGradTypes = {DType::kF32, DType::kF16, DType::kBF16};
// Output kinds: none, then the three dtypes.
constexpr std::array<int, 4> kOutKinds = {-1, 0, 1, 2};
constexpr std::array<DType, 3> kOutTypes = {DType::kF32, DType::kF16, DType::kBF16};
// 0, 1, less than a vector, odd, more than one vector of every target, > a block.
constexpr std::array<size_t, 6> kLengths = {0, 1, 3, 17, 67, 1031};

// One copy of an optimizer's buffers (state, grad, output) at given offsets.
struct Buffers {
  Buffers(int states, size_t n, DType grad_dtype, int out_kind, size_t misalign)
      : n(n), grad_dtype(grad_dtype) {
    bufs.reserve(static_cast<size_t>(states) + 2);  // grad_buf points into bufs
    for (int s = 0; s < states; ++s) {
      bufs.emplace_back(n * 4, ((misalign + static_cast<size_t>(s)) % 16) * 4);
      state.push_back(bufs.back().As<float>(n));
    }
    // Unaligned for vectors, aligned for the element type (the contract).
    bufs.emplace_back(n * 4, (misalign % 7) * DTypeSize(grad_dtype));
    grad_buf = &bufs.back();
    if (out_kind >= 0) {
      const DType od = kOutTypes[static_cast<size_t>(out_kind)];
      bufs.emplace_back(n * 4, (misalign % 5) * DTypeSize(od));
      out = OutView{od, bufs.back().As<std::byte>(n).data(), n};
    }
  }
  GradView grad() { return {grad_dtype, grad_buf->As<std::byte>(0).data(), n}; }
  void* grad_data() { return grad_buf->As<std::byte>(0).data(); }

  size_t n;
  DType grad_dtype;
  std::vector<Buffer> bufs;
  std::vector<std::span<float>> state;
  Buffer* grad_buf = nullptr;
  OutView out = OutView::None();
};

// Runs `steps` updates through the dispatched kernel and the reference from
// the same random start and compares every state array and the output after
// every step. `update(fast, buffers, step)` performs one update.
using UpdateFn = std::function<Status(bool fast, Buffers& b, int64_t step)>;

void CompareWithReference(const char* name, int states, const UpdateFn& update, int steps,
                          bool wide_params, uint64_t salt) {
  std::mt19937_64 rng(cpu_adam_test::TestSeed() ^ salt);
  for (DType gd : kGradTypes) {
    for (int ok : kOutKinds) {
      for (size_t n : kLengths) {
        const size_t misalign = rng() % 16;
        Buffers fast(states, n, gd, ok, misalign);
        Buffers ref(states, n, gd, ok, misalign + 3);
        for (size_t i = 0; i < n; ++i) {
          fast.state[0][i] =
              wide_params ? cpu_adam_test::WideValue(rng) : cpu_adam_test::SmallValue(rng, 1.0f);
          for (int s = 1; s < states; ++s) {
            const float x = cpu_adam_test::SmallValue(rng, 1e-3f);
            // Second moments/sums are non-negative.
            fast.state[static_cast<size_t>(s)][i] = (s == 2 || states == 2) ? x * x : x;
          }
        }
        if (std::string(name) == "lion") {
          for (size_t i = 0; i < n; ++i) fast.state[1][i] = cpu_adam_test::SmallValue(rng, 1e-3f);
        }
        for (int s = 0; s < states; ++s) {
          std::copy(fast.state[static_cast<size_t>(s)].begin(),
                    fast.state[static_cast<size_t>(s)].end(),
                    ref.state[static_cast<size_t>(s)].begin());
        }
        for (int64_t step = 1; step <= steps; ++step) {
          cpu_adam_test::FillGrad(rng, gd, fast.grad_data(), n);
          std::memcpy(ref.grad_data(), fast.grad_data(), n * DTypeSize(gd));
          ASSERT_TRUE(update(true, fast, step).ok());
          ASSERT_TRUE(update(false, ref, step).ok());
          const std::string where = std::string(name) + " target " + hwy::TargetName(HWY_TARGET) +
                                    " grad " + std::string(DTypeName(gd)) + " out " +
                                    cpu_adam_test::OutName(fast.out) + " n " + std::to_string(n) +
                                    " step " + std::to_string(step) + ": state";
          for (int s = 0; s < states; ++s) {
            ASSERT_TRUE(FloatsMatch(fast.state[static_cast<size_t>(s)],
                                    ref.state[static_cast<size_t>(s)], where + std::to_string(s)));
          }
          ASSERT_TRUE(OutMatch(fast.out, ref.out, n, where + " out"));
        }
      }
    }
  }
}

AdamState AsAdam(Buffers& b) { return {b.state[0], b.state[1], b.state[2]}; }

void TestDispatchesToThisTarget() {
  EXPECT_EQ(CpuAdamTargetName(), std::string(hwy::TargetName(HWY_TARGET)));
}

void TestAdamMatchesReference() {
  struct Mode {
    double wd;
    WeightDecayMode wd_mode;
    BiasCorrection bc;
  };
  const std::array<Mode, 5> modes = {{{0.0, WeightDecayMode::kDecoupled, BiasCorrection::kOn},
                                      {0.1, WeightDecayMode::kDecoupled, BiasCorrection::kOn},
                                      {0.1, WeightDecayMode::kL2, BiasCorrection::kOn},
                                      {0.1, WeightDecayMode::kDecoupled, BiasCorrection::kOff},
                                      {0.01, WeightDecayMode::kL2, BiasCorrection::kOff}}};
  uint64_t salt = 1;
  for (const Mode& mode : modes) {
    for (bool wide : {false, true}) {
      const UpdateFn update = [&](bool fast, Buffers& b, int64_t step) {
        AdamHyper h;
        h.lr = 1e-3;
        h.weight_decay = mode.wd;
        h.weight_decay_mode = mode.wd_mode;
        h.bias_correction = mode.bc;
        h.step = step;
        h.grad_scale = 0.75f;
        return fast ? AdamStep(h, AsAdam(b), b.grad(), b.out)
                    : reference::AdamStep(h, AsAdam(b), b.grad(), b.out);
      };
      CompareWithReference("adam", 3, update, 4, wide, salt++);
    }
  }
}

void TestAdagradMatchesReference() {
  for (double wd : {0.0, 0.05}) {
    const UpdateFn update = [&](bool fast, Buffers& b, int64_t step) {
      AdagradHyper h;
      h.lr = 1e-2;
      h.lr_decay = 0.01;
      h.weight_decay = wd;
      h.step = step;
      h.grad_scale = 2.0f;
      const AdagradState st{b.state[0], b.state[1]};
      return fast ? AdagradStep(h, st, b.grad(), b.out)
                  : reference::AdagradStep(h, st, b.grad(), b.out);
    };
    CompareWithReference("adagrad", 2, update, 4, wd > 0, 100 + static_cast<uint64_t>(wd * 100));
  }
}

void TestLionMatchesReference() {
  for (double wd : {0.0, 0.1}) {
    const UpdateFn update = [&](bool fast, Buffers& b, int64_t) {
      LionHyper h;
      h.lr = 1e-4;
      h.weight_decay = wd;
      h.grad_scale = 0.5f;
      const LionState st{b.state[0], b.state[1]};
      return fast ? LionStep(h, st, b.grad(), b.out) : reference::LionStep(h, st, b.grad(), b.out);
    };
    CompareWithReference("lion", 2, update, 4, wd > 0, 200 + static_cast<uint64_t>(wd * 100));
  }
}

// With lr = 0, zero grads and zero moments, an Adam step leaves p unchanged
// and writes convert(p): the output conversion alone, on this target.
void ExpectConversions(const std::vector<float>& values) {
  const size_t n = values.size();
  std::vector<float> p(values), m(n, 0.0f), v(n, 0.0f), g(n, 0.0f);
  std::vector<uint16_t> f16(n), bf16(n);
  std::vector<float> f32(n);
  AdamHyper h;
  h.lr = 0.0;
  h.weight_decay = 0.0;
  ASSERT_TRUE(AdamStep(h, {p, m, v}, GradView::F32(g), OutView::F16(f16)).ok());
  ASSERT_TRUE(AdamStep(h, {p, m, v}, GradView::F32(g), OutView::BF16(bf16)).ok());
  ASSERT_TRUE(AdamStep(h, {p, m, v}, GradView::F32(g), OutView::F32(f32)).ok());
  for (size_t i = 0; i < n; ++i) {
    const uint32_t bits = std::bit_cast<uint32_t>(values[i]);
    ASSERT_TRUE(cpu_adam_test::SameBits(p[i], values[i])) << "p changed at " << i;
    // The kernel must give exactly the reference conversion, NaN payload included.
    ASSERT_EQ(f16[i], F32ToF16(values[i]))
        << hwy::TargetName(HWY_TARGET) << " fp16 of 0x" << std::hex << bits;
    ASSERT_EQ(bf16[i], F32ToBF16(values[i]))
        << hwy::TargetName(HWY_TARGET) << " bf16 of 0x" << std::hex << bits;
    // fp32 out is p itself (a signalling NaN comes out quieted by the update).
    ASSERT_EQ(std::bit_cast<uint32_t>(f32[i]), std::bit_cast<uint32_t>(p[i])) << std::hex << bits;
    if (!std::isnan(values[i])) {
      ASSERT_EQ(std::bit_cast<uint32_t>(f32[i]), bits) << std::hex << bits;
    }
  }
}

void TestOutputRoundingEdgeCases() {
  auto f = [](uint32_t bits) { return std::bit_cast<float>(bits); };
  // Known answers first (independent of runtime/dtype.h).
  struct Known {
    uint32_t in;
    uint16_t f16;
    uint16_t bf16;
  };
  const std::array<Known, 14> known = {{
      {0x3f800000u, 0x3c00, 0x3f80},  // 1.0
      {0x3f808000u, 0x3c04, 0x3f80},  // bf16 tie, even stays (1 + 2^-8)
      {0x3f818000u, 0x3c0c, 0x3f82},  // bf16 tie, odd rounds up
      {0x3f801000u, 0x3c00, 0x3f80},  // fp16 tie (1 + 2^-11) -> even 1.0
      {0x3f803000u, 0x3c02, 0x3f80},  // fp16 tie (1 + 3*2^-11) -> up
      {0x33000000u, 0x0000, 0x3300},  // 2^-25: fp16 subnormal tie -> 0
      {0x33c00000u, 0x0002, 0x33c0},  // 3*2^-25: tie -> 2*2^-24
      {0x387fc000u, 0x03ff, 0x3880},  // largest fp16 subnormal
      {0x477fe000u, 0x7bff, 0x4780},  // 65504
      {0x477ff000u, 0x7c00, 0x4780},  // 65520 -> fp16 inf
      {0x7f7fffffu, 0x7c00, 0x7f80},  // FLT_MAX -> inf in both
      {0xff800000u, 0xfc00, 0xff80},  // -inf
      {0x7fc00001u, 0x7e00, 0x7fc0},  // quiet NaN with payload
      {0xff800001u, 0xfe00, 0xffc0},  // signalling NaN -> quiet, sign kept
  }};
  std::vector<float> values;
  for (const Known& k : known) values.push_back(f(k.in));
  values.push_back(-0.0f);
  values.push_back(f(0x00000001u));  // fp32 subnormal
  {
    const size_t n = values.size();
    std::vector<float> p(values), m(n, 0.0f), v(n, 0.0f), g(n, 0.0f);
    std::vector<uint16_t> f16(n), bf16(n);
    AdamHyper h;
    h.lr = 0.0;
    h.weight_decay = 0.0;
    ASSERT_TRUE(AdamStep(h, {p, m, v}, GradView::F32(g), OutView::F16(f16)).ok());
    ASSERT_TRUE(AdamStep(h, {p, m, v}, GradView::F32(g), OutView::BF16(bf16)).ok());
    for (size_t i = 0; i < known.size(); ++i) {
      EXPECT_EQ(f16[i], known[i].f16) << std::hex << known[i].in;
      EXPECT_EQ(bf16[i], known[i].bf16) << std::hex << known[i].in;
    }
    EXPECT_EQ(f16[known.size()], 0x8000);
    EXPECT_EQ(bf16[known.size()], 0x8000);
  }
  ExpectConversions(values);
  // Every bf16 value with the dropped half at 0, tie-1, tie, tie+1, max:
  // every rounding case of every exponent, subnormals, inf and NaN.
  values.clear();
  for (uint32_t hi = 0; hi < 0x10000u; ++hi) {
    for (uint32_t lo : {0x0000u, 0x7fffu, 0x8000u, 0x8001u, 0xffffu}) {
      values.push_back(f((hi << 16) | lo));
    }
  }
  ExpectConversions(values);
  // Around every fp16 rounding point: fp16 value v (as fp32) +- half ulp.
  values.clear();
  for (uint32_t h = 0; h < 0x10000u; ++h) {
    const uint32_t bits = std::bit_cast<uint32_t>(F16ToF32(static_cast<uint16_t>(h)));
    for (int d : {-1, 0, 1}) values.push_back(f(bits + static_cast<uint32_t>(d * 0x1000)));
    values.push_back(f(bits + 0x1000u + 1u));
  }
  ExpectConversions(values);
}

// Every fp16 and bf16 bit pattern as a gradient (inf and NaN included).
void TestEveryHalfGradMatchesReference() {
  for (DType gd : {DType::kF16, DType::kBF16}) {
    const size_t n = 0x10000;
    std::vector<uint16_t> g(n);
    for (size_t i = 0; i < n; ++i) g[i] = static_cast<uint16_t>(i);
    std::vector<float> p1(n, 0.5f), m1(n, 1e-3f), v1(n, 1e-6f);
    std::vector<float> p2(p1), m2(m1), v2(v1);
    std::vector<uint16_t> o1(n), o2(n);
    AdamHyper h;
    h.step = 3;
    const GradView gv{gd, g.data(), n};
    ASSERT_TRUE(AdamStep(h, {p1, m1, v1}, gv, OutView::F16(o1)).ok());
    ASSERT_TRUE(reference::AdamStep(h, {p2, m2, v2}, gv, OutView::F16(o2)).ok());
    ASSERT_TRUE(FloatsMatch(p1, p2, "p"));
    ASSERT_TRUE(FloatsMatch(m1, m2, "m"));
    ASSERT_TRUE(FloatsMatch(v1, v2, "v"));
    ASSERT_TRUE(OutMatch(OutView::F16(o1), OutView::F16(o2), n, "out"));
    // Stats over the same patterns: exact non-finite count.
    auto st = ComputeGradStats(gv, 1.0f);
    ASSERT_TRUE(st.ok());
    // fp16: exp 31 -> 2 * 1024 patterns; bf16: exp 255 -> 2 * 128.
    EXPECT_EQ(st->nonfinite_elems, gd == DType::kF16 ? 2048u : 256u);
  }
}

void TestGradStatsMatchesReference() {
  std::mt19937_64 rng(cpu_adam_test::TestSeed() ^ 0x5747);
  for (DType gd : kGradTypes) {
    for (size_t n : {size_t{0}, size_t{1}, size_t{5}, size_t{1031}, kGradStatsBlockElems + 7,
                     3 * kGradStatsBlockElems + 1}) {
      for (size_t nonfinite_every : {size_t{0}, size_t{97}}) {
        Buffer buf(n * 4, (rng() % 4) * DTypeSize(gd));
        void* data = buf.As<std::byte>(n).data();
        cpu_adam_test::FillGrad(rng, gd, data, n, nonfinite_every);
        const GradView gv{gd, data, n};
        auto fast = ComputeGradStats(gv, 0.25f);
        auto ref = reference::ComputeGradStats(gv, 0.25f);
        ASSERT_TRUE(fast.ok() && ref.ok());
        EXPECT_EQ(fast->nonfinite_elems, ref->nonfinite_elems) << n;
        if (nonfinite_every > 0 && n >= nonfinite_every) {
          EXPECT_GT(fast->nonfinite_elems, 0u);
          EXPECT_FALSE(std::isfinite(fast->sum_sq));
          continue;
        }
        // Non-negative terms: any summation order is within (terms) * 2^-53
        // relative of the exact sum; blocked SIMD and sequential differ by at
        // most twice that.
        const double blocks =
            static_cast<double>((n + kGradStatsBlockElems - 1) / kGradStatsBlockElems);
        const double rel = 2.0 * (static_cast<double>(kGradStatsBlockElems) + blocks) * 0x1p-53;
        EXPECT_NEAR(fast->sum_sq, ref->sum_sq, rel * ref->sum_sq + 1e-300)
            << DTypeName(gd) << " n " << n << " " << hwy::TargetName(HWY_TARGET);
        // Threaded results are bitwise equal to the single-threaded one.
        for (int threads : {1, 2, 3, 8}) {
          auto opt = CpuAdam::Create({.threads = threads});
          ASSERT_TRUE(opt.ok());
          auto st = (*opt)->ComputeGradStats(gv, 0.25f);
          ASSERT_TRUE(st.ok());
          EXPECT_EQ(std::bit_cast<uint64_t>(st->sum_sq), std::bit_cast<uint64_t>(fast->sum_sq))
              << threads << " threads, n " << n;
          EXPECT_EQ(st->nonfinite_elems, fast->nonfinite_elems);
        }
      }
    }
  }
}

// The threaded driver, with spans longer than several chunks and unaligned
// params, gives what the single-threaded kernel gives, for every thread count.
void TestThreadedMatchesSingleThreaded() {
  std::mt19937_64 rng(cpu_adam_test::TestSeed() ^ 0x7468);
  const size_t n = 3 * kUpdateChunkElems + 1234;
  for (size_t misalign : {size_t{0}, size_t{5}}) {
    Buffers base(3, n, DType::kBF16, 2, misalign);
    for (size_t i = 0; i < n; ++i) {
      base.state[0][i] = cpu_adam_test::SmallValue(rng, 1.0f);
      base.state[1][i] = 0.0f;
      base.state[2][i] = 0.0f;
    }
    cpu_adam_test::FillGrad(rng, DType::kBF16, base.grad_data(), n);
    std::vector<float> want_p(n), want_m(n), want_v(n);
    std::vector<uint16_t> want_out(n);
    {
      std::vector<float> p(base.state[0].begin(), base.state[0].end()), m(n, 0.0f), v(n, 0.0f);
      AdamHyper h;
      for (int64_t s = 1; s <= 2; ++s) {
        h.step = s;
        ASSERT_TRUE(AdamStep(h, {p, m, v}, base.grad(), OutView::BF16(want_out)).ok());
      }
      want_p = p;
      want_m = m;
      want_v = v;
    }
    for (int threads : {1, 2, 3, 8}) {
      auto opt = CpuAdam::Create({.threads = threads});
      ASSERT_TRUE(opt.ok());
      Buffers b(3, n, DType::kBF16, 2, misalign);
      std::copy(base.state[0].begin(), base.state[0].end(), b.state[0].begin());
      std::fill(b.state[1].begin(), b.state[1].end(), 0.0f);
      std::fill(b.state[2].begin(), b.state[2].end(), 0.0f);
      std::memcpy(b.grad_data(), base.grad_data(), n * 2);
      AdamHyper h;
      for (int64_t s = 1; s <= 2; ++s) {
        h.step = s;
        ASSERT_TRUE((*opt)->Step(h, AsAdam(b), b.grad(), b.out).ok());
      }
      ASSERT_TRUE(FloatsMatch(b.state[0], want_p, "p threads " + std::to_string(threads)));
      ASSERT_TRUE(FloatsMatch(b.state[1], want_m, "m threads " + std::to_string(threads)));
      ASSERT_TRUE(FloatsMatch(b.state[2], want_v, "v threads " + std::to_string(threads)));
      ASSERT_TRUE(OutMatch(b.out, OutView::BF16(want_out), n, "out"));
    }
  }
}

// The params' copy is streamed (non-temporal stores) where the output's
// vectors start aligned and stored through the caches elsewhere; both give
// the reference's bits, for every output dtype, at every output offset from
// 0 to two vectors, through the threaded driver (several chunks and a tail),
// and the traffic baseline writes its truncated params either way. x86
// targets from AVX2 up must be able to stream (else the fast path is dead).
void TestStreamedOutputMatchesReference() {
  namespace hn = hwy::HWY_NAMESPACE;
  const hn::ScalableTag<float> df;
  const hn::Rebind<uint16_t, decltype(df)> d16;
  alignas(64) static uint16_t probe[64];
#if HWY_ARCH_X86
  if (HWY_TARGET <= HWY_AVX2) {
    EXPECT_EQ(StoreKindFrom(d16, probe), StoreKind::kStream);
    EXPECT_EQ(StoreKindFrom(df, reinterpret_cast<float*>(probe)), StoreKind::kStream);
  }
#endif
  EXPECT_EQ(StoreKindFrom(d16, probe + 1), StoreKind::kCached);

  std::mt19937_64 rng(cpu_adam_test::TestSeed() ^ 0x5354);
  const size_t n = 2 * kUpdateChunkElems + 77;
  auto opt = CpuAdam::Create({.threads = 2});
  ASSERT_TRUE(opt.ok());
  std::vector<float> p0(n);
  for (float& x : p0) x = cpu_adam_test::SmallValue(rng, 1.0f);
  for (DType od : kOutTypes) {
    for (size_t offset = 0; offset <= 2 * hn::Lanes(df); ++offset) {
      const std::string where = std::string(hwy::TargetName(HWY_TARGET)) + " out " +
                                std::string(DTypeName(od)) + " offset " + std::to_string(offset);
      Buffer fast_out(n * 4, offset * DTypeSize(od)), ref_out(n * 4, 0);
      const OutView fo{od, fast_out.As<std::byte>(n).data(), n};
      const OutView ro{od, ref_out.As<std::byte>(n).data(), n};
      std::vector<float> fp(p0), fm(n, 0.0f), fv(n, 0.0f), rp(p0), rm(n, 0.0f), rv(n, 0.0f);
      std::vector<uint16_t> g(n);
      AdamHyper h{.lr = 1e-3, .weight_decay = 0.01};
      for (int64_t step = 1; step <= 2; ++step) {
        cpu_adam_test::FillGrad(rng, DType::kBF16, g.data(), n);
        h.step = step;
        ASSERT_TRUE((*opt)->Step(h, {fp, fm, fv}, GradView::BF16(g), fo).ok());
        ASSERT_TRUE(reference::AdamStep(h, {rp, rm, rv}, GradView::BF16(g), ro).ok());
        ASSERT_TRUE(FloatsMatch(fp, rp, where + " p"));
        ASSERT_TRUE(FloatsMatch(fm, rm, where + " m"));
        ASSERT_TRUE(FloatsMatch(fv, rv, where + " v"));
        ASSERT_TRUE(OutMatch(fo, ro, n, where));
      }
      if (od == DType::kF16) continue;  // the baseline truncates; fp16 is not a truncation
      ASSERT_TRUE((*opt)->TrafficBaseline({fp, fm, fv}, GradView::BF16(g), fo).ok());
      for (size_t i = 0; i < n; ++i) {
        const uint32_t bits = std::bit_cast<uint32_t>(fp[i]);
        if (od == DType::kF32) {
          ASSERT_EQ(static_cast<const float*>(fo.data)[i], fp[i]) << where << " baseline " << i;
        } else {
          ASSERT_EQ(static_cast<const uint16_t*>(fo.data)[i], bits >> 16)
              << where << " baseline " << i;
        }
      }
    }
  }
}

}  // namespace
// NOLINTNEXTLINE(google-readability-namespace-comments)
}  // namespace HWY_NAMESPACE
}  // namespace strata
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace strata {
namespace {
HWY_BEFORE_TEST(CpuAdamSimdTest);
HWY_EXPORT_AND_TEST_P(CpuAdamSimdTest, TestDispatchesToThisTarget);
HWY_EXPORT_AND_TEST_P(CpuAdamSimdTest, TestAdamMatchesReference);
HWY_EXPORT_AND_TEST_P(CpuAdamSimdTest, TestAdagradMatchesReference);
HWY_EXPORT_AND_TEST_P(CpuAdamSimdTest, TestLionMatchesReference);
HWY_EXPORT_AND_TEST_P(CpuAdamSimdTest, TestOutputRoundingEdgeCases);
HWY_EXPORT_AND_TEST_P(CpuAdamSimdTest, TestEveryHalfGradMatchesReference);
HWY_EXPORT_AND_TEST_P(CpuAdamSimdTest, TestGradStatsMatchesReference);
HWY_EXPORT_AND_TEST_P(CpuAdamSimdTest, TestThreadedMatchesSingleThreaded);
HWY_EXPORT_AND_TEST_P(CpuAdamSimdTest, TestStreamedOutputMatchesReference);
}  // namespace
}  // namespace strata
#endif
