// The checkpoint format as JSON (docs/checkpoint.md), the one validator every
// reader applies, and the small-file IO the other checkpoint files share.
#include <fcntl.h>
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <sys/stat.h>
#include <unistd.h>
#include <xxhash.h>

#include <cerrno>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <limits>
#include <optional>
#include <unordered_map>

#include "offload/checkpoint_internal.h"
#include "offload/config.h"
#include "runtime/json_parse.h"

namespace strata {
namespace checkpoint_internal {
namespace {

Result<uint64_t> ParseHex(const std::string& s) {
  if (s.size() != 16) return InvalidArgumentError("'" + s + "' is not 16 hex digits");
  char* end = nullptr;
  const uint64_t v = std::strtoull(s.c_str(), &end, 16);
  if (end != s.c_str() + s.size()) return InvalidArgumentError("'" + s + "' is not hex");
  return v;
}

json HyperJson(const GroupHyper& h) {
  return {{"lr", h.lr},
          {"beta1", h.beta1},
          {"beta2", h.beta2},
          {"eps", h.eps},
          {"weight_decay", h.weight_decay}};
}

json ManifestJson(const CheckpointInfo& info, const RankManifest& rank) {
  json tensors = json::array();
  for (const CheckpointTensor& t : info.tensors) {
    json e = {{"name", t.name},
              {"group", t.group},
              {"offset_elems", t.offset_elems},
              {"elems", t.elems}};
    if (t.shape) e["shape"] = *t.shape;
    tensors.push_back(std::move(e));
  }
  json groups = json::array();
  for (const GroupHyper& h : info.groups) groups.push_back(HyperJson(h));
  json files = json::array();
  for (const CheckpointFile& f : rank.files) {
    json chunks = json::array();
    for (uint64_t h : f.chunk_xxh3) chunks.push_back(Hex(h));
    files.push_back({{"array", f.array},
                     {"name", f.name},
                     {"payload_bytes", f.payload_bytes},
                     {"file_bytes", f.file_bytes},
                     {"xxh3", Hex(f.xxh3)},
                     {"chunks_xxh3", chunks}});
  }
  return {{"format", kCheckpointFormatName},
          {"format_version", kCheckpointFormatVersion},
          {"save_id", info.save_id},
          {"rank", rank.rank},
          {"world_size", info.world_size},
          {"step", info.step},
          {"optimizer", info.optimizer},
          {"state_dtype", "f32"},
          {"param_dtype", info.param_dtype},
          {"arrays", info.arrays},
          {"layout",
           {{"align_elems", info.align_elems},
            {"total_elems", info.total_elems},
            {"shard_elems", info.shard_elems},
            {"tensor_elems", info.tensor_elems}}},
          {"shard", {{"begin", rank.shard.begin}, {"end", rank.shard.end}}},
          {"tensors", tensors},
          {"groups", groups},
          {"loss_scaler",
           {{"scale", info.scaler.scale},
            {"iteration", info.scaler.iteration},
            {"last_overflow_iteration", info.scaler.last_overflow_iteration},
            {"hysteresis_left", info.scaler.hysteresis_left}}},
          {"chunk_bytes", info.chunk_bytes},
          {"checksum", "xxh3-64"},
          {"files", files}};
}

// The manifest's own checksum: XXH3-64 of its compact serialization (keys
// sorted, no whitespace) without the "manifest_xxh3" key. A flipped byte in a
// manifest would otherwise pass as, say, another learning rate.
uint64_t ManifestHash(json j) {
  j.erase("manifest_xxh3");
  const std::string text = j.dump();
  return XXH3_64bits(text.data(), text.size());
}

}  // namespace

std::string Hex(uint64_t v) { return fmt::format("{:016x}", v); }

std::string RankName(uint32_t rank) { return fmt::format("rank{:05}", rank); }

std::string WithoutTrailingSlashes(std::string_view dir) {
  while (dir.size() > 1 && dir.back() == '/') dir.remove_suffix(1);
  return std::string(dir);
}

std::string JoinPath(std::string_view dir, std::string_view name) {
  std::string out = WithoutTrailingSlashes(dir);
  if (out.empty() || out.back() != '/') out += '/';
  return out + std::string(name);
}

std::string ShapeString(const CheckpointTensor& t) {
  return t.shape ? fmt::format("[{}]", fmt::join(*t.shape, ", ")) : fmt::format("[{}]", t.elems);
}

json SealedManifestJson(const CheckpointInfo& info, const RankManifest& rank) {
  json j = ManifestJson(info, rank);
  j["manifest_xxh3"] = Hex(ManifestHash(j));
  return j;
}

namespace {

// An integer as T. nlohmann's get<> converts what it finds: 2^64 - 1 read
// as int64 was -1 ("step -1 is negative"), 3.5 read as an integer 3.
// InvalidArgument naming `what` for a non-integer or one out of T's range.
template <typename T>
Result<T> IntegerOf(const json& v, std::string_view what) {
  if (!v.is_number_integer()) {
    return InvalidArgumentError(fmt::format("{} is {}, not an integer", what, v.dump()));
  }
  constexpr uint64_t kMax = static_cast<uint64_t>(std::numeric_limits<T>::max());
  if (v.is_number_unsigned()) {
    if (const uint64_t u = v.get<uint64_t>(); u <= kMax) return static_cast<T>(u);
  } else if (const int64_t i = v.get<int64_t>();
             i >= 0 ? static_cast<uint64_t>(i) <= kMax : std::is_signed_v<T>) {
    return static_cast<T>(i);
  }
  return InvalidArgumentError(fmt::format("{} is {}, out of the range {}..{}", what, v.dump(),
                                          std::numeric_limits<T>::min(), kMax));
}

// A member: a missing key throws nlohmann's out_of_range, as for any member.
template <typename T>
Result<T> IntegerAt(const json& object, const char* key) {
  return IntegerOf<T>(object.at(key), key);
}

Result<std::vector<uint64_t>> SizesAt(const json& object, const char* key) {
  const json& list = object.at(key);
  if (!list.is_array()) return InvalidArgumentError(fmt::format("{} is not a list", key));
  std::vector<uint64_t> out;
  for (size_t i = 0; i < list.size(); ++i) {
    STRATA_ASSIGN_OR_RETURN(uint64_t v,
                            IntegerOf<uint64_t>(list[i], fmt::format("{}[{}]", key, i)));
    out.push_back(v);
  }
  return out;
}

}  // namespace

// Throws nlohmann's exceptions on missing keys and wrong types; the caller
// turns them into DataLoss.
Status ParseManifest(const json& j, CheckpointInfo& info, RankManifest& rank) {
  STRATA_ASSIGN_OR_RETURN(uint64_t sealed, ParseHex(j.at("manifest_xxh3").get<std::string>()));
  if (sealed != ManifestHash(j)) {
    return InvalidArgumentError(
        fmt::format("its checksum (manifest_xxh3 {}) does not match its "
                    "content (XXH3 {})",
                    Hex(sealed), Hex(ManifestHash(j))));
  }
  info.save_id = j.at("save_id").get<std::string>();
  STRATA_ASSIGN_OR_RETURN(info.world_size, IntegerAt<uint32_t>(j, "world_size"));
  STRATA_ASSIGN_OR_RETURN(info.step, IntegerAt<int64_t>(j, "step"));
  info.optimizer = j.at("optimizer").get<std::string>();
  if (j.at("state_dtype").get<std::string>() != "f32") {
    return InvalidArgumentError("state_dtype is " + j.at("state_dtype").get<std::string>() +
                                "; this build reads f32");
  }
  info.param_dtype = j.at("param_dtype").get<std::string>();
  info.arrays = j.at("arrays").get<std::vector<std::string>>();
  const json& l = j.at("layout");
  STRATA_ASSIGN_OR_RETURN(info.align_elems, IntegerAt<uint64_t>(l, "align_elems"));
  STRATA_ASSIGN_OR_RETURN(info.total_elems, IntegerAt<uint64_t>(l, "total_elems"));
  STRATA_ASSIGN_OR_RETURN(info.shard_elems, IntegerAt<uint64_t>(l, "shard_elems"));
  STRATA_ASSIGN_OR_RETURN(info.tensor_elems, IntegerAt<uint64_t>(l, "tensor_elems"));
  info.tensors.clear();
  for (const json& t : j.at("tensors")) {
    CheckpointTensor ct{.name = t.at("name").get<std::string>()};
    STRATA_ASSIGN_OR_RETURN(ct.group, IntegerAt<uint32_t>(t, "group"));
    STRATA_ASSIGN_OR_RETURN(ct.offset_elems, IntegerAt<uint64_t>(t, "offset_elems"));
    STRATA_ASSIGN_OR_RETURN(ct.elems, IntegerAt<uint64_t>(t, "elems"));
    if (t.contains("shape")) {
      STRATA_ASSIGN_OR_RETURN(ct.shape, SizesAt(t, "shape"));
    }
    info.tensors.push_back(std::move(ct));
  }
  info.groups.clear();
  for (const json& g : j.at("groups")) {
    info.groups.push_back({.lr = g.at("lr").get<double>(),
                           .beta1 = g.at("beta1").get<double>(),
                           .beta2 = g.at("beta2").get<double>(),
                           .eps = g.at("eps").get<double>(),
                           .weight_decay = g.at("weight_decay").get<double>()});
  }
  const json& s = j.at("loss_scaler");
  info.scaler = {.scale = s.at("scale").get<double>()};
  STRATA_ASSIGN_OR_RETURN(info.scaler.iteration, IntegerAt<int64_t>(s, "iteration"));
  STRATA_ASSIGN_OR_RETURN(info.scaler.last_overflow_iteration,
                          IntegerAt<int64_t>(s, "last_overflow_iteration"));
  STRATA_ASSIGN_OR_RETURN(info.scaler.hysteresis_left, IntegerAt<uint32_t>(s, "hysteresis_left"));
  STRATA_ASSIGN_OR_RETURN(info.chunk_bytes, IntegerAt<uint64_t>(j, "chunk_bytes"));
  if (j.at("checksum").get<std::string>() != "xxh3-64") {
    return InvalidArgumentError("checksum is " + j.at("checksum").get<std::string>() +
                                "; this build knows xxh3-64");
  }
  STRATA_ASSIGN_OR_RETURN(rank.rank, IntegerAt<uint32_t>(j, "rank"));
  STRATA_ASSIGN_OR_RETURN(rank.shard.begin, IntegerAt<uint64_t>(j.at("shard"), "begin"));
  STRATA_ASSIGN_OR_RETURN(rank.shard.end, IntegerAt<uint64_t>(j.at("shard"), "end"));
  rank.files.clear();
  for (const json& f : j.at("files")) {
    CheckpointFile cf;
    cf.array = f.at("array").get<std::string>();
    cf.name = f.at("name").get<std::string>();
    STRATA_ASSIGN_OR_RETURN(cf.payload_bytes, IntegerAt<uint64_t>(f, "payload_bytes"));
    STRATA_ASSIGN_OR_RETURN(cf.file_bytes, IntegerAt<uint64_t>(f, "file_bytes"));
    STRATA_ASSIGN_OR_RETURN(cf.xxh3, ParseHex(f.at("xxh3").get<std::string>()));
    for (const json& c : f.at("chunks_xxh3")) {
      STRATA_ASSIGN_OR_RETURN(uint64_t h, ParseHex(c.get<std::string>()));
      cf.chunk_xxh3.push_back(h);
    }
    rank.files.push_back(std::move(cf));
  }
  return OkStatus();
}

json CommonPart(json j) {
  for (const char* k : {"rank", "shard", "files", "manifest_xxh3"}) j.erase(k);
  return j;
}

Status ValidateCommon(const CheckpointInfo& info) {
  if (info.world_size == 0) return InvalidArgumentError("world_size is 0");
  if (info.chunk_bytes == 0 || info.chunk_bytes % kFileAlign != 0) {
    return InvalidArgumentError(
        fmt::format("chunk_bytes {} is not a positive multiple of 4096", info.chunk_bytes));
  }
  if (info.chunk_bytes > kMaxCheckpointChunkBytes) {
    return InvalidArgumentError(
        fmt::format("chunk_bytes {} is more than the {} bytes a save writes", info.chunk_bytes,
                    kMaxCheckpointChunkBytes));
  }
  if (info.arrays.empty() || info.arrays[0] != "master") {
    return InvalidArgumentError("arrays must start with \"master\"");
  }
  std::optional<OptimizerType> type;
  for (auto t : {OptimizerType::kAdam, OptimizerType::kAdamW, OptimizerType::kAdagrad,
                 OptimizerType::kLion}) {
    if (info.optimizer == OptimizerTypeName(t)) type = t;
  }
  if (!type) {
    return InvalidArgumentError(
        fmt::format("optimizer is '{}'; a save holds the state of Adam, AdamW, Adagrad or Lion",
                    info.optimizer));
  }
  if (const std::vector<std::string> names = StateArrayNames(*type); info.arrays != names) {
    return InvalidArgumentError(fmt::format("arrays are [{}]; a save of {} holds [{}]",
                                            fmt::join(info.arrays, ", "), info.optimizer,
                                            fmt::join(names, ", ")));
  }
  if (info.param_dtype != "fp32" && info.param_dtype != "bf16" && info.param_dtype != "fp16") {
    return InvalidArgumentError(fmt::format(
        "param_dtype is '{}'; a save's params are fp32, bf16 or fp16", info.param_dtype));
  }
  if (info.step < 0) return InvalidArgumentError(fmt::format("step {} is negative", info.step));
  // Before anything is computed from them: the sizes that follow (shard,
  // tensors) are at most the total.
  if (info.total_elems > kMaxCheckpointElems) {
    return InvalidArgumentError(
        fmt::format("layout.total_elems {} is more than a checkpoint holds (at most {} elems)",
                    info.total_elems, kMaxCheckpointElems));
  }
  // The tensors: a layout the sizes give, shapes that match the sizes.
  std::vector<TensorSpec> specs;
  for (const CheckpointTensor& t : info.tensors) specs.push_back({.elems = t.elems});
  STRATA_ASSIGN_OR_RETURN(FlatLayout l, PlanFlatLayout(specs, {.align_elems = info.align_elems,
                                                               .world_size = info.world_size}));
  bool same = l.total_elems == info.total_elems && l.shard_elems == info.shard_elems &&
              l.tensor_elems == info.tensor_elems;
  for (size_t t = 0; same && t < specs.size(); ++t) {
    same = l.tensors[t].offset_elems == info.tensors[t].offset_elems;
  }
  if (!same) {
    return InvalidArgumentError(
        "the layout (tensor offsets, totals) is not what the tensor sizes, align_elems and "
        "world_size give");
  }
  for (uint32_t i = 0; i < info.tensors.size(); ++i) {
    const CheckpointTensor& t = info.tensors[i];
    if (t.group >= info.groups.size()) {
      return InvalidArgumentError(
          fmt::format("tensor '{}' is in group {} of {}", t.name, t.group, info.groups.size()));
    }
    if (!t.shape) continue;
    uint64_t product = 1;
    for (uint64_t d : *t.shape) {
      product = d != 0 && product > std::numeric_limits<uint64_t>::max() / d ? 0 : product * d;
    }
    if (product != t.elems) {
      return InvalidArgumentError(fmt::format("tensor {} ('{}') has shape {} but {} elems", i,
                                              t.name, ShapeString(t), t.elems));
    }
  }
  // Counters and hyperparameters: values the engine accepts.
  for (uint32_t g = 0; g < info.groups.size(); ++g) {
    STRATA_RETURN_IF_ERROR(
        ValidateGroupHyper(info.groups[g], fmt::format("groups[{}].", g), *type));
  }
  // Any scaler state a dynamic scaler can reach (a static one is a special
  // case the loading optimizer checks against its own config).
  STRATA_ASSIGN_OR_RETURN(
      LossScaler scaler,
      LossScaler::Create({.hysteresis = std::numeric_limits<uint32_t>::max()}));
  STRATA_RETURN_IF_ERROR((scaler.Restore(info.scaler)).WithContext("loss_scaler"));
  return OkStatus();
}

// Checks a manifest against the layout it claims (so a reader can trust
// offsets and sizes).
Status ValidateRank(const CheckpointInfo& info, const RankManifest& rank) {
  // ValidateCommon bounds the layout; checked here too, since every size
  // below is a product of these.
  uint64_t shard_end = 0, shard_bytes = 0;
  if (info.shard_elems > kMaxCheckpointElems ||
      __builtin_mul_overflow(uint64_t{rank.rank} + 1, info.shard_elems, &shard_end) ||
      __builtin_mul_overflow(info.shard_elems, uint64_t{4}, &shard_bytes)) {
    return InvalidArgumentError(fmt::format(
        "layout.shard_elems {} of rank {} is more than a checkpoint holds (at most {} elems)",
        info.shard_elems, rank.rank, kMaxCheckpointElems));
  }
  const ElemRange want{shard_end - info.shard_elems, shard_end};
  if (!(rank.shard == want)) {
    return InvalidArgumentError(fmt::format("shard is [{}, {}); rank {} of {} owns [{}, {})",
                                            rank.shard.begin, rank.shard.end, rank.rank,
                                            info.world_size, want.begin, want.end));
  }
  if (rank.files.size() != info.arrays.size()) {
    return InvalidArgumentError(
        fmt::format("{} files for {} arrays", rank.files.size(), info.arrays.size()));
  }
  for (size_t a = 0; a < rank.files.size(); ++a) {
    const CheckpointFile& f = rank.files[a];
    if (f.array != info.arrays[a] || f.payload_bytes != shard_bytes ||
        f.file_bytes != RoundUp(f.payload_bytes, kFileAlign) ||
        f.chunk_xxh3.size() != (f.file_bytes + info.chunk_bytes - 1) / info.chunk_bytes ||
        f.name.empty() || f.name.find('/') != std::string::npos || f.name[0] == '.') {
      return InvalidArgumentError(fmt::format(
          "file entry {} ({}) does not match the layout (array {}, {} payload bytes, {} file "
          "bytes, {} chunks)",
          a, f.name, f.array, f.payload_bytes, f.file_bytes, f.chunk_xxh3.size()));
    }
  }
  return OkStatus();
}

json LatestJson(const CheckpointInfo& info, const std::vector<std::string>& history) {
  return {{"format", kCheckpointFormatName}, {"format_version", kCheckpointFormatVersion},
          {"checkpoint", info.save_id},      {"step", info.step},
          {"world_size", info.world_size},   {"history", history}};
}

std::optional<Latest> ParseLatest(const std::string& text) {
  json j = ParseJsonBounded<json>(text);
  if (j.is_discarded() || !j.is_object() || !j.contains("checkpoint") ||
      !j["checkpoint"].is_string()) {
    return std::nullopt;
  }
  Latest out{.checkpoint = j["checkpoint"].get<std::string>(), .history = {}};
  if (j.contains("history") && j["history"].is_array()) {
    for (const json& h : j["history"]) {
      if (h.is_string()) out.history.push_back(h.get<std::string>());
    }
  }
  return out;
}

std::string KeyName(const CheckpointInfo& info, uint32_t tensor) {
  const std::string& name = info.tensors[tensor].name;
  return name.empty() ? fmt::format("param.{}", tensor) : name;
}

std::optional<std::pair<uint32_t, uint32_t>> DuplicateKey(const CheckpointInfo& info) {
  std::unordered_map<std::string, uint32_t> seen;
  for (uint32_t i = 0; i < info.tensors.size(); ++i) {
    auto [it, inserted] = seen.emplace(KeyName(info, i), i);
    if (!inserted) return std::pair(it->second, i);
  }
  return std::nullopt;
}

// ---- Small file IO ------------------------------------------------------------------

Result<std::string> ReadSmallFile(Storage& storage, const std::string& path) {
  STRATA_ASSIGN_OR_RETURN(
      auto file, storage.Open(path, {.direct = DirectIo::kOff, .access = FileAccess::kReadOnly}));
  STRATA_ASSIGN_OR_RETURN(uint64_t size, file->SizeBytes());
  std::string text(size, '\0');
  if (size == 0) return text;
  IoRequest request = IoRequest::Read(0, std::as_writable_bytes(std::span(text.data(), size)));
  STRATA_RETURN_IF_ERROR(file->Submit({&request, 1}));
  IoRequest* done = nullptr;
  STRATA_ASSIGN_OR_RETURN(size_t n, file->Reap({&done, 1}, 1));
  if (n != 1) return InternalError("reap " + path + ": no completion");
  STRATA_RETURN_IF_ERROR(done->status);
  return text;
}

bool Exists(const std::string& path) {
  std::error_code ec;
  return std::filesystem::exists(path, ec);
}

Result<bool> Present(const std::string& path, std::string_view op) {
  struct stat st {};
  if (::stat(path.c_str(), &st) == 0) return true;
  const int err = errno;
  if (err == ENOENT || err == ENOTDIR) return false;
  const Status cause = ErrnoError(err, fmt::format("{}: stat {}", op, path));
  if (err != EACCES) return cause;
  // The nearest directory on the way that this user may not search.
  std::string why;
  for (std::filesystem::path dir = std::filesystem::path(path).lexically_normal().parent_path();
       !dir.empty() && dir != dir.root_path(); dir = dir.parent_path()) {
    struct stat d {};
    if (::stat(dir.c_str(), &d) == 0 &&
        ::faccessat(AT_FDCWD, dir.c_str(), R_OK | X_OK, AT_EACCESS) != 0) {
      why = fmt::format("; this user (uid {}) may not read {} (mode {:03o}, owner uid {})",
                        ::geteuid(), dir.string(), d.st_mode & 07777, d.st_uid);
      break;
    }
  }
  return Status(cause.code(),
                fmt::format("{}{}: give this user read and search permission on the checkpoint "
                            "(chmod -R u+rX, or ask its owner), or read it as a user who can",
                            cause.message(), why));
}

Result<StorageRef> StorageRef::Of(Storage* given) {
  StorageRef r;
  if (given != nullptr) {
    r.storage = given;
  } else {
    STRATA_ASSIGN_OR_RETURN(r.owned, CreateStorage({}));
    r.storage = r.owned.get();
  }
  return r;
}

}  // namespace checkpoint_internal

std::vector<std::string> StateArrayNames(OptimizerType type) {
  switch (type) {
    case OptimizerType::kAdam:
    case OptimizerType::kAdamW:
      return {"master", "exp_avg", "exp_avg_sq"};
    case OptimizerType::kAdagrad:
      return {"master", "sum"};
    case OptimizerType::kLion:
      return {"master", "exp_avg"};
  }
  return {"master"};
}

uint64_t CheckpointInfo::data_bytes() const {
  uint64_t n = 0;
  for (const RankManifest& r : ranks) {
    for (const CheckpointFile& f : r.files) n += f.file_bytes;
  }
  return n;
}

}  // namespace strata
