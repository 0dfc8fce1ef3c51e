// What only the emulated host device promises: the memory budget, the PCIe
// model (bandwidth cap, latency, one link per direction), checks of device
// ranges, and the device factories.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <thread>
#include <vector>

#include "runtime/device.h"
#include "runtime/units.h"

namespace strata {
namespace {

using ::testing::HasSubstr;
using Clock = std::chrono::steady_clock;

std::unique_ptr<Device> MakeHost(const HostDeviceOptions& options = {}) {
  auto d = CreateHostDevice(options);
  STRATA_CHECK_OK(d);
  return *std::move(d);
}

double Seconds(Clock::duration d) { return std::chrono::duration<double>(d).count(); }

// The fastest of three timed runs of `run`. A late wake-up of a worker or of
// the test thread (a loaded machine, TSan) only makes a run slower: the
// model's lower bounds hold for every run, and its upper bounds for the
// fastest.
template <typename F>
double FastestOf3(F&& run) {
  double best = 1e300;
  for (int i = 0; i < 3; ++i) {
    const auto t0 = Clock::now();
    run();
    best = std::min(best, Seconds(Clock::now() - t0));
  }
  return best;
}

TEST(HostDevice, AllocationBeyondTheBudgetIsResourceExhausted) {
  auto dev = MakeHost({.memory_budget_bytes = 1 * kMiB});
  EXPECT_EQ(dev->caps().total_memory_bytes, 1 * kMiB);
  auto a = dev->Allocate(512 * kKiB);
  ASSERT_TRUE(a.ok()) << a.status();
  auto b = dev->Allocate(600 * kKiB);
  ASSERT_FALSE(b.ok());
  EXPECT_EQ(b.status().code(), StatusCode::kResourceExhausted);
  EXPECT_THAT(std::string(b.status().message()), HasSubstr("budget 1.00 MiB"));
  EXPECT_THAT(std::string(b.status().message()), HasSubstr("512.00 KiB in use"));
  // Freeing returns the bytes to the budget.
  a->Reset();
  auto c = dev->Allocate(600 * kKiB);
  EXPECT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(dev->Allocate(2 * kMiB).status().code(), StatusCode::kResourceExhausted);
}

TEST(HostDevice, CopyRangesMustBeInsideDeviceAllocations) {
  auto dev = MakeHost();
  auto d = dev->Allocate(4096);
  ASSERT_TRUE(d.ok());
  std::vector<char> host(8192);
  StreamRef s = dev->DefaultStream();
  // Host memory passed as the device side, and a range running past the end.
  Status st = dev->CopyAsync(host.data(), host.data() + 4096, 16, CopyKind::kDeviceToHost, s);
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(st.message()), HasSubstr("source is not inside one device allocation"));
  st = dev->CopyAsync(static_cast<char*>(d->data()) + 100, host.data(), 4000,
                      CopyKind::kHostToDevice, s);
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
  EXPECT_TRUE(dev->CopyAsync(static_cast<char*>(d->data()) + 96, host.data(), 4000,
                             CopyKind::kHostToDevice, s)
                  .ok());
  EXPECT_TRUE(dev->Synchronize().ok());
}

TEST(HostDevice, BandwidthCapSetsTheCopyTime) {
  // Small copies at a low rate: the modeled time dominates even where memcpy
  // is slow (TSan instruments it).
  constexpr double kRate = 20e6;  // 20 MB/s
  constexpr size_t kBytes = 2'000'000;
  auto dev = MakeHost({.h2d_bytes_per_sec = kRate});
  EXPECT_TRUE(dev->caps().copy_bandwidth_capped);
  auto d = dev->Allocate(kBytes);
  ASSERT_TRUE(d.ok());
  std::vector<char> host(kBytes, 1);
  auto stream = dev->CreateStream();
  ASSERT_TRUE(stream.ok());
  const double secs = FastestOf3([&] {
    ASSERT_TRUE(
        dev->CopyAsync(d->data(), host.data(), kBytes, CopyKind::kHostToDevice, *stream).ok());
    ASSERT_TRUE(dev->StreamSynchronize(*stream).ok());
  });
  const double expected = kBytes / kRate;  // 0.1 s
  EXPECT_GT(secs, 0.7 * expected);
  EXPECT_LT(secs, 1.5 * expected);
}

TEST(HostDevice, StreamsShareOneLinkPerDirection) {
  constexpr double kRate = 20e6;
  constexpr size_t kBytes = 1'000'000;  // 50 ms alone
  auto dev = MakeHost({.h2d_bytes_per_sec = kRate, .d2h_bytes_per_sec = kRate});
  std::vector<char> host_a(kBytes, 1), host_b(kBytes, 2);
  auto da = dev->Allocate(kBytes);
  auto db = dev->Allocate(kBytes);
  ASSERT_TRUE(da.ok() && db.ok());
  auto sa = dev->CreateStream();
  auto sb = dev->CreateStream();
  ASSERT_TRUE(sa.ok() && sb.ok());
  const double alone = kBytes / kRate;

  // Two H2D copies on two streams share the H2D link: about twice one copy.
  double secs = FastestOf3([&] {
    ASSERT_TRUE(
        dev->CopyAsync(da->data(), host_a.data(), kBytes, CopyKind::kHostToDevice, *sa).ok());
    ASSERT_TRUE(
        dev->CopyAsync(db->data(), host_b.data(), kBytes, CopyKind::kHostToDevice, *sb).ok());
    ASSERT_TRUE(dev->Synchronize().ok());
  });
  EXPECT_GT(secs, 0.7 * 2 * alone) << "two streams got more than the H2D link's bandwidth";
  EXPECT_LT(secs, 1.5 * 2 * alone);

  // H2D and D2H run on separate links, in parallel: about one copy's time.
  secs = FastestOf3([&] {
    ASSERT_TRUE(
        dev->CopyAsync(da->data(), host_a.data(), kBytes, CopyKind::kHostToDevice, *sa).ok());
    ASSERT_TRUE(
        dev->CopyAsync(host_b.data(), db->data(), kBytes, CopyKind::kDeviceToHost, *sb).ok());
    ASSERT_TRUE(dev->Synchronize().ok());
  });
  EXPECT_GT(secs, 0.7 * alone);
  EXPECT_LT(secs, 1.5 * alone) << "H2D and D2H did not overlap";
  EXPECT_EQ(host_b[12345], 2);
}

TEST(HostDevice, BackToBackCopiesKeepTheLinkBusy) {
  // Like a DMA engine, the link starts a queued copy when the previous one
  // ends, not when the stream's worker thread wakes up: many small copies
  // take the modeled time, not the model plus a thread hand-off each.
  constexpr double kRate = 200e6;  // 82 us per copy
  constexpr size_t kBytes = 16 * 1024;
  constexpr int kCopies = 1000;
  auto dev = MakeHost({.h2d_bytes_per_sec = kRate});
  auto d = dev->Allocate(kBytes);
  ASSERT_TRUE(d.ok());
  std::vector<char> host(kBytes, 1);
  auto stream = dev->CreateStream();
  ASSERT_TRUE(stream.ok());
  const double secs = FastestOf3([&] {
    for (int i = 0; i < kCopies; ++i) {
      ASSERT_TRUE(
          dev->CopyAsync(d->data(), host.data(), kBytes, CopyKind::kHostToDevice, *stream).ok());
    }
    ASSERT_TRUE(dev->StreamSynchronize(*stream).ok());
  });
  const double expected = kCopies * kBytes / kRate;  // 82 ms
  EXPECT_GT(secs, 0.95 * expected) << "the copies beat the link's bandwidth";
  EXPECT_LT(secs, 1.5 * expected) << "the link idled between queued copies";
}

TEST(HostDevice, LatencyIsAddedToEachCopy) {
  auto dev = MakeHost({.copy_latency_sec = 0.02});
  auto d = dev->Allocate(64);
  ASSERT_TRUE(d.ok());
  char host[64] = {};
  const double secs = FastestOf3([&] {
    for (int i = 0; i < 3; ++i) {
      ASSERT_TRUE(
          dev->CopyAsync(d->data(), host, 64, CopyKind::kHostToDevice, dev->DefaultStream()).ok());
    }
    ASSERT_TRUE(dev->Synchronize().ok());
  });
  EXPECT_GT(secs, 0.7 * 0.06);
  EXPECT_LT(secs, 1.5 * 0.06 + 0.05);
}

TEST(HostDevice, DeviceToDeviceAndHostToHostAreNotCapped) {
  auto dev = MakeHost({.h2d_bytes_per_sec = 1e6, .d2h_bytes_per_sec = 1e6});  // 1 MB/s
  constexpr size_t kBytes = 4 * kMiB;  // 4 s through a capped link
  auto a = dev->Allocate(kBytes);
  auto b = dev->Allocate(kBytes);
  ASSERT_TRUE(a.ok() && b.ok());
  std::vector<char> h1(kBytes), h2(kBytes);
  const auto t0 = Clock::now();
  ASSERT_TRUE(
      dev->CopyAsync(b->data(), a->data(), kBytes, CopyKind::kDeviceToDevice, dev->DefaultStream())
          .ok());
  ASSERT_TRUE(
      dev->CopyAsync(h2.data(), h1.data(), kBytes, CopyKind::kHostToHost, dev->DefaultStream())
          .ok());
  ASSERT_TRUE(dev->Synchronize().ok());
  EXPECT_LT(Seconds(Clock::now() - t0), 1.0);
}

TEST(HostDevice, RejectsNegativeRates) {
  auto d = CreateHostDevice({.h2d_bytes_per_sec = -1});
  ASSERT_FALSE(d.ok());
  EXPECT_EQ(d.status().code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(d.status().message()), HasSubstr("h2d_bytes_per_sec=-1"));
}

TEST(DeviceFactories, ListAndOpen) {
  std::vector<DeviceCaps> devices = ListDevices();
  ASSERT_FALSE(devices.empty());
  EXPECT_EQ(devices[0].name, "host");
  for (size_t i = 1; i < devices.size(); ++i)
    EXPECT_EQ(devices[i].name, "cuda:" + std::to_string(i - 1));

  auto host = OpenDevice("host");
  ASSERT_TRUE(host.ok());
  EXPECT_EQ((*host)->name(), "host");
  auto any = OpenDevice("auto");
  ASSERT_TRUE(any.ok()) << any.status();
  EXPECT_EQ((*any)->name(), devices.size() > 1 ? "cuda:0" : "host");

  for (const char* bad : {"gpu", "cuda:", "cuda:x", "cuda:-1", ""}) {
    auto d = OpenDevice(bad);
    ASSERT_FALSE(d.ok()) << bad;
    EXPECT_EQ(d.status().code(), StatusCode::kInvalidArgument) << bad;
  }
  if (devices.size() == 1) {
    // No GPU: a CUDA device is Unavailable with a reason, never a crash.
    auto cuda = OpenDevice("cuda:0");
    ASSERT_FALSE(cuda.ok());
    EXPECT_EQ(cuda.status().code(), StatusCode::kUnavailable);
    EXPECT_THAT(std::string(cuda.status().message()), HasSubstr("cuda:0"));
  }
}

}  // namespace
}  // namespace strata
