// StateStore: the NVMe tier of the optimizer state. Fixed-size extents (one
// per sub-group: its fp32 master weights, Adam m and v) live in one file per
// rank per path, striped over the paths RAID-0 style, each extent in two slots
// so that a failed write never destroys the last good copy.
//
//   STRATA_ASSIGN_OR_RETURN(auto storage, CreateStorage({}));
//   STRATA_ASSIGN_OR_RETURN(auto store, StateStore::Create(*storage, {
//       .paths = {"/nvme0/strata", "/nvme1/strata"}, .rank = 0,
//       .extent_bytes = 384 * kMiB, .num_extents = 64}));
//   // buf: store->ExtentBufferBytes() bytes, 4096-aligned (pinned memory).
//   STRATA_RETURN_IF_ERROR(store->RegisterBuffers({&buf, 1}));
//   fill(store->Payload(buf));
//   STRATA_ASSIGN_OR_RETURN(StateStore::Ticket w, store->WriteExtent(3, buf));
//   STRATA_RETURN_IF_ERROR(store->Wait(w));            // committed; Sync() makes it durable
//   STRATA_ASSIGN_OR_RETURN(StateStore::Ticket r, store->ReadExtent(3, buf));
//   ... other work; store->Poll(r) tells without blocking ...
//   STRATA_RETURN_IF_ERROR(store->Wait(r));            // Payload(buf) is valid and verified
//
// On-disk layout (docs/nvme.md has the picture): file `<path>/strata-rank<r>.state`
// per path; a 4 KiB superblock (JSON: geometry) padded to block_bytes, then
// 2 * num_extents slots, each file's share of a slot padded to whole blocks
// (every chunk starts on a block boundary).
// A slot is a 4 KiB header (magic, extent id, generation, payload size, the
// payload's checksum, XXH3-64 of the header) followed by the payload rounded
// up to 4 KiB, i.e. exactly the caller's buffer. The payload's checksum is
// the XXH3-64 of the XXH3-64s of its 1 MiB pieces (kHashPieceBytes), in
// order: the pieces hash on every thread at once. A slot is cut into block_bytes
// chunks dealt round-robin over the paths, so one extent read uses every
// drive. Every chunk is one IoRequest; queue_depth of them are in flight per
// file: reads and writes take turns chunk by chunk (a read and a write in
// flight progress together), the oldest op of each kind first.
//
// Generations: the store keeps the committed generation of each extent in
// memory (scanned from the headers on open). Writing generation g goes to slot
// g % 2, never the slot holding the committed copy; the write commits only
// when every chunk succeeded. A read demands the committed generation: a
// header or payload that does not verify, or an older generation where a
// newer one was committed, is DataLoss — the store never returns corrupt or
// stale data.
//
// A file whose Reap fails (its queue broke: an io_uring submit or wait error)
// can no longer say which of its requests completed. The store then takes no
// more IO: every later start, Poll of an unfinished ticket, Wait, WaitSome
// and Sync returns that error, and the requests stay owned by the store until
// its files are closed (which drains them). Committed copies are never
// touched by a write in flight, so what was committed stays valid on disk.
//
// Exclusive: Create takes `<path>/strata-rank<r>.lock` on every path first
// (Storage::Lock) and holds it until the store is destroyed, so two stores of
// one rank on one directory (two runs, two optimizers of one process) never
// truncate or share each other's state: the second fails with
// FailedPrecondition naming the directory and the holder's pid.
//
// Errors: InvalidArgument (buffer size or alignment, bad options),
// OutOfRange (extent id), FailedPrecondition (extent never written, an extent
// already has IO in flight, geometry of an existing store differs, the
// directory is in use by another store), DataLoss
// (checksum or generation mismatch), and the IO errors of the storage with
// file, offset and size (ResourceExhausted for ENOSPC, Internal for EIO, ...).
//
// Thread-safety: one thread drives a store. Buffers passed to Read/WriteExtent
// must stay alive and untouched until their ticket completes. The destructor
// waits for IO in flight. The Storage must outlive the store.
#pragma once

#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <unordered_map>
#include <vector>

#include "runtime/status.h"
#include "runtime/storage.h"

namespace strata {

enum class StoreOpen : uint8_t {
  kCreate,        // new files sized for the geometry (existing ones are overwritten)
  kOpenExisting,  // reopen after a restart: check the geometry, scan the headers
};

// What the destructor does with the state files.
enum class StoreClose : uint8_t {
  kKeep,  // leave them, to reopen with StoreOpen::kOpenExisting
  // Remove them, still holding the lock (the engine's: nothing reopens
  // them). Not after the IO queue failed: then they stay, and a warning
  // names them.
  kRemove,
};

struct StateStoreOptions {
  std::vector<std::string> paths;  // directories, one per drive
  uint32_t rank = 0;
  uint64_t extent_bytes = 0;  // payload bytes per extent
  uint32_t num_extents = 0;
  uint64_t block_bytes = 1 << 20;  // IO size and stripe unit; a multiple of 4096
  uint32_t queue_depth = 8;        // requests in flight per file
  DirectIo direct = DirectIo::kAuto;
  StoreOpen open = StoreOpen::kCreate;
  StoreClose close = StoreClose::kKeep;
  // Runs body(begin, count) over [0, n) in pieces on any threads and returns
  // when all ran: PayloadHash and VerifyPayload hash an extent's 1 MiB
  // pieces with it (the engine passes its CPU optimizer's threads). Empty:
  // the calling thread.
  std::function<void(size_t n, const std::function<void(size_t, size_t)>& body)> parallel_for{};
};

// Locks `strata-rank<rank>.lock` in each directory, as a store does while it
// lives: FailedPrecondition naming the holder when another optimizer keeps
// that rank's state there; the errno and the fix when a lock file cannot be
// made. For an optimizer whose plan puts no state on NVMe: its nvme_path is
// still its own.
Result<std::vector<std::unique_ptr<StorageLock>>> LockStateDirectories(
    Storage& storage, std::span<const std::string> paths, uint32_t rank);

enum class PayloadCheck : uint8_t { kStore, kCaller };

class StateStore {
 public:
  struct Ticket {
    uint64_t id = 0;
  };
  static constexpr uint64_t kHeaderBytes = 4096;
  static constexpr uint64_t kSuperblockBytes = 4096;
  static constexpr uint64_t kHashPieceBytes = uint64_t{1} << 20;

  static Result<std::unique_ptr<StateStore>> Create(Storage& storage,
                                                    const StateStoreOptions& options);
  ~StateStore();
  StateStore(const StateStore&) = delete;
  StateStore& operator=(const StateStore&) = delete;

  // Size of the buffer an extent is read into / written from: header + payload
  // rounded up to 4096.
  uint64_t ExtentBufferBytes() const { return slot_bytes_; }
  // The payload part of such a buffer.
  std::span<std::byte> Payload(std::span<std::byte> extent_buffer) const {
    return extent_buffer.subspan(kHeaderBytes, options_.extent_bytes);
  }

  // Registers long-lived (pinned) buffers with every file; no IO in flight.
  // Take them from a PinnedPool: its host slabs are huge-page backed where
  // the kernel allows, so a request is one or two DMA segments instead of
  // one per 4 KiB page (2-5x read throughput on a virtio disk; see
  // docs/perf/nvme.md).
  Status RegisterBuffers(std::span<const std::span<std::byte>> buffers);

  // Starts reading extent `id` into `buffer` (ExtentBufferBytes(), 4096-aligned).
  // The header is always verified when the read completes; the payload's
  // checksum too with PayloadCheck::kStore. With kCaller the thread that uses
  // the data calls VerifyPayload first (it hashes what it is about to read
  // anyway, and the thread driving the store stays free for IO).
  Result<Ticket> ReadExtent(uint32_t id, std::span<std::byte> buffer,
                            PayloadCheck check = PayloadCheck::kStore);
  // Starts writing Payload(buffer) as the next generation of extent `id`; the
  // store fills the header part of `buffer`. `payload_hash`, when given, is
  // PayloadHash(buffer) computed by the caller (the store hashes otherwise).
  Result<Ticket> WriteExtent(uint32_t id, std::span<std::byte> buffer,
                             std::optional<uint64_t> payload_hash = std::nullopt);
  // The checksum of Payload(buffer) (see the layout above), on
  // options.parallel_for's threads. Thread-safe.
  uint64_t PayloadHash(std::span<const std::byte> extent_buffer) const;
  // After a kCaller read of `id` completed: DataLoss unless the payload
  // matches the checksum in its (verified) header. Thread-safe.
  Status VerifyPayload(uint32_t id, std::span<const std::byte> extent_buffer) const;

  // Whether the ticket is complete, without blocking: nullopt while in flight,
  // else its final status (and the ticket is consumed). NotFound for a ticket
  // that is unknown or already consumed.
  std::optional<Status> Poll(Ticket ticket);
  // Waits for this ticket only (other tickets progress meanwhile), returns its
  // status and consumes it.
  Status Wait(Ticket ticket);
  // Blocks until at least one chunk of any op in flight completes (and
  // feeds the files again); returns at once when nothing is in flight. For a
  // thread that drives several ops: Poll each ticket after it.
  Status WaitSome();
  // Makes every completed write durable (fdatasync on every file).
  Status Sync();

  // The committed generation of an extent (0: never written).
  uint64_t generation(uint32_t id) const { return committed_.at(id); }
  const std::vector<std::string>& file_paths() const { return file_paths_; }
  size_t InFlight() const { return ops_.size(); }

 private:
  // PayloadHash's checksum; `parallel`: on options.parallel_for's threads.
  uint64_t Hash(std::span<const std::byte> extent_buffer, bool parallel) const;
  struct Op;
  struct Placement {
    uint32_t file;
    uint64_t offset_bytes;
    uint64_t size_bytes;
  };

  StateStore(const StateStoreOptions& options);
  Status Init(Storage& storage);
  Status WriteSuperblocks();
  Status CheckSuperblocks();
  Status ScanHeaders();
  // Synchronous IO of one chunk, for setup.
  Status RunSync(uint32_t file, IoRequest request);
  std::vector<Placement> SlotChunks(uint32_t id, uint32_t slot) const;
  // "<path>@<offset>+<size>" of each file's part of a slot, in path order:
  // where a payload that fails its checksum lies (any part of it may be bad).
  std::string SlotWhere(uint32_t id, uint32_t slot) const;
  Result<Ticket> Start(IoOp op, uint32_t id, std::span<std::byte> buffer, PayloadCheck check,
                       std::optional<uint64_t> payload_hash);
  Status ReapFile(uint32_t file, size_t min_completions);
  void Feed(uint32_t file);
  void Finish(Op& op);
  Status VerifyRead(const Op& op) const;

  StateStoreOptions options_;
  uint64_t slot_bytes_ = 0;
  uint64_t per_file_slot_bytes_ = 0;
  uint64_t data_offset_ = kSuperblockBytes;  // the first slot: a block boundary
  Storage* storage_ = nullptr;               // the caller's; outlives the store
  std::vector<std::string> file_paths_;
  // One lock per path (strata-rank<r>.lock, runtime/file_lock.h), held for
  // the store's life: a second store of this rank on a path fails to open.
  std::vector<std::unique_ptr<StorageLock>> locks_;
  std::vector<std::unique_ptr<File>> files_;
  std::vector<uint64_t> committed_;
  std::vector<uint8_t> busy_;  // extent has an op in flight
  std::unordered_map<uint64_t, std::unique_ptr<Op>> ops_;
  // Per file: the ops with chunks not yet submitted there, in start order
  // (Feed keeps File::InFlight() at most queue_depth).
  std::vector<std::deque<uint64_t>> feed_;
  std::vector<IoOp> last_kind_;  // of the last chunk submitted, per file
  uint64_t next_ticket_ = 1;
  // Set when a file's Reap fails: which of its requests completed is unknown,
  // so the store takes no more IO and every later call returns this.
  Status broken_;
};

}  // namespace strata
