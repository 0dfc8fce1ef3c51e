// Backend-specific behaviour: the io_uring and O_DIRECT fallbacks, fixed
// buffers (split at 1 GiB, the warning when the kernel refuses them), the
// counting wrapper and manual completion.
#include <gtest/gtest.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/vfs.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <iostream>
#include <thread>
#include <vector>

#include "runtime/storage.h"
#include "runtime/storage_internal.h"
#include "runtime/testing/manual_storage.h"
#include "runtime/testing/test_util.h"
#include "runtime/units.h"

namespace strata {
namespace {

using testing::AlignedBuffer;
using testing::FillPattern;
using testing::TempDir;

Status WriteAndWait(File& f, uint64_t offset, std::span<std::byte> buf) {
  IoRequest r = IoRequest::Write(offset, buf);
  STRATA_RETURN_IF_ERROR(f.Submit(std::span(&r, 1)));
  IoRequest* done[1];
  STRATA_ASSIGN_OR_RETURN(size_t n, f.Reap(done, 1));
  if (n != 1) return InternalError("not reaped");
  return r.status;
}

TEST(StorageFallback, UringRefusalFallsBackToPosix) {
  ::setenv("STRATA_URING_REFUSE", "1", 1);
  auto s = CreateStorage({.backend = StorageBackend::kUring});
  auto strict =
      CreateStorage({.backend = StorageBackend::kUring, .fallback = UringFallback::kFail});
  ::unsetenv("STRATA_URING_REFUSE");
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_EQ((*s)->name(), "posix");
  EXPECT_EQ(strict.status().code(), StatusCode::kUnavailable);
  EXPECT_NE(strict.status().message().find("io_uring refused"), std::string_view::npos)
      << strict.status();
}

TEST(StorageFallback, UringIsChosenWhereAvailable) {
  if (!UringAvailable()) GTEST_SKIP() << "io_uring not available here";
  auto s = CreateStorage({.backend = StorageBackend::kUring});
  ASSERT_TRUE(s.ok());
  EXPECT_EQ((*s)->name(), "uring");
}

bool IsTmpfs(const std::string& path) {
  struct statfs st;
  return ::statfs(path.c_str(), &st) == 0 && st.f_type == 0x01021994;  // TMPFS_MAGIC
}

// Kernels since 6.6 accept O_DIRECT on tmpfs, so the refusal is forced with
// STRATA_O_DIRECT_REFUSE (the same EINVAL path as a refusing filesystem).
TEST(StorageFallback, ODirectRefusedFallsBackToBufferedAndStillChecksAlignment) {
  TempDir dir;
  ASSERT_TRUE(dir.ok());
  std::vector<std::unique_ptr<Storage>> storages;
  storages.push_back(CreatePosixStorage());
  if (auto u = CreateUringStorage(SqPoll::kOff); u.ok()) storages.push_back(std::move(u).value());
  ::setenv("STRATA_O_DIRECT_REFUSE", "1", 1);
  for (auto& storage : storages) {
    SCOPED_TRACE(std::string(storage->name()));
    auto f = storage->Open(dir.File("x"), {.create = FileCreate::kCreate});
    ASSERT_TRUE(f.ok()) << f.status();
    EXPECT_EQ((*f)->info().io_mode, IoMode::kBuffered);
    EXPECT_EQ((*f)->info().alignment_bytes, 4096u);
    AlignedBuffer buf(8192);
    FillPattern(buf.span(), 1);
    EXPECT_TRUE(WriteAndWait(**f, 4096, buf.span()).ok());
    EXPECT_EQ(WriteAndWait(**f, 100, buf.span()).code(), StatusCode::kInvalidArgument);
    auto strict =
        storage->Open(dir.File("y"), {.create = FileCreate::kCreate, .direct = DirectIo::kRequire});
    EXPECT_EQ(strict.status().code(), StatusCode::kInvalidArgument) << strict.status();
    EXPECT_NE(strict.status().message().find("O_DIRECT"), std::string_view::npos);
  }
  ::unsetenv("STRATA_O_DIRECT_REFUSE");
}

// A FIFO, a socket or a directory where a file should be (a checkpoint file
// replaced by `mkfifo`): refused at once naming what it is; open() used to
// wait on the FIFO for a writer forever (`strata inspect` hung).
TEST(StorageFileType, OnlyRegularFilesAndBlockDevicesOpenAndAFifoIsNotWaitedOn) {
  TempDir dir;
  ASSERT_TRUE(dir.ok());
  ASSERT_EQ(::mkfifo(dir.File("fifo").c_str(), 0600), 0);
  std::filesystem::create_directory(dir.File("sub"));
  std::vector<std::unique_ptr<Storage>> storages;
  storages.push_back(CreatePosixStorage());
  if (auto u = CreateUringStorage(SqPoll::kOff); u.ok()) storages.push_back(std::move(u).value());
  for (auto& storage : storages) {
    SCOPED_TRACE(std::string(storage->name()));
    for (auto [name, kind] : {std::pair{"fifo", "a FIFO"}, std::pair{"sub", "a directory"}}) {
      for (FileAccess access : {FileAccess::kReadOnly, FileAccess::kReadWrite}) {
        for (DirectIo direct : {DirectIo::kOff, DirectIo::kAuto}) {
          auto f = storage->Open(dir.File(name), {.direct = direct, .access = access});
          EXPECT_EQ(f.status().code(), StatusCode::kFailedPrecondition) << f.status();
          EXPECT_NE(f.status().message().find(dir.File(name) + ": not a regular file (" + kind),
                    std::string_view::npos)
              << f.status();
        }
      }
    }
    auto regular = storage->Open(dir.File("file"), {.create = FileCreate::kCreate});
    EXPECT_TRUE(regular.ok()) << regular.status();
  }
}

TEST(StorageFallback, TmpfsWorksWhateverItSaysToODirect) {
  if (!std::filesystem::is_directory("/dev/shm") || !IsTmpfs("/dev/shm")) {
    GTEST_SKIP() << "no tmpfs at /dev/shm";
  }
  TempDir dir("/dev/shm");
  ASSERT_TRUE(dir.ok());
  auto f = CreatePosixStorage()->Open(dir.File("x"), {.create = FileCreate::kCreate});
  ASSERT_TRUE(f.ok()) << f.status();
  AlignedBuffer buf(8192);
  EXPECT_TRUE(WriteAndWait(**f, 4096, buf.span()).ok());
}

TEST(StorageFallback, ODirectWorksOnTheTestDirectory) {
  TempDir dir;
  ASSERT_TRUE(dir.ok());
  if (IsTmpfs(dir.path())) GTEST_SKIP() << dir.path() << " is tmpfs";
  auto f = CreatePosixStorage()->Open(
      dir.File("x"), {.create = FileCreate::kCreate, .direct = DirectIo::kRequire});
  ASSERT_TRUE(f.ok()) << f.status();
  EXPECT_EQ((*f)->info().io_mode, IoMode::kDirect);
  AlignedBuffer buf(4096);
  // The kernel would say EINVAL; the file says which value is wrong first.
  Status s = WriteAndWait(**f, 0, buf.span().first(512));
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("length 512"), std::string_view::npos) << s;
}

TEST(UringBackend, FixedBuffersAndFixedFileAreUsed) {
  if (!UringAvailable()) GTEST_SKIP() << "io_uring not available here";
  TempDir dir;
  auto storage = CreateUringStorage(SqPoll::kOff).value();
  auto f = storage->Open(dir.File("x"), {.create = FileCreate::kCreate, .queue_depth = 2}).value();
  EXPECT_TRUE(f->info().fixed_file);
  AlignedBuffer reg(1 << 20), other(1 << 20);
  std::span<std::byte> bufs[] = {reg.span()};
  ASSERT_TRUE(f->RegisterBuffers(bufs).ok());
  EXPECT_TRUE(f->info().fixed_buffers);
  FillPattern(reg.span(), 11);
  ASSERT_TRUE(WriteAndWait(*f, 0, reg.span()).ok());
  // A buffer outside the registered ones takes the plain path.
  IoRequest r = IoRequest::Read(0, other.span());
  ASSERT_TRUE(f->Submit(std::span(&r, 1)).ok());
  IoRequest* done[1];
  ASSERT_EQ(f->Reap(done, 1).value(), 1u);
  ASSERT_TRUE(r.status.ok()) << r.status;
  EXPECT_EQ(std::memcmp(reg.data(), other.data(), reg.size()), 0);
}

// Ends an injected submit fault however the test leaves.
struct SubmitFault {
  SubmitFault(int error, int count) { internal::FailUringSubmitsForTest(error, count); }
  ~SubmitFault() { internal::FailUringSubmitsForTest(0, 0); }
};

std::vector<std::byte> ReadBack(Storage& storage, const std::string& path, size_t bytes) {
  auto f = storage.Open(path, {}).value();
  AlignedBuffer buf(bytes);
  IoRequest r = IoRequest::Read(0, buf.span());
  EXPECT_TRUE(f->Submit(std::span(&r, 1)).ok());
  IoRequest* done[1];
  EXPECT_EQ(f->Reap(done, 1).value(), 1u);
  EXPECT_TRUE(r.status.ok()) << r.status;
  return {buf.data(), buf.data() + bytes};
}

// A submit the kernel refuses (not busy) used to return its error with the
// SQEs left in the ring and counted: a drain then waited forever for
// completions of requests never started, and a later submit could start them
// on buffers their owner had reused.
TEST(UringBackend, ASubmitTheKernelRefusesFailsItsRequestsWhichNeverRunLater) {
  if (!UringAvailable()) GTEST_SKIP() << "io_uring not available here";
  TempDir dir;
  auto storage = CreateUringStorage(SqPoll::kOff).value();
  const std::string path = dir.File("x");
  AlignedBuffer before(3 * 4096), after(3 * 4096);
  FillPattern(before.span(), 1);
  FillPattern(after.span(), 2);
  {
    auto f = storage->Open(path, {.create = FileCreate::kCreate, .queue_depth = 4}).value();
    ASSERT_TRUE(WriteAndWait(*f, 0, before.span()).ok());
    SubmitFault fault(EIO, 1);
    IoRequest reqs[3];
    for (int i = 0; i < 3; ++i) {
      reqs[i] = IoRequest::Write(i * 4096, after.span().subspan(i * 4096, 4096));
    }
    ASSERT_TRUE(f->Submit(reqs).ok());
    IoRequest* done[3];
    ASSERT_EQ(f->Reap(done, 3).value(), 3u);
    EXPECT_EQ(f->InFlight(), 0u);
    for (const IoRequest& r : reqs) {
      EXPECT_FALSE(r.status.ok());
      EXPECT_NE(r.status.message().find("io_uring_submit for " + path), std::string::npos)
          << r.status;
    }
    // The queue stopped: a new batch is refused, saying why and what to do.
    Status refused = WriteAndWait(*f, 0, after.span());
    EXPECT_EQ(refused.code(), StatusCode::kFailedPrecondition) << refused;
    EXPECT_NE(refused.message().find("close and reopen"), std::string::npos) << refused;
    EXPECT_EQ(f->InFlight(), 0u);
  }  // closing waits for nothing and starts nothing
  const std::vector<std::byte> on_disk = ReadBack(*storage, path, before.size());
  EXPECT_EQ(std::memcmp(on_disk.data(), before.data(), before.size()), 0);
}

// A short read resumed after a refused submit is failed too: submitting its
// remainder would also have started the refused write left in the ring,
// reported failed and then run.
TEST(UringBackend, AResumedRequestAfterARefusedSubmitStartsNothingRefused) {
  if (!UringAvailable()) GTEST_SKIP() << "io_uring not available here";
  TempDir dir;
  auto storage = CreateUringStorage(SqPoll::kOff).value();
  const std::string path = dir.File("x");
  AlignedBuffer first(4096), refused(4096), read(8192);
  FillPattern(first.span(), 1);
  FillPattern(refused.span(), 2);
  {
    auto f = storage->Open(path, {.create = FileCreate::kCreate, .queue_depth = 4}).value();
    ASSERT_TRUE(WriteAndWait(*f, 0, first.span()).ok());
    IoRequest short_read = IoRequest::Read(0, read.span());  // 8 KiB of a 4 KiB file
    ASSERT_TRUE(f->Submit(std::span(&short_read, 1)).ok());
    IoRequest write = IoRequest::Write(8192, refused.span());
    {
      SubmitFault fault(EIO, 1);
      ASSERT_TRUE(f->Submit(std::span(&write, 1)).ok());
    }
    IoRequest* done[2];
    size_t reaped = 0;
    while (reaped < 2) reaped += f->Reap(std::span(done).subspan(reaped), 1).value();
    EXPECT_FALSE(write.status.ok());
    EXPECT_FALSE(short_read.status.ok()) << "its remainder was not submitted";
    EXPECT_EQ(f->InFlight(), 0u);
    // Time for a write started behind the file's back to land.
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  EXPECT_EQ(std::filesystem::file_size(path), 4096u) << "the refused write ran";
}

// EAGAIN (no memory for requests) and EBUSY (completion backlog) are waits,
// not errors: with nothing in flight the submit is retried; with requests in
// flight, it goes again after one completes.
TEST(UringBackend, ABusyKernelDelaysRequestsAndFailsNone) {
  if (!UringAvailable()) GTEST_SKIP() << "io_uring not available here";
  TempDir dir;
  auto storage = CreateUringStorage(SqPoll::kOff).value();
  auto f = storage->Open(dir.File("x"), {.create = FileCreate::kCreate, .queue_depth = 8}).value();
  AlignedBuffer data(4 * 4096);
  FillPattern(data.span(), 3);
  {
    SubmitFault fault(EAGAIN, 3);  // nothing in flight: three retries
    ASSERT_TRUE(WriteAndWait(*f, 0, data.span().first(4096)).ok());
  }
  IoRequest first[2] = {IoRequest::Write(4096, data.span().subspan(4096, 4096)),
                        IoRequest::Write(2 * 4096, data.span().subspan(2 * 4096, 4096))};
  ASSERT_TRUE(f->Submit(first).ok());
  {
    SubmitFault fault(EBUSY, 1);  // two in flight: this one waits for them
    IoRequest second = IoRequest::Write(3 * 4096, data.span().subspan(3 * 4096, 4096));
    ASSERT_TRUE(f->Submit(std::span(&second, 1)).ok());
    IoRequest* done[3];
    size_t reaped = 0;
    while (reaped < 3) reaped += f->Reap(std::span(done).subspan(reaped), 1).value();
    EXPECT_TRUE(second.status.ok()) << second.status;
  }
  for (const IoRequest& r : first) EXPECT_TRUE(r.status.ok()) << r.status;
  const std::vector<std::byte> on_disk = ReadBack(*storage, dir.File("x"), data.size());
  EXPECT_EQ(std::memcmp(on_disk.data(), data.data(), data.size()), 0);
}

// An SQE's length has 32 bits: a request of 4 GiB + 4 KiB was cut to its
// low 32 bits (4 KiB), then to 0 bytes, which read as the end of the file.
// The file is 3 pages, so a request that is not cut reads all 3 before the
// end of the file stops it (and the 4 GiB buffer is never touched beyond).
TEST(UringBackend, ARequestOfFourGiBAndMoreIsNotCutToItsLow32Bits) {
  if (!UringAvailable()) GTEST_SKIP() << "io_uring not available here";
  constexpr size_t kBytes = (size_t{1} << 32) + 4096, kFile = 3 * 4096;
  void* base = ::mmap(nullptr, kBytes, PROT_READ | PROT_WRITE,
                      MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  ASSERT_NE(base, MAP_FAILED);
  auto* bytes = static_cast<std::byte*>(base);
  TempDir dir;
  auto storage = CreateUringStorage(SqPoll::kOff).value();
  AlignedBuffer data(kFile);
  FillPattern(data.span(), 5);
  {
    auto w = storage->Open(dir.File("x"), {.create = FileCreate::kCreate}).value();
    ASSERT_TRUE(WriteAndWait(*w, 0, data.span()).ok());
  }
  auto f = storage->Open(dir.File("x"), {.direct = DirectIo::kOff}).value();
  IoRequest r = IoRequest::Read(0, {bytes, kBytes});
  ASSERT_TRUE(f->Submit(std::span(&r, 1)).ok());
  IoRequest* done[1];
  ASSERT_EQ(f->Reap(done, 1).value(), 1u);
  EXPECT_EQ(r.status.code(), StatusCode::kOutOfRange) << r.status;
  EXPECT_NE(r.status.message().find("end of file after " + std::to_string(kFile) + " bytes"),
            std::string::npos)
      << r.status;
  EXPECT_EQ(r.transferred_bytes, kFile);
  EXPECT_EQ(std::memcmp(bytes, data.data(), kFile), 0);
  ::munmap(base, kBytes);
}

// ---- Registration of buffers of any size (pure helpers) ---------------------

// Fake addresses: the helpers only do arithmetic on them.
std::span<std::byte> FakeBuffer(uintptr_t address, uint64_t size) {
  return {reinterpret_cast<std::byte*>(address), static_cast<size_t>(size)};
}

TEST(UringRegistration, BuffersAreCutAtOneGiBMultiplesFromTheirStart) {
  const uintptr_t a = uintptr_t{1} << 40, b = uintptr_t{3} << 40;
  const std::span<std::byte> bufs[] = {FakeBuffer(a, 2 * kGiB + 12288), FakeBuffer(b, 4096),
                                       FakeBuffer(b + 8192, 0)};
  const auto ranges = internal::SplitForRegistration(bufs, internal::kMaxUringBufferBytes);
  ASSERT_EQ(ranges.size(), 4u);  // 1 GiB, 1 GiB, 12 KiB, then the small buffer; empty dropped
  EXPECT_EQ(ranges[0].begin, a);
  EXPECT_EQ(ranges[0].end, a + kGiB);
  EXPECT_EQ(ranges[1].begin, a + kGiB);
  EXPECT_EQ(ranges[1].end, a + 2 * kGiB);
  EXPECT_EQ(ranges[2].begin, a + 2 * kGiB);
  EXPECT_EQ(ranges[2].end, a + 2 * kGiB + 12288);
  EXPECT_EQ(ranges[3].begin, b);
  EXPECT_EQ(ranges[3].end, b + 4096);
  for (const auto& r : ranges) EXPECT_LE(r.end - r.begin, internal::kMaxUringBufferBytes);
  // Exactly 1 GiB is one piece: the kernel's cap is inclusive.
  const std::span<std::byte> one[] = {FakeBuffer(a, kGiB)};
  EXPECT_EQ(internal::SplitForRegistration(one, internal::kMaxUringBufferBytes).size(), 1u);
}

TEST(UringRegistration, RequestsMapToTheirPieceAndStraddlersToNone) {
  const uintptr_t a = uintptr_t{1} << 40;
  const std::span<std::byte> bufs[] = {FakeBuffer(a, kGiB + 8 * kMiB)};
  const auto ranges = internal::SplitForRegistration(bufs, internal::kMaxUringBufferBytes);
  auto at = [&](uint64_t offset) { return reinterpret_cast<const std::byte*>(a + offset); };
  EXPECT_EQ(internal::FindRegisteredRange(ranges, at(0), kMiB), 0);
  EXPECT_EQ(internal::FindRegisteredRange(ranges, at(kGiB - kMiB), kMiB), 0);  // ends at the cut
  EXPECT_EQ(internal::FindRegisteredRange(ranges, at(kGiB), kMiB), 1);
  EXPECT_EQ(internal::FindRegisteredRange(ranges, at(kGiB + 7 * kMiB), kMiB), 1);
  EXPECT_EQ(internal::FindRegisteredRange(ranges, at(kGiB - 4096), 8192), -1);          // straddles
  EXPECT_EQ(internal::FindRegisteredRange(ranges, at(kGiB + 7 * kMiB), kMiB + 1), -1);  // past
  EXPECT_EQ(internal::FindRegisteredRange(ranges, at(0) - 4096, 4096), -1);             // before
}

internal::BufferRegistrationRefusal Refusal(int error) {
  internal::BufferRegistrationRefusal r;
  r.error = error;
  r.buffers = 3;
  r.total_bytes = 2 * kGiB + 512 * kMiB;
  r.largest_bytes = kGiB;
  return r;
}

TEST(UringRegistration, WarningNamesTheMemlockLimitWithItsValue) {
  auto r = Refusal(ENOMEM);
  r.memlock_limit_bytes = 8 * kMiB;
  const std::string m = internal::DescribeBufferRegistrationRefusal(r, "/nvme/x.state");
  EXPECT_NE(m.find("register 3 buffers (2.50 GiB) with io_uring for /nvme/x.state: ENOMEM"),
            std::string::npos)
      << m;
  EXPECT_NE(m.find("RLIMIT_MEMLOCK (`ulimit -l`) is 8.00 MiB"), std::string::npos) << m;
  EXPECT_NE(m.find("ulimit -l unlimited"), std::string::npos) << m;
  EXPECT_NE(m.find("CAP_IPC_LOCK"), std::string::npos) << m;
  EXPECT_NE(m.find("IO proceeds without fixed buffers"), std::string::npos) << m;
}

TEST(UringRegistration, WarningDoesNotBlameTheLimitWhenItDoesNotApply) {
  for (bool cap : {true, false}) {
    auto r = Refusal(ENOMEM);
    r.cap_ipc_lock = cap;
    r.memlock_limit_bytes = cap ? 8 * kMiB : UINT64_MAX;  // CAP_IPC_LOCK, or unlimited
    const std::string m = internal::DescribeBufferRegistrationRefusal(r, "f");
    EXPECT_EQ(m.find("ulimit -l"), std::string::npos) << m;
    EXPECT_NE(m.find("short of memory"), std::string::npos) << m;
    EXPECT_NE(m.find(cap ? "(CAP_IPC_LOCK)" : "(unlimited)"), std::string::npos) << m;
  }
}

TEST(UringRegistration, WarningNamesTheOneGiBCap) {
  auto r = Refusal(EFAULT);
  r.largest_bytes = kGiB + 128 * kMiB;
  const std::string m = internal::DescribeBufferRegistrationRefusal(r, "f");
  EXPECT_NE(m.find("EFAULT"), std::string::npos) << m;
  EXPECT_NE(m.find("a buffer of 1.12 GiB is larger than io_uring's limit of 1 GiB"),
            std::string::npos)
      << m;
  EXPECT_EQ(m.find("ulimit"), std::string::npos) << m;
}

TEST(UringRegistration, WarningNamesOtherCausesByTheirErrno) {
  std::string m = internal::DescribeBufferRegistrationRefusal(Refusal(EFAULT), "f");
  EXPECT_NE(m.find("EFAULT (Bad address): io_uring could not pin a buffer"), std::string::npos)
      << m;
  m = internal::DescribeBufferRegistrationRefusal(Refusal(EOPNOTSUPP), "f");
  EXPECT_NE(m.find("not a file mapping"), std::string::npos) << m;
  auto many = Refusal(EINVAL);
  many.buffers = internal::kMaxUringBuffers + 1;
  m = internal::DescribeBufferRegistrationRefusal(many, "f");
  EXPECT_NE(m.find("16385 buffers are more than io_uring's limit of 16384"), std::string::npos)
      << m;
  m = internal::DescribeBufferRegistrationRefusal(Refusal(EBUSY), "f");
  EXPECT_NE(m.find(": EBUSY (Device or resource busy); IO proceeds without fixed buffers"),
            std::string::npos)
      << m;
  EXPECT_EQ(m.find("ulimit"), std::string::npos) << m;
}

TEST(UringRegistration, CurrentMemlockLimitsReadsTheRlimit) {
  rlimit rl{};
  ASSERT_EQ(getrlimit(RLIMIT_MEMLOCK, &rl), 0);
  const internal::MemlockLimits limits = internal::CurrentMemlockLimits();
  EXPECT_EQ(limits.limit_bytes, rl.rlim_cur == RLIM_INFINITY ? UINT64_MAX : rl.rlim_cur);
  std::cout << "[ note ] RLIMIT_MEMLOCK " << limits.limit_bytes << " bytes, CAP_IPC_LOCK "
            << (limits.cap_ipc_lock ? "held" : "not held") << "\n";
}

TEST(CountingStorage, CountsOpsAndBytes) {
  auto counters = std::make_shared<IoCounters>();
  auto storage = CreateCountingStorage(CreateMemStorage(), counters);
  EXPECT_EQ(storage->name(), "counting(mem)");
  auto f = storage->Open("x", {.create = FileCreate::kCreate}).value();
  AlignedBuffer buf(8192);
  ASSERT_TRUE(WriteAndWait(*f, 0, buf.span()).ok());
  ASSERT_TRUE(WriteAndWait(*f, 8192, buf.span().first(4096)).ok());
  IoRequest r = IoRequest::Read(16384, buf.span());  // past the end: an error
  ASSERT_TRUE(f->Submit(std::span(&r, 1)).ok());
  IoRequest* done[1];
  ASSERT_EQ(f->Reap(done, 1).value(), 1u);
  ASSERT_TRUE(f->Sync().ok());
  EXPECT_EQ(counters->writes.load(), 2u);
  EXPECT_EQ(counters->write_bytes.load(), 12288u);
  EXPECT_EQ(counters->reads.load(), 0u);
  EXPECT_EQ(counters->errors.load(), 1u);
  EXPECT_EQ(counters->syncs.load(), 1u);
  EXPECT_EQ(counters->opens.load(), 1u);
}

TEST(ManualStorage, RequestsCompleteInTheOrderTheTestChooses) {
  auto storage = testing::ManualStorage::Create();
  auto f = storage->Open("x", {.create = FileCreate::kCreate}).value();
  AlignedBuffer a(4096), b(4096), c(4096);
  FillPattern(a.span(), 1);
  FillPattern(b.span(), 2);
  std::vector<IoRequest> reqs = {IoRequest::Write(0, a.span(), 0),
                                 IoRequest::Write(4096, b.span(), 1)};
  ASSERT_TRUE(f->Submit(reqs).ok());
  IoRequest* done[2];
  EXPECT_EQ(f->Reap(done, 1).status().code(), StatusCode::kFailedPrecondition);
  auto pending = storage->Pending();
  ASSERT_EQ(pending.size(), 2u);
  ASSERT_TRUE(storage->Complete(pending[1]).ok());
  ASSERT_EQ(f->Reap(done, 1).value(), 1u);
  EXPECT_EQ(done[0]->user_data, 1u);
  ASSERT_TRUE(storage->Fail(pending[0], ErrnoError(EIO, "write x@0+4KiB")).ok());
  ASSERT_EQ(f->Reap(done, 1).value(), 1u);
  EXPECT_EQ(done[0]->user_data, 0u);
  EXPECT_EQ(done[0]->status.code(), StatusCode::kInternal);
  // The failed write did nothing; the completed one is there.
  IoRequest r = IoRequest::Read(4096, c.span());
  ASSERT_TRUE(f->Submit(std::span(&r, 1)).ok());
  ASSERT_TRUE(storage->Complete(storage->Pending().at(0)).ok());
  ASSERT_EQ(f->Reap(done, 1).value(), 1u);
  ASSERT_TRUE(r.status.ok());
  EXPECT_EQ(std::memcmp(b.data(), c.data(), 4096), 0);
  EXPECT_EQ(storage->Complete(&r).code(), StatusCode::kNotFound);
}

}  // namespace
}  // namespace strata
