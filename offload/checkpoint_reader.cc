// CheckpointReader: opens a checkpoint (latest.json or a save directory),
// checks every manifest with the one validator (checkpoint_format.cc), and
// reads flat ranges of the arrays chunk by chunk, each chunk verified against
// its checksum as it arrives.
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <tbb/blocked_range.h>
#include <tbb/parallel_for.h>
#include <tbb/task_arena.h>
#include <xxhash.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <functional>
#include <mutex>
#include <thread>

#include "offload/checkpoint_internal.h"
#include "runtime/host_region.h"
#include "runtime/json_parse.h"
#include "runtime/units.h"

namespace strata {

using namespace checkpoint_internal;  // NOLINT: this file's own helpers

namespace {

// Chunk reads in flight per array: queue_depth within [1, kMaxReadDepth]
// (deeper gains a drive nothing and holds a chunk of memory per request).
constexpr uint32_t kMaxReadDepth = 64;
uint32_t ReadDepth(const ReaderOptions& o) {
  return std::clamp<uint32_t>(o.queue_depth, 1, kMaxReadDepth);
}

// The save directories in `dir` (step-*), oldest first, for a message.
std::string SavesIn(const std::string& dir) {
  std::vector<std::string> saves;
  std::error_code ec;
  for (const auto& e : std::filesystem::directory_iterator(dir, ec)) {
    const std::string name = e.path().filename().string();
    std::error_code is;
    if (name.rfind("step-", 0) == 0 && e.is_directory(is)) saves.push_back(name);
  }
  if (saves.empty()) return "none";
  std::sort(saves.begin(), saves.end());
  return fmt::format("{}", fmt::join(saves, ", "));
}

// fn(0) ... fn(n - 1) on up to `threads` threads (<= 0: as many as the
// hardware has), all of them; with one thread in order on the calling
// thread until one fails. The lowest array's error (as StateTiers's
// ForEachArray, which runs on the optimizer's threads).
Status ForEachArray(uint32_t n, int threads, const std::function<Status(uint32_t)>& fn) {
  const int hardware = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  const int width = std::min<int>(static_cast<int>(n), threads <= 0 ? hardware : threads);
  if (width <= 1) {
    for (uint32_t a = 0; a < n; ++a) STRATA_RETURN_IF_ERROR(fn(a));
    return OkStatus();
  }
  std::vector<Status> results(n);
  tbb::task_arena arena(width);
  arena.execute([&] {
    tbb::parallel_for(tbb::blocked_range<uint32_t>(0, n, 1), [&](const auto& r) {
      for (uint32_t a = r.begin(); a < r.end(); ++a) results[a] = fn(a);
    });
  });
  for (Status& s : results) {
    if (!s.ok()) return std::move(s);
  }
  return OkStatus();
}

}  // namespace

// ---- CheckpointReader --------------------------------------------------------------

// What reads one array's files: its chunk buffers, the read stream and the
// last chunk read (sub-groups and tensors share boundary chunks). One per
// array, so the arrays can be read on threads of their own.
//
// The stream: chunks [next, submitted) of `file` are in flight or read,
// chunk c in slot c % depth. A read call keeps up to depth chunks in flight,
// also past its end (read-ahead), so that the next call, when it goes on
// where this one ended (the next tensor, the next sub-group), finds them
// read or on the way instead of starting the queue again. A call elsewhere
// drains the stream first.
//
// The lane also owns the one data file of its array it has open: moving to
// another rank's file drains the stream and closes the previous file, so a
// reader holds at most one file per array open however many ranks the save
// has (600 files of a 200-rank Adam save, two descriptors each on io_uring,
// ran out of descriptors). Reads go through the files rank by rank, so the
// read-ahead within a file is kept.
struct Lane {
  HostRegion region;                       // bufs and cache, one chunk each
  std::vector<std::span<std::byte>> bufs;  // per slot
  std::vector<IoRequest> reqs;
  std::vector<uint8_t> done;               // per slot: its request was reaped
  std::vector<std::span<std::byte>> into;  // per slot: where its chunk is read
  File* file = nullptr;                    // nullptr: no stream
  uint64_t next = 0, submitted = 0;
  std::span<std::byte> cache;
  int64_t cache_rank = -1, cache_chunk = -1;
  uint64_t cache_bytes = 0;
  std::unique_ptr<File> open;  // the file of rank open_rank; the stream's, if any
  int64_t open_rank = -1;

  // Waits for what the stream has in flight (its buffers are then free);
  // the stream is empty afterwards.
  void Drain() {
    while (file != nullptr && file->InFlight() > 0) {
      std::vector<IoRequest*> got(bufs.size());
      if (!file->Reap(got, file->InFlight()).ok()) break;
    }
    file = nullptr;
    next = submitted = 0;
  }
};

struct CheckpointReader::Impl {
  StorageRef storage;
  ReaderOptions options;
  const CheckpointInfo* info = nullptr;
  std::mutex mu;                             // lanes (their contents belong to one array's reader)
  std::vector<std::unique_ptr<Lane>> lanes;  // per array, made at its first read

  ~Impl() {
    for (auto& lane : lanes) {
      if (lane != nullptr) lane->Drain();  // before the files and buffers go
    }
  }

  std::string PathOf(uint32_t rank, uint32_t array) const {
    return info->save_dir + "/" + info->ranks[rank].files[array].name;
  }
  // Opens the data file and checks its size against the manifest: NotFound
  // (missing) or DataLoss (truncated, longer) naming it.
  Result<std::unique_ptr<File>> OpenChecked(uint32_t rank, uint32_t array);
  // The lane's open file of `rank` (its array's), opened when the lane has
  // another rank's open, which is then drained and closed.
  Result<File*> FileOf(Lane& lane, uint32_t rank, uint32_t array);
  // The array's lane, made at its first use: ResourceExhausted when its
  // buffers cannot be had.
  Result<Lane*> LaneOf(uint32_t array);
  // Reads chunks [first, last) of a file in order, queue_depth in flight,
  // checks each chunk's checksum and hands it to `fn`. A chunk for which
  // `place(c, bytes)` gives memory (kFileAlign-aligned; bytes is a multiple
  // of it) is read straight there instead of into a buffer of ours: fn then
  // sees it in place. Such memory holds the chunk's bytes even when its
  // checksum fails. Calls for different arrays may run concurrently.
  using Place = std::function<std::byte*(uint64_t chunk, uint64_t bytes)>;
  Status ReadChunks(uint32_t rank, uint32_t array, uint64_t first, uint64_t last,
                    const std::function<void(uint64_t, std::span<const std::byte>)>& fn,
                    const Place& place = {});
};

Result<Lane*> CheckpointReader::Impl::LaneOf(uint32_t array) {
  std::lock_guard<std::mutex> lock(mu);
  std::unique_ptr<Lane>& lane = lanes[array];
  if (lane == nullptr) {
    auto made = std::make_unique<Lane>();
    const uint32_t depth = ReadDepth(options);
    // Chunk sizes are multiples of kFileAlign (the format's), so each
    // buffer starts aligned for O_DIRECT.
    const uint64_t cb = info->chunk_bytes;
    Result<HostRegion> region = HostRegion::Map((depth + 1) * cb);
    if (!region.ok()) {
      return ResourceExhaustedError(fmt::format(
          "read checkpoint {}: no memory for the read buffers of array '{}' ({} chunks of "
          "chunk_bytes {}: queue_depth + 1); lower the reader's queue_depth or free memory",
          info->save_dir, info->arrays[array], depth + 1, FormatBytes(info->chunk_bytes)));
    }
    made->region = std::move(*region);
    for (uint32_t i = 0; i < depth; ++i)
      made->bufs.push_back(made->region.span().subspan(i * cb, cb));
    made->cache = made->region.span().subspan(depth * cb, cb);
    made->reqs.resize(depth);
    made->done.resize(depth);
    made->into.resize(depth);
    lane = std::move(made);
  }
  return lane.get();
}

Result<std::unique_ptr<File>> CheckpointReader::Impl::OpenChecked(uint32_t rank, uint32_t array) {
  const std::string path = PathOf(rank, array);
  auto opened = storage.storage->Open(path, {.direct = options.direct,
                                             .queue_depth = ReadDepth(options),
                                             .access = FileAccess::kReadOnly});
  if (!opened.ok()) {
    if (opened.status().code() == StatusCode::kNotFound) {
      return NotFoundError(fmt::format(
          "{} is missing (rank {}'s {} of save {}): copy every file of the save directory, or "
          "load an earlier checkpoint",
          path, rank, info->arrays[array], info->save_id));
    }
    return opened.status();
  }
  std::unique_ptr<File> file = std::move(*opened);
  STRATA_ASSIGN_OR_RETURN(uint64_t size, file->SizeBytes());
  const uint64_t want = info->ranks[rank].files[array].file_bytes;
  if (size != want) {
    return DataLossError(fmt::format(
        "{} has {} bytes; its manifest says {}: the file is {} (an interrupted copy?); restore "
        "it or load an earlier checkpoint",
        path, size, want, size < want ? "truncated" : "longer than written"));
  }
  return file;
}

Result<File*> CheckpointReader::Impl::FileOf(Lane& lane, uint32_t rank, uint32_t array) {
  if (lane.open != nullptr && lane.open_rank == rank) return lane.open.get();
  lane.Drain();
  lane.open.reset();
  lane.open_rank = -1;
  STRATA_ASSIGN_OR_RETURN(lane.open, OpenChecked(rank, array));
  lane.open_rank = rank;
  return lane.open.get();
}

Status CheckpointReader::Impl::ReadChunks(
    uint32_t rank, uint32_t array, uint64_t first, uint64_t last,
    const std::function<void(uint64_t, std::span<const std::byte>)>& fn, const Place& place) {
  const CheckpointFile& meta = info->ranks[rank].files[array];
  const uint64_t cb = info->chunk_bytes;
  auto chunk_len = [&](uint64_t c) { return std::min(cb, meta.file_bytes - c * cb); };
  STRATA_ASSIGN_OR_RETURN(Lane * lane_of, LaneOf(array));
  Lane& lane = *lane_of;
  if (first < last && lane.cache_rank == rank && lane.cache_chunk == static_cast<int64_t>(first)) {
    fn(first, lane.cache.first(lane.cache_bytes));
    ++first;
  }
  if (first >= last) return OkStatus();
  STRATA_ASSIGN_OR_RETURN(File * file, FileOf(lane, rank, array));
  const std::string path = PathOf(rank, array);
  std::vector<IoRequest>& reqs = lane.reqs;
  const uint64_t depth = lane.bufs.size();
  const uint64_t chunks = meta.chunk_xxh3.size();  // the file's
  if (lane.file != file || lane.next != first) lane.Drain();
  if (lane.file == nullptr) {
    lane.file = file;
    lane.next = lane.submitted = first;
  }
  Status error;
  for (uint64_t next = first; next < last && error.ok(); ++next) {
    // Up to depth chunks in flight, past `last` too (into our buffers).
    while (lane.submitted < chunks && lane.submitted - next < depth) {
      const uint64_t c = lane.submitted;
      const uint64_t slot = c % depth;
      const uint64_t len = chunk_len(c);
      std::byte* at = c < last && place && len % kFileAlign == 0 ? place(c, len) : nullptr;
      if (at != nullptr && reinterpret_cast<uintptr_t>(at) % kFileAlign != 0) at = nullptr;
      lane.into[slot] = at != nullptr ? std::span<std::byte>(at, len) : lane.bufs[slot].first(len);
      reqs[slot] = IoRequest::Read(c * cb, lane.into[slot], slot);
      lane.done[slot] = 0;
      if (Status s = file->Submit({&reqs[slot], 1}); !s.ok()) {
        error = std::move(s);
        break;
      }
      ++lane.submitted;
    }
    if (!error.ok()) break;
    const uint64_t slot = next % depth;
    while (!lane.done[slot]) {
      std::vector<IoRequest*> got(depth);
      auto n = file->Reap(got, 1);
      if (!n.ok()) {  // the backend broke: nothing more is reaped
        lane.file = nullptr;
        return n.status();
      }
      for (size_t k = 0; k < *n; ++k) lane.done[got[k]->user_data] = 1;
    }
    lane.next = next + 1;
    if (!reqs[slot].status.ok()) {
      error = reqs[slot].status;
      break;
    }
    std::span<const std::byte> data = lane.into[slot];
    const uint64_t h = XXH3_64bits(data.data(), data.size());
    if (h != meta.chunk_xxh3[next]) {
      error = DataLossError(fmt::format(
          "{}: chunk {} (bytes {}+{}) fails its checksum (XXH3 {}, manifest {}): the file is "
          "corrupt; restore it from a copy or load an earlier checkpoint",
          path, next, next * cb, data.size(), Hex(h), Hex(meta.chunk_xxh3[next])));
      break;
    }
    fn(next, data);
    if (next + 1 == last) {
      std::memcpy(lane.cache.data(), data.data(), data.size());
      lane.cache_rank = rank;
      lane.cache_chunk = static_cast<int64_t>(next);
      lane.cache_bytes = data.size();
    }
  }
  // A failed call may leave chunks in flight into the caller's memory: wait
  // for them. After a whole call only chunks past `last`, which go into our
  // buffers, are in flight: they stay, for the next call.
  if (!error.ok()) lane.Drain();
  return error;
}

CheckpointReader::CheckpointReader(CheckpointInfo info, std::unique_ptr<Impl> impl)
    : info_(std::move(info)), impl_(std::move(impl)) {
  impl_->info = &info_;
}
CheckpointReader::~CheckpointReader() = default;

Result<std::unique_ptr<CheckpointReader>> CheckpointReader::Open(const std::string& dir,
                                                                 const ReaderOptions& options) {
  auto impl = std::make_unique<Impl>();
  impl->options = options;
  STRATA_ASSIGN_OR_RETURN(impl->storage, StorageRef::Of(options.storage));
  Storage& storage = *impl->storage.storage;
  CheckpointInfo info;
  info.root = dir;
  namespace fs = std::filesystem;
  std::error_code ec;
  if (dir.empty()) {
    return InvalidArgumentError(
        "open checkpoint '': the checkpoint directory is empty; give the directory given to "
        "Save");
  }
  STRATA_ASSIGN_OR_RETURN(const bool exists, Present(dir, "open checkpoint " + dir));
  if (!exists) {
    return NotFoundError(fmt::format(
        "open checkpoint {}: no such directory; pass the directory given to Save", dir));
  }
  if (!fs::is_directory(dir, ec)) {
    return NotFoundError(fmt::format(
        "open checkpoint {}: not a directory; a checkpoint is the directory given to Save "
        "(it holds latest.json and step-* folders)",
        dir));
  }
  const std::string latest = JoinPath(dir, kLatest);
  STRATA_ASSIGN_OR_RETURN(const bool has_latest, Present(latest, "open checkpoint " + dir));
  if (has_latest) {
    if (!fs::is_regular_file(latest, ec)) {
      return FailedPreconditionError(fmt::format(
          "open checkpoint: {} is not a file ({}), so it names no save: move it away (the next "
          "save writes a new one), or load one of the saves in {} by its directory ({})",
          latest, fs::is_directory(latest, ec) ? "a directory" : "not a regular file", dir,
          SavesIn(dir)));
    }
    STRATA_ASSIGN_OR_RETURN(std::string text, ReadSmallFile(storage, latest));
    const std::optional<Latest> parsed = ParseLatest(text);
    if (!parsed) {
      return DataLossError(fmt::format(
          "open checkpoint: {} is not valid (no \"checkpoint\" string): the pointer file is "
          "damaged; open one of the step-* directories in {} directly",
          latest, dir));
    }
    const std::string name = parsed->checkpoint;
    if (name.empty() || name.find('/') != std::string::npos || name == "." || name == "..") {
      return DataLossError(
          fmt::format("open checkpoint: {} names '{}', not a save directory", latest, name));
    }
    info.save_dir = JoinPath(dir, name);
    STRATA_ASSIGN_OR_RETURN(const bool there, Present(info.save_dir, "open checkpoint " + dir));
    if (!there) {
      return NotFoundError(fmt::format(
          "open checkpoint: {} names {}, which does not exist in {} (saves there: {}): load one "
          "of them by its directory, or restore {}",
          latest, name, dir, SavesIn(dir), name));
    }
  } else {
    STRATA_ASSIGN_OR_RETURN(const bool is_save, Present(JoinPath(dir, RankName(0) + ".json"),
                                                        "open checkpoint " + dir));
    if (!is_save) {
      // What a save killed before it finished leaves: say that, not "not a checkpoint".
      const std::string base =
          std::filesystem::path(WithoutTrailingSlashes(dir)).filename().string();
      if (base.rfind("step-", 0) == 0) {
        return NotFoundError(fmt::format(
            "open checkpoint {}: no {}.json: this save did not finish (killed or failed while "
            "saving); load another save, or the directory given to Save",
            dir, RankName(0)));
      }
      if (const std::string saves = SavesIn(dir); saves != "none") {
        return NotFoundError(fmt::format(
            "open checkpoint {}: no {}: no save here finished (a save killed or failed before "
            "publishing left {}); save again (the next save removes what it left)",
            dir, kLatest, saves));
      }
      return NotFoundError(fmt::format(
          "open checkpoint {}: no {} and no {}.json: this is not a checkpoint; pass the "
          "directory given to Save, or one of its step-* directories",
          dir, kLatest, RankName(0)));
    }
    info.save_dir = WithoutTrailingSlashes(dir);
  }
  json common0;
  for (uint32_t r = 0;; ++r) {
    const std::string path = info.save_dir + "/" + RankName(r) + ".json";
    STRATA_ASSIGN_OR_RETURN(const bool present, Present(path, "open checkpoint"));
    if (!present) {
      return NotFoundError(fmt::format(
          "open checkpoint: {} is missing{}: copy every rank's files into the save directory, "
          "or load an earlier checkpoint",
          path, r == 0 ? "" : fmt::format(" (the save has {} ranks)", info.world_size)));
    }
    STRATA_ASSIGN_OR_RETURN(std::string text, ReadSmallFile(storage, path));
    bool too_deep = false;
    json j = ParseJsonBounded<json>(text, &too_deep);
    auto bad = [&](std::string_view why) {
      return DataLossError(fmt::format(
          "open checkpoint: {} is not a valid manifest ({}): restore it from a copy or load "
          "an earlier checkpoint",
          path, why));
    };
    if (too_deep) {
      return bad(
          fmt::format("nested deeper than {} levels; a manifest nests a few", kMaxJsonDepth));
    }
    if (j.is_discarded() || !j.is_object()) return bad("not JSON; truncated or overwritten?");
    if (!j.contains("format") || j["format"] != kCheckpointFormatName ||
        !j.contains("format_version") || !j["format_version"].is_number_integer()) {
      return bad("no \"format\": \"strata-checkpoint\" with a format_version");
    }
    const int version = j["format_version"].get<int>();
    if (version != kCheckpointFormatVersion) {
      return FailedPreconditionError(fmt::format(
          "open checkpoint: {} has format version {}; this build reads version {}: {}", path,
          version, kCheckpointFormatVersion,
          version > kCheckpointFormatVersion ? "load it with a newer strata"
                                             : "convert it with the strata that wrote it"));
    }
    RankManifest rank;
    Status parsed;
    try {
      parsed = ParseManifest(j, info, rank);
    } catch (const json::exception& e) {
      return bad(e.what());
    }
    if (!parsed.ok()) return bad(parsed.message());
    info.format_version = version;
    if (r == 0) {
      common0 = CommonPart(j);
      if (Status s = ValidateCommon(info); !s.ok()) return bad(s.message());
    } else if (CommonPart(j) != common0) {
      return DataLossError(fmt::format(
          "open checkpoint: {} does not agree with {}.json (save id, step, layout or "
          "hyperparameters differ): the directory mixes files of different saves; restore it "
          "or load an earlier checkpoint",
          path, RankName(0)));
    }
    if (rank.rank != r) return bad(fmt::format("it says rank {}", rank.rank));
    if (Status s = ValidateRank(info, rank); !s.ok()) return bad(s.message());
    info.ranks.push_back(std::move(rank));
    if (info.ranks.size() == info.world_size) break;
  }
  if (options.duplicate_names == DuplicateNames::kRefuse) {
    if (const auto dup = DuplicateKey(info)) {
      return FailedPreconditionError(fmt::format(
          "open checkpoint {}: tensors {} and {} are both named '{}' (a save made before "
          "duplicate param names were refused): a state_dict or export keyed by name would keep "
          "only one of them. Load it into an optimizer of the same params with unique names "
          "(load matches tensors by index) and save again; that save exports",
          info.save_dir, dup->first, dup->second, KeyName(info, dup->second)));
    }
  }
  impl->lanes.resize(info.arrays.size());
  return std::unique_ptr<CheckpointReader>(new CheckpointReader(std::move(info), std::move(impl)));
}

Status CheckpointReader::ReadFlat(uint32_t array, ElemRange range, std::span<float> out) {
  if (array >= info_.arrays.size() || range.end < range.begin || range.end > info_.total_elems ||
      out.size() != range.elems()) {
    return OutOfRangeError(fmt::format(
        "read checkpoint {}: array {} range [{}, {}) into {} floats; the save has {} arrays of "
        "{} elems",
        info_.save_dir, array, range.begin, range.end, out.size(), info_.arrays.size(),
        info_.total_elems));
  }
  const uint64_t cb = info_.chunk_bytes;
  auto* dst = reinterpret_cast<std::byte*>(out.data());
  while (range.begin < range.end) {
    const uint32_t r = static_cast<uint32_t>(range.begin / info_.shard_elems);
    const uint64_t shard_end = (uint64_t{r} + 1) * info_.shard_elems;
    const uint64_t end = std::min(range.end, shard_end);
    // No wrap: Open refused a layout past kMaxCheckpointElems.
    const uint64_t lo = (range.begin - uint64_t{r} * info_.shard_elems) * 4;
    const uint64_t hi = (end - uint64_t{r} * info_.shard_elems) * 4;
    // Whole chunks go straight into `out` where it is aligned: no copy.
    STRATA_RETURN_IF_ERROR(impl_->ReadChunks(
        r, array, lo / cb, (hi + cb - 1) / cb,
        [&](uint64_t c, std::span<const std::byte> data) {
          const uint64_t c0 = c * cb;
          const uint64_t from = std::max(lo, c0);
          const uint64_t to = std::min(hi, c0 + data.size());
          std::byte* target = dst + (from - lo);
          if (data.data() + (from - c0) != target) {
            std::memcpy(target, data.data() + (from - c0), to - from);
          }
        },
        [&](uint64_t c, uint64_t bytes) -> std::byte* {
          return c * cb >= lo && c * cb + bytes <= hi ? dst + (c * cb - lo) : nullptr;
        }));
    dst += hi - lo;
    range.begin = end;
  }
  return OkStatus();
}

Status CheckpointReader::ReadTensor(uint32_t array, uint32_t tensor, uint64_t offset_elems,
                                    std::span<float> out) {
  if (tensor >= info_.tensors.size() || offset_elems + out.size() > info_.tensors[tensor].elems) {
    return OutOfRangeError(
        fmt::format("read checkpoint {}: tensor {} elems [{}, +{}) is outside "
                    "the save's {} tensors",
                    info_.save_dir, tensor, offset_elems, out.size(), info_.tensors.size()));
  }
  const uint64_t begin = info_.tensors[tensor].offset_elems + offset_elems;
  return ReadFlat(array, {begin, begin + out.size()}, out);
}

Status CheckpointReader::CheckFiles(std::span<const uint32_t> ranks) {
  std::vector<uint32_t> all;
  if (ranks.empty()) {
    for (uint32_t r = 0; r < info_.world_size; ++r) all.push_back(r);
    ranks = all;
  }
  for (uint32_t r : ranks) {
    for (uint32_t a = 0; a < info_.arrays.size(); ++a) {
      // Opened and closed again: a save of many ranks has more files than
      // a process may hold open.
      STRATA_RETURN_IF_ERROR(
          impl_->OpenChecked(r, a).status().WithContext("check checkpoint " + info_.save_dir));
    }
  }
  return OkStatus();
}

Status CheckpointReader::Verify(std::span<const uint32_t> ranks) {
  std::vector<uint32_t> all;
  if (ranks.empty()) {
    for (uint32_t r = 0; r < info_.world_size; ++r) all.push_back(r);
    ranks = all;
  }
  // The arrays on threads of their own (each has its lane and files): the
  // two checksums per byte are CPU work that one thread does at about a
  // drive's rate. The first error in array order is returned.
  const uint32_t arrays = static_cast<uint32_t>(info_.arrays.size());
  uint64_t total = 0;
  for (uint32_t r : ranks) {
    for (const CheckpointFile& f : info_.ranks[r].files) total += f.file_bytes;
  }
  const ReaderOptions& o = impl_->options;
  ProgressReporter progress(o.verify_what.empty() ? "verify " + info_.save_dir : o.verify_what,
                            total, ProgressUnit::kBytes, o.progress);
  auto verify_array = [&](uint32_t a) {
    XXH3_state_t* state = XXH3_createState();
    Status result;
    for (uint32_t r : ranks) {
      if (!result.ok()) break;
      const CheckpointFile& f = info_.ranks[r].files[a];
      XXH3_64bits_reset(state);
      // Whole files go around the cache and the stream: a chunk read
      // earlier would hide a change on disk.
      Result<Lane*> lane = impl_->LaneOf(a);
      if (!lane.ok()) {
        result = lane.status();
        break;
      }
      (*lane)->cache_chunk = -1;
      (*lane)->Drain();
      result = impl_->ReadChunks(r, a, 0, f.chunk_xxh3.size(),
                                 [&](uint64_t, std::span<const std::byte> data) {
                                   XXH3_64bits_update(state, data.data(), data.size());
                                   progress.Add(data.size());
                                 });
      if (result.ok() && XXH3_64bits_digest(state) != f.xxh3) {
        result = DataLossError(fmt::format(
            "{}: the file checksum (XXH3 {}) is not the manifest's ({}): the file is corrupt; "
            "restore it or load an earlier checkpoint",
            impl_->PathOf(r, a), Hex(XXH3_64bits_digest(state)), Hex(f.xxh3)));
      }
    }
    XXH3_freeState(state);
    return result;
  };
  STRATA_RETURN_IF_ERROR(ForEachArray(arrays, o.threads, verify_array)
                             .WithContext("verify checkpoint " + info_.save_dir));
  progress.Finish();
  return OkStatus();
}

}  // namespace strata
