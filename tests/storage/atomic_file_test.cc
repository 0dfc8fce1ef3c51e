// AtomicFileWriter (runtime/atomic_file.h) on every backend, under faults,
// and FileLock (runtime/file_lock.h) across processes.
#include "runtime/atomic_file.h"

#include <fcntl.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <sys/vfs.h>
#include <sys/wait.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <functional>
#include <sstream>
#include <thread>
#include <vector>

#include "runtime/file_lock.h"
#include "runtime/machine.h"
#include "runtime/storage.h"
#include "runtime/testing/fault_storage.h"
#include "runtime/testing/test_util.h"

namespace strata {
namespace {

namespace fs = std::filesystem;
using testing::FaultStorage;
using testing::TempDir;

std::string ReadAll(const std::string& path) { return testing::ReadFileBytes(path); }
std::vector<std::string> Names(const std::string& dir) { return testing::DirNames(dir); }

std::string Pattern(size_t bytes, uint64_t seed) {
  std::string s(bytes, '\0');
  testing::FillPattern(std::as_writable_bytes(std::span(s.data(), s.size())), seed);
  return s;
}

struct Backend {
  std::string name;
  std::function<std::unique_ptr<Storage>()> make;
};

std::vector<Backend> FileBackends() {
  std::vector<Backend> out = {{"posix", [] { return CreatePosixStorage(); }}};
  if (UringAvailable()) {
    out.push_back({"uring", [] { return std::move(CreateUringStorage(SqPoll::kOff)).value(); }});
  }
  return out;
}

// What a writer killed before it removed its temporary left: only names as
// the writer gives them, of targets the caller wants, whose pid is no live
// process, and only regular files.
TEST(DeadTemporariesTest, OnlyTheTemporariesOfDeadProcessesAndWantedTargets) {
  TempDir dir;
  const std::string dead = std::to_string(testing::DeadPid());
  const std::string alive = std::to_string(::getpid());
  for (const std::string& name : std::vector<std::string>{
           ".a.bin.tmp-" + dead + "-1f",    // listed
           ".a.bin.tmp-" + dead + "-2a3b",  // listed
           ".a.bin.tmp-" + alive + "-3",    // this process: alive
           ".a.bin.tmp-1-4",                // pid 1: alive
           ".b.bin.tmp-" + dead + "-5",     // not a wanted target
           ".a.bin.tmp-" + dead + "-zz",    // not a writer's name
           "a.bin.tmp-" + dead + "-6",      // no leading dot
           ".a.bin.tmp--7", ".a.bin.tmp-" + dead + "-", ".tmp-" + dead + "-8"}) {
    std::ofstream(dir.File(name)) << "x";
  }
  fs::create_directory(dir.File(".a.bin.tmp-" + dead + "-9"));  // not a file
  const std::vector<std::string> want = {dir.File(".a.bin.tmp-" + dead + "-1f"),
                                         dir.File(".a.bin.tmp-" + dead + "-2a3b")};
  EXPECT_EQ(DeadTemporaries(dir.path(), [](std::string_view t) { return t == "a.bin"; }), want);
  EXPECT_TRUE(DeadTemporaries(dir.File("missing"), [](std::string_view) { return true; }).empty());
}

TEST(AtomicFileTest, ManyChunksReadBackBitwiseAndOnlyTheTargetRemains) {
  for (const Backend& b : FileBackends()) {
    SCOPED_TRACE(b.name);
    TempDir dir;
    auto storage = b.make();
    const std::string data = Pattern(100'000, 7);
    auto w = AtomicFileWriter::Create(*storage, dir.File("out.bin"),
                                      {.chunk_bytes = 4096, .queue_depth = 3});
    ASSERT_TRUE(w.ok()) << w.status();
    // Odd pieces, so chunks fill across Append calls.
    for (size_t at = 0; at < data.size(); at += 999) {
      ASSERT_TRUE((*w)->Append(std::string_view(data).substr(at, 999)).ok());
    }
    EXPECT_FALSE(fs::exists(dir.File("out.bin"))) << "visible only after Commit";
    ASSERT_TRUE((*w)->Commit().ok());
    EXPECT_EQ(ReadAll(dir.File("out.bin")), data);
    EXPECT_EQ(Names(dir.path()), std::vector<std::string>{"out.bin"});
  }
}

TEST(AtomicFileTest, TheMemBackendWritesAndRefusesAnExistingFile) {
  auto storage = CreateMemStorage();
  ASSERT_TRUE(WriteFileAtomically(*storage, "/mem/a", "hello").ok());
  auto f = storage->Open("/mem/a", {.direct = DirectIo::kOff});
  ASSERT_TRUE(f.ok());
  EXPECT_EQ((*f)->SizeBytes().value(), 5u);
  Status s = WriteFileAtomically(*storage, "/mem/a", "other", {.existing = ExistingFile::kRefuse});
  EXPECT_EQ(s.code(), StatusCode::kFailedPrecondition) << s;
  EXPECT_TRUE(WriteFileAtomically(*storage, "/mem/a", "other").ok());  // kReplace
}

TEST(AtomicFileTest, ReplaceNeedsKReplaceAndRefusalLeavesTheFileAlone) {
  TempDir dir;
  auto storage = CreatePosixStorage();
  const std::string path = dir.File("model.bin");
  ASSERT_TRUE(WriteFileAtomically(*storage, path, "old").ok());
  Status refused = WriteFileAtomically(*storage, path, "new", {.existing = ExistingFile::kRefuse});
  EXPECT_EQ(refused.code(), StatusCode::kFailedPrecondition) << refused;
  EXPECT_NE(refused.message().find(path), std::string_view::npos) << refused;
  EXPECT_NE(refused.message().find("--force"), std::string_view::npos) << refused;
  EXPECT_EQ(ReadAll(path), "old");
  ASSERT_TRUE(WriteFileAtomically(*storage, path, "new", {.existing = ExistingFile::kReplace}).ok());
  EXPECT_EQ(ReadAll(path), "new");
  EXPECT_EQ(Names(dir.path()), std::vector<std::string>{"model.bin"});
}

TEST(AtomicFileTest, NeverWritesOverADirectoryLinkDeviceOrFifo) {
  TempDir dir;
  auto storage = CreatePosixStorage();
  ASSERT_TRUE(WriteFileAtomically(*storage, dir.File("target"), "keep").ok());
  fs::create_directory(dir.File("d"));
  fs::create_symlink(dir.File("target"), dir.File("link"));
  ASSERT_EQ(::mkfifo(dir.File("fifo").c_str(), 0644), 0);
  for (const auto& [path, kind] : std::vector<std::pair<std::string, std::string>>{
           {dir.File("d"), "a directory"},
           {dir.File("link"), "a symbolic link"},
           {dir.File("fifo"), "a fifo"},
           {"/dev/null", "a device"}}) {
    for (ExistingFile e : {ExistingFile::kRefuse, ExistingFile::kReplace}) {
      Status s = WriteFileAtomically(*storage, path, "x", {.existing = e});
      EXPECT_EQ(s.code(), StatusCode::kFailedPrecondition) << path << ": " << s;
      EXPECT_NE(s.message().find(kind), std::string_view::npos) << s;
    }
  }
  EXPECT_EQ(ReadAll(dir.File("target")), "keep");
  EXPECT_TRUE(fs::is_symlink(dir.File("link")));
  EXPECT_TRUE(fs::is_character_file("/dev/null"));
}

// A target whose directory is missing (or is a file) is named as the caller
// gave it, with the cause; never by the hidden temporary name.
TEST(AtomicFileTest, AMissingParentDirectoryIsNamedNotTheTemporary) {
  TempDir dir;
  std::ofstream(dir.File("file")) << "x";
  for (const auto& backend : FileBackends()) {
    SCOPED_TRACE(backend.name);
    auto storage = backend.make();
    const std::string missing = dir.File("nope/model.safetensors");
    Status s = WriteFileAtomically(*storage, missing, "x");
    EXPECT_EQ(s.code(), StatusCode::kNotFound) << s;
    EXPECT_NE(s.message().find("write " + missing + ": the parent directory " + dir.File("nope") +
                               " does not exist"),
              std::string_view::npos)
        << s;
    EXPECT_EQ(s.message().find(".tmp-"), std::string_view::npos) << s;
    const std::string under_file = dir.File("file/model.safetensors");
    s = WriteFileAtomically(*storage, under_file, "x");
    EXPECT_EQ(s.code(), StatusCode::kFailedPrecondition) << s;
    EXPECT_NE(s.message().find("write " + under_file + ": " + dir.File("file") +
                               " is not a directory"),
              std::string_view::npos)
        << s;
    EXPECT_EQ(s.message().find(".tmp-"), std::string_view::npos) << s;
  }
  EXPECT_EQ(Names(dir.path()), std::vector<std::string>{"file"});
}

TEST(AtomicFileTest, AnAbandonedWriterLeavesTheOldFileAndNoTemporary) {
  TempDir dir;
  auto storage = CreatePosixStorage();
  const std::string path = dir.File("latest.json");
  ASSERT_TRUE(WriteFileAtomically(*storage, path, "v1").ok());
  {
    auto w = AtomicFileWriter::Create(*storage, path);
    ASSERT_TRUE(w.ok());
    ASSERT_TRUE((*w)->Append(Pattern(3 << 20, 1)).ok());
    EXPECT_TRUE(fs::exists((*w)->temp_path()));
  }
  EXPECT_EQ(ReadAll(path), "v1");
  EXPECT_EQ(Names(dir.path()), std::vector<std::string>{"latest.json"});
}

// Seal makes the temporary whole and durable and lets go of the file and
// the chunks, without touching the target: dropped, the temporary goes and
// the old file stays; committed, it is renamed into place. Appending after
// a seal is refused. Files that must replace their targets together (an
// export's shards) are sealed one by one and committed once all are.
TEST(AtomicFileTest, ASealedWriterTouchesNoTargetUntilItsCommit) {
  TempDir dir;
  auto storage = CreatePosixStorage();
  const std::string a = dir.File("a"), b = dir.File("b");
  ASSERT_TRUE(WriteFileAtomically(*storage, a, "old a").ok());
  ASSERT_TRUE(WriteFileAtomically(*storage, b, "old b").ok());
  const std::string data = Pattern(3 << 20, 2);
  {
    auto w = AtomicFileWriter::Create(*storage, a);
    ASSERT_TRUE(w.ok());
    ASSERT_TRUE((*w)->Append(data).ok());
    ASSERT_TRUE((*w)->Seal().ok());
    ASSERT_TRUE((*w)->Seal().ok()) << "twice: nothing more";
    EXPECT_EQ(ReadAll((*w)->temp_path()), data);
    EXPECT_EQ(ReadAll(a), "old a");
    EXPECT_EQ((*w)->Append("x").code(), StatusCode::kFailedPrecondition);
  }
  EXPECT_EQ(ReadAll(a), "old a");
  EXPECT_EQ(Names(dir.path()), (std::vector<std::string>{"a", "b"}));

  std::vector<std::unique_ptr<AtomicFileWriter>> sealed;
  for (const std::string& path : {a, b}) {
    auto w = AtomicFileWriter::Create(*storage, path);
    ASSERT_TRUE(w.ok());
    ASSERT_TRUE((*w)->Append(path + data).ok());
    ASSERT_TRUE((*w)->Seal().ok());
    sealed.push_back(std::move(*w));
  }
  EXPECT_EQ(ReadAll(a), "old a");
  EXPECT_EQ(ReadAll(b), "old b");
  for (auto& w : sealed) ASSERT_TRUE(w->Commit().ok());
  EXPECT_EQ(sealed[0]->Commit().code(), StatusCode::kFailedPrecondition) << "committed";
  sealed.clear();
  EXPECT_EQ(ReadAll(a), a + data);
  EXPECT_EQ(ReadAll(b), b + data);
  EXPECT_EQ(Names(dir.path()), (std::vector<std::string>{"a", "b"}));
}

// Every kind of write fault: the call that sees it fails, naming the file;
// the target keeps its old content and no temporary file is left.
TEST(AtomicFileTest, FaultsFailTheWriteAndLeaveTheOldFileAndNoTemporary) {
  const std::vector<std::pair<std::string, testing::FaultOptions>> faults = {
      {"write EIO", {.seed = 3, .write_eio_one_in = 3}},
      {"ENOSPC", {.seed = 4, .write_enospc_one_in = 2}},
      {"fsync EIO", {.seed = 5, .sync_eio_one_in = 1}},
  };
  for (const auto& [what, options] : faults) {
    SCOPED_TRACE(what);
    TempDir dir;
    auto fault = FaultStorage::Create(CreatePosixStorage(), {});
    const std::string path = dir.File("model.safetensors");
    ASSERT_TRUE(WriteFileAtomically(*fault, path, "old").ok());
    fault->SetOptions(options);
    Status s = [&]() -> Status {
      STRATA_ASSIGN_OR_RETURN(auto w, AtomicFileWriter::Create(*fault, path,
                                                              {.chunk_bytes = 4096}));
      STRATA_RETURN_IF_ERROR(w->Append(Pattern(64 << 10, 2)));
      return w->Commit();
    }();
    EXPECT_FALSE(s.ok());
    EXPECT_NE(s.message().find("model.safetensors"), std::string_view::npos) << s;
    EXPECT_GT(fault->stats().injected_errors.load(), 0u);
    EXPECT_EQ(ReadAll(path), "old");
    EXPECT_EQ(Names(dir.path()), std::vector<std::string>{"model.safetensors"});
  }
}

TEST(AtomicFileTest, DirectIoPadsTheTailAndOnChunkSeesEveryByteWritten) {
  TempDir dir;
  auto storage = CreatePosixStorage();
  uint64_t seen = 0;
  std::string seen_bytes;
  auto w = AtomicFileWriter::Create(
      *storage, dir.File("a.f32"),
      {.direct = DirectIo::kAuto,
       .chunk_bytes = 8192,
       .queue_depth = 2,
       .on_chunk = [&](std::span<const std::byte> c) {
         seen += c.size();
         seen_bytes.append(reinterpret_cast<const char*>(c.data()), c.size());
       }});
  ASSERT_TRUE(w.ok()) << w.status();
  const std::string data = Pattern(10'000, 9);
  ASSERT_TRUE((*w)->Append(data).ok());
  ASSERT_TRUE((*w)->Commit().ok());
  EXPECT_EQ((*w)->appended_bytes(), 10'000u);
  EXPECT_EQ((*w)->file_bytes(), 12'288u);
  EXPECT_EQ(seen, 12'288u);
  const std::string file = ReadAll(dir.File("a.f32"));
  EXPECT_EQ(file, seen_bytes);
  EXPECT_EQ(file.substr(0, data.size()), data);
  EXPECT_EQ(file.substr(data.size()), std::string(12'288 - 10'000, '\0'));
  EXPECT_EQ(AtomicFileWriter::Create(*storage, dir.File("b"), {.direct = DirectIo::kAuto,
                                                                .chunk_bytes = 1000})
                .status()
                .code(),
            StatusCode::kInvalidArgument);
}

// chunk_bytes is bounded (kMaxAtomicWriteChunkBytes): a huge value (2^46)
// made Create's buffer allocation fail, and the writer aborted.
TEST(AtomicFileTest, ChunkBytesPastTheLimitAreInvalidArgumentAndLeaveNothing) {
  TempDir dir;
  auto storage = CreatePosixStorage();
  for (uint64_t chunk_bytes : {kMaxAtomicWriteChunkBytes + 4096, uint64_t{1} << 46}) {
    SCOPED_TRACE(chunk_bytes);
    for (DirectIo direct : {DirectIo::kOff, DirectIo::kAuto}) {
      auto w = AtomicFileWriter::Create(*storage, dir.File("big"),
                                        {.direct = direct, .chunk_bytes = chunk_bytes});
      ASSERT_FALSE(w.ok());
      EXPECT_EQ(w.status().code(), StatusCode::kInvalidArgument) << w.status();
      EXPECT_NE(w.status().message().find("at most 268435456"), std::string::npos) << w.status();
    }
  }
  EXPECT_TRUE(std::filesystem::is_empty(dir.path()));
}

// size_hint reserves the file's final size at Create, so a write lands
// inside the file (ext4 serializes writes that grow a file on its inode lock,
// which io_uring's workers then contend for) and a full disk fails before
// the first byte; Commit leaves exactly what was written, whatever the hint.
TEST(AtomicFileTest, ASizeHintIsReservedAtCreateAndTheFileEndsAsWritten) {
  for (const Backend& b : FileBackends()) {
    SCOPED_TRACE(b.name);
    TempDir dir;
    auto storage = b.make();
    const std::string data = Pattern(40'000, 11);
    for (uint64_t hint : {uint64_t{40'000}, uint64_t{1} << 20, uint64_t{4096}}) {
      SCOPED_TRACE("hint " + std::to_string(hint));
      const std::string path = dir.File("h" + std::to_string(hint));
      std::string temporary;
      AtomicFileListener previous =
          SetAtomicFileListener([&](AtomicFileEvent e, const std::string& p) {
            if (e == AtomicFileEvent::kCreatingTemporary) temporary = p;
          });
      auto w = AtomicFileWriter::Create(*storage, path,
                                        {.chunk_bytes = 8192, .queue_depth = 2, .size_hint = hint});
      SetAtomicFileListener(std::move(previous));
      ASSERT_TRUE(w.ok()) << w.status();
      EXPECT_EQ(fs::file_size(temporary), hint) << "reserved before the first write";
      ASSERT_TRUE((*w)->Append(data).ok());
      ASSERT_TRUE((*w)->Commit().ok());
      EXPECT_EQ(ReadAll(path), data);
    }
  }
  // A size no file here can have: refused at Create, naming the output,
  // leaving nothing. ext4 (EFBIG, past its largest file) and tmpfs (ENOSPC,
  // past its size) refuse it before allocating anything; a hint between the
  // free space and that limit would fill the disk before failing, under the
  // tests running beside this one, so none is tried.
  TempDir dir;
  struct statfs fs_info {};
  ASSERT_EQ(::statfs(dir.path().c_str(), &fs_info), 0);
  constexpr long kExt4 = 0xEF53, kTmpfs = 0x01021994;
  if (fs_info.f_type != kExt4 && fs_info.f_type != kTmpfs) {
    GTEST_SKIP() << "the oversized hint is tried on ext4 and tmpfs only; " << dir.path()
                 << " is on filesystem type 0x" << std::hex << fs_info.f_type;
  }
  auto storage = CreatePosixStorage();
  auto w = AtomicFileWriter::Create(*storage, dir.File("big"), {.size_hint = uint64_t{1} << 62});
  ASSERT_FALSE(w.ok());
  EXPECT_EQ(w.status().code(), StatusCode::kResourceExhausted) << w.status();
  EXPECT_NE(w.status().message().find("write " + dir.File("big")), std::string::npos)
      << w.status();
  EXPECT_TRUE(Names(dir.path()).empty());
}

// Two writers of one path at once (two processes saving into one checkpoint
// directory did share one "latest.json.tmp"): each has its own temporary
// file, and the target ends as one whole version.
TEST(AtomicFileTest, ConcurrentWritersOfOnePathNeverMix) {
  TempDir dir;
  auto storage = CreatePosixStorage();
  const std::string path = dir.File("latest.json");
  const std::string a = Pattern(200'000, 11), b = Pattern(200'000, 12);
  for (int round = 0; round < 10; ++round) {
    auto wa = AtomicFileWriter::Create(*storage, path, {.chunk_bytes = 4096});
    auto wb = AtomicFileWriter::Create(*storage, path, {.chunk_bytes = 4096});
    ASSERT_TRUE(wa.ok() && wb.ok());
    EXPECT_NE((*wa)->temp_path(), (*wb)->temp_path());
    std::thread ta([&] { EXPECT_TRUE((*wa)->Append(a).ok() && (*wa)->Commit().ok()); });
    std::thread tb([&] { EXPECT_TRUE((*wb)->Append(b).ok() && (*wb)->Commit().ok()); });
    ta.join();
    tb.join();
    const std::string got = ReadAll(path);
    EXPECT_TRUE(got == a || got == b) << "round " << round;
  }
  EXPECT_EQ(Names(dir.path()), std::vector<std::string>{"latest.json"});
}

TEST(AtomicFileTest, CommitRefusesATargetThatAppearedMeanwhile) {
  TempDir dir;
  auto storage = CreatePosixStorage();
  const std::string path = dir.File("out");
  auto w = AtomicFileWriter::Create(*storage, path, {.existing = ExistingFile::kRefuse});
  ASSERT_TRUE(w.ok());
  ASSERT_TRUE((*w)->Append("mine").ok());
  ASSERT_TRUE(WriteFileAtomically(*storage, path, "theirs").ok());
  EXPECT_EQ((*w)->Commit().code(), StatusCode::kFailedPrecondition);
  EXPECT_EQ(ReadAll(path), "theirs");
  EXPECT_EQ(Names(dir.path()), std::vector<std::string>{"out"});
}

// ---- FileLock -------------------------------------------------------------------

TEST(FileLockTest, RecordsThePidAndAMissingDirectoryIsNotFound) {
  TempDir dir;
  auto lock = FileLock::Acquire(dir.File("a.lock"));
  ASSERT_TRUE(lock.ok()) << lock.status();
  EXPECT_EQ(ReadAll(dir.File("a.lock")), std::to_string(::getpid()) + "\n");
  auto missing = FileLock::Acquire(dir.File("nope/a.lock"));
  EXPECT_EQ(missing.status().code(), StatusCode::kNotFound) << missing.status();
  FileLock moved = std::move(*lock);
  EXPECT_TRUE(moved.held());
  EXPECT_FALSE(FileLock::Acquire(dir.File("a.lock")).ok()) << "a moved lock is still held";
}

// A lock held by another process names its pid; once that process dies
// (SIGKILL: no cleanup ran) the stale lock file does not block.
TEST(FileLockTest, AnotherProcessIsNamedAndItsDeathReleasesTheLock) {
  TempDir dir;
  const std::string path = dir.File("strata-rank0.lock");
  int ready[2];
  ASSERT_EQ(::pipe(ready), 0);
  const pid_t child = ::fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    // Only system calls in the child of a threaded test process.
    const int fd = ::open(path.c_str(), O_RDWR | O_CREAT, 0644);
    if (fd < 0 || ::flock(fd, LOCK_EX) != 0) ::_exit(1);
    char buf[32];
    const int n = std::snprintf(buf, sizeof(buf), "%ld\n", static_cast<long>(::getpid()));
    if (::pwrite(fd, buf, n, 0) != n || ::write(ready[1], "x", 1) != 1) ::_exit(1);
    for (;;) ::pause();
  }
  char c;
  ASSERT_EQ(::read(ready[0], &c, 1), 1);
  auto held = FileLock::Acquire(path);
  ASSERT_FALSE(held.ok());
  EXPECT_EQ(held.status().code(), StatusCode::kFailedPrecondition);
  EXPECT_NE(held.status().message().find("process " + std::to_string(child)),
            std::string_view::npos)
      << held.status();
  ::kill(child, SIGKILL);
  int status = 0;
  ::waitpid(child, &status, 0);
  ::close(ready[0]);
  ::close(ready[1]);
  auto after = FileLock::Acquire(path);
  EXPECT_TRUE(after.ok()) << after.status();
}

// A child forked while a lock is held does not keep it: released in the
// parent, the lock can be taken again while the child lives (a DataLoader
// worker forked after an optimizer was built kept its nvme_path locked after
// close()). The child's inherited FileLock releases nothing of the parent's.
TEST(FileLockTest, AForkedChildDoesNotKeepTheLock) {
  TempDir dir;
  const std::string path = dir.File("strata-rank0.lock");
  auto lock = FileLock::Acquire(path);
  ASSERT_TRUE(lock.ok()) << lock.status();
  auto kept = FileLock::Acquire(dir.File("kept.lock"));
  ASSERT_TRUE(kept.ok()) << kept.status();
  int go[2], done[2];
  ASSERT_EQ(::pipe(go), 0);
  ASSERT_EQ(::pipe(done), 0);
  const pid_t child = ::fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    // Drop the inherited FileLock values as a child's exit would; then wait.
    { FileLock gone = std::move(*kept); }
    char c;
    if (::write(done[1], "x", 1) != 1 || ::read(go[0], &c, 1) != 1) ::_exit(1);
    ::_exit(0);
  }
  char c;
  ASSERT_EQ(::read(done[0], &c, 1), 1);
  // The child dropped its copy of `kept`: the parent still holds that lock.
  auto again_kept = FileLock::Acquire(dir.File("kept.lock"));
  EXPECT_FALSE(again_kept.ok());
  *lock = FileLock();  // released here, while the child lives
  auto again = FileLock::Acquire(path);
  EXPECT_TRUE(again.ok()) << again.status();
  ASSERT_EQ(::write(go[1], "x", 1), 1);
  int status = 0;
  ::waitpid(child, &status, 0);
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0);
  for (int fd : {go[0], go[1], done[0], done[1]}) ::close(fd);
}

// A lock file that cannot be created, or opened for writing, names its errno,
// the path and the fix, and never says "held by" (which the state store and
// the save lock read as another user of the directory: an nvme_path this
// user cannot write was reported as "another optimizer keeps rank 0's
// state"). Root passes every permission check: as root this runs as nobody.
TEST(FileLockTest, ALockFileThatCannotBeMadeNamesItsErrnoNotAHolder) {
  namespace fs = std::filesystem;
  TempDir dir;
  fs::permissions(dir.path(), fs::perms::owner_all | fs::perms::group_read | fs::perms::group_exec |
                                  fs::perms::others_read | fs::perms::others_exec);
  const std::string locked = dir.File("locked");
  fs::create_directories(locked);
  fs::permissions(locked, fs::perms::owner_read | fs::perms::owner_exec | fs::perms::group_read |
                              fs::perms::group_exec | fs::perms::others_read |
                              fs::perms::others_exec);
  // A shared directory (1777) holding a lock file another user left, 0644.
  const std::string shared = dir.File("shared");
  fs::create_directories(shared);
  fs::permissions(shared, fs::perms::all | fs::perms::sticky_bit);
  std::ofstream(shared + "/a.lock") << "1\n";
  fs::permissions(shared + "/a.lock", fs::perms::owner_read | fs::perms::owner_write |
                                          fs::perms::group_read | fs::perms::others_read);
  auto failed = testing::RunUnprivileged([&]() -> std::string {
    // An nvme_path to be made under it: the errno and the fix as well.
    const Status mkdir = CreateDirectories(locked + "/nvme");
    if (mkdir.ok() || mkdir.message().find("EACCES") == std::string_view::npos ||
        mkdir.message().find("give a directory this user can write") == std::string_view::npos) {
      return "create directory: " + mkdir.ToString();
    }
    auto expect = [](const Result<FileLock>& r, const std::vector<std::string>& needles) {
      if (r.ok()) return std::string("acquired");
      const Status& s = r.status();
      if (s.code() != StatusCode::kFailedPrecondition) return "code of " + s.ToString();
      if (LockHeldByAnother(s)) return "reads as held: " + s.ToString();
      for (const std::string& n : needles) {
        if (s.message().find(n) == std::string_view::npos)
          return "no '" + n + "' in " + s.ToString();
      }
      return std::string();
    };
    std::string f = expect(FileLock::Acquire(locked + "/a.lock"),
                           {"lock " + locked + "/a.lock: EACCES",
                            "may not create files in " + locked, "give a directory it can write"});
    if (!f.empty()) return f;
    struct stat st {};
    if (::stat((shared + "/a.lock").c_str(), &st) != 0) return std::string("stat");
    if (st.st_uid == ::geteuid()) return std::string();  // not root: this user's own file
    return expect(FileLock::Acquire(shared + "/a.lock"),
                  {"lock " + shared + "/a.lock: EACCES", "the lock file exists",
                   "remove the file when no process of its owner uses the directory"});
  });
  if (!failed) GTEST_SKIP() << "cannot switch to uid 65534";
  EXPECT_EQ(*failed, "");
  // Held by another: LockHeldByAnother says so, with any context.
  auto first = FileLock::Acquire(dir.File("b.lock"));
  ASSERT_TRUE(first.ok()) << first.status();
  auto second = FileLock::Acquire(dir.File("b.lock"));
  ASSERT_FALSE(second.ok());
  EXPECT_TRUE(LockHeldByAnother(second.status().WithContext("open state store")))
      << second.status();
  auto mem = CreateMemStorage();
  auto m1 = mem->Lock("/x.lock");
  ASSERT_TRUE(m1.ok());
  EXPECT_TRUE(LockHeldByAnother(mem->Lock("/x.lock").status()));
}

}  // namespace
}  // namespace strata
