// `strata inspect DIR [--verify] [--json]`: what a checkpoint holds, and
// whether every checksum holds (the validator every reader applies, then
// every byte). `strata export DIR OUT [--dtype] [--max-shard-size] [--force]`:
// the full weights as safetensors that torch's load_state_dict takes, one
// file or Hugging Face shards with an index. Neither needs a GPU or the model.
#include "offload/checkpoint.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <map>
#include <nlohmann/json.hpp>
#include <regex>
#include <string>
#include <vector>

#include "runtime/atomic_file.h"
#include "runtime/units.h"
#include "tools/cleanup.h"
#include "tools/cli.h"

namespace strata::cli {
namespace {

struct InspectArgs {
  std::string dir;
  bool verify = false;
  bool json = false;
};

constexpr size_t kListedTensors = 50;

// "1 group", "2 groups".
std::string Plural(size_t n, std::string_view noun) {
  return fmt::format("{} {}{}", n, noun, n == 1 ? "" : "s");
}

Status RunInspect(const InspectArgs& args) {
  // Load takes a save whose tensors share a name (by index): so does inspect.
  STRATA_ASSIGN_OR_RETURN(
      auto reader, CheckpointReader::Open(args.dir, {.duplicate_names = DuplicateNames::kAllow}));
  const CheckpointInfo& info = reader->info();
  std::string duplicate;  // the first name two tensors share, as export would key them
  {
    std::map<std::string, size_t> seen;
    for (size_t i = 0; i < info.tensors.size() && duplicate.empty(); ++i) {
      const std::string& n = info.tensors[i].name;
      const std::string key = n.empty() ? fmt::format("param.{}", i) : n;
      if (auto [it, inserted] = seen.emplace(key, i); !inserted) {
        duplicate = fmt::format("tensors {} and {} are both named '{}'", it->second, i, key);
      }
    }
  }
  // Without --verify, every data file is still there with its size: a save
  // missing a file fails inspect as it would fail a load.
  Status verified = args.verify ? reader->Verify() : reader->CheckFiles();
  uint64_t files = 0;
  for (const RankManifest& r : info.ranks) files += r.files.size();
  if (args.json) {
    nlohmann::json tensors = nlohmann::json::array();
    for (const CheckpointTensor& t : info.tensors) {
      tensors.push_back({{"name", t.name},
                         {"group", t.group},
                         {"offset_elems", t.offset_elems},
                         {"elems", t.elems},
                         {"shape", t.shape ? nlohmann::json(*t.shape) : nlohmann::json(nullptr)}});
    }
    nlohmann::json groups = nlohmann::json::array();
    for (const GroupHyper& h : info.groups) {
      groups.push_back({{"lr", h.lr},
                        {"beta1", h.beta1},
                        {"beta2", h.beta2},
                        {"eps", h.eps},
                        {"weight_decay", h.weight_decay}});
    }
    nlohmann::json out = {
        {"dir", info.root},
        {"save_dir", info.save_dir},
        {"save_id", info.save_id},
        {"format_version", info.format_version},
        {"step", info.step},
        {"world_size", info.world_size},
        {"optimizer", info.optimizer},
        {"arrays", info.arrays},
        {"param_dtype", info.param_dtype},
        {"tensor_elems", info.tensor_elems},
        {"total_elems", info.total_elems},
        {"loss_scale", info.scaler.scale},
        {"files", files},
        {"data_bytes", info.data_bytes()},
        {"verified", args.verify ? nlohmann::json(verified.ok()) : nlohmann::json(nullptr)},
        // Without --verify: every data file is there with its manifest's size.
        {"files_present", args.verify ? nlohmann::json(nullptr) : nlohmann::json(verified.ok())},
        {"tensors", tensors},
        {"groups", groups}};
    out["error"] = ErrorJson(verified);
    out["duplicate_names"] =
        duplicate.empty() ? nlohmann::json(nullptr) : nlohmann::json(duplicate);
    PrintJson(out, 2);
    return verified;
  }
  std::printf("checkpoint %s\n", info.root.c_str());
  std::printf("  save         %s\n", info.save_dir.c_str());
  std::printf("  format       %s version %d\n", std::string(kCheckpointFormatName).c_str(),
              info.format_version);
  std::printf("  step         %lld\n", static_cast<long long>(info.step));
  std::printf("  world size   %u\n", info.world_size);
  std::printf("  optimizer    %s (%s), params %s\n", info.optimizer.c_str(),
              fmt::format("{}", fmt::join(info.arrays, ", ")).c_str(), info.param_dtype.c_str());
  std::printf("  params       %s, %llu elems (%llu with padding), %s\n",
              Plural(info.tensors.size(), "tensor").c_str(),
              static_cast<unsigned long long>(info.tensor_elems),
              static_cast<unsigned long long>(info.total_elems),
              Plural(info.groups.size(), "group").c_str());
  std::printf("  loss scale   %g (iteration %lld)\n", info.scaler.scale,
              static_cast<long long>(info.scaler.iteration));
  std::printf("  data         %llu files, %s\n", static_cast<unsigned long long>(files),
              FormatBytes(info.data_bytes()).c_str());
  if (!args.verify && verified.ok()) {
    std::printf(
        "  checksums    not verified (--verify reads every byte); every data file is there "
        "with its size\n");
  } else if (!args.verify) {
    std::printf("  files        FAILED (below)\n");
  } else if (verified.ok()) {
    std::printf("  checksums    verified: every chunk and file matches its XXH3\n");
  } else {
    std::printf("  checksums    FAILED (below)\n");
  }
  if (!duplicate.empty()) {
    std::printf(
        "  names        %s: export and state_dict_from_checkpoint refuse it; load it into an "
        "optimizer of the same params with unique names and save again\n",
        duplicate.c_str());
  }
  for (uint32_t g = 0; g < info.groups.size(); ++g) {
    const GroupHyper& h = info.groups[g];
    std::printf("  group %u      lr %g, betas (%g, %g), eps %g, weight decay %g\n", g, h.lr,
                h.beta1, h.beta2, h.eps, h.weight_decay);
  }
  std::printf("  tensors:\n");
  for (size_t i = 0; i < info.tensors.size() && i < kListedTensors; ++i) {
    const CheckpointTensor& t = info.tensors[i];
    const std::string shape =
        t.shape ? fmt::format("shape [{}]", fmt::join(*t.shape, ", ")) : "no shape recorded";
    std::printf("    %4zu  %-32s group %u  %llu elems, %s\n", i,
                t.name.empty() ? fmt::format("param.{}", i).c_str() : t.name.c_str(), t.group,
                static_cast<unsigned long long>(t.elems), shape.c_str());
  }
  if (info.tensors.size() > kListedTensors) {
    std::printf("    ... %zu more (--json lists all)\n", info.tensors.size() - kListedTensors);
  }
  return verified;
}

constexpr std::string_view kIndexName = "model.safetensors.index.json";

bool IsShardName(const std::string& name) {
  static const std::regex shard("model-[0-9]{5,}-of-[0-9]{5,}\\.safetensors");
  return std::regex_match(name, shard);
}

// Runs an export so that a signal (Ctrl-C, kill, a closed terminal) removes
// what it leaves unfinished: the temporaries (the one being written and the
// sealed shards, as large as their targets, and hidden) and, in the short
// window where the sealed shards are renamed into place, the shards already
// renamed, which are no export without their index (the next export would
// refuse them as existing files). Once the index is written the shards
// stay. A failure keeps them (the error says what failed); the re-run's
// error then says what they are.
Result<ExportResult> ExportRemovingWhatASignalInterrupts(const std::string& dir,
                                                         const std::string& out,
                                                         const ExportOptions& options) {
  CleanupScope cleanup;
  std::vector<std::string> shards;
  AtomicFileListener previous =
      SetAtomicFileListener([&](AtomicFileEvent event, const std::string& path) {
        const std::string name = std::filesystem::path(path).filename().string();
        switch (event) {
          case AtomicFileEvent::kCreatingTemporary:
            cleanup.AddFile(path);
            break;
          case AtomicFileEvent::kTemporaryGone:
            cleanup.Keep(path);
            break;
          case AtomicFileEvent::kCreatingDirectory:  // an export makes none
            break;
          case AtomicFileEvent::kCommitted:
            if (IsShardName(name)) {
              cleanup.AddFile(path);
              shards.push_back(path);
            } else if (name == kIndexName) {
              for (const std::string& shard : shards) cleanup.Keep(shard);
              shards.clear();
            }
            break;
        }
      });
  Result<ExportResult> result = ExportSafetensors(dir, out, options);
  SetAtomicFileListener(std::move(previous));
  for (const std::string& shard : shards) cleanup.Keep(shard);
  return result;
}

// An export refused because OUT holds shards and no index: the files of an
// export that a signal, SIGKILL or an error ended before it wrote its index.
Status ExplainUnfinishedExport(Status s, const std::string& out) {
  if (s.ok() || s.code() != StatusCode::kFailedPrecondition) return s;
  std::error_code ec;
  if (!std::filesystem::is_directory(out, ec) ||
      std::filesystem::exists(std::filesystem::path(out) / kIndexName, ec)) {
    return s;
  }
  std::vector<std::string> shards, temporaries;
  for (const auto& e : std::filesystem::directory_iterator(out, ec)) {
    const std::string name = e.path().filename().string();
    if (IsShardName(name)) shards.push_back(name);
  }
  if (shards.empty()) return s;
  std::sort(shards.begin(), shards.end());
  // Those of a writer that is gone (SIGKILL): the export with --force removes them.
  for (const std::string& path : DeadTemporaries(
           out, [](std::string_view target) { return IsShardName(std::string(target)); })) {
    temporaries.push_back(std::filesystem::path(path).filename().string());
  }
  return Status(
      s.code(),
      fmt::format("{}; note: {} holds {} ({}{}) but no {}: an export that was interrupted or "
                  "failed before it wrote its index; --force replaces them{}",
                  s.message(), out, Plural(shards.size(), "shard"), shards.front(),
                  shards.size() > 1 ? fmt::format(" ... {}", shards.back()) : "", kIndexName,
                  temporaries.empty() ? ""
                                      : fmt::format(" and removes its hidden temporaries ({})",
                                                    fmt::join(temporaries, ", "))));
}

}  // namespace

void AddCheckpointCommands(Cli& cli) {
  auto inspect = std::make_shared<InspectArgs>();
  CLI::App* cmd = cli.app.add_subcommand(
      "inspect", "Print what a checkpoint holds (step, world size, params, bytes, checksums)");
  cmd->add_option("dir", inspect->dir, "checkpoint directory (given to Save) or a step-* save")
      ->required();
  cmd->add_flag("--verify", inspect->verify, "read every data file and check every checksum");
  cmd->add_flag("--json", inspect->json, "print one JSON object");
  cmd->callback([&cli, inspect] {
    RunAction(cli, "inspect", OutputOf(inspect->json), [&] { return RunInspect(*inspect); });
  });

  struct ExportArgs {
    std::string dir, out, dtype = "fp32", max_shard_size;
    bool force = false;
  };
  auto args = std::make_shared<ExportArgs>();
  CLI::App* exp = cli.app.add_subcommand(
      "export",
      "Write a checkpoint's full weights as safetensors (shaped, named: model.load_state_dict "
      "takes them)");
  exp->add_option("dir", args->dir, "checkpoint directory (given to Save) or a step-* save")
      ->required();
  exp->add_option("out", args->out,
                  "OUT.safetensors: one file; anything else: a directory that receives "
                  "model.safetensors, or shards and model.safetensors.index.json")
      ->required();
  exp->add_option("--dtype", args->dtype, "fp32 (default), bf16 (round to nearest even) or fp16")
      ->check(CLI::IsMember({"fp32", "bf16", "fp16"}));
  exp->add_option("--max-shard-size", args->max_shard_size,
                  "at most this many bytes of tensors per file (e.g. 5GiB; binary units), "
                  "Hugging Face shards with an index; OUT must be a directory");
  exp->add_flag("--force", args->force,
                "replace output files that exist, and remove an earlier export's files in the "
                "other layout (model.safetensors vs shards and index) from OUT");
  exp->callback([&cli, args] {
    RunAction(cli, "export", [&]() -> Status {
      ExportOptions options;
      options.dtype = args->dtype == "bf16"   ? DType::kBF16
                      : args->dtype == "fp16" ? DType::kF16
                                              : DType::kF32;
      if (!args->max_shard_size.empty()) {
        STRATA_ASSIGN_OR_RETURN(options.max_shard_bytes, ParseBytes(args->max_shard_size));
        if (options.max_shard_bytes == 0) {
          return InvalidArgumentError("--max-shard-size 0: give a positive size, e.g. 5GiB");
        }
      }
      options.existing = args->force ? ExistingFile::kReplace : ExistingFile::kRefuse;
      Result<ExportResult> exported =
          ExportRemovingWhatASignalInterrupts(args->dir, args->out, options);
      if (!exported.ok()) return ExplainUnfinishedExport(exported.status(), args->out);
      const ExportResult& r = *exported;
      for (const std::string& f : r.files) std::printf("wrote %s\n", f.c_str());
      for (const std::string& f : r.removed) {
        std::printf("removed %s (an earlier export in another layout)\n", f.c_str());
      }
      std::printf("%llu tensors, %s of %s weights\n", static_cast<unsigned long long>(r.tensors),
                  FormatBytes(r.tensor_bytes).c_str(), args->dtype.c_str());
      return OkStatus();
    });
  });
}

}  // namespace strata::cli
