// `strata bench checkpoint`: SaveCheckpoint, the verify pass alone and
// LoadCheckpoint of one optimizer's state, against the drive measured in the
// same run. The bound of a save is its bytes written at the checkpoint
// drive's synced write rate (a save is durable: new files written, then
// fdatasync; plus, with state on NVMe, the state read at the state drive's
// read rate: in sequence when both are one drive, else the larger);
// a load's is its bytes read once at the read rate (plus the state written
// back). Two loads are timed: into the stepped optimizer, whose state must
// survive a bad checkpoint, so every file is verified before it is read
// again into the state (at most about 1/2 of the bound where the drive
// bounds it; the verify pass is timed alone to show the split); and a
// resume, into a state as Create writes it (ResetStateFromParams), which
// reads each file once.
#include <fmt/format.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <mutex>
#include <nlohmann/json.hpp>
#include <set>
#include <string>
#include <vector>

#include "offload/checkpoint.h"
#include "offload/optimizer.h"
#include "runtime/atomic_file.h"
#include "runtime/device.h"
#include "runtime/machine.h"
#include "runtime/units.h"
#include "tools/baselines.h"
#include "tools/cleanup.h"
#include "tools/cli.h"

namespace strata::cli {
namespace {

namespace fs = std::filesystem;

struct CheckpointArgs {
  std::string params = "128M";
  std::string offload = "cpu";
  std::string host_budget = "auto";
  std::string sub_group = "16M";
  std::string dir;
  std::string nvme_dir;
  std::string drive_probe = "auto";
  int repeat = 2;
  int threads = 0;
  bool json = false;
};

double Seconds(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

// `dir` when given (it must exist), else a new directory under /var/tmp;
// either way the bench works in a fresh directory of its own inside it,
// removed at the end (also on Ctrl-C).
Result<std::string> WorkDir(const std::string& dir, const char* what, const char* option,
                            CleanupScope& cleanup) {
  const std::string parent = dir.empty() ? "/var/tmp" : dir;
  if (!fs::is_directory(parent)) {
    return InvalidArgumentError(fmt::format(
        "{} {}: not an existing directory; create it on the drive to measure", option, parent));
  }
  std::string tmpl = parent + "/strata-bench-checkpoint-XXXXXX";
  if (::mkdtemp(tmpl.data()) == nullptr) {
    return ErrnoError(errno, "create a directory in " + parent)
        .WithContext(
            fmt::format("bench checkpoint: give {} a directory this user can write", option));
  }
  cleanup.AddDir(tmpl);
  std::fprintf(stderr, "bench checkpoint: %s in %s (removed afterwards, also on Ctrl-C)\n", what,
               tmpl.c_str());
  return tmpl;
}

bool SameFilesystem(const std::string& a, const std::string& b) {
  struct stat sa {
  }, sb{};
  return ::stat(a.c_str(), &sa) == 0 && ::stat(b.c_str(), &sb) == 0 && sa.st_dev == sb.st_dev;
}

Status RunCheckpoint(const CheckpointArgs& a) {
  STRATA_ASSIGN_OR_RETURN(const uint64_t params, ParseCount(a.params));
  if (params == 0) return InvalidArgumentError("--params 0: the benchmark needs parameters");
  STRATA_ASSIGN_OR_RETURN(const std::optional<uint64_t> probe_bytes,
                          ParseDriveProbe(a.drive_probe));
  const bool nvme = a.offload == "nvme";
  if (!nvme && !a.nvme_dir.empty()) {
    return InvalidArgumentError(
        "--nvme-dir is for state on NVMe and --offload cpu keeps it all in DRAM: drop "
        "--nvme-dir, or give --offload nvme");
  }

  OffloadConfig config;
  config.device = nvme ? OffloadDevice::kNvme : OffloadDevice::kCpu;
  config.param_dtype = DType::kBF16;
  config.grad_dtype = DType::kBF16;
  config.loss_scaler = {.mode = LossScaleMode::kNone};
  config.threads = a.threads;
  STRATA_ASSIGN_OR_RETURN(config.sub_group_elems, ParseCount(a.sub_group));
  if (config.sub_group_elems == 0) return InvalidArgumentError("--sub-group 0: must be > 0");

  CleanupScope cleanup;
  std::mutex cleanup_mu;  // the listener runs on the writers' threads
  STRATA_ASSIGN_OR_RETURN(const std::string ckpt_dir,
                          WorkDir(a.dir, "checkpoints", "--dir", cleanup));
  std::string state_dir;
  if (nvme) {
    STRATA_ASSIGN_OR_RETURN(state_dir, WorkDir(a.nvme_dir, "state files", "--nvme-dir", cleanup));
    config.nvme_paths = {state_dir};
    cleanup.AddFile(state_dir + "/strata-rank0.state");
    cleanup.AddFile(state_dir + "/strata-rank0.lock");
  }
  if (a.host_budget == "auto") {
    // nvme: staging plus a quarter of the state (3/4 on NVMe); cpu: unlimited.
    if (nvme) {
      OffloadConfig probe = config;
      probe.host_budget_bytes = 0;
      const ElemRange shard{0, params};
      STRATA_ASSIGN_OR_RETURN(std::vector<ElemRange> sgs,
                              CutSubGroups(shard, config.sub_group_elems));
      std::vector<uint64_t> sizes;
      for (const ElemRange& r : sgs) sizes.push_back(r.elems());
      STRATA_ASSIGN_OR_RETURN(PlacementPlan staging,
                              PlanPlacement(PlacementInputsFor(probe, sizes, 1)));
      config.host_budget_bytes = staging.host_staging_bytes + staging.nvme_state_bytes / 4;
    }
  } else {
    STRATA_ASSIGN_OR_RETURN(config.host_budget_bytes, ParseBytes(a.host_budget));
  }
  STRATA_RETURN_IF_ERROR(ValidateConfig(config).WithContext("bench checkpoint"));

  // ---- the model and the optimizer, stepped once: every array holds values ----
  STRATA_ASSIGN_OR_RETURN(std::unique_ptr<Device> device, CreateHostDevice());
  STRATA_ASSIGN_OR_RETURN(DeviceBuffer data, device->Allocate(params * 2));
  STRATA_ASSIGN_OR_RETURN(DeviceBuffer grad, device->Allocate(params * 2));
  {
    auto* d = static_cast<uint16_t*>(data.data());
    auto* g = static_cast<uint16_t*>(grad.data());
    for (uint64_t i = 0; i < params; ++i) {
      d[i] = F32ToBF16(static_cast<float>(i % 1021) * 1e-3f - 0.5f);
      g[i] = F32ToBF16(static_cast<float>(i % 509) * 1e-5f - 2e-3f);
    }
  }
  std::vector<ParamGroup> groups(1);
  groups[0].hyper = DefaultGroupHyper(config);
  groups[0].params.push_back(
      {.name = "w", .data = data.data(), .grad = grad.data(), .elems = params});
  std::fprintf(stderr,
               "bench checkpoint: creating the optimizer of %s params and stepping once ...\n",
               FormatCount(params).c_str());
  STRATA_ASSIGN_OR_RETURN(Stream stream, device->CreateStream());
  STRATA_ASSIGN_OR_RETURN(
      auto opt,
      OffloadOptimizer::Create({.device = device.get(), .stream = stream}, config, groups));
  STRATA_RETURN_IF_ERROR(opt->Step());
  STRATA_RETURN_IF_ERROR(device->StreamSynchronize(stream));
  const PlacementPlan& plan = opt->plan();
  const uint64_t state_bytes = plan.host_state_bytes + plan.nvme_state_bytes;

  // ---- the drives alone ----
  DriveRates ckpt_drive, state_drive;
  const bool one_drive = nvme && SameFilesystem(ckpt_dir, state_dir);
  if (probe_bytes.value_or(1) > 0) {
    STRATA_ASSIGN_OR_RETURN(const uint64_t room, ProbeRoom(std::span(&ckpt_dir, 1), 2, kMiB));
    uint64_t bytes = probe_bytes.value_or(
        std::min<uint64_t>(std::clamp<uint64_t>(state_bytes, 256 * kMiB, 2 * kGiB), room));
    std::fprintf(stderr, "bench checkpoint: drive baseline: %s in %s ...\n",
                 FormatBytes(bytes).c_str(), ckpt_dir.c_str());
    STRATA_ASSIGN_OR_RETURN(
        ckpt_drive, MeasureDriveRates(std::span(&ckpt_dir, 1), bytes, kMiB, 8, "--drive-probe",
                                      "--drive-probe 0 to skip it"));
    if (nvme && plan.nvme_state_bytes > 0 && !one_drive) {
      STRATA_ASSIGN_OR_RETURN(
          state_drive,
          MeasureDriveRates(std::span(&state_dir, 1), bytes, config.aio.block_bytes,
                            config.aio.queue_depth, "--drive-probe", "--drive-probe 0 to skip it"));
    } else {
      state_drive = ckpt_drive;
    }
  }

  // ---- save, verify, load ----
  // Each file a save writes, from its temporary on, the save's directory
  // (from just before it is made), and the save lock (docs/checkpoint.md).
  std::set<std::string> dirs = {ckpt_dir};
  cleanup.AddFile(ckpt_dir + "/strata-save.lock");
  AtomicFileListener previous =
      SetAtomicFileListener([&](AtomicFileEvent event, const std::string& path) {
        std::lock_guard lock(cleanup_mu);
        if (event == AtomicFileEvent::kTemporaryGone) {
          cleanup.Keep(path);
          return;
        }
        if (event == AtomicFileEvent::kCreatingDirectory) {
          if (dirs.insert(path).second) cleanup.AddDir(path);
          return;
        }
        const std::string dir = fs::path(path).parent_path().string();
        if (dirs.insert(dir).second) cleanup.AddDir(dir);
        cleanup.AddFile(path);  // the temporary, then its target
      });
  std::vector<double> save, verify, load, resume;
  Status run = [&]() -> Status {
    for (int r = 0; r < a.repeat; ++r) {
      ::sync();
      auto t0 = std::chrono::steady_clock::now();
      STRATA_RETURN_IF_ERROR(SaveCheckpoint(*opt, ckpt_dir));
      save.push_back(Seconds(t0));
      ::sync();
      t0 = std::chrono::steady_clock::now();
      STRATA_ASSIGN_OR_RETURN(auto reader, CheckpointReader::Open(ckpt_dir));
      STRATA_RETURN_IF_ERROR(reader->Verify());
      verify.push_back(Seconds(t0));
      reader.reset();
      ::sync();
      t0 = std::chrono::steady_clock::now();
      STRATA_RETURN_IF_ERROR(LoadCheckpoint(*opt, ckpt_dir));
      load.push_back(Seconds(t0));
      STRATA_RETURN_IF_ERROR(opt->ResetStateFromParams());
      ::sync();
      t0 = std::chrono::steady_clock::now();
      STRATA_RETURN_IF_ERROR(LoadCheckpoint(*opt, ckpt_dir));
      resume.push_back(Seconds(t0));
      std::fprintf(
          stderr, "bench checkpoint: round %d/%d: save %s, verify %s, load %s, resume %s\n", r + 1,
          a.repeat, FormatSeconds(save.back()).c_str(), FormatSeconds(verify.back()).c_str(),
          FormatSeconds(load.back()).c_str(), FormatSeconds(resume.back()).c_str());
    }
    return OkStatus();
  }();
  SetAtomicFileListener(std::move(previous));
  STRATA_RETURN_IF_ERROR(run);

  // ---- the bound ----
  const double nvme_bytes = static_cast<double>(plan.nvme_state_bytes);
  auto t = [](double bytes, double rate) { return rate > 0 ? bytes / rate : 0.0; };
  auto both = [&](double a_sec, double b_sec) {
    return one_drive ? a_sec + b_sec : std::max(a_sec, b_sec);
  };
  const bool bounded = ckpt_drive.read_bytes_per_sec > 0;
  const double save_bound = both(t(state_bytes, ckpt_drive.synced_write_bytes_per_sec),
                                 t(nvme_bytes, state_drive.read_bytes_per_sec));
  const double load_bound = both(t(state_bytes, ckpt_drive.read_bytes_per_sec),
                                 t(nvme_bytes, state_drive.write_bytes_per_sec));
  const double verify_bound = t(state_bytes, ckpt_drive.read_bytes_per_sec);
  const double save_sec = Median(save), verify_sec = Median(verify), load_sec = Median(load),
               resume_sec = Median(resume);

  if (a.json) {
    nlohmann::json j = {
        {"params", params},
        {"offload", a.offload},
        {"state_bytes", state_bytes},
        {"nvme_state_bytes", plan.nvme_state_bytes},
        {"one_drive", one_drive},
        {"save_sec", save},
        {"verify_sec", verify},
        {"load_sec", load},
        {"resume_sec", resume},
        {"drive_read_bytes_per_sec", ckpt_drive.read_bytes_per_sec},
        {"drive_write_bytes_per_sec", ckpt_drive.write_bytes_per_sec},
        {"drive_synced_write_bytes_per_sec", ckpt_drive.synced_write_bytes_per_sec},
        {"drive_direct_io", ckpt_drive.direct},
        {"save_bound_sec", bounded ? nlohmann::json(save_bound) : nlohmann::json()},
        {"verify_bound_sec", bounded ? nlohmann::json(verify_bound) : nlohmann::json()},
        {"load_bound_sec", bounded ? nlohmann::json(load_bound) : nlohmann::json()},
        {"save_efficiency", bounded ? nlohmann::json(save_bound / save_sec) : nlohmann::json()},
        {"verify_efficiency",
         bounded ? nlohmann::json(verify_bound / verify_sec) : nlohmann::json()},
        {"load_efficiency", bounded ? nlohmann::json(load_bound / load_sec) : nlohmann::json()},
        {"resume_efficiency", bounded ? nlohmann::json(load_bound / resume_sec) : nlohmann::json()},
        {"error", nullptr}};
    if (nvme && !one_drive) {
      j["state_drive_read_bytes_per_sec"] = state_drive.read_bytes_per_sec;
      j["state_drive_write_bytes_per_sec"] = state_drive.write_bytes_per_sec;
    }
    PrintJson(j);
    return OkStatus();
  }
  std::printf("state: %s (%s params, AdamW fp32), %s of it on NVMe%s\n",
              FormatBytes(state_bytes).c_str(), FormatCount(params).c_str(),
              FormatBytes(plan.nvme_state_bytes).c_str(),
              nvme ? (one_drive ? ", the same drive as the checkpoints" : ", another drive") : "");
  if (bounded) {
    std::printf("drive: read %s, write %s, written and synced %s (%s%s)\n",
                FormatRate(ckpt_drive.read_bytes_per_sec).c_str(),
                FormatRate(ckpt_drive.write_bytes_per_sec).c_str(),
                FormatRate(ckpt_drive.synced_write_bytes_per_sec).c_str(),
                FormatBytes(ckpt_drive.bytes).c_str(),
                ckpt_drive.direct ? ", O_DIRECT" : ", buffered: the page cache, not the drive");
  }
  auto line = [&](const char* what, double sec, double bound) {
    std::printf("%-7s %9s  %10s of state", what, FormatSeconds(sec).c_str(),
                FormatRate(state_bytes / sec).c_str());
    if (bounded)
      std::printf("  bound %9s  efficiency %.2f", FormatSeconds(bound).c_str(), bound / sec);
    std::printf("\n");
  };
  std::printf("median of %d:\n", a.repeat);
  line("save", save_sec, save_bound);
  line("verify", verify_sec, verify_bound);
  line("load", load_sec, load_bound);
  line("resume", resume_sec, load_bound);
  std::printf(
      "(load: into the stepped optimizer, every file verified, then read again into the "
      "state;\n resume: into a state as Create writes it, each file read once)\n");
  return OkStatus();
}

}  // namespace

void AddBenchCheckpointCommand(Cli& cli) {
  auto a = std::make_shared<CheckpointArgs>();
  CLI::App* cmd = cli.bench->add_subcommand(
      "checkpoint",
      "Checkpoint save, verify and load of one optimizer's state vs the drive's rates measured "
      "in the same run");
  cmd->add_option("--params", a->params, "Parameters (AdamW: 12 bytes of state each)")
      ->capture_default_str();
  cmd->add_option("--offload", a->offload,
                  "Where the state lives: cpu (DRAM) or nvme (a quarter in DRAM, the rest on NVMe)")
      ->capture_default_str()
      ->check(CLI::IsMember({"nvme", "cpu"}));
  cmd->add_option("--host-budget", a->host_budget,
                  "Pinned DRAM for state + staging (auto: unlimited for cpu, staging + 1/4 of the "
                  "state for nvme)")
      ->capture_default_str();
  cmd->add_option("--sub-group", a->sub_group, "Sub-group size in elements")->capture_default_str();
  cmd->add_option("--dir", a->dir,
                  "Directory on the drive to checkpoint to (default /var/tmp); the bench works in "
                  "a new directory inside it and removes it");
  cmd->add_option("--nvme-dir", a->nvme_dir,
                  "Directory for the NVMe state (--offload nvme; default /var/tmp)");
  cmd->add_option("--drive-probe", a->drive_probe,
                  "Bytes the drive baseline writes and reads (auto: the state's size, 256 MiB to "
                  "2 GiB; 0: skip it, no bound then)")
      ->capture_default_str();
  cmd->add_option("--repeat", a->repeat, "Rounds of save, verify, load")
      ->capture_default_str()
      ->check(Within(1, 100));
  cmd->add_option("--threads", a->threads, "CPU optimizer threads (0: every hardware thread)")
      ->capture_default_str()
      ->check(Within(0, 4096));
  cmd->add_flag("--json", a->json, "Print one JSON object on stdout");
  cmd->callback([&cli, a] {
    RunAction(cli, "bench checkpoint", OutputOf(a->json), [a] { return RunCheckpoint(*a); });
  });
}

}  // namespace strata::cli
