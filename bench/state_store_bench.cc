// Google Benchmark of the state store's payload checksum (StateStore::
// PayloadHash: XXH3-64 over the XXH3-64s of 1 MiB pieces), which the step
// computes for every NVMe extent it writes and verifies for every one it
// reads, on the CPU optimizer's threads. Args: threads (0: no parallel_for,
// the calling thread alone, as before the pieces; n: CpuAdam::ParallelFor on
// n threads). Reported: GBps, payload bytes / mean time in 1e9 bytes/s, and
// base_GBps, one XXH3-64 pass over the whole payload on this thread in the
// same run (the single-stream hash the pieces replaced).
//
//   build/bin/state_store_bench --benchmark_counters_tabular=true
#include <benchmark/benchmark.h>
#include <xxhash.h>

#include <chrono>
#include <cstring>
#include <functional>
#include <memory>
#include <thread>
#include <vector>

#include "cpu_adam/cpu_adam.h"
#include "offload/state_store.h"
#include "runtime/storage.h"

namespace strata {
namespace {

constexpr uint64_t kExtentBytes = uint64_t{192} << 20;  // `bench step`'s 16M-element sub-group

void BM_PayloadHash(benchmark::State& state) {
  const int threads = static_cast<int>(state.range(0));
  std::unique_ptr<Storage> storage = CreateMemStorage();
  std::unique_ptr<CpuAdam> cpu;
  StateStoreOptions o;
  o.paths = {"/mem/bench"};
  o.extent_bytes = kExtentBytes;
  o.num_extents = 1;
  if (threads > 0) {
    cpu = *CpuAdam::Create({.threads = threads});
    o.parallel_for = [&](size_t n, const std::function<void(size_t, size_t)>& body) {
      cpu->ParallelFor(n, 1, body);
    };
  }
  std::unique_ptr<StateStore> store = *StateStore::Create(*storage, o);
  std::vector<std::byte> buffer(store->ExtentBufferBytes());
  for (size_t i = 0; i < buffer.size(); ++i) buffer[i] = static_cast<std::byte>(i * 131);
  const std::span<const std::byte> b(buffer);
  double hash_sec = 0, base_sec = 0;
  for (auto _ : state) {
    const auto t0 = std::chrono::steady_clock::now();
    benchmark::DoNotOptimize(store->PayloadHash(b));
    const auto t1 = std::chrono::steady_clock::now();
    benchmark::DoNotOptimize(
        XXH3_64bits(buffer.data() + StateStore::kHeaderBytes, kExtentBytes));
    const auto t2 = std::chrono::steady_clock::now();
    hash_sec += std::chrono::duration<double>(t1 - t0).count();
    base_sec += std::chrono::duration<double>(t2 - t1).count();
  }
  const double n = static_cast<double>(state.iterations()) * kExtentBytes;
  state.counters["GBps"] = n / hash_sec * 1e-9;
  state.counters["base_GBps"] = n / base_sec * 1e-9;
}
BENCHMARK(BM_PayloadHash)
    ->ArgName("threads")
    ->Arg(0)
    ->DenseRange(1, static_cast<int>(std::max(1u, std::thread::hardware_concurrency())))
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();

}  // namespace
}  // namespace strata

BENCHMARK_MAIN();
