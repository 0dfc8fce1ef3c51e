// Google Benchmark suite of cpu_adam. One BM_ per question:
//   BM_AdamStep          fused AdamW step, by grad/out dtype and threads
//   BM_TrafficBaseline   the same memory traffic with trivial arithmetic
//   BM_AdamReference     the scalar reference (the SIMD speed-up's baseline)
//   BM_GradStats         squared norm + non-finite count
// Bytes/s count the bytes each pass must move (grad read, p/m/v read and
// written, out written), not write-allocate traffic.
//
//   build/bin/cpu_adam_bench --benchmark_filter='BM_(AdamStep|TrafficBaseline)/grad:2'
//       --benchmark_repetitions=5 --benchmark_report_aggregates_only=true  (one line)
#include <benchmark/benchmark.h>

#include <cstring>
#include <memory>
#include <vector>

#include "cpu_adam/cpu_adam.h"
#include "cpu_adam/cpu_adam_reference.h"
#include "runtime/dtype.h"

namespace strata {
namespace {

constexpr size_t kElems = size_t{1} << 24;  // 16M params: 448 MB moved per bf16 step

struct Arrays {
  Arrays(size_t n, DType grad_dtype, int out_kind)
      : p(n, 0.5f), m(n, 0.0f), v(n, 0.0f), g(n * DTypeSize(grad_dtype)), out(n * 4) {
    for (size_t i = 0; i < n; ++i) {
      const float x = static_cast<float>(i % 1000) * 1e-5f + 1e-4f;
      switch (grad_dtype) {
        case DType::kF16:
          reinterpret_cast<uint16_t*>(g.data())[i] = F32ToF16(x);
          break;
        case DType::kBF16:
          reinterpret_cast<uint16_t*>(g.data())[i] = F32ToBF16(x);
          break;
        default:
          reinterpret_cast<float*>(g.data())[i] = x;
          break;
      }
    }
    gv = GradView{grad_dtype, g.data(), n};
    if (out_kind >= 0) {
      const DType od = out_kind == 0 ? DType::kF32 : out_kind == 1 ? DType::kF16 : DType::kBF16;
      ov = OutView{od, out.data(), n};
      out_bytes = DTypeSize(od);
    }
    bytes_per_param = DTypeSize(grad_dtype) + 24 + out_bytes;
  }
  AdamState state() { return {p, m, v}; }
  std::vector<float> p, m, v;
  std::vector<std::byte> g, out;
  GradView gv;
  OutView ov = OutView::None();
  size_t out_bytes = 0;
  size_t bytes_per_param = 0;
};

// Args: grad dtype (0 fp32, 1 fp16, 2 bf16), out (-1 none, 0 fp32, 1 fp16, 2 bf16), threads.
DType GradOf(int64_t a) { return a == 0 ? DType::kF32 : a == 1 ? DType::kF16 : DType::kBF16; }

void BM_AdamStep(benchmark::State& st) {
  Arrays a(kElems, GradOf(st.range(0)), static_cast<int>(st.range(1)));
  auto opt = CpuAdam::Create({.threads = static_cast<int>(st.range(2))});
  AdamHyper h{.lr = 1e-4};
  for (auto _ : st) {
    ++h.step;
    if (!opt.value()->Step(h, a.state(), a.gv, a.ov).ok()) st.SkipWithError("step failed");
  }
  st.SetBytesProcessed(static_cast<int64_t>(st.iterations() * kElems * a.bytes_per_param));
  st.SetItemsProcessed(static_cast<int64_t>(st.iterations() * kElems));
}

void BM_TrafficBaseline(benchmark::State& st) {
  Arrays a(kElems, GradOf(st.range(0)), static_cast<int>(st.range(1)));
  auto opt = CpuAdam::Create({.threads = static_cast<int>(st.range(2))});
  for (auto _ : st) {
    if (!opt.value()->TrafficBaseline(a.state(), a.gv, a.ov).ok()) st.SkipWithError("failed");
  }
  st.SetBytesProcessed(static_cast<int64_t>(st.iterations() * kElems * a.bytes_per_param));
  st.SetItemsProcessed(static_cast<int64_t>(st.iterations() * kElems));
}

void BM_AdamReference(benchmark::State& st) {
  const size_t n = kElems / 4;
  Arrays a(n, GradOf(st.range(0)), static_cast<int>(st.range(1)));
  AdamHyper h{.lr = 1e-4};
  for (auto _ : st) {
    ++h.step;
    if (!reference::AdamStep(h, a.state(), a.gv, a.ov).ok()) st.SkipWithError("step failed");
  }
  st.SetBytesProcessed(static_cast<int64_t>(st.iterations() * n * a.bytes_per_param));
  st.SetItemsProcessed(static_cast<int64_t>(st.iterations() * n));
}

void BM_GradStats(benchmark::State& st) {
  Arrays a(kElems, GradOf(st.range(0)), -1);
  auto opt = CpuAdam::Create({.threads = static_cast<int>(st.range(1))});
  double sink = 0;
  for (auto _ : st) {
    auto r = opt.value()->ComputeGradStats(a.gv, 1.0f);
    sink += r->sum_sq;
  }
  benchmark::DoNotOptimize(sink);
  st.SetBytesProcessed(
      static_cast<int64_t>(st.iterations() * kElems * DTypeSize(GradOf(st.range(0)))));
}

void StepArgs(benchmark::internal::Benchmark* b) {
  b->ArgNames({"grad", "out", "threads"});
  for (int threads : {1, 2}) {
    b->Args({2, 2, threads});   // bf16 -> bf16: the target configuration
    b->Args({1, 1, threads});   // fp16 -> fp16
    b->Args({0, 0, threads});   // fp32 -> fp32
    b->Args({0, -1, threads});  // fp32, no output
  }
  b->UseRealTime()->Unit(benchmark::kMillisecond);
}

BENCHMARK(BM_AdamStep)->Apply(StepArgs);
BENCHMARK(BM_TrafficBaseline)->Apply(StepArgs);
BENCHMARK(BM_AdamReference)
    ->ArgNames({"grad", "out"})
    ->Args({2, 2})
    ->Args({0, 0})
    ->Unit(benchmark::kMillisecond);
BENCHMARK(BM_GradStats)
    ->ArgNames({"grad", "threads"})
    ->Args({2, 1})
    ->Args({2, 2})
    ->Args({0, 2})
    ->UseRealTime()
    ->Unit(benchmark::kMillisecond);

}  // namespace
}  // namespace strata

BENCHMARK_MAIN();
