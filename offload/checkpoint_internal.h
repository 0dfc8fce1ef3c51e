// Pieces the checkpoint files share (not a public header):
//   checkpoint_format.cc     the manifest and latest.json as JSON, and the one
//                            validator every reader of a checkpoint applies
//   checkpoint_reader.cc     CheckpointReader: open, read ranges, verify
//   checkpoint_save_load.cc  SaveCheckpoint / LoadCheckpoint, retention
//   checkpoint_export.cc     ExportSafetensors
// The format itself is docs/checkpoint.md.
#pragma once

#include <cstdint>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "offload/checkpoint.h"
#include "runtime/status.h"
#include "runtime/storage.h"

namespace strata::checkpoint_internal {

using json = nlohmann::json;

inline constexpr uint64_t kFileAlign = 4096;
// The most elements a checkpoint's layout may hold (total_elems): 2^58, an
// EiB of fp32 per array, beyond any optimizer's state. Bounded so that no
// byte count or offset a reader computes from a manifest can wrap (an
// array's bytes, x 4, padded to 4096 and summed over the ranks and an
// optimizer's arrays stay below 2^62): shard_elems = 2^62 + 64 made
// shard_elems x 4 wrap to 256 and passed as a 256-byte file.
inline constexpr uint64_t kMaxCheckpointElems = uint64_t{1} << 58;
inline constexpr std::string_view kLatest = "latest.json";
// Held by rank 0 while a save runs (SaveCheckpoint).
inline constexpr std::string_view kSaveLock = "strata-save.lock";

inline uint64_t RoundUp(uint64_t v, uint64_t a) { return (v + a - 1) / a * a; }
std::string Hex(uint64_t v);
std::string RankName(uint32_t rank);  // "rank00003"
// `dir` without the slashes it ends with ("ckpt//" gives "ckpt"; "/" stays).
std::string WithoutTrailingSlashes(std::string_view dir);
// `dir` + "/" + `name`, one slash however many `dir` ends with ("ckpt/" and
// "ckpt" give "ckpt/latest.json"; "/" gives "/latest.json").
std::string JoinPath(std::string_view dir, std::string_view name);
// "[32, 16]"; "[elems]" for a tensor saved without a shape.
std::string ShapeString(const CheckpointTensor& t);

// ---- Manifests (checkpoint_format.cc) ----------------------------------------

// The sealed manifest of one rank (manifest_xxh3 included).
json SealedManifestJson(const CheckpointInfo& info, const RankManifest& rank);
// Checks the seal, then parses one rank's manifest into `info` (the common
// part) and `rank`. InvalidArgument (the caller makes it DataLoss, naming the
// file) for a missing key, a wrong type or a value this build cannot read.
Status ParseManifest(const json& j, CheckpointInfo& info, RankManifest& rank);
// The parts every rank's manifest of one save must agree on.
json CommonPart(json j);

// The one validator: what must hold of a checkpoint for anything (load,
// export, inspect --verify) to use it, without a model to compare with.
// `info` with its ranks so far. InvalidArgument naming the field.
Status ValidateCommon(const CheckpointInfo& info);
Status ValidateRank(const CheckpointInfo& info, const RankManifest& rank);

// The name a tensor is keyed by in state_dicts and exports: its own, or
// "param.<i>" when it has none.
std::string KeyName(const CheckpointInfo& info, uint32_t tensor);
// The first two tensors keyed alike (KeyName), nullopt when every key is unique.
std::optional<std::pair<uint32_t, uint32_t>> DuplicateKey(const CheckpointInfo& info);

// latest.json: the save it names, and the saves it keeps (newest first).
json LatestJson(const CheckpointInfo& info, const std::vector<std::string>& history);
struct Latest {
  std::string checkpoint;
  std::vector<std::string> history;
};
// nullopt when the text is not a valid latest.json.
std::optional<Latest> ParseLatest(const std::string& text);

// ---- Small file IO -------------------------------------------------------------

Result<std::string> ReadSmallFile(Storage& storage, const std::string& path);
bool Exists(const std::string& path);
// Whether `path` exists; an error other than ENOENT/ENOTDIR (EACCES: a
// directory on the way this user may not search) is the errno naming the
// path and, for EACCES, the directory, its mode and owner, and the fix,
// after "<op>: ".
Result<bool> Present(const std::string& path, std::string_view op);

// The storage the caller gave, or one made for this call.
struct StorageRef {
  std::unique_ptr<Storage> owned;
  Storage* storage = nullptr;
  static Result<StorageRef> Of(Storage* given);
};

}  // namespace strata::checkpoint_internal
