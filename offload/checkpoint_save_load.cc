// SaveCheckpoint and LoadCheckpoint: the collectives around the format
// (checkpoint_format.cc) and the reader (checkpoint_reader.cc), and retention.
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <xxhash.h>

#include <algorithm>
#include <charconv>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <limits>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <random>
#include <regex>
#include <set>
#include <span>

#include "offload/checkpoint_internal.h"
#include "runtime/device.h"
#include "runtime/file_lock.h"
#include "runtime/json_parse.h"
#include "runtime/log.h"

namespace strata {

using namespace checkpoint_internal;  // NOLINT: this file's own helpers

namespace {

namespace fs = std::filesystem;

// A data file's chunks are its AtomicFileWriter's write requests.
static_assert(kMaxCheckpointChunkBytes <= kMaxAtomicWriteChunkBytes);

Status MakeDir(const std::string& dir) {
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (ec) return ErrnoError(ec.value(), "create directory " + dir);
  return OkStatus();
}

// InvalidArgument unless `shapes` is empty or gives every registered param a
// shape whose product is its element count.
Status CheckShapes(OffloadOptimizer& opt, const TensorShapes& shapes, std::string_view op) {
  if (shapes.empty()) return OkStatus();
  if (shapes.size() != opt.params().size()) {
    return InvalidArgumentError(fmt::format("{}: {} shapes for {} registered params", op,
                                            shapes.size(), opt.params().size()));
  }
  for (uint32_t i = 0; i < shapes.size(); ++i) {
    // Checked: [3, 0xAAAAAAAAAAAAAAAB] wrapped to 1, was saved for a
    // one-element param, and every reader refused the save.
    uint64_t product = 1;
    bool wrapped = false;
    for (uint64_t d : shapes[i]) wrapped |= __builtin_mul_overflow(product, d, &product);
    if (wrapped || product != opt.params()[i].elems) {
      return InvalidArgumentError(fmt::format("{}: param {} ('{}') has shape [{}] but {} elems", op,
                                              i, opt.params()[i].name, fmt::join(shapes[i], ", "),
                                              opt.params()[i].elems));
    }
  }
  return OkStatus();
}

// Small all-reduces over the optimizer's communicator, on a stream of our
// own (the local backend wants one stream per rank; nothing else runs on it).
class Collective {
 public:
  static constexpr size_t kMaxValues = 16;  // the most one all-reduce carries

  static Result<Collective> Create(OffloadOptimizer& opt) {
    Collective c;
    c.comm_ = opt.comm();
    if (c.comm_ == nullptr || opt.world_size() == 1) return c;
    c.device_ = &opt.device();
    STRATA_ASSIGN_OR_RETURN(c.stream_, c.device_->CreateStream());
    STRATA_ASSIGN_OR_RETURN(c.buf_, c.device_->Allocate(kMaxValues * sizeof(double)));
    STRATA_ASSIGN_OR_RETURN(c.host_, c.device_->AllocateHost(kMaxValues * sizeof(double)));
    return c;
  }
  // All-reduces `values` in place, in one collective.
  Status AllReduce(std::span<double> values, ReduceOp op) {
    STRATA_CHECK(values.size() <= kMaxValues) << values.size() << " values in one all-reduce";
    if (device_ == nullptr || values.empty()) return OkStatus();
    const size_t bytes = values.size_bytes();
    double* host = static_cast<double*>(host_.data());
    std::copy(values.begin(), values.end(), host);
    Status enqueued = [&]() -> Status {
      STRATA_RETURN_IF_ERROR(
          device_->CopyAsync(buf_.data(), host, bytes, CopyKind::kHostToDevice, stream_));
      STRATA_RETURN_IF_ERROR(
          comm_->AllReduce(buf_.data(), buf_.data(), values.size(), DType::kF64, op, stream_));
      return device_->CopyAsync(host, buf_.data(), bytes, CopyKind::kDeviceToHost, stream_);
    }();
    // Drained also after an error: what was enqueued still uses the buffers.
    Status done = device_->StreamSynchronize(stream_);
    STRATA_RETURN_IF_ERROR(enqueued);
    STRATA_RETURN_IF_ERROR(done);
    std::copy(host, host + values.size(), values.begin());
    return OkStatus();
  }
  Result<double> AllReduce(double value, ReduceOp op) {
    STRATA_RETURN_IF_ERROR(AllReduce(std::span<double>(&value, 1), op));
    return value;
  }
  // How many ranks report a failure.
  Result<int> CountFailures(const Status& local) {
    Result<double> n = AllReduce(local.ok() ? 0.0 : 1.0, ReduceOp::kSum);
    if (!n.ok()) return Unagreed(local, n.status());
    return static_cast<int>(*n);
  }
  // The error of an agreement that failed (`comm`, the all-reduce's error):
  // this rank's own failure `local` first, as it is the cause, then `comm`.
  static Status Unagreed(const Status& local, const Status& comm) {
    const std::string unagreed =
        fmt::format("the ranks could not agree on the outcome ({})", comm.message());
    if (local.ok()) return Status(comm.code(), unagreed);
    return Status(local.code(), fmt::format("{}; and {}", local.message(), unagreed));
  }

 private:
  Communicator* comm_ = nullptr;
  Device* device_ = nullptr;
  Stream stream_;
  DeviceBuffer buf_;
  HostAllocation host_;  // pinned: the CUDA backend copies from pinned memory only
};

// ---- The ranks agree on what they do -----------------------------------------------
//
// Before a save writes anything and before a load changes anything, every
// rank learns, in one all-reduce, whether all ranks passed the same
// directory, and (save) are at the same step with the same settings, or
// (load) resolved the same save. Each part travels as a 52-bit digest d of
// its value, sent as d and kDigestRange - d under kMax (exact in a double):
// every rank then holds max(d) and kDigestRange - min(d), and the ranks
// agree on the part when these add up to kDigestRange. Every rank sees the
// same sums, so every rank refuses together, naming the part and its own
// value (the pattern of OffloadOptimizer's AgreeOnPlan).

constexpr double kDigestRange = 4503599627370496.0;  // 2^52

// Load's unit of device state (partial offload): a host buffer of 4 MiB.
constexpr uint64_t kStatePieceElems = uint64_t{1} << 20;

struct AgreedPart {
  std::string_view what;  // "directory", "step", ...
  std::string value;      // this rank's, as the error shows it
  std::string compared;   // what is compared, when it is not `value`
};

// What one agreement found: whether any rank failed before it, and the first
// part whose value differs between ranks.
struct Agreed {
  bool any_failed = false;
  std::optional<size_t> differs;
};

// One all-reduce: `local`'s outcome and every part. Without an answer, the
// error says so (this rank's own failure first).
Result<Agreed> Agree(Collective& coll, const Status& local, std::span<const AgreedPart> parts) {
  std::vector<double> values(1 + 2 * parts.size());
  values[0] = local.ok() ? 0.0 : 1.0;
  for (size_t i = 0; i < parts.size(); ++i) {
    const std::string& v = parts[i].compared.empty() ? parts[i].value : parts[i].compared;
    const double d =
        static_cast<double>(XXH3_64bits(v.data(), v.size()) & ((uint64_t{1} << 52) - 1));
    values[1 + 2 * i] = d;
    values[2 + 2 * i] = kDigestRange - d;
  }
  if (Status s = coll.AllReduce(values, ReduceOp::kMax); !s.ok()) {
    return Collective::Unagreed(local, s);
  }
  Agreed agreed;
  agreed.any_failed = values[0] > 0;
  for (size_t i = 0; i < parts.size(); ++i) {
    if (values[1 + 2 * i] + values[2 + 2 * i] != kDigestRange) {
      agreed.differs = i;
      break;
    }
  }
  return agreed;
}

// A directory as the ranks compare it: absolute, lexically normal, without
// a trailing separator.
std::string ComparableDir(const std::string& dir) {
  std::error_code ec;
  fs::path p = fs::absolute(dir, ec);
  if (ec) p = dir;
  p = p.lexically_normal();
  if (!p.has_filename() && p.has_parent_path() && p != p.root_path()) p = p.parent_path();
  return p.string();
}

// One data file: the rank's shard of one array, zero-padded to 4096 bytes,
// with the checksum of every chunk_bytes piece and of the whole file.
class ArrayFile {
 public:
  static Result<std::unique_ptr<ArrayFile>> Open(Storage& storage, const std::string& path,
                                                 uint64_t payload_bytes, const SaveOptions& o) {
    auto f = std::unique_ptr<ArrayFile>(new ArrayFile());
    f->hash_ = XXH3_createState();
    XXH3_64bits_reset(f->hash_);
    ArrayFile* raw = f.get();
    STRATA_ASSIGN_OR_RETURN(
        f->writer_,
        AtomicFileWriter::Create(storage, path,
                                 {.existing = ExistingFile::kReplace,
                                  .direct = o.direct,
                                  .chunk_bytes = o.chunk_bytes,
                                  .queue_depth = o.queue_depth,
                                  .on_chunk =
                                      [raw](std::span<const std::byte> c) {
                                        raw->chunk_xxh3_.push_back(
                                            XXH3_64bits(c.data(), c.size()));
                                        XXH3_64bits_update(raw->hash_, c.data(), c.size());
                                      },
                                  .size_hint = RoundUp(payload_bytes, kFileAlign)}));
    return f;
  }
  ~ArrayFile() {
    writer_.reset();  // its chunks still call into hash_
    XXH3_freeState(hash_);
  }

  // Appends elems [0, elems) of `array` of sub-group `index` straight into
  // the writer's chunks: from `state` (host memory) or, where it is empty
  // (device state), read with ReadState.
  Status AppendState(OffloadOptimizer& opt, uint32_t index, uint32_t array, uint64_t elems,
                     std::span<const float> state, ProgressReporter& progress) {
    uint64_t begin = 0;
    return writer_->AppendFilled(elems * sizeof(float), [&](std::span<std::byte> piece) {
      // Only whole floats are appended before the padding: pieces hold floats.
      const std::span<float> out(reinterpret_cast<float*>(piece.data()),
                                 piece.size() / sizeof(float));
      if (state.empty()) {
        STRATA_RETURN_IF_ERROR(opt.ReadState(index, array, begin, out));
      } else {
        std::memcpy(out.data(), state.data() + begin, out.size_bytes());
      }
      begin += out.size();
      progress.Add(piece.size());
      return OkStatus();
    });
  }

  Result<CheckpointFile> Finish(std::string array, std::string name) {
    const uint64_t payload = writer_->appended_bytes();
    const std::string zeros(RoundUp(payload, kFileAlign) - payload, '\0');
    STRATA_RETURN_IF_ERROR(writer_->Append(zeros));
    STRATA_RETURN_IF_ERROR(writer_->Commit());
    return CheckpointFile{.array = std::move(array),
                          .name = std::move(name),
                          .payload_bytes = payload,
                          .file_bytes = writer_->file_bytes(),
                          .xxh3 = XXH3_64bits_digest(hash_),
                          .chunk_xxh3 = chunk_xxh3_};
  }

 private:
  ArrayFile() = default;
  std::unique_ptr<AtomicFileWriter> writer_;
  XXH3_state_t* hash_ = nullptr;
  std::vector<uint64_t> chunk_xxh3_;
};

// The manifest's checkpoint description of a live optimizer.
CheckpointInfo InfoOf(OffloadOptimizer& opt, const std::string& save_id, uint64_t chunk_bytes,
                      const TensorShapes& shapes) {
  CheckpointInfo info;
  info.save_id = save_id;
  info.format_version = kCheckpointFormatVersion;
  info.step = opt.step_count();
  info.world_size = static_cast<uint32_t>(opt.world_size());
  info.optimizer = std::string(OptimizerTypeName(opt.config().optimizer));
  info.arrays = StateArrayNames(opt.config().optimizer);
  info.param_dtype = std::string(DTypeName(opt.config().param_dtype));
  const FlatLayout& l = opt.layout();
  info.align_elems = l.align_elems;
  info.total_elems = l.total_elems;
  info.shard_elems = l.shard_elems;
  info.tensor_elems = l.tensor_elems;
  info.chunk_bytes = chunk_bytes;
  for (uint32_t i = 0; i < opt.params().size(); ++i) {
    info.tensors.push_back({.name = opt.params()[i].name,
                            .group = opt.param_group(i),
                            .offset_elems = l.tensors[i].offset_elems,
                            .elems = l.tensors[i].elems,
                            .shape = shapes.empty() ? std::nullopt : std::optional(shapes[i])});
  }
  for (uint32_t g = 0; g < opt.num_groups(); ++g) info.groups.push_back(opt.group_hyper(g));
  info.scaler = opt.loss_scaler_state();
  return info;
}

// The saves latest.json keeps, newest first; nullopt when it exists but
// cannot be read (then retention removes nothing: we cannot tell what is
// still wanted).
std::optional<std::vector<std::string>> ReadHistory(Storage& storage, const std::string& dir) {
  const std::string path = JoinPath(dir, kLatest);
  if (!Exists(path)) return std::vector<std::string>{};
  auto text = ReadSmallFile(storage, path);
  if (!text.ok()) return std::nullopt;
  std::optional<Latest> latest = ParseLatest(*text);
  if (!latest) return std::nullopt;
  std::vector<std::string> out = {latest->checkpoint};
  for (const std::string& h : latest->history) {
    if (h != out[0]) out.push_back(h);
  }
  return out;
}

// What retention may remove is only what Strata itself writes into DIR: the
// names below (SaveCheckpoint's save id, RankName's files, AtomicFileWriter's
// temporaries), and a save directory only when everything in it is one of
// its files. Anything else, however it is named, is the user's.
const std::regex kSaveDirName("step-[0-9]{10,}-[0-9a-f]{12}");
const std::regex kSaveFileName(
    "\\.?rank[0-9]{5,}\\.(json|[A-Za-z0-9_]+\\.f32)(\\.tmp-[0-9]+-[0-9a-f]+)?");
const std::regex kManifestName("rank[0-9]{5,}\\.json");
const std::regex kLatestTemporaryName("\\.latest\\.json\\.tmp-[0-9]+-[0-9a-f]+");

bool IsRegularFile(const fs::path& p) {
  std::error_code ec;
  return fs::symlink_status(p, ec).type() == fs::file_type::regular;
}

// A ".latest.json.tmp-<pid>-<n>" file that a crashed publish left.
bool IsStaleLatestTemporary(const fs::path& p) {
  return std::regex_match(p.filename().string(), kLatestTemporaryName) && IsRegularFile(p);
}

// A save directory of Strata's own (see StrataSave below).
struct OwnSave {
  int64_t step = 0;       // from its name
  bool complete = false;  // every rank's manifest, and every file they list, is there
};

// The step in a save's name ("step-0000000012-<id>"); the largest step when
// the digits do not fit (never taken for an older save).
int64_t StepOfSaveName(const std::string& name) {
  int64_t step = 0;
  const char* begin = name.data() + 5;  // after "step-"
  const char* end = name.data() + name.find('-', 5);
  if (std::from_chars(begin, end, step).ec != std::errc()) {
    return std::numeric_limits<int64_t>::max();
  }
  return step;
}

// A directory (not a symlink) named as Strata names a save, holding only a
// save's data files, manifests (of this save id) and their temporaries: a
// published save, or what a crashed one left. A lookalike is logged and
// kept (nullopt).
std::optional<OwnSave> StrataSave(const fs::path& p) {
  const std::string name = p.filename().string();
  if (name.rfind("step-", 0) != 0) return std::nullopt;
  auto keep = [&](std::string_view why) -> std::optional<OwnSave> {
    LogDebug(fmt::format("checkpoint retention: {} is not removed: {}", p.string(), why));
    return std::nullopt;
  };
  std::error_code ec;
  if (!std::regex_match(name, kSaveDirName)) {
    return keep("not a name Strata gives a save (step-<10 digits>-<12 hex digits>)");
  }
  if (fs::symlink_status(p, ec).type() != fs::file_type::directory) {
    return keep("not a directory");
  }
  std::set<std::string> manifests;
  std::map<std::string, uint64_t> present;  // file -> bytes
  std::map<std::string, uint64_t> listed;   // the data files the manifests list
  int64_t world_size = 0;
  for (const auto& e : fs::directory_iterator(p, ec)) {
    const std::string file = e.path().filename().string();
    if (!std::regex_match(file, kSaveFileName) || !IsRegularFile(e.path())) {
      return keep(fmt::format("it holds {}, which is not a file Strata writes into a save", file));
    }
    std::error_code size_ec;
    present[file] = fs::file_size(e.path(), size_ec);
    if (std::regex_match(file, kManifestName)) {
      std::ifstream in(e.path());
      const std::string text((std::istreambuf_iterator<char>(in)),
                             std::istreambuf_iterator<char>());
      const json j = ParseJsonBounded<json>(text);
      // value() throws on a member of another type: compare as JSON instead.
      if (!j.is_object() || !j.contains("format") ||
          j["format"] != std::string(kCheckpointFormatName) || !j.contains("save_id") ||
          j["save_id"] != name) {
        return keep(fmt::format("{} is not a manifest of save {}", file, name));
      }
      manifests.insert(file);
      if (j.contains("files") && j["files"].is_array()) {
        for (const json& f : j["files"]) {
          if (f.is_object() && f.contains("name") && f["name"].is_string() &&
              f.contains("file_bytes") && f["file_bytes"].is_number_unsigned()) {
            listed[f["name"].get<std::string>()] = f["file_bytes"].get<uint64_t>();
          }
        }
      }
      if (j.contains("world_size") && j["world_size"].is_number_unsigned()) {
        world_size = std::max<int64_t>(world_size, static_cast<int64_t>(std::min<uint64_t>(
                                                       j["world_size"].get<uint64_t>(), 1u << 20)));
      }
    }
  }
  if (ec) return keep(fmt::format("cannot list it ({})", ec.message()));
  OwnSave save{.step = StepOfSaveName(name), .complete = world_size > 0};
  for (int64_t r = 0; r < world_size && save.complete; ++r) {
    save.complete = manifests.count(RankName(static_cast<uint32_t>(r)) + ".json") > 0;
  }
  // A removal killed part way (retention's, a crash's) may leave manifests
  // without their data: that does not load, so it is not complete.
  for (const auto& [file, bytes] : listed) {
    const auto it = present.find(file);
    save.complete = save.complete && it != present.end() && it->second == bytes;
  }
  return save;
}

// Removes a save directory of Strata's own, its manifests first: a removal
// stopped part way leaves an incomplete save, which the next retention
// removes (not a manifest that lists missing data).
void RemoveOwnSave(const fs::path& dir, std::error_code& ec) {
  for (const auto& e : fs::directory_iterator(dir, ec)) {
    if (std::regex_match(e.path().filename().string(), kManifestName)) {
      fs::remove(e.path(), ec);
      if (ec) return;
    }
  }
  if (!ec) fs::remove_all(dir, ec);
}

// The name of `save_dir` inside `dir` when it is a directory of `dir`; "".
std::string NameInDir(const std::string& save_dir, const std::string& dir) {
  if (save_dir.empty()) return "";
  const fs::path p(save_dir);
  std::error_code ec;
  if (!fs::is_directory(p, ec) || !fs::equivalent(p.parent_path(), dir, ec) || ec) return "";
  return p.filename().string();
}

// How many saves retention keeps (the new one and the one before it at least).
uint32_t SavesKept(uint32_t keep_checkpoints) { return std::max<uint32_t>(keep_checkpoints, 2); }

// The save this optimizer loaded from, which retention keeps besides the
// newest ones until as many saves as it keeps have followed it into that
// directory: after a rollback to an older save, the new line's saves replace
// it before it may go. "" when it need not be kept.
std::string KeptLoadedSave(const OffloadOptimizer& opt, const SaveOptions& o) {
  const OffloadOptimizer::LoadedSave& loaded = opt.loaded_save();
  return loaded.saves_after + 1 < SavesKept(o.keep_checkpoints) ? loaded.dir : "";
}

// Whether the save this optimizer last loaded is one of `dir`'s.
bool LoadedFrom(const OffloadOptimizer& opt, const std::string& dir) {
  const std::string& loaded = opt.loaded_save().dir;
  std::error_code ec;
  return !loaded.empty() && fs::equivalent(fs::path(loaded).parent_path(), dir, ec);
}

// A save published into the directory of the save loaded from counts
// towards its release (KeptLoadedSave).
void CountSaveAfterLoad(OffloadOptimizer& opt, const std::string& dir) {
  if (!LoadedFrom(opt, dir)) return;
  OffloadOptimizer::LoadedSave loaded = opt.loaded_save();
  ++loaded.saves_after;
  opt.set_loaded_save(std::move(loaded));
}

// Which live optimizer of this process saves into a directory, per rank.
// Two that save into one (a GAN's generator and discriminator) replace each
// other's saves as the current one, retention removes the other's older
// saves, and a load takes whichever came last: a save into a directory that
// another live optimizer of the same rank saved into is refused, unless
// the saver loaded from it (a resume takes the directory over). An entry
// ends with its optimizer (OffloadOptimizer::identity expires).
class DirOwners {
 public:
  struct Owner {
    std::weak_ptr<const void> who;
    int64_t step = 0;  // of its last save there
  };
  static DirOwners& Get() {
    static DirOwners* owners = new DirOwners;  // outlives optimizers destroyed at exit
    return *owners;
  }
  // The other live optimizer that saves into `dir` for `rank`, if any.
  std::optional<Owner> Other(const std::string& dir, int rank,
                             const std::weak_ptr<const void>& me) {
    std::lock_guard lock(mu_);
    std::erase_if(owners_, [](const auto& e) { return e.second.who.expired(); });
    auto it = owners_.find({dir, rank});
    if (it == owners_.end() || Same(it->second.who, me)) return std::nullopt;
    return it->second;
  }
  void Take(const std::string& dir, int rank, std::weak_ptr<const void> me, int64_t step) {
    std::lock_guard lock(mu_);
    owners_[{dir, rank}] = Owner{.who = std::move(me), .step = step};
  }

 private:
  static bool Same(const std::weak_ptr<const void>& a, const std::weak_ptr<const void>& b) {
    return !a.owner_before(b) && !b.owner_before(a);
  }
  std::mutex mu_;
  std::map<std::pair<std::string, int>, Owner> owners_;
};

// DirOwners' key: the directory with its symbolic links resolved, so that
// two spellings of one directory are one.
std::string OwnedDir(const std::string& dir) {
  std::error_code ec;
  const fs::path p = fs::weakly_canonical(fs::absolute(dir, ec), ec);
  return ec ? ComparableDir(dir) : ComparableDir(p.string());
}

// `owned` is OwnedDir(dir).
Status CheckDirOwner(const OffloadOptimizer& opt, const std::string& dir, const std::string& owned,
                     std::string_view op) {
  const auto other = DirOwners::Get().Other(owned, opt.rank(), opt.identity());
  if (!other || LoadedFrom(opt, dir)) return OkStatus();
  const std::string name = fs::path(ComparableDir(dir)).filename().string();
  return FailedPreconditionError(fmt::format(
      "{}: another optimizer of this process saves into {} (its last save there was at step "
      "{}) and is still alive: two optimizers saving into one directory replace each other's "
      "saves as the current one, retention removes the other's older saves, and a load takes "
      "whichever came last. Give each optimizer a directory of its own (for example "
      "{}/generator and {}/discriminator), or destroy the other optimizer first (Python: its "
      "close()). An optimizer that loaded from {} (a resume) may save there; nothing was "
      "written",
      op, dir, other->step, name, name, dir));
}

// Rank 0, after every rank wrote its part, holding the save lock: point
// latest.json at the save, then apply retention. `loaded` is the save the
// optimizer loaded from while retention still keeps it (KeptLoadedSave; ""
// when none).
//
// Retention removes only what it can account for. The new latest.json keeps
// the new save and the newest ones the previous latest.json lists (keep in
// all), plus `loaded`. Of the other saves in
// DIR it removes the incomplete ones (a crash's or a failed save's
// leftovers) and the complete ones the previous latest.json listed, except
// a save of a later step than a kept one (a rollback's, or one copied
// back). A complete save it cannot account for (not listed: copied in, or
// listed by a latest.json restored from a backup) is kept with a warning;
// so is everything when every save the previous latest.json lists is gone.
Status Publish(Storage& storage, const std::string& dir, const CheckpointInfo& info, uint32_t keep,
               const std::string& loaded) {
  std::vector<std::string> history = {info.save_id};
  const std::optional<std::vector<std::string>> old = ReadHistory(storage, dir);
  const std::vector<std::string> listed = old.value_or(std::vector<std::string>{});
  bool any_listed_exists = false;
  for (const std::string& h : listed) {
    if (h == info.save_id || !Exists(JoinPath(dir, h))) continue;
    any_listed_exists = true;
    if (history.size() < SavesKept(keep)) history.push_back(h);
  }
  // A save later than these (by step) is never removed: a rollback's, or
  // one copied back.
  int64_t oldest_kept = info.step;
  for (const std::string& h : history) oldest_kept = std::min(oldest_kept, StepOfSaveName(h));
  const std::string loaded_name = NameInDir(loaded, dir);
  if (!loaded_name.empty() &&
      std::find(history.begin(), history.end(), loaded_name) == history.end()) {
    history.push_back(loaded_name);
  }
  STRATA_RETURN_IF_ERROR((WriteFileAtomically(storage, JoinPath(dir, kLatest),
                                              LatestJson(info, history).dump(2) + "\n"))
                             .WithContext("publish " + info.save_id));
  // Retention: the published file no longer needs anything else. Failures
  // only cost disk space, so they are warnings.
  auto is_in = [](const std::vector<std::string>& v, const std::string& name) {
    return std::find(v.begin(), v.end(), name) != v.end();
  };
  // Everything retention does not remove and does not list, to name it.
  std::vector<std::string> unaccounted;
  std::vector<std::pair<fs::path, std::string>> remove;  // and why
  std::error_code ec;
  for (const auto& entry : fs::directory_iterator(dir, ec)) {
    const std::string name = entry.path().filename().string();
    if (is_in(history, name)) continue;
    // A latest.json temporary a crash left (no other save runs: we hold the lock).
    if (IsStaleLatestTemporary(entry.path())) {
      remove.emplace_back(entry.path(), "a temporary a crashed publish left");
      continue;
    }
    // Nothing else but Strata's own saves: DIR may hold the user's files,
    // named step-* or not.
    const std::optional<OwnSave> save = StrataSave(entry.path());
    if (!save) continue;
    if (!save->complete) {
      remove.emplace_back(entry.path(), "an incomplete save: a crashed or failed save's files");
    } else if (save->step > oldest_kept) {
      unaccounted.push_back(
          fmt::format("{} (step {}, later than a save the rule keeps)", name, save->step));
    } else if (!is_in(listed, name)) {
      unaccounted.push_back(fmt::format("{} (not listed in {})", name, kLatest));
    } else {
      remove.emplace_back(entry.path(),
                          fmt::format("step {}: older than the saves kept", save->step));
    }
  }
  std::sort(unaccounted.begin(), unaccounted.end());
  if (!old || (!listed.empty() && !any_listed_exists)) {
    // What is still wanted cannot be told: nothing is removed.
    for (const auto& [p, why] : remove) unaccounted.push_back(p.filename().string());
    std::sort(unaccounted.begin(), unaccounted.end());
    LogWarning(fmt::format(
        "checkpoint retention: the previous {}/{} {}, so no old save is removed{}; remove "
        "unwanted step-* directories by hand",
        dir, kLatest,
        !old ? "was unreadable"
             : fmt::format("lists only saves that do not exist ({}; restored from a backup?)",
                           fmt::join(listed, ", ")),
        unaccounted.empty() ? "" : fmt::format(" (kept: {})", fmt::join(unaccounted, ", "))));
    return OkStatus();
  }
  for (const auto& [p, why] : remove) {
    std::error_code rm;
    if (fs::symlink_status(p, rm).type() == fs::file_type::directory) {
      RemoveOwnSave(p, rm);
    } else {
      fs::remove(p, rm);  // a latest.json temporary
    }
    if (rm) {
      LogWarning(
          fmt::format("checkpoint retention: remove {} ({}): {}", p.string(), why, rm.message()));
    } else {
      LogInfo(fmt::format("checkpoint retention: removed {} ({})", p.string(), why));
    }
  }
  if (!unaccounted.empty()) {
    LogWarning(fmt::format(
        "checkpoint retention: kept {} in {} besides the saves {} lists ({}): retention never "
        "removes a complete save it cannot account for; remove {} by hand when no longer wanted",
        fmt::join(unaccounted, ", "), dir, kLatest, fmt::join(history, ", "),
        unaccounted.size() == 1 ? "it" : "them"));
  }
  return OkStatus();
}

// ---- A failed save removes what it wrote -------------------------------------------
//
// Only after every rank agreed that the save failed (so no rank still writes
// into the save's directory, and rank 0 still holds the lock): each rank
// removes its own files there, through the storage; then, once all ranks
// have (an all-reduce), the directory itself if it is empty. The directory is
// new (its id was just drawn), so nothing in it is a previous save's or the
// user's; rmdir never removes a directory something else was put into.

// This rank's files in `save_dir`: data files, manifest, and temporaries a
// writer could not remove ("rankRRRRR.*" and ".rankRRRRR.*.tmp-*"). The
// first failure; a missing directory is not one.
Status RemoveRankFiles(Storage& storage, const std::string& save_dir, uint32_t rank) {
  const std::string own = RankName(rank) + ".";
  std::vector<std::string> paths;
  std::error_code ec;
  fs::directory_iterator it(save_dir, ec);
  for (; !ec && it != fs::directory_iterator(); it.increment(ec)) {
    const std::string name = it->path().filename().string();
    const bool mine = name.rfind(own, 0) == 0 || name.rfind("." + own, 0) == 0;
    if (mine && std::regex_match(name, kSaveFileName) && IsRegularFile(it->path())) {
      paths.push_back(it->path().string());
    }
  }
  if (ec && ec != std::errc::no_such_file_or_directory) {
    return ErrnoError(ec.value(), "list " + save_dir);
  }
  // The manifest first: what a failed removal leaves is then an incomplete
  // save, which the next save's retention removes.
  std::stable_partition(paths.begin(), paths.end(),
                        [](const std::string& p) { return p.ends_with(".json"); });
  Status first;
  for (const std::string& path : paths) {
    Status s = storage.Remove(path);
    if (!s.ok() && s.code() != StatusCode::kNotFound && first.ok()) first = std::move(s);
  }
  return first;
}

// Every rank calls it (one all-reduce). OK when nothing of the save is left.
Status RemoveFailedSave(Collective& coll, Storage& storage, const std::string& save_dir,
                        uint32_t rank) {
  Status own = RemoveRankFiles(storage, save_dir, rank);
  // Only a barrier. Should it fail, the rmdir below is still safe: it fails
  // on files another rank has not removed yet.
  coll.CountFailures(own).status().IgnoreError();
  std::error_code ec;
  fs::remove(save_dir, ec);  // false without error when another rank removed it first
  if (!own.ok()) return own;
  if (ec) return ErrnoError(ec.value(), "remove directory " + save_dir);
  return OkStatus();
}

// `error` as it was (code and message first), noting a failed save
// directory that could not be removed.
Status WithRemoval(Status error, const Status& removed, const std::string& save_dir) {
  if (removed.ok()) return error;
  return Status(error.code(),
                fmt::format("{}; the partial save directory {} could not be removed ({}): remove "
                            "it by hand, or the next successful save's retention removes it",
                            error.message(), save_dir, removed.message()));
}

// Whether DIR/latest.json may name `save_id`: it does, or it cannot be read.
// Not when it is no regular file (a directory): no rename replaced it.
bool LatestMayName(Storage& storage, const std::string& dir, const std::string& save_id) {
  std::error_code ec;
  const fs::file_type type = fs::symlink_status(JoinPath(dir, kLatest), ec).type();
  if (!ec && type != fs::file_type::regular && type != fs::file_type::symlink) return false;
  const std::optional<std::vector<std::string>> history = ReadHistory(storage, dir);
  return !history || (!history->empty() && history->front() == save_id);
}

// This rank's data files and manifest inside `save_dir`.
Status WriteRank(OffloadOptimizer& opt, Storage& storage, const std::string& save_dir,
                 const CheckpointInfo& info, const SaveOptions& o) {
  NotifyCreatingDirectory(save_dir);
  STRATA_RETURN_IF_ERROR(MakeDir(save_dir));
  const uint32_t rank = static_cast<uint32_t>(opt.rank());
  const uint32_t arrays = opt.StateArrayCount();
  if (arrays != info.arrays.size()) {
    return InternalError(fmt::format("the optimizer has {} state arrays; {} are named for {}",
                                     arrays, info.arrays.size(), info.optimizer));
  }
  std::vector<std::unique_ptr<ArrayFile>> files;
  std::vector<std::string> names;
  for (uint32_t a = 0; a < arrays; ++a) {
    names.push_back(fmt::format("{}.{}.f32", RankName(rank), info.arrays[a]));
    STRATA_ASSIGN_OR_RETURN(auto f, ArrayFile::Open(storage, save_dir + "/" + names[a],
                                                    opt.shard().elems() * 4, o));
    files.push_back(std::move(f));
  }
  // The state goes straight into the writers' chunks: host memory stays at
  // those chunks, whatever the sub-group size. NVMe state is read ahead; the
  // arrays' files are written (copied, hashed) on threads of their own.
  ProgressReporter progress(fmt::format("rank {}: save {}", rank, save_dir),
                            opt.shard().elems() * arrays * 4, ProgressUnit::kBytes);
  STRATA_RETURN_IF_ERROR(
      opt.ReadStateInOrder([&](uint32_t i, uint32_t a, std::span<const float> state) -> Status {
        return files[a]->AppendState(opt, i, a, opt.sub_groups()[i].elems(), state, progress);
      }));
  progress.Finish();
  RankManifest manifest{.rank = rank, .shard = opt.shard(), .files = {}};
  for (uint32_t a = 0; a < arrays; ++a) {
    STRATA_ASSIGN_OR_RETURN(CheckpointFile f, files[a]->Finish(info.arrays[a], names[a]));
    manifest.files.push_back(std::move(f));
  }
  files.clear();
  return WriteFileAtomically(storage, save_dir + "/" + RankName(rank) + ".json",
                             SealedManifestJson(info, manifest).dump(1) + "\n");
}

// The flat ranges of the saved layout that `range` of `layout` maps to,
// tensor by tensor: (saved flat begin, elems, offset in range).
struct MappedPiece {
  uint64_t saved_begin = 0;
  uint64_t elems = 0;
  uint64_t at = 0;
};
Result<std::vector<MappedPiece>> MapRange(const CheckpointInfo& info, const FlatLayout& layout,
                                          ElemRange range) {
  STRATA_ASSIGN_OR_RETURN(std::vector<TensorPiece> pieces, PiecesInRange(layout, range));
  std::vector<MappedPiece> out;
  for (const TensorPiece& p : pieces) {
    out.push_back({.saved_begin = info.tensors[p.tensor].offset_elems + p.tensor_offset_elems,
                   .elems = p.elems,
                   .at = p.flat_offset_elems - range.begin});
  }
  return out;
}

// Is this checkpoint one of this optimizer's model? FailedPrecondition
// naming the first difference.
Status CheckSameModel(const CheckpointInfo& info, OffloadOptimizer& opt, const TensorShapes& shapes,
                      const std::string& file) {
  auto other = [&](std::string what) {
    return FailedPreconditionError(fmt::format(
        "{}: {}; the checkpoint was saved from another model (or another registration order): "
        "load it into the model it was saved from",
        file, what));
  };
  const std::vector<std::string> arrays = StateArrayNames(opt.config().optimizer);
  if (info.arrays != arrays) {
    return FailedPreconditionError(fmt::format(
        "{}: the checkpoint holds {} state ({}); this optimizer is {} ({}): configure the "
        "optimizer the checkpoint was saved with",
        file, info.optimizer, fmt::join(info.arrays, ", "),
        OptimizerTypeName(opt.config().optimizer), fmt::join(arrays, ", ")));
  }
  const std::string_view mine = OptimizerTypeName(opt.config().optimizer);
  // Adam and AdamW are one update where no group decays: such a save loads
  // into the other (e.g. one from a DeepSpeed "type": "Adam" config, saved as
  // Adam before that resolved to AdamW).
  auto adam_family = [](std::string_view t) { return t == "Adam" || t == "AdamW"; };
  bool no_decay = adam_family(info.optimizer) && adam_family(mine);
  for (const GroupHyper& g : info.groups) no_decay = no_decay && g.weight_decay == 0;
  for (uint32_t g = 0; g < opt.num_groups(); ++g) {
    no_decay = no_decay && opt.group_hyper(g).weight_decay == 0;
  }
  if (info.optimizer != mine && !no_decay) {
    // Adam and AdamW keep the same arrays, but the moments would go on
    // under another weight decay (L2 in the gradient, or decoupled).
    auto decay = [](std::string_view type) {
      return type == "AdamW"  ? "decoupled weight decay: adam_w_mode true, OffloadAdam(adamw=True)"
             : type == "Adam" ? "L2 weight decay: adam_w_mode false, OffloadAdam(adamw=False)"
                              : "";
    };
    return FailedPreconditionError(fmt::format(
        "{}: the checkpoint was saved by {} ({}); this optimizer is {} ({}): the update would "
        "continue under another rule; configure the optimizer the checkpoint was saved with",
        file, info.optimizer, decay(info.optimizer), mine, decay(mine)));
  }
  if (info.tensors.size() != opt.params().size()) {
    return other(fmt::format("it has {} tensors, this optimizer {}", info.tensors.size(),
                             opt.params().size()));
  }
  if (info.groups.size() != opt.num_groups()) {
    return other(fmt::format("it has {} param groups, this optimizer {}", info.groups.size(),
                             opt.num_groups()));
  }
  std::set<std::string> named, duplicated;
  for (const CheckpointTensor& t : info.tensors) {
    if (!t.name.empty() && !named.insert(t.name).second) duplicated.insert(t.name);
  }
  for (uint32_t i = 0; i < info.tensors.size(); ++i) {
    const CheckpointTensor& t = info.tensors[i];
    const Param& p = opt.params()[i];
    if (t.elems != p.elems) {
      return other(fmt::format("tensor {} ('{}') has {} elems in the checkpoint, {} here", i,
                               t.name, t.elems, p.elems));
    }
    if (t.group != opt.param_group(i)) {
      return other(fmt::format("tensor {} ('{}') is in group {} in the checkpoint, {} here", i,
                               t.name, t.group, opt.param_group(i)));
    }
    // A name the checkpoint gives several tensors (a save made before
    // duplicates were refused) says nothing: such tensors match by index.
    if (!t.name.empty() && !p.name.empty() && t.name != p.name && !duplicated.count(t.name)) {
      return other(
          fmt::format("tensor {} is '{}' in the checkpoint, '{}' here", i, t.name, p.name));
    }
    if (t.shape && !shapes.empty() && *t.shape != shapes[i]) {
      CheckpointTensor here = t;
      here.shape = shapes[i];
      return other(fmt::format("tensor {} ('{}') has shape {} in the checkpoint, {} here", i,
                               t.name, ShapeString(t), ShapeString(here)));
    }
  }
  return OkStatus();
}

// The parts of a save the ranks must agree on (every one the manifests
// share, so that a save they finish loads): the directory, the step, the
// groups' hyperparameters, the loss scaler, and the rest of the manifest
// (the model, the layout, SaveOptions' chunk_bytes and shapes). The last
// ones are digested only when this rank's checks passed (`checked`).
std::vector<AgreedPart> SaveParts(OffloadOptimizer& opt, const std::string& dir,
                                  const SaveOptions& o, bool checked) {
  std::vector<AgreedPart> parts = {
      {.what = "directory", .value = ComparableDir(dir), .compared = ""},
      {.what = "step", .value = fmt::format("{}", opt.step_count()), .compared = ""}};
  json common;
  if (checked) {
    common = CommonPart(SealedManifestJson(InfoOf(opt, "", o.chunk_bytes, o.shapes), {}));
  }
  parts.push_back(
      {.what = "group hyperparameters", .value = common["groups"].dump(), .compared = ""});
  parts.push_back(
      {.what = "loss scaler state", .value = common["loss_scaler"].dump(), .compared = ""});
  for (const char* k : {"groups", "loss_scaler", "step", "save_id"}) common.erase(k);
  std::string shapes = "none";
  if (!o.shapes.empty()) {
    std::vector<std::string> each;
    for (const auto& s : o.shapes) each.push_back(fmt::format("[{}]", fmt::join(s, ", ")));
    shapes = fmt::format("{}", fmt::join(each, ", "));
  }
  parts.push_back(
      {.what = "save options",
       .value = fmt::format("chunk_bytes {} and tensor shapes {}", o.chunk_bytes, shapes),
       .compared = common.dump()});
  return parts;
}

// The error of a part the ranks disagree on, on every rank.
Status SaveDisagreement(const AgreedPart& part, int rank, std::string_view op) {
  if (part.what == "directory") {
    return InvalidArgumentError(fmt::format(
        "{}: rank {} saves into {} while another rank saves into a different directory: every "
        "rank must pass the same directory; nothing was written",
        op, rank, part.value));
  }
  if (part.what == "step") {
    return FailedPreconditionError(fmt::format(
        "{}: rank {} is at step {} while another rank is at a different step (a checkpoint or "
        "state_dict loaded on one rank alone, or a step skipped there?): its files would go "
        "into another save directory; load the same checkpoint on every rank; nothing was "
        "written",
        op, rank, part.value));
  }
  if (part.what == "save options") {
    return InvalidArgumentError(fmt::format(
        "{}: rank {} saves with {} while another rank's differ: pass the same SaveOptions "
        "(chunk_bytes, shapes) on every rank; nothing was written",
        op, rank, part.value));
  }
  return FailedPreconditionError(fmt::format(
      "{}: rank {} saves {} {} while another rank's differ (set on one rank only?): the ranks' "
      "manifests would not agree and the save would not load; set the same on every rank; "
      "nothing was written",
      op, rank, part.what, part.value));
}

}  // namespace

Status SaveCheckpoint(OffloadOptimizer& opt, const std::string& dir, const SaveOptions& o) {
  const std::string op = fmt::format("save checkpoint {} (rank {}, step {})",
                                     dir.empty() ? "''" : dir, opt.rank(), opt.step_count());
  const std::string nothing_written = op + ": nothing was written";
  const std::string owned = OwnedDir(dir);  // DirOwners' key
  // Before the collective and the save lock: a forked child would wait on
  // the parent's threads, or take its lock.
  STRATA_RETURN_IF_ERROR(opt.CheckNotForked(nothing_written));
  STRATA_ASSIGN_OR_RETURN(Collective coll, Collective::Create(opt));
  // This rank's own checks. Their outcome rides in the agreement below, so a
  // rank that refuses never leaves the others waiting in a collective.
  StorageRef storage;
  Status checked = [&]() -> Status {
    // Here and not before the agreement: a rank that returned at once would
    // leave the others waiting in it.
    if (dir.empty()) {
      return InvalidArgumentError(fmt::format(
          "{}: the checkpoint directory is empty; give a directory; nothing was written", op));
    }
    // Nothing is written for a state that mixes two steps.
    STRATA_RETURN_IF_ERROR(opt.CheckStateWhole(op));
    if (o.chunk_bytes == 0 || o.chunk_bytes % kFileAlign != 0) {
      return InvalidArgumentError(
          fmt::format("{}: chunk_bytes {} is not a positive multiple of 4096", op, o.chunk_bytes));
    }
    if (o.chunk_bytes > kMaxCheckpointChunkBytes) {
      return InvalidArgumentError(fmt::format(
          "{}: chunk_bytes {} is more than {} (256 MiB), the largest chunk a checkpoint has; "
          "the default is 1 MiB",
          op, o.chunk_bytes, kMaxCheckpointChunkBytes));
    }
    STRATA_RETURN_IF_ERROR(CheckShapes(opt, o.shapes, op));
    STRATA_RETURN_IF_ERROR(CheckDirOwner(opt, dir, owned, op));
    STRATA_ASSIGN_OR_RETURN(storage, StorageRef::Of(o.storage));
    return OkStatus();
  }();
  // Every rank saves into one directory, at one step, with one set of
  // settings: else each rank's files would go elsewhere, or the manifests
  // would disagree. Nothing is written, and no lock taken, before this.
  const std::vector<AgreedPart> parts = SaveParts(opt, dir, o, checked.ok());
  Result<Agreed> agreed = Agree(coll, checked, parts);
  if (!agreed.ok()) return agreed.status().WithContext(nothing_written);
  // A rank that passed "" says so (its directory reads as the working one).
  if (agreed->differs == 0 && !dir.empty()) return SaveDisagreement(parts[0], opt.rank(), op);
  if (!checked.ok()) return checked;  // it says nothing was written
  if (agreed->any_failed) {
    return FailedPreconditionError(fmt::format(
        "{}: another rank refused the save (its error says why); nothing was written", op));
  }
  if (agreed->differs) {
    return SaveDisagreement(parts[*agreed->differs], opt.rank(), op);
  }
  // Rank 0 holds DIR's save lock from before the first byte until retention
  // is done: a second job saving into DIR stops here, on every rank.
  std::unique_ptr<StorageLock> lock;
  Status locked = OkStatus();
  if (opt.rank() == 0) {
    locked = [&]() -> Status {
      STRATA_RETURN_IF_ERROR(MakeDir(dir));
      auto l = storage.storage->Lock(JoinPath(dir, kSaveLock));
      if (!l.ok() && LockHeldByAnother(l.status())) {
        return FailedPreconditionError(fmt::format(
            "{}; another save into {} is running (another job, or another optimizer of this "
            "process): wait for it to finish, or save into another directory",
            l.status().message(), dir));
      }
      if (!l.ok()) {
        return l.status().WithContext("take the save lock of " + dir);
      }
      lock = std::move(l).value();
      // Publishing replaces latest.json by a rename, which a directory there
      // refuses, and never writes over a symbolic link (AtomicFileWriter):
      // found out only after every rank wrote its part.
      const std::string latest = JoinPath(dir, kLatest);
      std::error_code ec;
      const fs::file_type type = fs::symlink_status(latest, ec).type();
      if (type != fs::file_type::not_found && type != fs::file_type::regular) {
        return FailedPreconditionError(fmt::format(
            "{} is {}, not the file Save writes (it names the current save, and each save "
            "replaces it): move it away{}, or save into another directory",
            latest,
            type == fs::file_type::directory ? "a directory"
            : type == fs::file_type::symlink ? "a symbolic link"
                                             : "not a regular file",
            type == fs::file_type::symlink ? " (or put the file it points to in its place)" : ""));
      }
      return OkStatus();
    }();
  }
  // Every rank learns whether rank 0 holds the lock and, in the same
  // all-reduce, the save's id (rank 0 draws it): every rank writes into the
  // same new directory.
  double lock_and_id[2] = {locked.ok() ? 0.0 : 1.0, 0.0};
  if (opt.rank() == 0) {
    std::random_device rd;
    lock_and_id[1] =
        static_cast<double>(((uint64_t{rd()} << 32) | rd()) & ((uint64_t{1} << 48) - 1));
  }
  if (Status s = coll.AllReduce(lock_and_id, ReduceOp::kMax); !s.ok()) {
    return Collective::Unagreed(locked, s).WithContext(nothing_written);
  }
  if (!locked.ok()) return std::move(locked).WithContext(nothing_written);
  if (lock_and_id[0] > 0) {
    return FailedPreconditionError(fmt::format(
        "{}: rank 0 could not take the save lock of {}; nothing was written; see rank 0's error",
        op, dir));
  }
  const double nonce = lock_and_id[1];
  const std::string save_id =
      fmt::format("step-{:010}-{:012x}", opt.step_count(), static_cast<uint64_t>(nonce));
  const std::string save_dir = JoinPath(dir, save_id);
  const CheckpointInfo info = InfoOf(opt, save_id, o.chunk_bytes, o.shapes);

  const uint32_t rank = static_cast<uint32_t>(opt.rank());
  // The save failed (every rank agreed): this rank's own error, or `others`
  // (Unavailable) where another rank's failed; the save's files are removed.
  auto fail = [&](Status own, std::string others) {
    Status error = !own.ok() ? std::move(own).WithContext(op) : UnavailableError(others);
    return WithRemoval(std::move(error), RemoveFailedSave(coll, *storage.storage, save_dir, rank),
                       save_dir);
  };
  // Without agreement nothing is removed: a rank that saw the all-reduce
  // succeed may go on to publish this save.
  auto unagreed = [&](Status error) {
    return Status(error.code(),
                  fmt::format("{}: {}; {} is left as it is: if {}/{} does not name {}, remove it",
                              op, error.message(), save_dir, dir, kLatest, save_id));
  };
  Status local = WriteRank(opt, *storage.storage, save_dir, info, o);
  Result<int> failed = coll.CountFailures(local);
  if (!failed.ok()) return unagreed(failed.status());
  if (*failed > 0) {
    return fail(std::move(local),
                fmt::format("{}: {} other rank(s) failed to write their part; the previous "
                            "checkpoint stays the current one; see their errors and save again",
                            op, *failed));
  }
  // Rank 0 publishes. A failed publish whose rename happened (the directory
  // fsync after it failed) left latest.json naming this save: then the save
  // is kept, not removed.
  enum class Outcome : int { kPublished = 0, kNotPublished = 1, kMaybePublished = 2 };
  Status published = OkStatus();
  Outcome mine = Outcome::kPublished;
  if (rank == 0) {
    published = Publish(*storage.storage, dir, info, o.keep_checkpoints, KeptLoadedSave(opt, o));
    if (!published.ok()) {
      mine = LatestMayName(*storage.storage, dir, save_id) ? Outcome::kMaybePublished
                                                           : Outcome::kNotPublished;
    }
  }
  Result<double> worst = coll.AllReduce(static_cast<int>(mine), ReduceOp::kMax);
  if (!worst.ok()) return unagreed(Collective::Unagreed(published, worst.status()));
  const auto outcome = static_cast<Outcome>(static_cast<int>(*worst));
  if (outcome != Outcome::kNotPublished) {
    DirOwners::Get().Take(owned, opt.rank(), opt.identity(), opt.step_count());
  }
  if (outcome == Outcome::kPublished) {
    CountSaveAfterLoad(opt, dir);
    return OkStatus();
  }
  if (outcome == Outcome::kMaybePublished) {
    const std::string kept = fmt::format(
        "{} is complete and kept: {}/{} may already name it (the rename happened before the "
        "error) or cannot be read; save again",
        save_dir, dir, kLatest);
    if (!published.ok()) {
      return Status(published.code(), fmt::format("{}: {}; {}", op, published.message(), kept));
    }
    return UnavailableError(
        fmt::format("{}: rank 0 failed to publish {} in {}; {}; see rank 0's error", op, save_id,
                    kLatest, kept));
  }
  return fail(std::move(published),
              fmt::format("{}: rank 0 failed to publish {} in {}; the previous checkpoint stays "
                          "the current one; see rank 0's error and save again",
                          op, save_id, kLatest));
}

Status LoadCheckpoint(OffloadOptimizer& opt, const std::string& dir, const LoadOptions& o) {
  const std::string op =
      fmt::format("load checkpoint {} (rank {})", dir.empty() ? "''" : dir, opt.rank());
  const std::string nothing_loaded = op + ": nothing was loaded";
  STRATA_RETURN_IF_ERROR(opt.CheckNotForked(nothing_loaded));
  STRATA_ASSIGN_OR_RETURN(Collective coll, Collective::Create(opt));
  // A state that Create wrote from the params, on every rank, loses nothing
  // when a failed load overwrites it: ResetStateFromParams writes it again.
  // Its load reads each file once, every chunk checked as it arrives. Any
  // other state stays until every file it needs has passed its checksums.
  double kept[1] = {opt.state_from_params() ? 0.0 : 1.0};
  if (Status s = coll.AllReduce(kept, ReduceOp::kMax); !s.ok()) {
    return std::move(s).WithContext(nothing_loaded);
  }
  const bool one_pass = kept[0] == 0;
  std::unique_ptr<CheckpointReader> reader;
  LossScalerState scaler_state;  // what the optimizer's loss scaler is restored to
  // Phase 1, nothing changes: the checkpoint is complete, ours, and (unless
  // one_pass) intact.
  Status local = [&]() -> Status {
    // In the agreement, as SaveCheckpoint's checks: no rank is left waiting.
    if (dir.empty()) {
      // WithContext below says which load.
      return InvalidArgumentError(
          "the checkpoint directory is empty; give the directory given to Save");
    }
    ReaderOptions reading{.storage = o.storage,
                          .queue_depth = o.queue_depth,
                          .direct = o.direct,
                          .duplicate_names = DuplicateNames::kAllow,
                          .threads = opt.config().threads};
    reading.verify_what = fmt::format("rank {}: verify {}", opt.rank(), dir);
    STRATA_ASSIGN_OR_RETURN(reader, CheckpointReader::Open(dir, reading));
    const CheckpointInfo& info = reader->info();
    const std::string manifest = info.save_dir + "/" + RankName(0) + ".json";
    STRATA_RETURN_IF_ERROR(CheckShapes(opt, o.shapes, "load checkpoint"));
    STRATA_RETURN_IF_ERROR(CheckSameModel(info, opt, o.shapes, manifest));
    if (const auto dup = DuplicateKey(info); dup && opt.rank() == 0) {
      LogWarning(fmt::format(
          "load checkpoint {}: tensors {} and {} are both named '{}' (saved before duplicate "
          "names were refused); the tensors are loaded by index, and the next save records "
          "this optimizer's names",
          info.save_dir, dup->first, dup->second, KeyName(info, dup->second)));
    }
    if (info.world_size != static_cast<uint32_t>(opt.world_size()) &&
        o.reshard == Reshard::kForbid) {
      return FailedPreconditionError(fmt::format(
          "{}: saved with {} ranks, loading with {} and resharding is off: run with {} ranks, "
          "or load with Reshard::kAllow",
          manifest, info.world_size, opt.world_size(), info.world_size));
    }
    // The saved ranks whose files hold this rank's shard: verify all of them.
    STRATA_ASSIGN_OR_RETURN(std::vector<MappedPiece> pieces,
                            MapRange(info, opt.layout(), opt.shard()));
    std::set<uint32_t> need;
    for (const MappedPiece& p : pieces) {
      if (p.elems == 0) continue;
      for (uint64_t r = p.saved_begin / info.shard_elems;
           r <= (p.saved_begin + p.elems - 1) / info.shard_elems; ++r) {
        need.insert(static_cast<uint32_t>(r));
      }
    }
    const std::vector<uint32_t> ranks(need.begin(), need.end());
    STRATA_RETURN_IF_ERROR(one_pass ? reader->CheckFiles(ranks) : reader->Verify(ranks));
    // The reader's validator checked the counters and hyperparameters; what
    // is left depends on this optimizer's config (a static loss scale).
    STRATA_ASSIGN_OR_RETURN(LossScaler scaler, LossScaler::Create(opt.config().loss_scaler));
    scaler_state = info.scaler;
    const std::string_view here = DTypeName(opt.config().param_dtype);
    if (info.param_dtype != here && (info.param_dtype == "fp16" || here == "fp16")) {
      // A scale of fp16 training means nothing to another dtype, and a
      // bf16/fp32 save's scale (1) would leave fp16 gradients unscaled, most
      // of them flushed to zero: the scaler starts as the config says.
      scaler_state = scaler.state();
      if (opt.rank() == 0) {
        LogInfo(fmt::format(
            "load checkpoint {}: saved with {} params, this optimizer's are {}: the loss scaler "
            "starts from this config's initial scale {} (the saved scale {} is not carried over); "
            "the step count {} is kept",
            info.save_dir, info.param_dtype, here, scaler_state.scale, info.scaler.scale,
            info.step));
      }
    }
    STRATA_RETURN_IF_ERROR((scaler.Restore(scaler_state)).WithContext(manifest + ": loss_scaler"));
    return OkStatus();
  }();
  // Every rank loads one save: the ranks passed the same directory and
  // resolved the same save in it (latest.json may have changed between their
  // reads), all in the all-reduce that says whether every rank verified.
  const std::vector<AgreedPart> parts = {
      {.what = "directory", .value = ComparableDir(dir), .compared = ""},
      {.what = "save", .value = local.ok() ? reader->info().save_id : "", .compared = ""}};
  Result<Agreed> agreed = Agree(coll, local, parts);
  if (!agreed.ok()) return agreed.status().WithContext(nothing_loaded);
  if (agreed->differs == 0 && !dir.empty()) {
    return InvalidArgumentError(fmt::format(
        "{}: rank {} loads from {} while another rank loads from a different directory: every "
        "rank must pass the same directory; nothing was loaded",
        op, opt.rank(), parts[0].value));
  }
  if (!local.ok()) return std::move(local).WithContext(nothing_loaded);
  if (agreed->any_failed) {
    return FailedPreconditionError(fmt::format(
        "{}: another rank could not verify the checkpoint; nothing was loaded on any rank; see "
        "its error",
        op));
  }
  if (agreed->differs) {
    return FailedPreconditionError(fmt::format(
        "{}: rank {} resolved {} to {} while another rank resolved another save ({}/{} changed "
        "between the ranks' reads: is a save into {} running?): load again, or load one save "
        "by its directory; nothing was loaded",
        op, opt.rank(), dir, parts[1].value, dir, kLatest, dir));
  }

  // Phase 2: the state, sub-group by sub-group.
  const CheckpointInfo& info = reader->info();
  const uint32_t arrays = opt.StateArrayCount();
  Status applied = [&]() -> Status {
    ProgressReporter progress(fmt::format("rank {}: load {}", opt.rank(), dir),
                              opt.shard().elems() * arrays * 4, ProgressUnit::kBytes);
    // Straight into the state (a device sub-group's through pieces of
    // kStatePieceElems): no buffer of a sub-group's state. An NVMe
    // sub-group's write runs while the next one is read from the checkpoint.
    // The arrays are filled on threads of their own: each call maps its range.
    STRATA_RETURN_IF_ERROR(opt.WriteStateInOrder(
        [&](uint32_t i, uint32_t a, uint64_t begin, std::span<float> out) -> Status {
          STRATA_ASSIGN_OR_RETURN(std::vector<MappedPiece> pieces,
                                  MapRange(info, opt.layout(), opt.sub_groups()[i]));
          const uint64_t end = begin + out.size();
          uint64_t done = begin;  // the pieces come in order: zero only the padding between
          for (const MappedPiece& p : pieces) {
            const uint64_t lo = std::max(begin, p.at), hi = std::min(end, p.at + p.elems);
            if (lo >= hi) continue;
            std::fill(out.begin() + (done - begin), out.begin() + (lo - begin), 0.0f);
            const uint64_t from = p.saved_begin + (lo - p.at);
            STRATA_RETURN_IF_ERROR(
                reader->ReadFlat(a, {from, from + (hi - lo)}, out.subspan(lo - begin, hi - lo)));
            done = hi;
          }
          std::fill(out.begin() + (done - begin), out.end(), 0.0f);
          progress.Add(out.size_bytes());
          return OkStatus();
        },
        kStatePieceElems));
    progress.Finish();
    return OkStatus();
  }();
  Result<int> failed = coll.CountFailures(applied);
  if (!failed.ok() || !applied.ok() || *failed > 0) {
    Status error = !applied.ok()  ? std::move(applied)
                   : !failed.ok() ? failed.status()
                                  : FailedPreconditionError(fmt::format(
                                        "{} other rank(s) failed while loading", *failed));
    Status reset = one_pass ? opt.ResetStateFromParams() : OkStatus();
    if (one_pass && reset.ok()) {
      return std::move(error).WithContext(
          nothing_loaded + " (the state is again the one Create wrote from the params)");
    }
    std::string partial = op + ": the optimizer state is partly loaded";
    if (!reset.ok()) partial += fmt::format(" ({})", reset.message());
    return std::move(error).WithContext(partial + "; load again, or recreate the optimizer");
  }
  // Every rank holds the saved state: now the counters and hyperparameters
  // (checked in phase 1), so that a failure above left them as they were.
  Status counters = opt.RestoreCounters(info.step, scaler_state);
  for (uint32_t g = 0; g < info.groups.size() && counters.ok(); ++g) {
    counters = opt.SetGroupHyper(g, info.groups[g]);
  }
  if (!counters.ok()) {
    return std::move(counters).WithContext(
        op +
        ": the state is loaded but not the step count, loss scale and hyperparameters; "
        "load again");
  }
  // Retention keeps the save the state came from for a while (KeptLoadedSave).
  std::error_code ec;
  const fs::path canonical = fs::canonical(info.save_dir, ec);
  opt.set_loaded_save({.dir = ec ? fs::absolute(info.save_dir, ec).string() : canonical.string()});
  if (o.saved_shapes != nullptr) {
    o.saved_shapes->clear();
    for (const CheckpointTensor& t : info.tensors) {
      if (!t.shape) {
        o.saved_shapes->clear();
        break;
      }
      o.saved_shapes->push_back(*t.shape);
    }
  }
  // Phase 3 (a collective): the trainer's tensors from the loaded masters.
  return (opt.UploadParams()).WithContext(op);
}

}  // namespace strata
