// Checkpoints: the format is in docs/checkpoint.md; the comments here say why
// the code is shaped as it is.
//
// Data files are written in chunk_bytes pieces (a multiple of 4096) so every
// write is aligned for O_DIRECT whatever the sub-group boundaries are, and the
// same pieces are the unit of the chunk checksums: a reader verifies exactly
// what it read. Small files (manifests, latest.json) go through the same
// Storage, buffered, so a fault-injecting storage sees every byte we write.
#include "offload/checkpoint.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <unistd.h>
#include <xxhash.h>

#include <algorithm>
#include <bit>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <map>
#include <nlohmann/json.hpp>
#include <optional>
#include <random>
#include <set>
#include <utility>

#include "runtime/device.h"
#include "runtime/log.h"
#include "runtime/units.h"

namespace strata {
namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;

static_assert(std::endian::native == std::endian::little,
              "checkpoint data files are little-endian fp32, written as in memory");

constexpr uint64_t kFileAlign = 4096;
constexpr std::string_view kLatest = "latest.json";

uint64_t RoundUp(uint64_t v, uint64_t a) { return (v + a - 1) / a * a; }

std::string Hex(uint64_t v) { return fmt::format("{:016x}", v); }

Result<uint64_t> ParseHex(const std::string& s) {
  if (s.size() != 16) return InvalidArgumentError("'" + s + "' is not 16 hex digits");
  char* end = nullptr;
  const uint64_t v = std::strtoull(s.c_str(), &end, 16);
  if (end != s.c_str() + s.size()) return InvalidArgumentError("'" + s + "' is not hex");
  return v;
}

std::string RankName(uint32_t rank) { return fmt::format("rank{:05}", rank); }

// 4096-aligned host memory for O_DIRECT.
class AlignedBytes {
 public:
  AlignedBytes() = default;
  explicit AlignedBytes(size_t bytes)
      : data_(static_cast<std::byte*>(std::aligned_alloc(kFileAlign, RoundUp(bytes, kFileAlign)))),
        size_(bytes) {
    STRATA_CHECK(data_ != nullptr) << "aligned_alloc of " << bytes << " bytes";
  }
  AlignedBytes(AlignedBytes&& o) noexcept { *this = std::move(o); }
  AlignedBytes& operator=(AlignedBytes&& o) noexcept {
    std::swap(data_, o.data_);
    std::swap(size_, o.size_);
    return *this;
  }
  ~AlignedBytes() { std::free(data_); }
  std::span<std::byte> span() const { return {data_, size_}; }

 private:
  std::byte* data_ = nullptr;
  size_t size_ = 0;
};

Status FsyncDir(const std::string& dir) {
  const int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) return ErrnoError(errno, "open directory " + dir);
  Status s;
  if (::fsync(fd) != 0) s = ErrnoError(errno, "fsync directory " + dir);
  ::close(fd);
  return s;
}

Status MakeDir(const std::string& dir) {
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (ec) {
    return ErrnoError(ec.value(), "create directory " + dir);
  }
  return OkStatus();
}

// One synchronous request.
Status RunIo(File& file, IoRequest request) {
  STRATA_RETURN_IF_ERROR(file.Submit({&request, 1}));
  IoRequest* done = nullptr;
  STRATA_ASSIGN_OR_RETURN(size_t n, file.Reap({&done, 1}, 1));
  if (n != 1) return InternalError("reap " + file.info().path + ": no completion");
  return done->status;
}

// tmp name, write, fsync, rename, fsync the directory: readers see the old
// file or the whole new one, never a part.
Status WriteFileAtomic(Storage& storage, const std::string& dir, const std::string& name,
                       const std::string& text) {
  const std::string path = dir + "/" + name;
  const std::string tmp = path + ".tmp";
  {
    STRATA_ASSIGN_OR_RETURN(
        auto file, storage.Open(tmp, {.create = FileCreate::kCreate, .direct = DirectIo::kOff}));
    STRATA_RETURN_IF_ERROR(file->Resize(0));
    std::string copy = text;
    STRATA_RETURN_IF_ERROR(RunIo(
        *file, IoRequest::Write(0, std::as_writable_bytes(std::span(copy.data(), copy.size())))));
    STRATA_RETURN_IF_ERROR(file->Sync());
  }
  std::error_code ec;
  fs::rename(tmp, path, ec);
  if (ec) return ErrnoError(ec.value(), "rename " + tmp + " to " + path);
  return FsyncDir(dir);
}

Result<std::string> ReadSmallFile(Storage& storage, const std::string& path) {
  STRATA_ASSIGN_OR_RETURN(auto file, storage.Open(path, {.direct = DirectIo::kOff}));
  STRATA_ASSIGN_OR_RETURN(uint64_t size, file->SizeBytes());
  std::string text(size, '\0');
  if (size > 0) {
    STRATA_RETURN_IF_ERROR(
        RunIo(*file, IoRequest::Read(0, std::as_writable_bytes(std::span(text.data(), size)))));
  }
  return text;
}

bool Exists(const std::string& path) {
  std::error_code ec;
  return fs::exists(path, ec);
}

// The storage the caller gave, or one made for this call.
struct StorageRef {
  std::unique_ptr<Storage> owned;
  Storage* storage = nullptr;
  static Result<StorageRef> Of(Storage* given) {
    StorageRef r;
    if (given != nullptr) {
      r.storage = given;
    } else {
      STRATA_ASSIGN_OR_RETURN(r.owned, CreateStorage({}));
      r.storage = r.owned.get();
    }
    return r;
  }
};

// Small all-reduces over the optimizer's communicator, on a stream of our
// own (the local backend wants one stream per rank; nothing else runs on it).
class Collective {
 public:
  static Result<Collective> Create(OffloadOptimizer& opt) {
    Collective c;
    c.comm_ = opt.comm();
    if (c.comm_ == nullptr || opt.world_size() == 1) return c;
    c.device_ = &opt.device();
    STRATA_ASSIGN_OR_RETURN(c.stream_, c.device_->CreateStream());
    STRATA_ASSIGN_OR_RETURN(c.buf_, c.device_->Allocate(sizeof(double)));
    STRATA_ASSIGN_OR_RETURN(c.host_, c.device_->AllocateHost(sizeof(double)));
    return c;
  }
  Result<double> AllReduce(double value, ReduceOp op) {
    if (device_ == nullptr) return value;
    double* host = static_cast<double*>(host_.data());
    *host = value;
    STRATA_RETURN_IF_ERROR(
        device_->CopyAsync(buf_.data(), host, sizeof(double), CopyKind::kHostToDevice, stream_));
    STRATA_RETURN_IF_ERROR(comm_->AllReduce(buf_.data(), buf_.data(), 1, DType::kF64, op, stream_));
    STRATA_RETURN_IF_ERROR(
        device_->CopyAsync(host, buf_.data(), sizeof(double), CopyKind::kDeviceToHost, stream_));
    STRATA_RETURN_IF_ERROR(device_->StreamSynchronize(stream_));
    return *host;
  }
  // How many ranks report a failure.
  Result<int> CountFailures(const Status& local) {
    STRATA_ASSIGN_OR_RETURN(double n, AllReduce(local.ok() ? 0.0 : 1.0, ReduceOp::kSum));
    return static_cast<int>(n);
  }

 private:
  Communicator* comm_ = nullptr;
  Device* device_ = nullptr;
  Stream stream_;
  DeviceBuffer buf_;
  HostAllocation host_;  // pinned: the CUDA backend copies from pinned memory only
};

// ---- Writing one data file ---------------------------------------------------

// Appends fp32 values to a file in chunk_bytes writes, queue_depth in flight,
// hashing each chunk and the whole file on the way.
class ArrayWriter {
 public:
  static Result<std::unique_ptr<ArrayWriter>> Open(Storage& storage, const std::string& dir,
                                                   const std::string& name, const SaveOptions& o) {
    auto w = std::unique_ptr<ArrayWriter>(new ArrayWriter());
    w->path_ = dir + "/" + name;
    w->meta_.name = name;
    w->chunk_bytes_ = o.chunk_bytes;
    STRATA_ASSIGN_OR_RETURN(w->file_, storage.Open(w->path_, {.create = FileCreate::kCreate,
                                                              .direct = o.direct,
                                                              .queue_depth = o.queue_depth}));
    STRATA_RETURN_IF_ERROR(w->file_->Resize(0));
    const uint32_t depth = std::max<uint32_t>(o.queue_depth, 1);
    for (uint32_t i = 0; i < depth; ++i) {
      w->bufs_.emplace_back(o.chunk_bytes);
      w->free_.push_back(i);
    }
    w->reqs_.resize(depth);
    w->hash_ = XXH3_createState();
    XXH3_64bits_reset(w->hash_);
    return w;
  }
  ~ArrayWriter() {
    Drain().IgnoreError();
    XXH3_freeState(hash_);
  }

  Status Append(std::span<const float> values) {
    auto bytes = std::as_bytes(values);
    while (!bytes.empty()) {
      if (cur_ < 0) {
        STRATA_RETURN_IF_ERROR(TakeBuffer());
      }
      const size_t n = std::min<size_t>(bytes.size(), chunk_bytes_ - fill_);
      std::memcpy(bufs_[cur_].span().data() + fill_, bytes.data(), n);
      fill_ += n;
      payload_ += n;
      bytes = bytes.subspan(n);
      if (fill_ == chunk_bytes_) STRATA_RETURN_IF_ERROR(Flush());
    }
    return OkStatus();
  }

  // Writes the last chunk (zero-padded to 4096), waits for every write and
  // fsyncs. Returns what the manifest says about the file.
  Result<CheckpointFile> Finish() {
    if (cur_ >= 0) {
      const size_t padded = RoundUp(fill_, kFileAlign);
      std::memset(bufs_[cur_].span().data() + fill_, 0, padded - fill_);
      fill_ = padded;
      STRATA_RETURN_IF_ERROR(Flush());
    }
    STRATA_RETURN_IF_ERROR(Drain());
    STRATA_RETURN_IF_ERROR(first_error_);
    STRATA_RETURN_IF_ERROR((file_->Sync()).WithContext("fsync " + path_));
    meta_.payload_bytes = payload_;
    meta_.file_bytes = offset_;
    meta_.xxh3 = XXH3_64bits_digest(hash_);
    return meta_;
  }

 private:
  ArrayWriter() = default;

  Status TakeBuffer() {
    while (free_.empty()) STRATA_RETURN_IF_ERROR(ReapSome(1));
    cur_ = static_cast<int>(free_.back());
    free_.pop_back();
    fill_ = 0;
    return first_error_;
  }
  Status Flush() {
    std::span<std::byte> data = bufs_[cur_].span().first(fill_);
    meta_.chunk_xxh3.push_back(XXH3_64bits(data.data(), data.size()));
    XXH3_64bits_update(hash_, data.data(), data.size());
    reqs_[cur_] = IoRequest::Write(offset_, data, static_cast<uint64_t>(cur_));
    offset_ += fill_;
    const int slot = cur_;
    cur_ = -1;
    fill_ = 0;
    Status s = file_->Submit({&reqs_[slot], 1});
    if (!s.ok()) {
      free_.push_back(static_cast<uint32_t>(slot));
      return std::move(s).WithContext("write " + path_);
    }
    return OkStatus();
  }
  Status ReapSome(size_t min) {
    std::vector<IoRequest*> done(reqs_.size());
    STRATA_ASSIGN_OR_RETURN(size_t n, file_->Reap(done, min));
    for (size_t k = 0; k < n; ++k) {
      if (!done[k]->status.ok() && first_error_.ok()) first_error_ = done[k]->status;
      free_.push_back(static_cast<uint32_t>(done[k]->user_data));
    }
    return OkStatus();
  }
  Status Drain() {
    while (file_ && file_->InFlight() > 0) STRATA_RETURN_IF_ERROR(ReapSome(file_->InFlight()));
    return OkStatus();
  }

  std::string path_;
  CheckpointFile meta_;
  uint64_t chunk_bytes_ = 0;
  std::unique_ptr<File> file_;
  std::vector<AlignedBytes> bufs_;
  std::vector<IoRequest> reqs_;
  std::vector<uint32_t> free_;
  int cur_ = -1;
  size_t fill_ = 0;
  uint64_t offset_ = 0;
  uint64_t payload_ = 0;
  XXH3_state_t* hash_ = nullptr;
  Status first_error_;
};

// ---- Manifests ------------------------------------------------------------------

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
    tensors.push_back({{"name", t.name},
                       {"group", t.group},
                       {"offset_elems", t.offset_elems},
                       {"elems", t.elems}});
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
json SealManifest(json j) {
  j["manifest_xxh3"] = Hex(ManifestHash(j));
  return j;
}

// Parses one rank's manifest into `info` (the common part) and `rank`.
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
  info.world_size = j.at("world_size").get<uint32_t>();
  info.step = j.at("step").get<int64_t>();
  info.optimizer = j.at("optimizer").get<std::string>();
  if (j.at("state_dtype").get<std::string>() != "f32") {
    return InvalidArgumentError("state_dtype is " + j.at("state_dtype").get<std::string>() +
                                "; this build reads f32");
  }
  info.param_dtype = j.at("param_dtype").get<std::string>();
  info.arrays = j.at("arrays").get<std::vector<std::string>>();
  const json& l = j.at("layout");
  info.align_elems = l.at("align_elems").get<uint64_t>();
  info.total_elems = l.at("total_elems").get<uint64_t>();
  info.shard_elems = l.at("shard_elems").get<uint64_t>();
  info.tensor_elems = l.at("tensor_elems").get<uint64_t>();
  info.tensors.clear();
  for (const json& t : j.at("tensors")) {
    info.tensors.push_back({.name = t.at("name").get<std::string>(),
                            .group = t.at("group").get<uint32_t>(),
                            .offset_elems = t.at("offset_elems").get<uint64_t>(),
                            .elems = t.at("elems").get<uint64_t>()});
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
  info.scaler = {.scale = s.at("scale").get<double>(),
                 .iteration = s.at("iteration").get<int64_t>(),
                 .last_overflow_iteration = s.at("last_overflow_iteration").get<int64_t>(),
                 .hysteresis_left = s.at("hysteresis_left").get<uint32_t>()};
  info.chunk_bytes = j.at("chunk_bytes").get<uint64_t>();
  if (j.at("checksum").get<std::string>() != "xxh3-64") {
    return InvalidArgumentError("checksum is " + j.at("checksum").get<std::string>() +
                                "; this build knows xxh3-64");
  }
  rank.rank = j.at("rank").get<uint32_t>();
  rank.shard = {j.at("shard").at("begin").get<uint64_t>(), j.at("shard").at("end").get<uint64_t>()};
  rank.files.clear();
  for (const json& f : j.at("files")) {
    CheckpointFile cf;
    cf.array = f.at("array").get<std::string>();
    cf.name = f.at("name").get<std::string>();
    cf.payload_bytes = f.at("payload_bytes").get<uint64_t>();
    cf.file_bytes = f.at("file_bytes").get<uint64_t>();
    STRATA_ASSIGN_OR_RETURN(cf.xxh3, ParseHex(f.at("xxh3").get<std::string>()));
    for (const json& c : f.at("chunks_xxh3")) {
      STRATA_ASSIGN_OR_RETURN(uint64_t h, ParseHex(c.get<std::string>()));
      cf.chunk_xxh3.push_back(h);
    }
    rank.files.push_back(std::move(cf));
  }
  return OkStatus();
}

// The parts every rank's manifest must agree on.
json CommonPart(json j) {
  for (const char* k : {"rank", "shard", "files", "manifest_xxh3"}) j.erase(k);
  return j;
}

// Checks a manifest against the layout it claims (so a reader can trust
// offsets and sizes).
Status CheckManifestGeometry(const CheckpointInfo& info, const RankManifest& rank) {
  if (info.chunk_bytes == 0 || info.chunk_bytes % kFileAlign != 0) {
    return InvalidArgumentError(
        fmt::format("chunk_bytes {} is not a positive multiple of 4096", info.chunk_bytes));
  }
  if (info.arrays.empty() || info.arrays[0] != "master") {
    return InvalidArgumentError("arrays must start with \"master\"");
  }
  const ElemRange want{uint64_t{rank.rank} * info.shard_elems,
                       uint64_t{rank.rank + 1} * info.shard_elems};
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
    if (f.array != info.arrays[a] || f.payload_bytes != info.shard_elems * 4 ||
        f.file_bytes != RoundUp(f.payload_bytes, kFileAlign) ||
        f.chunk_xxh3.size() != (f.file_bytes + info.chunk_bytes - 1) / info.chunk_bytes ||
        f.name.find('/') != std::string::npos) {
      return InvalidArgumentError(fmt::format(
          "file entry {} ({}) does not match the layout (array {}, {} payload bytes, {} file "
          "bytes, {} chunks)",
          a, f.name, f.array, f.payload_bytes, f.file_bytes, f.chunk_xxh3.size()));
    }
  }
  return OkStatus();
}

Status CheckLayout(const CheckpointInfo& info) {
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
  for (const CheckpointTensor& t : info.tensors) {
    if (t.group >= info.groups.size()) {
      return InvalidArgumentError(
          fmt::format("tensor '{}' is in group {} of {}", t.name, t.group, info.groups.size()));
    }
  }
  return OkStatus();
}

// The manifest's checkpoint description of a live optimizer.
CheckpointInfo InfoOf(OffloadOptimizer& opt, const std::string& save_id, uint64_t chunk_bytes) {
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
                            .elems = l.tensors[i].elems});
  }
  for (uint32_t g = 0; g < opt.num_groups(); ++g) info.groups.push_back(opt.group_hyper(g));
  info.scaler = opt.loss_scaler_state();
  return info;
}

// The saves latest.json keeps, newest first; nullopt when it exists but
// cannot be read (then retention removes nothing: we cannot tell what is
// still wanted).
std::optional<std::vector<std::string>> ReadHistory(Storage& storage, const std::string& dir) {
  const std::string path = dir + "/" + std::string(kLatest);
  if (!Exists(path)) return std::vector<std::string>{};
  auto text = ReadSmallFile(storage, path);
  if (!text.ok()) return std::nullopt;
  json j = json::parse(*text, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded() || !j.is_object() || !j.contains("checkpoint") ||
      !j["checkpoint"].is_string()) {
    return std::nullopt;
  }
  std::vector<std::string> out = {j["checkpoint"].get<std::string>()};
  if (j.contains("history") && j["history"].is_array()) {
    for (const json& h : j["history"]) {
      if (h.is_string() && h.get<std::string>() != out[0]) out.push_back(h.get<std::string>());
    }
  }
  return out;
}

// Rank 0, after every rank wrote its part: point latest.json at the save,
// then apply retention.
Status Publish(Storage& storage, const std::string& dir, const CheckpointInfo& info,
               uint32_t keep) {
  std::vector<std::string> history = {info.save_id};
  const std::optional<std::vector<std::string>> old = ReadHistory(storage, dir);
  for (const std::string& h : old.value_or(std::vector<std::string>{})) {
    if (history.size() >= std::max<uint32_t>(keep, 2)) break;
    if (h != info.save_id && Exists(dir + "/" + h)) history.push_back(h);
  }
  const json latest = {
      {"format", kCheckpointFormatName}, {"format_version", kCheckpointFormatVersion},
      {"checkpoint", info.save_id},      {"step", info.step},
      {"world_size", info.world_size},   {"history", history}};
  STRATA_RETURN_IF_ERROR(
      (WriteFileAtomic(storage, dir, std::string(kLatest), latest.dump(2) + "\n"))
          .WithContext("publish " + info.save_id));
  // Retention: the published file no longer needs anything else. Failures
  // only cost disk space, so they are warnings.
  if (!old) {
    LogWarning(
        fmt::format("checkpoint retention: the previous {}/{} was unreadable, so no old "
                    "save is removed; remove unwanted step-* directories by hand",
                    dir, kLatest));
    return OkStatus();
  }
  std::error_code ec;
  for (const auto& entry : fs::directory_iterator(dir, ec)) {
    const std::string name = entry.path().filename().string();
    if (name.rfind("step-", 0) != 0) continue;
    if (std::find(history.begin(), history.end(), name) != history.end()) continue;
    std::error_code rm;
    fs::remove_all(entry.path(), rm);
    if (rm)
      LogWarning(
          fmt::format("checkpoint retention: remove {}: {}", entry.path().string(), rm.message()));
  }
  return OkStatus();
}

// This rank's data files and manifest inside `save_dir`.
Status WriteRank(OffloadOptimizer& opt, Storage& storage, const std::string& save_dir,
                 const CheckpointInfo& info, const SaveOptions& o) {
  STRATA_RETURN_IF_ERROR(MakeDir(save_dir));
  const uint32_t rank = static_cast<uint32_t>(opt.rank());
  const uint32_t arrays = opt.StateArrayCount();
  if (arrays != info.arrays.size()) {
    return InternalError(fmt::format("the optimizer has {} state arrays; {} are named for {}",
                                     arrays, info.arrays.size(), info.optimizer));
  }
  std::vector<std::unique_ptr<ArrayWriter>> writers;
  for (uint32_t a = 0; a < arrays; ++a) {
    STRATA_ASSIGN_OR_RETURN(
        auto w, ArrayWriter::Open(storage, save_dir,
                                  fmt::format("{}.{}.f32", RankName(rank), info.arrays[a]), o));
    writers.push_back(std::move(w));
  }
  // One sub-group's state at a time: host memory stays at the largest
  // sub-group plus the writers' chunks.
  uint64_t max_elems = 0;
  for (const ElemRange& r : opt.sub_groups()) max_elems = std::max(max_elems, r.elems());
  std::vector<float> state(max_elems * arrays);
  for (uint32_t i = 0; i < opt.sub_groups().size(); ++i) {
    const uint64_t elems = opt.sub_groups()[i].elems();
    std::span<float> s(state.data(), elems * arrays);
    STRATA_RETURN_IF_ERROR(opt.ReadState(i, s));
    for (uint32_t a = 0; a < arrays; ++a) {
      STRATA_RETURN_IF_ERROR(writers[a]->Append(s.subspan(a * elems, elems)));
    }
  }
  RankManifest manifest{.rank = rank, .shard = opt.shard(), .files = {}};
  for (uint32_t a = 0; a < arrays; ++a) {
    STRATA_ASSIGN_OR_RETURN(CheckpointFile f, writers[a]->Finish());
    f.array = info.arrays[a];
    manifest.files.push_back(std::move(f));
  }
  writers.clear();
  STRATA_RETURN_IF_ERROR(FsyncDir(save_dir));
  return WriteFileAtomic(storage, save_dir, RankName(rank) + ".json",
                         SealManifest(ManifestJson(info, manifest)).dump(1) + "\n");
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
Status CheckSameModel(const CheckpointInfo& info, OffloadOptimizer& opt, const std::string& file) {
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
  if (info.tensors.size() != opt.params().size()) {
    return other(fmt::format("it has {} tensors, this optimizer {}", info.tensors.size(),
                             opt.params().size()));
  }
  if (info.groups.size() != opt.num_groups()) {
    return other(fmt::format("it has {} param groups, this optimizer {}", info.groups.size(),
                             opt.num_groups()));
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
    if (!t.name.empty() && !p.name.empty() && t.name != p.name) {
      return other(
          fmt::format("tensor {} is '{}' in the checkpoint, '{}' here", i, t.name, p.name));
    }
  }
  return OkStatus();
}

}  // namespace

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

// ---- CheckpointReader --------------------------------------------------------------

struct CheckpointReader::Impl {
  StorageRef storage;
  ReaderOptions options;
  const CheckpointInfo* info = nullptr;
  std::map<std::pair<uint32_t, uint32_t>, std::unique_ptr<File>> files;  // (rank, array)
  std::vector<AlignedBytes> bufs;
  std::vector<IoRequest> reqs;
  // The last chunk read (sub-groups and tensors share boundary chunks).
  AlignedBytes cache;
  int64_t cache_rank = -1, cache_array = -1, cache_chunk = -1;
  uint64_t cache_bytes = 0;

  std::string PathOf(uint32_t rank, uint32_t array) const {
    return info->save_dir + "/" + info->ranks[rank].files[array].name;
  }
  Result<File*> FileOf(uint32_t rank, uint32_t array);
  // Reads chunks [first, last) of a file in order, queue_depth in flight,
  // checks each chunk's checksum and hands it to `fn`.
  Status ReadChunks(uint32_t rank, uint32_t array, uint64_t first, uint64_t last,
                    const std::function<void(uint64_t, std::span<const std::byte>)>& fn);
};

Result<File*> CheckpointReader::Impl::FileOf(uint32_t rank, uint32_t array) {
  auto key = std::make_pair(rank, array);
  if (auto it = files.find(key); it != files.end()) return it->second.get();
  const std::string path = PathOf(rank, array);
  auto opened = storage.storage->Open(
      path, {.direct = options.direct, .queue_depth = std::max<uint32_t>(options.queue_depth, 1)});
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
  File* raw = file.get();
  files.emplace(key, std::move(file));
  return raw;
}

Status CheckpointReader::Impl::ReadChunks(
    uint32_t rank, uint32_t array, uint64_t first, uint64_t last,
    const std::function<void(uint64_t, std::span<const std::byte>)>& fn) {
  const CheckpointFile& meta = info->ranks[rank].files[array];
  const uint64_t cb = info->chunk_bytes;
  auto chunk_len = [&](uint64_t c) { return std::min(cb, meta.file_bytes - c * cb); };
  if (first < last && cache_rank == rank && cache_array == array &&
      cache_chunk == static_cast<int64_t>(first)) {
    fn(first, cache.span().first(cache_bytes));
    ++first;
  }
  if (first >= last) return OkStatus();
  STRATA_ASSIGN_OR_RETURN(File * file, FileOf(rank, array));
  const std::string path = PathOf(rank, array);
  const uint64_t depth = bufs.size();
  std::vector<uint8_t> done(depth, 0);
  uint64_t next_submit = first;
  Status error;
  for (uint64_t next = first; next < last && error.ok(); ++next) {
    while (next_submit < last && next_submit - next < depth) {
      const uint64_t slot = next_submit % depth;
      reqs[slot] =
          IoRequest::Read(next_submit * cb, bufs[slot].span().first(chunk_len(next_submit)), slot);
      done[slot] = 0;
      if (Status s = file->Submit({&reqs[slot], 1}); !s.ok()) {
        error = std::move(s);
        break;
      }
      ++next_submit;
    }
    if (!error.ok()) break;
    const uint64_t slot = next % depth;
    while (!done[slot]) {
      std::vector<IoRequest*> got(depth);
      auto n = file->Reap(got, 1);
      if (!n.ok()) return n.status();  // the backend broke: nothing more is reaped
      for (size_t k = 0; k < *n; ++k) done[got[k]->user_data] = 1;
    }
    if (!reqs[slot].status.ok()) {
      error = reqs[slot].status;
      break;
    }
    std::span<const std::byte> data = bufs[slot].span().first(chunk_len(next));
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
      std::memcpy(cache.span().data(), data.data(), data.size());
      cache_rank = rank;
      cache_array = array;
      cache_chunk = static_cast<int64_t>(next);
      cache_bytes = data.size();
    }
  }
  // Requests still in flight use our buffers: wait for them.
  while (file->InFlight() > 0) {
    std::vector<IoRequest*> got(depth);
    if (!file->Reap(got, file->InFlight()).ok()) break;
  }
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
  std::error_code ec;
  if (!fs::is_directory(dir, ec)) {
    return NotFoundError(fmt::format(
        "open checkpoint {}: no such directory; pass the directory given to Save", dir));
  }
  const std::string latest = dir + "/" + std::string(kLatest);
  if (Exists(latest)) {
    STRATA_ASSIGN_OR_RETURN(std::string text, ReadSmallFile(storage, latest));
    json j = json::parse(text, nullptr, /*allow_exceptions=*/false);
    if (j.is_discarded() || !j.is_object() || !j.contains("checkpoint") ||
        !j["checkpoint"].is_string()) {
      return DataLossError(fmt::format(
          "open checkpoint: {} is not valid (no \"checkpoint\" string): the pointer file is "
          "damaged; open one of the step-* directories in {} directly",
          latest, dir));
    }
    const std::string name = j["checkpoint"].get<std::string>();
    if (name.empty() || name.find('/') != std::string::npos || name == "." || name == "..") {
      return DataLossError(
          fmt::format("open checkpoint: {} names '{}', not a save directory", latest, name));
    }
    info.save_dir = dir + "/" + name;
  } else if (Exists(dir + "/" + RankName(0) + ".json")) {
    info.save_dir = dir;
  } else {
    return NotFoundError(
        fmt::format("open checkpoint {}: no {} and no {}.json: this is not a checkpoint; pass the "
                    "directory given to Save, or one of its step-* directories",
                    dir, kLatest, RankName(0)));
  }
  json common0;
  for (uint32_t r = 0;; ++r) {
    const std::string path = info.save_dir + "/" + RankName(r) + ".json";
    if (!Exists(path)) {
      return NotFoundError(fmt::format(
          "open checkpoint: {} is missing{}: copy every rank's files into the save directory, "
          "or load an earlier checkpoint",
          path, r == 0 ? "" : fmt::format(" (the save has {} ranks)", info.world_size)));
    }
    STRATA_ASSIGN_OR_RETURN(std::string text, ReadSmallFile(storage, path));
    json j = json::parse(text, nullptr, /*allow_exceptions=*/false);
    auto bad = [&](std::string_view why) {
      return DataLossError(fmt::format(
          "open checkpoint: {} is not a valid manifest ({}): restore it from a copy or load "
          "an earlier checkpoint",
          path, why));
    };
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
      if (info.world_size == 0) return bad("world_size is 0");
      if (Status s = CheckLayout(info); !s.ok()) return bad(s.message());
    } else if (CommonPart(j) != common0) {
      return DataLossError(fmt::format(
          "open checkpoint: {} does not agree with {}.json (save id, step, layout or "
          "hyperparameters differ): the directory mixes files of different saves; restore it "
          "or load an earlier checkpoint",
          path, RankName(0)));
    }
    if (rank.rank != r) return bad(fmt::format("it says rank {}", rank.rank));
    if (Status s = CheckManifestGeometry(info, rank); !s.ok()) return bad(s.message());
    info.ranks.push_back(std::move(rank));
    if (info.ranks.size() == info.world_size) break;
  }
  const uint32_t depth = std::max<uint32_t>(options.queue_depth, 1);
  for (uint32_t i = 0; i < depth; ++i) impl->bufs.emplace_back(info.chunk_bytes);
  impl->reqs.resize(depth);
  impl->cache = AlignedBytes(info.chunk_bytes);
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
    const uint64_t lo = (range.begin - uint64_t{r} * info_.shard_elems) * 4;
    const uint64_t hi = (end - uint64_t{r} * info_.shard_elems) * 4;
    STRATA_RETURN_IF_ERROR(impl_->ReadChunks(
        r, array, lo / cb, (hi + cb - 1) / cb, [&](uint64_t c, std::span<const std::byte> data) {
          const uint64_t c0 = c * cb;
          const uint64_t from = std::max(lo, c0);
          const uint64_t to = std::min(hi, c0 + data.size());
          std::memcpy(dst + (from - lo), data.data() + (from - c0), to - from);
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

Status CheckpointReader::Verify(std::span<const uint32_t> ranks) {
  std::vector<uint32_t> all;
  if (ranks.empty()) {
    for (uint32_t r = 0; r < info_.world_size; ++r) all.push_back(r);
    ranks = all;
  }
  XXH3_state_t* state = XXH3_createState();
  Status result;
  for (uint32_t r : ranks) {
    for (uint32_t a = 0; a < info_.arrays.size() && result.ok(); ++a) {
      const CheckpointFile& f = info_.ranks[r].files[a];
      XXH3_64bits_reset(state);
      // Whole files go around the cache: a stale cached chunk would hide a
      // change on disk.
      impl_->cache_chunk = -1;
      result = impl_->ReadChunks(r, a, 0, f.chunk_xxh3.size(),
                                 [&](uint64_t, std::span<const std::byte> data) {
                                   XXH3_64bits_update(state, data.data(), data.size());
                                 });
      if (result.ok() && XXH3_64bits_digest(state) != f.xxh3) {
        result = DataLossError(fmt::format(
            "{}: the file checksum (XXH3 {}) is not the manifest's ({}): the file is corrupt; "
            "restore it or load an earlier checkpoint",
            impl_->PathOf(r, a), Hex(XXH3_64bits_digest(state)), Hex(f.xxh3)));
      }
    }
  }
  XXH3_freeState(state);
  return std::move(result).WithContext("verify checkpoint " + info_.save_dir);
}

// ---- Save / Load ------------------------------------------------------------------------

Status SaveCheckpoint(OffloadOptimizer& opt, const std::string& dir, const SaveOptions& o) {
  const std::string op =
      fmt::format("save checkpoint {} (rank {}, step {})", dir, opt.rank(), opt.step_count());
  if (o.chunk_bytes == 0 || o.chunk_bytes % kFileAlign != 0) {
    return InvalidArgumentError(
        fmt::format("{}: chunk_bytes {} is not a positive multiple of 4096", op, o.chunk_bytes));
  }
  STRATA_ASSIGN_OR_RETURN(StorageRef storage, StorageRef::Of(o.storage));
  STRATA_ASSIGN_OR_RETURN(Collective coll, Collective::Create(opt));
  // Every rank writes into the same new directory: rank 0 draws its id.
  double nonce = 0;
  if (opt.rank() == 0) {
    std::random_device rd;
    nonce = static_cast<double>(((uint64_t{rd()} << 32) | rd()) & ((uint64_t{1} << 48) - 1));
  }
  STRATA_ASSIGN_OR_RETURN(nonce, coll.AllReduce(nonce, ReduceOp::kMax));
  const std::string save_id =
      fmt::format("step-{:010}-{:012x}", opt.step_count(), static_cast<uint64_t>(nonce));
  const std::string save_dir = dir + "/" + save_id;
  const CheckpointInfo info = InfoOf(opt, save_id, o.chunk_bytes);

  Status local = WriteRank(opt, *storage.storage, save_dir, info, o);
  STRATA_ASSIGN_OR_RETURN(int failed, coll.CountFailures(local));
  if (!local.ok()) return std::move(local).WithContext(op);
  if (failed > 0) {
    return UnavailableError(fmt::format(
        "{}: {} other rank(s) failed to write their part; the previous checkpoint stays the "
        "current one; see their errors and save again",
        op, failed));
  }
  Status published =
      opt.rank() == 0 ? Publish(*storage.storage, dir, info, o.keep_checkpoints) : OkStatus();
  STRATA_ASSIGN_OR_RETURN(failed, coll.CountFailures(published));
  if (!published.ok()) return std::move(published).WithContext(op);
  if (failed > 0) {
    return UnavailableError(fmt::format(
        "{}: rank 0 failed to publish {} in {}; the previous checkpoint stays the current one; "
        "see rank 0's error and save again",
        op, save_id, kLatest));
  }
  return OkStatus();
}

Status LoadCheckpoint(OffloadOptimizer& opt, const std::string& dir, const LoadOptions& o) {
  const std::string op = fmt::format("load checkpoint {} (rank {})", dir, opt.rank());
  STRATA_ASSIGN_OR_RETURN(Collective coll, Collective::Create(opt));
  std::unique_ptr<CheckpointReader> reader;
  // Phase 1, nothing changes: the checkpoint is complete, ours, and intact.
  Status local = [&]() -> Status {
    STRATA_ASSIGN_OR_RETURN(
        reader, CheckpointReader::Open(
                    dir, {.storage = o.storage, .queue_depth = o.queue_depth, .direct = o.direct}));
    const CheckpointInfo& info = reader->info();
    const std::string manifest = info.save_dir + "/" + RankName(0) + ".json";
    STRATA_RETURN_IF_ERROR(CheckSameModel(info, opt, manifest));
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
    STRATA_RETURN_IF_ERROR(reader->Verify(ranks));
    // The counters and hyperparameters must be ones this optimizer accepts.
    STRATA_ASSIGN_OR_RETURN(LossScaler scaler, LossScaler::Create(opt.config().loss_scaler));
    STRATA_RETURN_IF_ERROR((scaler.Restore(info.scaler)).WithContext(manifest + ": loss_scaler"));
    if (info.step < 0) {
      return DataLossError(fmt::format("{}: step {} is negative", manifest, info.step));
    }
    for (uint32_t g = 0; g < info.groups.size(); ++g) {
      // SetGroupHyper is the validator; the current values go straight back.
      const GroupHyper current = opt.group_hyper(g);
      STRATA_RETURN_IF_ERROR((opt.SetGroupHyper(g, info.groups[g])).WithContext(manifest));
      STRATA_RETURN_IF_ERROR(opt.SetGroupHyper(g, current));
    }
    return OkStatus();
  }();
  STRATA_ASSIGN_OR_RETURN(int failed, coll.CountFailures(local));
  if (!local.ok()) return std::move(local).WithContext(op + ": nothing was loaded");
  if (failed > 0) {
    return FailedPreconditionError(fmt::format(
        "{}: {} other rank(s) could not verify the checkpoint; nothing was loaded on any rank; "
        "see their errors",
        op, failed));
  }

  // Phase 2: the state, sub-group by sub-group.
  const CheckpointInfo& info = reader->info();
  const uint32_t arrays = opt.StateArrayCount();
  Status applied = [&]() -> Status {
    uint64_t max_elems = 0;
    for (const ElemRange& r : opt.sub_groups()) max_elems = std::max(max_elems, r.elems());
    std::vector<float> state(max_elems * arrays);
    for (uint32_t i = 0; i < opt.sub_groups().size(); ++i) {
      const ElemRange sg = opt.sub_groups()[i];
      std::span<float> s(state.data(), sg.elems() * arrays);
      std::fill(s.begin(), s.end(), 0.0f);  // padding
      STRATA_ASSIGN_OR_RETURN(std::vector<MappedPiece> pieces, MapRange(info, opt.layout(), sg));
      for (uint32_t a = 0; a < arrays; ++a) {
        for (const MappedPiece& p : pieces) {
          STRATA_RETURN_IF_ERROR(reader->ReadFlat(a, {p.saved_begin, p.saved_begin + p.elems},
                                                  s.subspan(a * sg.elems() + p.at, p.elems)));
        }
      }
      STRATA_RETURN_IF_ERROR(opt.WriteState(i, s));
    }
    STRATA_RETURN_IF_ERROR(opt.RestoreCounters(info.step, info.scaler));
    for (uint32_t g = 0; g < info.groups.size(); ++g) {
      STRATA_RETURN_IF_ERROR(opt.SetGroupHyper(g, info.groups[g]));
    }
    return OkStatus();
  }();
  STRATA_ASSIGN_OR_RETURN(failed, coll.CountFailures(applied));
  const std::string partial =
      ": the optimizer state is partly loaded; load again, or recreate the optimizer";
  if (!applied.ok()) return std::move(applied).WithContext(op + partial);
  if (failed > 0) {
    return FailedPreconditionError(
        fmt::format("{}: {} other rank(s) failed while loading{}", op, failed, partial));
  }
  // Phase 3 (a collective): the trainer's tensors from the loaded masters.
  return (opt.UploadParams()).WithContext(op);
}

// ---- Export ---------------------------------------------------------------------------

Status ExportSafetensors(const std::string& dir, const std::string& out_path,
                         const ExportOptions& options) {
  const std::string op = fmt::format("export {} to {}", dir, out_path);
  STRATA_ASSIGN_OR_RETURN(auto reader, CheckpointReader::Open(dir, options.reader));
  const CheckpointInfo& info = reader->info();
  nlohmann::ordered_json header;
  header["__metadata__"] = {{"format", "pt"},
                            {"source", "strata checkpoint " + info.save_id},
                            {"step", std::to_string(info.step)},
                            {"world_size", std::to_string(info.world_size)},
                            {"optimizer", info.optimizer}};
  uint64_t offset = 0;
  std::set<std::string> names = {"__metadata__"};
  for (uint32_t i = 0; i < info.tensors.size(); ++i) {
    const CheckpointTensor& t = info.tensors[i];
    const std::string name = t.name.empty() ? fmt::format("param.{}", i) : t.name;
    if (!names.insert(name).second) {
      return FailedPreconditionError(fmt::format(
          "{}: tensor {} is named '{}' like an earlier one; safetensors needs unique names: "
          "register the params with unique names (or none)",
          op, i, name));
    }
    header[name] = {
        {"dtype", "F32"}, {"shape", {t.elems}}, {"data_offsets", {offset, offset + t.elems * 4}}};
    offset += t.elems * 4;
  }
  std::string text = header.dump();
  text.append(RoundUp(text.size(), 8) - text.size(), ' ');

  const std::string tmp = out_path + ".tmp";
  const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) return ErrnoError(errno, op + ": create " + tmp);
  auto write_all = [&](const void* data, size_t bytes) -> Status {
    const auto* p = static_cast<const char*>(data);
    while (bytes > 0) {
      const ssize_t n = ::write(fd, p, bytes);
      if (n < 0 && errno == EINTR) continue;
      if (n < 0) return ErrnoError(errno, op + ": write " + tmp);
      p += n;
      bytes -= static_cast<size_t>(n);
    }
    return OkStatus();
  };
  Status s = [&]() -> Status {
    uint8_t len[8];
    uint64_t n = text.size();
    for (int k = 0; k < 8; ++k) len[k] = static_cast<uint8_t>(n >> (8 * k));
    STRATA_RETURN_IF_ERROR(write_all(len, 8));
    STRATA_RETURN_IF_ERROR(write_all(text.data(), text.size()));
    std::vector<float> buf(std::max<uint64_t>(options.buffer_bytes / 4, 1024));
    for (uint32_t i = 0; i < info.tensors.size(); ++i) {
      for (uint64_t at = 0; at < info.tensors[i].elems; at += buf.size()) {
        const uint64_t k = std::min<uint64_t>(buf.size(), info.tensors[i].elems - at);
        std::span<float> part(buf.data(), k);
        STRATA_RETURN_IF_ERROR((reader->ReadTensor(0, i, at, part)).WithContext(op));
        STRATA_RETURN_IF_ERROR(write_all(part.data(), part.size_bytes()));
      }
    }
    if (::fsync(fd) != 0) return ErrnoError(errno, op + ": fsync " + tmp);
    return OkStatus();
  }();
  ::close(fd);
  if (!s.ok()) {
    ::unlink(tmp.c_str());
    return s;
  }
  std::error_code ec;
  fs::rename(tmp, out_path, ec);
  if (ec) return ErrnoError(ec.value(), op + ": rename " + tmp);
  const std::string parent = fs::path(out_path).parent_path().string();
  return FsyncDir(parent.empty() ? "." : parent);
}

// ---- OffloadOptimizer::Save / Load live in optimizer_checkpoint.cc ----

}  // namespace strata
