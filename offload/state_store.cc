#include "offload/state_store.h"

#include <xxhash.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <nlohmann/json.hpp>

#include "runtime/file_lock.h"
#include "runtime/log.h"
#include "runtime/units.h"

namespace strata {
namespace {

std::string JoinPaths(const std::vector<std::string>& paths) {
  std::string out;
  for (const std::string& p : paths) out += (out.empty() ? "" : ", ") + p;
  return out;
}

constexpr uint64_t kSlotMagic = 0x5845415441525453ull;  // "STRATAEX"
// 2: slots on block boundaries, the payload checksum over 1 MiB pieces.
constexpr uint32_t kFormatVersion = 2;
constexpr uint64_t kAlign = 4096;

struct SlotHeader {
  uint64_t magic;
  uint32_t version;
  uint32_t extent_id;
  uint64_t generation;
  uint64_t payload_bytes;
  uint64_t payload_hash;
  uint64_t header_hash;  // of the bytes above
};
static_assert(sizeof(SlotHeader) == 48);

uint64_t HeaderHash(const SlotHeader& h) {
  return XXH3_64bits(&h, offsetof(SlotHeader, header_hash));
}

uint64_t RoundUp(uint64_t v, uint64_t a) { return (v + a - 1) / a * a; }

// A 4096-aligned scratch buffer for setup IO.
struct Scratch {
  explicit Scratch(size_t bytes)
      : size(RoundUp(bytes, kAlign)),
        data(static_cast<std::byte*>(std::aligned_alloc(kAlign, size))) {
    std::memset(data, 0, size);
  }
  ~Scratch() { std::free(data); }
  Scratch(const Scratch&) = delete;
  Scratch& operator=(const Scratch&) = delete;
  std::span<std::byte> span() { return {data, size}; }
  size_t size;
  std::byte* data;
};

}  // namespace

struct StateStore::Op {
  uint64_t ticket;
  IoOp op;
  uint32_t extent;
  uint64_t generation;
  uint32_t slot;
  std::span<std::byte> buffer;
  bool check_payload = true;        // reads: verify the payload here (else VerifyPayload)
  std::vector<IoRequest> requests;  // grouped by file
  std::vector<uint32_t> pending_per_file;  // not yet reaped (submitted or not)
  std::vector<size_t> next, end;           // per file: requests[next, end) not submitted yet
  size_t pending = 0;
  Status status;
  bool done = false;
};

StateStore::StateStore(const StateStoreOptions& options) : options_(options) {}

Result<std::unique_ptr<StateStore>> StateStore::Create(Storage& storage,
                                                       const StateStoreOptions& options) {
  auto bad = [](const std::string& why) {
    return InvalidArgumentError("state store options: " + why);
  };
  if (options.paths.empty()) return bad("no paths; give at least one directory");
  if (options.extent_bytes == 0) return bad("extent_bytes is 0");
  if (options.num_extents == 0) return bad("num_extents is 0");
  if (options.block_bytes == 0 || options.block_bytes % kAlign != 0) {
    return bad("block_bytes " + std::to_string(options.block_bytes) +
               " is not a positive multiple of 4096");
  }
  if (options.block_bytes > 64 * kMiB) return bad("block_bytes above 64 MiB");
  if (options.queue_depth == 0) return bad("queue_depth is 0");
  std::unique_ptr<StateStore> store(new StateStore(options));
  STRATA_RETURN_IF_ERROR(store->Init(storage));
  return store;
}

StateStore::~StateStore() {
  // Chunks in flight still point into caller buffers and into ops_; the ones
  // not submitted yet are dropped.
  for (auto& q : feed_) q.clear();
  for (size_t f = 0; f < files_.size() && broken_.ok(); ++f) {
    while (files_[f]->InFlight() > 0) {
      if (!ReapFile(static_cast<uint32_t>(f), 1).ok()) break;
    }
  }
  // Files about to be removed are emptied first: their io_uring instances
  // let go of them some time after they close, and until then an unlinked
  // file holds its blocks (an optimizer built next would find the disk
  // still full).
  if (options_.close == StoreClose::kRemove && broken_.ok()) {
    for (auto& f : files_) (void)f->Resize(0);
  }
  // A broken file drains what it still has in flight when it closes, and its
  // requests live in ops_: close the files first.
  files_.clear();
  if (options_.close != StoreClose::kRemove || file_paths_.empty()) return;
  if (!broken_.ok()) {
    LogWarning("state store: kept " + JoinPaths(file_paths_) + " after the IO queue failed (" +
               std::string(broken_.message()) +
               "); nothing reopens it: remove it by hand once the cause is known");
    return;
  }
  // The locks (members) are released after this: no other store of this
  // rank can have opened the files meanwhile.
  for (const std::string& path : file_paths_) {
    Status removed = storage_->Remove(path);
    if (!removed.ok() && removed.code() != StatusCode::kNotFound) {
      LogWarning("state store: remove " + path + ": " + std::string(removed.message()) +
                 "; remove it by hand");
    }
  }
}

Result<std::vector<std::unique_ptr<StorageLock>>> LockStateDirectories(
    Storage& storage, std::span<const std::string> paths, uint32_t rank) {
  std::vector<std::unique_ptr<StorageLock>> locks;
  for (const std::string& dir : paths) {
    const std::string lock = dir + "/strata-rank" + std::to_string(rank) + ".lock";
    auto held = storage.Lock(lock);
    if (!held.ok() && LockHeldByAnother(held.status())) {
      return FailedPreconditionError(
          "open state store: " + std::string(held.status().message()) +
          "; another optimizer keeps rank " + std::to_string(rank) + "'s state in " + dir +
          " (another run, a second optimizer of this process, or the directory listed "
          "twice in nvme_path): give each optimizer its own nvme_path directory, or stop the "
          "other one");
    }
    // A lock file that cannot be made: its errno and the fix, no holder.
    if (!held.ok()) return held.status().WithContext("open state store");
    locks.push_back(std::move(held).value());
  }
  return locks;
}

Status StateStore::Init(Storage& storage) {
  storage_ = &storage;
  const uint32_t num_paths = static_cast<uint32_t>(options_.paths.size());
  slot_bytes_ = kHeaderBytes + RoundUp(options_.extent_bytes, kAlign);
  const uint64_t chunks = (slot_bytes_ + options_.block_bytes - 1) / options_.block_bytes;
  // Each file reserves room for its share of a slot; file 0 has the most.
  per_file_slot_bytes_ = 0;
  for (uint32_t f = 0; f < num_paths; ++f) {
    uint64_t bytes = 0;
    for (uint64_t k = f; k < chunks; k += num_paths) {
      bytes += std::min(options_.block_bytes, slot_bytes_ - k * options_.block_bytes);
    }
    per_file_slot_bytes_ = std::max(per_file_slot_bytes_, bytes);
  }
  // Every chunk starts on a block boundary of its file, as the drive probes
  // (and fio) issue them: the slots after a superblock padded to one block.
  per_file_slot_bytes_ = RoundUp(per_file_slot_bytes_, options_.block_bytes);
  data_offset_ = RoundUp(kSuperblockBytes, options_.block_bytes);
  committed_.assign(options_.num_extents, 0);
  busy_.assign(options_.num_extents, 0);
  STRATA_ASSIGN_OR_RETURN(locks_, LockStateDirectories(storage, options_.paths, options_.rank));
  const uint64_t file_bytes =
      data_offset_ + 2 * uint64_t{options_.num_extents} * per_file_slot_bytes_;
  for (uint32_t f = 0; f < num_paths; ++f) {
    std::string path =
        options_.paths[f] + "/strata-rank" + std::to_string(options_.rank) + ".state";
    FileOptions fo{.create = options_.open == StoreOpen::kCreate ? FileCreate::kCreate
                                                                 : FileCreate::kOpenExisting,
                   .direct = options_.direct,
                   .queue_depth = options_.queue_depth};
    auto file = storage.Open(path, fo);
    if (!file.ok()) return file.status().WithContext("open state store");
    if (options_.open == StoreOpen::kCreate) {
      STRATA_RETURN_IF_ERROR((*file)->Resize(0).WithContext("create state store"));
      STRATA_RETURN_IF_ERROR((*file)->Resize(file_bytes).WithContext("create state store"));
    }
    file_paths_.push_back(std::move(path));
    files_.push_back(std::move(file).value());
    feed_.emplace_back();
    last_kind_.push_back(IoOp::kWrite);
  }
  if (options_.open == StoreOpen::kCreate) {
    STRATA_RETURN_IF_ERROR(WriteSuperblocks());
  } else {
    STRATA_RETURN_IF_ERROR(CheckSuperblocks());
    for (size_t f = 0; f < files_.size(); ++f) {
      STRATA_ASSIGN_OR_RETURN(uint64_t size, files_[f]->SizeBytes());
      if (size < file_bytes) {
        return DataLossError("open state store " + file_paths_[f] + ": " + std::to_string(size) +
                             " bytes where the geometry needs " + std::to_string(file_bytes) +
                             "; the file was truncated: restore from a checkpoint");
      }
    }
    STRATA_RETURN_IF_ERROR(ScanHeaders());
  }
  return OkStatus();
}

Status StateStore::RunSync(uint32_t file, IoRequest request) {
  STRATA_RETURN_IF_ERROR(files_[file]->Submit(std::span<IoRequest>(&request, 1)));
  IoRequest* done[1];
  while (true) {
    STRATA_ASSIGN_OR_RETURN(size_t n, files_[file]->Reap(done, 1));
    if (n == 1) break;
  }
  return request.status;
}

namespace {
nlohmann::json Geometry(const StateStoreOptions& o, uint32_t path_index) {
  return {{"magic", "strata-state"},
          {"version", kFormatVersion},
          {"rank", o.rank},
          {"path_index", path_index},
          {"num_paths", o.paths.size()},
          {"extent_bytes", o.extent_bytes},
          {"num_extents", o.num_extents},
          {"block_bytes", o.block_bytes}};
}
}  // namespace

Status StateStore::WriteSuperblocks() {
  Scratch block(kSuperblockBytes);
  for (uint32_t f = 0; f < files_.size(); ++f) {
    std::string text = Geometry(options_, f).dump();
    std::memset(block.data, 0, block.size);
    std::memcpy(block.data, text.data(), text.size());
    STRATA_RETURN_IF_ERROR(
        RunSync(f, IoRequest::Write(0, block.span())).WithContext("create state store"));
    STRATA_RETURN_IF_ERROR(files_[f]->Sync());
  }
  return OkStatus();
}

Status StateStore::CheckSuperblocks() {
  Scratch block(kSuperblockBytes);
  for (uint32_t f = 0; f < files_.size(); ++f) {
    STRATA_RETURN_IF_ERROR(
        RunSync(f, IoRequest::Read(0, block.span())).WithContext("open state store"));
    const char* text = reinterpret_cast<const char*>(block.data);
    nlohmann::json found = nlohmann::json::parse(text, text + strnlen(text, block.size), nullptr,
                                                 /*allow_exceptions=*/false);
    nlohmann::json want = Geometry(options_, f);
    if (found.is_discarded() || !found.is_object() || !found.contains("magic") ||
        found["magic"] != "strata-state") {
      return DataLossError(
          "open state store " + file_paths_[f] +
          ": no valid superblock at offset 0 (not a Strata state file, or damaged); "
          "recreate the store and restore from a checkpoint");
    }
    if (found != want) {
      return FailedPreconditionError(
          "open state store " + file_paths_[f] + ": it was created as " + found.dump() +
          " but is opened as " + want.dump() +
          "; open it with the same paths (in the same order), rank and geometry");
    }
  }
  return OkStatus();
}

std::vector<StateStore::Placement> StateStore::SlotChunks(uint32_t id, uint32_t slot) const {
  const uint32_t num_paths = static_cast<uint32_t>(files_.size());
  const uint64_t base = data_offset_ + (uint64_t{id} * 2 + slot) * per_file_slot_bytes_;
  std::vector<Placement> out;
  for (uint64_t k = 0, pos = 0; pos < slot_bytes_; ++k, pos += options_.block_bytes) {
    out.push_back({static_cast<uint32_t>(k % num_paths),
                   base + (k / num_paths) * options_.block_bytes,
                   std::min(options_.block_bytes, slot_bytes_ - pos)});
  }
  return out;
}

std::string StateStore::SlotWhere(uint32_t id, uint32_t slot) const {
  // A file's chunks of one slot are consecutive blocks of it.
  std::vector<Placement> parts(files_.size(), Placement{0, 0, 0});
  for (const Placement& p : SlotChunks(id, slot)) {
    Placement& part = parts[p.file];
    if (part.size_bytes == 0) part.offset_bytes = p.offset_bytes;
    part.size_bytes += p.size_bytes;
  }
  std::string out;
  for (uint32_t f = 0; f < parts.size(); ++f) {
    if (parts[f].size_bytes == 0) continue;
    if (!out.empty()) out += ", ";
    out += IoObjectName(file_paths_[f], parts[f].offset_bytes, parts[f].size_bytes);
  }
  return out;
}

Status StateStore::ScanHeaders() {
  // The header is the first 4 KiB of chunk 0, which is always in file 0.
  constexpr uint32_t kBatch = 64;
  const uint32_t total = options_.num_extents * 2;
  Scratch scratch(uint64_t{kBatch} * kHeaderBytes);
  for (uint32_t first = 0; first < total; first += kBatch) {
    const uint32_t n = std::min(kBatch, total - first);
    std::vector<IoRequest> reqs;
    for (uint32_t i = 0; i < n; ++i) {
      const uint32_t g = first + i;
      reqs.push_back(
          IoRequest::Read(SlotChunks(g / 2, g % 2)[0].offset_bytes,
                          scratch.span().subspan(uint64_t{i} * kHeaderBytes, kHeaderBytes), g));
    }
    STRATA_RETURN_IF_ERROR(files_[0]->Submit(reqs));
    std::vector<IoRequest*> done(n);
    size_t got = 0;
    while (got < n) {
      STRATA_ASSIGN_OR_RETURN(size_t k, files_[0]->Reap(done, n - got));
      got += k;
    }
    for (uint32_t i = 0; i < n; ++i) {
      STRATA_RETURN_IF_ERROR(reqs[i].status.WithContext("open state store: scan slot headers"));
      SlotHeader h;
      std::memcpy(&h, scratch.data + uint64_t{i} * kHeaderBytes, sizeof(h));
      const uint32_t id = (first + i) / 2;
      if (h.magic != kSlotMagic || h.header_hash != HeaderHash(h) || h.extent_id != id ||
          h.payload_bytes != options_.extent_bytes || h.generation % 2 != (first + i) % 2) {
        continue;  // never written, or torn: a read of that slot will say so
      }
      committed_[id] = std::max(committed_[id], h.generation);
    }
  }
  return OkStatus();
}

Status StateStore::RegisterBuffers(std::span<const std::span<std::byte>> buffers) {
  if (!ops_.empty()) {
    return FailedPreconditionError(
        "register buffers with the state store: " + std::to_string(ops_.size()) +
        " extents in flight; wait for them first");
  }
  for (auto& f : files_) STRATA_RETURN_IF_ERROR(f->RegisterBuffers(buffers));
  return OkStatus();
}

Result<StateStore::Ticket> StateStore::ReadExtent(uint32_t id, std::span<std::byte> buffer,
                                                 PayloadCheck check) {
  return Start(IoOp::kRead, id, buffer, check, std::nullopt);
}

Result<StateStore::Ticket> StateStore::WriteExtent(uint32_t id, std::span<std::byte> buffer,
                                                  std::optional<uint64_t> payload_hash) {
  return Start(IoOp::kWrite, id, buffer, PayloadCheck::kStore, payload_hash);
}

uint64_t StateStore::PayloadHash(std::span<const std::byte> extent_buffer) const {
  return Hash(extent_buffer, /*parallel=*/true);
}

uint64_t StateStore::Hash(std::span<const std::byte> extent_buffer, bool parallel) const {
  const std::byte* payload = extent_buffer.data() + kHeaderBytes;
  const uint64_t bytes = options_.extent_bytes;
  const size_t pieces = static_cast<size_t>((bytes + kHashPieceBytes - 1) / kHashPieceBytes);
  std::vector<XXH64_hash_t> h(pieces);
  auto body = [&](size_t begin, size_t count) {
    for (size_t k = begin; k < begin + count; ++k) {
      const uint64_t at = k * kHashPieceBytes;
      h[k] = XXH3_64bits(payload + at, std::min(kHashPieceBytes, bytes - at));
    }
  };
  if (parallel && options_.parallel_for) {
    options_.parallel_for(pieces, body);
  } else {
    body(0, pieces);
  }
  return XXH3_64bits(h.data(), h.size() * sizeof(XXH64_hash_t));
}

Result<StateStore::Ticket> StateStore::Start(IoOp kind, uint32_t id, std::span<std::byte> buffer,
                                             PayloadCheck check,
                                             std::optional<uint64_t> payload_hash) {
  const char* what = kind == IoOp::kRead ? "read extent " : "write extent ";
  const std::string name = what + std::to_string(id);
  if (id >= options_.num_extents) {
    return OutOfRangeError(name + ": the store has " + std::to_string(options_.num_extents) +
                           " extents");
  }
  if (buffer.size() != slot_bytes_) {
    return InvalidArgumentError(name + ": buffer of " + std::to_string(buffer.size()) +
                                " bytes, expected " + std::to_string(slot_bytes_) +
                                " (ExtentBufferBytes())");
  }
  if (reinterpret_cast<uintptr_t>(buffer.data()) % kAlign != 0) {
    return InvalidArgumentError(name +
                                ": buffer is not 4096-aligned; use pinned or aligned_alloc memory");
  }
  if (!broken_.ok()) return broken_;
  if (busy_[id]) {
    return FailedPreconditionError(
        name + ": the extent already has IO in flight; wait for its ticket first");
  }
  auto op = std::make_unique<Op>();
  op->ticket = next_ticket_++;
  op->op = kind;
  op->extent = id;
  op->buffer = buffer;
  op->check_payload = check == PayloadCheck::kStore;
  if (kind == IoOp::kRead) {
    if (committed_[id] == 0) {
      return FailedPreconditionError(name + ": never written; write it before reading it");
    }
    op->generation = committed_[id];
  } else {
    op->generation = committed_[id] + 1;
    SlotHeader h{kSlotMagic,
                 kFormatVersion,
                 id,
                 op->generation,
                 options_.extent_bytes,
                 payload_hash ? *payload_hash : Hash(buffer, /*parallel=*/false),
                 0};
    h.header_hash = HeaderHash(h);
    std::memset(buffer.data(), 0, kHeaderBytes);
    std::memcpy(buffer.data(), &h, sizeof(h));
  }
  op->slot = static_cast<uint32_t>(op->generation % 2);
  std::vector<Placement> chunks = SlotChunks(id, op->slot);
  std::stable_sort(chunks.begin(), chunks.end(),
                   [](const Placement& a, const Placement& b) { return a.file < b.file; });
  op->pending_per_file.assign(files_.size(), 0);
  // Chunk k of the slot is bytes [k * block, ...) of the buffer; recover k from
  // the file offset so that sorting by file keeps the mapping.
  const uint64_t base = data_offset_ + (uint64_t{id} * 2 + op->slot) * per_file_slot_bytes_;
  const uint64_t num_paths = files_.size();
  for (const Placement& p : chunks) {
    const uint64_t k = ((p.offset_bytes - base) / options_.block_bytes) * num_paths + p.file;
    std::span<std::byte> part = buffer.subspan(k * options_.block_bytes, p.size_bytes);
    op->requests.push_back(kind == IoOp::kRead
                               ? IoRequest::Read(p.offset_bytes, part, op->ticket)
                               : IoRequest::Write(p.offset_bytes, part, op->ticket));
    ++op->pending_per_file[p.file];
  }
  op->pending = op->requests.size();
  op->next.assign(files_.size(), 0);
  op->end.assign(files_.size(), 0);
  size_t begin = 0;
  for (uint32_t f = 0; f < files_.size(); ++f) {
    op->next[f] = begin;
    begin += op->pending_per_file[f];
    op->end[f] = begin;
  }
  busy_[id] = 1;
  const Ticket t{op->ticket};
  Op& started = *op;
  ops_.emplace(op->ticket, std::move(op));
  for (uint32_t f = 0; f < files_.size(); ++f) {
    if (started.next[f] == started.end[f]) continue;
    feed_[f].push_back(t.id);
    Feed(f);
  }
  if (started.done) {
    // Refused before any chunk reached a drive: the error is the call's.
    Status failed = std::move(started.status);
    busy_[id] = 0;
    ops_.erase(t.id);
    return failed;
  }
  return t;
}

// Submits chunks to file f up to the queue depth. Reads and writes take
// turns, chunk by chunk, so a write-behind never waits for a read-ahead's
// whole extent (nor the other way round); within each kind the oldest op
// goes first, so the read the optimizer needs next is not slowed by the
// reads queued behind it. A chunk the file refuses fails its op (with the
// op's other chunks on f, never submitted); the op finishes once its
// submitted chunks are reaped.
void StateStore::Feed(uint32_t f) {
  std::deque<uint64_t>& q = feed_[f];
  while (files_[f]->InFlight() < options_.queue_depth && !q.empty()) {
    // The oldest op of the other kind than the last chunk's, else the oldest.
    auto pick = q.begin();
    for (auto it = q.begin(); it != q.end(); ++it) {
      auto op = ops_.find(*it);
      if (op != ops_.end() && op->second->op != last_kind_[f]) {
        pick = it;
        break;
      }
    }
    auto found = ops_.find(*pick);
    if (found == ops_.end() || found->second->next[f] == found->second->end[f]) {
      q.erase(pick);
      continue;
    }
    Op& op = *found->second;
    IoRequest& r = op.requests[op.next[f]];
    if (Status s = files_[f]->Submit(std::span<IoRequest>(&r, 1)); !s.ok()) {
      const size_t dropped = op.end[f] - op.next[f];
      op.next[f] = op.end[f];
      op.pending -= dropped;
      op.pending_per_file[f] -= static_cast<uint32_t>(dropped);
      if (op.status.ok()) {
        op.status = std::move(s).WithContext(
            (op.op == IoOp::kRead ? "read extent " : "write extent ") + std::to_string(op.extent));
      }
      q.erase(pick);
      if (op.pending == 0) Finish(op);
      continue;
    }
    ++op.next[f];
    last_kind_[f] = op.op;
    if (op.next[f] == op.end[f]) q.erase(pick);
  }
}

Status StateStore::ReapFile(uint32_t file, size_t min_completions) {
  if (!broken_.ok()) return broken_;
  IoRequest* done[64];
  Result<size_t> reaped = files_[file]->Reap(done, min_completions);
  if (!reaped.ok()) {
    // The requests stay where they are (ops_ owns them) until the file closes.
    broken_ = Status(
        reaped.status().code(),
        "state store: the IO queue of " + file_paths_[file] + " failed (" +
            std::string(reaped.status().message()) + ") with " +
            std::to_string(files_[file]->InFlight()) +
            " requests in flight, which may or may not have completed; the store takes no more "
            "IO (the committed copies on the drive were not touched). This optimizer cannot go "
            "on: check `dmesg` and the drive, then restart the process and load the last "
            "checkpoint");
    return broken_;
  }
  const size_t n = *reaped;
  for (size_t i = 0; i < n; ++i) {
    auto it = ops_.find(done[i]->user_data);
    if (it == ops_.end()) continue;
    Op& op = *it->second;
    if (!done[i]->status.ok() && op.status.ok()) {
      op.status = done[i]->status;
    }
    --op.pending_per_file[file];
    if (--op.pending == 0) Finish(op);
  }
  Feed(file);
  return OkStatus();
}

void StateStore::Finish(Op& op) {
  op.done = true;
  busy_[op.extent] = 0;
  const std::string gen =
      " (generation " + std::to_string(op.generation) + ", slot " + std::to_string(op.slot) + ")";
  if (op.op == IoOp::kWrite) {
    if (op.status.ok()) {
      committed_[op.extent] = op.generation;
    } else {
      std::string keep = committed_[op.extent] == 0
                             ? std::string("; the extent has no committed copy yet")
                             : "; generation " + std::to_string(committed_[op.extent]) +
                                   " in the other slot is intact";
      op.status = op.status.WithContext("write extent " + std::to_string(op.extent) + gen);
      op.status = Status(op.status.code(), std::string(op.status.message()) + keep);
    }
    return;
  }
  if (!op.status.ok()) {
    op.status = op.status.WithContext("read extent " + std::to_string(op.extent) + gen);
    return;
  }
  op.status = VerifyRead(op);
}

Status StateStore::VerifyRead(const Op& op) const {
  SlotHeader h;
  std::memcpy(&h, op.buffer.data(), sizeof(h));
  // The header is the first 4 KiB of the slot's first chunk; the payload
  // may be striped over every file.
  const Placement head = SlotChunks(op.extent, op.slot)[0];
  const std::string what =
      " (generation " + std::to_string(op.generation) + ", slot " + std::to_string(op.slot) + ")";
  const std::string where = "read extent " + std::to_string(op.extent) + " from " +
                            IoObjectName(file_paths_[head.file], head.offset_bytes, kHeaderBytes) +
                            what;
  const std::string advice =
      ": the copy on disk is torn or corrupt and was not used; restore the state from a checkpoint";
  if (h.magic != kSlotMagic || h.header_hash != HeaderHash(h)) {
    return DataLossError(where + ": slot header checksum mismatch" + advice);
  }
  if (h.extent_id != op.extent || h.payload_bytes != options_.extent_bytes) {
    return DataLossError(where + ": the header belongs to extent " + std::to_string(h.extent_id) +
                         " with " + std::to_string(h.payload_bytes) + " bytes" + advice);
  }
  if (h.generation != op.generation) {
    return DataLossError(where + ": found generation " + std::to_string(h.generation) +
                         " where the committed one is expected (a write that reported success did "
                         "not reach the drive)" +
                         advice);
  }
  // On the thread that drives the store: not on the caller's threads.
  if (op.check_payload && Hash(op.buffer, /*parallel=*/false) != h.payload_hash) {
    return DataLossError("read extent " + std::to_string(op.extent) + " from " +
                         SlotWhere(op.extent, op.slot) + what +
                         ": payload checksum (XXH3-64) mismatch" + advice);
  }
  return OkStatus();
}

Status StateStore::VerifyPayload(uint32_t id, std::span<const std::byte> extent_buffer) const {
  SlotHeader h;
  std::memcpy(&h, extent_buffer.data(), sizeof(h));
  if (h.extent_id != id || PayloadHash(extent_buffer) != h.payload_hash) {
    return DataLossError(
        "read extent " + std::to_string(id) + " from " +
        SlotWhere(id, static_cast<uint32_t>(h.generation % 2)) + " (generation " +
        std::to_string(h.generation) + "): payload checksum (XXH3-64) mismatch: the copy on disk " +
        "is torn or corrupt and was not used; restore the state from a checkpoint");
  }
  return OkStatus();
}

std::optional<Status> StateStore::Poll(Ticket ticket) {
  auto it = ops_.find(ticket.id);
  if (it == ops_.end())
    return NotFoundError("poll ticket " + std::to_string(ticket.id) +
                         ": unknown or already consumed");
  if (!broken_.ok() && !it->second->done) return broken_;
  for (uint32_t f = 0; f < files_.size(); ++f) {
    if (files_[f]->InFlight() > 0) {
      Status s = ReapFile(f, 0);
      if (!s.ok()) return s;
    }
  }
  if (!it->second->done) return std::nullopt;
  Status s = std::move(it->second->status);
  ops_.erase(it);
  return s;
}

Status StateStore::Wait(Ticket ticket) {
  auto it = ops_.find(ticket.id);
  if (it == ops_.end())
    return NotFoundError("wait ticket " + std::to_string(ticket.id) +
                         ": unknown or already consumed");
  Op& op = *it->second;
  if (!broken_.ok() && !op.done) return broken_;
  while (!op.done) {
    for (uint32_t f = 0; f < files_.size(); ++f) {
      if (op.pending_per_file[f] > 0) {
        STRATA_RETURN_IF_ERROR(ReapFile(f, 1));
        break;
      }
    }
  }
  Status s = std::move(op.status);
  ops_.erase(it);
  return s;
}

Status StateStore::WaitSome() {
  if (!broken_.ok()) return broken_;
  for (uint32_t f = 0; f < files_.size(); ++f) {
    if (files_[f]->InFlight() > 0) return ReapFile(f, 1);
  }
  return OkStatus();
}

Status StateStore::Sync() {
  if (!broken_.ok()) return broken_;
  for (auto& f : files_) STRATA_RETURN_IF_ERROR(f->Sync());
  return OkStatus();
}

}  // namespace strata
