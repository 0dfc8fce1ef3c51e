#include "offload/config.h"

#include <fmt/format.h>

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdlib>
#include <limits>
#include <mutex>
#include <nlohmann/json.hpp>
#include <optional>
#include <set>
#include <string>

#include "runtime/json_walker.h"
#include "runtime/log.h"
#include "runtime/spelling.h"
#include "runtime/units.h"

namespace strata {
namespace {

using Json = nlohmann::json;

// DeepSpeed keys that do not apply to an optimizer-offload engine. A section
// listed here is accepted with everything under it.
constexpr std::string_view kIgnoredKeys[] = {
    // top level: training loop, logging, other features
    "train_batch_size",
    "train_micro_batch_size_per_gpu",
    "gradient_accumulation_steps",
    "steps_per_print",
    "wall_clock_breakdown",
    "dump_state",
    "scheduler",
    "zero_allow_untested_optimizer",
    "zero_force_ds_cpu_optimizer",
    "prescale_gradients",
    "gradient_predivide_factor",
    "sparse_gradients",
    "seq_parallel_communication_data_type",
    "seq_parallel_comm_data_type",  // DeepSpeed's own spelling of the key above
    "activation_checkpointing",
    "flops_profiler",
    "tensorboard",
    "wandb",
    "csv_monitor",
    "comet",
    "comms_logger",
    "memory_breakdown",
    "elasticity",
    "checkpoint",
    "data_types",
    "amp",
    "compression_training",
    "data_efficiency",
    "autotuning",
    "pipeline",
    "timers",
    "disable_allgather",
    "dataloader_drop_last",
    "sparse_attention",
    "hybrid_engine",
    "compile",
    "graph_harvesting",
    "eigenvalue",
    "use_data_before_expert_parallelism",
    // zero_optimization: communication buckets and stage-3 parameter partitioning
    "zero_optimization.offload_param",
    "zero_optimization.overlap_comm",
    "zero_optimization.contiguous_gradients",
    "zero_optimization.reduce_bucket_size",
    "zero_optimization.allgather_bucket_size",
    "zero_optimization.reduce_scatter",
    "zero_optimization.allgather_partitions",
    "zero_optimization.round_robin_gradients",
    "zero_optimization.elastic_checkpoint",
    "zero_optimization.load_from_fp32_weights",
    "zero_optimization.cpu_offload",
    "zero_optimization.ignore_unused_parameters",
    "zero_optimization.stage3_prefetch_bucket_size",
    "zero_optimization.stage3_param_persistence_threshold",
    "zero_optimization.stage3_max_live_parameters",
    "zero_optimization.stage3_max_reuse_distance",
    "zero_optimization.stage3_gather_16bit_weights_on_model_save",
    "zero_optimization.stage3_gather_fp16_weights_on_model_save",
    "zero_optimization.zero_hpz_partition_size",
    "zero_optimization.zero_quantized_weights",
    "zero_optimization.zero_quantized_gradients",
    "zero_optimization.mics_shard_size",
    "zero_optimization.memory_efficient_linear",
    "zero_optimization.use_multi_rank_bucket_allreduce",
    "zero_optimization.stage3_model_persistence_threshold",
    "zero_optimization.stage3_module_granularity_threshold",
    "zero_optimization.stage3_use_all_reduce_for_fetch_params",
    "zero_optimization.stage3_allgather_sequential",
    "zero_optimization.stage3_partition_stream_chunk_size",
    "zero_optimization.zero_quantized_nontrainable_weights",
    "zero_optimization.zeropp_loco_param",
    "zero_optimization.mics_hierarchical_params_gather",
    "zero_optimization.legacy_stage1",
    "zero_optimization.cpu_offload_param",
    "zero_optimization.cpu_offload_use_pin_memory",
    "zero_optimization.pipeline_loading_checkpoint",
    "zero_optimization.override_module_apply",
    "zero_optimization.log_trace_cache_warnings",
    "zero_optimization.enable_sanity_checks",
    "zero_optimization.leaf_module",
    "zero_optimization.offload_optimizer.pipeline_read",
    "zero_optimization.offload_optimizer.pipeline_write",
    "zero_optimization.offload_optimizer.pipeline",
    "zero_optimization.offload_optimizer.super_offload",
    "zero_optimization.offload_optimizer.convert_grad_on_cpu",
    "zero_optimization.offload_optimizer.cpuadam_cores_perc",
    // aio
    "aio.intra_op_parallelism",
    // optimizer
    "optimizer.legacy_fusion",
    "optimizer.params.torch_adam",
    "optimizer.params.fused",
    // fp16 / bf16
    "fp16.auto_cast",
    "fp16.fused_mode",
    "fp16.fp16_master_weights_and_grads",
    "bf16.immediate_grad_update",
    // Strata keeps fp32 master weights and moments whatever these say, as
    // for fp16.fp16_master_weights_and_grads: more precise, more memory
    // (the plan shows it).
    "bf16.bf16_master_weights_and_grads",
    "bf16.bf16_optimizer_states",
    "bf16.check_grad_overflow",
};

bool IsIgnored(std::string_view path) {
  return std::find(std::begin(kIgnoredKeys), std::end(kIgnoredKeys), path) !=
         std::end(kIgnoredKeys);
}

// DeepSpeed keys whose DeepSpeed meaning Strata cannot honour: refused, saying
// what DeepSpeed does and what to write instead (an unknown-key error would
// read as a typo). A value that switches the feature off (SwitchedOff) asks
// for nothing and is accepted like an ignored key.
struct UnsupportedKey {
  std::string_view path;
  std::string_view why;
};
constexpr UnsupportedKey kUnsupportedKeys[] = {
    {"bfloat16",
     "it is DeepSpeed's old name for the bf16 section: rename it to bf16"},
    {"torch_autocast",
     "DeepSpeed runs the model's forward under torch.autocast, and Strata does not run the "
     "forward: wrap it in torch.autocast in the training loop and drop the key"},
    {"gradient_allreduce_op",
     "DeepSpeed's \"sum\" adds the ranks' gradients, and Strata averages them (\"mean\"): "
     "drop the key, or multiply the loss by the world size to train on the sum"},
    {"tensor_parallel",
     "DeepSpeed's AutoTP splits the model's layers over ranks, and Strata shards only the "
     "optimizer state over data-parallel ranks: drop the key"},
    {"progressive_layer_drop",
     "DeepSpeed's engine hands the model a layer-drop schedule, and Strata does not drive the "
     "model: drop the key (or set enabled false)"},
    {"curriculum_learning",
     "DeepSpeed's engine hands the model a growing sequence length, and Strata does not drive "
     "the data or the model: drop the key (or set enabled false)"},
    {"zero_optimization.zenflow",
     "ZenFlow applies the smaller gradients late, and Strata updates every param at every "
     "step: drop the section"},
    {"optimizer.params.max_grad_norm",
     "DeepSpeed refuses it too and clips by the top-level gradient_clipping: move the value "
     "there"},
};

const UnsupportedKey* FindUnsupported(std::string_view path) {
  for (const UnsupportedKey& k : kUnsupportedKeys) {
    if (k.path == path) return &k;
  }
  return nullptr;
}

std::string Lower(std::string s) {
  for (char& c : s) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return s;
}

// The value of an unsupported key switches its feature off: false,
// {"enabled": false}, or gradient_allreduce_op "mean" (what Strata does).
bool SwitchedOff(std::string_view path, const Json& v) {
  if (v.is_boolean()) return !v.get<bool>();
  if (v.is_object()) {
    auto it = v.find("enabled");
    return it != v.end() && it->is_boolean() && !it->get<bool>();
  }
  return path == "gradient_allreduce_op" && v.is_string() && Lower(v.get<std::string>()) == "mean";
}

// Ignored DeepSpeed keys whose DeepSpeed meaning changes the training: a
// warning at every config that holds them (a notebook's second optimizer
// included), saying what to do instead. The rest of kIgnoredKeys (logging,
// profiling, communication buckets, stage-3 partitioning) are an info line.
// An empty string: the key needs no warning for this value.
std::string IgnoredEffect(std::string_view path, const Json& value) {
  if (path == "scheduler") {
    const std::string type =
        value.is_object() && value.contains("type") && value["type"].is_string()
            ? fmt::format(" ({})", value["type"].get<std::string>())
            : "";
    return fmt::format(
        "config: scheduler{} is not applied: Strata runs no DeepSpeed LR scheduler, so the lr "
        "stays optimizer.params.lr. Drive the lr yourself: with strata.torch.OffloadAdam any "
        "torch.optim.lr_scheduler, in C++ OffloadOptimizer::SetGroupHyper (C: "
        "strata_optimizer_set_lr) before each step",
        type);
  }
  if (path == "gradient_accumulation_steps" && value.is_number() && value.get<double>() > 1) {
    return fmt::format(
        "config: gradient_accumulation_steps = {} is not applied: Strata does not divide the "
        "gradients by it, so a step gets the sum of its micro-steps' gradients where DeepSpeed "
        "averages them (the update differs when clipping or the loss scale is at work, and the "
        "grad norm is {} times larger). Divide the loss by the number of micro-steps",
        value.dump(), value.dump());
  }
  return "";
}

void LogIgnoredOnce(const std::string& path) {
  static std::mutex mu;
  static std::set<std::string> seen;
  {
    std::lock_guard<std::mutex> lock(mu);
    if (!seen.insert(path).second) return;
  }
  LogInfo(fmt::format("config: {} is a DeepSpeed key that Strata ignores", path));
}

std::string Join(std::string_view path, std::string_view key) {
  return path.empty() ? std::string(key) : fmt::format("{}.{}", path, key);
}

// A value as compact JSON, cut to 60 characters. Written here rather than by
// dump(), which recurses through the whole value: a deeply nested one (a
// million '[') overflowed the stack. This stops at 60 characters and 16
// levels.
std::string Describe(const Json& v) {
  constexpr size_t kMaxChars = 60;
  std::string out;
  auto write = [&](auto& self, const Json& x, int depth) -> void {
    if (out.size() > kMaxChars) return;
    if (!x.is_structured()) {
      // `replace`: a string that is not UTF-8 is shown, not thrown on.
      out += x.dump(-1, ' ', false, Json::error_handler_t::replace);
      return;
    }
    const bool object = x.is_object();
    if (depth == 0 && !x.empty()) {
      out += object ? "{...}" : "[...]";
      return;
    }
    out += object ? '{' : '[';
    for (auto it = x.begin(); it != x.end() && out.size() <= kMaxChars; ++it) {
      if (it != x.begin()) out += ',';
      if (object) out += Json(it.key()).dump(-1, ' ', false, Json::error_handler_t::replace) + ":";
      self(self, *it, depth - 1);
    }
    out += object ? '}' : ']';
  };
  write(write, v, 16);
  if (out.size() > kMaxChars) out = out.substr(0, kMaxChars - 3) + "...";
  return out;
}

// Every key of `obj` must be in `known` or in the ignored table.
Status CheckKeys(const Json& obj, std::string_view path,
                 std::initializer_list<std::string_view> known) {
  for (const auto& [key, value] : obj.items()) {
    if (std::find(known.begin(), known.end(), key) != known.end()) continue;
    const std::string full = Join(path, key);
    if (const UnsupportedKey* u = FindUnsupported(full)) {
      if (!SwitchedOff(full, value)) {
        return InvalidArgumentError(
            fmt::format("{}: a DeepSpeed key Strata does not support; {}", full, u->why));
      }
      LogIgnoredOnce(full);
      continue;
    }
    if (IsIgnored(full)) {
      if (const std::string effect = IgnoredEffect(full, value); !effect.empty()) {
        LogWarning(effect);
      } else {
        LogIgnoredOnce(full);
      }
      continue;
    }
    std::vector<std::string_view> candidates(known.begin(), known.end());
    // A typo of an ignored (or refused) DeepSpeed key at this level gets the
    // same hint.
    const std::string prefix = path.empty() ? std::string() : std::string(path) + ".";
    auto child = [&](std::string_view deepspeed_path) -> std::optional<std::string_view> {
      if (!deepspeed_path.starts_with(prefix)) return std::nullopt;
      const std::string_view rest = deepspeed_path.substr(prefix.size());
      if (rest.find('.') != std::string_view::npos) return std::nullopt;
      return rest;
    };
    size_t ignored_here = 0;
    for (std::string_view ignored : kIgnoredKeys) {
      if (auto rest = child(ignored)) candidates.push_back(*rest), ++ignored_here;
    }
    for (const UnsupportedKey& u : kUnsupportedKeys) {
      if (auto rest = child(u.path)) candidates.push_back(*rest);
    }
    const std::string_view best = NearestSpelling(key, candidates);
    std::string hint;
    if (!best.empty()) {
      hint = fmt::format(" (did you mean {}?)", best);
    } else if (ignored_here > 0) {
      // Listing Strata's keys alone would read as "the DeepSpeed keys that are
      // accepted here are refused too".
      hint = fmt::format(
          " (known keys here: {}; and {} DeepSpeed keys accepted and ignored, listed in "
          "docs/config.md)",
          fmt::join(known, ", "), ignored_here);
    } else {
      hint = fmt::format(" (known keys here: {})", fmt::join(known, ", "));
    }
    return InvalidArgumentError(fmt::format("{}: unknown key{}", full, hint));
  }
  return OkStatus();
}

Status TypeError(const std::string& path, const Json& v, std::string_view expected) {
  std::string hint;
  if (v.is_string() && v.get<std::string>() == "auto") {
    hint = "; \"auto\" is filled in by the Hugging Face integration, give a value";
  }
  return InvalidArgumentError(
      fmt::format("{} = {}: expected {}{}", path, Describe(v), expected, hint));
}

const Json* Find(const Json& obj, std::string_view key) {
  auto it = obj.find(key);
  return it == obj.end() ? nullptr : &*it;
}

bool IsZero(const Json* v) { return v != nullptr && v->is_number() && v->get<double>() == 0; }

Result<const Json*> Section(const Json& obj, std::string_view path, std::string_view key) {
  const Json* v = Find(obj, key);
  if (v == nullptr) return static_cast<const Json*>(nullptr);
  if (!v->is_object()) return TypeError(Join(path, key), *v, "an object");
  return v;
}

// An integer in [lo, hi]; a float with an integral value (1e8) is accepted.
Result<std::optional<uint64_t>> GetUint(const Json& obj, std::string_view path,
                                        std::string_view key, uint64_t lo, uint64_t hi) {
  const Json* v = Find(obj, key);
  if (v == nullptr) return std::optional<uint64_t>();
  const std::string full = Join(path, key);
  const std::string range = fmt::format("an integer in [{}, {}]", lo, hi);
  std::optional<uint64_t> value;
  if (v->is_number_unsigned()) {
    value = v->get<uint64_t>();
  } else if (v->is_number_integer()) {
    if (v->get<int64_t>() >= 0) value = static_cast<uint64_t>(v->get<int64_t>());
  } else if (v->is_number_float()) {
    const double d = v->get<double>();
    if (d >= 0 && d < 1.8e19 && std::floor(d) == d) value = static_cast<uint64_t>(d);
  } else {
    return TypeError(full, *v, range);
  }
  if (!value || *value < lo || *value > hi) {
    return InvalidArgumentError(fmt::format("{} = {}: must be {}", full, Describe(*v), range));
  }
  return value;
}

// A byte count: an integer, or a string with units ("64GiB").
Result<std::optional<uint64_t>> GetBytes(const Json& obj, std::string_view path,
                                         std::string_view key, uint64_t lo, uint64_t hi) {
  const Json* v = Find(obj, key);
  if (v == nullptr || !v->is_string()) return GetUint(obj, path, key, lo, hi);
  const std::string full = Join(path, key);
  Result<uint64_t> bytes = ParseBytes(v->get<std::string>());
  if (!bytes.ok()) {
    // "auto" gets TypeError's hint; otherwise the parser says what is wrong
    // (an unknown suffix, ...).
    if (v->get<std::string>() == "auto") {
      return TypeError(full, *v, "a byte count (an integer or a size such as \"64GiB\")");
    }
    return InvalidArgumentError(fmt::format("{} = {}: expected a byte count (an integer or a "
                                            "size such as \"64GiB\"): {}",
                                            full, Describe(*v), bytes.status().message()));
  }
  if (*bytes < lo || *bytes > hi) {
    return InvalidArgumentError(fmt::format("{} = {}: must be in [{}, {}] bytes", full,
                                            Describe(*v), FormatBytes(lo), FormatBytes(hi)));
  }
  return std::optional<uint64_t>(*bytes);
}

enum class Bound : uint8_t { kClosed, kOpen };

// A finite number in the range [lo, hi] (or (lo, hi] etc. per bound).
Result<std::optional<double>> GetDouble(const Json& obj, std::string_view path,
                                        std::string_view key, double lo, Bound lo_bound, double hi,
                                        Bound hi_bound) {
  const Json* v = Find(obj, key);
  if (v == nullptr) return std::optional<double>();
  const std::string full = Join(path, key);
  const std::string range = fmt::format(
      "a number in {}{}, {}{}", lo_bound == Bound::kClosed ? "[" : "(", lo,
      std::isinf(hi) ? "inf" : fmt::format("{}", hi), hi_bound == Bound::kClosed ? "]" : ")");
  if (!v->is_number()) return TypeError(full, *v, range);
  const double d = v->get<double>();
  const bool ok = std::isfinite(d) && (lo_bound == Bound::kClosed ? d >= lo : d > lo) &&
                  (hi_bound == Bound::kClosed ? d <= hi : d < hi);
  if (!ok)
    return InvalidArgumentError(fmt::format("{} = {}: must be {}", full, Describe(*v), range));
  return std::optional<double>(d);
}

Result<std::optional<Switch>> GetSwitch(const Json& obj, std::string_view path,
                                        std::string_view key) {
  const Json* v = Find(obj, key);
  if (v == nullptr) return std::optional<Switch>();
  if (!v->is_boolean()) return TypeError(Join(path, key), *v, "true or false");
  return std::optional<Switch>(v->get<bool>() ? Switch::kOn : Switch::kOff);
}

Result<std::optional<std::string>> GetString(const Json& obj, std::string_view path,
                                             std::string_view key) {
  const Json* v = Find(obj, key);
  if (v == nullptr) return std::optional<std::string>();
  if (!v->is_string()) return TypeError(Join(path, key), *v, "a string");
  return std::optional<std::string>(v->get<std::string>());
}

#define STRATA_CONFIG_SET(field, expr)          \
  do {                                          \
    STRATA_ASSIGN_OR_RETURN(auto value_, expr); \
    if (value_) field = *value_;                \
  } while (false)

constexpr uint64_t kMaxElems = uint64_t{1} << 44;
constexpr uint64_t kMaxBytes = uint64_t{1} << 60;
constexpr double kInf = std::numeric_limits<double>::infinity();

// `ratio` is set when offload_optimizer.ratio is given: the gpu_fraction it means.
Status ParseOffloadOptimizer(const Json& o, OffloadConfig& c, std::optional<double>& ratio) {
  const std::string p = "zero_optimization.offload_optimizer";
  STRATA_RETURN_IF_ERROR(
      CheckKeys(o, p, {"device", "nvme_path", "pin_memory", "buffer_count", "fast_init", "ratio"}));
  STRATA_ASSIGN_OR_RETURN(auto device, GetString(o, p, "device"));
  if (device) {
    const std::string d = Lower(*device);
    if (d == "cpu")
      c.device = OffloadDevice::kCpu;
    else if (d == "nvme")
      c.device = OffloadDevice::kNvme;
    else if (d == "none")
      c.device = OffloadDevice::kNone;
    else
      return InvalidArgumentError(
          fmt::format("{}.device = \"{}\": must be \"cpu\", \"nvme\" or \"none\"", p, *device));
  }
  if (const Json* v = Find(o, "nvme_path"); v != nullptr && !v->is_null()) {
    c.nvme_paths.clear();
    if (v->is_string()) {
      c.nvme_paths.push_back(v->get<std::string>());
    } else if (v->is_array()) {
      for (const Json& e : *v) {
        if (!e.is_string()) return TypeError(p + ".nvme_path", *v, "a string or a list of strings");
        c.nvme_paths.push_back(e.get<std::string>());
      }
    } else {
      return TypeError(p + ".nvme_path", *v, "a string or a list of strings");
    }
    for (const std::string& path : c.nvme_paths) {
      if (path.empty()) return InvalidArgumentError(p + ".nvme_path: an empty path");
    }
  }
  STRATA_CONFIG_SET(c.pin_memory, GetSwitch(o, p, "pin_memory"));
  if (c.pin_memory == Switch::kOff) {
    // Unpinned staging would make every copy synchronous (the CUDA backend
    // copies from page-locked memory only), so the engine has no such mode.
    WarnOnce("config-pin-memory-false",
             "config: zero_optimization.offload_optimizer.pin_memory = false is ignored: Strata "
             "always page-locks its host buffers (the state kept in DRAM and the staging; "
             "without CUDA, where mlock is refused, it falls back to unlocked memory with a "
             "warning). strata.host_budget bounds them (with device \"nvme\" the state beyond "
             "it goes to NVMe)");
  }
  STRATA_CONFIG_SET(c.buffer_count, GetUint(o, p, "buffer_count", 1, 64));
  STRATA_CONFIG_SET(c.fast_init, GetSwitch(o, p, "fast_init"));
  // The share offloaded: the rest stays on the device (strata.gpu_fraction).
  STRATA_ASSIGN_OR_RETURN(auto offloaded,
                          GetDouble(o, p, "ratio", 0, Bound::kClosed, 1, Bound::kClosed));
  if (offloaded) ratio = c.gpu_fraction = 1.0 - *offloaded;
  return OkStatus();
}

Status ParseZero(const Json& z, OffloadConfig& c, std::optional<double>& ratio) {
  const std::string p = "zero_optimization";
  STRATA_RETURN_IF_ERROR(CheckKeys(z, p, {"stage", "sub_group_size", "offload_optimizer"}));
  STRATA_CONFIG_SET(c.zero_stage, GetUint(z, p, "stage", 0, 3));
  if (const Json* v = Find(z, "sub_group_size");
      v != nullptr && v->is_string() && Lower(v->get<std::string>()) == "auto") {
    c.sub_group_elems = kSubGroupAuto;
  } else {
    Result<std::optional<uint64_t>> size = GetUint(z, p, "sub_group_size", 1, kMaxElems);
    if (!size.ok() && IsZero(Find(z, "sub_group_size"))) {
      return InvalidArgumentError(fmt::format(
          "{}; DeepSpeed's 0 (read in stage 3 only) puts each parameter in a sub-group of its "
          "own, and Strata cuts sub-groups by element count across tensors: give a size such "
          "as 1e8, or \"auto\" for the planner's choice",
          size.status().message()));
    }
    STRATA_CONFIG_SET(c.sub_group_elems, std::move(size));
  }
  STRATA_ASSIGN_OR_RETURN(const Json* off, Section(z, p, "offload_optimizer"));
  if (off != nullptr) STRATA_RETURN_IF_ERROR(ParseOffloadOptimizer(*off, c, ratio));
  return OkStatus();
}

Status ParseAio(const Json& a, OffloadConfig& c) {
  const std::string p = "aio";
  STRATA_RETURN_IF_ERROR(CheckKeys(
      a, p,
      {"block_size", "queue_depth", "thread_count", "single_submit", "overlap_events", "use_gds"}));
  STRATA_CONFIG_SET(c.aio.block_bytes, GetBytes(a, p, "block_size", 4096, kGiB));
  STRATA_CONFIG_SET(c.aio.queue_depth, GetUint(a, p, "queue_depth", 1, 4096));
  STRATA_CONFIG_SET(c.aio.thread_count, GetUint(a, p, "thread_count", 1, 1024));
  STRATA_CONFIG_SET(c.aio.single_submit, GetSwitch(a, p, "single_submit"));
  STRATA_CONFIG_SET(c.aio.overlap_events, GetSwitch(a, p, "overlap_events"));
  STRATA_CONFIG_SET(c.aio.use_gds, GetSwitch(a, p, "use_gds"));
  return OkStatus();
}

Result<std::optional<std::pair<double, double>>> GetBetas(const Json& o, std::string_view path) {
  const Json* v = Find(o, "betas");
  if (v == nullptr) return std::optional<std::pair<double, double>>();
  const std::string full = Join(path, "betas");
  if (!v->is_array() || v->size() != 2 || !(*v)[0].is_number() || !(*v)[1].is_number()) {
    return TypeError(full, *v, "two numbers [beta1, beta2], each in [0, 1)");
  }
  const double b1 = (*v)[0].get<double>(), b2 = (*v)[1].get<double>();
  if (!(b1 >= 0 && b1 < 1 && b2 >= 0 && b2 < 1)) {
    return InvalidArgumentError(
        fmt::format("{} = {}: each beta must be in [0, 1)", full, Describe(*v)));
  }
  return std::optional<std::pair<double, double>>({b1, b2});
}

Status ParseOptimizer(const Json& o, OffloadConfig& c) {
  const std::string p = "optimizer";
  STRATA_RETURN_IF_ERROR(CheckKeys(o, p, {"type", "params"}));
  STRATA_ASSIGN_OR_RETURN(auto type, GetString(o, p, "type"));
  if (type) {
    const std::string t = Lower(*type);
    if (t == "adam")
      c.optimizer = OptimizerType::kAdam;
    else if (t == "adamw")
      c.optimizer = OptimizerType::kAdamW;
    else if (t == "adagrad")
      c.optimizer = OptimizerType::kAdagrad;
    else if (t == "lion")
      c.optimizer = OptimizerType::kLion;
    else
      return InvalidArgumentError(fmt::format(
          "optimizer.type = \"{}\": unsupported; use Adam, AdamW, Adagrad or Lion", *type));
  }
  STRATA_ASSIGN_OR_RETURN(const Json* params, Section(o, p, "params"));
  const std::string pp = "optimizer.params";
  // DeepSpeed's Adam is AdamW unless adam_w_mode is false (its engine builds
  // the optimizer with adamw_mode = type is AdamW or adam_w_mode, default
  // true). The type decides the rule everywhere after parsing (the update,
  // checkpoints), so Adam with decoupled decay becomes AdamW here.
  if (c.optimizer == OptimizerType::kAdam || c.optimizer == OptimizerType::kAdamW) {
    c.adam.weight_decay_mode = WeightDecayMode::kDecoupled;
  }
  auto resolve_adam = [&] {
    if (c.optimizer == OptimizerType::kAdam &&
        c.adam.weight_decay_mode == WeightDecayMode::kDecoupled) {
      c.optimizer = OptimizerType::kAdamW;
    }
  };
  if (params == nullptr) {
    resolve_adam();
    return OkStatus();
  }
  const Json& q = *params;
  switch (c.optimizer) {
    case OptimizerType::kAdam:
    case OptimizerType::kAdamW: {
      STRATA_RETURN_IF_ERROR(CheckKeys(
          q, pp,
          {"lr", "betas", "eps", "weight_decay", "adam_w_mode", "bias_correction", "amsgrad"}));
      STRATA_CONFIG_SET(c.adam.lr, GetDouble(q, pp, "lr", 0, Bound::kClosed, kInf, Bound::kOpen));
      STRATA_ASSIGN_OR_RETURN(auto betas, GetBetas(q, pp));
      if (betas) c.adam.beta1 = betas->first, c.adam.beta2 = betas->second;
      STRATA_CONFIG_SET(c.adam.eps, GetDouble(q, pp, "eps", 0, Bound::kOpen, kInf, Bound::kOpen));
      STRATA_CONFIG_SET(c.adam.weight_decay,
                        GetDouble(q, pp, "weight_decay", 0, Bound::kClosed, kInf, Bound::kOpen));
      STRATA_ASSIGN_OR_RETURN(auto w_mode, GetSwitch(q, pp, "adam_w_mode"));
      if (w_mode) {
        if (c.optimizer == OptimizerType::kAdamW && *w_mode == Switch::kOff) {
          return InvalidArgumentError(
              "optimizer.params.adam_w_mode = false contradicts optimizer.type AdamW; use "
              "type Adam for L2 weight decay");
        }
        c.adam.weight_decay_mode =
            *w_mode == Switch::kOn ? WeightDecayMode::kDecoupled : WeightDecayMode::kL2;
      }
      resolve_adam();
      STRATA_ASSIGN_OR_RETURN(auto bias, GetSwitch(q, pp, "bias_correction"));
      if (bias)
        c.adam.bias_correction = *bias == Switch::kOn ? BiasCorrection::kOn : BiasCorrection::kOff;
      STRATA_ASSIGN_OR_RETURN(auto amsgrad, GetSwitch(q, pp, "amsgrad"));
      if (amsgrad && *amsgrad == Switch::kOn) {
        return InvalidArgumentError(
            "optimizer.params.amsgrad = true: AMSGrad is not supported; "
            "set it to false");
      }
      break;
    }
    case OptimizerType::kAdagrad:
      STRATA_RETURN_IF_ERROR(CheckKeys(q, pp, {"lr", "eps", "weight_decay", "lr_decay"}));
      STRATA_CONFIG_SET(c.adagrad.lr,
                        GetDouble(q, pp, "lr", 0, Bound::kClosed, kInf, Bound::kOpen));
      STRATA_CONFIG_SET(c.adagrad.eps,
                        GetDouble(q, pp, "eps", 0, Bound::kOpen, kInf, Bound::kOpen));
      STRATA_CONFIG_SET(c.adagrad.weight_decay,
                        GetDouble(q, pp, "weight_decay", 0, Bound::kClosed, kInf, Bound::kOpen));
      STRATA_CONFIG_SET(c.adagrad.lr_decay,
                        GetDouble(q, pp, "lr_decay", 0, Bound::kClosed, kInf, Bound::kOpen));
      break;
    case OptimizerType::kLion: {
      STRATA_RETURN_IF_ERROR(CheckKeys(q, pp, {"lr", "betas", "weight_decay"}));
      STRATA_CONFIG_SET(c.lion.lr, GetDouble(q, pp, "lr", 0, Bound::kClosed, kInf, Bound::kOpen));
      STRATA_ASSIGN_OR_RETURN(auto betas, GetBetas(q, pp));
      if (betas) c.lion.beta1 = betas->first, c.lion.beta2 = betas->second;
      STRATA_CONFIG_SET(c.lion.weight_decay,
                        GetDouble(q, pp, "weight_decay", 0, Bound::kClosed, kInf, Bound::kOpen));
      break;
    }
  }
  return OkStatus();
}

Status ParseFp16(const Json& f, OffloadConfig& c) {
  const std::string p = "fp16";
  STRATA_RETURN_IF_ERROR(
      CheckKeys(f, p,
                {"enabled", "loss_scale", "initial_scale_power", "loss_scale_window", "hysteresis",
                 "consecutive_hysteresis", "min_loss_scale"}));
  STRATA_ASSIGN_OR_RETURN(auto enabled, GetSwitch(f, p, "enabled"));
  LossScalerOptions& s = c.loss_scaler;
  STRATA_ASSIGN_OR_RETURN(auto loss_scale,
                          GetDouble(f, p, "loss_scale", 0, Bound::kClosed, kInf, Bound::kOpen));
  STRATA_CONFIG_SET(s.initial_scale_power, GetUint(f, p, "initial_scale_power", 0, 127));
  STRATA_CONFIG_SET(s.growth_interval, GetUint(f, p, "loss_scale_window", 1, 1u << 30));
  STRATA_CONFIG_SET(s.hysteresis, GetUint(f, p, "hysteresis", 1, 1u << 30));
  STRATA_ASSIGN_OR_RETURN(auto consecutive, GetSwitch(f, p, "consecutive_hysteresis"));
  if (consecutive) {
    s.consecutive_hysteresis =
        *consecutive == Switch::kOn ? ConsecutiveHysteresis::kOn : ConsecutiveHysteresis::kOff;
  }
  Result<std::optional<double>> min_scale =
      GetDouble(f, p, "min_loss_scale", 0, Bound::kOpen, kInf, Bound::kOpen);
  if (!min_scale.ok() && IsZero(Find(f, "min_loss_scale"))) {
    return InvalidArgumentError(fmt::format(
        "{}; DeepSpeed reads 0 as no floor (the scale halves at every overflow without end), "
        "and Strata needs a positive floor: give 1 (the default), or a tiny one such as 1e-30 "
        "to come close to no floor (an overflow at the floor is an error unless "
        "strata.min_scale_overflow is \"skip\")",
        min_scale.status().message()));
  }
  STRATA_CONFIG_SET(s.min_scale, std::move(min_scale));
  if (enabled && *enabled == Switch::kOn) {
    c.param_dtype = DType::kF16;
    c.grad_dtype = DType::kF16;
    if (loss_scale && *loss_scale > 0) {
      s.mode = LossScaleMode::kStatic;
      s.static_scale = *loss_scale;
    } else {
      s.mode = LossScaleMode::kDynamic;
    }
  }
  return OkStatus();
}

Status ParseBf16(const Json& b, OffloadConfig& c) {
  STRATA_RETURN_IF_ERROR(CheckKeys(b, "bf16", {"enabled"}));
  STRATA_ASSIGN_OR_RETURN(auto enabled, GetSwitch(b, "bf16", "enabled"));
  if (enabled && *enabled == Switch::kOn) {
    if (c.param_dtype == DType::kF16) {
      return InvalidArgumentError(
          "fp16.enabled and bf16.enabled are both true; enable at most one");
    }
    c.param_dtype = DType::kBF16;
    c.grad_dtype = DType::kBF16;
    c.loss_scaler.mode = LossScaleMode::kNone;
  }
  return OkStatus();
}

// strata.rates: what this machine does per second, for the plan's estimate
// and gpu_fraction "auto" (PlanRates). Adam rates in elements per second (a
// number or a count such as "5.4G"), the others in bytes per second (a
// number or a rate such as "25GB/s").
Status ParseRates(const Json& r, PlanRates& rates) {
  const std::string p = "strata.rates";
  if (!r.is_object()) return TypeError(p, r, "an object");
  STRATA_RETURN_IF_ERROR(
      CheckKeys(r, p, {"cpu_adam", "device_adam", "pcie", "nvme_read", "nvme_write"}));
  struct Field {
    std::string_view key;
    double* out;
    bool elems;
  } fields[] = {{"cpu_adam", &rates.cpu_adam_elems_per_sec, true},
                {"device_adam", &rates.device_adam_elems_per_sec, true},
                {"pcie", &rates.pcie_bytes_per_sec, false},
                {"nvme_read", &rates.nvme_read_bytes_per_sec, false},
                {"nvme_write", &rates.nvme_write_bytes_per_sec, false}};
  for (const Field& f : fields) {
    const Json* v = Find(r, f.key);
    if (v == nullptr || v->is_null()) continue;
    const std::string full = Join(p, f.key);
    const std::string_view want = f.elems ? "elements per second (a number or a count such as \"5.4G\")"
                                          : "bytes per second (a number or a rate such as \"25GB/s\")";
    double value = 0;
    if (v->is_number()) {
      value = v->get<double>();
    } else if (v->is_string()) {
      if (f.elems) {
        Result<uint64_t> n = ParseCount(v->get<std::string>());
        if (!n.ok()) return TypeError(full, *v, want);
        value = static_cast<double>(*n);
      } else {
        Result<double> b = ParseRate(v->get<std::string>());
        if (!b.ok()) return TypeError(full, *v, want);
        value = *b;
      }
    } else {
      return TypeError(full, *v, want);
    }
    if (!std::isfinite(value) || value < 0) {
      return InvalidArgumentError(
          fmt::format("{} = {}: must be {} >= 0 (0: unknown)", full, Describe(*v), want));
    }
    *f.out = value;
  }
  return OkStatus();
}

// `ratio`: the gpu_fraction zero_optimization.offload_optimizer.ratio gave, if any.
Status ParseStrata(const Json& s, OffloadConfig& c, std::optional<double> ratio) {
  const std::string p = "strata";
  STRATA_RETURN_IF_ERROR(CheckKeys(s, p,
                                   {"host_budget", "device_budget", "threads", "align_elems",
                                    "grad_dtype", "min_scale_overflow", "gpu_fraction",
                                    "rates"}));
  if (const Json* r = Find(s, "rates"); r != nullptr && !r->is_null()) {
    STRATA_RETURN_IF_ERROR(ParseRates(*r, c.rates));
  }
  STRATA_CONFIG_SET(c.host_budget_bytes, GetBytes(s, p, "host_budget", 0, kMaxBytes));
  STRATA_CONFIG_SET(c.device_budget_bytes, GetBytes(s, p, "device_budget", 0, kMaxBytes));
  STRATA_CONFIG_SET(c.threads, GetUint(s, p, "threads", 0, 4096));
  if (const Json* v = Find(s, "gpu_fraction"); v != nullptr && !v->is_null()) {
    double f = 0;
    if (v->is_string() && Lower(v->get<std::string>()) == "auto") {
      f = kGpuFractionAuto;
    } else if (v->is_number()) {
      f = v->get<double>();
      if (!(f >= 0 && f <= 1)) {
        return InvalidArgumentError(
            fmt::format("strata.gpu_fraction = {}: must be in [0, 1] or \"auto\"", f));
      }
    } else {
      return TypeError(p + ".gpu_fraction", *v, "a number in [0, 1] or \"auto\"");
    }
    // offload_optimizer.ratio says the same thing the other way round.
    if (ratio && (f == kGpuFractionAuto || std::abs(*ratio - f) > 1e-9)) {
      return InvalidArgumentError(fmt::format(
          "strata.gpu_fraction = {} contradicts zero_optimization.offload_optimizer.ratio = {} "
          "(which means gpu_fraction {}); give one of them",
          f == kGpuFractionAuto ? std::string("\"auto\"") : fmt::format("{}", f),
          1 - *ratio, *ratio));
    }
    c.gpu_fraction = f;
  }
  STRATA_CONFIG_SET(c.align_elems, GetUint(s, p, "align_elems", 1, 1u << 20));
  STRATA_ASSIGN_OR_RETURN(auto grad, GetString(s, p, "grad_dtype"));
  if (grad) {
    Result<DType> t = ParseDType(*grad);
    if (!t.ok() || (*t != DType::kF32 && *t != DType::kF16 && *t != DType::kBF16)) {
      return InvalidArgumentError(
          fmt::format("strata.grad_dtype = \"{}\": must be \"fp32\", \"fp16\" or \"bf16\"", *grad));
    }
    c.grad_dtype = *t;
  }
  STRATA_ASSIGN_OR_RETURN(auto overflow, GetString(s, p, "min_scale_overflow"));
  if (overflow) {
    if (*overflow == "error")
      c.loss_scaler.min_scale_overflow = MinScaleOverflow::kError;
    else if (*overflow == "skip")
      c.loss_scaler.min_scale_overflow = MinScaleOverflow::kSkipStep;
    else
      return InvalidArgumentError(fmt::format(
          "strata.min_scale_overflow = \"{}\": must be \"error\" or \"skip\"", *overflow));
  }
  return OkStatus();
}

// nlohmann's exception ids (json.exception.<kind>.<id>).
constexpr int kNumberOverflow = 406;

Status ExplainParseFailure(std::string_view text) {
  JsonWalker locator;
  // The document is already known to be malformed; sax_parse only replays
  // the parse to find where. It reports through the handler, never throws.
  (void)Json::sax_parse(text.begin(), text.end(), &locator);
  if (!locator.failed()) return InvalidArgumentError("parse config JSON: malformed document");
  const std::string path = locator.Path();
  if (locator.id() == kNumberOverflow) {
    std::string number = locator.token();
    if (number.size() > 60) number = number.substr(0, 57) + "...";
    return InvalidArgumentError(
        fmt::format("parse config JSON: {} = {}: the number is beyond the range of a double (about "
                    "1.8e308); give a finite value in the key's range",
                    path.empty() ? std::string("the document") : path, number));
  }
  return InvalidArgumentError(fmt::format(
      "parse config JSON{}: {}", path.empty() ? "" : fmt::format(" in {}", path), locator.what()));
}

}  // namespace

std::string_view OffloadDeviceName(OffloadDevice device) {
  switch (device) {
    case OffloadDevice::kNone:
      return "none";
    case OffloadDevice::kCpu:
      return "cpu";
    case OffloadDevice::kNvme:
      return "nvme";
  }
  return "?";
}

std::string_view OptimizerTypeName(OptimizerType type) {
  switch (type) {
    case OptimizerType::kAdam:
      return "Adam";
    case OptimizerType::kAdamW:
      return "AdamW";
    case OptimizerType::kAdagrad:
      return "Adagrad";
    case OptimizerType::kLion:
      return "Lion";
  }
  return "?";
}

uint32_t StateBytesPerElem(OptimizerType type) {
  switch (type) {
    case OptimizerType::kAdam:
    case OptimizerType::kAdamW:
      return 12;
    case OptimizerType::kAdagrad:
    case OptimizerType::kLion:
      return 8;
  }
  return 12;
}

PlacementInputs PlacementInputsFor(const OffloadConfig& c,
                                   std::span<const uint64_t> sub_group_elems, uint32_t world_size) {
  return {.sub_group_elems = {sub_group_elems.begin(), sub_group_elems.end()},
          .state_bytes_per_elem = StateBytesPerElem(c.optimizer),
          .grad_bytes_per_elem = static_cast<uint32_t>(
              DTypeSize(world_size == 1 ? c.grad_dtype : c.comm_dtype)),
          .param_bytes_per_elem = static_cast<uint32_t>(DTypeSize(c.param_dtype)),
          .host_budget_bytes = c.host_budget_bytes,
          .device_budget_bytes = c.device_budget_bytes,
          .nvme = c.device == OffloadDevice::kNvme && !c.nvme_paths.empty()
                      ? NvmeTier::kAvailable
                      : NvmeTier::kUnavailable,
          // More buffers than sub-groups would never be used.
          .buffer_count = std::max<uint32_t>(
              1, static_cast<uint32_t>(std::min<uint64_t>(c.buffer_count, sub_group_elems.size()))),
          .block_bytes = c.aio.block_bytes,
          .world_size = world_size,
          .gpu_fraction = c.gpu_fraction,
          .rates = c.rates,
          .auto_sub_groups = c.sub_group_elems == kSubGroupAuto};
}

uint64_t SubGroupElemsFor(const OffloadConfig& c, uint64_t shard_elems, uint32_t world_size) {
  if (c.sub_group_elems != kSubGroupAuto) return c.sub_group_elems;
  const PlacementInputs in = PlacementInputsFor(c, {}, world_size);
  return AutoSubGroupElems(
      {.shard_elems = shard_elems,
       .staging_bytes_per_elem = uint64_t{in.state_bytes_per_elem} + in.param_bytes_per_elem +
                                 (world_size == 1 ? in.grad_bytes_per_elem : 0),
       .buffer_count = c.buffer_count,
       .host_budget_bytes = c.host_budget_bytes,
       .nvme = in.nvme == NvmeTier::kAvailable});
}

std::span<const std::string_view> IgnoredConfigKeys() { return kIgnoredKeys; }

namespace {

// The paths of the "auto" values the parser refuses, in key order: not in an
// ignored section, not a refused key's, not where a key takes "auto". A
// config nests a few levels: the walk stops at 16, so a deeply nested value
// cannot overflow the stack.
std::vector<std::string> AutoPaths(const Json& doc) {
  std::vector<std::string> out;
  auto walk = [&](auto& self, const Json& v, const std::string& path, int depth) -> void {
    if (depth == 0) return;
    if (v.is_string()) {
      if (v.get<std::string>() == "auto" && path != "zero_optimization.sub_group_size" &&
          path != "strata.gpu_fraction") {
        out.push_back(path);
      }
    } else if (v.is_object()) {
      for (const auto& [key, value] : v.items()) {
        const std::string full = Join(path, key);
        if (!IsIgnored(full) && FindUnsupported(full) == nullptr) {
          self(self, value, full, depth - 1);
        }
      }
    } else if (v.is_array()) {
      for (size_t i = 0; i < v.size(); ++i) {
        self(self, v[i], fmt::format("{}[{}]", path, i), depth - 1);
      }
    }
  };
  walk(walk, doc, "", 16);
  return out;
}

Result<OffloadConfig> ParseDocument(const Json& doc) {
  OffloadConfig c;
  STRATA_RETURN_IF_ERROR(CheckKeys(
      doc, "",
      {"zero_optimization", "aio", "optimizer", "gradient_clipping", "fp16", "bf16",
       "communication_data_type", "strata"}));
  STRATA_ASSIGN_OR_RETURN(const Json* zero, Section(doc, "", "zero_optimization"));
  std::optional<double> ratio;  // the gpu_fraction offload_optimizer.ratio gives
  if (zero != nullptr) STRATA_RETURN_IF_ERROR(ParseZero(*zero, c, ratio));
  STRATA_ASSIGN_OR_RETURN(const Json* aio, Section(doc, "", "aio"));
  if (aio != nullptr) STRATA_RETURN_IF_ERROR(ParseAio(*aio, c));
  STRATA_ASSIGN_OR_RETURN(const Json* opt, Section(doc, "", "optimizer"));
  if (opt != nullptr) STRATA_RETURN_IF_ERROR(ParseOptimizer(*opt, c));
  STRATA_CONFIG_SET(c.max_grad_norm,
                    GetDouble(doc, "", "gradient_clipping", 0, Bound::kClosed, kInf, Bound::kOpen));
  STRATA_ASSIGN_OR_RETURN(const Json* fp16, Section(doc, "", "fp16"));
  if (fp16 != nullptr) STRATA_RETURN_IF_ERROR(ParseFp16(*fp16, c));
  STRATA_ASSIGN_OR_RETURN(const Json* bf16, Section(doc, "", "bf16"));
  if (bf16 != nullptr) STRATA_RETURN_IF_ERROR(ParseBf16(*bf16, c));
  STRATA_ASSIGN_OR_RETURN(auto comm_type, GetString(doc, "", "communication_data_type"));
  if (comm_type) {
    Result<DType> t = ParseDType(*comm_type == "bfp16" ? "bf16" : *comm_type);
    if (!t.ok() || (*t != DType::kF32 && *t != DType::kF16 && *t != DType::kBF16)) {
      return InvalidArgumentError(fmt::format(
          "communication_data_type = \"{}\": must be \"fp32\", \"fp16\" or \"bf16\"",
          *comm_type));
    }
    c.comm_dtype = *t;
  }
  // After fp16/bf16, so an explicit strata.grad_dtype wins.
  STRATA_ASSIGN_OR_RETURN(const Json* strata, Section(doc, "", "strata"));
  if (strata != nullptr) STRATA_RETURN_IF_ERROR(ParseStrata(*strata, c, ratio));
  // Said here, once per config text: ValidateConfig runs for one config in
  // each layer it passes (the Python module or the C API, then Create), and
  // logged it each time.
  if (c.device == OffloadDevice::kCpu && !c.nvme_paths.empty()) {
    LogInfo("config: zero_optimization.offload_optimizer.nvme_path is unused with device \"cpu\"");
  }
  return c;
}

}  // namespace

Result<OffloadConfig> ParseConfigJson(std::string_view text) {
  Json doc = Json::parse(text.begin(), text.end(), nullptr, /*allow_exceptions=*/false);
  if (doc.is_discarded()) return ExplainParseFailure(text);
  if (!doc.is_object()) return TypeError("config", doc, "a JSON object");
  if (const std::string repeated = RepeatedJsonKey(text); !repeated.empty()) {
    return InvalidArgumentError(fmt::format(
        "parse config JSON: the key {} appears more than once in its object; JSON keeps only the "
        "last value, so remove the others",
        repeated));
  }
  Result<OffloadConfig> c = ParseDocument(doc);
  // A Hugging Face config has "auto" in several places: name them all at
  // once rather than one per run.
  if (!c.ok() && c.status().message().find("= \"auto\"") != std::string_view::npos) {
    const std::vector<std::string> autos = AutoPaths(doc);
    if (autos.size() > 1) {
      return InvalidArgumentError(fmt::format(
          "config: {} values are \"auto\", which the Hugging Face integration fills in "
          "(strata.torch.OffloadAdam fills the optimizer's, the clipping and fp16/bf16 from its "
          "arguments); give each a value: {}",
          autos.size(), fmt::join(autos, ", ")));
    }
  }
  return c;
}

Status ValidateConfig(const OffloadConfig& c) {
  const std::string off = "zero_optimization.offload_optimizer";
  if (c.zero_stage < 1 || c.zero_stage > 3) {
    return InvalidArgumentError(
        fmt::format("zero_optimization.stage = {}: optimizer offload needs ZeRO stage 1, 2 or 3",
                    c.zero_stage));
  }
  if (c.device == OffloadDevice::kNone) {
    return InvalidArgumentError(off +
                                ".device = \"none\": Strata always offloads the "
                                "optimizer state; use \"cpu\" or \"nvme\"");
  }
  if (c.device == OffloadDevice::kNvme && c.nvme_paths.empty()) {
    return InvalidArgumentError(off +
                                ".device is \"nvme\" but nvme_path is not set; set "
                                "nvme_path to a directory on an NVMe drive, or use "
                                "device \"cpu\"");
  }
  // No shell reads a config: "~/nvme" would make a directory named "~"
  // under the working directory, on whatever drive that is.
  for (const std::string& path : c.nvme_paths) {
    if (!path.empty() && path[0] == '~') {
      const char* home = std::getenv("HOME");
      return InvalidArgumentError(fmt::format(
          "{}.nvme_path: '{}' starts with ~, which nothing expands here (no shell reads the "
          "config): give the whole path{}, or write ./{} for a directory named so",
          off, path,
          home != nullptr && (path == "~" || path.rfind("~/", 0) == 0)
              ? fmt::format(" ({}{})", home, path.substr(1))
              : std::string(),
          path));
    }
  }
  // The same directory twice would stripe one file onto itself. Spellings
  // that differ ("/a" and "/a/", or a symlink) meet the state store's lock.
  for (size_t i = 0; i < c.nvme_paths.size(); ++i) {
    for (size_t j = 0; j < i; ++j) {
      auto norm = [](std::string p) {
        while (p.size() > 1 && p.back() == '/') p.pop_back();
        return p;
      };
      if (norm(c.nvme_paths[i]) == norm(c.nvme_paths[j])) {
        return InvalidArgumentError(fmt::format(
            "{}.nvme_path: '{}' is listed twice (entries {} and {}); each entry is a directory "
            "on its own drive, striped: list each once",
            off, c.nvme_paths[i], j, i));
      }
    }
  }
  if (c.gpu_fraction != kGpuFractionAuto && !(c.gpu_fraction >= 0 && c.gpu_fraction <= 1)) {
    return InvalidArgumentError(fmt::format(
        "strata.gpu_fraction = {}: must be in [0, 1] or \"auto\"", c.gpu_fraction));
  }
  if (c.gpu_fraction != 0 && c.optimizer != OptimizerType::kAdam &&
      c.optimizer != OptimizerType::kAdamW) {
    return InvalidArgumentError(fmt::format(
        "strata.gpu_fraction = {} needs optimizer Adam or AdamW (the device has no {} kernel); "
        "set gpu_fraction to 0 (offload_optimizer.ratio 1.0)",
        c.gpu_fraction == kGpuFractionAuto ? std::string("\"auto\"")
                                           : fmt::format("{}", c.gpu_fraction),
        OptimizerTypeName(c.optimizer)));
  }
  if (c.gpu_fraction == kGpuFractionAuto && c.device_budget_bytes == 0) {
    return InvalidArgumentError(
        "strata.gpu_fraction = \"auto\" needs strata.device_budget: the device memory the "
        "optimizer may use (its staging and the state it keeps there); set it, or give "
        "gpu_fraction a number");
  }
  if (c.buffer_count < 1) return InvalidArgumentError(off + ".buffer_count = 0: must be >= 1");
  if (c.aio.block_bytes < 4096 || c.aio.block_bytes % 4096 != 0) {
    return InvalidArgumentError(fmt::format(
        "aio.block_size = {}: must be a positive multiple of 4096 (O_DIRECT)", c.aio.block_bytes));
  }
  if (c.aio.queue_depth < 1) return InvalidArgumentError("aio.queue_depth = 0: must be >= 1");
  if (c.aio.use_gds == Switch::kOn) {
    WarnOnce("config-use-gds",
             "config: aio.use_gds is not supported; NVMe IO goes through "
             "pinned host buffers");
  }
  if (!(c.max_grad_norm >= 0 && std::isfinite(c.max_grad_norm))) {
    return InvalidArgumentError(
        fmt::format("gradient_clipping = {}: must be finite and >= 0", c.max_grad_norm));
  }
  if (c.param_dtype != DType::kF32 && c.param_dtype != DType::kF16 &&
      c.param_dtype != DType::kBF16) {
    return InvalidArgumentError(
        fmt::format("param dtype {}: must be fp32, fp16 or bf16", DTypeName(c.param_dtype)));
  }
  if (c.grad_dtype != DType::kF32 && c.grad_dtype != DType::kF16 && c.grad_dtype != DType::kBF16) {
    return InvalidArgumentError(
        fmt::format("strata.grad_dtype = {}: must be fp32, fp16 or bf16", DTypeName(c.grad_dtype)));
  }
  if (c.param_dtype == DType::kF16 && c.loss_scaler.mode == LossScaleMode::kNone) {
    return InvalidArgumentError(
        "fp16 params without a loss scaler: set fp16.loss_scale (0 for dynamic)");
  }
  if (c.align_elems < 1) return InvalidArgumentError("strata.align_elems = 0: must be >= 1");
  if (c.threads < 0) {
    return InvalidArgumentError(fmt::format("strata.threads = {}: must be >= 0", c.threads));
  }
  STRATA_RETURN_IF_ERROR(ValidateLossScalerOptions(c.loss_scaler).WithContext("fp16"));
  return OkStatus();
}

std::string ConfigToJson(const OffloadConfig& c) {
  auto on = [](Switch s) { return s == Switch::kOn; };
  Json off = {{"device", OffloadDeviceName(c.device)},
              {"pin_memory", true},  // what happens, whatever pin_memory says
              {"buffer_count", c.buffer_count},
              {"fast_init", on(c.fast_init)}};
  if (c.nvme_paths.size() == 1) off["nvme_path"] = c.nvme_paths[0];
  if (c.nvme_paths.size() > 1) off["nvme_path"] = c.nvme_paths;
  Json params;
  switch (c.optimizer) {
    case OptimizerType::kAdam:
    case OptimizerType::kAdamW:
      params = {{"lr", c.adam.lr},
                {"betas", {c.adam.beta1, c.adam.beta2}},
                {"eps", c.adam.eps},
                {"weight_decay", c.adam.weight_decay},
                {"adam_w_mode", c.optimizer == OptimizerType::kAdamW},
                {"bias_correction", c.adam.bias_correction == BiasCorrection::kOn}};
      break;
    case OptimizerType::kAdagrad:
      params = {{"lr", c.adagrad.lr},
                {"eps", c.adagrad.eps},
                {"weight_decay", c.adagrad.weight_decay},
                {"lr_decay", c.adagrad.lr_decay}};
      break;
    case OptimizerType::kLion:
      params = {{"lr", c.lion.lr},
                {"betas", {c.lion.beta1, c.lion.beta2}},
                {"weight_decay", c.lion.weight_decay}};
      break;
  }
  const LossScalerOptions& s = c.loss_scaler;
  Json doc = {{"zero_optimization",
               {{"stage", c.zero_stage},
                {"sub_group_size", c.sub_group_elems == kSubGroupAuto
                                       ? Json("auto")
                                       : Json(c.sub_group_elems)},
                {"offload_optimizer", off}}},
              {"aio",
               {{"block_size", c.aio.block_bytes},
                {"queue_depth", c.aio.queue_depth},
                {"thread_count", c.aio.thread_count},
                {"single_submit", on(c.aio.single_submit)},
                {"overlap_events", on(c.aio.overlap_events)},
                {"use_gds", on(c.aio.use_gds)}}},
              {"optimizer", {{"type", OptimizerTypeName(c.optimizer)}, {"params", params}}},
              {"gradient_clipping", c.max_grad_norm},
              {"communication_data_type", DTypeName(c.comm_dtype)},
              {"fp16",
               {{"enabled", c.param_dtype == DType::kF16},
                {"loss_scale", s.mode == LossScaleMode::kStatic ? s.static_scale : 0.0},
                {"initial_scale_power", s.initial_scale_power},
                {"loss_scale_window", s.growth_interval},
                {"hysteresis", s.hysteresis},
                {"consecutive_hysteresis", s.consecutive_hysteresis == ConsecutiveHysteresis::kOn},
                {"min_loss_scale", s.min_scale}}},
              {"bf16", {{"enabled", c.param_dtype == DType::kBF16}}},
              {"strata",
               {{"host_budget", c.host_budget_bytes},
                {"device_budget", c.device_budget_bytes},
                {"gpu_fraction", c.gpu_fraction == kGpuFractionAuto ? Json("auto")
                                                                    : Json(c.gpu_fraction)},
                {"rates",
                 {{"cpu_adam", c.rates.cpu_adam_elems_per_sec},
                  {"device_adam", c.rates.device_adam_elems_per_sec},
                  {"pcie", c.rates.pcie_bytes_per_sec},
                  {"nvme_read", c.rates.nvme_read_bytes_per_sec},
                  {"nvme_write", c.rates.nvme_write_bytes_per_sec}}},
                {"threads", c.threads},
                {"align_elems", c.align_elems},
                {"grad_dtype", DTypeName(c.grad_dtype)},
                {"min_scale_overflow",
                 s.min_scale_overflow == MinScaleOverflow::kError ? "error" : "skip"}}}};
  // `replace`: a path that is not UTF-8 (a struct filled in by code, not
  // parsed) is written with U+FFFD rather than thrown on.
  return doc.dump(2, ' ', false, Json::error_handler_t::replace);
}

}  // namespace strata
