// `strata plan`: reads a DeepSpeed-style config, prints the effective config
// and the placement plan of one rank for a model of --params parameters, or
// the refusal with the knob to turn. Needs no GPU and leaves nothing behind
// (--probe-drive writes its probe files, and makes the nvme_path folders
// that do not exist yet, then removes them), so a config can be checked
// before a job is launched. The preflight checks the
// plan against this machine (memory available, `ulimit -l`, free space of
// the nvme_paths) as the engine will; --no-preflight plans for another one.
// Exit codes: 0 the plan fits, 1 it cannot run here (or the planner refused
// it), 2 a bad command line or config.
#include <fmt/format.h>

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <sstream>
#include <string>

#include "offload/config.h"
#include "offload/layout.h"
#include "offload/placement.h"
#include "runtime/machine.h"
#include "runtime/units.h"
#include "tools/baselines.h"
#include "tools/cleanup.h"
#include "tools/cli.h"
#include "tools/model_tensors.h"

namespace strata::cli {
namespace {

// The nvme_path folders that do not exist yet, made for --probe-drive as the
// engine would make them (mkdir -p) and removed afterwards, also on Ctrl-C,
// so that plan leaves nothing behind.
class ProbeDirs {
 public:
  // Makes each missing directory; the count of nvme_paths made.
  Result<size_t> Make(std::span<const std::string> dirs) {
    namespace fs = std::filesystem;
    size_t made = 0;
    for (const std::string& d : dirs) {
      std::error_code ec;
      std::vector<std::string> missing;  // deepest first
      fs::path p = fs::absolute(d, ec).lexically_normal();
      if (p.filename().empty()) p = p.parent_path();  // "/a/b/"
      for (; p != p.parent_path() && !fs::exists(fs::symlink_status(p, ec)); p = p.parent_path()) {
        missing.push_back(p.string());
      }
      if (missing.empty()) continue;
      // Registered before they exist, outermost first: removed innermost first.
      for (auto it = missing.rbegin(); it != missing.rend(); ++it) cleanup_.AddDir(*it);
      Status s = CreateDirectories(d);
      if (!s.ok()) {
        return std::move(s).WithContext(fmt::format(
            "--probe-drive: nvme_path {} does not exist and cannot be made (the engine would "
            "fail the same way); create it as a user who can (mkdir -p), or choose another "
            "nvme_path",
            d));
      }
      ++made;
    }
    return made;
  }

 private:
  CleanupScope cleanup_;
};

nlohmann::json PlanJson(const PlacementPlan& plan) {
  nlohmann::json tiers = nlohmann::json::array();
  for (const SubGroupPlacement& g : plan.sub_groups) tiers.push_back(TierName(g.tier));
  nlohmann::json buffers = nlohmann::json::array();
  for (const StagingBuffer& b : plan.buffers) {
    buffers.push_back({{"name", b.name},
                       {"tier", TierName(b.tier)},
                       {"count", b.count},
                       {"bytes_each", b.bytes_each}});
  }
  return {{"sub_group_tiers", tiers},
          {"buffers", buffers},
          {"device_state_bytes", plan.device_state_bytes},
          {"gpu_fraction", plan.gpu_fraction()},
          {"host_state_bytes", plan.host_state_bytes},
          {"nvme_state_bytes", plan.nvme_state_bytes},
          {"host_staging_bytes", plan.host_staging_bytes},
          {"device_staging_bytes", plan.device_staging_bytes},
          {"nvme_file_bytes", plan.nvme_file_bytes}};
}

nlohmann::json EstimateJson(const StepEstimate& e) {
  return {{"cpu_adam_sec", e.cpu_adam},
          {"device_adam_sec", e.device_adam},
          {"d2h_sec", e.d2h},
          {"h2d_sec", e.h2d},
          {"nvme_sec", e.nvme},
          {"bound_sec", e.bound()},
          {"bottleneck", e.bottleneck()},
          {"d2h_bytes", e.d2h_bytes},
          {"h2d_bytes", e.h2d_bytes},
          {"nvme_read_bytes", e.nvme_read_bytes},
          {"nvme_write_bytes", e.nvme_write_bytes}};
}

struct PlanArgs {
  std::string config_path;
  // The model: one tensor of `params` elements, or the tensors read from
  // `model_path` (ReadModelTensors).
  std::string params;
  std::string model_path;
  uint32_t world_size = 1;
  uint32_t rank = 0;
  uint32_t ranks_per_node = 0;  // 0: RanksPerNode() (LOCAL_WORLD_SIZE, else 1)
  bool no_preflight = false;
  std::string probe_drive;  // bytes to read and write on the nvme_paths; empty: no probe
  bool json = false;
};

Status RunPlan(const PlanArgs& args) {
  if (args.params.empty() && args.model_path.empty()) {
    return InvalidArgumentError(
        "give the model: --params N (e.g. 7B, planned as one tensor) or --model FILE (its "
        "own tensors, from a .safetensors file, its index, or a list of sizes)");
  }
  if (args.rank >= args.world_size) {
    return InvalidArgumentError(
        fmt::format("--rank {} must be below --world-size {}", args.rank, args.world_size));
  }
  // Checked whatever the plan puts on NVMe (a bad size went unnoticed when
  // nothing was there to probe).
  if (!args.probe_drive.empty() && !ParseBytes(args.probe_drive).ok()) {
    return InvalidArgumentError(fmt::format(
        "--probe-drive {}: {}; give a size such as 4GiB", args.probe_drive,
        ParseBytes(args.probe_drive).status().message()));
  }
  OffloadConfig config;
  if (!args.config_path.empty()) {
    STRATA_ASSIGN_OR_RETURN(std::string text, ReadConfigFile(args.config_path));
    Result<OffloadConfig> parsed = ParseConfigJson(text);
    if (!parsed.ok()) return parsed.status().WithContext(args.config_path);
    config = *std::move(parsed);
  }
  STRATA_RETURN_IF_ERROR(ValidateConfig(config).WithContext(
      args.config_path.empty() ? std::string("default config") : args.config_path));
  std::vector<TensorSpec> model;
  if (!args.model_path.empty()) {
    Result<ModelTensors> read = ReadModelTensors(args.model_path);
    if (!read.ok()) return read.status().WithContext("--model");
    const ModelTensors& m = *read;
    for (uint64_t elems : m.elems) model.push_back({.elems = elems, .dtype = config.param_dtype});
  } else {
    STRATA_ASSIGN_OR_RETURN(uint64_t params, ParseCount(args.params));
    model.push_back({.elems = params, .dtype = config.param_dtype});
  }
  uint64_t model_elems = 0;
  for (const TensorSpec& t : model) model_elems += t.elems;
  STRATA_ASSIGN_OR_RETURN(
      FlatLayout layout,
      PlanFlatLayout(model, {.align_elems = config.align_elems, .world_size = args.world_size}));
  STRATA_ASSIGN_OR_RETURN(ElemRange shard, ShardRange(layout, args.rank));
  STRATA_ASSIGN_OR_RETURN(std::vector<ElemRange> groups,
                          CutSubGroups(shard, SubGroupElemsFor(config, shard.elems(),
                                                               args.world_size)));
  std::vector<uint64_t> sizes;
  for (const ElemRange& g : groups) sizes.push_back(g.elems());
  PlacementInputs inputs = PlacementInputsFor(config, sizes, args.world_size);
  STRATA_ASSIGN_OR_RETURN(inputs.tensor_pieces, CountPieces(layout, groups));
  if (!args.no_preflight) {
    inputs.machine = ProbeMachineLimits(
        inputs.nvme == NvmeTier::kAvailable ? std::span<const std::string>(config.nvme_paths)
                                            : std::span<const std::string>(),
        args.rank, args.ranks_per_node > 0 ? args.ranks_per_node : RanksPerNode("", 1));
  }
  // What --json prints besides the plan, and the plan's own part.
  auto json_head = [&] {
    return nlohmann::json{{"config", nlohmann::json::parse(ConfigToJson(config))},
                          {"rank", args.rank},
                          {"world_size", args.world_size},
                          {"shard_elems", shard.elems()},
                          {"model",
                           {{"tensors", model.size()},
                            {"elems", model_elems},
                            {"padded_elems", layout.total_elems},
                            {"from", args.model_path.empty() ? nlohmann::json(nullptr)
                                                          : nlohmann::json(args.model_path)}}}};
  };
  auto preflight_json = [&](const std::vector<std::string>& warnings) {
    return nlohmann::json{{"checked", !args.no_preflight},
                          {"host_available_bytes", inputs.machine.host_available_bytes},
                          {"ranks_per_node", inputs.machine.ranks_per_node},
                          {"warnings", warnings}};
  };
  Result<PlacementPlan> planned = PlanPlacement(inputs);
  if (!planned.ok()) {
    if (args.json) {
      // The refusal, and what the planner alone makes of the config (the
      // numbers behind a preflight refusal; null where the planner refuses).
      PlacementInputs unchecked = inputs;
      unchecked.machine = MachineLimits{};
      Result<PlacementPlan> shape = PlanPlacement(unchecked);
      nlohmann::json out = json_head();
      out["fits"] = false;
      out["error"] = ErrorJson(planned.status());
      out["plan"] = shape.ok() ? PlanJson(*shape) : nlohmann::json(nullptr);
      out["estimate"] = shape.ok() ? EstimateJson(shape->estimate) : nlohmann::json(nullptr);
      out["preflight"] = preflight_json({});
      PrintJson(out, 2);
    } else {
      // The plan the machine refused, to read the refusal's numbers against
      // (nothing where the planner itself refuses).
      PlacementInputs unchecked = inputs;
      unchecked.machine = MachineLimits{};
      if (Result<PlacementPlan> shape = PlanPlacement(unchecked); shape.ok()) {
        std::printf("%s\npreflight: does not fit this machine (below)\n",
                    FormatPlan(*shape).c_str());
      }
    }
    return planned.status();
  }
  PlacementPlan plan = *std::move(planned);
  // The drive measured: its rates join the config's (strata.rates) in the
  // plan's per-step estimate.
  std::optional<DriveRates> drive;
  // --probe-drive 0: no probe, as --drive-probe 0 in bench step (it probed one block).
  const uint64_t probe_bytes = args.probe_drive.empty() ? 0 : *ParseBytes(args.probe_drive);
  if (probe_bytes > 0 && plan.nvme_sub_groups > 0) {
    ProbeDirs probe_dirs;
    STRATA_ASSIGN_OR_RETURN(const size_t made, probe_dirs.Make(config.nvme_paths));
    std::fprintf(stderr, "plan: measuring the drive under %s (%s%s) ...\n",
                 fmt::format("{}", fmt::join(config.nvme_paths, ", ")).c_str(),
                 FormatBytes(probe_bytes).c_str(),
                 made > 0 ? "; made for the probe as the engine would, removed afterwards" : "");
    STRATA_ASSIGN_OR_RETURN(drive,
                            MeasureDriveRates(config.nvme_paths,
                                              probe_bytes / config.nvme_paths.size(),
                                              config.aio.block_bytes, config.aio.queue_depth,
                                              "--probe-drive",
                                              "leave out --probe-drive to plan without the drive"));
    inputs.rates.nvme_read_bytes_per_sec = drive->read_bytes_per_sec;
    inputs.rates.nvme_write_bytes_per_sec = drive->write_bytes_per_sec;
    STRATA_ASSIGN_OR_RETURN(plan, PlanPlacement(inputs));
  }
  if (std::string w = PaddingWarning(layout); !w.empty()) plan.warnings.push_back(std::move(w));
  const StepEstimate& e = plan.estimate;
  // Both ways at the rate of reads and writes at once (what a step asks).
  const double ranks = std::max<uint32_t>(inputs.machine.ranks_per_node, 1);
  const double nvme_mixed_sec =
      drive ? ranks * static_cast<double>(e.nvme_read_bytes + e.nvme_write_bytes) /
                  drive->mixed_bytes_per_sec
            : 0.0;
  if (args.json) {
    nlohmann::json out = json_head();
    out["fits"] = true;
    out["error"] = nullptr;
    out["plan"] = PlanJson(plan);
    out["preflight"] = preflight_json(plan.warnings);
    out["estimate"] = EstimateJson(e);
    if (drive) {
      out["drive"] = {{"read_bytes_per_sec", drive->read_bytes_per_sec},
                      {"write_bytes_per_sec", drive->write_bytes_per_sec},
                      {"mixed_bytes_per_sec", drive->mixed_bytes_per_sec},
                      {"nvme_sec_mixed", nvme_mixed_sec}};
    }
    PrintJson(out, 2);
    return OkStatus();
  }
  std::printf("effective config:\n%s\n", ConfigToJson(config).c_str());
  if (args.model_path.empty()) {
    std::printf("model: %s elements as one tensor (--model lays out the model's own: each "
                "starts at a multiple of %llu elements, which can add a sub-group)\n",
                FormatCount(model_elems).c_str(),
                static_cast<unsigned long long>(config.align_elems));
  } else {
    std::printf("model: %zu tensors, %s elements (%s); each starts at a multiple of %llu "
                "elements: padding adds %llu\n",
                model.size(), FormatCount(model_elems).c_str(), args.model_path.c_str(),
                static_cast<unsigned long long>(config.align_elems),
                static_cast<unsigned long long>(layout.total_elems - model_elems));
  }
  std::printf("rank %u of %u: %s elements in %zu sub-groups\n", args.rank, args.world_size,
              FormatCount(shard.elems()).c_str(), groups.size());
  std::fputs(FormatPlan(plan).c_str(), stdout);
  if (drive) {
    std::printf(
        "nvme per step: this drive reads %s and writes %s alone (the estimate above), %s with "
        "both at once: %s to %s of NVMe time per step, which CPU Adam hides when it takes "
        "longer\n",
        FormatRate(drive->read_bytes_per_sec).c_str(),
        FormatRate(drive->write_bytes_per_sec).c_str(),
        FormatRate(drive->mixed_bytes_per_sec).c_str(),
        FormatSeconds(std::min(e.nvme, nvme_mixed_sec)).c_str(),
        FormatSeconds(std::max(e.nvme, nvme_mixed_sec)).c_str());
  } else if (probe_bytes > 0) {
    std::printf("nvme per step: nothing on NVMe in this plan\n");
  }
  if (args.no_preflight) {
    std::printf("preflight: not checked (--no-preflight)\n");
  } else {
    const uint32_t per_node = inputs.machine.ranks_per_node;
    const std::string shared =
        per_node > 1 ? fmt::format(", shared by {} ranks", per_node)
        : args.world_size > 1
            ? std::string(", for 1 rank on this machine: --ranks-per-node (or LOCAL_WORLD_SIZE) "
                          "says how many share it")
            : std::string();
    std::printf("preflight: fits this machine (%s of memory available%s%s)\n",
                FormatBytes(inputs.machine.host_available_bytes).c_str(),
                inputs.machine.host_memory_note.c_str(), shared.c_str());
  }
  return OkStatus();
}

}  // namespace

void AddPlanCommand(Cli& cli) {
  auto args = std::make_shared<PlanArgs>();
  CLI::App* cmd = cli.app.add_subcommand(
      "plan", "Check a config and print where one rank's optimizer state would live");
  cmd->add_option("--config", args->config_path, "DeepSpeed-style JSON config (default: defaults)")
      ->check(CLI::ExistingFile);
  CLI::Option* params = cmd->add_option("--params", args->params,
                                         "model parameters, e.g. 7B or 350M (as one tensor)");
  CLI::Option* model =
      cmd->add_option(
             "--model", args->model_path,
             "the model's own tensors, laid out as the engine will: a .safetensors file, its "
             "*.safetensors.index.json, a directory with them, or a text file with one size per "
             "line "
             "(16777216, 4096x4096 or (4096, 4096), after an optional name)")
          ->check(CLI::ExistingPath);
  params->excludes(model);
  model->excludes(params);
  cmd->add_option("--world-size", args->world_size, "data-parallel ranks")
      ->check(Within(1u, 1u << 16));  // the planner's limit
  cmd->add_option("--rank", args->rank, "the rank to plan for");
  cmd->add_option("--ranks-per-node", args->ranks_per_node,
                  "ranks sharing this machine's memory (default: $LOCAL_WORLD_SIZE, else 1)")
      ->check(Within(1u, 65536u));
  cmd->add_flag("--no-preflight", args->no_preflight,
                "do not check the plan against this machine (plan for another one)");
  cmd->add_option("--probe-drive", args->probe_drive,
                  "measure the drive under the config's nvme_path with this many bytes (e.g. "
                  "2GiB: at least a few GiB where a cache may hold a small file) and print the "
                  "expected NVMe time per step; 0: no probe");
  cmd->add_flag("--json", args->json, "print one JSON object");
  cmd->callback([&cli, args] {
    RunAction(cli, "plan", OutputOf(args->json), [args] { return RunPlan(*args); });
  });
}

}  // namespace strata::cli
