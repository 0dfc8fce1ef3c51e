#include "runtime/pinned.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <linux/capability.h>
#include <sys/resource.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "runtime/host_region.h"
#include "runtime/units.h"

namespace strata {
namespace {

using ::testing::HasSubstr;

std::unique_ptr<Device> MakeHost() {
  auto d = CreateHostDevice();
  STRATA_CHECK_OK(d);
  return *std::move(d);
}

PinnedPool MakePool(Device& device, uint64_t budget, uint64_t slab) {
  auto p = PinnedPool::Create(device, {.budget_bytes = budget, .slab_bytes = slab});
  STRATA_CHECK_OK(p);
  return *std::move(p);
}

bool Aligned(const void* p) { return reinterpret_cast<uintptr_t>(p) % PinnedPool::kAlignment == 0; }

TEST(PinnedPool, BuffersAreAlignedAndRounded) {
  auto dev = MakeHost();
  PinnedPool pool = MakePool(*dev, 4 * kMiB, 1 * kMiB);
  for (size_t bytes : {size_t{1}, size_t{4095}, size_t{4096}, size_t{4097}, size_t{100000}}) {
    auto b = pool.Allocate(bytes);
    ASSERT_TRUE(b.ok()) << b.status();
    EXPECT_TRUE(Aligned(b->data())) << bytes;
    EXPECT_EQ(b->size_bytes(), (bytes + 4095) / 4096 * 4096);
    EXPECT_EQ(b->bytes().size(), b->size_bytes());
    std::memset(b->data(), 0x7f, b->size_bytes());
  }
}

// The first buffer of an empty pool starts its first slab.
TEST(PinnedPool, SlabsStartOnA2MiBBoundary) {
  auto dev = MakeHost();
  for (uint64_t slab : {uint64_t{1} * kMiB, uint64_t{2} * kMiB, uint64_t{6} * kMiB + 4096}) {
    PinnedPool pool = MakePool(*dev, 64 * kMiB, slab);
    auto a = pool.Allocate(4096);
    ASSERT_TRUE(a.ok()) << a.status();
    EXPECT_EQ(reinterpret_cast<uintptr_t>(a->data()) % (2 * kMiB), 0u) << "slab " << slab;
    // A request larger than a slab gets a slab of its own, aligned too.
    auto big = pool.Allocate(slab + 4096);
    ASSERT_TRUE(big.ok()) << big.status();
    EXPECT_EQ(reinterpret_cast<uintptr_t>(big->data()) % (2 * kMiB), 0u) << "slab " << slab;
    std::memset(a->data(), 1, a->size_bytes());
    std::memset(big->data(), 2, big->size_bytes());
  }
}

// "[madvise]" from /sys/kernel/mm/transparent_hugepage/<name>, or "".
std::string ThpSetting(const char* name) {
  std::FILE* f =
      std::fopen((std::string("/sys/kernel/mm/transparent_hugepage/") + name).c_str(), "r");
  if (f == nullptr) return "";
  char line[256] = {};
  const bool ok = std::fgets(line, sizeof(line), f) != nullptr;
  std::fclose(f);
  if (!ok) return "";
  const std::string s(line);
  const size_t b = s.find('['), e = s.find(']');
  return b == std::string::npos || e == std::string::npos ? "" : s.substr(b, e - b + 1);
}

// Why advised ranges may get no huge page at fault time ("" when they do).
std::string WhyNoHugePages(const std::string& enabled, const std::string& defrag) {
  if (enabled != "[always]" && enabled != "[madvise]") {
    return "transparent huge pages are " + (enabled.empty() ? std::string("absent") : enabled);
  }
  if (defrag != "[always]" && defrag != "[madvise]" && defrag != "[defer+madvise]") {
    return "THP defrag is " + defrag + ": huge pages at fault time are not guaranteed";
  }
  return "";
}

// AnonHugePages (bytes) of the mapping of /proc/self/smaps that contains p.
uint64_t AnonHugePagesBytes(const void* p) {
  std::FILE* f = std::fopen("/proc/self/smaps", "r");
  if (f == nullptr) return 0;
  const auto addr = reinterpret_cast<uintptr_t>(p);
  char line[512];
  bool inside = false;
  uint64_t kb = 0;
  while (std::fgets(line, sizeof(line), f) != nullptr) {
    unsigned long lo = 0, hi = 0;
    if (std::sscanf(line, "%lx-%lx ", &lo, &hi) == 2) {  // a mapping's first line
      inside = addr >= lo && addr < hi;
    } else if (inside && std::sscanf(line, "AnonHugePages: %lu kB", &kb) == 1) {
      break;
    }
  }
  std::fclose(f);
  return kb * 1024;
}

// Where THP is on for advised ranges and the kernel compacts memory for
// them at fault time, a slab of whole 2 MiB pages is backed by huge pages.
TEST(PinnedPool, SlabsAreBackedByHugePagesWhereTheKernelAllowsIt) {
  const std::string enabled = ThpSetting("enabled");
  const std::string defrag = ThpSetting("defrag");
  if (const std::string why = WhyNoHugePages(enabled, defrag); !why.empty()) GTEST_SKIP() << why;
  auto dev = MakeHost();
  PinnedPool pool = MakePool(*dev, 16 * kMiB, 8 * kMiB);
  auto b = pool.Allocate(8 * kMiB);
  ASSERT_TRUE(b.ok()) << b.status();
  if (!pool.stats().locked) GTEST_SKIP() << "mlock refused: pages are faulted lazily";
  EXPECT_GT(AnonHugePagesBytes(b->data()), 0u)
      << "an 8 MiB locked slab advised MADV_HUGEPAGE has no huge page (THP enabled " << enabled
      << ", defrag " << defrag << ")";
}

// The checkpoint reader's and writer's IO buffers: 2 MiB-aligned, zeroed,
// writable, unmapped with the object, and huge pages where THP allows (with
// 4 KiB pages a virtio disk read and wrote them 2-5x slower).
TEST(HostRegion, IsAlignedZeroedAndBackedByHugePagesWhereTheKernelAllowsIt) {
  for (const size_t bytes : {size_t{1}, size_t{5000}, 9 * kMiB}) {
    SCOPED_TRACE(bytes);
    Result<HostRegion> r = HostRegion::Map(bytes);
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_EQ(r->size(), bytes);
    EXPECT_EQ(reinterpret_cast<uintptr_t>(r->data()) % (2 * kMiB), 0u);
    EXPECT_TRUE(
        std::all_of(r->data(), r->data() + bytes, [](std::byte b) { return b == std::byte{0}; }));
    std::memset(r->data(), 7, bytes);
    HostRegion moved = std::move(*r);
    EXPECT_EQ(r->data(), nullptr);
    EXPECT_EQ(moved.size(), bytes);
    EXPECT_EQ(moved.data()[bytes - 1], std::byte{7});
  }
  const std::string enabled = ThpSetting("enabled");
  const std::string defrag = ThpSetting("defrag");
  if (const std::string why = WhyNoHugePages(enabled, defrag); !why.empty()) GTEST_SKIP() << why;
  Result<HostRegion> r = HostRegion::Map(9 * kMiB);  // a reader lane: 8 + 1 chunks of 1 MiB
  ASSERT_TRUE(r.ok()) << r.status();
  std::memset(r->data(), 1, r->size());
  EXPECT_GE(AnonHugePagesBytes(r->data()), 8 * kMiB)
      << "9 MiB advised MADV_HUGEPAGE (THP enabled " << enabled << ", defrag " << defrag << ")";
}

TEST(PinnedPool, AccountsCapacityInUseAndPeak) {
  auto dev = MakeHost();
  PinnedPool pool = MakePool(*dev, 4 * kMiB, 1 * kMiB);
  EXPECT_EQ(pool.stats().capacity_bytes, 0u) << "slabs are taken on demand";
  auto a = pool.Allocate(5000);
  auto b = pool.Allocate(1);
  ASSERT_TRUE(a.ok() && b.ok());
  PinnedPoolStats s = pool.stats();
  EXPECT_EQ(s.capacity_bytes, 1 * kMiB);
  EXPECT_EQ(s.slabs, 1u);
  EXPECT_EQ(s.in_use_bytes, 8192u + 4096u);
  EXPECT_EQ(s.peak_bytes, 8192u + 4096u);
  EXPECT_EQ(s.buffers, 2u);
  a->Reset();
  s = pool.stats();
  EXPECT_EQ(s.in_use_bytes, 4096u);
  EXPECT_EQ(s.peak_bytes, 8192u + 4096u);
  EXPECT_EQ(s.buffers, 1u);
  // A request larger than a slab gets a slab of its own.
  auto big = pool.Allocate(2 * kMiB + 1);
  ASSERT_TRUE(big.ok()) << big.status();
  s = pool.stats();
  EXPECT_EQ(s.slabs, 2u);
  EXPECT_EQ(s.capacity_bytes, 1 * kMiB + 2 * kMiB + 4096);
  // Moving a buffer does not free it.
  PinnedBuffer moved = *std::move(big);
  EXPECT_EQ(pool.stats().buffers, 2u);
  moved.Reset();
  EXPECT_EQ(pool.stats().in_use_bytes, 4096u);
}

TEST(PinnedPool, BeyondTheBudgetIsResourceExhausted) {
  auto dev = MakeHost();
  PinnedPool pool = MakePool(*dev, 1 * kMiB, 512 * kKiB);
  auto a = pool.Allocate(768 * kKiB);
  ASSERT_TRUE(a.ok()) << a.status();
  auto b = pool.Allocate(512 * kKiB);
  ASSERT_FALSE(b.ok());
  EXPECT_EQ(b.status().code(), StatusCode::kResourceExhausted);
  const std::string m(b.status().message());
  EXPECT_THAT(m, HasSubstr("allocate 512.00 KiB"));
  EXPECT_THAT(m, HasSubstr("budget 1.00 MiB"));
  EXPECT_THAT(m, HasSubstr("768.00 KiB in use"));
  // The rest of the budget still serves what fits.
  auto c = pool.Allocate(256 * kKiB);
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_LE(pool.stats().capacity_bytes, 1 * kMiB);
}

TEST(PinnedPool, FreedRangesCoalesce) {
  auto dev = MakeHost();
  constexpr size_t kPage = 4096;
  PinnedPool pool = MakePool(*dev, 16 * kPage, 16 * kPage);
  std::vector<PinnedBuffer> pages;
  for (int i = 0; i < 16; ++i) {
    auto b = pool.Allocate(kPage);
    ASSERT_TRUE(b.ok()) << i << ": " << b.status();
    pages.push_back(*std::move(b));
  }
  std::byte* base = pages[0].data();
  for (int i = 0; i < 16; ++i)
    EXPECT_EQ(pages[i].data(), base + i * kPage) << "first fit, in order";
  for (int i = 0; i < 16; i += 2) pages[i].Reset();  // 8 free pages, none adjacent
  auto two = pool.Allocate(2 * kPage);
  ASSERT_FALSE(two.ok()) << "fragmented: no two adjacent free pages";
  EXPECT_THAT(std::string(two.status().message()), HasSubstr("largest free range 4.00 KiB"));
  pages[1].Reset();  // pages 0, 1, 2 now one free range
  auto three = pool.Allocate(3 * kPage);
  ASSERT_TRUE(three.ok()) << three.status();
  EXPECT_EQ(three->data(), base);
  three->Reset();
  pages.clear();
  auto all = pool.Allocate(16 * kPage);
  ASSERT_TRUE(all.ok()) << "everything freed must coalesce back into one range: " << all.status();
  EXPECT_EQ(all->data(), base);
}

TEST(PinnedPool, ThreadSafeUnderConcurrentUse) {
  auto dev = MakeHost();
  PinnedPool pool = MakePool(*dev, 32 * kMiB, 4 * kMiB);
  const unsigned seed = std::random_device{}();
  std::printf("seed=%u\n", seed);
  constexpr int kThreads = 4;
  std::vector<std::thread> threads;
  std::atomic<int> failures{0};
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      std::mt19937 rng(seed + t);
      std::vector<PinnedBuffer> held;
      for (int i = 0; i < 300; ++i) {
        if (!held.empty() && (rng() % 3 == 0 || held.size() > 16)) {
          const size_t victim = rng() % held.size();
          const auto tag = static_cast<uint8_t>(held[victim].data()[0]);
          for (std::byte b : held[victim].bytes()) {
            if (static_cast<uint8_t>(b) != tag) {
              failures.fetch_add(1);
              break;
            }
          }
          held.erase(held.begin() + victim);
          continue;
        }
        auto b = pool.Allocate(1 + rng() % (256 * 1024));
        if (!b.ok()) {
          failures.fetch_add(1);
          continue;
        }
        std::memset(b->data(), (t * 61 + i) & 0xff, b->size_bytes());
        held.push_back(*std::move(b));
      }
    });
  }
  for (auto& th : threads) th.join();
  EXPECT_EQ(failures.load(), 0) << "seed=" << seed;
  PinnedPoolStats s = pool.stats();
  EXPECT_EQ(s.in_use_bytes, 0u);
  EXPECT_EQ(s.buffers, 0u);
  EXPECT_LE(s.capacity_bytes, 32 * kMiB);
  EXPECT_GT(s.peak_bytes, 0u);
}

TEST(PinnedPool, BuffersMayOutliveThePoolObject) {
  auto dev = MakeHost();
  PinnedBuffer kept;
  {
    PinnedPool pool = MakePool(*dev, 1 * kMiB, 1 * kMiB);
    auto b = pool.Allocate(4096);
    ASSERT_TRUE(b.ok());
    kept = *std::move(b);
  }
  std::memset(kept.data(), 1, kept.size_bytes());
  kept.Reset();
}

TEST(PinnedPool, RejectsBadArguments) {
  auto dev = MakeHost();
  EXPECT_EQ(PinnedPool::Create(*dev, {.budget_bytes = 0}).status().code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(PinnedPool::Create(*dev, {.budget_bytes = kMiB, .slab_bytes = 0}).status().code(),
            StatusCode::kInvalidArgument);
  PinnedPool pool = MakePool(*dev, 1 * kMiB, 1 * kMiB);
  EXPECT_EQ(pool.Allocate(0).status().code(), StatusCode::kInvalidArgument);
}

// Runs in a child process: drops CAP_IPC_LOCK and lowers RLIMIT_MEMLOCK so
// that mlock is refused, then checks that the pool still serves unlocked
// memory. Exits 0 on success.
[[noreturn]] void AllocateWithMlockRefused() {
  rlimit limit{64 * 1024, 64 * 1024};
  if (setrlimit(RLIMIT_MEMLOCK, &limit) != 0) std::exit(4);
  __user_cap_header_struct header{_LINUX_CAPABILITY_VERSION_3, 0};
  __user_cap_data_struct caps[2] = {};
  bool dropped = false;
  if (syscall(SYS_capget, &header, caps) == 0) {
    caps[0].effective &= ~(1u << CAP_IPC_LOCK);
    dropped = syscall(SYS_capset, &header, caps) == 0;
  }
  // Where capset is filtered, becoming an ordinary user drops every capability.
  if (!dropped && geteuid() == 0 && setuid(65534) != 0) std::exit(3);
  auto dev = CreateHostDevice();
  if (!dev.ok()) std::exit(5);
  auto pool = PinnedPool::Create(**dev, {.budget_bytes = 16 * kMiB, .slab_bytes = 4 * kMiB});
  if (!pool.ok()) std::exit(6);
  auto a = pool->Allocate(1 * kMiB);
  auto b = pool->Allocate(6 * kMiB);  // a second slab, also unlocked
  if (!a.ok() || !b.ok()) std::exit(7);
  if (pool->stats().locked) std::exit(8);
  std::memset(a->data(), 1, a->size_bytes());
  std::exit(0);
}

TEST(PinnedPoolDeathTest, FallsBackToUnlockedMemoryWhenMlockIsRefused) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_EXIT(AllocateWithMlockRefused(), ::testing::ExitedWithCode(0),
              "warning: mlock 4.00 MiB: E(PERM|NOMEM|AGAIN).*using unlocked host memory");
}

}  // namespace
}  // namespace strata
