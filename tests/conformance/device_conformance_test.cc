// Conformance suite for Device: every backend must pass it. Built twice:
// device_conformance_test instantiates it for "host", and
// device_conformance_gpu_test (ctest label `gpu`) for "cuda", where every
// test is skipped, visibly, when no CUDA device is present.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <future>
#include <memory>
#include <numeric>
#include <string>
#include <thread>
#include <vector>

#include "runtime/device.h"
#include "runtime/units.h"

#ifndef STRATA_TEST_BACKEND
#define STRATA_TEST_BACKEND "host"
#endif

namespace strata {
namespace {

using ::testing::HasSubstr;
using namespace std::chrono_literals;

Result<std::unique_ptr<Device>> OpenBackend(const std::string& backend) {
  if (backend == "host") return CreateHostDevice();
  if (backend == "cuda") return CreateCudaDevice(0);
  return InvalidArgumentError("unknown backend " + backend);
}

class DeviceConformance : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    auto dev = OpenBackend(GetParam());
    if (!dev.ok()) {
      if (GetParam() == "cuda" && dev.status().code() == StatusCode::kUnavailable) {
        GTEST_SKIP() << "no CUDA device: " << dev.status();
      }
      FAIL() << dev.status();
    }
    device_ = *std::move(dev);
  }
  void TearDown() override {
    if (device_) {
      EXPECT_TRUE(device_->Synchronize().ok());
    }
  }

  Stream NewStream() {
    auto s = device_->CreateStream();
    STRATA_CHECK_OK(s);
    return *std::move(s);
  }
  Event NewEvent() {
    auto e = device_->CreateEvent();
    STRATA_CHECK_OK(e);
    return *std::move(e);
  }
  HostAllocation NewHost(size_t bytes) {
    auto h = device_->AllocateHost(bytes);
    STRATA_CHECK_OK(h);
    return *std::move(h);
  }
  DeviceBuffer NewBuffer(size_t bytes) {
    auto b = device_->Allocate(bytes);
    STRATA_CHECK_OK(b);
    return *std::move(b);
  }

  std::unique_ptr<Device> device_;
};

TEST_P(DeviceConformance, CapsDescribeTheBackend) {
  const DeviceCaps& caps = device_->caps();
  EXPECT_EQ(DeviceKindName(caps.kind), GetParam());
  EXPECT_FALSE(caps.name.empty());
  EXPECT_GT(caps.total_memory_bytes, 0u);
  EXPECT_EQ(caps.host_addressable_memory, caps.kind == DeviceKind::kHost);
}

TEST_P(DeviceConformance, AllocateGivesAlignedMemoryAndFreesIt) {
  for (size_t bytes : {size_t{1}, size_t{4096}, size_t{1} << 20, size_t{3} * 1000 * 1000}) {
    auto b = device_->Allocate(bytes);
    ASSERT_TRUE(b.ok()) << b.status();
    EXPECT_NE(b->data(), nullptr);
    EXPECT_EQ(b->bytes(), bytes);
    EXPECT_EQ(reinterpret_cast<uintptr_t>(b->data()) % 256, 0u);
  }
  auto empty = device_->Allocate(0);
  ASSERT_TRUE(empty.ok());
  EXPECT_EQ(empty->data(), nullptr);
  // Moving transfers ownership; the moved-from buffer is empty.
  DeviceBuffer a = NewBuffer(4096);
  void* p = a.data();
  DeviceBuffer b = std::move(a);
  EXPECT_EQ(b.data(), p);
  EXPECT_EQ(a.data(), nullptr);  // NOLINT: testing the moved-from state
}

TEST_P(DeviceConformance, AllocateHostIsPageAlignedAndRounded) {
  HostAllocation h = NewHost(5000);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(h.data()) % 4096, 0u);
  EXPECT_EQ(h.bytes(), 8192u);
  if (GetParam() == "cuda") {
    EXPECT_TRUE(h.locked());
  }
  std::memset(h.data(), 0xab, h.bytes());  // writable over the whole rounded size
}

// The optimizer's state slab is one large host allocation: on CUDA it is
// mapped, faulted in on every core and registered (cudaHostRegister) rather
// than cudaHostAlloc'd. Twice in a row (freeing unregisters and unmaps), the
// whole range copies both ways, and so does a sub-range near its end.
TEST_P(DeviceConformance, LargeHostAllocationsCopyBothWaysAndFree) {
  constexpr size_t kBytes = 96 * kMiB + 4096;
  for (int round = 0; round < 2; ++round) {
    HostAllocation h = NewHost(kBytes);
    ASSERT_EQ(h.bytes(), kBytes);
    EXPECT_EQ(reinterpret_cast<uintptr_t>(h.data()) % 4096, 0u);
    if (GetParam() == "cuda") {
      EXPECT_TRUE(h.locked());
    }
    auto* p = static_cast<uint32_t*>(h.data());
    for (size_t i = 0; i < kBytes / 4; ++i) p[i] = static_cast<uint32_t>(i * 2654435761u + round);
    HostAllocation back = NewHost(kBytes);
    std::memset(back.data(), 0, kBytes);
    DeviceBuffer d = NewBuffer(kBytes);
    Stream stream = NewStream();
    ASSERT_TRUE(
        device_->CopyAsync(d.data(), h.data(), kBytes, CopyKind::kHostToDevice, stream).ok());
    ASSERT_TRUE(
        device_->CopyAsync(back.data(), d.data(), kBytes, CopyKind::kDeviceToHost, stream).ok());
    ASSERT_TRUE(device_->StreamSynchronize(stream).ok());
    EXPECT_EQ(std::memcmp(h.data(), back.data(), kBytes), 0) << "round " << round;
    constexpr size_t kTail = 3 * kMiB + 12;
    const size_t off = kBytes - kTail - 4096;
    std::memset(static_cast<std::byte*>(back.data()) + off, 0, kTail);
    ASSERT_TRUE(device_
                    ->CopyAsync(static_cast<std::byte*>(back.data()) + off,
                                static_cast<std::byte*>(d.data()) + off, kTail,
                                CopyKind::kDeviceToHost, stream)
                    .ok());
    ASSERT_TRUE(device_->StreamSynchronize(stream).ok());
    EXPECT_EQ(std::memcmp(h.data(), back.data(), kBytes), 0) << "round " << round << " tail";
  }
}

TEST_P(DeviceConformance, CopiesOfEveryKindRoundTrip) {
  constexpr size_t kBytes = 3 * kMiB + 123;
  HostAllocation src = NewHost(kBytes);
  HostAllocation mid = NewHost(kBytes);
  HostAllocation dst = NewHost(kBytes);
  auto* s = static_cast<uint8_t*>(src.data());
  for (size_t i = 0; i < kBytes; ++i) s[i] = static_cast<uint8_t>(i * 131 + 7);
  std::memset(dst.data(), 0, kBytes);
  DeviceBuffer d1 = NewBuffer(kBytes);
  DeviceBuffer d2 = NewBuffer(kBytes);
  Stream stream = NewStream();
  ASSERT_TRUE(
      device_->CopyAsync(mid.data(), src.data(), kBytes, CopyKind::kHostToHost, stream).ok());
  ASSERT_TRUE(
      device_->CopyAsync(d1.data(), mid.data(), kBytes, CopyKind::kHostToDevice, stream).ok());
  ASSERT_TRUE(
      device_->CopyAsync(d2.data(), d1.data(), kBytes, CopyKind::kDeviceToDevice, stream).ok());
  ASSERT_TRUE(
      device_->CopyAsync(dst.data(), d2.data(), kBytes, CopyKind::kDeviceToHost, stream).ok());
  ASSERT_TRUE(device_->StreamSynchronize(stream).ok());
  EXPECT_EQ(std::memcmp(src.data(), dst.data(), kBytes), 0);

  // A sub-range at an odd offset.
  std::memset(dst.data(), 0, kBytes);
  auto* d1b = static_cast<std::byte*>(d1.data());
  ASSERT_TRUE(
      device_->CopyAsync(dst.data(), d1b + 1001, 77777, CopyKind::kDeviceToHost, stream).ok());
  ASSERT_TRUE(device_->StreamSynchronize(stream).ok());
  EXPECT_EQ(std::memcmp(dst.data(), s + 1001, 77777), 0);
}

TEST_P(DeviceConformance, OneStreamRunsInEnqueueOrder) {
  Stream stream = NewStream();
  std::vector<int> order;  // touched only by the stream's work, read after sync
  constexpr int kTasks = 200;
  for (int i = 0; i < kTasks; ++i) {
    ASSERT_TRUE(device_->LaunchHostFunc(stream, [&order, i] { order.push_back(i); }).ok());
  }
  ASSERT_TRUE(device_->StreamSynchronize(stream).ok());
  std::vector<int> expected(kTasks);
  std::iota(expected.begin(), expected.end(), 0);
  EXPECT_EQ(order, expected);
}

TEST_P(DeviceConformance, CopiesAndHostFuncsInterleaveInOrder) {
  // host func writes a value, H2D copies it, a host func overwrites the
  // source, D2H copies the device value back: only in order is it the first value.
  HostAllocation staging = NewHost(4096);
  HostAllocation out = NewHost(4096);
  DeviceBuffer d = NewBuffer(sizeof(uint64_t));
  auto* st = static_cast<uint64_t*>(staging.data());
  auto* o = static_cast<uint64_t*>(out.data());
  *st = 0;
  *o = 0;
  Stream stream = NewStream();
  for (uint64_t round = 1; round <= 20; ++round) {
    ASSERT_TRUE(device_
                    ->LaunchHostFunc(stream,
                                     [st, round] {
                                       std::this_thread::sleep_for(1ms);
                                       *st = round * 1000;
                                     })
                    .ok());
    ASSERT_TRUE(
        device_->CopyAsync(d.data(), st, sizeof(uint64_t), CopyKind::kHostToDevice, stream).ok());
    ASSERT_TRUE(device_->LaunchHostFunc(stream, [st] { *st = 7; }).ok());
    ASSERT_TRUE(
        device_->CopyAsync(o, d.data(), sizeof(uint64_t), CopyKind::kDeviceToHost, stream).ok());
    ASSERT_TRUE(device_->StreamSynchronize(stream).ok());
    ASSERT_EQ(*o, round * 1000) << "round " << round;
  }
}

TEST_P(DeviceConformance, EnqueueReturnsBeforeTheWorkRuns) {
  // The task waits (bounded) for the caller to signal that LaunchHostFunc
  // returned; a stream that ran work inline would time out and record false.
  Stream stream = NewStream();
  std::promise<void> returned;
  std::shared_future<void> returned_future = returned.get_future().share();
  std::atomic<int> saw_return{-1};
  ASSERT_TRUE(device_
                  ->LaunchHostFunc(stream,
                                   [&] {
                                     saw_return =
                                         returned_future.wait_for(5s) == std::future_status::ready
                                             ? 1
                                             : 0;
                                   })
                  .ok());
  returned.set_value();
  ASSERT_TRUE(device_->StreamSynchronize(stream).ok());
  EXPECT_EQ(saw_return.load(), 1) << "the host func ran inside LaunchHostFunc";
}

TEST_P(DeviceConformance, CopyIsAsyncWithRespectToTheCaller) {
  // A copy queued behind a blocked host func must not have happened when
  // CopyAsync returns.
  Stream stream = NewStream();
  HostAllocation src = NewHost(4096);
  HostAllocation dst = NewHost(4096);
  DeviceBuffer d = NewBuffer(4096);
  std::memset(src.data(), 0x5a, 4096);
  std::memset(dst.data(), 0, 4096);
  std::promise<void> go;
  std::shared_future<void> go_future = go.get_future().share();
  ASSERT_TRUE(device_->LaunchHostFunc(stream, [go_future] { go_future.wait_for(5s); }).ok());
  ASSERT_TRUE(device_->CopyAsync(d.data(), src.data(), 4096, CopyKind::kHostToDevice, stream).ok());
  ASSERT_TRUE(device_->CopyAsync(dst.data(), d.data(), 4096, CopyKind::kDeviceToHost, stream).ok());
  EXPECT_EQ(static_cast<uint8_t*>(dst.data())[100], 0)
      << "a copy ran before the work queued ahead of it";
  go.set_value();
  ASSERT_TRUE(device_->StreamSynchronize(stream).ok());
  EXPECT_EQ(static_cast<uint8_t*>(dst.data())[100], 0x5a);
}

TEST_P(DeviceConformance, EventOrdersWorkAcrossStreams) {
  // Stream A: slow host func producing a value, H2D, record E.
  // Stream B: wait E, D2H. Without the wait B would read the old value.
  HostAllocation in = NewHost(4096);
  HostAllocation out = NewHost(4096);
  DeviceBuffer d = NewBuffer(sizeof(uint32_t));
  auto* iv = static_cast<uint32_t*>(in.data());
  auto* ov = static_cast<uint32_t*>(out.data());
  Stream a = NewStream();
  Stream b = NewStream();
  Event e = NewEvent();
  for (uint32_t round = 1; round <= 5; ++round) {
    *iv = 0;
    *ov = 0;
    ASSERT_TRUE(device_->CopyAsync(d.data(), iv, 4, CopyKind::kHostToDevice, a).ok());
    ASSERT_TRUE(device_->StreamSynchronize(a).ok());
    ASSERT_TRUE(device_
                    ->LaunchHostFunc(a,
                                     [iv, round] {
                                       std::this_thread::sleep_for(30ms);
                                       *iv = 0xC0DE0000u + round;
                                     })
                    .ok());
    ASSERT_TRUE(device_->CopyAsync(d.data(), iv, 4, CopyKind::kHostToDevice, a).ok());
    ASSERT_TRUE(device_->RecordEvent(e, a).ok());
    ASSERT_TRUE(device_->StreamWaitEvent(b, e).ok());
    ASSERT_TRUE(device_->CopyAsync(ov, d.data(), 4, CopyKind::kDeviceToHost, b).ok());
    ASSERT_TRUE(device_->StreamSynchronize(b).ok());
    EXPECT_EQ(*ov, 0xC0DE0000u + round) << "stream B did not wait for the event of stream A";
    ASSERT_TRUE(device_->StreamSynchronize(a).ok());
  }
}

TEST_P(DeviceConformance, EventQueryAndSynchronize) {
  Event never = NewEvent();
  auto q = device_->EventQuery(never);
  ASSERT_TRUE(q.ok());
  EXPECT_TRUE(*q) << "an event never recorded counts as complete";
  EXPECT_TRUE(device_->EventSynchronize(never).ok());

  Stream stream = NewStream();
  Event e = NewEvent();
  std::promise<void> go;
  std::shared_future<void> go_future = go.get_future().share();
  std::atomic<bool> ran{false};
  ASSERT_TRUE(device_
                  ->LaunchHostFunc(stream,
                                   [&] {
                                     go_future.wait_for(5s);
                                     ran = true;
                                   })
                  .ok());
  ASSERT_TRUE(device_->RecordEvent(e, stream).ok());
  q = device_->EventQuery(e);
  ASSERT_TRUE(q.ok());
  EXPECT_FALSE(*q) << "event complete while the work before it is blocked";
  go.set_value();
  ASSERT_TRUE(device_->EventSynchronize(e).ok());
  EXPECT_TRUE(ran.load());
  q = device_->EventQuery(e);
  ASSERT_TRUE(q.ok());
  EXPECT_TRUE(*q);
}

TEST_P(DeviceConformance, ErrorsAreStickyPerStream) {
  Stream bad = NewStream();
  Stream good = NewStream();
  Event after = NewEvent();
  std::atomic<bool> later_ran{false};
  ASSERT_TRUE(
      device_->LaunchHostTask(bad, [] { return DataLossError("checksum of shard 3"); }).ok());
  ASSERT_TRUE(device_->LaunchHostFunc(bad, [&] { later_ran = true; }).ok());
  ASSERT_TRUE(device_->RecordEvent(after, bad).ok());
  ASSERT_TRUE(device_->LaunchHostFunc(good, [] {}).ok());

  Status s = device_->StreamSynchronize(bad);
  EXPECT_EQ(s.code(), StatusCode::kDataLoss);
  EXPECT_THAT(std::string(s.message()), HasSubstr("checksum of shard 3"));
  EXPECT_FALSE(later_ran.load()) << "work after a failure must be skipped";
  // Still failed on the next synchronize, and through the event and the device.
  EXPECT_EQ(device_->StreamSynchronize(bad).code(), StatusCode::kDataLoss);
  EXPECT_EQ(device_->EventSynchronize(after).code(), StatusCode::kDataLoss);
  EXPECT_TRUE(device_->StreamSynchronize(good).ok()) << "an error must not leak to another stream";
  EXPECT_EQ(device_->Synchronize().code(), StatusCode::kDataLoss);
  // Drop the failed stream so TearDown's Synchronize sees only healthy ones.
  bad = Stream();
  EXPECT_TRUE(device_->Synchronize().ok());
}

TEST_P(DeviceConformance, BadArgumentsFailSynchronously) {
  Stream stream = NewStream();
  DeviceBuffer d = NewBuffer(4096);
  HostAllocation h = NewHost(4096);
  EXPECT_EQ(device_->CopyAsync(d.data(), h.data(), 16, CopyKind::kHostToDevice, StreamRef()).code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(device_->CopyAsync(nullptr, h.data(), 16, CopyKind::kHostToDevice, stream).code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(device_->LaunchHostFunc(StreamRef(), [] {}).code(), StatusCode::kInvalidArgument);
  Event empty;
  EXPECT_EQ(device_->RecordEvent(empty, stream).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(device_->EventQuery(empty).status().code(), StatusCode::kInvalidArgument);

  // A stream or event of another device is rejected.
  auto other = OpenBackend(GetParam());
  ASSERT_TRUE(other.ok());
  auto foreign = (*other)->CreateStream();
  ASSERT_TRUE(foreign.ok());
  Status s = device_->LaunchHostFunc(*foreign, [] {});
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(s.message()), HasSubstr("another device"));
}

TEST_P(DeviceConformance, SynchronizeWaitsForEveryStream) {
  std::vector<Stream> streams;
  std::atomic<int> done{0};
  for (int i = 0; i < 4; ++i) {
    streams.push_back(NewStream());
    ASSERT_TRUE(device_
                    ->LaunchHostFunc(streams.back(),
                                     [&done, i] {
                                       std::this_thread::sleep_for(
                                           std::chrono::milliseconds(5 * (i + 1)));
                                       done.fetch_add(1);
                                     })
                    .ok());
  }
  ASSERT_TRUE(
      device_->LaunchHostFunc(device_->DefaultStream(), [&done] { done.fetch_add(1); }).ok());
  ASSERT_TRUE(device_->Synchronize().ok());
  EXPECT_EQ(done.load(), 5);
}

TEST_P(DeviceConformance, StreamsCopyConcurrentlyAndCorrectly) {
  constexpr int kStreams = 4;
  constexpr size_t kBytes = 256 * kKiB;
  std::vector<Stream> streams;
  std::vector<HostAllocation> ins, outs;
  std::vector<DeviceBuffer> ds;
  for (int i = 0; i < kStreams; ++i) {
    streams.push_back(NewStream());
    ins.push_back(NewHost(kBytes));
    outs.push_back(NewHost(kBytes));
    ds.push_back(NewBuffer(kBytes));
    std::memset(ins.back().data(), 0x10 + i, kBytes);
    std::memset(outs.back().data(), 0, kBytes);
  }
  for (int i = 0; i < kStreams; ++i) {
    ASSERT_TRUE(
        device_->CopyAsync(ds[i].data(), ins[i].data(), kBytes, CopyKind::kHostToDevice, streams[i])
            .ok());
    ASSERT_TRUE(
        device_
            ->CopyAsync(outs[i].data(), ds[i].data(), kBytes, CopyKind::kDeviceToHost, streams[i])
            .ok());
  }
  ASSERT_TRUE(device_->Synchronize().ok());
  for (int i = 0; i < kStreams; ++i) {
    EXPECT_EQ(std::memcmp(ins[i].data(), outs[i].data(), kBytes), 0) << "stream " << i;
  }
}

// Where a device has native streams, DefaultStream() is native stream 0 (on
// CUDA the legacy default stream), the queue a trainer that names no stream
// works on: work on it waits for work enqueued through a wrapper of 0.
TEST_P(DeviceConformance, DefaultStreamIsNativeStreamZero) {
  auto zero = device_->WrapNativeStream(nullptr);
  if (!zero.ok()) {
    ASSERT_EQ(zero.status().code(), StatusCode::kInvalidArgument) << zero.status();
    GTEST_SKIP() << GetParam() << " has no native streams";
  }
  std::promise<void> go;
  std::shared_future<void> go_future = go.get_future().share();
  ASSERT_TRUE(device_->LaunchHostFunc(*zero, [go_future] { go_future.wait_for(5s); }).ok());
  Event e = NewEvent();
  ASSERT_TRUE(device_->RecordEvent(e, device_->DefaultStream()).ok());
  std::this_thread::sleep_for(50ms);
  auto q = device_->EventQuery(e);
  ASSERT_TRUE(q.ok()) << q.status();
  EXPECT_FALSE(*q) << "DefaultStream() ran past work blocked on native stream 0";
  go.set_value();
  ASSERT_TRUE(device_->EventSynchronize(e).ok());
}

TEST_P(DeviceConformance, DestroyingAStreamWaitsForItsWork) {
  std::atomic<bool> ran{false};
  {
    Stream stream = NewStream();
    ASSERT_TRUE(device_
                    ->LaunchHostFunc(stream,
                                     [&] {
                                       std::this_thread::sleep_for(20ms);
                                       ran = true;
                                     })
                    .ok());
  }
  EXPECT_TRUE(ran.load());
}

// ReleaseCachedMemory hands back only what was freed: a live buffer keeps its
// contents, and the device allocates as before afterwards.
TEST_P(DeviceConformance, ReleaseCachedMemoryKeepsLiveBuffers) {
  constexpr size_t kBytes = size_t{1} << 20;
  DeviceBuffer live = NewBuffer(kBytes);
  HostAllocation pattern = NewHost(kBytes);
  auto* in = static_cast<unsigned char*>(pattern.data());
  for (size_t i = 0; i < kBytes; ++i) in[i] = static_cast<unsigned char>(i * 7 + 3);
  Stream stream = NewStream();
  ASSERT_TRUE(
      device_->CopyAsync(live.data(), pattern.data(), kBytes, CopyKind::kHostToDevice, stream)
          .ok());
  ASSERT_TRUE(device_->StreamSynchronize(stream).ok());
  for (size_t bytes : {size_t{4096}, size_t{8} << 20}) {
    DeviceBuffer freed = NewBuffer(bytes);
  }
  Status released = device_->ReleaseCachedMemory();
  ASSERT_TRUE(released.ok()) << released;
  ASSERT_TRUE(device_->ReleaseCachedMemory().ok()) << "a second release (nothing cached)";
  HostAllocation back = NewHost(kBytes);
  std::memset(back.data(), 0, kBytes);
  ASSERT_TRUE(
      device_->CopyAsync(back.data(), live.data(), kBytes, CopyKind::kDeviceToHost, stream).ok());
  ASSERT_TRUE(device_->StreamSynchronize(stream).ok());
  EXPECT_EQ(std::memcmp(back.data(), pattern.data(), kBytes), 0);
  DeviceBuffer again = NewBuffer(kBytes);
  EXPECT_NE(again.data(), nullptr);
}

INSTANTIATE_TEST_SUITE_P(Backend, DeviceConformance,
                         ::testing::Values(std::string(STRATA_TEST_BACKEND)),
                         [](const auto& info) { return info.param; });

}  // namespace
}  // namespace strata
