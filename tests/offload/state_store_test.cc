// The NVMe state store: round trips over every backend and striping, per-extent
// completion, checksums, double-buffered slots under faults (many seeds),
// restart and crash.
#include "offload/state_store.h"

#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <unistd.h>
#include <xxhash.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <functional>
#include <future>
#include <memory>
#include <optional>
#include <random>
#include <thread>

#include "offload/engine_io.h"
#include "runtime/testing/fault_storage.h"
#include "runtime/testing/manual_storage.h"
#include "runtime/testing/test_util.h"
#include "runtime/units.h"

namespace strata {
namespace {

using testing::AlignedBuffer;
using testing::FaultStorage;
using testing::FillPattern;
using testing::TempDir;

class StoreTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_TRUE(dir_.ok());
    for (int i = 0; i < 3; ++i) {
      paths_.push_back(dir_.File("d" + std::to_string(i)));
      std::filesystem::create_directory(paths_.back());
    }
  }
  StateStoreOptions Options(size_t num_paths, uint64_t extent_bytes, uint32_t num_extents,
                            uint64_t block) {
    return {.paths = std::vector<std::string>(paths_.begin(), paths_.begin() + num_paths),
            .rank = 1,
            .extent_bytes = extent_bytes,
            .num_extents = num_extents,
            .block_bytes = block,
            .queue_depth = 4};
  }
  TempDir dir_;
  std::vector<std::string> paths_;
};

Status WriteWait(StateStore& s, uint32_t id, std::span<std::byte> buf) {
  STRATA_ASSIGN_OR_RETURN(auto t, s.WriteExtent(id, buf));
  return s.Wait(t);
}
Status ReadWait(StateStore& s, uint32_t id, std::span<std::byte> buf) {
  STRATA_ASSIGN_OR_RETURN(auto t, s.ReadExtent(id, buf));
  return s.Wait(t);
}

TEST_F(StoreTest, RoundTripOverEveryBackendPathCountAndShape) {
  std::vector<std::pair<std::string, std::unique_ptr<Storage>>> storages;
  storages.emplace_back("posix", CreatePosixStorage());
  storages.emplace_back("mem", CreateMemStorage());
  if (UringAvailable()) storages.emplace_back("uring", CreateUringStorage(SqPoll::kOff).value());
  struct Shape {
    size_t paths;
    uint64_t extent_bytes, block;
  } shapes[] = {{1, 100000, 65536},
                {2, 1 << 20, 65536},
                {3, 300000, 16384},
                {3, 4096, 1 << 20},
                {2, 12345, 4096}};
  for (auto& [name, storage] : storages) {
    for (const Shape& sh : shapes) {
      SCOPED_TRACE(name + " paths " + std::to_string(sh.paths) + " extent " +
                   std::to_string(sh.extent_bytes) + " block " + std::to_string(sh.block));
      auto store = StateStore::Create(*storage, Options(sh.paths, sh.extent_bytes, 3, sh.block));
      ASSERT_TRUE(store.ok()) << store.status();
      StateStore& s = **store;
      ASSERT_EQ(s.file_paths().size(), sh.paths);
      std::vector<std::unique_ptr<AlignedBuffer>> bufs;
      for (uint32_t id = 0; id < 3; ++id) {
        bufs.push_back(std::make_unique<AlignedBuffer>(s.ExtentBufferBytes()));
        FillPattern(s.Payload(bufs.back()->span()), id + 10);
      }
      // All three writes in flight at once.
      std::vector<StateStore::Ticket> tickets;
      for (uint32_t id = 0; id < 3; ++id)
        tickets.push_back(s.WriteExtent(id, bufs[id]->span()).value());
      for (auto t : tickets) ASSERT_TRUE(s.Wait(t).ok());
      for (uint32_t id = 0; id < 3; ++id) {
        AlignedBuffer back(s.ExtentBufferBytes());
        ASSERT_TRUE(ReadWait(s, id, back.span()).ok());
        EXPECT_EQ(std::memcmp(s.Payload(back.span()).data(), s.Payload(bufs[id]->span()).data(),
                              sh.extent_bytes),
                  0);
        EXPECT_EQ(s.generation(id), 1u);
      }
    }
  }
}

TEST_F(StoreTest, StripingSpreadsOneExtentOverEveryFile) {
  auto storage = CreatePosixStorage();
  auto store = StateStore::Create(*storage, Options(3, 3 * kMiB - 4096, 2, kMiB)).value();
  // A slot is 3 MiB: one 1 MiB chunk per file, after a superblock padded
  // to one block (every chunk on a block boundary).
  for (const std::string& p : store->file_paths()) {
    EXPECT_EQ(std::filesystem::file_size(p), kMiB + 2 * 2 * kMiB) << p;
  }
  AlignedBuffer buf(store->ExtentBufferBytes());
  FillPattern(store->Payload(buf.span()), 3);
  ASSERT_TRUE(WriteWait(*store, 1, buf.span()).ok());
  ASSERT_TRUE(store->Sync().ok());
  // The slot of generation 1 of extent 1 is slot 1: per-file offset 1 MiB + 3 MiB.
  for (size_t f = 0; f < 3; ++f) {
    int fd = ::open(store->file_paths()[f].c_str(), O_RDONLY);
    ASSERT_GE(fd, 0);
    std::vector<std::byte> chunk(kMiB);
    ASSERT_EQ(::pread(fd, chunk.data(), kMiB, kMiB + 3 * kMiB), static_cast<ssize_t>(kMiB));
    ::close(fd);
    EXPECT_EQ(std::memcmp(chunk.data(), buf.data() + f * kMiB, kMiB), 0) << "file " << f;
  }
}

TEST_F(StoreTest, CompletionIsPerExtentWhenRequestsCompleteOutOfOrder) {
  auto manual = testing::ManualStorage::Create();
  manual->SetAutoComplete(testing::AutoComplete::kOn);  // setup IO and the writes
  auto store = StateStore::Create(*manual, Options(2, 64 * kKiB, 2, 16 * kKiB)).value();
  AlignedBuffer a(store->ExtentBufferBytes()), b(store->ExtentBufferBytes());
  AlignedBuffer ra(store->ExtentBufferBytes()), rb(store->ExtentBufferBytes());
  FillPattern(store->Payload(a.span()), 1);
  FillPattern(store->Payload(b.span()), 2);
  ASSERT_TRUE(WriteWait(*store, 0, a.span()).ok());
  ASSERT_TRUE(WriteWait(*store, 1, b.span()).ok());
  manual->SetAutoComplete(testing::AutoComplete::kOff);
  auto ta = store->ReadExtent(0, ra.span()).value();
  auto tb = store->ReadExtent(1, rb.span()).value();
  EXPECT_EQ(store->ReadExtent(1, rb.span()).status().code(), StatusCode::kFailedPrecondition);
  // 5 chunks per extent over 2 files, at most queue_depth (4) in flight per
  // file, taken from both reads in turn.
  EXPECT_EQ(manual->Pending().size(), 8u);
  EXPECT_FALSE(store->Poll(ta).has_value());
  // Complete b's chunks (newest first) as they are submitted; a stays in
  // flight and b still finishes.
  size_t completed_b = 0;
  for (int round = 0; round < 10 && !store->Poll(tb).has_value(); ++round) {
    std::vector<IoRequest*> pending = manual->Pending();
    for (auto it = pending.rbegin(); it != pending.rend(); ++it) {
      if ((*it)->user_data != tb.id) continue;
      ASSERT_TRUE(manual->Complete(*it).ok());
      ++completed_b;
    }
  }
  EXPECT_EQ(completed_b, 5u);
  EXPECT_EQ(
      std::memcmp(store->Payload(rb.span()).data(), store->Payload(b.span()).data(), 64 * kKiB), 0);
  EXPECT_FALSE(store->Poll(ta).has_value());
  EXPECT_EQ(store->InFlight(), 1u);
  for (int round = 0; round < 10 && !manual->Pending().empty(); ++round) {
    for (IoRequest* r : manual->Pending()) ASSERT_TRUE(manual->Complete(r).ok());
    store->Poll(ta);  // reaps, and submits a's remaining chunks
  }
  EXPECT_EQ(store->InFlight(), 0u);
  EXPECT_EQ(
      std::memcmp(store->Payload(ra.span()).data(), store->Payload(a.span()).data(), 64 * kKiB), 0);
  EXPECT_EQ(store->Poll(ta)->code(), StatusCode::kNotFound);
}

// A read and a write started together are in flight together, chunk by
// chunk (neither waits for the other's whole extent), never two ops on one
// extent; both complete with the right bytes.
TEST_F(StoreTest, AReadAndAWriteProgressTogether) {
  auto manual = testing::ManualStorage::Create();
  manual->SetAutoComplete(testing::AutoComplete::kOn);
  auto store = StateStore::Create(*manual, Options(2, 256 * kKiB, 2, 16 * kKiB)).value();
  AlignedBuffer a(store->ExtentBufferBytes()), b(store->ExtentBufferBytes());
  AlignedBuffer ra(store->ExtentBufferBytes());
  FillPattern(store->Payload(a.span()), 1);
  ASSERT_TRUE(WriteWait(*store, 0, a.span()).ok());
  manual->SetAutoComplete(testing::AutoComplete::kOff);
  auto tr = store->ReadExtent(0, ra.span()).value();
  FillPattern(store->Payload(b.span()), 2);
  auto tw = store->WriteExtent(1, b.span()).value();
  EXPECT_EQ(store->WriteExtent(0, a.span()).status().code(), StatusCode::kFailedPrecondition)
      << "an extent with a read in flight takes no write";
  // Every submission round has chunks of both ops in flight until one is done.
  size_t rounds_with_both = 0;
  int round = 0;
  std::optional<Status> read_done, write_done;
  while (!manual->Pending().empty()) {
    size_t reads = 0, writes = 0;
    for (IoRequest* r : manual->Pending()) (r->op == IoOp::kRead ? reads : writes)++;
    EXPECT_LE(reads + writes, 8u) << "queue depth 4 on each of 2 files";
    if (reads > 0 && writes > 0) ++rounds_with_both;
    // The read started first and took the whole queue depth; from the first
    // completion on, the write takes its turn.
    if (round++ == 1 && writes == 0) {
      ADD_FAILURE() << "after a completion " << reads << " reads and no write are in flight: "
                    << "the write waits for the read's whole extent";
    }
    // Complete the oldest chunk of each op: both advance.
    std::vector<IoRequest*> pending = manual->Pending();
    for (uint64_t id : {tr.id, tw.id}) {
      for (IoRequest* r : pending) {
        if (r->user_data == id) {
          ASSERT_TRUE(manual->Complete(r).ok());
          break;
        }
      }
    }
    if (!read_done) read_done = store->Poll(tr);  // reaps, feeds the next chunks
    if (!write_done) write_done = store->Poll(tw);
  }
  EXPECT_GE(rounds_with_both, 8u);  // 17 chunks each: both run for most of the way
  ASSERT_TRUE(read_done && write_done);
  EXPECT_TRUE(read_done->ok()) << *read_done;
  EXPECT_TRUE(write_done->ok()) << *write_done;
  EXPECT_EQ(
      std::memcmp(store->Payload(ra.span()).data(), store->Payload(a.span()).data(), 256 * kKiB),
      0);
  AlignedBuffer rb(store->ExtentBufferBytes());
  manual->SetAutoComplete(testing::AutoComplete::kOn);
  auto t = store->ReadExtent(1, rb.span()).value();
  ASSERT_TRUE(store->Wait(t).ok());
  EXPECT_EQ(
      std::memcmp(store->Payload(rb.span()).data(), store->Payload(b.span()).data(), 256 * kKiB),
      0);
}

TEST_F(StoreTest, FailedWriteKeepsThePreviousCopyBitwise) {
  auto fault = FaultStorage::Create(CreatePosixStorage(), {.seed = 1});
  auto store = StateStore::Create(*fault, Options(2, 200000, 2, 65536)).value();
  AlignedBuffer good(store->ExtentBufferBytes()), next(store->ExtentBufferBytes()),
      back(store->ExtentBufferBytes());
  FillPattern(store->Payload(good.span()), 1);
  ASSERT_TRUE(WriteWait(*store, 0, good.span()).ok());
  for (auto kind :
       {&testing::FaultOptions::write_eio_one_in, &testing::FaultOptions::write_enospc_one_in}) {
    testing::FaultOptions fo{.seed = 2};
    fo.*kind = 1;
    fault->SetOptions(fo);
    FillPattern(store->Payload(next.span()), 2);
    Status s = WriteWait(*store, 0, next.span());
    EXPECT_FALSE(s.ok());
    EXPECT_TRUE(s.code() == StatusCode::kInternal || s.code() == StatusCode::kResourceExhausted)
        << s;
    EXPECT_NE(s.message().find("write extent 0 (generation 2, slot 0)"), std::string_view::npos)
        << s;
    EXPECT_NE(s.message().find("strata-rank1.state@"), std::string_view::npos) << s;
    EXPECT_NE(s.message().find("generation 1 in the other slot is intact"), std::string_view::npos)
        << s;
    fault->SetOptions({});
    EXPECT_EQ(store->generation(0), 1u);
    ASSERT_TRUE(ReadWait(*store, 0, back.span()).ok());
    EXPECT_EQ(
        std::memcmp(store->Payload(back.span()).data(), store->Payload(good.span()).data(), 200000),
        0);
  }
}

// A file whose queue breaks cannot tell which requests completed: the store
// says so on every later call instead of hanging or blaming the caller, its
// destruction drains the requests (posix: worker threads still write into
// them; ASan would see it), and nothing it returns later is wrong: reopened,
// the extent only read reads back bitwise, the ones written read back the old
// or the new payload, or DataLoss where the write was torn.
TEST_F(StoreTest, BrokenQueueStopsTheStoreAndKeepsWhatWasCommitted) {
  auto fault = FaultStorage::Create(CreatePosixStorage(), {.seed = 3});
  StateStoreOptions o = Options(2, 200000, 3, 16384);
  std::vector<std::unique_ptr<AlignedBuffer>> old, next;
  {
    auto store = StateStore::Create(*fault, o).value();
    for (uint32_t id = 0; id < 3; ++id) {
      old.push_back(std::make_unique<AlignedBuffer>(store->ExtentBufferBytes()));
      next.push_back(std::make_unique<AlignedBuffer>(store->ExtentBufferBytes()));
      FillPattern(store->Payload(old[id]->span()), 10 + id);
      FillPattern(store->Payload(next[id]->span()), 20 + id);
      ASSERT_TRUE(WriteWait(*store, id, old[id]->span()).ok());
    }
    ASSERT_TRUE(store->Sync().ok());
    // Two writes and a read in flight (26 chunks over 2 files, queue depth 4).
    AlignedBuffer back(store->ExtentBufferBytes());
    auto w0 = store->WriteExtent(0, next[0]->span()).value();
    auto w1 = store->WriteExtent(1, next[1]->span()).value();
    auto r2 = store->ReadExtent(2, back.span()).value();
    fault->SetOptions({.seed = 4, .queue_fail_one_in = 1});
    const Status broken = store->Wait(w0);
    ASSERT_FALSE(broken.ok());
    EXPECT_EQ(fault->stats().queue_failures.load(), 1u);
    EXPECT_EQ(broken.code(), StatusCode::kInternal) << broken;
    for (std::string_view part : {"IO queue of", "strata-rank1.state", "EIO", "in flight",
                                  "load the last checkpoint"}) {
      EXPECT_NE(broken.message().find(part), std::string_view::npos) << part << ": " << broken;
    }
    fault->SetOptions({});  // the queue stays broken: the store does not retry it
    EXPECT_EQ(store->Poll(w1), broken);
    EXPECT_EQ(store->Wait(r2), broken);
    EXPECT_EQ(store->WaitSome(), broken);
    EXPECT_EQ(store->Sync(), broken);
    EXPECT_EQ(store->ReadExtent(2, back.span()).status(), broken);
    EXPECT_EQ(store->WriteExtent(2, next[2]->span()).status(), broken);
    EXPECT_EQ(store->generation(0), 1u);
  }
  o.open = StoreOpen::kOpenExisting;
  auto store = StateStore::Create(*fault, o);
  ASSERT_TRUE(store.ok()) << store.status();
  for (uint32_t id = 0; id < 3; ++id) {
    AlignedBuffer back((*store)->ExtentBufferBytes());
    Status read = ReadWait(**store, id, back.span());
    if (id < 2 && !read.ok()) {
      // The write's header landed and part of its payload: torn, as after a
      // crash mid-write; never returned as data.
      EXPECT_EQ(read.code(), StatusCode::kDataLoss) << read;
      continue;
    }
    ASSERT_TRUE(read.ok()) << "extent " << id << ": " << read;
    const std::byte* got = (*store)->Payload(back.span()).data();
    const bool is_old = std::memcmp(got, (*store)->Payload(old[id]->span()).data(), 200000) == 0;
    const bool is_next = std::memcmp(got, (*store)->Payload(next[id]->span()).data(), 200000) == 0;
    EXPECT_TRUE(is_old || (id < 2 && is_next)) << "extent " << id;
  }
}

// StoreClose::kRemove (the engine's): closing removes the state files, under
// the lock; the lock files stay (file_lock.h). After a broken queue the
// files stay, with a warning naming them. kKeep leaves them to reopen.
TEST_F(StoreTest, RemoveOnCloseRemovesTheStateFilesButNotAfterABrokenQueue) {
  namespace fs = std::filesystem;
  auto storage = CreatePosixStorage();
  StateStoreOptions o = Options(2, 8192, 2, 4096);
  o.close = StoreClose::kRemove;
  const std::string state0 = paths_[0] + "/strata-rank1.state";
  const std::string state1 = paths_[1] + "/strata-rank1.state";
  {
    auto store = StateStore::Create(*storage, o);
    ASSERT_TRUE(store.ok()) << store.status();
    AlignedBuffer a((*store)->ExtentBufferBytes());
    FillPattern((*store)->Payload(a.span()), 1);
    ASSERT_TRUE(WriteWait(**store, 0, a.span()).ok());
    EXPECT_TRUE(fs::exists(state0));
    EXPECT_TRUE(fs::exists(state1));
  }
  EXPECT_FALSE(fs::exists(state0));
  EXPECT_FALSE(fs::exists(state1));
  EXPECT_TRUE(fs::exists(paths_[0] + "/strata-rank1.lock"));

  auto fault = FaultStorage::Create(CreatePosixStorage(), {.seed = 3});
  testing::LogCapture log(LogLevel::kWarning);
  {
    // The buffer outlives the store: after the broken queue the write stays in
    // flight until the store's files drain it on close.
    std::unique_ptr<AlignedBuffer> a;
    auto store = StateStore::Create(*fault, o);
    ASSERT_TRUE(store.ok()) << store.status();
    a = std::make_unique<AlignedBuffer>((*store)->ExtentBufferBytes());
    fault->SetOptions({.seed = 4, .queue_fail_one_in = 1});
    EXPECT_FALSE(WriteWait(**store, 0, a->span()).ok());
    fault->SetOptions({});
  }
  EXPECT_TRUE(fs::exists(state0));
  EXPECT_TRUE(fs::exists(state1));
  const auto kept = log.Find(LogLevel::kWarning, "after the IO queue failed");
  ASSERT_EQ(kept.size(), 1u);
  EXPECT_NE(kept[0].find(state0), std::string::npos) << kept[0];

  o.close = StoreClose::kKeep;  // the default: reopened below
  { ASSERT_TRUE(StateStore::Create(*storage, o).ok()); }
  o.open = StoreOpen::kOpenExisting;
  EXPECT_TRUE(StateStore::Create(*storage, o).ok());
}

// A removed state file gives its space back when the store is gone, not
// when io_uring lets go of the file some time later: an optimizer built next
// on a nearly full disk (bench step after its drive probe, a rebuilt
// OffloadAdam) measures the free space at once.
TEST_F(StoreTest, RemovedStateFilesFreeTheirSpaceAtOnce) {
  if (!UringAvailable()) GTEST_SKIP() << "io_uring is not available here";
  auto free_bytes = [&] {
    struct statvfs v {};
    EXPECT_EQ(::statvfs(paths_[0].c_str(), &v), 0);
    return uint64_t{v.f_bavail} * v.f_frsize;
  };
  auto storage = *CreateUringStorage(SqPoll::kOff);
  StateStoreOptions o = Options(1, 16 * kMiB, 4, 1 * kMiB);
  o.close = StoreClose::kRemove;
  const std::string file = paths_[0] + "/strata-rank1.state";
  // Other tests write beside this one (a drive probe writes 256 MiB): a
  // round counts when at least half of the 128 MiB showed up as free, and
  // two of three must (files kept by io_uring freed nothing in any round).
  int freed_at_once = 0;
  for (int round = 0; round < 3; ++round) {
    uint64_t before_close = 0;
    {
      auto store = StateStore::Create(*storage, o);
      ASSERT_TRUE(store.ok()) << store.status();
      AlignedBuffer a((*store)->ExtentBufferBytes());
      std::span<std::byte> span = a.span();
      ASSERT_TRUE((*store)->RegisterBuffers({&span, 1}).ok());
      FillPattern((*store)->Payload(a.span()), 1);
      for (uint32_t e = 0; e < 4; ++e) ASSERT_TRUE(WriteWait(**store, e, a.span()).ok());
      // 2 slots x 4 x 16 MiB reserved: the file's own blocks, which tests
      // running beside this one cannot change (the free space they can).
      struct stat st {};
      ASSERT_EQ(::stat(file.c_str(), &st), 0) << file;
      ASSERT_GE(uint64_t(st.st_blocks) * 512, 128 * kMiB);
      before_close = free_bytes();
    }
    const uint64_t after = free_bytes();
    std::printf("round %d: %.1f MiB freed at close\n", round,
                (double(after) - double(before_close)) / double(kMiB));
    freed_at_once += after > before_close + 64 * kMiB;
  }
  EXPECT_GE(freed_at_once, 2) << "the removed state file kept its blocks after the store closed";
}

// IoPump counts a busy interval before the future of the request that ends
// it is ready: whoever waits for its last request and then takes the busy
// time gets all of it (a step's NVMe time once went to the next step: 0,
// then twice as much). The waiter spins, so it takes the busy time the
// moment the future is ready, racing the pump thread as a busy step does.
TEST_F(StoreTest, IoPumpCountsTheBusyTimeBeforeTheRequestCompletes) {
  auto storage = CreateMemStorage();
  auto store = StateStore::Create(*storage, Options(1, 4096, 1, 4096));
  ASSERT_TRUE(store.ok()) << store.status();
  AlignedBuffer a((*store)->ExtentBufferBytes());
  FillPattern((*store)->Payload(a.span()), 1);
  const uint64_t hash = (*store)->PayloadHash(a.span());
  internal::IoPump pump(**store);
  int missed = 0;
  for (int i = 0; i < 500; ++i) {
    std::future<Status> done =
        pump.Submit({.op = IoOp::kWrite, .extent = 0, .buffer = a.span(), .payload_hash = hash});
    while (done.wait_for(std::chrono::seconds(0)) != std::future_status::ready) {
    }
    ASSERT_TRUE(done.get().ok());
    if (pump.TakeBusySec() <= 0) ++missed;
  }
  EXPECT_EQ(missed, 0) << "of 500 requests";
}

TEST_F(StoreTest, TornWriteIsDataLossNeverStaleOrCorruptData) {
  auto fault = FaultStorage::Create(CreateMemStorage(), {.seed = 1});
  auto store = StateStore::Create(*fault, Options(1, 1 << 20, 1, 1 << 20)).value();
  AlignedBuffer a(store->ExtentBufferBytes()), b(store->ExtentBufferBytes()),
      back(store->ExtentBufferBytes());
  FillPattern(store->Payload(a.span()), 1);
  FillPattern(store->Payload(b.span()), 2);
  ASSERT_TRUE(WriteWait(*store, 0, a.span()).ok());
  ASSERT_TRUE(WriteWait(*store, 0, b.span()).ok());  // generation 2 in slot 0
  fault->SetOptions({.torn_write_one_in = 1});
  // Generation 3 goes to slot 1 (generation 1, payload a): new data whose first
  // half lands, over the old.
  FillPattern(store->Payload(a.span()), 3);
  ASSERT_TRUE(WriteWait(*store, 0, a.span()).ok());
  fault->SetOptions({});
  Status s = ReadWait(*store, 0, back.span());
  EXPECT_EQ(s.code(), StatusCode::kDataLoss) << s;
  EXPECT_NE(s.message().find("generation 3"), std::string_view::npos) << s;
  EXPECT_NE(s.message().find("checkpoint"), std::string_view::npos) << s;
  // Rewriting the extent heals it.
  ASSERT_TRUE(WriteWait(*store, 0, b.span()).ok());
  ASSERT_TRUE(ReadWait(*store, 0, back.span()).ok());
  EXPECT_EQ(
      std::memcmp(store->Payload(back.span()).data(), store->Payload(b.span()).data(), 1 << 20), 0);
}

TEST_F(StoreTest, FlippedBitIsDataLoss) {
  auto storage = CreatePosixStorage();
  auto store = StateStore::Create(*storage, Options(1, 50000, 1, 65536)).value();
  AlignedBuffer a(store->ExtentBufferBytes()), back(store->ExtentBufferBytes());
  FillPattern(store->Payload(a.span()), 1);
  ASSERT_TRUE(WriteWait(*store, 0, a.span()).ok());
  ASSERT_TRUE(store->Sync().ok());
  // Generation 1 is slot 1 of extent 0: after the superblock's block and
  // slot 0 (57344 bytes, rounded up to the 64 KiB block), past its header.
  const off_t block = 65536;
  ASSERT_LE(store->ExtentBufferBytes(), static_cast<uint64_t>(block));
  const off_t pos = block + block + 4096 + 777;
  int fd = ::open(store->file_paths()[0].c_str(), O_RDWR);
  ASSERT_GE(fd, 0);
  std::byte x;
  ASSERT_EQ(::pread(fd, &x, 1, pos), 1);
  x ^= std::byte{0x10};
  ASSERT_EQ(::pwrite(fd, &x, 1, pos), 1);
  ::fsync(fd);
  ::close(fd);
  Status s = ReadWait(*store, 0, back.span());
  EXPECT_EQ(s.code(), StatusCode::kDataLoss) << s;
  EXPECT_NE(s.message().find("payload checksum"), std::string_view::npos) << s;
  // The same read with the payload check left to the caller: the header is
  // fine, so the read completes, and VerifyPayload finds the flipped bit.
  auto t = store->ReadExtent(0, back.span(), PayloadCheck::kCaller).value();
  ASSERT_TRUE(store->Wait(t).ok());
  Status v = store->VerifyPayload(0, back.span());
  EXPECT_EQ(v.code(), StatusCode::kDataLoss) << v;
  EXPECT_NE(v.message().find("payload checksum"), std::string_view::npos) << v;
  EXPECT_NE(v.message().find(store->file_paths()[0]), std::string_view::npos) << v;
  // A caller-computed hash is the store's own: a good copy verifies.
  FillPattern(store->Payload(a.span()), 3);
  auto w = store->WriteExtent(0, a.span(), store->PayloadHash(a.span())).value();
  ASSERT_TRUE(store->Wait(w).ok());
  t = store->ReadExtent(0, back.span(), PayloadCheck::kCaller).value();
  ASSERT_TRUE(store->Wait(t).ok());
  EXPECT_TRUE(store->VerifyPayload(0, back.span()).ok());
  EXPECT_TRUE(ReadWait(*store, 0, back.span()).ok());
  EXPECT_NE(s.message().find(store->file_paths()[0]), std::string_view::npos) << s;
}

// A slot striped over two paths whose part on the second fails its
// checksum: the message names every file's part of the slot, the second's
// included. It named the first file's offset with the whole slot's size.
TEST_F(StoreTest, AFlippedBitOnAnotherPathIsNamedWithItsFileAndOffset) {
  auto storage = CreatePosixStorage();
  constexpr uint64_t kBlock = 65536;
  // 4 KiB header + 100000 bytes rounded up: a 64 KiB chunk on path 0, 40 KiB on path 1.
  auto store = StateStore::Create(*storage, Options(2, 100000, 1, kBlock)).value();
  AlignedBuffer a(store->ExtentBufferBytes()), back(store->ExtentBufferBytes());
  FillPattern(store->Payload(a.span()), 1);
  ASSERT_TRUE(WriteWait(*store, 0, a.span()).ok());
  ASSERT_TRUE(store->Sync().ok());
  // Generation 1 is slot 1: past the superblock's block and slot 0 (one
  // block per file), at the same offset in both files.
  const off_t slot1 = 2 * kBlock;
  int fd = ::open(store->file_paths()[1].c_str(), O_RDWR);
  ASSERT_GE(fd, 0);
  std::byte x;
  ASSERT_EQ(::pread(fd, &x, 1, slot1 + 777), 1);
  x ^= std::byte{0x10};
  ASSERT_EQ(::pwrite(fd, &x, 1, slot1 + 777), 1);
  ::fsync(fd);
  ::close(fd);
  const std::string where = store->file_paths()[0] + "@131072+64KiB, " + store->file_paths()[1] +
                            "@131072+40KiB (generation 1";
  Status s = ReadWait(*store, 0, back.span());
  EXPECT_EQ(s.code(), StatusCode::kDataLoss) << s;
  EXPECT_NE(s.message().find(where), std::string_view::npos) << s;
  auto t = store->ReadExtent(0, back.span(), PayloadCheck::kCaller).value();
  ASSERT_TRUE(store->Wait(t).ok());
  Status v = store->VerifyPayload(0, back.span());
  EXPECT_EQ(v.code(), StatusCode::kDataLoss) << v;
  EXPECT_NE(v.message().find(where), std::string_view::npos) << v;
}

// The payload checksum: XXH3-64 over the XXH3-64s of the 1 MiB pieces, the
// same whichever threads (and in whatever order) the pieces are hashed on;
// a store that hashes on threads and one that does not read each other's
// extents, and a flipped byte in the short last piece is found.
TEST_F(StoreTest, PayloadHashIsPiecewiseAndTheSameOnAnyThreads) {
  auto storage = CreatePosixStorage();
  constexpr uint64_t kExtent = 3 * kMiB + 12345 * 4;  // three whole pieces and a short one
  StateStoreOptions threaded = Options(1, kExtent, 1, kMiB);
  std::atomic<int> calls{0};
  threaded.parallel_for = [&](size_t n, const std::function<void(size_t, size_t)>& body) {
    ++calls;
    std::vector<std::thread> threads;
    for (size_t k = n; k-- > 0;) threads.emplace_back([&, k] { body(k, 1); });  // last first
    for (auto& t : threads) t.join();
  };
  auto store = StateStore::Create(*storage, threaded).value();
  AlignedBuffer a(store->ExtentBufferBytes()), back(store->ExtentBufferBytes());
  FillPattern(store->Payload(a.span()), 7);
  const uint64_t hash = store->PayloadHash(a.span());
  EXPECT_EQ(calls.load(), 1);
  // The definition, by hand.
  const std::byte* p = store->Payload(a.span()).data();
  std::vector<XXH64_hash_t> pieces;
  for (uint64_t at = 0; at < kExtent; at += StateStore::kHashPieceBytes) {
    pieces.push_back(XXH3_64bits(p + at, std::min(StateStore::kHashPieceBytes, kExtent - at)));
  }
  ASSERT_EQ(pieces.size(), 4u);
  EXPECT_EQ(hash, XXH3_64bits(pieces.data(), pieces.size() * sizeof(XXH64_hash_t)));
  // Written by the threaded store, read by a plain one (and back).
  ASSERT_TRUE(WriteWait(*store, 0, a.span()).ok());
  store.reset();
  StateStoreOptions plain = Options(1, kExtent, 1, kMiB);
  plain.open = StoreOpen::kOpenExisting;
  auto reopened = StateStore::Create(*storage, plain).value();
  ASSERT_TRUE(ReadWait(*reopened, 0, back.span()).ok());
  EXPECT_EQ(reopened->PayloadHash(back.span()), hash);
  // A flipped byte in the short last piece.
  reopened->Payload(back.span())[kExtent - 1] ^= std::byte{1};
  EXPECT_NE(reopened->PayloadHash(back.span()), hash);
  EXPECT_EQ(reopened->VerifyPayload(0, back.span()).code(), StatusCode::kDataLoss);
}

TEST_F(StoreTest, ReopenAfterRestartScansGenerations) {
  auto storage = CreateUringStorage(SqPoll::kOff);
  std::unique_ptr<Storage> st = storage.ok() ? std::move(storage).value() : CreatePosixStorage();
  StateStoreOptions o = Options(2, 70000, 3, 16384);
  std::vector<std::unique_ptr<AlignedBuffer>> bufs;
  {
    auto store = StateStore::Create(*st, o).value();
    for (uint32_t id = 0; id < 3; ++id) {
      bufs.push_back(std::make_unique<AlignedBuffer>(store->ExtentBufferBytes()));
      for (uint32_t g = 0; g <= id; ++g) {  // extent id reaches generation id + 1
        FillPattern(store->Payload(bufs[id]->span()), id * 100 + g);
        ASSERT_TRUE(WriteWait(*store, id, bufs[id]->span()).ok());
      }
    }
    ASSERT_TRUE(store->Sync().ok());
  }
  o.open = StoreOpen::kOpenExisting;
  auto store = StateStore::Create(*st, o);
  ASSERT_TRUE(store.ok()) << store.status();
  for (uint32_t id = 0; id < 3; ++id) {
    EXPECT_EQ((*store)->generation(id), id + 1);
    AlignedBuffer back((*store)->ExtentBufferBytes());
    ASSERT_TRUE(ReadWait(**store, id, back.span()).ok());
    EXPECT_EQ(std::memcmp((*store)->Payload(back.span()).data(),
                          (*store)->Payload(bufs[id]->span()).data(), 70000),
              0);
  }
  store->reset();
  StateStoreOptions other = o;
  other.extent_bytes = 80000;
  auto bad = StateStore::Create(*st, other);
  EXPECT_EQ(bad.status().code(), StatusCode::kFailedPrecondition) << bad.status();
  EXPECT_NE(bad.status().message().find("same paths"), std::string_view::npos) << bad.status();
}

// A superblock that is not Strata's (other JSON, a magic of another type)
// is DataLoss on open, never an exception out of Create.
TEST_F(StoreTest, AForeignSuperblockIsDataLoss) {
  auto st = CreatePosixStorage();
  StateStoreOptions o = Options(1, 70000, 2, 16384);
  std::string path;
  {
    auto store = StateStore::Create(*st, o).value();
    path = store->file_paths()[0];
  }
  o.open = StoreOpen::kOpenExisting;
  for (std::string text : {"{\"magic\": 5}", "[1, 2]", "{\"magic\": \"other\"}"}) {
    text.resize(4096, '\0');
    int fd = ::open(path.c_str(), O_WRONLY);
    ASSERT_GE(fd, 0);
    ASSERT_EQ(::pwrite(fd, text.data(), text.size(), 0), static_cast<ssize_t>(text.size()));
    ::close(fd);
    auto store = StateStore::Create(*st, o);
    ASSERT_FALSE(store.ok()) << text.c_str();
    EXPECT_EQ(store.status().code(), StatusCode::kDataLoss) << store.status();
    EXPECT_NE(store.status().message().find("no valid superblock"), std::string_view::npos)
        << store.status();
  }
}

TEST_F(StoreTest, CrashLosesOnlyUnsyncedGenerations) {
  auto fault =
      FaultStorage::Create(CreatePosixStorage(), {.drop_unsynced = testing::DropUnsynced::kOn});
  StateStoreOptions o = Options(2, 100000, 2, 32768);
  AlignedBuffer a(4096 + 102400), b(4096 + 102400), back(4096 + 102400);
  {
    auto store = StateStore::Create(*fault, o).value();
    ASSERT_EQ(store->ExtentBufferBytes(), a.size());
    FillPattern(store->Payload(a.span()), 1);
    FillPattern(store->Payload(b.span()), 2);
    ASSERT_TRUE(WriteWait(*store, 0, a.span()).ok());
    ASSERT_TRUE(WriteWait(*store, 1, a.span()).ok());
    ASSERT_TRUE(store->Sync().ok());
    ASSERT_TRUE(WriteWait(*store, 0, b.span()).ok());  // generation 2, never synced
  }
  ASSERT_TRUE(fault->SimulateCrash().ok());
  o.open = StoreOpen::kOpenExisting;
  auto store = StateStore::Create(*fault, o).value();
  EXPECT_EQ(store->generation(0), 1u);
  EXPECT_EQ(store->generation(1), 1u);
  ASSERT_TRUE(ReadWait(*store, 0, back.span()).ok());
  EXPECT_EQ(
      std::memcmp(store->Payload(back.span()).data(), store->Payload(a.span()).data(), 100000), 0);
}

// Two runs (or two optimizers of one process) pointed at one nvme_path: the
// second store of a rank fails before it touches a file, naming the
// directory and the holder, and the first store's state is intact.
// An nvme_path this user cannot write (or a read-only mount) is named with
// its errno and the fix; it used to read "another optimizer keeps rank 1's
// state in ...". As root this runs as nobody (root passes permission checks).
TEST_F(StoreTest, AnUnwritableDirectoryIsNamedNotBlamedOnAnotherOptimizer) {
  namespace fs = std::filesystem;
  fs::permissions(dir_.path(), fs::perms::owner_all | fs::perms::group_read |
                                   fs::perms::group_exec | fs::perms::others_read |
                                   fs::perms::others_exec);
  fs::permissions(paths_[0], fs::perms::owner_read | fs::perms::owner_exec | fs::perms::group_read |
                                 fs::perms::group_exec | fs::perms::others_read |
                                 fs::perms::others_exec);
  const StateStoreOptions options = Options(1, 8192, 2, 4096);
  auto failed = testing::RunUnprivileged([&]() -> std::string {
    auto storage = CreatePosixStorage();
    auto store = StateStore::Create(*storage, options);
    if (store.ok()) return "created a store in an unwritable directory";
    const std::string m(store.status().message());
    for (const std::string& needle :
         {"open state store: lock " + paths_[0] + "/strata-rank1.lock: EACCES",
          std::string("give a directory it can write")}) {
      if (m.find(needle) == std::string::npos) return "no '" + needle + "' in " + m;
    }
    if (m.find("another optimizer") != std::string::npos) return "blames another optimizer: " + m;
    return "";
  });
  if (!failed) GTEST_SKIP() << "cannot switch to uid 65534";
  EXPECT_EQ(*failed, "");
  EXPECT_FALSE(fs::exists(paths_[0] + "/strata-rank1.state"));
}

TEST_F(StoreTest, ASecondStoreOfARankOnOneDirectoryIsRefusedAndTruncatesNothing) {
  for (auto make : {+[] { return CreatePosixStorage(); }, +[] { return CreateMemStorage(); }}) {
    auto storage = make();
    auto first = StateStore::Create(*storage, Options(2, 8192, 2, 4096));
    ASSERT_TRUE(first.ok()) << first.status();
    AlignedBuffer a((*first)->ExtentBufferBytes()), back((*first)->ExtentBufferBytes());
    FillPattern((*first)->Payload(a.span()), 5);
    ASSERT_TRUE(WriteWait(**first, 0, a.span()).ok());

    // The second path alone is enough to collide.
    StateStoreOptions other = Options(2, 8192, 2, 4096);
    other.paths = {paths_[2], paths_[1]};
    auto second = StateStore::Create(*storage, other);
    ASSERT_FALSE(second.ok());
    EXPECT_EQ(second.status().code(), StatusCode::kFailedPrecondition) << second.status();
    EXPECT_NE(second.status().message().find(paths_[1] + "/strata-rank1.lock"),
              std::string_view::npos)
        << second.status();
    EXPECT_NE(second.status().message().find("this process"), std::string_view::npos)
        << second.status();
    EXPECT_NE(second.status().message().find("own nvme_path"), std::string_view::npos)
        << second.status();
    ASSERT_TRUE(ReadWait(**first, 0, back.span()).ok());
    EXPECT_EQ(std::memcmp((*first)->Payload(back.span()).data(),
                          (*first)->Payload(a.span()).data(), 8192),
              0);

    // Another rank of the same job shares the directory legitimately.
    StateStoreOptions rank2 = Options(2, 8192, 2, 4096);
    rank2.rank = 2;
    EXPECT_TRUE(StateStore::Create(*storage, rank2).ok());
    // Once the first store is gone, the directory is free again.
    first->reset();
    StateStoreOptions reopen = Options(2, 8192, 2, 4096);
    reopen.open = StoreOpen::kOpenExisting;
    auto again = StateStore::Create(*storage, reopen);
    ASSERT_TRUE(again.ok()) << again.status();
    ASSERT_TRUE(ReadWait(**again, 0, back.span()).ok());
  }
}

TEST_F(StoreTest, BadArgumentsAreReportedBeforeAnyIo) {
  auto storage = CreateMemStorage();
  auto store = StateStore::Create(*storage, Options(1, 8192, 2, 4096)).value();
  AlignedBuffer buf(store->ExtentBufferBytes() + 4096);
  EXPECT_EQ(store->ReadExtent(0, buf.span().first(store->ExtentBufferBytes())).status().code(),
            StatusCode::kFailedPrecondition);  // never written
  EXPECT_EQ(store->WriteExtent(2, buf.span().first(store->ExtentBufferBytes())).status().code(),
            StatusCode::kOutOfRange);
  EXPECT_EQ(store->WriteExtent(0, buf.span()).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(
      store->WriteExtent(0, buf.span().subspan(8, store->ExtentBufferBytes())).status().code(),
      StatusCode::kInvalidArgument);
  EXPECT_EQ(store->Wait({12345}).code(), StatusCode::kNotFound);
  EXPECT_EQ(StateStore::Create(*storage, Options(1, 8192, 2, 1000)).status().code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(StateStore::Create(*storage, {}).status().code(), StatusCode::kInvalidArgument);
  StateStoreOptions missing = Options(1, 8192, 2, 4096);
  missing.paths = {dir_.File("no-such-dir")};
  auto st2 = CreatePosixStorage();
  Status s = StateStore::Create(*st2, missing).status();
  EXPECT_EQ(s.code(), StatusCode::kNotFound) << s;
  EXPECT_NE(s.message().find("no-such-dir"), std::string_view::npos) << s;
}

// Many seeds of random writes and reads under every kind of fault. A read that
// succeeds returns exactly the last committed payload; a failed write never
// changes what reads return; DataLoss happens only after a torn write.
TEST_F(StoreTest, FaultSuiteManySeeds) {
  const uint64_t base_seed = std::random_device{}();
  std::printf("base seed %llu\n", static_cast<unsigned long long>(base_seed));
  uint64_t writes_failed = 0, reads_failed = 0, data_loss = 0, reads_ok = 0;
  constexpr uint32_t kExtents = 4;
  constexpr uint64_t kPayload = 40000;
  for (uint64_t i = 0; i < 150; ++i) {
    const uint64_t seed = base_seed + i;
    SCOPED_TRACE("seed " + std::to_string(seed));
    std::mt19937_64 rng(seed);
    testing::FaultOptions fo{.seed = seed,
                             .read_eio_one_in = 25,
                             .write_eio_one_in = 25,
                             .write_enospc_one_in = 40,
                             .eintr_one_in = 6,
                             .short_io_one_in = 5,
                             .torn_write_one_in = i % 3 == 0 ? 40u : 0u};
    auto fault = FaultStorage::Create(CreateMemStorage(), {});
    auto store = StateStore::Create(*fault, Options(2, kPayload, kExtents, 8192)).value();
    fault->SetOptions(fo);
    std::vector<std::vector<std::byte>> model(kExtents);
    std::vector<bool> torn(kExtents, false);
    AlignedBuffer buf(store->ExtentBufferBytes());
    for (int step = 0; step < 30; ++step) {
      const uint32_t id = rng() % kExtents;
      const uint64_t torn_before = fault->stats().torn_writes.load();
      if (model[id].empty() || rng() % 2) {
        FillPattern(store->Payload(buf.span()), rng());
        Status s = WriteWait(*store, id, buf.span());
        if (s.ok()) {
          auto p = store->Payload(buf.span());
          model[id].assign(p.begin(), p.end());
          torn[id] = fault->stats().torn_writes.load() != torn_before;
        } else {
          ++writes_failed;
          ASSERT_TRUE(s.code() == StatusCode::kInternal ||
                      s.code() == StatusCode::kResourceExhausted)
              << s;
          ASSERT_NE(s.message().find("write extent " + std::to_string(id)), std::string_view::npos)
              << s;
        }
      } else {
        std::memset(buf.data(), 0, buf.size());
        Status s = ReadWait(*store, id, buf.span());
        if (s.ok()) {
          ++reads_ok;
          ASSERT_FALSE(torn[id]) << "a torn extent was returned as good";
          ASSERT_EQ(std::memcmp(store->Payload(buf.span()).data(), model[id].data(), kPayload), 0)
              << "extent " << id << " step " << step;
        } else if (s.code() == StatusCode::kDataLoss) {
          ++data_loss;
          ASSERT_TRUE(torn[id]) << s;
        } else {
          ++reads_failed;
          ASSERT_EQ(s.code(), StatusCode::kInternal) << s;
          ASSERT_NE(s.message().find("EIO"), std::string_view::npos) << s;
        }
      }
    }
    // With faults off, every extent reads back its last committed payload.
    fault->SetOptions({});
    for (uint32_t id = 0; id < kExtents; ++id) {
      if (model[id].empty() || torn[id]) continue;
      ASSERT_TRUE(ReadWait(*store, id, buf.span()).ok());
      ASSERT_EQ(std::memcmp(store->Payload(buf.span()).data(), model[id].data(), kPayload), 0)
          << "extent " << id;
    }
  }
  std::printf(
      "writes failed %llu, reads failed %llu, data loss detected %llu, reads ok %llu\n",
      static_cast<unsigned long long>(writes_failed), static_cast<unsigned long long>(reads_failed),
      static_cast<unsigned long long>(data_loss), static_cast<unsigned long long>(reads_ok));
  EXPECT_GT(writes_failed, 20u);
  EXPECT_GT(reads_failed, 10u);
  EXPECT_GT(data_loss, 0u);
  EXPECT_GT(reads_ok, 500u);
}

}  // namespace
}  // namespace strata
