// `strata bench step`: whole optimizer steps of OffloadOptimizer on the host
// device (the embedded default: no GPU needed), with part of the state on
// NVMe, and how well the pipeline overlaps its stages.
//
// The judge is the machine, measured in the same run before the optimizer
// exists: the link each way alone (pinned copies on the device), the CPU's
// stream rate for the optimizer's own traffic (CpuAdam::TrafficBaseline, as
// `bench adam`), and the drive's read and write rates alone at the engine's
// block size and queue depth on the same directories (as `bench nvme`). The
// step's lower bound bound_sec is the largest of: PCIe bytes each way / the
// link's rate, the optimizer's DRAM bytes / the stream rate, NVMe read bytes /
// read rate + write bytes / write rate (one drive serves both), and
// "together": the step's link and CPU work (and device Adam) run at once
// after the steps, which is longer than each alone where they share the
// machine (on the host device the link is memcpy in the same DRAM);
// bound_efficiency = bound_sec / the overlapped step time (medians over
// rounds), and nvme_efficiency = the NVMe part of the bound / the NVMe busy
// time in the overlapped step.
//
// Every round also runs one step with PipelineMode::kSerial (each stage
// alone, nothing else running), on the same optimizer, in alternating order:
// overlap_efficiency = (the largest resource busy time of the serial step) /
// (the overlapped step time) says how well the stages overlap, but not how
// fast each runs (it is 1.0 for an engine whose stages all run at half the
// machine's speed): read it beside bound_efficiency. With --trace, each round
// runs one more overlapped step with the trace recorder on (written to FILE,
// and its cost reported as trace_overhead). docs/guide.md says how to read the
// output; docs/perf/step.md has measured results.
//
// With --gpu-fraction F (partial offload) part of the state is updated by the
// device Adam beside the CPU: its baseline is kernels::AdamStep alone on the
// device over a probe buffer, its bound the device share's bytes at that
// rate, and the text names both sides' busy times.
#include <fmt/format.h>
#include <stdlib.h>
#include <unistd.h>

#include <algorithm>
#include <barrier>
#include <chrono>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <set>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "offload/config.h"
#include "offload/layout.h"
#include "offload/optimizer.h"
#include "cpu_adam/cpu_adam.h"
#include "offload/placement.h"
#include "offload/rate_probe.h"
#include "runtime/comm.h"
#include "runtime/device.h"
#include "runtime/dtype.h"
#include "runtime/file_lock.h"
#include "runtime/machine.h"
#include "runtime/trace.h"
#include "runtime/units.h"
#include "tools/baselines.h"
#include "tools/cleanup.h"
#include "tools/cli.h"

namespace strata::cli {
namespace {

struct StepArgs {
  std::string config_path;
  std::string params = "64M";
  uint32_t tensors = 4;
  std::string offload = "nvme";
  std::string host_budget = "auto";
  std::string device_budget = "0";
  std::string gpu_fraction = "0";
  std::vector<std::string> nvme_dirs;
  int ranks = 1;
  int steps = 3;
  int warmup = 1;
  std::string sub_group = "4M";
  uint32_t buffer_count = 4;
  int threads = 0;
  std::string grad = "bf16";
  std::string param = "bf16";
  std::string block = "1MiB";
  uint32_t queue_depth = 8;
  std::string pcie_rate = "0";
  std::string device = "host";
  std::string trace_path;
  std::string drive_probe = "auto";
  bool backward = true;
  bool json = false;
  std::set<std::string> given;  // options given on the command line
};

// Without --config every option takes its default; with one, only the
// options given on the command line override the file.
bool Use(const StepArgs& a, const char* option) {
  return a.config_path.empty() || a.given.count(option) > 0;
}

// The checks a file written at the end needs, made before any work so a
// long run is not lost to a typo: the path is not a directory and its
// directory exists and takes new files (the trace is written to a temporary
// file there and renamed).
Status CheckOutputFile(const std::string& option, const std::string& path) {
  namespace fs = std::filesystem;
  std::error_code ec;
  if (fs::is_directory(path, ec)) {
    return InvalidArgumentError(
        fmt::format("{} {}: is a directory; give a file name in it", option, path));
  }
  const fs::path parent = fs::path(path).parent_path();
  const std::string dir = parent.empty() ? std::string(".") : parent.string();
  if (!fs::exists(dir, ec)) {
    return InvalidArgumentError(
        fmt::format("{} {}: the directory {} does not exist; create it or choose another path",
                    option, path, dir));
  }
  if (!fs::is_directory(dir, ec)) {
    return InvalidArgumentError(
        fmt::format("{} {}: {} is not a directory; choose another path", option, path, dir));
  }
  if (::access(dir.c_str(), W_OK | X_OK) != 0) {
    const int err = errno;
    return InvalidArgumentError(
        fmt::format("{} {}: cannot create files in {} ({}); choose a directory this user can write",
                    option, path, dir, std::strerror(err)));
  }
  return OkStatus();
}

// One rank's trainer tensors on the device.
struct RankModel {
  std::vector<DeviceBuffer> data, grad;
  std::vector<uint64_t> elems;
};

// Small, varied, finite values; the step's speed does not depend on them.
void Fill(void* dst, uint64_t n, DType dtype, float scale, uint64_t salt) {
  for (uint64_t i = 0; i < n; ++i) {
    const float x = (static_cast<float>(((i + salt) * 2654435761u) % 2000u) * 1e-3f - 1.0f) * scale;
    switch (dtype) {
      case DType::kF32:
        static_cast<float*>(dst)[i] = x;
        break;
      case DType::kBF16:
        static_cast<uint16_t*>(dst)[i] = F32ToBF16(x);
        break;
      default:
        static_cast<uint16_t*>(dst)[i] = F32ToF16(x);
        break;
    }
  }
}

// The per-step figures of one mode, slowest rank per stage.
struct StepSample {
  StageTimes times;  // max over ranks, stage by stage
  uint64_t read_bytes = 0, write_bytes = 0, d2h_bytes = 0, h2d_bytes = 0;  // sum over ranks
  uint64_t host_dram_bytes = 0;                                            // sum over ranks
  uint64_t resident_bytes = 0;  // NVMe reads skipped: still in the buffers (sum over ranks)
  uint64_t device_adam_bytes = 0;  // the device Adam's traffic (sum over ranks)
  double handover_sec = 0;  // the simulated backward's hand-over (slowest rank)
};

StepSample Combine(const std::vector<StepStats>& ranks) {
  StepSample s;
  for (const StepStats& r : ranks) {
    const StageTimes& t = r.times;
    s.times.d2h = std::max(s.times.d2h, t.d2h);
    s.times.comm = std::max(s.times.comm, t.comm);
    s.times.read = std::max(s.times.read, t.read);
    s.times.adam = std::max(s.times.adam, t.adam);
    s.times.grad_stats = std::max(s.times.grad_stats, t.grad_stats);
    s.times.write = std::max(s.times.write, t.write);
    s.times.nvme = std::max(s.times.nvme, t.nvme);
    s.times.h2d = std::max(s.times.h2d, t.h2d);
    s.times.device = std::max(s.times.device, t.device);
    s.times.device_adam = std::max(s.times.device_adam, t.device_adam);
    s.times.step = std::max(s.times.step, t.step);
    s.read_bytes += r.read_bytes;
    s.write_bytes += r.write_bytes;
    s.d2h_bytes += r.d2h_bytes;
    s.h2d_bytes += r.h2d_bytes;
    s.host_dram_bytes += r.host_dram_bytes;
    s.resident_bytes += r.resident_bytes;
  }
  return s;
}

// Busy time of each resource: NVMe = wall time with IO in flight (reads and
// writes share the drive).
struct Resources {
  double nvme = 0, cpu = 0, d2h = 0, h2d = 0, comm = 0, device = 0, device_adam = 0;
  static Resources Of(const StageTimes& t) {
    return {t.nvme, t.adam, t.d2h, t.h2d, t.comm, t.device, t.device_adam};
  }
  std::pair<std::string, double> Bottleneck() const {
    std::pair<std::string, double> b{"nvme", nvme};
    for (auto [name, v] : {std::pair<const char*, double>{"cpu", cpu},
                           {"d2h", d2h},
                           {"h2d", h2d},
                           {"comm", comm},
                           {"device", device},
                           {"device adam", device_adam}}) {
      if (v > b.second) b = {name, v};
    }
    return b;
  }
};

// What the machine allows for a step's traffic: each resource's time at the
// rate measured alone. The drive serves reads and writes in turn.
struct Rates {
  LinkRates link;
  double adam_bytes_per_sec = 0;  // CpuAdam::TrafficBaseline
  DriveRates drive;               // zero when there is no NVMe state (or --drive-probe 0)
  double device_adam_bytes_per_sec = 0;  // kernels::AdamStep alone (partial offload only)
};

// `together` is measured, not computed: MeasureTogether below.
struct Bound {
  double d2h = 0, h2d = 0, cpu = 0, nvme = 0, device_adam = 0, together = 0;
  static Bound Of(const StepSample& s, const Rates& r, double together_sec) {
    auto t = [](uint64_t bytes, double rate) { return rate > 0 ? bytes / rate : 0.0; };
    return {t(s.d2h_bytes, r.link.d2h_bytes_per_sec),
            t(s.h2d_bytes, r.link.h2d_bytes_per_sec),
            t(s.host_dram_bytes, r.adam_bytes_per_sec),
            t(s.read_bytes, r.drive.read_bytes_per_sec) +
                t(s.write_bytes, r.drive.write_bytes_per_sec),
            t(s.device_adam_bytes, r.device_adam_bytes_per_sec),
            together_sec};
  }
  // The largest term; with Terms::kAloneOnly, of the rates measured alone
  // (each resource as if nothing shared it).
  enum class Terms { kAll, kAloneOnly };
  std::pair<std::string, double> Max(Terms terms = Terms::kAll) const {
    std::pair<std::string, double> b{"cpu", cpu};
    for (auto [name, v] : {std::pair<const char*, double>{"d2h", d2h}, {"h2d", h2d},
                           {"nvme", nvme}, {"device adam", device_adam},
                           {"together", terms == Terms::kAll ? together : 0.0}}) {
      if (v > b.second) b = {name, v};
    }
    return b;
  }
};

// The CPU's stream for the optimizer's own traffic: TrafficBaseline (the same
// reads and writes, dtypes, chunks and threads as the Adam step, trivial
// arithmetic) over `elems` fresh params.
class AdamTraffic {
 public:
  static Result<AdamTraffic> Create(const OffloadConfig& config, uint64_t elems) {
    AdamTraffic t;
    STRATA_ASSIGN_OR_RETURN(t.adam_, CpuAdam::Create({.threads = config.threads}));
    t.n_ = static_cast<size_t>(std::max<uint64_t>(elems, 1));
    t.grad_dtype_ = config.grad_dtype;
    t.out_dtype_ = config.param_dtype;
    STRATA_ASSIGN_OR_RETURN(t.state_, HostArray::Create(3 * t.n_ * sizeof(float), "state"));
    STRATA_ASSIGN_OR_RETURN(t.grad_, HostArray::Create(t.n_ * DTypeSize(t.grad_dtype_), "grad"));
    STRATA_ASSIGN_OR_RETURN(t.out_, HostArray::Create(t.n_ * DTypeSize(t.out_dtype_), "out"));
    std::ranges::fill(t.state_.As<float>(), 0.5f);
    std::memset(t.grad_.data(), 0, t.grad_.bytes());
    std::memset(t.out_.data(), 0, t.out_.bytes());
    return t;
  }
  uint64_t elems() const { return n_; }
  uint64_t bytes() const { return n_ * 24 + grad_.bytes() + out_.bytes(); }
  Status Run() {
    const std::span<float> s = state_.As<float>();
    const AdamState state{.params = s.first(n_),
                          .exp_avg = s.subspan(n_, n_),
                          .exp_avg_sq = s.subspan(2 * n_, n_)};
    return adam_->TrafficBaseline(state, GradView{grad_dtype_, grad_.data(), n_},
                                  OutView{out_dtype_, out_.data(), n_});
  }

 private:
  std::unique_ptr<CpuAdam> adam_;
  size_t n_ = 0;
  DType grad_dtype_ = DType::kF32, out_dtype_ = DType::kF32;
  HostArray state_, grad_, out_;
};

// Seconds of `pass`, best of three after one more that faults the pages in.
template <typename Pass>
Result<double> BestOfThree(Pass pass) {
  double best = 1e300;
  for (int i = 0; i < 4; ++i) {
    const auto t0 = std::chrono::steady_clock::now();
    STRATA_RETURN_IF_ERROR(pass());
    const double sec =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (i > 0) best = std::min(best, sec);
  }
  return best;
}

// The stream rate alone: bytes per second.
Result<double> MeasureAdamRate(const OffloadConfig& config, uint64_t elems) {
  STRATA_ASSIGN_OR_RETURN(AdamTraffic cpu, AdamTraffic::Create(config, elems));
  STRATA_ASSIGN_OR_RETURN(const double sec, BestOfThree([&] { return cpu.Run(); }));
  return static_cast<double>(cpu.bytes()) / sec;
}

// The machine doing one step's work at once: the step's link copies each
// way, its CPU stream and its device Adam, in the step's proportions but
// scaled down so that the CPU's part is at most `max_cpu_elems` params (the
// step's own bytes where they are fewer), all started at
// one instant with no order between them, as a perfect pipeline would run
// them. The time until the last one ends (best of three), scaled back to the
// step. Where the resources are independent (a GPU's copy engines, its SMs
// and the CPU's cores) it is about the largest alone term; where they share
// what the alone rates cannot see, it is longer, and no schedule of the step
// can beat it: on the host device the link's copies and the device Adam are
// memcpy and loops on the same cores and DRAM as the CPU Adam. The drive and
// the communicator are not in it. 0 when the CPU does no work in the step.
Result<double> MeasureTogether(Device& device, const OffloadConfig& config,
                               const AdamShape& shape, const StepSample& step,
                               uint64_t max_cpu_elems) {
  if (step.host_dram_bytes == 0) return 0.0;
  const uint64_t bytes_per_elem =
      24 + DTypeSize(config.grad_dtype) + DTypeSize(config.param_dtype);
  STRATA_ASSIGN_OR_RETURN(
      AdamTraffic cpu,
      AdamTraffic::Create(config, std::min(max_cpu_elems, step.host_dram_bytes / bytes_per_elem)));
  const double scale = static_cast<double>(cpu.bytes()) / step.host_dram_bytes;
  const auto scaled = [&](uint64_t bytes) {
    return static_cast<uint64_t>(std::llround(static_cast<double>(bytes) * scale));
  };
  std::optional<DeviceAdamProbe> device_adam;
  if (const uint64_t elems = scaled(step.device_adam_bytes) / shape.device_bytes_per_elem();
      elems > 0) {
    STRATA_ASSIGN_OR_RETURN(device_adam, DeviceAdamProbe::Create(device, shape, elems));
  }
  // Each direction cycles through a region of its own in 4 MiB copies.
  constexpr uint64_t kPiece = 4 * kMiB, kRegion = 32 * kMiB;
  struct Direction {
    uint64_t bytes;
    CopyKind kind;
    HostAllocation host;
    DeviceBuffer dev;
    Stream stream;
  };
  std::vector<Direction> dirs;
  for (auto [bytes, kind] : {std::pair{scaled(step.d2h_bytes), CopyKind::kDeviceToHost},
                             std::pair{scaled(step.h2d_bytes), CopyKind::kHostToDevice}}) {
    if (bytes == 0) continue;
    Direction d{.bytes = bytes, .kind = kind, .host = {}, .dev = {}, .stream = {}};
    const uint64_t region = std::min(bytes, kRegion);
    STRATA_ASSIGN_OR_RETURN(d.host, device.AllocateHost(region));
    STRATA_ASSIGN_OR_RETURN(d.dev, device.Allocate(region));
    STRATA_ASSIGN_OR_RETURN(d.stream, device.CreateStream());
    std::memset(d.host.data(), 1, region);
    dirs.push_back(std::move(d));
  }
  const auto pass = [&]() -> Status {
    for (Direction& d : dirs) {
      const uint64_t region = std::min(d.bytes, kRegion);
      for (uint64_t done = 0; done < d.bytes;) {
        const uint64_t off = done % region;
        const uint64_t n = std::min({kPiece, d.bytes - done, region - off});
        auto* host = static_cast<std::byte*>(d.host.data()) + off;
        auto* dev = static_cast<std::byte*>(d.dev.data()) + off;
        STRATA_RETURN_IF_ERROR(d.kind == CopyKind::kDeviceToHost
                                   ? device.CopyAsync(host, dev, n, d.kind, d.stream)
                                   : device.CopyAsync(dev, host, n, d.kind, d.stream));
        done += n;
      }
    }
    if (device_adam) STRATA_RETURN_IF_ERROR(device_adam->Launch());
    STRATA_RETURN_IF_ERROR(cpu.Run());
    for (Direction& d : dirs) STRATA_RETURN_IF_ERROR(device.StreamSynchronize(d.stream));
    return device_adam ? device_adam->Wait() : OkStatus();
  };
  STRATA_ASSIGN_OR_RETURN(const double sec, BestOfThree(pass));
  return sec / scale;
}

nlohmann::json StagesJson(const StageTimes& t) {
  return {{"d2h", t.d2h},
          {"comm", t.comm},
          {"read", t.read},
          {"adam", t.adam},
          {"write", t.write},
          {"nvme", t.nvme},
          {"h2d", t.h2d},
          {"grad_stats", t.grad_stats},
          {"device", t.device},
          {"device_adam", t.device_adam},
          {"step", t.step}};
}

// Median over rounds, stage by stage.
StageTimes MedianTimes(const std::vector<StepSample>& v) {
  auto med = [&](double StageTimes::*f) {
    std::vector<double> x;
    for (const StepSample& s : v) x.push_back(s.times.*f);
    return Median(x);
  };
  StageTimes t;
  t.d2h = med(&StageTimes::d2h);
  t.comm = med(&StageTimes::comm);
  t.read = med(&StageTimes::read);
  t.adam = med(&StageTimes::adam);
  t.grad_stats = med(&StageTimes::grad_stats);
  t.write = med(&StageTimes::write);
  t.nvme = med(&StageTimes::nvme);
  t.h2d = med(&StageTimes::h2d);
  t.device = med(&StageTimes::device);
  t.device_adam = med(&StageTimes::device_adam);
  t.step = med(&StageTimes::step);
  return t;
}

Status RunStep(const StepArgs& a) {
  // ---- the options on their own, before any work ----
  if (!a.trace_path.empty()) STRATA_RETURN_IF_ERROR(CheckOutputFile("--trace", a.trace_path));
  STRATA_ASSIGN_OR_RETURN(const std::optional<uint64_t> drive_probe_bytes,
                          ParseDriveProbe(a.drive_probe));
  Result<uint64_t> pcie_rate_parsed = ParseBytes(a.pcie_rate);
  if (!pcie_rate_parsed.ok()) {
    return InvalidArgumentError(fmt::format(
        "--pcie-rate {}: give bytes per second (12G, 25GiB) or 0 for memcpy speed", a.pcie_rate));
  }
  const uint64_t pcie_rate = *pcie_rate_parsed;
  // A link slower than 1 MB/s takes minutes to move even a small model, in
  // silence: "12" was meant as 12G far more often than as 12 bytes/s.
  if (pcie_rate != 0 && pcie_rate < 1000 * 1000) {
    const bool digits = a.pcie_rate.find_first_not_of("0123456789") == std::string::npos;
    return InvalidArgumentError(fmt::format(
        "--pcie-rate {}: {} bytes/s is slower than any link (the value is in bytes per "
        "second{}); give at least 1M, or 0 for memcpy speed",
        a.pcie_rate, pcie_rate, digits ? fmt::format(": did you mean {}G?", a.pcie_rate) : ""));
  }
  int cuda_ordinal = -1;
  if (a.device != "host") {
    if (a.device.rfind("cuda:", 0) == 0 && a.device.size() > 5 && a.device.size() < 10 &&
        a.device.find_first_not_of("0123456789", 5) == std::string::npos) {
      cuda_ordinal = std::stoi(a.device.substr(5));
    }
    if (cuda_ordinal < 0) {
      return InvalidArgumentError(
          fmt::format("--device {}: give host or cuda:N (N: the GPU's ordinal)", a.device));
    }
    if (pcie_rate != 0) {
      return InvalidArgumentError("--pcie-rate models a link for --device host; a GPU has its own");
    }
    if (a.ranks != 1) {
      return InvalidArgumentError(
          "--ranks with --device cuda: one rank per process on a GPU; run one bench per GPU");
    }
  }

  // ---- configuration ----
  OffloadConfig config;
  if (!a.config_path.empty()) {
    STRATA_ASSIGN_OR_RETURN(std::string text, ReadConfigFile(a.config_path));
    Result<OffloadConfig> parsed = ParseConfigJson(text);
    if (!parsed.ok()) return parsed.status().WithContext(a.config_path);
    config = *std::move(parsed);
  }
  STRATA_ASSIGN_OR_RETURN(const uint64_t params, ParseCount(a.params));
  if (params == 0) return InvalidArgumentError("--params 0: the benchmark needs parameters");
  if (a.tensors == 0 || a.tensors > params) {
    return InvalidArgumentError(
        fmt::format("--tensors {}: must be between 1 and --params ({})", a.tensors, params));
  }
  if (Use(a, "--grad")) {
    STRATA_ASSIGN_OR_RETURN(config.grad_dtype, ParseDType(a.grad));
  }
  if (Use(a, "--param")) {
    STRATA_ASSIGN_OR_RETURN(config.param_dtype, ParseDType(a.param));
    if (config.param_dtype == DType::kF16) {
      // No overflow in the bench's gradients; a static scale takes every step.
      config.loss_scaler = {.mode = LossScaleMode::kStatic, .static_scale = 1.0};
    } else {
      config.loss_scaler = {.mode = LossScaleMode::kNone};
    }
  }
  if (Use(a, "--sub-group")) {
    if (a.sub_group == "auto") {
      config.sub_group_elems = kSubGroupAuto;
    } else {
      STRATA_ASSIGN_OR_RETURN(config.sub_group_elems, ParseCount(a.sub_group));
      if (config.sub_group_elems == 0) return InvalidArgumentError("--sub-group 0: must be > 0");
    }
  }
  if (Use(a, "--buffer-count")) config.buffer_count = a.buffer_count;
  if (Use(a, "--threads")) config.threads = a.threads;
  if (Use(a, "--block")) {
    STRATA_ASSIGN_OR_RETURN(config.aio.block_bytes, ParseBytes(a.block));
  }
  if (Use(a, "--queue-depth")) config.aio.queue_depth = a.queue_depth;
  if (Use(a, "--device-budget")) {
    STRATA_ASSIGN_OR_RETURN(config.device_budget_bytes, ParseBytes(a.device_budget));
  }
  if (Use(a, "--gpu-fraction")) {
    if (a.gpu_fraction == "auto") {
      config.gpu_fraction = kGpuFractionAuto;
    } else {
      char* end = nullptr;
      const double f = std::strtod(a.gpu_fraction.c_str(), &end);
      if (end == a.gpu_fraction.c_str() || *end != '\0' || !(f >= 0 && f <= 1)) {
        return InvalidArgumentError(fmt::format(
            "--gpu-fraction {}: give a number in [0, 1] or auto", a.gpu_fraction));
      }
      config.gpu_fraction = f;
    }
  }
  if (Use(a, "--offload")) {
    config.device = a.offload == "nvme" ? OffloadDevice::kNvme : OffloadDevice::kCpu;
  }
  if (config.device == OffloadDevice::kCpu) {
    // Options of the NVMe tier mean nothing here: refused, not ignored.
    for (const char* option : {"--nvme-dir", "--drive-probe", "--block", "--queue-depth"}) {
      if (a.given.count(option) > 0) {
        return InvalidArgumentError(fmt::format(
            "{} is for state on NVMe, and {} keeps it all in DRAM: drop {}, or give --offload "
            "nvme",
            option,
            a.given.count("--offload") > 0 ? "--offload cpu" : "the config's offload_optimizer",
            option));
      }
    }
  }

  // The state store's files (offload/state_store.h: strata-rank<r>.state and
  // .lock), and the temporary directory when the bench made one: removed on
  // exit and on Ctrl-C. In a directory the user gave, a file that was there
  // before is another run's until the store is created (its lock held): it
  // is registered only then, so a bench refused by another run's lock does
  // not delete that run's state; a lock file that was there is left.
  CleanupScope cleanup;
  std::vector<std::pair<int, std::string>> state_files_to_claim;  // (rank, path)
  if (config.device == OffloadDevice::kNvme) {
    if (!a.nvme_dirs.empty()) {
      config.nvme_paths = a.nvme_dirs;
    } else if (config.nvme_paths.empty()) {
      char tmpl[] = "/var/tmp/strata-bench-step-XXXXXX";
      if (::mkdtemp(tmpl) == nullptr) {
        return ErrnoError(errno, "create a directory under /var/tmp")
            .WithContext("bench step: pass --nvme-dir on the drive to measure");
      }
      cleanup.AddDir(tmpl);
      config.nvme_paths = {tmpl};
      std::fprintf(stderr, "bench step: state files in %s (removed afterwards, also on Ctrl-C)\n",
                   tmpl);
    }
    for (const std::string& d : config.nvme_paths) {
      if (!std::filesystem::is_directory(d)) {
        return InvalidArgumentError(fmt::format(
            "--nvme-dir {}: not an existing directory; create it on the drive to measure", d));
      }
      // Before anything is measured: a directory the optimizer cannot use
      // failed only after seconds of probes (naming a probe's file), and
      // another run's directory had its figures disturbed by our drive probe.
      const DirectoryProbe probe = ProbeDirectory(d, DirectoryChecks::kSpace);
      if (!probe.writable.ok()) {
        return FailedPreconditionError(fmt::format(
            "--nvme-dir {}: {}; give a directory this user can write (`strata info --nvme-dir "
            "{}` says more)",
            d, probe.writable.message(), d));
      }
      for (int r = 0; r < a.ranks; ++r) {
        for (const char* ext : {"state", "lock"}) {
          const std::string f = fmt::format("{}/strata-rank{}.{}", d, r, ext);
          std::error_code ec;
          if (!std::filesystem::exists(std::filesystem::symlink_status(f, ec))) {
            cleanup.AddFile(f);
          } else if (std::string_view(ext) == "state") {
            state_files_to_claim.emplace_back(r, f);
          }
        }
        const Result<FileLock> lock = FileLock::Acquire(fmt::format("{}/strata-rank{}.lock", d, r));
        if (!lock.ok() && LockHeldByAnother(lock.status())) {
          return FailedPreconditionError(fmt::format(
              "--nvme-dir {}: another run uses it ({}); wait for it to end, or give another "
              "--nvme-dir",
              d, lock.status().message()));
        }
      }
    }
  } else {
    config.nvme_paths.clear();
  }

  // The flat layout of one rank gives the sub-groups the planner sees.
  std::vector<uint64_t> tensor_elems(a.tensors, params / a.tensors);
  tensor_elems.back() += params % a.tensors;
  std::vector<TensorSpec> specs;
  for (uint64_t n : tensor_elems) specs.push_back({.elems = n, .dtype = config.param_dtype});
  STRATA_ASSIGN_OR_RETURN(FlatLayout layout,
                          PlanFlatLayout(specs, {.align_elems = config.align_elems,
                                                 .world_size = static_cast<uint32_t>(a.ranks)}));
  STRATA_ASSIGN_OR_RETURN(ElemRange shard0, ShardRange(layout, 0));
  // "auto" resolved once, from the budget given (the config's, or
  // --host-budget SIZE applied first); the bench's own default budget
  // (--host-budget auto) follows the sub-groups below.
  if (Use(a, "--host-budget") && a.host_budget != "auto") {
    STRATA_ASSIGN_OR_RETURN(config.host_budget_bytes, ParseBytes(a.host_budget));
  }
  config.sub_group_elems =
      SubGroupElemsFor(config, shard0.elems(), static_cast<uint32_t>(a.ranks));
  STRATA_ASSIGN_OR_RETURN(std::vector<ElemRange> sgs, CutSubGroups(shard0, config.sub_group_elems));
  std::vector<uint64_t> sg_sizes;
  for (const ElemRange& r : sgs) sg_sizes.push_back(r.elems());
  if (!Use(a, "--host-budget")) {
    // the config's strata.host_budget
  } else if (a.host_budget == "auto") {
    if (config.device == OffloadDevice::kNvme) {
      // The staging, plus room for a quarter of the state: the rest (3/4) on NVMe.
      OffloadConfig probe = config;
      probe.host_budget_bytes = 0;
      STRATA_ASSIGN_OR_RETURN(
          PlacementPlan staging_only,
          PlanPlacement(PlacementInputsFor(probe, sg_sizes, static_cast<uint32_t>(a.ranks))));
      config.host_budget_bytes =
          staging_only.host_staging_bytes + staging_only.nvme_state_bytes / 4;
    } else {
      config.host_budget_bytes = 0;  // cpu: not limited
    }
  }  // else: --host-budget SIZE, applied above
  STRATA_RETURN_IF_ERROR(ValidateConfig(config).WithContext("bench step"));
  STRATA_ASSIGN_OR_RETURN(
      PlacementPlan plan0,
      PlanPlacement(PlacementInputsFor(config, sg_sizes, static_cast<uint32_t>(a.ranks))));
  if (config.device == OffloadDevice::kNvme && plan0.nvme_sub_groups == 0) {
    // Few sub-groups: NVMe's staging buffers would take as much DRAM as the
    // state they stage, so the planner keeps it all in DRAM.
    std::fprintf(stderr,
                 "bench step: note: no sub-group is on NVMe: with %zu sub-groups and "
                 "buffer_count %u, staging them from NVMe needs as much host memory as keeping "
                 "them, so the plan keeps all in DRAM (a cpu run). For an NVMe run give more "
                 "sub-groups (a smaller --sub-group), --buffer-count 2, or a smaller "
                 "--host-budget\n",
                 sg_sizes.size(), config.buffer_count);
  }

  // ---- device, communicator, tensors ----
  const uint64_t tensor_bytes =
      params * (DTypeSize(config.param_dtype) + DTypeSize(config.grad_dtype));
  constexpr uint64_t kLinkProbeBytes = 64 * kMiB;
  const AdamShape adam_shape = AdamShape::Of(config, static_cast<uint32_t>(a.ranks));
  // The device Adam's probes (alone, then together with the rest) run on at
  // most 32 Mi fresh elements each.
  const uint64_t device_adam_probe_bytes =
      plan0.device_sub_groups > 0
          ? std::min<uint64_t>(plan0.device_elems, uint64_t{32} << 20) *
                adam_shape.device_bytes_per_elem()
          : 0;
  // What the device holds at most (its budget adds room for small buffers).
  const uint64_t device_use = a.ranks * (tensor_bytes + plan0.device_total_bytes()) +
                              kLinkProbeBytes + device_adam_probe_bytes;
  const uint64_t device_need = device_use + (a.ranks + 1) * 64 * kMiB;
  // What the bench holds in host memory at its peak, refused before any of
  // it is allocated: past a container's memory limit the kernel kills the
  // process without a word. On the host device its memory (the tensors,
  // staging, probes) is host memory too; the CPU probe's arrays come and go
  // before the optimizers are built.
  if (Result<HostMemory> mem = ProbeHostMemory(); mem.ok()) {
    const uint64_t cpu_probe_bytes = std::min<uint64_t>(shard0.elems(), uint64_t{32} << 20) *
                                     (12 + DTypeSize(config.grad_dtype) +
                                      DTypeSize(config.param_dtype));
    const uint64_t need = (a.device == "host" ? device_use : 0) +
                          std::max(cpu_probe_bytes, a.ranks * plan0.host_total_bytes());
    if (need > mem->available_bytes) {
      return ResourceExhaustedError(fmt::format(
          "needs about {} of host memory (the optimizer{} pin {}{}) but {} is available{}; "
          "lower --params, or give --offload nvme with a --host-budget",
          FormatBytes(need), a.ranks > 1 ? "s" : "", FormatBytes(a.ranks * plan0.host_total_bytes()),
          a.device == "host" ? fmt::format(", the emulated device holds {}", FormatBytes(device_use))
                             : std::string(),
          FormatBytes(mem->available_bytes), mem->limit_note()));
    }
  }
  std::unique_ptr<Device> device;
  if (a.device == "host") {
    STRATA_ASSIGN_OR_RETURN(device,
                            CreateHostDevice({.memory_budget_bytes = device_need,
                                              .h2d_bytes_per_sec = static_cast<double>(pcie_rate),
                                              .d2h_bytes_per_sec = static_cast<double>(pcie_rate)}));
  } else {
    STRATA_ASSIGN_OR_RETURN(device, CreateCudaDevice(cuda_ordinal));
  }
  std::vector<std::unique_ptr<Communicator>> comms;
  if (a.ranks > 1) {
    STRATA_ASSIGN_OR_RETURN(comms, CreateLocalGroup(a.ranks, *device));
  }
  std::fprintf(stderr, "bench step: %s params in %u tensors, %d rank(s), allocating %s ...\n",
               FormatCount(params).c_str(), a.tensors, a.ranks,
               FormatBytes(a.ranks * tensor_bytes).c_str());
  std::vector<RankModel> models(a.ranks);
  std::vector<Stream> streams;
  // Filled on the host and copied (device memory may not be host-visible).
  std::vector<std::byte> host_fill;
  auto fill = [&](DeviceBuffer& buf, uint64_t n, DType dtype, float scale,
                  uint64_t salt) -> Status {
    host_fill.resize(n * DTypeSize(dtype));
    Fill(host_fill.data(), n, dtype, scale, salt);
    StreamRef s = device->DefaultStream();
    STRATA_RETURN_IF_ERROR(device->CopyAsync(buf.data(), host_fill.data(), host_fill.size(),
                                             CopyKind::kHostToDevice, s));
    return device->StreamSynchronize(s);
  };
  for (int r = 0; r < a.ranks; ++r) {
    for (uint32_t t = 0; t < a.tensors; ++t) {
      const uint64_t n = tensor_elems[t];
      STRATA_ASSIGN_OR_RETURN(DeviceBuffer d, device->Allocate(n * DTypeSize(config.param_dtype)));
      STRATA_ASSIGN_OR_RETURN(DeviceBuffer g, device->Allocate(n * DTypeSize(config.grad_dtype)));
      STRATA_RETURN_IF_ERROR(fill(d, n, config.param_dtype, 1.0f, t));
      STRATA_RETURN_IF_ERROR(fill(g, n, config.grad_dtype, 1e-3f, t + 7 * r));
      models[r].data.push_back(std::move(d));
      models[r].grad.push_back(std::move(g));
      models[r].elems.push_back(n);
    }
    STRATA_ASSIGN_OR_RETURN(Stream s, device->CreateStream());
    streams.push_back(std::move(s));
  }

  host_fill = {};

  // ---- the machine alone: link, CPU stream, drive ----
  Rates rates;
  std::fprintf(stderr, "bench step: measuring the link, the CPU stream rate%s ...\n",
               plan0.nvme_sub_groups > 0 ? " and the drive" : "");
  STRATA_ASSIGN_OR_RETURN(rates.link, MeasureLinkRates(*device, kLinkProbeBytes));
  // The ranks update at once, each on config.threads threads (0: every
  // hardware thread, shared): the CPU probes run on as many.
  OffloadConfig cpu_probe = config;
  cpu_probe.threads = config.threads == 0 ? 0 : config.threads * a.ranks;
  STRATA_ASSIGN_OR_RETURN(
      rates.adam_bytes_per_sec,
      MeasureAdamRate(cpu_probe, std::min<uint64_t>(shard0.elems(), uint64_t{32} << 20)));
  if (plan0.device_sub_groups > 0) {
    STRATA_ASSIGN_OR_RETURN(
        const double device_adam_elems_per_sec,
        MeasureDeviceAdamRate(*device, adam_shape,
                              std::min<uint64_t>(plan0.device_elems, uint64_t{32} << 20)));
    rates.device_adam_bytes_per_sec = device_adam_elems_per_sec * adam_shape.device_bytes_per_elem();
  }
  // auto: as many bytes as one copy of the rank's NVMe state (256 MiB to 4
  // GiB): a small file may sit in a cache (a VM's host) the state does not;
  // less where the disk has no room for that (the probe's files are gone
  // before the optimizer writes its state).
  uint64_t probe_bytes = drive_probe_bytes.value_or(
      std::clamp<uint64_t>(plan0.nvme_state_bytes, 256 * kMiB, 4 * kGiB));
  if (plan0.nvme_sub_groups == 0 && drive_probe_bytes.value_or(0) > 0) {
    std::fprintf(stderr,
                 "bench step: --drive-probe skipped: the plan puts no state on NVMe (the host "
                 "budget holds it all), so the drive bounds nothing\n");
  }
  if (plan0.nvme_sub_groups > 0 && probe_bytes > 0) {
    const size_t dirs = config.nvme_paths.size();
    if (!drive_probe_bytes) {
      STRATA_ASSIGN_OR_RETURN(const uint64_t room,
                              ProbeRoom(config.nvme_paths, 2, config.aio.block_bytes));
      if (room * dirs < probe_bytes && room > 0) {
        std::fprintf(stderr,
                     "bench step: the drive baseline probes %s, not %s: the disk has no room "
                     "for more (--drive-probe SIZE to choose)\n",
                     FormatBytes(room * dirs).c_str(), FormatBytes(probe_bytes).c_str());
        probe_bytes = room * dirs;
      }
    }
    std::fprintf(stderr,
                 "bench step: drive baseline: writing, then reading %s on %s (--drive-probe 0 "
                 "skips it) ...\n",
                 FormatBytes(probe_bytes / dirs * dirs).c_str(),
                 fmt::format("{}", fmt::join(config.nvme_paths, ", ")).c_str());
    STRATA_ASSIGN_OR_RETURN(rates.drive,
                            MeasureDriveRates(config.nvme_paths, probe_bytes / dirs,
                                              config.aio.block_bytes, config.aio.queue_depth,
                                              "--drive-probe",
                                              "--drive-probe 0 to skip the drive baseline"));
  }

  std::unique_ptr<TraceRecorder> trace;
  if (!a.trace_path.empty()) {
    STRATA_ASSIGN_OR_RETURN(trace,
                            TraceRecorder::Create({.steps = static_cast<uint32_t>(a.steps)}));
  }

  // ---- optimizers (Create is a collective: one thread per rank) ----
  std::fprintf(stderr, "bench step: creating the optimizer%s (writes the initial state) ...\n",
               a.ranks > 1 ? "s" : "");
  std::vector<std::unique_ptr<OffloadOptimizer>> opts(a.ranks);
  const auto setup_start = std::chrono::steady_clock::now();
  auto on_ranks = [&](const std::function<Status(int)>& body) -> Status {
    std::vector<Status> status(a.ranks);
    std::vector<std::thread> threads;
    for (int r = 0; r < a.ranks; ++r) threads.emplace_back([&, r] { status[r] = body(r); });
    for (auto& t : threads) t.join();
    for (int r = 0; r < a.ranks; ++r) {
      if (!status[r].ok()) return std::move(status[r]).WithContext(fmt::format("rank {}", r));
    }
    return OkStatus();
  };
  STRATA_RETURN_IF_ERROR(on_ranks([&](int r) -> Status {
    std::vector<ParamGroup> groups(1);
    groups[0].hyper = DefaultGroupHyper(config);
    for (uint32_t t = 0; t < a.tensors; ++t) {
      groups[0].params.push_back({.name = fmt::format("w{}", t),
                                  .data = models[r].data[t].data(),
                                  .grad = models[r].grad[t].data(),
                                  .elems = models[r].elems[t]});
    }
    STRATA_ASSIGN_OR_RETURN(
        opts[r], OffloadOptimizer::Create({.device = device.get(),
                                           .comm = a.ranks > 1 ? comms[r].get() : nullptr,
                                           .stream = streams[r],
                                           .trace = trace.get()},
                                          config, groups));
    return OkStatus();
  }));
  // Each store holds its lock now: its state file, rewritten, is the bench's.
  for (const auto& [r, f] : state_files_to_claim) {
    if (opts[r]->plan().nvme_sub_groups > 0) cleanup.AddFile(f);
  }

  const double setup_sec =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - setup_start).count();
  uint64_t state_bytes = 0;
  for (const auto& opt : opts) state_bytes += opt->plan().host_state_bytes + opt->plan().nvme_state_bytes;
  std::fprintf(stderr, "bench step: created in %s: %s of state at %s\n",
               FormatSeconds(setup_sec).c_str(), FormatBytes(state_bytes).c_str(),
               FormatRate(state_bytes / setup_sec).c_str());

  // ---- steps ----
  // With --backward (the default) each step follows a simulated backward: the
  // grads are reported with GradReady, last tensor first as backward produces
  // them, and the device finishes what that queued (the statistics; with
  // several ranks pack, reduce-scatter and D2H) before Step() is timed, as a
  // trainer's backward would hide it on a GPU. Its time is reported apart.
  std::vector<double> handover(a.ranks);
  std::barrier handed_over(a.ranks);
  auto run_step = [&](PipelineMode mode) -> Result<StepSample> {
    std::vector<StepStats> stats(a.ranks);
    STRATA_RETURN_IF_ERROR(on_ranks([&](int r) -> Status {
      opts[r]->SetPipelineMode(mode);
      if (a.backward) {
        const auto t0 = std::chrono::steady_clock::now();
        Status ready;
        for (uint32_t t = a.tensors; t-- > 0 && ready.ok();) ready = opts[r]->GradReady(t);
        // The ranks share the device: one waits for all of it, once every
        // rank has queued its collectives (a rank waiting alone would wait
        // for another rank's collective that cannot finish without it).
        handed_over.arrive_and_wait();
        Status synced = r == 0 ? device->Synchronize() : OkStatus();
        handed_over.arrive_and_wait();
        STRATA_RETURN_IF_ERROR(ready);
        STRATA_RETURN_IF_ERROR(synced);
        handover[r] =
            std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      }
      STRATA_RETURN_IF_ERROR(opts[r]->Step());
      STRATA_RETURN_IF_ERROR(device->StreamSynchronize(streams[r]));
      stats[r] = opts[r]->last_step();
      return OkStatus();
    }));
    StepSample s = Combine(stats);
    s.handover_sec = *std::max_element(handover.begin(), handover.end());
    if (!stats[0].skipped) {
      for (const auto& opt : opts) {
        s.device_adam_bytes +=
            opt->plan().device_elems * adam_shape.device_bytes_per_elem();
      }
    }
    return s;
  };
  // A round: overlapped, serial (alternating which goes first so drift
  // favours neither), and with --trace an overlapped step recorded.
  enum class Kind { kOverlapped, kSerial, kTraced };
  auto name = [](Kind k) {
    return k == Kind::kSerial ? "serial    " : k == Kind::kTraced ? "traced    " : "overlapped";
  };
  const int steps_per_round = trace ? 3 : 2;
  const int total = steps_per_round * (a.warmup + a.steps);
  int done = 0;
  const bool stderr_tty = ::isatty(STDERR_FILENO) == 1;
  std::vector<StepSample> overlapped, serial, traced;
  for (int round = 0; round < a.warmup + a.steps; ++round) {
    const bool warm = round < a.warmup;
    std::vector<Kind> order = {round % 2 == 0 ? Kind::kOverlapped : Kind::kSerial,
                               round % 2 == 0 ? Kind::kSerial : Kind::kOverlapped};
    if (trace) order.insert(order.begin() + (round % 2 == 0 ? 1 : 2), Kind::kTraced);
    for (Kind k : order) {
      // On a terminal a line that the result overwrites; in a log only the result.
      if (stderr_tty) {
        std::fprintf(stderr, "\rbench step: step %d/%d (%s%s) ...   ", done + 1, total, name(k),
                     warm ? ", warm-up" : "");
      }
      if (trace) trace->SetEnabled(k == Kind::kTraced && !warm);
      STRATA_ASSIGN_OR_RETURN(
          StepSample s, run_step(k == Kind::kSerial ? PipelineMode::kSerial
                                                    : PipelineMode::kOverlapped));
      if (trace) trace->SetEnabled(false);
      ++done;
      std::fprintf(stderr, "%sbench step: step %d/%d (%s%s): %s\n", stderr_tty ? "\r" : "",
                   done, total, name(k), warm ? ", warm-up" : "",
                   FormatSeconds(s.times.step).c_str());
      if (warm) continue;
      (k == Kind::kSerial ? serial : k == Kind::kTraced ? traced : overlapped).push_back(s);
    }
  }

  // ---- results ----
  const StageTimes over = MedianTimes(overlapped);
  const StageTimes alone = MedianTimes(serial);
  const Resources res_alone = Resources::Of(alone);
  const Resources res_over = Resources::Of(over);
  const auto [bottleneck, bottleneck_sec] = res_alone.Bottleneck();
  const double efficiency = bottleneck_sec / over.step;
  std::vector<double> per_round;
  for (size_t i = 0; i < overlapped.size(); ++i) {
    per_round.push_back(Resources::Of(serial[i].times).Bottleneck().second /
                        overlapped[i].times.step);
  }
  const StepSample& traffic = overlapped.back();
  uint64_t host_state = 0, host_staging = 0, nvme_state = 0, device_staging = 0;
  uint64_t device_state = 0;
  uint32_t sub_groups = 0, nvme_sub_groups = 0, device_sub_groups = 0;
  // The optimizers are done: their memory goes back for the together probe.
  std::vector<PlacementPlan> plans;
  for (const auto& opt : opts) plans.push_back(opt->plan());
  opts.clear();
  const double gpu_fraction = plans[0].gpu_fraction();
  for (const PlacementPlan& p : plans) {
    device_state += p.device_state_bytes;
    device_sub_groups += p.device_sub_groups;
    host_state += p.host_state_bytes;
    host_staging += p.host_staging_bytes;
    nvme_state += p.nvme_state_bytes;
    device_staging += p.device_staging_bytes;
    sub_groups += static_cast<uint32_t>(p.sub_groups.size());
    nvme_sub_groups += p.nvme_sub_groups;
  }
  const double nvme_bytes = static_cast<double>(traffic.read_bytes + traffic.write_bytes);
  // The machine's bound for this traffic, and how close the step came.
  std::fprintf(stderr, "bench step: measuring the step's work together ...\n");
  STRATA_ASSIGN_OR_RETURN(
      const double together_sec,
      MeasureTogether(*device, cpu_probe, adam_shape, traffic, uint64_t{32} << 20));
  const Bound bound = Bound::Of(traffic, rates, together_sec);
  const auto [bound_resource, bound_sec] = bound.Max();
  const double bound_efficiency = bound_sec / over.step;
  const auto [alone_resource, alone_bound_sec] = bound.Max(Bound::Terms::kAloneOnly);
  const double nvme_busy = over.nvme;
  const double nvme_efficiency = nvme_busy > 0 ? bound.nvme / nvme_busy : 0.0;
  // Against the drive's rate with reads and writes at once (what a step asks).
  const double nvme_efficiency_mixed =
      nvme_busy > 0 && rates.drive.mixed_bytes_per_sec > 0
          ? (traffic.read_bytes + traffic.write_bytes) / rates.drive.mixed_bytes_per_sec / nvme_busy
          : 0.0;
  const double params_d = static_cast<double>(params);
  double trace_overhead = 0;
  // A trace that cannot be written (its directory removed during the run,
  // the disk full) fails the command after the results are printed.
  Status trace_written;
  if (trace) {
    const StageTimes with = MedianTimes(traced);
    trace_overhead = with.step / over.step - 1.0;
    nlohmann::json other = {{"command", "strata bench step"},
                            {"params", params},
                            {"ranks", a.ranks},
                            {"bound_sec", bound_sec},
                            {"bound_resource", bound_resource},
                            {"step_sec", with.step},
                            {"dropped_events", trace->dropped()}};
    trace_written = trace->WriteChromeTrace(a.trace_path, JsonText(other));
    if (trace_written.ok()) {
      std::fprintf(stderr,
                   "bench step: trace of %d step(s) in %s (open it in https://ui.perfetto.dev)\n",
                   a.steps, a.trace_path.c_str());
    } else {
      trace_written = std::move(trace_written)
                          .WithContext("the results are printed; the trace is lost (--trace)");
    }
  }

  if (a.json) {
    nlohmann::json rounds = nlohmann::json::array();
    for (size_t i = 0; i < overlapped.size(); ++i) {
      rounds.push_back({{"overlapped", StagesJson(overlapped[i].times)},
                        {"serial", StagesJson(serial[i].times)},
                        {"overlap_efficiency", per_round[i]}});
    }
    nlohmann::json j = {
        {"params", params},
        {"tensors", a.tensors},
        {"ranks", a.ranks},
        {"param_dtype", std::string(DTypeName(config.param_dtype))},
        {"grad_dtype", std::string(DTypeName(config.grad_dtype))},
        {"offload", std::string(OffloadDeviceName(config.device))},
        {"nvme_paths", config.nvme_paths},
        {"sub_group_elems", config.sub_group_elems},
        {"sub_groups", sub_groups},
        {"nvme_sub_groups", nvme_sub_groups},
        {"device_sub_groups", device_sub_groups},
        {"gpu_fraction", gpu_fraction},
        {"buffer_count", config.buffer_count},
        {"threads", config.threads},
        {"block_bytes", config.aio.block_bytes},
        {"queue_depth", config.aio.queue_depth},
        {"host_budget_bytes", config.host_budget_bytes},
        {"device_budget_bytes", config.device_budget_bytes},
        {"pcie_bytes_per_sec", pcie_rate},
        {"steps", a.steps},
        {"step_sec", over.step},
        {"step_sec_best",
         std::min_element(overlapped.begin(), overlapped.end(),
                          [](auto& x, auto& y) { return x.times.step < y.times.step; })
             ->times.step},
        {"serial_step_sec", alone.step},
        {"stages", StagesJson(over)},
        {"stages_alone", StagesJson(alone)},
        {"resources_alone",
         {{"nvme", res_alone.nvme},
          {"cpu", res_alone.cpu},
          {"d2h", res_alone.d2h},
          {"h2d", res_alone.h2d},
          {"comm", res_alone.comm},
          {"device", res_alone.device},
          {"device_adam", res_alone.device_adam}}},
        {"resources",
         {{"nvme", res_over.nvme},
          {"cpu", res_over.cpu},
          {"d2h", res_over.d2h},
          {"h2d", res_over.h2d},
          {"comm", res_over.comm},
          {"device", res_over.device},
          {"device_adam", res_over.device_adam}}},
        {"bottleneck", bottleneck},
        {"bottleneck_alone_sec", bottleneck_sec},
        {"overlap_efficiency", efficiency},
        {"overlap_efficiency_per_round", per_round},
        {"nvme_bytes_per_sec_alone", res_alone.nvme > 0 ? nvme_bytes / res_alone.nvme : 0.0},
        {"device", a.device},
        {"setup_sec", setup_sec},
        {"backward", a.backward},
        {"handover_sec", a.backward ? Median([&] {
           std::vector<double> v;
           for (const StepSample& x : overlapped) v.push_back(x.handover_sec);
           return v;
         }()) : 0.0},
        {"setup_state_bytes_per_sec", state_bytes / setup_sec},
        {"baselines",
         {{"h2d_bytes_per_sec", rates.link.h2d_bytes_per_sec},
          {"d2h_bytes_per_sec", rates.link.d2h_bytes_per_sec},
          {"adam_stream_bytes_per_sec", rates.adam_bytes_per_sec},
          {"drive_read_bytes_per_sec", rates.drive.read_bytes_per_sec},
          {"drive_write_bytes_per_sec", rates.drive.write_bytes_per_sec},
          {"drive_mixed_bytes_per_sec", rates.drive.mixed_bytes_per_sec},
          {"drive_probe_bytes", rates.drive.bytes},
          {"drive_direct_io", rates.drive.direct},
          {"device_adam_bytes_per_sec", rates.device_adam_bytes_per_sec}}},
        {"bound",
         {{"d2h", bound.d2h},
          {"h2d", bound.h2d},
          {"cpu", bound.cpu},
          {"nvme", bound.nvme},
          {"device_adam", bound.device_adam},
          {"together", bound.together}}},
        {"bound_sec", bound_sec},
        {"bound_resource", bound_resource},
        {"bound_efficiency", bound_efficiency},
        {"alone_bound_sec", alone_bound_sec},
        {"alone_bound_resource", alone_resource},
        {"alone_bound_efficiency", alone_bound_sec / over.step},
        {"nvme_efficiency", nvme_efficiency},
        {"nvme_efficiency_mixed", nvme_efficiency_mixed},
        {"d2h_bytes_per_param", traffic.d2h_bytes / params_d},
        {"h2d_bytes_per_param", traffic.h2d_bytes / params_d},
        {"host_dram_bytes_per_param", traffic.host_dram_bytes / params_d},
        {"trace_overhead", trace ? nlohmann::json(trace_overhead) : nlohmann::json(nullptr)},
        {"bytes_per_tier",
         {{"host", {{"state", host_state}, {"staging", host_staging}}},
          {"nvme", {{"state", nvme_state}}},
          {"device",
           {{"tensors", a.ranks * tensor_bytes},
            {"staging", device_staging},
            {"state", device_state}}}}},
        {"traffic_per_step",
         {{"nvme_read", traffic.read_bytes},
          {"nvme_write", traffic.write_bytes},
          {"nvme_resident", traffic.resident_bytes},
          {"d2h", traffic.d2h_bytes},
          {"h2d", traffic.h2d_bytes}}},
        {"rounds", rounds},
    };
    PrintJson(j);
    return trace_written;
  }
  std::printf(
      "step: %s params, %d rank(s), %s params / %s grads, %u sub-groups of %s (%u on nvme)%s, "
      "buffer_count %u\n",
      FormatCount(params).c_str(), a.ranks, std::string(DTypeName(config.param_dtype)).c_str(),
      std::string(DTypeName(config.grad_dtype)).c_str(), sub_groups,
      FormatCount(config.sub_group_elems).c_str(), nvme_sub_groups,
      a.ranks > 1 ? " over all ranks" : "", config.buffer_count);
  // Sums over the ranks beside a budget per rank: the line says so.
  std::printf(
      "  bytes per tier%s: host %s state + %s staging (budget %s%s), nvme %s state, "
      "device %s tensors + %s staging\n",
      a.ranks > 1 ? " (all ranks)" : "",
      FormatBytes(host_state).c_str(), FormatBytes(host_staging).c_str(),
      config.host_budget_bytes                ? FormatBytes(config.host_budget_bytes).c_str()
      : config.device == OffloadDevice::kNvme ? "staging only"
                                              : "unlimited",
      a.ranks > 1 ? " per rank" : "", FormatBytes(nvme_state).c_str(),
      FormatBytes(a.ranks * tensor_bytes).c_str(), FormatBytes(device_staging).c_str());
  std::printf(
      "  traffic per step: nvme read %s (%s more still in the buffers), write %s, d2h %s (%.2f "
      "B/param), h2d %s (%.2f B/param), cpu dram %s (%.2f B/param)\n",
      FormatBytes(traffic.read_bytes).c_str(), FormatBytes(traffic.resident_bytes).c_str(),
      FormatBytes(traffic.write_bytes).c_str(),
      FormatBytes(traffic.d2h_bytes).c_str(), traffic.d2h_bytes / params_d,
      FormatBytes(traffic.h2d_bytes).c_str(), traffic.h2d_bytes / params_d,
      FormatBytes(traffic.host_dram_bytes).c_str(), traffic.host_dram_bytes / params_d);
  std::printf("  the machine alone: link h2d %s, d2h %s; cpu stream %s (adam traffic)",
              FormatRate(rates.link.h2d_bytes_per_sec).c_str(),
              FormatRate(rates.link.d2h_bytes_per_sec).c_str(),
              FormatRate(rates.adam_bytes_per_sec).c_str());
  if (rates.drive.bytes > 0) {
    std::printf("; drive read %s, write %s, both at once %s (%s%s)",
                FormatRate(rates.drive.read_bytes_per_sec).c_str(),
                FormatRate(rates.drive.write_bytes_per_sec).c_str(),
                FormatRate(rates.drive.mixed_bytes_per_sec).c_str(),
                FormatBytes(rates.drive.bytes).c_str(),
                rates.drive.direct ? ", O_DIRECT" : ", buffered: the page cache, not the drive");
  }
  std::printf("\n");
  std::printf("  %-12s %12s %12s\n", "stage", "overlapped", "alone");
  auto row = [](const char* n, double o, double s) {
    std::printf("  %-12s %12s %12s\n", n, FormatSeconds(o).c_str(), FormatSeconds(s).c_str());
  };
  row("d2h", over.d2h, alone.d2h);
  row("comm", over.comm, alone.comm);
  row("read", over.read, alone.read);
  row("adam", over.adam, alone.adam);
  row(" grad stats", over.grad_stats, alone.grad_stats);
  row("write", over.write, alone.write);
  row(" nvme busy", over.nvme, alone.nvme);
  row("h2d", over.h2d, alone.h2d);
  row("device", over.device, alone.device);
  if (device_sub_groups > 0) row("device adam", over.device_adam, alone.device_adam);
  row("step", over.step, alone.step);
  if (a.backward) {
    std::vector<double> v;
    for (const StepSample& x : overlapped) v.push_back(x.handover_sec);
    std::printf("  (before each step, the simulated backward's hand-over: %s)\n",
                FormatSeconds(Median(v)).c_str());
  }
  std::printf("  resources alone: nvme %s (%s), cpu %s, d2h %s, h2d %s, comm %s, device %s\n",
              FormatSeconds(res_alone.nvme).c_str(),
              res_alone.nvme > 0 ? FormatRate(nvme_bytes / res_alone.nvme).c_str() : "-",
              FormatSeconds(res_alone.cpu).c_str(), FormatSeconds(res_alone.d2h).c_str(),
              FormatSeconds(res_alone.h2d).c_str(), FormatSeconds(res_alone.comm).c_str(),
              FormatSeconds(res_alone.device).c_str());
  std::printf(
      "  bottleneck %s: %s alone; step %s; overlap_efficiency %.3f (median of %d "
      "rounds; per round",
      bottleneck.c_str(), FormatSeconds(bottleneck_sec).c_str(), FormatSeconds(over.step).c_str(),
      efficiency, a.steps);
  for (double e : per_round) std::printf(" %.3f", e);
  std::printf(")\n");
  std::printf(
      "  bound %s: d2h %s, h2d %s, cpu %s, nvme %s%s, together %s; step %s; bound_efficiency "
      "%.3f (%.3f against the largest alone, %s)",
      bound_resource.c_str(), FormatSeconds(bound.d2h).c_str(), FormatSeconds(bound.h2d).c_str(),
      FormatSeconds(bound.cpu).c_str(), FormatSeconds(bound.nvme).c_str(),
      device_sub_groups > 0
          ? fmt::format(", device adam {}", FormatSeconds(bound.device_adam)).c_str()
          : "",
      FormatSeconds(bound.together).c_str(), FormatSeconds(over.step).c_str(), bound_efficiency,
      alone_bound_sec / over.step, alone_resource.c_str());
  if (bound.nvme > 0) {
    std::printf(", nvme_efficiency %.3f (%.3f against the drive reading and writing at once)",
                nvme_efficiency, nvme_efficiency_mixed);
  }
  if (trace) std::printf(", trace_overhead %+.1f%%", 100 * trace_overhead);
  std::printf("\n");
  if (device_sub_groups > 0) {
    std::printf(
        "  partial offload: gpu_fraction %.3f (%u sub-groups, %s of state on the device); "
        "cpu side busy %s, device side busy %s (bound %s at %s, kernels::AdamStep alone); "
        "step %s\n",
        gpu_fraction, device_sub_groups, FormatBytes(device_state).c_str(),
        FormatSeconds(over.adam).c_str(), FormatSeconds(over.device_adam).c_str(),
        FormatSeconds(bound.device_adam).c_str(),
        FormatRate(rates.device_adam_bytes_per_sec).c_str(), FormatSeconds(over.step).c_str());
  }
  return trace_written;
}

}  // namespace

void AddBenchStepCommand(Cli& cli) {
  auto a = std::make_shared<StepArgs>();
  CLI::App* cmd = cli.bench->add_subcommand(
      "step",
      "Whole OffloadOptimizer steps: stage times against the machine's bound (link, CPU "
      "stream, drive, and the step's work together, measured in the same run)");
  cmd->add_option("--config", a->config_path,
                  "DeepSpeed-style JSON config to start from: the options below given on the "
                  "command line override it; their defaults apply only without --config (a key "
                  "the file leaves out takes the engine's default)")
      ->check(CLI::ExistingFile);
  cmd->add_option("--params", a->params, "Parameters of the model (64M, 1.5B, ...)")
      ->capture_default_str();
  cmd->add_option("--tensors", a->tensors, "Tensors the params are split into")
      ->capture_default_str()
      ->check(Within(1u, 1u << 20));
  cmd->add_option("--offload", a->offload,
                  "Where the state may go: nvme (DRAM, the rest on NVMe) or cpu (DRAM only)")
      ->capture_default_str()
      ->check(CLI::IsMember({"nvme", "cpu"}));
  cmd->add_option("--host-budget", a->host_budget,
                  "Pinned DRAM per rank (state + staging); auto: staging + 1/4 of the state "
                  "(nvme) or unlimited (cpu); 0: staging only (nvme)")
      ->capture_default_str();
  cmd->add_option("--device-budget", a->device_budget,
                  "Device memory per rank for staging and state (strata.device_budget); 0: not "
                  "limited")
      ->capture_default_str();
  cmd->add_option("--gpu-fraction", a->gpu_fraction,
                  "Partial offload: the share of the state updated on the device "
                  "(strata.gpu_fraction), 0 to 1, or auto (the device and the CPU side finish together, "
                  "at most what fits --device-budget)")
      ->capture_default_str();
  cmd->add_option("--nvme-dir", a->nvme_dirs,
                  "Directory for the state files; repeat to stripe over drives (default: a "
                  "temporary directory under /var/tmp; files removed afterwards)");
  cmd->add_option("--ranks", a->ranks, "Ranks (local communicator, one thread per rank)")
      ->capture_default_str()
      ->check(Within(1, 64));
  cmd->add_option("--steps", a->steps, "Timed rounds; each runs an overlapped and a serial step")
      ->capture_default_str()
      ->check(Within(1, 1000));
  cmd->add_option("--warmup", a->warmup, "Untimed rounds first")
      ->capture_default_str()
      ->check(Within(0, 100));
  cmd->add_option("--sub-group", a->sub_group, "Sub-group size in elements (sub_group_size), or auto (the planner's choice)")
      ->capture_default_str();
  cmd->add_option("--buffer-count", a->buffer_count, "Pipeline depth (buffer_count)")
      ->capture_default_str()
      ->check(Within(1u, 64u));
  cmd->add_option("--threads", a->threads, "CPU optimizer threads (0: every hardware thread)")
      ->capture_default_str()
      ->check(Within(0, 4096));
  cmd->add_option("--grad", a->grad, "Gradient dtype handed to the engine")
      ->capture_default_str()
      ->check(CLI::IsMember({"fp32", "fp16", "bf16"}));
  cmd->add_option("--param", a->param, "Param dtype")
      ->capture_default_str()
      ->check(CLI::IsMember({"fp32", "fp16", "bf16"}));
  cmd->add_option("--block", a->block, "NVMe IO size (aio.block_size)")->capture_default_str();
  cmd->add_option("--queue-depth", a->queue_depth, "NVMe requests in flight (aio.queue_depth)")
      ->capture_default_str()
      ->check(Within(1u, 4096u));
  cmd->add_option("--pcie-rate", a->pcie_rate,
                  "Model a PCIe link: H2D and D2H each capped at this many bytes/s, e.g. 12G "
                  "(0: memcpy speed)")
      ->capture_default_str();
  cmd->add_option("--device", a->device,
                  "host (the emulated device, the embedded default) or cuda:N")
      ->capture_default_str();
  cmd->add_option("--trace", a->trace_path,
                  "Record the timed steps (one more overlapped step per round) as a Chrome "
                  "trace (Perfetto, chrome://tracing) in this file");
  cmd->add_option("--drive-probe", a->drive_probe,
                  "Bytes the drive baseline reads and writes on the --nvme-dir paths (auto: "
                  "one copy of the NVMe state, 256 MiB to 4 GiB; 0: skip it, no NVMe bound then)")
      ->capture_default_str();
  cmd->add_flag("--backward,!--no-backward", a->backward,
                "Report the grads with GradReady before each step, as a trainer's backward does, "
                "and time the hand-over apart (default); --no-backward: Step() takes them all")
      ->capture_default_str();
  cmd->add_flag("--json", a->json, "Print one JSON object on stdout");
  cmd->callback([&cli, a, cmd] {
    for (const CLI::Option* o : cmd->get_options()) {
      if (o->count() > 0) a->given.insert(o->get_name());
    }
    RunAction(cli, "bench step", OutputOf(a->json), [a] { return RunStep(*a); });
  });
}

}  // namespace strata::cli
