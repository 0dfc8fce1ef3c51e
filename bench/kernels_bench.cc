// Google Benchmark suite of the host twins (kernels/kernels_host.cc), the
// kernels the emulated device runs in place of a GPU's. One BM_ per twin; each
// iteration runs the twin and, alternately before or after it, a vectorized
// stream with the twin's memory traffic and trivial arithmetic
// (internal::TrafficBaselineHost) on the same buffers, both on this one
// thread (the twins run single-threaded on a stream's worker). Reported per
// benchmark:
//   GBps              the twin: its read + written bytes / its mean time, in
//                     1e9 bytes/s (Google Benchmark's bytes_per_second is the
//                     same in 2^30 bytes/s)
//   base_GBps         the same-traffic baseline, same run, same buffers
//   ratio             base time / twin time (1.0 = at the baseline's speed)
//   ref_GBps          the scalar reference (kernels_reference.cc) on the same
//                     buffers, in the first 3 iterations, for the speed-up
// BM_Memcpy is memcpy of a 4-byte-per-element tensor, for scale.
// Args: elems (4M: one default bucket of `strata bench step`, mostly in
// cache; 64M: DRAM).
//
//   build/bin/kernels_bench --benchmark_min_time=1 --benchmark_counters_tabular=true
//   build/bin/kernels_bench --benchmark_filter='BM_(Pack|GradStats)/.*elems:67108864'
#include <benchmark/benchmark.h>

#include <chrono>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

#include "kernels/kernels.h"
#include "kernels/kernels_internal.h"
#include "runtime/dtype.h"

namespace strata::kernels {
namespace {

using internal::BaselineKind;
using internal::ScaleMode;
using Clock = std::chrono::steady_clock;

DType DTypeOf(int64_t a) { return a == 0 ? DType::kF32 : a == 1 ? DType::kF16 : DType::kBF16; }

// Page-aligned, touched, filled with normal values of `dtype` (no
// subnormals: those would time the CPU's assists, not memory).
class Tensor {
 public:
  Tensor(DType dtype, size_t elems) : dtype_(dtype), elems_(elems) {
    const size_t bytes = (elems * DTypeSize(dtype) + 4095) / 4096 * 4096 + 4096;
    data_ = static_cast<std::byte*>(std::aligned_alloc(4096, bytes));
    for (size_t i = 0; i < elems; ++i) {
      const float v = static_cast<float>(i % 1000) * 1e-3f + 0.5f;
      if (dtype == DType::kF32) {
        std::memcpy(data_ + 4 * i, &v, 4);
      } else {
        const uint16_t h = dtype == DType::kF16 ? F32ToF16(v) : F32ToBF16(v);
        std::memcpy(data_ + 2 * i, &h, 2);
      }
    }
  }
  ~Tensor() { std::free(data_); }
  Tensor(const Tensor&) = delete;
  Tensor& operator=(const Tensor&) = delete;
  std::byte* data() const { return data_; }
  DType dtype() const { return dtype_; }
  size_t elems() const { return elems_; }
  size_t bytes() const { return elems_ * DTypeSize(dtype_); }
  DeviceTensor mut() const { return {data_, elems_, dtype_}; }
  ConstDeviceTensor view() const { return {data_, elems_, dtype_}; }

 private:
  DType dtype_;
  size_t elems_;
  std::byte* data_;
};

double Seconds(Clock::duration d) { return std::chrono::duration<double>(d).count(); }

// The scalar reference is slow (1-20 GB/s): it runs in the first few
// iterations only.
constexpr int kReferenceRuns = 3;

// Times `twin` against `baseline` (alternating which goes first) and, in the
// first kReferenceRuns iterations, `reference`; `bytes` is what one pass moves.
void RunAgainstBaseline(benchmark::State& st, size_t bytes, const std::function<void()>& twin,
                        const std::function<void()>& baseline,
                        const std::function<void()>& reference) {
  double twin_s = 0, base_s = 0, ref_s = 0;
  int ref_runs = 0;
  bool twin_first = true;
  for (auto _ : st) {
    auto time = [](const std::function<void()>& fn) {
      const auto t0 = Clock::now();
      fn();
      return Seconds(Clock::now() - t0);
    };
    double t = 0;
    if (twin_first) {
      t = time(twin);
      base_s += time(baseline);
    } else {
      base_s += time(baseline);
      t = time(twin);
    }
    twin_first = !twin_first;
    twin_s += t;
    st.SetIterationTime(t);
    if (reference && ref_runs < kReferenceRuns) {
      ref_s += time(reference);
      ++ref_runs;
    }
  }
  const double n = static_cast<double>(st.iterations());
  st.SetBytesProcessed(static_cast<int64_t>(st.iterations() * bytes));
  st.counters["GBps"] = static_cast<double>(bytes) * n / twin_s / 1e9;
  st.counters["base_GBps"] = static_cast<double>(bytes) * n / base_s / 1e9;
  st.counters["ratio"] = base_s / twin_s;
  if (ref_runs > 0) st.counters["ref_GBps"] = static_cast<double>(bytes) * ref_runs / ref_s / 1e9;
  st.SetLabel(std::string(internal::HostTwinTarget()));
}

// Args: src dtype, dst dtype, elems. dst = convert(src), no scale (same
// dtype: the memcpy path).
void BM_Cast(benchmark::State& st) {
  const auto n = static_cast<size_t>(st.range(2));
  Tensor src(DTypeOf(st.range(0)), n), dst(DTypeOf(st.range(1)), n);
  RunAgainstBaseline(
      st, src.bytes() + dst.bytes(),
      [&] {
        internal::ConvertHost(src.data(), src.dtype(), dst.data(), dst.dtype(), n, 1.0f,
                              ScaleMode::kNone);
      },
      [&] {
        benchmark::DoNotOptimize(internal::TrafficBaselineHost(BaselineKind::kWrite, src.data(),
                                                               DTypeSize(src.dtype()), dst.data(),
                                                               DTypeSize(dst.dtype()), n));
      },
      [&] {
        internal::ConvertReference(src.data(), src.dtype(), dst.data(), dst.dtype(), n, 1.0f,
                                   ScaleMode::kNone);
      });
}

// Args: dtype, elems. x = x * 0.5 in place (twice per iteration would drift
// to subnormals: the scale alternates 0.5 and 2).
void BM_Scale(benchmark::State& st) {
  const auto n = static_cast<size_t>(st.range(1));
  Tensor x(DTypeOf(st.range(0)), n);
  float scale = 0.5f;
  RunAgainstBaseline(
      st, 2 * x.bytes(),
      [&] {
        internal::ConvertHost(x.data(), x.dtype(), x.data(), x.dtype(), n, scale,
                              ScaleMode::kMultiply);
        scale = 1.0f / scale;
      },
      [&] {
        benchmark::DoNotOptimize(internal::TrafficBaselineHost(BaselineKind::kReadModWrite,
                                                               x.data(), DTypeSize(x.dtype()),
                                                               x.data(), DTypeSize(x.dtype()), n));
      },
      [&] {
        internal::ConvertReference(x.data(), x.dtype(), x.data(), x.dtype(), n, scale,
                                   ScaleMode::kMultiply);
        scale = 1.0f / scale;
      });
}

// Args: grad dtype, bucket dtype, scale (0: 1, 1: 1/1024), elems. Four
// tensors packed back to back into one bucket, as the engine does.
void BM_Pack(benchmark::State& st) {
  const auto n = static_cast<size_t>(st.range(3));
  const DType gt = DTypeOf(st.range(0));
  Tensor grads(gt, n), bucket(DTypeOf(st.range(1)), n);
  const float scale = st.range(2) == 0 ? 1.0f : 1.0f / 1024.0f;
  std::vector<PackEntry> entries;
  for (size_t k = 0; k < 4; ++k) {
    const size_t begin = n * k / 4, end = n * (k + 1) / 4;
    entries.push_back({{grads.data() + begin * DTypeSize(gt), end - begin, gt}, begin});
  }
  RunAgainstBaseline(
      st, grads.bytes() + bucket.bytes(),
      [&] { internal::PackGradsHost(entries, bucket.mut(), scale); },
      [&] {
        benchmark::DoNotOptimize(internal::TrafficBaselineHost(BaselineKind::kWrite, grads.data(),
                                                               DTypeSize(gt), bucket.data(),
                                                               DTypeSize(bucket.dtype()), n));
      },
      [&] {
        internal::ConvertReference(grads.data(), gt, bucket.data(), bucket.dtype(), n, scale,
                                   internal::ScaleModeOf(scale));
      });
}

// Args: bucket dtype, param dtype, elems. Four tensors scattered out of one
// bucket.
void BM_Unpack(benchmark::State& st) {
  const auto n = static_cast<size_t>(st.range(2));
  const DType pt = DTypeOf(st.range(1));
  Tensor bucket(DTypeOf(st.range(0)), n), params(pt, n);
  std::vector<UnpackEntry> entries;
  for (size_t k = 0; k < 4; ++k) {
    const size_t begin = n * k / 4, end = n * (k + 1) / 4;
    entries.push_back({{params.data() + begin * DTypeSize(pt), end - begin, pt}, begin});
  }
  RunAgainstBaseline(
      st, bucket.bytes() + params.bytes(),
      [&] { internal::UnpackParamsHost(bucket.view(), entries); },
      [&] {
        benchmark::DoNotOptimize(internal::TrafficBaselineHost(BaselineKind::kWrite, bucket.data(),
                                                               DTypeSize(bucket.dtype()),
                                                               params.data(), DTypeSize(pt), n));
      },
      [&] {
        internal::ConvertReference(bucket.data(), bucket.dtype(), params.data(), pt, n, 1.0f,
                                   ScaleMode::kNone);
      });
}

// Args: src dtype, dst dtype, elems. dst += src (dst grows by ~1 per pass:
// its values stay normal for as long as a benchmark runs).
void BM_Accumulate(benchmark::State& st) {
  const auto n = static_cast<size_t>(st.range(2));
  Tensor src(DTypeOf(st.range(0)), n), dst(DTypeOf(st.range(1)), n);
  RunAgainstBaseline(
      st, src.bytes() + 2 * dst.bytes(), [&] { internal::AccumulateHost(src.view(), dst.mut()); },
      [&] {
        benchmark::DoNotOptimize(internal::TrafficBaselineHost(
            BaselineKind::kReadModWrite, src.data(), DTypeSize(src.dtype()), dst.data(),
            DTypeSize(dst.dtype()), n));
      },
      [&] { internal::AccumulateReference(src.view(), dst.mut()); });
}

// Args: grad dtype, elems.
void BM_GradStats(benchmark::State& st) {
  const auto n = static_cast<size_t>(st.range(1));
  Tensor grad(DTypeOf(st.range(0)), n);
  std::vector<std::byte> buf(GradStatsBufferBytes(n));
  RunAgainstBaseline(
      st, grad.bytes(), [&] { internal::GradStatsHost(grad.view(), 1.0f, buf.data()); },
      [&] {
        benchmark::DoNotOptimize(internal::TrafficBaselineHost(
            BaselineKind::kReadOnly, grad.data(), DTypeSize(grad.dtype()), nullptr, 0, n));
      },
      [&] { internal::GradStatsReference(grad.view(), 1.0f, buf.data()); });
}

// Args: elems (of fp32): memcpy of 4 * elems bytes; bytes = read + written.
void BM_Memcpy(benchmark::State& st) {
  const auto n = static_cast<size_t>(st.range(0));
  Tensor src(DType::kF32, n), dst(DType::kF32, n);
  for (auto _ : st) {
    std::memcpy(dst.data(), src.data(), src.bytes());
    benchmark::ClobberMemory();
  }
  st.SetBytesProcessed(static_cast<int64_t>(st.iterations() * 2 * src.bytes()));
  st.counters["GBps"] = benchmark::Counter(static_cast<double>(2 * src.bytes()) / 1e9,
                                           benchmark::Counter::kIsIterationInvariantRate);
}

constexpr int64_t kSizes[] = {int64_t{1} << 22, int64_t{1} << 26};

void CastArgs(benchmark::internal::Benchmark* b) {
  b->ArgNames({"src", "dst", "elems"});
  for (int64_t n : kSizes) {
    b->Args({2, 0, n});  // bf16 -> fp32
    b->Args({0, 2, n});  // fp32 -> bf16
    b->Args({1, 0, n});  // fp16 -> fp32
    b->Args({0, 1, n});  // fp32 -> fp16
    b->Args({2, 2, n});  // bf16 -> bf16: memcpy
  }
  b->UseManualTime()->Unit(benchmark::kMillisecond);
}

void ScaleArgs(benchmark::internal::Benchmark* b) {
  b->ArgNames({"dtype", "elems"});
  for (int64_t n : kSizes) {
    for (int t : {0, 1, 2}) b->Args({t, n});
  }
  b->UseManualTime()->Unit(benchmark::kMillisecond);
}

void PackArgs(benchmark::internal::Benchmark* b) {
  b->ArgNames({"grad", "bucket", "scaled", "elems"});
  for (int64_t n : kSizes) {
    b->Args({2, 0, 0, n});  // bf16 grads -> fp32 bucket (today's engine)
    b->Args({2, 0, 1, n});  // the same, unscaled by 1/1024
    b->Args({2, 2, 0, n});  // bf16 -> bf16 bucket: memcpy
    b->Args({1, 0, 1, n});  // fp16 grads, loss-scaled
    b->Args({0, 0, 1, n});  // fp32 grads, scaled
  }
  b->UseManualTime()->Unit(benchmark::kMillisecond);
}

void UnpackArgs(benchmark::internal::Benchmark* b) {
  b->ArgNames({"bucket", "param", "elems"});
  for (int64_t n : kSizes) {
    b->Args({0, 2, n});  // fp32 bucket -> bf16 params
    b->Args({0, 1, n});  // fp32 bucket -> fp16 params
    b->Args({2, 2, n});  // bf16 bucket -> bf16 params: memcpy
  }
  b->UseManualTime()->Unit(benchmark::kMillisecond);
}

void AccumulateArgs(benchmark::internal::Benchmark* b) {
  b->ArgNames({"src", "dst", "elems"});
  for (int64_t n : kSizes) {
    b->Args({2, 0, n});  // bf16 grads into an fp32 accumulator
    b->Args({0, 0, n});  // fp32 into fp32
    b->Args({2, 2, n});  // bf16 into bf16
  }
  b->UseManualTime()->Unit(benchmark::kMillisecond);
}

void StatsArgs(benchmark::internal::Benchmark* b) {
  b->ArgNames({"grad", "elems"});
  for (int64_t n : kSizes) {
    for (int t : {0, 2, 1}) b->Args({t, n});
  }
  b->UseManualTime()->Unit(benchmark::kMillisecond);
}

BENCHMARK(BM_Memcpy)->ArgNames({"elems"})->Arg(kSizes[0])->Arg(kSizes[1])->Unit(
    benchmark::kMillisecond);
BENCHMARK(BM_Cast)->Apply(CastArgs);
BENCHMARK(BM_Scale)->Apply(ScaleArgs);
BENCHMARK(BM_Pack)->Apply(PackArgs);
BENCHMARK(BM_Unpack)->Apply(UnpackArgs);
BENCHMARK(BM_Accumulate)->Apply(AccumulateArgs);
BENCHMARK(BM_GradStats)->Apply(StatsArgs);

}  // namespace
}  // namespace strata::kernels

BENCHMARK_MAIN();
