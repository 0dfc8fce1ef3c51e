// `strata bench pcie`: host <-> device copy throughput through the Device
// interface (pinned and pageable host memory, each direction alone and both
// at once) over a sweep of sizes, against the best plain copy measured in
// the same run (cudaMemcpyAsync on CUDA, memcpy under the link model on the
// host device), and the engine's own transfers: the D2H of gradients and
// the H2D of params of real OffloadOptimizer steps.
#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "offload/optimizer.h"
#include "runtime/device.h"
#include "runtime/dtype.h"
#include "runtime/units.h"
#include "tools/baselines.h"
#include "tools/cli.h"

#if STRATA_HAVE_CUDA
#include <cuda_runtime_api.h>
#endif

namespace strata::cli {
namespace {

constexpr double kTargetRatio = 0.90;

struct Options {
  std::string device = "auto";
  std::vector<std::string> sizes = {"64KiB", "256KiB", "1MiB", "4MiB", "16MiB", "64MiB"};
  std::string volume = "256MiB";  // bytes moved per measurement (at least 4 copies)
  int repeats = 3;                // best of
  std::string engine_params = "32M";
  double link_gbps = 0;     // host device: GB/s per direction (0: unlimited)
  double latency_us = 0;    // host device: per copy
  bool json = false;
};

double Now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

struct Copy {
  void* dst;
  const void* src;
  CopyKind kind;
  StreamRef stream;
};

// Seconds for `count` back-to-back copies of `bytes` on each of `copies`
// (all running at once, one stream each), best of `repeats`.
Result<double> TimeCopies(Device& dev, std::span<const Copy> copies, size_t bytes, int count,
                          int repeats) {
  double best = 1e300;
  for (int r = 0; r < repeats; ++r) {
    const double t0 = Now();
    for (int i = 0; i < count; ++i) {
      for (const Copy& c : copies) {
        STRATA_RETURN_IF_ERROR(dev.CopyAsync(c.dst, c.src, bytes, c.kind, c.stream));
      }
    }
    for (const Copy& c : copies) STRATA_RETURN_IF_ERROR(dev.StreamSynchronize(c.stream));
    best = std::min(best, Now() - t0);
  }
  return best;
}

// The plain copy the Device figures are compared with.
class Baseline {
 public:
  virtual ~Baseline() = default;
  // Seconds for `count` copies of `bytes` in one direction, best of `repeats`.
  virtual Result<double> Seconds(size_t bytes, CopyKind kind, int count, int repeats) = 0;
  virtual std::string_view name() const = 0;
};

// Host device: memcpy between the same kind of buffers, bounded by the link
// model (rate and latency) the device was given.
class MemcpyBaseline : public Baseline {
 public:
  MemcpyBaseline(size_t max_bytes, double rate, double latency)
      : a_(max_bytes), b_(max_bytes), rate_(rate), latency_(latency) {
    std::memset(a_.data(), 1, max_bytes);
    std::memset(b_.data(), 2, max_bytes);
  }
  Result<double> Seconds(size_t bytes, CopyKind, int count, int repeats) override {
    double best = 1e300;
    for (int r = 0; r < repeats; ++r) {
      const double t0 = Now();
      for (int i = 0; i < count; ++i) std::memcpy(b_.data(), a_.data(), bytes);
      best = std::min(best, Now() - t0);
    }
    const double link = rate_ > 0 ? count * (static_cast<double>(bytes) / rate_ + latency_)
                                  : count * latency_;
    return std::max(best, link);
  }
  std::string_view name() const override { return "memcpy under the link model"; }

 private:
  std::vector<std::byte> a_, b_;
  double rate_, latency_;
};

#if STRATA_HAVE_CUDA
Status CudaCheck(cudaError_t e, std::string_view what) {
  if (e == cudaSuccess) return OkStatus();
  return InternalError(fmt::format("bench pcie baseline: {}: {}", what, cudaGetErrorString(e)));
}

// CUDA: cudaMemcpyAsync between cudaHostAlloc and cudaMalloc memory on one
// stream, timed with CUDA events.
class CudaBaseline : public Baseline {
 public:
  static Result<std::unique_ptr<CudaBaseline>> Create(int ordinal, size_t max_bytes) {
    auto b = std::unique_ptr<CudaBaseline>(new CudaBaseline);
    STRATA_RETURN_IF_ERROR(CudaCheck(cudaSetDevice(ordinal), "cudaSetDevice"));
    STRATA_RETURN_IF_ERROR(CudaCheck(cudaHostAlloc(&b->host_, max_bytes, 0), "cudaHostAlloc"));
    STRATA_RETURN_IF_ERROR(CudaCheck(cudaMalloc(&b->dev_, max_bytes), "cudaMalloc"));
    STRATA_RETURN_IF_ERROR(CudaCheck(cudaStreamCreate(&b->stream_), "cudaStreamCreate"));
    STRATA_RETURN_IF_ERROR(CudaCheck(cudaEventCreate(&b->start_), "cudaEventCreate"));
    STRATA_RETURN_IF_ERROR(CudaCheck(cudaEventCreate(&b->stop_), "cudaEventCreate"));
    return b;
  }
  ~CudaBaseline() override {
    if (start_) cudaEventDestroy(start_);
    if (stop_) cudaEventDestroy(stop_);
    if (stream_) cudaStreamDestroy(stream_);
    if (dev_) cudaFree(dev_);
    if (host_) cudaFreeHost(host_);
  }
  Result<double> Seconds(size_t bytes, CopyKind kind, int count, int repeats) override {
    const bool h2d = kind == CopyKind::kHostToDevice;
    void* dst = h2d ? dev_ : host_;
    const void* src = h2d ? host_ : dev_;
    const cudaMemcpyKind k = h2d ? cudaMemcpyHostToDevice : cudaMemcpyDeviceToHost;
    double best = 1e300;
    for (int r = 0; r < repeats; ++r) {
      STRATA_RETURN_IF_ERROR(CudaCheck(cudaEventRecord(start_, stream_), "cudaEventRecord"));
      for (int i = 0; i < count; ++i) {
        STRATA_RETURN_IF_ERROR(
            CudaCheck(cudaMemcpyAsync(dst, src, bytes, k, stream_), "cudaMemcpyAsync"));
      }
      STRATA_RETURN_IF_ERROR(CudaCheck(cudaEventRecord(stop_, stream_), "cudaEventRecord"));
      STRATA_RETURN_IF_ERROR(CudaCheck(cudaEventSynchronize(stop_), "cudaEventSynchronize"));
      float ms = 0;
      STRATA_RETURN_IF_ERROR(CudaCheck(cudaEventElapsedTime(&ms, start_, stop_), "elapsed"));
      best = std::min(best, ms * 1e-3);
    }
    return best;
  }
  std::string_view name() const override { return "cudaMemcpyAsync, pinned"; }

 private:
  CudaBaseline() = default;
  void* host_ = nullptr;
  void* dev_ = nullptr;
  cudaStream_t stream_ = nullptr;
  cudaEvent_t start_ = nullptr, stop_ = nullptr;
};
#endif

Result<std::unique_ptr<Baseline>> MakeBaseline(const Device& dev, size_t max_bytes,
                                               double rate, double latency) {
  if (dev.caps().kind == DeviceKind::kHost) {
    return std::unique_ptr<Baseline>(new MemcpyBaseline(max_bytes, rate, latency));
  }
#if STRATA_HAVE_CUDA
  STRATA_ASSIGN_OR_RETURN(auto b, CudaBaseline::Create(dev.caps().ordinal, max_bytes));
  return std::unique_ptr<Baseline>(std::move(b));
#else
  return UnavailableError("bench pcie: this build has no CUDA baseline");
#endif
}

struct Point {
  size_t bytes = 0;
  int count = 0;
  double h2d = 0, d2h = 0;                    // pinned, bytes/s
  double h2d_pageable = 0, d2h_pageable = 0;  // bytes/s
  double both = 0;                            // both directions at once, bytes/s in total
  double overlap = 0;  // (H2D alone + D2H alone) / both at once: 2 = full overlap, 1 = none
  double base_h2d = 0, base_d2h = 0;
};

struct EngineFigures {
  uint64_t params = 0;
  uint32_t sub_groups = 0;  // copies per direction per step
  double step_sec = 0;
  double d2h = 0, h2d = 0;  // bytes/s while the stage was busy (best step)
  uint64_t d2h_bytes = 0, h2d_bytes = 0;
  double base_d2h = 0, base_h2d = 0;  // the baseline for copies of the same sizes
};

// Real steps of an all-DRAM optimizer over `params` bf16 params: what the
// engine's own grad D2H and param H2D reach.
Result<EngineFigures> MeasureEngine(Device& dev, uint64_t params, int steps) {
  std::vector<uint16_t> host(params);
  for (uint64_t i = 0; i < params; ++i) {
    host[i] = F32ToBF16(static_cast<float>((i * 2654435761u) % 2000u) * 1e-3f - 1.0f);
  }
  STRATA_ASSIGN_OR_RETURN(DeviceBuffer data, dev.Allocate(params * 2));
  STRATA_ASSIGN_OR_RETURN(DeviceBuffer grad, dev.Allocate(params * 2));
  StreamRef s = dev.DefaultStream();
  STRATA_RETURN_IF_ERROR(
      dev.CopyAsync(data.data(), host.data(), params * 2, CopyKind::kHostToDevice, s));
  for (uint16_t& g : host) g = F32ToBF16(1e-3f);
  STRATA_RETURN_IF_ERROR(
      dev.CopyAsync(grad.data(), host.data(), params * 2, CopyKind::kHostToDevice, s));
  STRATA_RETURN_IF_ERROR(dev.StreamSynchronize(s));

  OffloadConfig config;
  config.param_dtype = DType::kBF16;
  config.grad_dtype = DType::kBF16;
  config.max_grad_norm = 0;
  config.sub_group_elems = std::max<uint64_t>(params / 8, 1);
  std::vector<ParamGroup> groups(1);
  groups[0].params.push_back(
      {.name = "bench", .data = data.data(), .grad = grad.data(), .elems = params});
  STRATA_ASSIGN_OR_RETURN(auto opt, OffloadOptimizer::Create({.device = &dev, .stream = {}}, config, groups));
  EngineFigures f{.params = params,
                  .sub_groups = static_cast<uint32_t>(opt->sub_groups().size()),
                  .step_sec = 1e300};
  for (int i = 0; i < steps + 1; ++i) {
    STRATA_RETURN_IF_ERROR(opt->Step());  // the grads stay: every step reduces them again
    const StepStats& st = opt->last_step();
    if (i == 0) continue;  // warm-up
    f.step_sec = std::min(f.step_sec, st.times.step);
    if (st.times.d2h > 0) f.d2h = std::max(f.d2h, st.d2h_bytes / st.times.d2h);
    if (st.times.h2d > 0) f.h2d = std::max(f.h2d, st.h2d_bytes / st.times.h2d);
    f.d2h_bytes = st.d2h_bytes;
    f.h2d_bytes = st.h2d_bytes;
  }
  return f;
}

Status Run(const Options& o) {
  const double link = o.link_gbps * 1e9, latency = o.latency_us * 1e-6;
  STRATA_ASSIGN_OR_RETURN(
      auto dev, OpenDevice(o.device, {.h2d_bytes_per_sec = link, .d2h_bytes_per_sec = link,
                                      .copy_latency_sec = latency}));
  std::vector<size_t> sizes;
  for (const std::string& s : o.sizes) {
    STRATA_ASSIGN_OR_RETURN(uint64_t b, ParseBytes(s));
    if (b == 0) return InvalidArgumentError("--sizes: a size of 0 bytes measures nothing");
    sizes.push_back(b);
  }
  STRATA_ASSIGN_OR_RETURN(const uint64_t volume, ParseBytes(o.volume));
  STRATA_ASSIGN_OR_RETURN(const uint64_t engine_params, ParseCount(o.engine_params));
  const size_t max_bytes = *std::max_element(sizes.begin(), sizes.end());
  if (dev->caps().kind != DeviceKind::kHost && (o.link_gbps > 0 || o.latency_us > 0)) {
    return InvalidArgumentError(fmt::format(
        "--link-gbps and --latency-us model a link on the host device; {} has a real one: drop them",
        dev->name()));
  }

  std::fprintf(stderr, "bench pcie: %s (%s), buffers of %s ...\n", dev->name().c_str(),
               dev->caps().description.c_str(), FormatBytes(max_bytes).c_str());
  STRATA_ASSIGN_OR_RETURN(DeviceBuffer d1, dev->Allocate(max_bytes));
  STRATA_ASSIGN_OR_RETURN(DeviceBuffer d2, dev->Allocate(max_bytes));
  // The engine copies one sub-group (an eighth of its params) at a time:
  // fp32 grads down, params up.
  const uint64_t engine_copy_max = std::max<uint64_t>(engine_params / 8, 1) * 4;
  STRATA_ASSIGN_OR_RETURN(HostAllocation p1, dev->AllocateHost(max_bytes));
  STRATA_ASSIGN_OR_RETURN(HostAllocation p2, dev->AllocateHost(max_bytes));
  std::vector<std::byte> g1(max_bytes, std::byte{1}), g2(max_bytes, std::byte{2});
  std::memset(p1.data(), 3, max_bytes);
  std::memset(p2.data(), 4, max_bytes);
  STRATA_ASSIGN_OR_RETURN(Stream up, dev->CreateStream());
  STRATA_ASSIGN_OR_RETURN(Stream down, dev->CreateStream());
  STRATA_ASSIGN_OR_RETURN(auto base, MakeBaseline(*dev, std::max<uint64_t>(max_bytes, engine_copy_max), link, latency));

  std::vector<Point> points;
  for (size_t bytes : sizes) {
    std::fprintf(stderr, "bench pcie: %s copies ...\n", FormatBytes(bytes).c_str());
    Point p{.bytes = bytes, .count = static_cast<int>(std::max<uint64_t>(4, volume / bytes))};
    const Copy h2d{d1.data(), p1.data(), CopyKind::kHostToDevice, up};
    const Copy d2h{p2.data(), d2.data(), CopyKind::kDeviceToHost, down};
    const Copy h2d_pageable{d1.data(), g1.data(), CopyKind::kHostToDevice, up};
    const Copy d2h_pageable{g2.data(), d2.data(), CopyKind::kDeviceToHost, down};
    const double moved = static_cast<double>(bytes) * p.count;
    auto rate = [&](std::initializer_list<Copy> copies) -> Result<double> {
      STRATA_RETURN_IF_ERROR(TimeCopies(*dev, {copies.begin(), copies.size()}, bytes, 1, 1).status());
      STRATA_ASSIGN_OR_RETURN(double sec, TimeCopies(*dev, {copies.begin(), copies.size()}, bytes,
                                                     p.count, o.repeats));
      return moved * static_cast<double>(copies.size()) / sec;
    };
    STRATA_ASSIGN_OR_RETURN(p.h2d, rate({h2d}));
    STRATA_ASSIGN_OR_RETURN(p.d2h, rate({d2h}));
    STRATA_ASSIGN_OR_RETURN(p.h2d_pageable, rate({h2d_pageable}));
    STRATA_ASSIGN_OR_RETURN(p.d2h_pageable, rate({d2h_pageable}));
    STRATA_ASSIGN_OR_RETURN(p.both, rate({h2d, d2h}));
    p.overlap = (moved / p.h2d + moved / p.d2h) / (2 * moved / p.both);
    STRATA_ASSIGN_OR_RETURN(double bh, base->Seconds(bytes, CopyKind::kHostToDevice, p.count,
                                                     o.repeats));
    STRATA_ASSIGN_OR_RETURN(double bd, base->Seconds(bytes, CopyKind::kDeviceToHost, p.count,
                                                     o.repeats));
    p.base_h2d = moved / bh;
    p.base_d2h = moved / bd;
    points.push_back(p);
  }
  double best_h2d = 0, best_d2h = 0;
  for (const Point& p : points) {
    best_h2d = std::max(best_h2d, p.base_h2d);
    best_d2h = std::max(best_d2h, p.base_d2h);
  }
  std::optional<EngineFigures> engine;
  if (engine_params > 0) {
    std::fprintf(stderr, "bench pcie: engine steps over %s bf16 params ...\n",
                 FormatCount(engine_params).c_str());
    STRATA_ASSIGN_OR_RETURN(engine, MeasureEngine(*dev, engine_params, 3));
    const int n = static_cast<int>(engine->sub_groups);
    const size_t down = engine->d2h_bytes / n, up_bytes = engine->h2d_bytes / n;
    STRATA_ASSIGN_OR_RETURN(double bd, base->Seconds(down, CopyKind::kDeviceToHost, n, o.repeats));
    STRATA_ASSIGN_OR_RETURN(double bh,
                            base->Seconds(up_bytes, CopyKind::kHostToDevice, n, o.repeats));
    engine->base_d2h = static_cast<double>(engine->d2h_bytes) / bd;
    engine->base_h2d = static_cast<double>(engine->h2d_bytes) / bh;
  }

  if (o.json) {
    nlohmann::json j = {{"device", dev->name()},
                        {"description", dev->caps().description},
                        {"baseline", std::string(base->name())},
                        {"baseline_h2d_best", best_h2d},
                        {"baseline_d2h_best", best_d2h},
                        {"target_ratio", kTargetRatio}};
    for (const Point& p : points) {
      j["points"].push_back({{"bytes", p.bytes},
                             {"copies", p.count},
                             {"h2d_pinned", p.h2d},
                             {"d2h_pinned", p.d2h},
                             {"h2d_pageable", p.h2d_pageable},
                             {"d2h_pageable", p.d2h_pageable},
                             {"both_directions", p.both},
                             {"overlap", p.overlap},
                             {"baseline_h2d", p.base_h2d},
                             {"baseline_d2h", p.base_d2h}});
    }
    if (engine) {
      j["engine"] = {{"params", engine->params},
                     {"step_sec", engine->step_sec},
                     {"d2h_bytes", engine->d2h_bytes},
                     {"h2d_bytes", engine->h2d_bytes},
                     {"d2h", engine->d2h},
                     {"h2d", engine->h2d},
                     {"baseline_d2h", engine->base_d2h},
                     {"baseline_h2d", engine->base_h2d},
                     {"d2h_ratio", engine->d2h / engine->base_d2h},
                     {"h2d_ratio", engine->h2d / engine->base_h2d}};
    }
    PrintJson(j);
    return OkStatus();
  }
  std::printf("pcie: %s (%s); baseline: %s, best of %d\n", dev->name().c_str(),
              dev->caps().description.c_str(), std::string(base->name()).c_str(), o.repeats);
  std::printf("  %10s %11s %11s %11s %11s %11s %8s %11s %11s\n", "size", "H2D pinned",
              "D2H pinned", "H2D pageabl", "D2H pageabl", "both", "overlap", "base H2D",
              "base D2H");
  for (const Point& p : points) {
    std::printf("  %10s %11s %11s %11s %11s %11s %8.2f %11s %11s\n", FormatBytes(p.bytes).c_str(),
                FormatRate(p.h2d).c_str(), FormatRate(p.d2h).c_str(),
                FormatRate(p.h2d_pageable).c_str(), FormatRate(p.d2h_pageable).c_str(),
                FormatRate(p.both).c_str(), p.overlap, FormatRate(p.base_h2d).c_str(),
                FormatRate(p.base_d2h).c_str());
  }
  std::printf("  overlap: time of H2D alone + D2H alone over both at once (2.00 = full)\n");
  if (engine) {
    auto verdict = [](double r) { return r >= kTargetRatio ? "meets" : "below"; };
    std::printf("engine (%s bf16 params, step %s):\n", FormatCount(engine->params).c_str(),
                FormatSeconds(engine->step_sec).c_str());
    auto row = [&](const char* what, uint64_t bytes, double rate, double base_rate) {
      std::printf("  %-10s %s in %u copies: %11s, baseline %11s: %.3f (%s the %.2f target)\n",
                  what, FormatBytes(bytes).c_str(), engine->sub_groups, FormatRate(rate).c_str(),
                  FormatRate(base_rate).c_str(), rate / base_rate, verdict(rate / base_rate),
                  kTargetRatio);
    };
    row("grads D2H", engine->d2h_bytes, engine->d2h, engine->base_d2h);
    row("params H2D", engine->h2d_bytes, engine->h2d, engine->base_h2d);
  }
  return OkStatus();
}

}  // namespace

Result<LinkRates> MeasureLinkRates(Device& device, size_t bytes) {
  STRATA_ASSIGN_OR_RETURN(HostAllocation host, device.AllocateHost(bytes));
  STRATA_ASSIGN_OR_RETURN(DeviceBuffer dev, device.Allocate(bytes));
  std::memset(host.data(), 1, bytes);
  STRATA_ASSIGN_OR_RETURN(Stream stream, device.CreateStream());
  constexpr int kCount = 4, kRepeats = 3;
  const Copy up{dev.data(), host.data(), CopyKind::kHostToDevice, stream};
  const Copy down{host.data(), dev.data(), CopyKind::kDeviceToHost, stream};
  STRATA_ASSIGN_OR_RETURN(double h2d, TimeCopies(device, std::span(&up, 1), bytes, kCount, kRepeats));
  STRATA_ASSIGN_OR_RETURN(double d2h,
                          TimeCopies(device, std::span(&down, 1), bytes, kCount, kRepeats));
  const double moved = static_cast<double>(bytes) * kCount;
  return LinkRates{.h2d_bytes_per_sec = moved / h2d, .d2h_bytes_per_sec = moved / d2h};
}

void AddBenchPcieCommand(Cli& cli) {
  auto o = std::make_shared<Options>();
  CLI::App* cmd = cli.bench->add_subcommand(
      "pcie", "Host<->device copy throughput (pinned, pageable, both ways) vs a plain-copy "
              "baseline, and the engine's own transfers");
  cmd->add_option("--device", o->device, "auto, host or cuda:N")->capture_default_str();
  cmd->add_option("--sizes", o->sizes, "Copy sizes to sweep")->delimiter(',')->capture_default_str();
  cmd->add_option("--volume", o->volume, "Bytes moved per measurement (at least 4 copies)")
      ->capture_default_str();
  cmd->add_option("--repeats", o->repeats, "Best of this many measurements")
      ->capture_default_str()
      ->check(Within(1, 100));
  cmd->add_option("--engine-params", o->engine_params,
                  "Params of the engine measurement (0: skip it)")
      ->capture_default_str();
  cmd->add_option("--link-gbps", o->link_gbps,
                  "Host device only: modelled link rate per direction, GB/s (0: unlimited)")
      ->check(Within(0.0, 1e6));
  cmd->add_option("--latency-us", o->latency_us, "Host device only: modelled latency per copy")
      ->check(Within(0.0, 1e6));
  cmd->add_flag("--json", o->json, "Print one JSON object on stdout");
  cmd->callback(
      [&cli, o] { RunAction(cli, "bench pcie", OutputOf(o->json), [o] { return Run(*o); }); });
}

}  // namespace strata::cli
