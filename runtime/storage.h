// Storage: asynchronous block IO on files, the layer under the NVMe state store.
//
// A Storage opens Files; a File takes batches of IoRequests (read or write of
// one buffer at one offset) and hands them back when they are complete. Each
// request carries its own result, so a caller can have many in flight and act
// on each as it finishes. Backends:
//   io_uring  O_DIRECT, buffers and the file registered with the ring (fixed
//             reads/writes), one io_uring_submit per batch, optional SQPOLL.
//   posix     a pread/pwrite thread pool: the reference, and the fallback
//             where io_uring is refused (seccomp, old kernel), with one warning.
//   mem       in-memory files, for tests.
// Forwarding wrappers: counting (below), fault injection and manual completion
// (runtime/testing/).
//
//   STRATA_ASSIGN_OR_RETURN(auto storage, CreateStorage({.backend = StorageBackend::kUring}));
//   STRATA_ASSIGN_OR_RETURN(auto file, storage->Open("/nvme/x.state", {.create =
//   FileCreate::kCreate})); STRATA_RETURN_IF_ERROR(file->Resize(64 * kMiB)); std::array<IoRequest,
//   2> reqs = {IoRequest::Write(0, buf_a), IoRequest::Write(kMiB, buf_b)};
//   STRATA_RETURN_IF_ERROR(file->Submit(reqs));
//   std::array<IoRequest*, 2> done;
//   STRATA_ASSIGN_OR_RETURN(size_t n, file->Reap(done, /*min_completions=*/2));
//   for (IoRequest* r : std::span(done).first(n)) STRATA_RETURN_IF_ERROR(r->status);
//
// Completion: a request is reaped once, when all of its buffer was transferred
// (status OK, transferred_bytes == buffer.size()) or when it failed (status
// names the op, file, offset and size: "read /nvme/x.state@4096+1MiB: EIO
// (Input/output error)"). Short transfers are resumed and EINTR/EAGAIN retried
// (a bounded number of times) inside the file, by InterpretCompletion().
//
// Alignment (O_DIRECT): when a file is opened with DirectIo::kAuto or kRequire,
// buffer address, offset and length must be multiples of
// FileInfo::alignment_bytes (4096, or the device's direct-IO alignment if
// larger). Submit() rejects the whole batch with InvalidArgument naming the bad
// value, before anything reaches the kernel. The check applies even where the
// filesystem refused O_DIRECT and the file fell back to buffered IO, so code
// tested on tmpfs behaves the same on a real drive.
//
// Ownership and threads: requests are submitted by pointer and must stay alive
// and unmoved, with their buffers, until reaped. A File is driven by one thread
// at a time (Submit/Reap/Sync are not concurrent); different Files are
// independent. A Storage is thread-safe. Destroying a File waits for its
// requests in flight. Destructors never fail.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>

#include "runtime/status.h"

namespace strata {

enum class IoOp : uint8_t { kRead, kWrite };

// One read or write of `buffer` at `offset_bytes`. The caller sets the first
// four fields; the file sets the rest while the request is in flight.
struct IoRequest {
  IoOp op = IoOp::kRead;
  uint64_t offset_bytes = 0;
  std::span<std::byte> buffer;
  uint64_t user_data = 0;  // for the caller: never read by the file

  // The result, valid once reaped: OK and transferred_bytes == buffer.size(),
  // or the error.
  Status status;
  uint64_t transferred_bytes = 0;
  // Progress bookkeeping of the file while in flight (EINTR/EAGAIN/zero-byte
  // retries so far). Reset by Submit().
  uint32_t retries = 0;

  static IoRequest Read(uint64_t offset_bytes, std::span<std::byte> buffer,
                        uint64_t user_data = 0) {
    return IoRequest{IoOp::kRead, offset_bytes, buffer, user_data, {}, 0, 0};
  }
  static IoRequest Write(uint64_t offset_bytes, std::span<std::byte> buffer,
                         uint64_t user_data = 0) {
    return IoRequest{IoOp::kWrite, offset_bytes, buffer, user_data, {}, 0, 0};
  }
};

// How one raw completion (bytes moved by one attempt, or -errno) is handled.
enum class CompletionAction : uint8_t {
  kDone,      // all bytes transferred: reap it with OK
  kResubmit,  // short transfer or EINTR/EAGAIN: submit the remainder again
  kFail,      // reap it with `status`
};
struct CompletionDecision {
  CompletionAction action;
  uint64_t transferred_bytes;  // total after this attempt
  uint32_t retries;            // retries after this attempt
  Status status;               // the error when kFail
};
// Retries of EINTR/EAGAIN or zero-byte writes before a request fails with
// Unavailable.
inline constexpr uint32_t kMaxIoRetries = 16;

// The single place that interprets a completion. Pure: reads `request`
// (op, offset, buffer size, transferred_bytes and retries so far) and
// `raw_result` (bytes moved by this attempt, or -errno), returns what to do.
// A read that hits end of file fails with OutOfRange; an errno fails with its
// code (EIO -> Internal, ENOSPC -> ResourceExhausted, ...) and a message
// "<op> <path>@<offset>+<size>: ENAME (text)".
CompletionDecision InterpretCompletion(const IoRequest& request, std::string_view path,
                                       int64_t raw_result);

// "/nvme/x.state@4096+1MiB": how IO errors name their object.
std::string IoObjectName(std::string_view path, uint64_t offset_bytes, uint64_t size_bytes);

enum class FileCreate : uint8_t { kOpenExisting, kCreate };  // kCreate: create if missing
// kReadOnly: opened for reading only (O_RDONLY), so a file this process may
// not write (mode 0444, a read-only mount, another user's file) opens and
// reads. A write request or Resize on it fails with FailedPrecondition
// naming the file; it cannot be combined with FileCreate::kCreate
// (InvalidArgument). Readers of files they never change (checkpoint
// readers, strata inspect/export) use it.
enum class FileAccess : uint8_t { kReadWrite, kReadOnly };
// kAuto: O_DIRECT, or buffered IO with one warning where the filesystem
// refuses it (tmpfs). kRequire: fail where refused. kOff: buffered IO.
enum class DirectIo : uint8_t { kAuto, kRequire, kOff };
enum class IoMode : uint8_t { kDirect, kBuffered };  // what the file actually does

struct FileOptions {
  FileCreate create = FileCreate::kOpenExisting;
  DirectIo direct = DirectIo::kAuto;
  // Requests in flight in the kernel at most (io_uring SQ size; posix threads
  // are min(queue_depth, 16)). More may be submitted: they wait in the file.
  uint32_t queue_depth = 32;
  FileAccess access = FileAccess::kReadWrite;
};

struct FileInfo {
  std::string path;
  std::string backend;  // "uring", "posix", "mem", or a wrapper "counting(uring)"
  IoMode io_mode = IoMode::kBuffered;
  FileAccess access = FileAccess::kReadWrite;  // as opened
  uint64_t alignment_bytes = 1;                // required alignment of buffer, offset and size
  uint32_t queue_depth = 0;
  bool fixed_buffers = false;        // RegisterBuffers() took effect (io_uring)
  uint32_t fixed_buffer_ranges = 0;  // kernel registrations made of them (<= 1 GiB each)
  bool fixed_file = false;           // the fd is in the ring's registered file table
};

class File {
 public:
  virtual ~File() = default;
  File() = default;
  File(const File&) = delete;
  File& operator=(const File&) = delete;

  virtual const FileInfo& info() const = 0;

  // Starts every request of the batch, or none: a request with a misaligned
  // or empty buffer gives InvalidArgument, a write to a file opened
  // FileAccess::kReadOnly FailedPrecondition, and nothing is submitted.
  // When the kernel refuses to take requests (io_uring_submit fails with
  // other than EAGAIN/EBUSY, which are waited out), the requests it has not
  // taken complete with that error, never to run, and the file refuses new
  // batches (FailedPrecondition): close and reopen it.
  virtual Status Submit(std::span<IoRequest> requests) = 0;

  // Waits until min(min_completions, InFlight()) requests are complete, then
  // stores up to completed.size() of the complete ones (in completion order)
  // and returns how many. Returns 0 at once when min_completions is 0 and
  // nothing is complete. Errors of a request are in its own status; Reap fails
  // only when the backend itself broke (the ring, a thread).
  virtual Result<size_t> Reap(std::span<IoRequest*> completed, size_t min_completions) = 0;

  // Submitted and not yet reaped.
  virtual size_t InFlight() const = 0;

  // Makes completed writes durable (fdatasync).
  virtual Status Sync() = 0;

  // Sets the file's size. Growing reserves the new space on the disk
  // (fallocate), so a full disk fails here, not at a later write; where the
  // filesystem cannot reserve (EOPNOTSUPP, EINVAL), the file grows sparse.
  // Copy-on-write filesystems (btrfs, ZFS) may still run out at a write; on
  // tmpfs the reserve is memory.
  // ResourceExhausted when the disk is full; FailedPrecondition on a file
  // opened FileAccess::kReadOnly.
  virtual Status Resize(uint64_t size_bytes) = 0;
  virtual Result<uint64_t> SizeBytes() = 0;

  // Registers long-lived buffers (pinned staging memory) with the backend;
  // requests whose buffer lies inside one of them use fixed-buffer IO.
  // Buffers may have any size: io_uring takes at most 1 GiB per registered
  // buffer, so a larger one is registered as pieces of 1 GiB cut at multiples
  // of 1 GiB from its start (FileInfo::fixed_buffer_ranges counts them). A
  // request inside one piece uses fixed IO; one that straddles a cut is
  // submitted unregistered (correct, a little more kernel work). Requests of
  // a power-of-two size, aligned to that size within their buffer, never
  // straddle. Replaces an earlier registration; needs no IO in flight
  // (FailedPrecondition otherwise). Backends without the notion accept and
  // ignore it. Where the kernel refuses, it warns once, naming the cause
  // (RLIMIT_MEMLOCK and its value, memory it cannot pin, or the errno) and
  // what to do, and IO proceeds unregistered (still OK).
  virtual Status RegisterBuffers(std::span<const std::span<std::byte>> buffers) = 0;
};

enum class StorageBackend : uint8_t { kUring, kPosix, kMem };
enum class SqPoll : uint8_t { kOff, kOn };
// What CreateStorage does when io_uring is refused by the kernel.
enum class UringFallback : uint8_t { kPosix, kFail };

struct StorageOptions {
  StorageBackend backend = StorageBackend::kUring;
  SqPoll sqpoll = SqPoll::kOff;
  UringFallback fallback = UringFallback::kPosix;
};

// A lock taken with Storage::Lock; destroying the handle releases it.
class StorageLock {
 public:
  virtual ~StorageLock() = default;
};

class Storage {
 public:
  virtual ~Storage() = default;
  Storage() = default;
  Storage(const Storage&) = delete;
  Storage& operator=(const Storage&) = delete;

  virtual std::string_view name() const = 0;
  // NotFound when missing and options.create is kOpenExisting; InvalidArgument
  // when O_DIRECT is required and refused, or for kCreate with kReadOnly; the
  // errno otherwise (EACCES for a file this process may not open as asked).
  virtual Result<std::unique_ptr<File>> Open(const std::string& path,
                                             const FileOptions& options) = 0;
  // Removes a file (NotFound when missing).
  virtual Status Remove(const std::string& path) = 0;
  // Renames `from` to `to`, replacing `to` atomically when it exists
  // (readers see the old file or the new one, never a mix), and makes the
  // rename durable (the directory of `to` is synced) before returning.
  // NotFound when `from` is missing. Files open under the old name keep
  // working. Whole files are written through AtomicFileWriter
  // (runtime/atomic_file.h), which ends with this.
  virtual Status Rename(const std::string& from, const std::string& to) = 0;
  // An exclusive lock named by `path`, held until the handle is destroyed.
  // File backends: a FileLock on the file `path` (runtime/file_lock.h:
  // flock, the holder's pid inside, released when the process dies); mem: a
  // name taken in this storage. FailedPrecondition naming `path` and, where
  // known, the holder's pid while someone else holds it (LockHeldByAnother
  // in runtime/file_lock.h tells it from a lock file that cannot be created
  // or opened, EACCES or EROFS, whose errno is named); never blocks.
  virtual Result<std::unique_ptr<StorageLock>> Lock(const std::string& path) = 0;
};

// Makes a storage of `options.backend`. io_uring refused (EPERM/ENOSYS from
// io_uring_queue_init, a build without liburing, or STRATA_URING_REFUSE=1 in
// the environment, which tests use) gives the posix backend with one warning,
// or Unavailable when options.fallback is kFail.
Result<std::unique_ptr<Storage>> CreateStorage(const StorageOptions& options);

// Direct constructors, for tests and tools.
Result<std::unique_ptr<Storage>> CreateUringStorage(SqPoll sqpoll);  // Unavailable when refused
std::unique_ptr<Storage> CreatePosixStorage();
std::unique_ptr<Storage> CreateMemStorage();
// Whether this build has the io_uring backend and the kernel accepts it.
bool UringAvailable();

// Counting wrapper: forwards everything, counts ops and bytes of completed
// requests. The counters are shared with the caller and thread-safe.
struct IoCounters {
  std::atomic<uint64_t> reads{0};
  std::atomic<uint64_t> writes{0};
  std::atomic<uint64_t> read_bytes{0};
  std::atomic<uint64_t> write_bytes{0};
  std::atomic<uint64_t> errors{0};
  std::atomic<uint64_t> syncs{0};
  std::atomic<uint64_t> opens{0};
  std::atomic<uint64_t> read_only_opens{0};  // of `opens`, those with FileAccess::kReadOnly
};
std::unique_ptr<Storage> CreateCountingStorage(std::unique_ptr<Storage> base,
                                               std::shared_ptr<IoCounters> counters);

}  // namespace strata
