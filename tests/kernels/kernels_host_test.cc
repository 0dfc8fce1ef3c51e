// The launchers on the emulated host device: each host twin against a plain
// element-by-element reference written here (or cpu_adam's scalar reference),
// argument errors, and stream ordering (a launch returns before the work runs).
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <future>
#include <random>
#include <vector>

#include "cpu_adam/cpu_adam_reference.h"
#include "kernels/kernels.h"
#include "kernels/kernels_internal.h"
#include "runtime/build_info.h"
#include "runtime/device.h"
#include "tests/kernels/kernels_test_util.h"

namespace strata::kernels {
namespace {

using testing::FiniteTensor;
using testing::FirstBitDifference;
using ::testing::HasSubstr;
using testing::kFloatTypes;
using testing::LoadRef;
using testing::RandomAdamState;
using testing::RandomTensor;
using testing::StoreRef;

constexpr size_t kOddSizes[] = {0, 1, 7, 257, 4097};

class KernelsHostTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto dev = CreateHostDevice();
    ASSERT_TRUE(dev.ok()) << dev.status();
    device_ = *std::move(dev);
    auto s = device_->CreateStream();
    ASSERT_TRUE(s.ok()) << s.status();
    stream_ = *std::move(s);
  }
  void Sync() { ASSERT_TRUE(device_->StreamSynchronize(stream_).ok()); }

  std::unique_ptr<Device> device_;
  Stream stream_;
};

ConstDeviceTensor Const(const std::vector<std::byte>& v, DType dtype) {
  return {v.data(), v.size() / DTypeSize(dtype), dtype};
}
DeviceTensor Mut(std::vector<std::byte>& v, DType dtype) {
  return {v.data(), v.size() / DTypeSize(dtype), dtype};
}

// Same dtype: a copy of the bits (NaN payloads included); otherwise dtype.h's
// conversions element by element.
TEST_F(KernelsHostTest, CastEveryDtypePairMatchesDtypeFunctions) {
  std::mt19937_64 rng(testing::TestSeed());
  for (DType from : kFloatTypes) {
    for (DType to : kFloatTypes) {
      for (size_t n : kOddSizes) {
        SCOPED_TRACE(std::string(DTypeName(from)) + "->" + std::string(DTypeName(to)) +
                     " n=" + std::to_string(n));
        const auto src = RandomTensor(from, n, rng);
        std::vector<std::byte> dst(n * DTypeSize(to), std::byte{0x5a});
        std::vector<std::byte> want(n * DTypeSize(to));
        if (from == to) {
          want = src;
        } else {
          for (size_t i = 0; i < n; ++i) StoreRef(want.data(), to, i, LoadRef(src.data(), from, i));
        }
        ASSERT_TRUE(Cast(*device_, stream_, Const(src, from), Mut(dst, to)).ok());
        Sync();
        EXPECT_EQ(FirstBitDifference(dst.data(), want.data(), to, n), "");
        std::vector<std::byte> on_host(n * DTypeSize(to), std::byte{0x5a});
        ASSERT_TRUE(CastOnHost(Const(src, from), Mut(on_host, to)).ok());  // no stream, no sync
        EXPECT_EQ(FirstBitDifference(on_host.data(), want.data(), to, n), "") << "CastOnHost";
      }
    }
  }
}

TEST_F(KernelsHostTest, CastKeepsNaNAndRoundsToNearestEven) {
  const std::vector<float> src = {std::nanf(""), -std::numeric_limits<float>::infinity(),
                                  std::bit_cast<float>(0x3f808000u),  // bf16 tie: down to even
                                  std::bit_cast<float>(0x3f818000u),  // bf16 tie: up to even
                                  65520.0f};
  std::vector<uint16_t> bf(src.size()), h(src.size());
  ASSERT_TRUE(Cast(*device_, stream_, {src.data(), src.size(), DType::kF32},
                   {bf.data(), bf.size(), DType::kBF16})
                  .ok());
  ASSERT_TRUE(Cast(*device_, stream_, {src.data(), src.size(), DType::kF32},
                   {h.data(), h.size(), DType::kF16})
                  .ok());
  Sync();
  EXPECT_TRUE(std::isnan(BF16ToF32(bf[0])));
  EXPECT_EQ(bf[1], 0xff80u);
  EXPECT_EQ(bf[2], 0x3f80u);
  EXPECT_EQ(bf[3], 0x3f82u);
  EXPECT_TRUE(std::isnan(F16ToF32(h[0])));
  EXPECT_EQ(h[4], 0x7c00u);  // 65520 overflows fp16
}

TEST_F(KernelsHostTest, ScaleInPlaceEveryDtype) {
  std::mt19937_64 rng(testing::TestSeed());
  for (DType t : kFloatTypes) {
    for (size_t n : kOddSizes) {
      for (float s : {0.5f, 3.0f, 1.0f / 1024.0f}) {
        SCOPED_TRACE(std::string(DTypeName(t)) + " n=" + std::to_string(n));
        auto x = RandomTensor(t, n, rng);
        std::vector<std::byte> want(x.size());
        for (size_t i = 0; i < n; ++i) StoreRef(want.data(), t, i, LoadRef(x.data(), t, i) * s);
        ASSERT_TRUE(Scale(*device_, stream_, Mut(x, t), s).ok());
        Sync();
        EXPECT_EQ(FirstBitDifference(x.data(), want.data(), t, n), "");
      }
    }
  }
}

TEST_F(KernelsHostTest, AccumulateEveryDtypePair) {
  std::mt19937_64 rng(testing::TestSeed());
  for (DType src_t : kFloatTypes) {
    for (DType dst_t : kFloatTypes) {
      for (size_t n : kOddSizes) {
        SCOPED_TRACE(std::string(DTypeName(src_t)) + "+=" + std::string(DTypeName(dst_t)));
        const auto src = RandomTensor(src_t, n, rng);
        auto dst = RandomTensor(dst_t, n, rng);
        std::vector<std::byte> want(dst.size());
        for (size_t i = 0; i < n; ++i) {
          StoreRef(want.data(), dst_t, i,
                   LoadRef(dst.data(), dst_t, i) + LoadRef(src.data(), src_t, i));
        }
        const auto dst0 = dst;
        ASSERT_TRUE(Accumulate(*device_, stream_, Const(src, src_t), Mut(dst, dst_t)).ok());
        Sync();
        EXPECT_EQ(testing::FirstAccumulateDifference(dst, want, src, dst0, src_t, dst_t), "");
      }
    }
  }
}

// Three tensors of mixed dtypes, given out of offset order, with gaps before,
// between and after them.
struct PackCase {
  std::vector<DType> dtypes = {DType::kBF16, DType::kF32, DType::kF16};
  std::vector<size_t> elems = {257, 1, 1000};
  std::vector<size_t> offsets = {300, 3, 600};  // gaps [0,3) [4,300) [557,600) [1600,1605)
  size_t bucket_elems = 1605;
};

TEST_F(KernelsHostTest, PackGradsConvertsScalesAndZeroesPadding) {
  std::mt19937_64 rng(testing::TestSeed());
  const PackCase pc;
  for (DType bucket_t : kFloatTypes) {
    for (float scale : {1.0f, 0.25f}) {
      SCOPED_TRACE(std::string("bucket ") + std::string(DTypeName(bucket_t)) +
                   " scale=" + std::to_string(scale));
      std::vector<std::vector<std::byte>> srcs;
      std::vector<PackEntry> entries;
      for (size_t k = 0; k < pc.dtypes.size(); ++k) {
        srcs.push_back(RandomTensor(pc.dtypes[k], pc.elems[k], rng));
        entries.push_back({Const(srcs[k], pc.dtypes[k]), pc.offsets[k]});
      }
      std::vector<std::byte> bucket(pc.bucket_elems * DTypeSize(bucket_t), std::byte{0xff});
      std::vector<std::byte> want(bucket.size(), std::byte{0});
      for (size_t k = 0; k < srcs.size(); ++k) {
        if (scale == 1.0f && pc.dtypes[k] == bucket_t) {  // a copy of the bits
          std::memcpy(want.data() + pc.offsets[k] * DTypeSize(bucket_t), srcs[k].data(),
                      srcs[k].size());
          continue;
        }
        for (size_t i = 0; i < pc.elems[k]; ++i) {
          float v = LoadRef(srcs[k].data(), pc.dtypes[k], i);
          if (scale != 1.0f) v = v * scale;
          StoreRef(want.data(), bucket_t, pc.offsets[k] + i, v);
        }
      }
      ASSERT_TRUE(PackGrads(*device_, stream_, entries, Mut(bucket, bucket_t), scale).ok());
      entries.clear();  // the launcher copied them
      Sync();
      EXPECT_EQ(FirstBitDifference(bucket.data(), want.data(), bucket_t, pc.bucket_elems), "");
    }
  }
}

TEST_F(KernelsHostTest, UnpackParamsScattersAndConverts) {
  std::mt19937_64 rng(testing::TestSeed());
  const PackCase pc;
  for (DType bucket_t : kFloatTypes) {
    SCOPED_TRACE(std::string("bucket ") + std::string(DTypeName(bucket_t)));
    const auto bucket = RandomTensor(bucket_t, pc.bucket_elems, rng);
    std::vector<std::vector<std::byte>> dsts;
    std::vector<UnpackEntry> entries;
    for (size_t k = 0; k < pc.dtypes.size(); ++k) {
      dsts.emplace_back(pc.elems[k] * DTypeSize(pc.dtypes[k]), std::byte{0x77});
    }
    for (size_t k = 0; k < pc.dtypes.size(); ++k) {
      entries.push_back({Mut(dsts[k], pc.dtypes[k]), pc.offsets[k]});
    }
    ASSERT_TRUE(UnpackParams(*device_, stream_, Const(bucket, bucket_t), entries).ok());
    Sync();
    for (size_t k = 0; k < dsts.size(); ++k) {
      std::vector<std::byte> want(dsts[k].size());
      for (size_t i = 0; i < pc.elems[k]; ++i) {
        StoreRef(want.data(), pc.dtypes[k], i, LoadRef(bucket.data(), bucket_t, pc.offsets[k] + i));
      }
      if (pc.dtypes[k] == bucket_t) {  // a copy of the bits
        std::memcpy(want.data(), bucket.data() + pc.offsets[k] * DTypeSize(bucket_t), want.size());
      }
      EXPECT_EQ(FirstBitDifference(dsts[k].data(), want.data(), pc.dtypes[k], pc.elems[k]), "")
          << "entry " << k;
    }
  }
}

TEST_F(KernelsHostTest, PackThenUnpackThroughFp32BucketIsExact) {
  std::mt19937_64 rng(testing::TestSeed());
  // Non-NaN values survive bf16 -> fp32 -> bf16 unchanged (NaNs come back
  // quiet, so they are left out here; the cast tests cover them).
  auto src = FiniteTensor(DType::kBF16, 333, 1000.0f, rng);
  StoreRef(src.data(), DType::kBF16, 7, -std::numeric_limits<float>::infinity());
  StoreRef(src.data(), DType::kBF16, 8, 1e-40f);  // rounds to a bf16 subnormal
  std::vector<std::byte> bucket(400 * 4), back(src.size());
  const std::vector<PackEntry> pack = {{Const(src, DType::kBF16), 40}};
  const std::vector<UnpackEntry> unpack = {{Mut(back, DType::kBF16), 40}};
  ASSERT_TRUE(PackGrads(*device_, stream_, pack, Mut(bucket, DType::kF32)).ok());
  ASSERT_TRUE(UnpackParams(*device_, stream_, Const(bucket, DType::kF32), unpack).ok());
  Sync();
  EXPECT_EQ(FirstBitDifference(src.data(), back.data(), DType::kBF16, 333), "");
}

TEST_F(KernelsHostTest, LaunchReturnsBeforeTheWorkRuns) {
  std::promise<void> release;
  std::shared_future<void> gate = release.get_future().share();
  ASSERT_TRUE(device_->LaunchHostFunc(stream_, [gate] { gate.wait(); }).ok());
  std::vector<float> x = {1.0f, 2.0f, 3.0f};
  std::vector<uint16_t> h(3, 0);
  ASSERT_TRUE(Scale(*device_, stream_, {x.data(), 3, DType::kF32}, 2.0f).ok());
  ASSERT_TRUE(Cast(*device_, stream_, {x.data(), 3, DType::kF32}, {h.data(), 3, DType::kF16}).ok());
  // The stream is blocked: nothing ran yet, and the launches did not wait.
  EXPECT_EQ(x[0], 1.0f);
  EXPECT_EQ(h[2], 0u);
  release.set_value();
  Sync();
  EXPECT_EQ(x[2], 6.0f);
  EXPECT_EQ(h[2], F32ToF16(6.0f));  // the cast saw the scaled values: stream order
}

TEST_F(KernelsHostTest, GradStatsMatchesCpuAdamReference) {
  std::mt19937_64 rng(testing::TestSeed());
  for (DType t : kFloatTypes) {
    for (size_t n :
         {size_t{0}, size_t{1}, size_t{4095}, size_t{4096}, size_t{4097}, size_t{100003}}) {
      SCOPED_TRACE(std::string(DTypeName(t)) + " n=" + std::to_string(n));
      const auto g = FiniteTensor(t, n, 3.0f, rng);
      std::vector<double> buf(GradStatsBufferBytes(n) / sizeof(double));
      const float scale = 0.125f;
      ASSERT_TRUE(
          GradStats(*device_, stream_, Const(g, t), scale, buf.data(), buf.size() * 8).ok());
      Sync();
      DeviceGradStats got;
      std::memcpy(&got, buf.data(), sizeof(got));
      auto want = reference::ComputeGradStats(GradView{t, g.data(), n}, scale);
      ASSERT_TRUE(want.ok());
      // Both sum non-negative terms in double, in different orders: each is
      // within (n - 1) * 2^-53 relative of the exact sum.
      const double tol = 2.0 * static_cast<double>(n + 1) * 0x1p-53 * want->sum_sq;
      EXPECT_NEAR(got.sum_sq, want->sum_sq, tol);
      EXPECT_EQ(got.nonfinite_elems, 0u);
      if (n > 0) {
        EXPECT_GT(got.sum_sq, 0.0);
      }
    }
  }
}

TEST_F(KernelsHostTest, GradStatsCountsNonFiniteAndIsDeterministic) {
  std::mt19937_64 rng(testing::TestSeed());
  for (DType t : kFloatTypes) {
    SCOPED_TRACE(DTypeName(t));
    auto g = FiniteTensor(t, 20000, 1.0f, rng);
    const float inf = std::numeric_limits<float>::infinity();
    StoreRef(g.data(), t, 5, inf);
    StoreRef(g.data(), t, 4096, -inf);
    StoreRef(g.data(), t, 19999, std::nanf(""));
    std::vector<double> a(GradStatsBufferBytes(20000) / 8), b(a.size());
    ASSERT_TRUE(GradStats(*device_, stream_, Const(g, t), 1.0f, a.data(), a.size() * 8).ok());
    Sync();
    DeviceGradStats got;
    std::memcpy(&got, a.data(), sizeof(got));
    EXPECT_EQ(got.nonfinite_elems, 3u);
    EXPECT_TRUE(std::isnan(got.sum_sq));  // inf + NaN
    // Finite data: two runs give the same bits.
    auto f = FiniteTensor(t, 20000, 1.0f, rng);
    ASSERT_TRUE(GradStats(*device_, stream_, Const(f, t), 2.0f, a.data(), a.size() * 8).ok());
    ASSERT_TRUE(GradStats(*device_, stream_, Const(f, t), 2.0f, b.data(), b.size() * 8).ok());
    Sync();
    EXPECT_EQ(std::memcmp(a.data(), b.data(), sizeof(DeviceGradStats)), 0);
  }
}

TEST_F(KernelsHostTest, AdamStepMatchesCpuAdamReferenceBitwise) {
  std::mt19937_64 rng(testing::TestSeed());
  const size_t n = 1031;
  for (WeightDecayMode mode : {WeightDecayMode::kDecoupled, WeightDecayMode::kL2}) {
    for (DType grad_t : kFloatTypes) {
      for (int out_k = 0; out_k < 4; ++out_k) {  // none, fp32, fp16, bf16
        SCOPED_TRACE("grad " + std::string(DTypeName(grad_t)) + " out " + std::to_string(out_k));
        const DType out_t = out_k == 0 ? DType::kF32 : kFloatTypes[out_k - 1];
        auto [p, m, v] = RandomAdamState(n, rng);
        auto p_ref = p, m_ref = m, v_ref = v;
        const auto g = FiniteTensor(grad_t, n, 0.5f, rng);
        std::vector<std::byte> out(out_k == 0 ? 0 : n * DTypeSize(out_t));
        std::vector<std::byte> out_ref(out.size());
        const AdamHyper h{.lr = 1e-3,
                          .weight_decay = 0.05,
                          .weight_decay_mode = mode,
                          .step = 7,
                          .grad_scale = 0.5f};
        const DeviceTensor out_t_view =
            out_k == 0 ? DeviceTensor{} : DeviceTensor{out.data(), n, out_t};
        ASSERT_TRUE(AdamStep(*device_, stream_, h, {p.data(), m.data(), v.data(), n},
                             Const(g, grad_t), out_t_view)
                        .ok());
        Sync();
        const OutView ov = out_k == 0 ? OutView::None() : OutView{out_t, out_ref.data(), n};
        ASSERT_TRUE(
            reference::AdamStep(h, {p_ref, m_ref, v_ref}, GradView{grad_t, g.data(), n}, ov).ok());
        EXPECT_EQ(FirstBitDifference(p.data(), p_ref.data(), DType::kF32, n), "");
        EXPECT_EQ(FirstBitDifference(m.data(), m_ref.data(), DType::kF32, n), "");
        EXPECT_EQ(FirstBitDifference(v.data(), v_ref.data(), DType::kF32, n), "");
        if (out_k != 0) {
          EXPECT_EQ(FirstBitDifference(out.data(), out_ref.data(), out_t, n), "");
        }
      }
    }
  }
}

TEST_F(KernelsHostTest, BadArgumentsAreRejectedBeforeEnqueue) {
  std::vector<float> a(16), b(8);
  std::vector<PackEntry> overlap = {{{a.data(), 4, DType::kF32}, 0},
                                    {{a.data() + 4, 4, DType::kF32}, 2}};
  Status s = PackGrads(*device_, stream_, overlap, {b.data(), 8, DType::kF32});
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("overlaps"));

  std::vector<PackEntry> past = {{{a.data(), 6, DType::kF32}, 4}};
  s = PackGrads(*device_, stream_, past, {b.data(), 8, DType::kF32});
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("ends past the bucket of 8 elems"));

  std::vector<UnpackEntry> null_entry = {{{nullptr, 3, DType::kF16}, 0}};
  s = UnpackParams(*device_, stream_, {b.data(), 8, DType::kF32}, null_entry);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("null data pointer"));

  s = Cast(*device_, stream_, {a.data(), 16, DType::kF64}, {b.data(), 16, DType::kF32});
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("fp64"));

  s = CastOnHost({a.data(), 16, DType::kF32}, {b.data(), 8, DType::kBF16});
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("same length"));
  s = CastOnHost({a.data(), 16, DType::kF32}, {nullptr, 16, DType::kBF16});
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("null data pointer"));

  s = Accumulate(*device_, stream_, {a.data(), 16, DType::kF32}, {b.data(), 8, DType::kF32});
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("same length"));

  s = Scale(*device_, StreamRef(), {a.data(), 16, DType::kF32}, 2.0f);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("null stream"));

  auto other = CreateHostDevice();
  ASSERT_TRUE(other.ok());
  s = Scale(*device_, (*other)->DefaultStream(), {a.data(), 16, DType::kF32}, 2.0f);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("belongs to device"));

  std::vector<double> small(2);
  s = GradStats(*device_, stream_, {a.data(), 16, DType::kF32}, 1.0f, small.data(), 16);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("GradStatsBufferBytes"));

  AdamHyper bad;
  bad.step = 0;
  s = AdamStep(*device_, stream_, bad, {a.data(), a.data(), a.data(), 16},
               {b.data(), 16, DType::kF32}, {});
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  s = AdamStep(*device_, stream_, AdamHyper{}, {a.data(), a.data(), a.data(), 16},
               {b.data(), 8, DType::kF32}, {});
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("grad has 8 elems"));
  // Nothing was enqueued: the data is untouched and the stream has no error.
  Sync();
  EXPECT_EQ(b[0], 0.0f);
}

// What a GPU the build has no kernel image for is told: its compute
// capability, the build's architectures, and what to rebuild with.
TEST(NoKernelImageErrorTest, NamesTheComputeCapabilityAndTheRebuildFlag) {
  const Status s = internal::NoKernelImageError("grad stats", "cuda:0", 8, 6, "90");
  EXPECT_EQ(s.code(), StatusCode::kFailedPrecondition);
  const std::string m(s.message());
  EXPECT_THAT(m, HasSubstr("grad stats on cuda:0: launch: cudaErrorNoKernelImageForDevice"));
  EXPECT_THAT(m, HasSubstr("CMAKE_CUDA_ARCHITECTURES=90,"));
  EXPECT_THAT(m, HasSubstr("compute capability 8.6"));
  EXPECT_THAT(m, HasSubstr("-DCMAKE_CUDA_ARCHITECTURES=86 "));
  // A two-digit major (Blackwell's 10.0, 12.0) gives a three-digit architecture.
  EXPECT_THAT(std::string(internal::NoKernelImageError("cast", "cuda:1", 12, 0, "80;90").message()),
              HasSubstr("-DCMAKE_CUDA_ARCHITECTURES=120 "));
}

// The architecture list travels from CMake as a compile definition whose ;s
// are commas on the way: it must come back as the ;-list CMake had.
TEST(NoKernelImageErrorTest, TheBuildsArchitecturesAreCMakesList) {
  const std::string archs = internal::BuiltCudaArchitectures();
  if (!GetBuildInfo().cuda) {
    EXPECT_EQ(archs, "");
    return;
  }
  EXPECT_THAT(archs, ::testing::MatchesRegex("[0-9a-z-]+(;[0-9a-z-]+)*")) << archs;
}

TEST(PaddingRangesTest, GapsBetweenUnsortedRanges) {
  const auto gaps = internal::PaddingRanges({{10, 20}, {0, 5}, {20, 25}}, 30);
  ASSERT_EQ(gaps.size(), 2u);
  EXPECT_EQ(gaps[0].begin, 5u);
  EXPECT_EQ(gaps[0].end, 10u);
  EXPECT_EQ(gaps[1].begin, 25u);
  EXPECT_EQ(gaps[1].end, 30u);
  EXPECT_TRUE(internal::PaddingRanges({{0, 30}}, 30).empty());
  const auto all = internal::PaddingRanges({}, 4);
  ASSERT_EQ(all.size(), 1u);
  EXPECT_EQ(all[0].end, 4u);
}

}  // namespace
}  // namespace strata::kernels
