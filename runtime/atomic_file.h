// AtomicFileWriter: the one way Strata writes a whole file (checkpoint data
// files and manifests, latest.json, safetensors exports, the NCCL id file).
// Readers of `path` see the old file or the complete new one, never a part;
// a failed or abandoned write leaves nothing behind; and every byte goes
// through a Storage, so the fault-injecting storage (runtime/testing/)
// reaches every writer.
//
//   STRATA_ASSIGN_OR_RETURN(auto w, AtomicFileWriter::Create(storage, "/out/model.safetensors",
//                                                              {.existing = ExistingFile::kRefuse}));
//   STRATA_RETURN_IF_ERROR(w->Append(header));
//   for (...) STRATA_RETURN_IF_ERROR(w->Append(tensor_bytes));   // streamed, bounded memory
//   STRATA_RETURN_IF_ERROR(w->Commit());                          // durable and visible
//
// Steps: Create checks the target (a new path, or an existing regular file
// when replacing is allowed; never a directory, device, fifo, socket or
// symlink) and opens a temporary file with a unique name in the target's
// directory (".<name>.tmp-<pid>-<n>", so concurrent writers of one path,
// threads or processes, never share it). Append copies into chunk_bytes
// buffers and writes full chunks, queue_depth in flight. Commit writes the
// tail (zero-padded to 4096 bytes when the file is O_DIRECT), waits for
// every write, fsyncs, checks the target again and renames the temporary
// file over it (Storage::Rename, which syncs the directory). Destroying a
// writer that did not commit, or a failed Commit, waits for the writes in
// flight and removes the temporary file. A crash (SIGKILL, power loss)
// before the rename leaves the old file intact and, at worst, a stale
// ".tmp-" file that nothing reads; a command ended by a signal can remove
// its temporaries through SetAtomicFileListener.
//
// Errors: FailedPrecondition for a target that exists (with kRefuse) or is
// not a regular file, naming it and what to do; NotFound when the target's
// directory does not exist (FailedPrecondition when it is not a directory),
// naming the target and its directory, never the temporary; InvalidArgument
// for bad options; the storage's IO errors, naming the file, offset and size. After
// an error every later call returns it. Thread-safety: one thread drives a
// writer; writers are independent.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "runtime/host_region.h"
#include "runtime/status.h"
#include "runtime/storage.h"

namespace strata {

// What happens to an existing regular file at the target path.
enum class ExistingFile : uint8_t {
  kReplace,  // replaced atomically (manifests, latest.json)
  kRefuse,   // FailedPrecondition: the caller asks for kReplace explicitly (`--force`)
};

// The largest AtomicWriteOptions::chunk_bytes (256 MiB): a chunk is one
// write request, and the writer holds queue_depth of them. Requests of a
// few MiB already reach a drive's rate; larger ones only cost memory (an
// allocation that fails), and past 2 GiB - 4 KiB Linux writes them short.
inline constexpr uint64_t kMaxAtomicWriteChunkBytes = uint64_t{256} << 20;

struct AtomicWriteOptions {
  ExistingFile existing = ExistingFile::kReplace;
  // kOff: buffered IO, any size. kAuto/kRequire: O_DIRECT where the
  // filesystem allows (storage.h); the file is then zero-padded to a
  // multiple of 4096 bytes and chunk_bytes must be a multiple of 4096.
  DirectIo direct = DirectIo::kOff;
  uint64_t chunk_bytes = 1 << 20;  // bytes per write request, 1..kMaxAtomicWriteChunkBytes
  uint32_t queue_depth = 4;        // write requests in flight
  // Called with each chunk as it is written, in file order, padding
  // included (checksums of what reaches the disk).
  std::function<void(std::span<const std::byte>)> on_chunk{};
  // The file's final size (padding included) when known: Create reserves it
  // (a full disk fails before the first byte is written), and the writes
  // then land inside the file, which a filesystem serves faster than writes
  // that grow it (ext4 serializes those on the inode lock). Commit truncates
  // the file to what was written when that differs. 0: none.
  uint64_t size_hint = 0;
};

class AtomicFileWriter {
 public:
  static Result<std::unique_ptr<AtomicFileWriter>> Create(Storage& storage,
                                                          const std::string& path,
                                                          AtomicWriteOptions options = {});
  ~AtomicFileWriter();
  AtomicFileWriter(const AtomicFileWriter&) = delete;
  AtomicFileWriter& operator=(const AtomicFileWriter&) = delete;

  Status Append(std::span<const std::byte> bytes);
  Status Append(std::string_view text) { return Append(std::as_bytes(std::span(text))); }
  // Appends `bytes` bytes that `fill` writes straight into the writer's
  // chunks: called in file order with consecutive pieces (each within one
  // chunk, together `bytes`), so data produced on the fly (a checkpoint's
  // state) is not copied through a buffer of the caller's. A piece starts at
  // an offset of the file that is a multiple of 4 when everything appended
  // before was. An error of `fill` fails the writer, as an IO error does.
  using Fill = std::function<Status(std::span<std::byte>)>;
  Status AppendFilled(uint64_t bytes, const Fill& fill);
  // Durable under temp_path() and not yet visible; the file handle and the
  // chunks are let go. For files that must replace their targets together
  // (an export's shards): seal each as it is written, then commit them all,
  // so a failure while writing any leaves every target as it was. On
  // failure nothing is left.
  Status Seal();
  // Durable and visible under path() when OK (seals first when not sealed);
  // on failure nothing is left, except when the rename took effect and what
  // followed it failed (the directory sync): path() then holds the file,
  // perhaps not durably, and in_place() says so.
  Status Commit();
  // Whether a failed Commit renamed the file over path() before it failed.
  bool in_place() const { return in_place_; }

  const std::string& path() const { return path_; }
  const std::string& temp_path() const { return temp_path_; }
  uint64_t appended_bytes() const { return appended_; }  // without padding
  uint64_t file_bytes() const { return offset_ + fill_; }  // with padding, once committed

 private:
  AtomicFileWriter() = default;
  Status Flush();
  Status ReapSome(size_t min);
  Status Drain();
  void Abandon();

  struct Chunk;
  Storage* storage_ = nullptr;
  AtomicWriteOptions options_;
  std::string path_;
  std::string temp_path_;
  std::unique_ptr<File> file_;
  HostRegion buffers_;  // the chunks' memory
  std::vector<std::unique_ptr<Chunk>> chunks_;
  std::vector<uint32_t> free_;
  int cur_ = -1;
  uint64_t fill_ = 0;
  uint64_t offset_ = 0;
  uint64_t appended_ = 0;
  uint64_t align_ = 1;
  Status error_;
  bool sealed_ = false;  // temp_path() is whole and durable; file_ is closed
  bool committed_ = false;
  bool in_place_ = false;  // a failed Commit's rename took effect
};

// What every writer of this process tells the listener (SetAtomicFileListener).
enum class AtomicFileEvent : uint8_t {
  kCreatingTemporary,  // the temporary `path` is about to be created
  kTemporaryGone,      // the temporary `path` was renamed over its target, or removed
  kCommitted,          // the target `path` holds the new file (after kTemporaryGone)
  // The new directory `path` is about to be made for files written here
  // (NotifyCreatingDirectory: a checkpoint's save directory).
  kCreatingDirectory,
};
using AtomicFileListener = std::function<void(AtomicFileEvent, const std::string& path)>;

// Installs `listener` (an empty function: none) for every writer of this
// process and returns the one it replaces. For a command that must remove
// the temporaries when a signal ends it (a signal handler cannot find them:
// tools/cleanup.h). Called on the writer's thread, so it must be
// thread-safe where writers run on several threads, and must not use a
// writer.
AtomicFileListener SetAtomicFileListener(AtomicFileListener listener);

// Tells the listener kCreatingDirectory: for code about to make a new
// directory whose only content will be atomic files, so that a command can
// remove it too when a signal ends it between the mkdir and the first file.
void NotifyCreatingDirectory(const std::string& path);

// The temporaries in `dir` that writers left when their process died
// before removing them (SIGKILL, an out-of-memory kill, a crash): names as
// AtomicFileWriter gives them, ".<target>.tmp-<pid>-<n>", whose `target`
// `wanted` accepts and whose pid is no live process on this host. Sorted
// paths. For a command about to write those targets again, which may remove
// them: nothing reads a temporary. (A writer on another host, writing into
// a shared directory at the same moment, is not told apart.)
std::vector<std::string> DeadTemporaries(const std::string& dir,
                                         const std::function<bool(std::string_view)>& wanted);

// Create, Append(bytes), Commit.
Status WriteFileAtomically(Storage& storage, const std::string& path, std::string_view bytes,
                           AtomicWriteOptions options = {});

// The target check Create and Commit make, for callers that want to refuse
// a bad output before doing any work: OK for a new path or (kReplace) an
// existing regular file; FailedPrecondition otherwise, naming `path`.
Status CheckOutputPath(const std::string& path, ExistingFile existing);

// For a file about to be written: NotFound when the directory of `path` does
// not exist, FailedPrecondition when it (or a directory above it) is not a
// directory, both naming `path` and the directory; OK otherwise.
Status CheckParentDirectory(const std::string& path);

}  // namespace strata
