#include "runtime/atomic_file.h"

#include <fmt/format.h>
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cctype>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <mutex>
#include <random>
#include <vector>

namespace strata {
namespace {

constexpr uint64_t kDirectAlign = 4096;

uint64_t RoundUp(uint64_t v, uint64_t a) { return (v + a - 1) / a * a; }

std::string_view KindOf(mode_t mode) {
  if (S_ISDIR(mode)) return "a directory";
  if (S_ISLNK(mode)) return "a symbolic link";
  if (S_ISCHR(mode) || S_ISBLK(mode)) return "a device";
  if (S_ISFIFO(mode)) return "a fifo";
  if (S_ISSOCK(mode)) return "a socket";
  return "not a regular file";
}

// ".<name>.tmp-<pid>-<n>" next to `path`: unique among the threads and
// processes that write one target at the same time.
std::string TempPathFor(const std::string& path) {
  static std::atomic<uint64_t> counter{0};
  static const uint64_t salt = [] {
    std::random_device rd;
    return (uint64_t{rd()} << 32) | rd();
  }();
  const size_t slash = path.find_last_of('/');
  const std::string dir = slash == std::string::npos ? "" : path.substr(0, slash + 1);
  const std::string name = slash == std::string::npos ? path : path.substr(slash + 1);
  return fmt::format("{}.{}.tmp-{}-{:x}", dir, name, static_cast<long>(::getpid()),
                     salt + counter.fetch_add(1));
}

std::mutex listener_mu;
AtomicFileListener& Listener() {
  static AtomicFileListener* listener = new AtomicFileListener();
  return *listener;
}

void Notify(AtomicFileEvent event, const std::string& path) {
  AtomicFileListener listener;
  {
    std::lock_guard lock(listener_mu);
    listener = Listener();
  }
  if (listener) listener(event, path);
}

// Why the temporary next to `path` could not be created, in terms of `path`
// (the temporary's name means nothing to the caller).
Status OpenTemporaryError(const std::string& path, Status opened) {
  STRATA_RETURN_IF_ERROR(CheckParentDirectory(path));
  return std::move(opened).WithContext("write " + path);
}

Status ExistsError(const std::string& path) {
  return FailedPreconditionError(fmt::format(
      "write {}: the file exists; remove it, choose another path, or allow replacing it "
      "(--force; force=True in Python)",
      path));
}

}  // namespace

AtomicFileListener SetAtomicFileListener(AtomicFileListener listener) {
  std::lock_guard lock(listener_mu);
  std::swap(Listener(), listener);
  return listener;
}

void NotifyCreatingDirectory(const std::string& path) {
  Notify(AtomicFileEvent::kCreatingDirectory, path);
}

Status CheckParentDirectory(const std::string& path) {
  const size_t slash = path.find_last_of('/');
  const std::string dir = slash == std::string::npos ? "."
                          : slash == 0               ? "/"
                                                     : path.substr(0, slash);
  struct stat st;
  if (::stat(dir.c_str(), &st) != 0) {
    if (errno == ENOENT) {
      return NotFoundError(fmt::format(
          "write {}: the parent directory {} does not exist; create it first, or choose another "
          "path",
          path, dir));
    }
    if (errno == ENOTDIR) {
      return FailedPreconditionError(fmt::format(
          "write {}: a component of {} is not a directory; choose another path", path, dir));
    }
    return OkStatus();  // the caller's own error says more
  }
  if (!S_ISDIR(st.st_mode)) {
    return FailedPreconditionError(
        fmt::format("write {}: {} is not a directory; choose another path", path, dir));
  }
  return OkStatus();
}

Status CheckOutputPath(const std::string& path, ExistingFile existing) {
  struct stat st;
  if (::lstat(path.c_str(), &st) != 0) {
    const int err = errno;
    if (err == ENOENT) return OkStatus();
    if (err == ENOTDIR) STRATA_RETURN_IF_ERROR(CheckParentDirectory(path));
    return ErrnoError(err, "write " + path);
  }
  if (!S_ISREG(st.st_mode)) {
    return FailedPreconditionError(fmt::format(
        "write {}: it is {}, not a regular file; give the path of a new file", path,
        KindOf(st.st_mode)));
  }
  if (existing == ExistingFile::kRefuse) return ExistsError(path);
  return OkStatus();
}

// One write buffer, 4096-aligned (O_DIRECT) in the writer's buffers_, and
// its request.
struct AtomicFileWriter::Chunk {
  std::byte* data = nullptr;
  IoRequest request;
};

Result<std::unique_ptr<AtomicFileWriter>> AtomicFileWriter::Create(Storage& storage,
                                                                   const std::string& path,
                                                                   AtomicWriteOptions options) {
  const bool direct = options.direct != DirectIo::kOff;
  if (options.chunk_bytes == 0 || options.chunk_bytes > kMaxAtomicWriteChunkBytes ||
      (direct && options.chunk_bytes % kDirectAlign != 0)) {
    return InvalidArgumentError(
        fmt::format("write {}: chunk_bytes {} must be positive, at most {} (256 MiB){}", path,
                    options.chunk_bytes, kMaxAtomicWriteChunkBytes,
                    direct ? " and a multiple of 4096 (O_DIRECT)" : ""));
  }
  STRATA_RETURN_IF_ERROR(CheckOutputPath(path, options.existing));
  if (options.existing == ExistingFile::kRefuse &&
      storage.Open(path, {.direct = DirectIo::kOff, .access = FileAccess::kReadOnly}).ok()) {
    return ExistsError(path);  // a file only the storage knows (the in-memory backend)
  }
  auto w = std::unique_ptr<AtomicFileWriter>(new AtomicFileWriter());
  w->storage_ = &storage;
  w->path_ = path;
  w->temp_path_ = TempPathFor(path);
  const uint32_t depth = std::max<uint32_t>(options.queue_depth, 1);
  Notify(AtomicFileEvent::kCreatingTemporary, w->temp_path_);
  auto opened = storage.Open(w->temp_path_, {.create = FileCreate::kCreate,
                                             .direct = options.direct,
                                             .queue_depth = depth});
  if (!opened.ok()) {
    Notify(AtomicFileEvent::kTemporaryGone, w->temp_path_);
    return OpenTemporaryError(path, std::move(opened).status());
  }
  w->file_ = std::move(*opened);
  w->align_ = direct ? std::max<uint64_t>(w->file_->info().alignment_bytes, kDirectAlign) : 1;
  if (direct && options.chunk_bytes % w->align_ != 0) {
    const Status bad = InvalidArgumentError(
        fmt::format("write {}: chunk_bytes {} is not a multiple of the device's direct-IO "
                    "alignment {}",
                    path, options.chunk_bytes, w->align_));
    w->Abandon();
    return bad;
  }
  if (Status s = w->file_->Resize(0); !s.ok()) {
    w->Abandon();
    return s;
  }
  if (options.size_hint > 0) {
    if (Status s = w->file_->Resize(options.size_hint); !s.ok()) {
      w->Abandon();
      return std::move(s).WithContext("write " + path);
    }
  }
  const uint64_t stride = RoundUp(options.chunk_bytes, kDirectAlign);
  Result<HostRegion> buffers = HostRegion::Map(depth * stride);
  if (!buffers.ok()) {
    const Status none = ResourceExhaustedError(fmt::format(
        "write {}: no memory for {} write buffers of {} bytes (queue_depth x chunk_bytes); "
        "lower either",
        path, depth, options.chunk_bytes));
    w->Abandon();
    return none;
  }
  w->buffers_ = std::move(*buffers);
  for (uint32_t i = 0; i < depth; ++i) {
    w->chunks_.push_back(std::make_unique<Chunk>());
    w->chunks_.back()->data = w->buffers_.data() + i * stride;
    w->free_.push_back(i);
  }
  w->options_ = std::move(options);
  return w;
}

AtomicFileWriter::~AtomicFileWriter() {
  if (!committed_) Abandon();
}

void AtomicFileWriter::Abandon() {
  if (file_ || sealed_) {
    Drain().IgnoreError();
    file_.reset();
    storage_->Remove(temp_path_).IgnoreError();
    Notify(AtomicFileEvent::kTemporaryGone, temp_path_);
  }
  sealed_ = false;
  committed_ = false;
}

Status AtomicFileWriter::Append(std::span<const std::byte> bytes) {
  return AppendFilled(bytes.size(), [&](std::span<std::byte> piece) {
    std::memcpy(piece.data(), bytes.data(), piece.size());
    bytes = bytes.subspan(piece.size());
    return OkStatus();
  });
}

Status AtomicFileWriter::AppendFilled(uint64_t bytes, const Fill& fill) {
  if (!error_.ok()) return error_;
  if (!file_) return FailedPreconditionError("write " + path_ + ": the writer is finished");
  while (bytes > 0) {
    if (cur_ < 0) {
      while (free_.empty()) {
        if (Status s = ReapSome(1); !s.ok()) return error_ = s;
      }
      if (!error_.ok()) return error_;
      cur_ = static_cast<int>(free_.back());
      free_.pop_back();
      fill_ = 0;
    }
    const uint64_t n = std::min<uint64_t>(bytes, options_.chunk_bytes - fill_);
    if (Status s = fill({chunks_[cur_]->data + fill_, n}); !s.ok()) return error_ = s;
    fill_ += n;
    appended_ += n;
    bytes -= n;
    if (fill_ == options_.chunk_bytes) {
      if (Status s = Flush(); !s.ok()) return error_ = s;
    }
  }
  return OkStatus();
}

Status AtomicFileWriter::Flush() {
  const int slot = cur_;
  const uint64_t padded = RoundUp(fill_, align_);
  std::memset(chunks_[slot]->data + fill_, 0, padded - fill_);
  std::span<std::byte> data(chunks_[slot]->data, padded);
  if (options_.on_chunk) options_.on_chunk(data);
  chunks_[slot]->request = IoRequest::Write(offset_, data, static_cast<uint64_t>(slot));
  offset_ += padded;
  cur_ = -1;
  fill_ = 0;
  Status s = file_->Submit({&chunks_[slot]->request, 1});
  if (!s.ok()) {
    free_.push_back(static_cast<uint32_t>(slot));
    return std::move(s).WithContext("write " + path_);
  }
  return OkStatus();
}

Status AtomicFileWriter::ReapSome(size_t min) {
  std::vector<IoRequest*> done(chunks_.size());
  STRATA_ASSIGN_OR_RETURN(size_t n, file_->Reap(done, min));
  for (size_t k = 0; k < n; ++k) {
    if (!done[k]->status.ok() && error_.ok()) {
      error_ = done[k]->status.WithContext("write " + path_);
    }
    free_.push_back(static_cast<uint32_t>(done[k]->user_data));
  }
  return OkStatus();
}

Status AtomicFileWriter::Drain() {
  while (file_ && file_->InFlight() > 0) STRATA_RETURN_IF_ERROR(ReapSome(file_->InFlight()));
  return OkStatus();
}

Status AtomicFileWriter::Seal() {
  if (sealed_) return OkStatus();
  if (!file_) return error_.ok() ? FailedPreconditionError("write " + path_ + ": committed") : error_;
  Status s = error_;
  if (s.ok() && cur_ >= 0 && fill_ > 0) s = Flush();
  if (Status d = Drain(); s.ok()) s = d;
  if (s.ok()) s = error_;
  if (s.ok() && options_.size_hint > 0 && options_.size_hint != file_bytes()) {
    s = file_->Resize(file_bytes()).WithContext("write " + path_);
  }
  if (s.ok()) s = file_->Sync().WithContext("write " + path_ + ": fsync " + temp_path_);
  if (!s.ok()) {
    Abandon();
    return error_ = s;
  }
  file_.reset();
  chunks_.clear();
  buffers_ = HostRegion();
  free_.clear();
  sealed_ = true;
  return OkStatus();
}

Status AtomicFileWriter::Commit() {
  STRATA_RETURN_IF_ERROR(Seal());
  Status s = CheckOutputPath(path_, options_.existing);  // nothing appeared meanwhile
  if (!s.ok()) {
    Abandon();
    return error_ = s;
  }
  s = storage_->Rename(temp_path_, path_);
  if (s.ok()) {
    sealed_ = false;
    committed_ = true;
    Notify(AtomicFileEvent::kTemporaryGone, temp_path_);
    Notify(AtomicFileEvent::kCommitted, path_);
    return OkStatus();
  }
  // A rename that took effect and then failed (the sync of the directory):
  // the temporary is gone, and the target is this file. The caller says so
  // (an export's shards in place).
  in_place_ =
      storage_->Open(temp_path_, {.direct = DirectIo::kOff, .access = FileAccess::kReadOnly})
          .status()
          .code() == StatusCode::kNotFound;
  Abandon();
  return error_ = s;
}

std::vector<std::string> DeadTemporaries(const std::string& dir,
                                         const std::function<bool(std::string_view)>& wanted) {
  std::vector<std::string> dead;
  std::error_code ec;
  for (const auto& entry : std::filesystem::directory_iterator(dir.empty() ? "." : dir, ec)) {
    const std::string name = entry.path().filename().string();
    // ".<target>.tmp-<pid>-<hex>"
    const size_t tmp = name.rfind(".tmp-");
    if (name.size() < 2 || name[0] != '.' || tmp == std::string::npos || tmp < 2) continue;
    const size_t dash = name.find('-', tmp + 5);
    if (dash == std::string::npos || dash == tmp + 5 || dash + 1 == name.size()) continue;
    const std::string_view pid_text = std::string_view(name).substr(tmp + 5, dash - tmp - 5);
    const std::string_view hex = std::string_view(name).substr(dash + 1);
    if (!std::all_of(pid_text.begin(), pid_text.end(),
                     [](char c) { return c >= '0' && c <= '9'; }) ||
        !std::all_of(hex.begin(), hex.end(), [](char c) { return std::isxdigit(c) != 0; }) ||
        pid_text.size() > 9) {
      continue;
    }
    const pid_t pid = static_cast<pid_t>(std::stol(std::string(pid_text)));
    if (pid <= 0 || !wanted(std::string_view(name).substr(1, tmp - 1))) continue;
    if (::kill(pid, 0) == 0 || errno != ESRCH) continue;  // alive, or not ours to signal
    if (!entry.is_regular_file(ec)) continue;
    dead.push_back(entry.path().string());
  }
  std::sort(dead.begin(), dead.end());
  return dead;
}

Status WriteFileAtomically(Storage& storage, const std::string& path, std::string_view bytes,
                           AtomicWriteOptions options) {
  STRATA_ASSIGN_OR_RETURN(auto writer, AtomicFileWriter::Create(storage, path, std::move(options)));
  STRATA_RETURN_IF_ERROR(writer->Append(bytes));
  return writer->Commit();
}

}  // namespace strata
