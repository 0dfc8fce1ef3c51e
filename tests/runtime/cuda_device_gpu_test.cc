// The CUDA device's memory pool and its handling of a lost context, on a GPU
// (label gpu). Every test skips, visibly, when CreateCudaDevice(0) is
// Unavailable (no GPU or driver).
//   - Allocate takes memory from a pool of the device's own: freed memory
//     stays there (cudaMemGetInfo shows it as used) until ReleaseCachedMemory,
//     after which a plain cudaMalloc (torch's caching allocator) gets it; the
//     device's default pool is neither used nor reconfigured.
//   - Out of memory names the GPU's free and total memory.
//   - A sticky error (a kernel storing to an unmapped address) is DataLoss
//     saying the context is unusable, and every later call of the device
//     returns it. That test poisons its process's CUDA context, so it runs
//     in a child process (a death test, "threadsafe": the child re-executes
//     this binary), and the other tests keep a working GPU.
#include <cuda_runtime_api.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>

#include "runtime/device.h"
#include "runtime/units.h"

// cuda_fault_kernel.cu
int LaunchFaultingKernel(void* stream);

namespace strata {
namespace {

using ::testing::HasSubstr;

class CudaDeviceGpuTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto dev = CreateCudaDevice(0);
    if (!dev.ok()) {
      if (dev.status().code() == StatusCode::kUnavailable) {
        GTEST_SKIP() << "no CUDA device: " << dev.status();
      }
      FAIL() << dev.status();
    }
    device_ = *std::move(dev);
    // cudaMemGetInfo and the pool queries below ask the current device.
    ASSERT_EQ(cudaSetDevice(0), cudaSuccess);
  }

  static size_t FreeBytes() {
    size_t free_bytes = 0;
    size_t total_bytes = 0;
    EXPECT_EQ(cudaMemGetInfo(&free_bytes, &total_bytes), cudaSuccess);
    return free_bytes;
  }

  static uint64_t PoolAttribute(cudaMemPool_t pool, cudaMemPoolAttr attr) {
    uint64_t value = 0;  // cuuint64_t
    EXPECT_EQ(cudaMemPoolGetAttribute(pool, attr, &value), cudaSuccess);
    return value;
  }

  std::unique_ptr<Device> device_;
};

TEST_F(CudaDeviceGpuTest, FreedMemoryStaysInTheDevicesPoolUntilReleased) {
  ASSERT_TRUE(device_->caps().async_alloc) << "this GPU's driver has no memory pools";
  constexpr size_t kBytes = size_t{1} << 30;
  const size_t free_before = FreeBytes();
  if (free_before < 3 * kBytes) GTEST_SKIP() << "needs 3 GiB free; " << FormatBytes(free_before);
  {
    auto b = device_->Allocate(kBytes);
    ASSERT_TRUE(b.ok()) << b.status();
  }
  // A synchronize is when a pool above its release threshold gives memory
  // back; the device's own pool keeps it (threshold UINT64_MAX).
  ASSERT_TRUE(device_->Synchronize().ok());
  const size_t free_held = FreeBytes();
  EXPECT_LT(free_held + kBytes / 2, free_before)
      << "the freed 1 GiB went back to the driver at a synchronize";
  const Status released = device_->ReleaseCachedMemory();
  ASSERT_TRUE(released.ok()) << released;
  EXPECT_GT(FreeBytes(), free_held + kBytes / 2) << "ReleaseCachedMemory kept the freed 1 GiB";
}

TEST_F(CudaDeviceGpuTest, ACudaMallocGetsWhatTheDeviceReleased) {
  // Three quarters of the free memory through Strata, freed and released:
  // then a cudaMalloc of as much (what torch's caching allocator does)
  // succeeds, which it could not while Strata's pool held it.
  const size_t bytes = FreeBytes() / 4 * 3;
  {
    auto b = device_->Allocate(bytes);
    ASSERT_TRUE(b.ok()) << b.status();
  }
  ASSERT_TRUE(device_->ReleaseCachedMemory().ok());
  void* p = nullptr;
  EXPECT_EQ(cudaMalloc(&p, bytes), cudaSuccess) << FormatBytes(bytes);
  if (p != nullptr) {
    EXPECT_EQ(cudaFree(p), cudaSuccess);
  }
  (void)cudaGetLastError();
}

TEST_F(CudaDeviceGpuTest, TheDefaultPoolIsNeitherUsedNorReconfigured) {
  cudaMemPool_t default_pool = nullptr;
  ASSERT_EQ(cudaDeviceGetDefaultMemPool(&default_pool, 0), cudaSuccess);
  const uint64_t used_before = PoolAttribute(default_pool, cudaMemPoolAttrUsedMemCurrent);
  {
    auto b = device_->Allocate(size_t{64} << 20);
    ASSERT_TRUE(b.ok()) << b.status();
    EXPECT_EQ(PoolAttribute(default_pool, cudaMemPoolAttrUsedMemCurrent), used_before)
        << "Allocate took memory from the device's default pool";
  }
  ASSERT_TRUE(device_->ReleaseCachedMemory().ok());
  // CUDA's default release threshold (driver_types.h: "default 0"); the
  // device used to raise it to UINT64_MAX, for the whole process.
  EXPECT_EQ(PoolAttribute(default_pool, cudaMemPoolAttrReleaseThreshold), 0u);
  cudaMemPool_t current = nullptr;
  ASSERT_EQ(cudaDeviceGetMemPool(&current, 0), cudaSuccess);
  EXPECT_EQ(current, default_pool) << "the device's current pool was changed";
}

TEST_F(CudaDeviceGpuTest, OutOfMemoryNamesTheGpusFreeAndTotalMemory) {
  auto huge = device_->Allocate(device_->caps().total_memory_bytes + (size_t{1} << 30));
  ASSERT_FALSE(huge.ok());
  EXPECT_EQ(huge.status().code(), StatusCode::kResourceExhausted) << huge.status();
  EXPECT_THAT(std::string(huge.status().message()), HasSubstr("cuda:0 has "));
  EXPECT_THAT(std::string(huge.status().message()), HasSubstr(" free of "));
  EXPECT_THAT(std::string(huge.status().message()), HasSubstr("Strata's memory pool holds"));
  // Nothing stale is left behind: the device allocates as before.
  auto small = device_->Allocate(4096);
  EXPECT_TRUE(small.ok()) << small.status();
}

// Runs in the death test's child: exits 0 when every check passed, else 1
// with the failed check on stderr.
void LoseTheContextAndCheckEveryLaterCall() {
  auto fail = [](const std::string& what) {
    std::fprintf(stderr, "CHECK FAILED: %s\n", what.c_str());
    std::exit(1);
  };
  auto dev = CreateCudaDevice(0);
  if (!dev.ok()) fail("open: " + dev.status().ToString());
  std::unique_ptr<Device> device = *std::move(dev);
  auto before = device->Allocate(4096);
  if (!before.ok()) fail("allocate before the fault: " + before.status().ToString());
  if (int err = LaunchFaultingKernel(nullptr); err != 0) {
    fail("launch: " + std::string(cudaGetErrorName(static_cast<cudaError_t>(err))));
  }
  const Status lost = device->Synchronize();
  if (!IsDeviceLost(lost)) fail("synchronize after the fault: " + lost.ToString());
  for (const char* text : {"the CUDA context is unusable", "Restart the process",
                           "last checkpoint, which is intact"}) {
    if (lost.message().find(text) == std::string_view::npos) {
      fail("'" + std::string(text) + "' missing from " + lost.ToString());
    }
  }
  // Every later call fails fast, refused with that same error.
  const Status later[] = {
      device->Allocate(4096).status(),
      device->CreateStream().status(),
      device->CreateEvent().status(),
      device->StreamSynchronize(device->DefaultStream()),
      device->ReleaseCachedMemory(),
  };
  for (const Status& s : later) {
    if (!IsDeviceLost(s) || s.message().find(lost.message()) == std::string_view::npos ||
        s.message().find("refused") == std::string_view::npos) {
      fail("a later call: " + s.ToString() + "\nexpected it to carry: " + lost.ToString());
    }
  }
  std::fprintf(stderr, "lost device: every check passed\n");
  std::exit(0);
}

TEST_F(CudaDeviceGpuTest, AStickyErrorLosesTheDeviceForEveryLaterCall) {
  device_.reset();  // the child opens its own
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_EXIT(LoseTheContextAndCheckEveryLaterCall(), ::testing::ExitedWithCode(0),
              "lost device: every check passed");
}

}  // namespace
}  // namespace strata
