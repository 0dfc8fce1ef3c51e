// ExportSafetensors: a checkpoint's master weights as safetensors files that
// torch's load_state_dict takes (shaped, named, fp32/bf16/fp16), one file or
// Hugging Face shards with an index, streamed tensor piece by tensor piece.
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <future>
#include <nlohmann/json.hpp>
#include <regex>
#include <set>

#include "kernels/kernels.h"
#include "offload/checkpoint_internal.h"
#include "runtime/atomic_file.h"
#include "runtime/host_region.h"
#include "runtime/log.h"
#include "runtime/units.h"

namespace strata {

using namespace checkpoint_internal;  // NOLINT: this file's own helpers

namespace {

namespace fs = std::filesystem;

constexpr std::string_view kSingleFile = "model.safetensors";
constexpr std::string_view kIndexFile = "model.safetensors.index.json";

bool EndsWith(std::string_view s, std::string_view suffix) {
  return s.size() >= suffix.size() && s.substr(s.size() - suffix.size()) == suffix;
}

// The names an export writes into a directory, in either layout.
bool IsExportFileName(const std::string& name) {
  static const std::regex shard("model-[0-9]{5,}-of-[0-9]{5,}\\.safetensors");
  return name == kSingleFile || name == kIndexFile || std::regex_match(name, shard);
}

// The files of an earlier export in `out_dir` that this export does not
// write (`ours`): the other layout, or shards of another count. Loaders
// prefer model.safetensors to an index, so left there they would load old
// weights or a mix. FailedPrecondition naming them without kReplace; with
// it, each must be a regular file (the caller removes them). Sorted.
Result<std::vector<std::string>> StaleExportFiles(const std::string& out_dir,
                                                  const std::set<std::string>& ours,
                                                  ExistingFile existing, std::string_view op) {
  std::vector<std::string> stale;
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(out_dir, ec)) {
    const std::string name = e.path().filename().string();
    if (IsExportFileName(name) && ours.count(name) == 0) stale.push_back(JoinPath(out_dir, name));
  }
  std::sort(stale.begin(), stale.end());
  if (stale.empty()) return stale;
  if (existing == ExistingFile::kRefuse) {
    constexpr size_t kListed = 6;
    std::vector<std::string> listed(stale.begin(), stale.begin() + std::min(stale.size(), kListed));
    return FailedPreconditionError(fmt::format(
        "{}: {} holds {} file(s) of an earlier export in another layout that this export would "
        "not replace: {}{}; Hugging Face loaders would read them (model.safetensors before any "
        "index) instead of, or mixed with, this export: remove them, export into another "
        "directory, or replace them (--force; force=True in Python)",
        op, out_dir, stale.size(), fmt::join(listed, ", "),
        stale.size() > kListed ? fmt::format(" and {} more", stale.size() - kListed) : ""));
  }
  for (const std::string& path : stale) {
    STRATA_RETURN_IF_ERROR(
        (CheckOutputPath(path, ExistingFile::kReplace))
            .WithContext(fmt::format("{}: a file of an earlier export cannot be replaced", op)));
  }
  return stale;
}

// Removes the temporaries that exports killed part way (SIGKILL, an
// out-of-memory kill) left in `dir`: up to a whole shard each, and nothing
// else removes them. Those of `one_file` when it is given, else those of
// any export file name.
Status RemoveDeadTemporaries(Storage& storage, const std::string& dir, const std::string& one_file,
                             std::string_view op) {
  const std::vector<std::string> dead = DeadTemporaries(dir, [&](std::string_view target) {
    return one_file.empty() ? IsExportFileName(std::string(target)) : target == one_file;
  });
  uint64_t bytes = 0;
  for (const std::string& path : dead) {
    std::error_code ec;
    const uintmax_t size = fs::file_size(path, ec);
    STRATA_RETURN_IF_ERROR(
        (storage.Remove(path))
            .WithContext(fmt::format(
                "{}: remove {}, the temporary file of an export that was killed part way", op,
                path)));
    if (!ec) bytes += size;
  }
  if (!dead.empty()) {
    LogInfo(
        fmt::format("{}: removed {} temporary file(s), {}, that exports killed part way left: {}",
                    op, dead.size(), FormatBytes(bytes), fmt::join(dead, ", ")));
  }
  return OkStatus();
}

// Removes what StaleExportFiles found, once this export's data files are
// written (so a failed export leaves the earlier one whole) and before its
// index is (so no moment shows both layouts' entry points).
Status RemoveStale(Storage& storage, const std::vector<std::string>& stale, std::string_view op) {
  for (const std::string& path : stale) {
    STRATA_RETURN_IF_ERROR(
        (storage.Remove(path))
            .WithContext(fmt::format(
                "{}: this export's files are written, but {} of an earlier export could not be "
                "removed; remove it by hand (loaders would read it)",
                op, path)));
  }
  return OkStatus();
}

// FailedPrecondition when `out` is the checkpoint directory or inside it:
// an export must never replace what it reads (latest.json, a manifest).
Status CheckOutsideCheckpoint(const std::string& dir, const std::string& out, std::string_view op) {
  if (dir.empty()) return OkStatus();  // the reader names it: no directory
  // Absolute first: weakly_canonical leaves a relative path whose first
  // part does not exist ("model.safetensors" in the checkpoint) relative.
  std::error_code ec;
  const fs::path root = fs::weakly_canonical(fs::absolute(dir, ec), ec);
  if (ec) return OkStatus();  // the reader reports a missing checkpoint
  const fs::path target = fs::weakly_canonical(fs::absolute(out, ec), ec);
  if (ec) return ErrnoError(ec.value(), fmt::format("{}: resolve {}", op, out));
  const std::string r = root.string(), t = target.string();
  if (t == r || (t.size() > r.size() && t.compare(0, r.size(), r) == 0 && t[r.size()] == '/')) {
    return FailedPreconditionError(fmt::format(
        "{}: {} is inside the checkpoint directory {} that the export reads; write the export "
        "somewhere else",
        op, out, r));
  }
  return OkStatus();
}

std::string_view SafetensorsDType(DType t) {
  switch (t) {
    case DType::kF32:
      return "F32";
    case DType::kBF16:
      return "BF16";
    case DType::kF16:
      return "F16";
    default:
      return "";
  }
}

// fp32 -> the export's dtype, as the bytes of `out`; returns how many finite
// values became infinite (beyond the dtype's range). The conversion is
// kernels' vectorized host cast (dtype.h's rounding, bit for bit).
Result<uint64_t> Convert(std::span<const float> in, DType dtype, std::vector<std::byte>& out) {
  const size_t size = DTypeSize(dtype);
  out.resize(in.size() * size);
  if (dtype == DType::kF32) {
    std::memcpy(out.data(), in.data(), in.size_bytes());
    return 0;
  }
  auto* dst = reinterpret_cast<uint16_t*>(out.data());
  STRATA_RETURN_IF_ERROR(
      kernels::CastOnHost({in.data(), in.size(), DType::kF32}, {dst, in.size(), dtype}));
  // The infinities of both 16-bit formats: every exponent bit set, no
  // mantissa. Those of the output, less those that were already infinite.
  const uint16_t inf = dtype == DType::kBF16 ? 0x7f80 : 0x7c00;
  uint64_t infinite = 0;
  for (size_t i = 0; i < in.size(); ++i) infinite += (dst[i] & 0x7fff) == inf ? 1 : 0;
  if (infinite == 0) return 0;
  for (float x : in) infinite -= std::isinf(x) ? 1 : 0;
  return infinite;
}

struct Shard {
  std::string file;               // name inside the output directory (or the file itself)
  std::vector<uint32_t> tensors;  // registration order
  uint64_t bytes = 0;
};

// Hugging Face's rule: tensors in order; a new shard when the next tensor
// would take the current one past the limit (a larger tensor alone).
std::vector<Shard> PlanShards(const CheckpointInfo& info, uint64_t elem_bytes, uint64_t max_bytes) {
  std::vector<Shard> shards(1);
  for (uint32_t i = 0; i < info.tensors.size(); ++i) {
    const uint64_t bytes = info.tensors[i].elems * elem_bytes;
    if (max_bytes > 0 && !shards.back().tensors.empty() &&
        shards.back().bytes + bytes > max_bytes) {
      shards.emplace_back();
    }
    shards.back().tensors.push_back(i);
    shards.back().bytes += bytes;
  }
  return shards;
}

}  // namespace

Result<ExportResult> ExportSafetensors(const std::string& dir, const std::string& out,
                                       const ExportOptions& options) {
  const std::string op = fmt::format("export {} to {}", dir, out);
  if (out.empty()) {
    return InvalidArgumentError(fmt::format(
        "export {} to '': the output path is empty; give OUT.safetensors for one file, or a "
        "directory that receives model.safetensors (or the shards and their index)",
        dir));
  }
  const std::string_view st_dtype = SafetensorsDType(options.dtype);
  if (st_dtype.empty()) {
    return InvalidArgumentError(
        fmt::format("{}: dtype {}; export writes f32, bf16 or f16", op, DTypeName(options.dtype)));
  }
  const bool one_file = EndsWith(out, ".safetensors");
  if (one_file && options.max_shard_bytes > 0) {
    return InvalidArgumentError(fmt::format(
        "{}: a maximum shard size writes several files and an index into a directory; give a "
        "directory, not a .safetensors file",
        op));
  }
  STRATA_RETURN_IF_ERROR(CheckOutsideCheckpoint(dir, out, op));
  STRATA_ASSIGN_OR_RETURN(auto reader, CheckpointReader::Open(dir, options.reader));
  const CheckpointInfo& info = reader->info();

  std::vector<std::string> names;
  std::set<std::string> seen = {"__metadata__"};
  for (uint32_t i = 0; i < info.tensors.size(); ++i) {
    const CheckpointTensor& t = info.tensors[i];
    names.push_back(t.name.empty() ? fmt::format("param.{}", i) : t.name);
    if (names.back() == "__metadata__") {
      return FailedPreconditionError(fmt::format(
          "{}: tensor {} is named '__metadata__', the key safetensors keeps for its metadata "
          "(saved before optimizers refused the name): load the save into an optimizer whose "
          "param has another name and save again",
          op, i));
    }
    if (!seen.insert(names.back()).second) {
      return FailedPreconditionError(fmt::format(
          "{}: tensor {} is named '{}' like an earlier one; safetensors needs unique names: "
          "register the params with unique names (or none)",
          op, i, names.back()));
    }
  }
  const uint64_t elem_bytes = DTypeSize(options.dtype);
  std::vector<Shard> shards = PlanShards(info, elem_bytes, options.max_shard_bytes);
  std::string out_dir;
  if (one_file) {
    shards[0].file = out;
  } else {
    out_dir = out;
    std::error_code ec;
    if (fs::exists(fs::symlink_status(out_dir, ec)) && !fs::is_directory(out_dir, ec)) {
      return FailedPreconditionError(fmt::format(
          "{}: {} exists and is not a directory; name a directory (or a .safetensors file)", op,
          out_dir));
    }
    for (size_t s = 0; s < shards.size(); ++s) {
      shards[s].file = JoinPath(
          out_dir, shards.size() == 1
                       ? std::string(kSingleFile)
                       : fmt::format("model-{:05}-of-{:05}.safetensors", s + 1, shards.size()));
    }
  }
  // Refuse every bad output before the first byte is written.
  for (const Shard& s : shards) STRATA_RETURN_IF_ERROR(CheckOutputPath(s.file, options.existing));
  if (one_file) {
    // A directory output is created; the directory of a one-file output must exist.
    if (Status s = CheckParentDirectory(out); !s.ok()) {
      return Status(s.code(), fmt::format("{}: {}; or give a directory as the output (it is "
                                          "created)",
                                          op, s.message()));
    }
  }
  const std::string index_path = JoinPath(out_dir, kIndexFile);
  if (shards.size() > 1) STRATA_RETURN_IF_ERROR(CheckOutputPath(index_path, options.existing));
  std::vector<std::string> stale;
  if (!out_dir.empty()) {
    std::set<std::string> ours;
    for (const Shard& s : shards) ours.insert(fs::path(s.file).filename().string());
    if (shards.size() > 1) ours.insert(std::string(kIndexFile));
    STRATA_ASSIGN_OR_RETURN(stale, StaleExportFiles(out_dir, ours, options.existing, op));
  }
  if (!out_dir.empty()) {
    std::error_code ec;
    fs::create_directories(out_dir, ec);
    if (ec) return ErrnoError(ec.value(), op + ": create directory " + out_dir);
  }

  STRATA_ASSIGN_OR_RETURN(StorageRef storage, StorageRef::Of(options.storage));
  STRATA_RETURN_IF_ERROR(RemoveDeadTemporaries(
      *storage.storage, one_file ? fs::path(out).parent_path().string() : out_dir,
      one_file ? fs::path(out).filename().string() : "", op));
  ExportResult result;
  // Two buffers: the next part is read (and its chunks checked) on a thread
  // of its own while this one is converted and written. 4096-aligned, so
  // the reader reads whole chunks straight into them.
  const uint64_t part_elems = RoundUp(std::max<uint64_t>(options.buffer_bytes / 8, 1024), 1024);
  Result<HostRegion> region = HostRegion::Map(2 * part_elems * sizeof(float));
  if (!region.ok()) return ResourceExhaustedError(op + ": no memory for the copy buffers");
  float* const bufs = reinterpret_cast<float*>(region->data());
  std::vector<std::byte> converted;
  nlohmann::ordered_json weight_map = nlohmann::ordered_json::object();
  uint64_t total_bytes = 0;
  for (const CheckpointTensor& t : info.tensors) total_bytes += t.elems * elem_bytes;
  ProgressReporter progress(
      fmt::format("export {}", fs::path(shards.front().file).parent_path().string()), total_bytes,
      ProgressUnit::kBytes);
  // Each shard is sealed as it is written and all are committed (renamed
  // over their targets) only once every one is: a failure (or an
  // interruption) while writing leaves nothing of this export and every
  // file of an earlier one as it was (the sealed temporaries go with their
  // writers).
  std::vector<std::unique_ptr<AtomicFileWriter>> sealed;
  Status written = [&]() -> Status {
    for (const Shard& shard : shards) {
      nlohmann::ordered_json header;
      header["__metadata__"] = {{"format", "pt"},
                                {"source", "strata checkpoint " + info.save_id},
                                {"step", std::to_string(info.step)},
                                {"world_size", std::to_string(info.world_size)},
                                {"optimizer", info.optimizer}};
      uint64_t offset = 0;
      for (uint32_t i : shard.tensors) {
        const CheckpointTensor& t = info.tensors[i];
        const std::vector<uint64_t> shape = t.shape.value_or(std::vector<uint64_t>{t.elems});
        header[names[i]] = {{"dtype", st_dtype},
                            {"shape", shape},
                            {"data_offsets", {offset, offset + t.elems * elem_bytes}}};
        offset += t.elems * elem_bytes;
        weight_map[names[i]] = fs::path(shard.file).filename().string();
      }
      std::string text = header.dump();
      text.append(RoundUp(text.size(), 8) - text.size(), ' ');
      std::string len(8, '\0');
      for (int k = 0; k < 8; ++k) len[k] = static_cast<char>(uint64_t{text.size()} >> (8 * k));

      STRATA_ASSIGN_OR_RETURN(
          auto writer,
          AtomicFileWriter::Create(*storage.storage, shard.file, {.existing = options.existing}));
      STRATA_RETURN_IF_ERROR((writer->Append(len)).WithContext(op));
      STRATA_RETURN_IF_ERROR((writer->Append(text)).WithContext(op));
      // The shard's tensors in parts of at most part_elems; part p is read
      // into buffer p % 2 while part p - 1 is converted and written.
      struct Part {
        uint32_t tensor;
        uint64_t at, elems;
      };
      std::vector<Part> parts;
      for (uint32_t i : shard.tensors) {
        for (uint64_t at = 0; at < info.tensors[i].elems; at += part_elems) {
          parts.push_back({i, at, std::min<uint64_t>(part_elems, info.tensors[i].elems - at)});
        }
      }
      auto buffer = [&](size_t p) {
        return std::span<float>(bufs + (p % 2) * part_elems, parts[p].elems);
      };
      auto read = [&](size_t p) {
        return std::async(std::launch::async, [&, p] {
          return reader->ReadTensor(0, parts[p].tensor, parts[p].at, buffer(p));
        });
      };
      // Waited for before anything it reads into or from goes away.
      std::future<Status> reading = parts.empty() ? std::future<Status>() : read(0);
      uint64_t overflowed = 0;  // of the current tensor
      for (size_t p = 0; p < parts.size(); ++p) {
        STRATA_RETURN_IF_ERROR((reading.get()).WithContext(op));
        if (options.interrupted && options.interrupted()) {
          return CancelledError(fmt::format("{}: interrupted while writing {}", op, shard.file));
        }
        if (p + 1 < parts.size()) reading = read(p + 1);
        STRATA_ASSIGN_OR_RETURN(const uint64_t beyond_range,
                                Convert(buffer(p), options.dtype, converted));
        overflowed += beyond_range;
        STRATA_RETURN_IF_ERROR((writer->Append(converted)).WithContext(op));
        progress.Add(converted.size());
        const uint32_t i = parts[p].tensor;
        if (parts[p].at + parts[p].elems < info.tensors[i].elems) continue;
        if (overflowed > 0) {
          LogWarning(fmt::format(
              "{}: {} of the {} values of tensor '{}' are beyond {}'s range and are inf in the "
              "file; export it as bf16 or fp32 to keep them",
              op, overflowed, info.tensors[i].elems, names[i], DTypeName(options.dtype)));
        }
        overflowed = 0;
      }
      STRATA_RETURN_IF_ERROR((writer->Seal()).WithContext(op));
      sealed.push_back(std::move(writer));
      result.tensor_bytes += shard.bytes;
      result.tensors += shard.tensors.size();
    }
    return OkStatus();
  }();
  if (!written.ok()) return written;
  // Renames only: a failure here is the filesystem's, and the shards
  // renamed before it have replaced their targets.
  for (const auto& writer : sealed) {
    if (Status s = writer->Commit(); !s.ok()) {
      // Its rename took effect before the failure (the directory sync): in place too.
      if (writer->in_place()) result.files.push_back(writer->path());
      if (result.files.empty()) return std::move(s).WithContext(op);
      return Status(s.code(), fmt::format("{}: {}; {} shard(s) are in place ({}): the export in "
                                          "{} is not whole, export again",
                                          op, s.message(), result.files.size(),
                                          fmt::join(result.files, ", "), out));
    }
    result.files.push_back(writer->path());
  }
  sealed.clear();
  progress.Finish();
  STRATA_RETURN_IF_ERROR(RemoveStale(*storage.storage, stale, op));
  result.removed = std::move(stale);
  if (shards.size() > 1) {
    const nlohmann::ordered_json index = {{"metadata", {{"total_size", result.tensor_bytes}}},
                                          {"weight_map", weight_map}};
    STRATA_RETURN_IF_ERROR((WriteFileAtomically(*storage.storage, index_path, index.dump(2) + "\n",
                                                {.existing = options.existing}))
                               .WithContext(op));
    result.files.push_back(index_path);
  }
  return result;
}

}  // namespace strata
