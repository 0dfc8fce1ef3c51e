// The fault wrapper under many seeds: every injected error surfaces as a
// Status naming the file, EINTR and short IO are retried to success, reads
// that succeed return exactly what was written, and a crash loses exactly the
// unsynced writes.
#include <gtest/gtest.h>

#include <cstring>
#include <map>
#include <random>

#include "runtime/storage.h"
#include "runtime/testing/fault_storage.h"
#include "runtime/testing/test_util.h"

namespace strata {
namespace {

using testing::AlignedBuffer;
using testing::FaultOptions;
using testing::FaultStorage;
using testing::FillPattern;
using testing::TempDir;

constexpr size_t kPage = 4096;
constexpr size_t kPages = 32;

struct Tally {
  uint64_t ok = 0, failed = 0;
};

// Random batches of page writes and reads over `storage`, checked against a
// model. Pages whose write failed are unknown until rewritten.
Tally RunRandomOps(Storage& storage, const std::string& path, uint64_t seed, int rounds) {
  std::mt19937_64 rng(seed);
  std::vector<std::byte> model(kPages * kPage);
  std::vector<bool> known(kPages, true);
  auto file = storage.Open(path, {.create = FileCreate::kCreate, .queue_depth = 4});
  EXPECT_TRUE(file.ok()) << file.status();
  if (!file.ok()) return {};
  File& f = **file;
  EXPECT_TRUE(f.Resize(kPages * kPage).ok());
  Tally tally;
  for (int round = 0; round < rounds; ++round) {
    std::vector<size_t> pages(kPages);
    for (size_t i = 0; i < kPages; ++i) pages[i] = i;
    std::shuffle(pages.begin(), pages.end(), rng);
    const size_t n = 1 + rng() % 6;
    std::vector<std::unique_ptr<AlignedBuffer>> bufs;
    std::vector<IoRequest> reqs;
    for (size_t i = 0; i < n; ++i) {
      // Two pages per request so short IO has a remainder to resume.
      const size_t page = pages[i] & ~size_t{1};
      if (std::any_of(reqs.begin(), reqs.end(),
                      [&](const IoRequest& r) { return r.offset_bytes == page * kPage; }))
        continue;
      bufs.push_back(std::make_unique<AlignedBuffer>(2 * kPage));
      if (rng() % 2) {
        FillPattern(bufs.back()->span(), rng());
        reqs.push_back(IoRequest::Write(page * kPage, bufs.back()->span(), page));
      } else {
        reqs.push_back(IoRequest::Read(page * kPage, bufs.back()->span(), page));
      }
    }
    EXPECT_TRUE(f.Submit(reqs).ok());
    std::vector<IoRequest*> done(8);
    size_t got = 0;
    while (got < reqs.size()) {
      auto k = f.Reap(done, 1);
      EXPECT_TRUE(k.ok()) << k.status();
      if (!k.ok()) return tally;
      got += *k;
    }
    for (size_t i = 0; i < reqs.size(); ++i) {
      const IoRequest& r = reqs[i];
      const size_t page = r.user_data;
      if (!r.status.ok()) {
        ++tally.failed;
        EXPECT_TRUE(r.status.code() == StatusCode::kInternal ||
                    r.status.code() == StatusCode::kResourceExhausted)
            << r.status;
        EXPECT_NE(r.status.message().find(path + "@" + std::to_string(r.offset_bytes) + "+8KiB"),
                  std::string_view::npos)
            << r.status;
        EXPECT_TRUE(r.status.message().find("EIO") != std::string_view::npos ||
                    r.status.message().find("ENOSPC") != std::string_view::npos)
            << r.status;
        if (r.op == IoOp::kWrite) known[page] = known[page + 1] = false;
        continue;
      }
      ++tally.ok;
      EXPECT_EQ(r.transferred_bytes, 2 * kPage);
      if (r.op == IoOp::kWrite) {
        std::memcpy(model.data() + page * kPage, bufs[i]->data(), 2 * kPage);
        known[page] = known[page + 1] = true;
      } else if (known[page] && known[page + 1]) {
        EXPECT_EQ(std::memcmp(bufs[i]->data(), model.data() + page * kPage, 2 * kPage), 0)
            << "corrupt data returned: page " << page << " round " << round;
      }
    }
  }
  return tally;
}

TEST(FaultStorage, ErrorsSurfaceRetriesSucceedAndDataIsNeverWrongOnMem) {
  uint64_t injected = 0, eintr = 0, shorts = 0, failed = 0, ok = 0;
  const uint64_t base_seed = std::random_device{}();
  for (uint64_t i = 0; i < 300; ++i) {
    const uint64_t seed = base_seed + i;
    SCOPED_TRACE("seed " + std::to_string(seed));
    auto storage = FaultStorage::Create(CreateMemStorage(), {.seed = seed,
                                                             .read_eio_one_in = 13,
                                                             .write_eio_one_in = 11,
                                                             .write_enospc_one_in = 17,
                                                             .eintr_one_in = 5,
                                                             .short_io_one_in = 4});
    Tally t = RunRandomOps(*storage, "f", seed, 20);
    if (::testing::Test::HasFailure()) {
      std::printf("failing seed %llu\n", static_cast<unsigned long long>(seed));
      return;
    }
    injected += storage->stats().injected_errors.load();
    eintr += storage->stats().eintr.load();
    shorts += storage->stats().short_io.load();
    failed += t.failed;
    ok += t.ok;
  }
  std::printf(
      "base seed %llu: %llu ok, %llu failed, %llu errors injected, %llu EINTR, %llu short\n",
      static_cast<unsigned long long>(base_seed), static_cast<unsigned long long>(ok),
      static_cast<unsigned long long>(failed), static_cast<unsigned long long>(injected),
      static_cast<unsigned long long>(eintr), static_cast<unsigned long long>(shorts));
  // Every injected error is one failed request (an EINTR retry that hits the
  // limit would add failures without an injected error; the rates make it
  // practically impossible).
  EXPECT_EQ(failed, injected);
  EXPECT_GT(eintr, 100u);
  EXPECT_GT(shorts, 100u);
  EXPECT_GT(ok, 1000u);
}

TEST(FaultStorage, SameOnRealFilesThroughEveryBackend) {
  TempDir dir;
  ASSERT_TRUE(dir.ok());
  const uint64_t base_seed = std::random_device{}();
  std::vector<std::pair<std::string, std::function<std::unique_ptr<Storage>()>>> bases = {
      {"posix", [] { return CreatePosixStorage(); }}};
  if (UringAvailable())
    bases.push_back({"uring", [] { return CreateUringStorage(SqPoll::kOff).value(); }});
  for (auto& [name, make] : bases) {
    for (uint64_t i = 0; i < 10; ++i) {
      const uint64_t seed = base_seed + i;
      SCOPED_TRACE(name + " seed " + std::to_string(seed));
      auto storage = FaultStorage::Create(make(), {.seed = seed,
                                                   .read_eio_one_in = 9,
                                                   .write_eio_one_in = 9,
                                                   .eintr_one_in = 4,
                                                   .short_io_one_in = 3,
                                                   .latency_one_in = 20});
      Tally t = RunRandomOps(*storage, dir.File(name + std::to_string(i)), seed, 10);
      EXPECT_EQ(t.failed, storage->stats().injected_errors.load());
      if (::testing::Test::HasFailure()) return;
    }
  }
}

TEST(FaultStorage, TornWriteReportsSuccessButPersistsOnlyAPrefix) {
  auto storage = FaultStorage::Create(CreateMemStorage(), {.seed = 1, .torn_write_one_in = 1});
  auto f = storage->Open("t", {.create = FileCreate::kCreate}).value();
  AlignedBuffer old_data(4 * kPage), new_data(4 * kPage), back(4 * kPage);
  FillPattern(old_data.span(), 1);
  FillPattern(new_data.span(), 2);
  storage->SetOptions({});
  IoRequest w = IoRequest::Write(0, old_data.span());
  ASSERT_TRUE(f->Submit(std::span(&w, 1)).ok());
  IoRequest* done[1];
  ASSERT_EQ(f->Reap(done, 1).value(), 1u);
  storage->SetOptions({.torn_write_one_in = 1});
  w = IoRequest::Write(0, new_data.span());
  ASSERT_TRUE(f->Submit(std::span(&w, 1)).ok());
  ASSERT_EQ(f->Reap(done, 1).value(), 1u);
  EXPECT_TRUE(w.status.ok());
  EXPECT_EQ(w.transferred_bytes, 4 * kPage);
  EXPECT_EQ(storage->stats().torn_writes.load(), 1u);
  storage->SetOptions({});
  IoRequest r = IoRequest::Read(0, back.span());
  ASSERT_TRUE(f->Submit(std::span(&r, 1)).ok());
  ASSERT_EQ(f->Reap(done, 1).value(), 1u);
  EXPECT_EQ(std::memcmp(back.data(), new_data.data(), 2 * kPage), 0);
  EXPECT_EQ(std::memcmp(back.data() + 2 * kPage, old_data.data() + 2 * kPage, 2 * kPage), 0);
}

TEST(FaultStorage, CrashLosesExactlyTheUnsyncedWrites) {
  TempDir dir;
  auto storage =
      FaultStorage::Create(CreatePosixStorage(), {.drop_unsynced = testing::DropUnsynced::kOn});
  AlignedBuffer a(kPage), b(kPage), back(2 * kPage);
  FillPattern(a.span(), 1);
  FillPattern(b.span(), 2);
  {
    auto f = storage->Open(dir.File("c"), {.create = FileCreate::kCreate}).value();
    std::vector<IoRequest> w = {IoRequest::Write(0, a.span())};
    ASSERT_TRUE(f->Submit(w).ok());
    IoRequest* done[1];
    ASSERT_EQ(f->Reap(done, 1).value(), 1u);
    ASSERT_TRUE(f->Sync().ok());
    w = {IoRequest::Write(kPage, b.span())};
    ASSERT_TRUE(f->Submit(w).ok());
    ASSERT_EQ(f->Reap(done, 1).value(), 1u);
    ASSERT_TRUE(w[0].status.ok());
  }
  ASSERT_TRUE(storage->SimulateCrash().ok());
  auto f = storage->Open(dir.File("c"), {}).value();
  IoRequest r = IoRequest::Read(0, back.span());
  ASSERT_TRUE(f->Submit(std::span(&r, 1)).ok());
  IoRequest* done[1];
  ASSERT_EQ(f->Reap(done, 1).value(), 1u);
  ASSERT_TRUE(r.status.ok()) << r.status;
  EXPECT_EQ(std::memcmp(back.data(), a.data(), kPage), 0) << "synced data must survive";
  for (size_t i = kPage; i < 2 * kPage; ++i) ASSERT_EQ(back.data()[i], std::byte{0xDB}) << i;
}

TEST(FaultStorage, SyncErrorsSurface) {
  auto storage = FaultStorage::Create(CreateMemStorage(), {.sync_eio_one_in = 1});
  auto f = storage->Open("s", {.create = FileCreate::kCreate}).value();
  Status s = f->Sync();
  EXPECT_EQ(s.code(), StatusCode::kInternal);
  EXPECT_NE(s.message().find("sync s: EIO"), std::string_view::npos) << s;
}

}  // namespace
}  // namespace strata
