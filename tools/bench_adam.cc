// `strata bench adam`: throughput of the fused CPU Adam step against a
// streaming baseline with exactly the same memory traffic, measured in the
// same run, interleaved.
#include <fmt/format.h>
#include <sys/mman.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "cpu_adam/cpu_adam.h"
#include "runtime/dtype.h"
#include "runtime/machine.h"
#include "runtime/units.h"
#include "tools/baselines.h"
#include "tools/cli.h"

namespace strata::cli {

Result<HostArray> HostArray::Create(size_t bytes, std::string_view name) {
  constexpr size_t kAlign = 2 * kMiB;
  const size_t rounded = std::max(kAlign, (bytes + kAlign - 1) / kAlign * kAlign);
  void* p = std::aligned_alloc(kAlign, rounded);
  if (p == nullptr) {
    return ResourceExhaustedError(
        fmt::format("allocate {} ({}): out of memory; lower --params", name, FormatBytes(bytes)));
  }
  madvise(p, rounded, MADV_HUGEPAGE);  // advisory: failure only costs TLB misses
  HostArray a;
  a.data_.reset(static_cast<std::byte*>(p));
  a.bytes_ = bytes;
  return a;
}

void HostArray::Free::operator()(std::byte* p) const { std::free(p); }

namespace {

struct Options {
  std::string params = "256M";
  int threads = 0;
  std::string grad = "bf16";
  std::string out = "bf16";
  int warmup = 2;
  int steps = 7;
  bool json = false;
};

Status Run(const Options& o) {
  STRATA_ASSIGN_OR_RETURN(const uint64_t n64, ParseCount(o.params));
  if (n64 == 0) return InvalidArgumentError("--params 0: the benchmark needs at least one param");
  const size_t n = static_cast<size_t>(n64);
  STRATA_ASSIGN_OR_RETURN(const DType grad_dtype, ParseDType(o.grad));
  const bool out_none = o.out == "none";
  DType out_dtype = DType::kBF16;
  if (!out_none) {
    STRATA_ASSIGN_OR_RETURN(out_dtype, ParseDType(o.out));
  }
  STRATA_ASSIGN_OR_RETURN(auto opt, CpuAdam::Create({.threads = o.threads}));

  const size_t grad_bytes = DTypeSize(grad_dtype);
  const size_t out_bytes = out_none ? 0 : DTypeSize(out_dtype);
  // Traffic per step: the grad read, the fp32 param and moments read and
  // written, the output written. Held: one of each.
  const size_t bytes_per_param = grad_bytes + 3 * 4 * 2 + out_bytes;
  const size_t held_per_param = 3 * 4 + grad_bytes + out_bytes;
  std::fprintf(stderr,
               "bench adam: allocating %s for %s param%s (%zu B/param: fp32 param, exp_avg and "
               "exp_avg_sq, %s grad%s; a step moves %zu B/param) ...\n",
               FormatBytes(n * held_per_param).c_str(), FormatCount(n).c_str(), n == 1 ? "" : "s",
               held_per_param, std::string(DTypeName(grad_dtype)).c_str(),
               out_none ? "" : fmt::format(", {} out", DTypeName(out_dtype)).c_str(),
               bytes_per_param);
  // Refused before it is allocated: memory is overcommitted, so the arrays
  // would be taken, and past a container's limit the kernel kills the process
  // without a word when they are filled.
  if (Result<HostMemory> mem = ProbeHostMemory();
      mem.ok() && n * held_per_param > mem->available_bytes) {
    return ResourceExhaustedError(fmt::format(
        "--params {}: {} of arrays but {} of memory is available{}; lower --params",
        o.params, FormatBytes(n * held_per_param), FormatBytes(mem->available_bytes),
        mem->limit_note()));
  }
  STRATA_ASSIGN_OR_RETURN(HostArray p, HostArray::Create(n * 4, "params"));
  STRATA_ASSIGN_OR_RETURN(HostArray m, HostArray::Create(n * 4, "exp_avg"));
  STRATA_ASSIGN_OR_RETURN(HostArray v, HostArray::Create(n * 4, "exp_avg_sq"));
  STRATA_ASSIGN_OR_RETURN(HostArray g, HostArray::Create(n * grad_bytes, "grad"));
  std::optional<HostArray> out;
  if (!out_none) {
    STRATA_ASSIGN_OR_RETURN(out, HostArray::Create(n * out_bytes, "out"));
  }
  std::fprintf(stderr, "bench adam: initializing ...\n");
  {
    auto ps = p.As<float>();
    auto gs = g.data();
    for (size_t i = 0; i < n; ++i) {
      // Small, varied, normal (never subnormal) values.
      const float x = static_cast<float>((i * 2654435761u) % 2000u) * 1e-3f - 1.0f;
      ps[i] = x;
      const float gx = x * 1e-2f + 1e-3f;
      switch (grad_dtype) {
        case DType::kF16:
          reinterpret_cast<uint16_t*>(gs)[i] = F32ToF16(gx);
          break;
        case DType::kBF16:
          reinterpret_cast<uint16_t*>(gs)[i] = F32ToBF16(gx);
          break;
        default:
          reinterpret_cast<float*>(gs)[i] = gx;
          break;
      }
    }
    std::memset(m.data(), 0, n * 4);
    std::memset(v.data(), 0, n * 4);
    if (out) std::memset(out->data(), 0, n * out_bytes);
  }
  const AdamState state{p.As<float>(), m.As<float>(), v.As<float>()};
  const GradView gv{grad_dtype, g.data(), n};
  const OutView ov = out_none ? OutView::None() : OutView{out_dtype, out->data(), n};

  AdamHyper h{.lr = 1e-4, .weight_decay = 0.01};
  int64_t step = 0;
  auto time_step = [&]() -> Result<double> {
    h.step = ++step;
    const auto t0 = std::chrono::steady_clock::now();
    STRATA_RETURN_IF_ERROR(opt->Step(h, state, gv, ov));
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  };
  auto time_baseline = [&]() -> Result<double> {
    const auto t0 = std::chrono::steady_clock::now();
    STRATA_RETURN_IF_ERROR(opt->TrafficBaseline(state, gv, ov));
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  };
  std::fprintf(stderr, "bench adam: %d warm-up + %d timed steps, %d threads, target %s ...\n",
               o.warmup, o.steps, opt->threads(), std::string(CpuAdamTargetName()).c_str());
  for (int i = 0; i < o.warmup; ++i) {
    STRATA_RETURN_IF_ERROR(time_step().status());
    STRATA_RETURN_IF_ERROR(time_baseline().status());
  }
  std::vector<double> kernel_s, baseline_s;
  for (int i = 0; i < o.steps; ++i) {
    // Alternate which goes first so drift hurts neither side.
    if (i % 2 == 0) {
      STRATA_ASSIGN_OR_RETURN(double k, time_step());
      STRATA_ASSIGN_OR_RETURN(double b, time_baseline());
      kernel_s.push_back(k);
      baseline_s.push_back(b);
    } else {
      STRATA_ASSIGN_OR_RETURN(double b, time_baseline());
      STRATA_ASSIGN_OR_RETURN(double k, time_step());
      kernel_s.push_back(k);
      baseline_s.push_back(b);
    }
  }
  const double k_best = *std::min_element(kernel_s.begin(), kernel_s.end());
  const double b_best = *std::min_element(baseline_s.begin(), baseline_s.end());
  const double k_med = Median(kernel_s), b_med = Median(baseline_s);
  const double bytes = static_cast<double>(n) * static_cast<double>(bytes_per_param);
  const double params_per_sec = static_cast<double>(n) / k_best;
  const double bytes_per_sec = bytes / k_best;
  const double baseline_bytes_per_sec = bytes / b_best;
  const double ratio = bytes_per_sec / baseline_bytes_per_sec;
  if (!std::isfinite(state.params[n / 2])) {
    return InternalError("bench adam: params became non-finite; the benchmark input is broken");
  }
  if (o.json) {
    nlohmann::json j = {
        {"params", n},
        {"threads", opt->threads()},
        {"target", std::string(CpuAdamTargetName())},
        {"grad", std::string(DTypeName(grad_dtype))},
        {"out", out_none ? std::string("none") : std::string(DTypeName(out_dtype))},
        {"steps", o.steps},
        {"params_per_sec", params_per_sec},
        {"bytes_per_param", bytes_per_param},
        {"bytes_per_sec", bytes_per_sec},
        {"baseline_bytes_per_sec", baseline_bytes_per_sec},
        {"ratio_to_baseline", ratio},
        {"step_seconds_best", k_best},
        {"step_seconds_median", k_med},
        {"baseline_seconds_best", b_best},
        {"baseline_seconds_median", b_med},
        {"ratio_to_baseline_median", b_med / k_med},
    };
    PrintJson(j);
  } else {
    std::printf("cpu adam: %s params, grad %s, out %s, %d threads, target %s\n",
                FormatCount(n).c_str(), std::string(DTypeName(grad_dtype)).c_str(),
                out_none ? "none" : std::string(DTypeName(out_dtype)).c_str(), opt->threads(),
                std::string(CpuAdamTargetName()).c_str());
    std::printf("  %-22s %12s %12s %14s\n", "", "best", "median", "best rate");
    std::printf("  %-22s %12s %12s %14s  %.3g params/s\n", "adamw step",
                FormatSeconds(k_best).c_str(), FormatSeconds(k_med).c_str(),
                FormatRate(bytes_per_sec).c_str(), params_per_sec);
    std::printf("  %-22s %12s %12s %14s\n", "baseline (same traffic)",
                FormatSeconds(b_best).c_str(), FormatSeconds(b_med).c_str(),
                FormatRate(baseline_bytes_per_sec).c_str());
    std::printf("  bytes/param %zu, ratio to baseline %.3f (best of %d), %.3f (median)\n",
                bytes_per_param, ratio, o.steps, b_med / k_med);
  }
  return OkStatus();
}

}  // namespace

void AddBenchAdamCommand(Cli& cli) {
  auto o = std::make_shared<Options>();
  CLI::App* cmd = cli.bench->add_subcommand(
      "adam", "CPU AdamW step throughput vs a streaming baseline with the same memory traffic");
  cmd->add_option("--params", o->params, "Parameters per step (256M, 1.5B, ...)")
      ->capture_default_str();
  cmd->add_option("--threads", o->threads, "Threads (0: every hardware thread)")
      ->capture_default_str()
      ->check(Within(0, 4096));
  cmd->add_option("--grad", o->grad, "Gradient dtype")
      ->capture_default_str()
      ->check(CLI::IsMember({"fp32", "fp16", "bf16"}));
  cmd->add_option("--out", o->out, "Output param dtype")
      ->capture_default_str()
      ->check(CLI::IsMember({"bf16", "fp16", "fp32", "none"}));
  cmd->add_option("--warmup", o->warmup, "Untimed steps first")
      ->capture_default_str()
      ->check(Within(0, 100));
  cmd->add_option("--steps", o->steps, "Timed steps (each also times the baseline)")
      ->capture_default_str()
      ->check(Within(1, 1000));
  cmd->add_flag("--json", o->json, "Print one JSON object on stdout");
  cmd->callback(
      [&cli, o] { RunAction(cli, "bench adam", OutputOf(o->json), [o] { return Run(*o); }); });
}

}  // namespace strata::cli
