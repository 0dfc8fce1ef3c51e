// The CUDA kernels against their host twins and cpu_adam's scalar reference:
// cast, unpack, grad stats and unscaled pack bit for bit; scale, accumulate
// and scaled pack bit for bit except that a NaN result may carry any sign and
// payload (GPUs return the canonical NaN); Adam <= 1 ulp (0 expected). Every test skips, visibly,
// when OpenDevice("cuda:0") fails (no GPU, driver or CUDA build).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "cpu_adam/cpu_adam_reference.h"
#include "kernels/kernels.h"
#include "kernels/kernels_internal.h"
#include "runtime/device.h"
#include "tests/kernels/kernels_test_util.h"

namespace strata::kernels {
namespace {

using testing::FiniteTensor;
using testing::FirstBitDifference;
using testing::kFloatTypes;
using testing::RandomAdamState;
using testing::RandomTensor;
using testing::StoreRef;

constexpr size_t kSizes[] = {0, 1, 7, 4097, (size_t{1} << 20) + 3};

class KernelsGpuTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto dev = OpenDevice("cuda:0");
    if (!dev.ok()) GTEST_SKIP() << "no CUDA device: " << dev.status();
    device_ = *std::move(dev);
    auto s = device_->CreateStream();
    ASSERT_TRUE(s.ok()) << s.status();
    stream_ = *std::move(s);
  }

  // Device memory holding a copy of `host` (at least 16 bytes allocated).
  DeviceBuffer Upload(const void* host, size_t bytes) {
    auto d = device_->Allocate(std::max<size_t>(bytes, 16));
    EXPECT_TRUE(d.ok()) << d.status();
    if (bytes > 0) {
      auto staging = device_->AllocateHost(bytes);
      EXPECT_TRUE(staging.ok()) << staging.status();
      std::memcpy(staging->data(), host, bytes);
      EXPECT_TRUE(
          device_->CopyAsync(d->data(), staging->data(), bytes, CopyKind::kHostToDevice, stream_)
              .ok());
      EXPECT_TRUE(device_->StreamSynchronize(stream_).ok());
    }
    return *std::move(d);
  }
  DeviceBuffer Upload(const std::vector<std::byte>& host) {
    return Upload(host.data(), host.size());
  }
  // Synchronizes the stream, then copies `bytes` of `d` back.
  std::vector<std::byte> Download(const DeviceBuffer& d, size_t bytes) {
    std::vector<std::byte> out(bytes);
    EXPECT_TRUE(device_->StreamSynchronize(stream_).ok());
    if (bytes == 0) return out;
    auto staging = device_->AllocateHost(bytes);
    EXPECT_TRUE(staging.ok()) << staging.status();
    EXPECT_TRUE(
        device_->CopyAsync(staging->data(), d.data(), bytes, CopyKind::kDeviceToHost, stream_)
            .ok());
    EXPECT_TRUE(device_->StreamSynchronize(stream_).ok());
    std::memcpy(out.data(), staging->data(), bytes);
    return out;
  }

  std::unique_ptr<Device> device_;
  Stream stream_;
};

TEST_F(KernelsGpuTest, CastMatchesHostTwinBitwise) {
  std::mt19937_64 rng(testing::TestSeed());
  for (DType from : kFloatTypes) {
    for (DType to : kFloatTypes) {
      for (size_t n : kSizes) {
        SCOPED_TRACE(std::string(DTypeName(from)) + "->" + std::string(DTypeName(to)) +
                     " n=" + std::to_string(n));
        const auto src = RandomTensor(from, n, rng);
        std::vector<std::byte> want(n * DTypeSize(to));
        internal::ConvertHost(src.data(), from, want.data(), to, n, 1.0f,
                              internal::ScaleMode::kNone);
        DeviceBuffer d_src = Upload(src);
        DeviceBuffer d_dst = Upload(std::vector<std::byte>(want.size(), std::byte{0x5a}));
        ASSERT_TRUE(Cast(*device_, stream_, {d_src.data(), n, from}, {d_dst.data(), n, to}).ok());
        const auto got = Download(d_dst, want.size());
        EXPECT_EQ(FirstBitDifference(got.data(), want.data(), to, n), "");
      }
    }
  }
}

TEST_F(KernelsGpuTest, ScaleAndAccumulateMatchHostTwinBitwise) {
  std::mt19937_64 rng(testing::TestSeed());
  for (DType a_t : kFloatTypes) {
    for (DType b_t : kFloatTypes) {
      const size_t n = 100003;
      SCOPED_TRACE(std::string(DTypeName(a_t)) + "/" + std::string(DTypeName(b_t)));
      const auto src = RandomTensor(a_t, n, rng);
      auto x = RandomTensor(b_t, n, rng);
      DeviceBuffer d_src = Upload(src);
      DeviceBuffer d_x = Upload(x);
      ASSERT_TRUE(Scale(*device_, stream_, {d_x.data(), n, b_t}, 0.375f).ok());
      ASSERT_TRUE(Accumulate(*device_, stream_, {d_src.data(), n, a_t}, {d_x.data(), n, b_t}).ok());
      internal::ConvertHost(x.data(), b_t, x.data(), b_t, n, 0.375f,
                            internal::ScaleMode::kMultiply);
      internal::AccumulateHost({src.data(), n, a_t}, {x.data(), n, b_t});
      const auto got = Download(d_x, x.size());
      EXPECT_EQ(testing::FirstDifferenceAnyNaN(got.data(), x.data(), b_t, n), "");
    }
  }
}

TEST_F(KernelsGpuTest, PackAndUnpackMatchHostTwinBitwise) {
  std::mt19937_64 rng(testing::TestSeed());
  const std::vector<DType> dtypes = {DType::kBF16, DType::kF32, DType::kF16};
  const std::vector<size_t> elems = {70001, 1, 1000};
  const std::vector<size_t> offsets = {2000, 3, 600};
  const size_t bucket_elems = 72005;
  for (DType bucket_t : kFloatTypes) {
    for (float scale : {1.0f, 0.25f}) {
      SCOPED_TRACE(std::string(DTypeName(bucket_t)) + " scale " + std::to_string(scale));
      std::vector<std::vector<std::byte>> srcs;
      std::vector<DeviceBuffer> d_srcs;
      std::vector<PackEntry> host_entries, dev_entries;
      for (size_t k = 0; k < dtypes.size(); ++k) {
        srcs.push_back(RandomTensor(dtypes[k], elems[k], rng));
        d_srcs.push_back(Upload(srcs[k]));
        host_entries.push_back({{srcs[k].data(), elems[k], dtypes[k]}, offsets[k]});
        dev_entries.push_back({{d_srcs[k].data(), elems[k], dtypes[k]}, offsets[k]});
      }
      std::vector<std::byte> want(bucket_elems * DTypeSize(bucket_t), std::byte{0xff});
      DeviceBuffer d_bucket = Upload(want);
      internal::PackGradsHost(host_entries, {want.data(), bucket_elems, bucket_t}, scale);
      ASSERT_TRUE(PackGrads(*device_, stream_, dev_entries,
                            {d_bucket.data(), bucket_elems, bucket_t}, scale)
                      .ok());
      const auto got = Download(d_bucket, want.size());
      if (scale == 1.0f) {
        EXPECT_EQ(FirstBitDifference(got.data(), want.data(), bucket_t, bucket_elems), "");
      } else {
        EXPECT_EQ(testing::FirstDifferenceAnyNaN(got.data(), want.data(), bucket_t, bucket_elems),
                  "");
      }
      // Unpack from the GPU's bucket on both sides, so NaN bits match.
      want = got;

      // Unpack the bucket into tensors of the entries' dtypes.
      std::vector<DeviceBuffer> d_outs;
      std::vector<std::vector<std::byte>> host_outs;
      std::vector<UnpackEntry> host_un, dev_un;
      for (size_t k = 0; k < dtypes.size(); ++k) {
        host_outs.emplace_back(elems[k] * DTypeSize(dtypes[k]));
        d_outs.push_back(Upload(host_outs[k]));
      }
      for (size_t k = 0; k < dtypes.size(); ++k) {
        host_un.push_back({{host_outs[k].data(), elems[k], dtypes[k]}, offsets[k]});
        dev_un.push_back({{d_outs[k].data(), elems[k], dtypes[k]}, offsets[k]});
      }
      internal::UnpackParamsHost({want.data(), bucket_elems, bucket_t}, host_un);
      ASSERT_TRUE(
          UnpackParams(*device_, stream_, {d_bucket.data(), bucket_elems, bucket_t}, dev_un).ok());
      for (size_t k = 0; k < dtypes.size(); ++k) {
        const auto out = Download(d_outs[k], host_outs[k].size());
        EXPECT_EQ(FirstBitDifference(out.data(), host_outs[k].data(), dtypes[k], elems[k]), "")
            << "entry " << k;
      }
    }
  }
}

TEST_F(KernelsGpuTest, GradStatsMatchesHostTwinBitwiseAndReferenceClosely) {
  std::mt19937_64 rng(testing::TestSeed());
  for (DType t : kFloatTypes) {
    for (size_t n : kSizes) {
      SCOPED_TRACE(std::string(DTypeName(t)) + " n=" + std::to_string(n));
      auto g = FiniteTensor(t, n, 2.0f, rng);
      const size_t buf_bytes = GradStatsBufferBytes(n);
      std::vector<std::byte> want(buf_bytes);
      internal::GradStatsHost({g.data(), n, t}, 0.5f, want.data());
      DeviceBuffer d_g = Upload(g);
      DeviceBuffer d_buf = Upload(std::vector<std::byte>(buf_bytes, std::byte{0xee}));
      ASSERT_TRUE(
          GradStats(*device_, stream_, {d_g.data(), n, t}, 0.5f, d_buf.data(), buf_bytes).ok());
      const auto got = Download(d_buf, sizeof(DeviceGradStats));
      EXPECT_EQ(std::memcmp(got.data(), want.data(), sizeof(DeviceGradStats)), 0);
      DeviceGradStats st;
      std::memcpy(&st, got.data(), sizeof(st));
      auto ref = reference::ComputeGradStats(GradView{t, g.data(), n}, 0.5f);
      ASSERT_TRUE(ref.ok());
      EXPECT_NEAR(st.sum_sq, ref->sum_sq, 2.0 * static_cast<double>(n + 1) * 0x1p-53 * ref->sum_sq);
      EXPECT_EQ(st.nonfinite_elems, 0u);
    }
    // Non-finite elements are counted exactly.
    const size_t n = 50000;
    auto g = FiniteTensor(t, n, 1.0f, rng);
    StoreRef(g.data(), t, 0, std::numeric_limits<float>::infinity());
    StoreRef(g.data(), t, 4096, std::nanf(""));
    StoreRef(g.data(), t, n - 1, -std::numeric_limits<float>::infinity());
    DeviceBuffer d_g = Upload(g);
    DeviceBuffer d_buf = Upload(std::vector<std::byte>(GradStatsBufferBytes(n)));
    ASSERT_TRUE(GradStats(*device_, stream_, {d_g.data(), n, t}, 1.0f, d_buf.data(),
                          GradStatsBufferBytes(n))
                    .ok());
    DeviceGradStats st;
    const auto got = Download(d_buf, sizeof(st));
    std::memcpy(&st, got.data(), sizeof(st));
    EXPECT_EQ(st.nonfinite_elems, 3u);
    EXPECT_TRUE(std::isnan(st.sum_sq));
  }
}

int64_t UlpDistance(float a, float b) {
  if (std::isnan(a) || std::isnan(b)) return std::isnan(a) && std::isnan(b) ? 0 : INT64_MAX;
  auto key = [](float f) {
    const int32_t i = std::bit_cast<int32_t>(f);
    return i < 0 ? static_cast<int64_t>(INT32_MIN) - i : static_cast<int64_t>(i);
  };
  return std::abs(key(a) - key(b));
}

TEST_F(KernelsGpuTest, AdamStepMatchesCpuAdamReference) {
  std::mt19937_64 rng(testing::TestSeed());
  const size_t n = 300007;
  for (WeightDecayMode mode : {WeightDecayMode::kDecoupled, WeightDecayMode::kL2}) {
    for (DType grad_t : kFloatTypes) {
      for (int out_k = 0; out_k < 4; ++out_k) {  // none, fp32, fp16, bf16
        SCOPED_TRACE("grad " + std::string(DTypeName(grad_t)) + " out " + std::to_string(out_k));
        const DType out_t = out_k == 0 ? DType::kF32 : kFloatTypes[out_k - 1];
        auto [p, m, v] = RandomAdamState(n, rng);
        const auto g = FiniteTensor(grad_t, n, 0.5f, rng);
        DeviceBuffer d_p = Upload(p.data(), n * 4), d_m = Upload(m.data(), n * 4),
                     d_v = Upload(v.data(), n * 4), d_g = Upload(g);
        const size_t out_bytes = out_k == 0 ? 0 : n * DTypeSize(out_t);
        DeviceBuffer d_out = Upload(std::vector<std::byte>(out_bytes));
        const AdamHyper h{.lr = 1e-3,
                          .weight_decay = 0.05,
                          .weight_decay_mode = mode,
                          .step = 11,
                          .grad_scale = 0.5f};
        ASSERT_TRUE(AdamStep(*device_, stream_, h,
                             {d_p.as<float>(), d_m.as<float>(), d_v.as<float>(), n},
                             {d_g.data(), n, grad_t},
                             out_k == 0 ? DeviceTensor{} : DeviceTensor{d_out.data(), n, out_t})
                        .ok());
        std::vector<std::byte> out_ref(out_bytes);
        ASSERT_TRUE(
            reference::AdamStep(h, {p, m, v}, GradView{grad_t, g.data(), n},
                                out_k == 0 ? OutView::None() : OutView{out_t, out_ref.data(), n})
                .ok());
        const auto gp = Download(d_p, n * 4), gm = Download(d_m, n * 4), gv = Download(d_v, n * 4),
                   go = Download(d_out, out_bytes);
        int64_t worst = 0;
        for (size_t i = 0; i < n; ++i) {
          float x, y, z;
          std::memcpy(&x, gp.data() + 4 * i, 4);
          std::memcpy(&y, gm.data() + 4 * i, 4);
          std::memcpy(&z, gv.data() + 4 * i, 4);
          worst =
              std::max({worst, UlpDistance(x, p[i]), UlpDistance(y, m[i]), UlpDistance(z, v[i])});
        }
        std::cout << "[ adam ] max ulp vs reference: " << worst << "\n";
        EXPECT_LE(worst, 1);
        if (out_k != 0 && worst == 0) {
          EXPECT_EQ(FirstBitDifference(go.data(), out_ref.data(), out_t, n), "");
        }
      }
    }
  }
}

TEST_F(KernelsGpuTest, CheckKernelsRunOnAcceptsThisGpu) {
  // Fails with FailedPrecondition (and the rebuild flag) where the build has
  // no kernel image for the GPU, e.g. -DCMAKE_CUDA_ARCHITECTURES=80-real on
  // an H100: then every other test here fails the same way.
  Status s = CheckKernelsRunOn(*device_);
  EXPECT_TRUE(s.ok()) << s;
}

// A failed runtime call leaves its error as the thread's last CUDA error; the
// next kernel launch, which reads cudaGetLastError(), must not report it as
// its own (a retry after an out-of-memory Create used to fail that way).
TEST_F(KernelsGpuTest, ALaunchAfterAFailedAllocationSucceeds) {
  std::vector<float> x(64, 1.5f);
  DeviceBuffer d = Upload(x.data(), x.size() * sizeof(float));
  auto huge = device_->Allocate(size_t{1} << 50);  // 1 PiB
  ASSERT_FALSE(huge.ok());
  Status s = Scale(*device_, stream_, {d.data(), x.size(), DType::kF32}, 2.0f);
  ASSERT_TRUE(s.ok()) << s << " (after the allocation failed with " << huge.status() << ")";
  const std::vector<std::byte> out = Download(d, x.size() * sizeof(float));
  float first = 0;
  std::memcpy(&first, out.data(), sizeof first);
  EXPECT_EQ(first, 3.0f);
}

TEST_F(KernelsGpuTest, ForeignStreamIsRejected) {
  auto host = CreateHostDevice();
  ASSERT_TRUE(host.ok());
  DeviceBuffer d = Upload(std::vector<std::byte>(64));
  Status s = Scale(*device_, (*host)->DefaultStream(), {d.data(), 16, DType::kF32}, 2.0f);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace strata::kernels
