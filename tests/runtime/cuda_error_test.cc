// How CUDA errors become a Status (runtime/cuda_internal.h), on any machine:
// the mapping calls only cudaGetErrorName/cudaGetErrorString, which need no
// GPU or driver. Built where the build has CUDA; label unit.
#include <cuda_runtime_api.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <string>
#include <utility>
#include <vector>

#include "runtime/cuda_internal.h"
#include "runtime/device.h"
#include "runtime/units.h"

namespace strata::internal {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;
using ::testing::StartsWith;

// driver_types.h's "any further CUDA work will return the same error ... the
// process must be terminated and relaunched" errors, and ECC uncorrectable.
const std::vector<cudaError_t> kSticky = {
    cudaErrorIllegalAddress,      cudaErrorLaunchFailure,       cudaErrorMisalignedAddress,
    cudaErrorIllegalInstruction,  cudaErrorHardwareStackError,  cudaErrorECCUncorrectable,
    cudaErrorLaunchTimeout,       cudaErrorAssert,              cudaErrorInvalidAddressSpace,
    cudaErrorInvalidPc,           cudaErrorTensorMemoryLeak,    cudaErrorContained,
    cudaErrorExternalDevice,      cudaErrorMpsClientTerminated,
};

std::string NameAndText(cudaError_t err) {
  return std::string(cudaGetErrorName(err)) + " (" + cudaGetErrorString(err) + ")";
}

TEST(CudaErrorStatus, StickyErrorsAreDataLossSayingTheContextIsUnusable) {
  for (cudaError_t err : kSticky) {
    SCOPED_TRACE(cudaGetErrorName(err));
    EXPECT_TRUE(IsStickyCudaError(err));
    const Status s = CudaErrorStatus(err, "synchronize cuda:0");
    EXPECT_EQ(s.code(), StatusCode::kDataLoss);
    EXPECT_TRUE(IsDeviceLost(s));
    EXPECT_THAT(std::string(s.message()), StartsWith("synchronize cuda:0: " + NameAndText(err)));
    EXPECT_THAT(std::string(s.message()), HasSubstr("the CUDA context is unusable after this error"));
    EXPECT_THAT(std::string(s.message()), HasSubstr("Restart the process"));
    EXPECT_THAT(std::string(s.message()), HasSubstr("last checkpoint, which is intact"));
    EXPECT_THAT(std::string(s.message()), Not(HasSubstr("retry_step")));
    // Still told apart after the engine adds its context.
    EXPECT_TRUE(IsDeviceLost(s.WithContext("step 3: update sub-group 2")));
  }
}

TEST(CudaErrorStatus, OtherErrorsKeepTheirCodesAndAreNotDeviceLoss) {
  const std::vector<std::pair<cudaError_t, StatusCode>> cases = {
      {cudaErrorMemoryAllocation, StatusCode::kResourceExhausted},
      {cudaErrorNoDevice, StatusCode::kUnavailable},
      {cudaErrorInsufficientDriver, StatusCode::kUnavailable},
      {cudaErrorInvalidValue, StatusCode::kInvalidArgument},
      {cudaErrorInvalidResourceHandle, StatusCode::kInvalidArgument},
      {cudaErrorNoKernelImageForDevice, StatusCode::kFailedPrecondition},
      // Not documented as sticky: an ordinary failure.
      {cudaErrorNvlinkUncorrectable, StatusCode::kInternal},
      {cudaErrorLaunchOutOfResources, StatusCode::kInternal},
      {cudaErrorUnknown, StatusCode::kInternal},
  };
  for (const auto& [err, code] : cases) {
    SCOPED_TRACE(cudaGetErrorName(err));
    EXPECT_FALSE(IsStickyCudaError(err));
    const Status s = CudaErrorStatus(err, "allocate 1.00 KiB on cuda:0");
    EXPECT_EQ(s.code(), code);
    EXPECT_FALSE(IsDeviceLost(s));
    EXPECT_EQ(std::string(s.message()), "allocate 1.00 KiB on cuda:0: " + NameAndText(err));
  }
}

TEST(CudaErrorStatus, SuccessIsOk) {
  EXPECT_TRUE(CudaErrorStatus(cudaSuccess, "copy").ok());
  EXPECT_FALSE(IsStickyCudaError(cudaSuccess));
}

TEST(CudaErrorStatus, OnlyTheDocumentedErrorsAreSticky) {
  // Every cudaError_t value CUDA 13 defines lies below 1000 (cudaErrorUnknown
  // is 999); 10000 leaves room for later ones.
  int sticky = 0;
  for (int v = 0; v < 10000; ++v) {
    if (IsStickyCudaError(static_cast<cudaError_t>(v))) ++sticky;
  }
  EXPECT_EQ(sticky, static_cast<int>(kSticky.size()));
}

TEST(IsDeviceLost, NeedsDataLossAndTheText) {
  // A damaged file's DataLoss: a load or a retry in this process can fix it.
  EXPECT_FALSE(IsDeviceLost(DataLossError("read rank0.state@4096+1MiB: checksum mismatch")));
  // The text under another code is not the device's verdict.
  EXPECT_FALSE(IsDeviceLost(FailedPreconditionError(std::string(kDeviceLostText))));
  EXPECT_FALSE(IsDeviceLost(OkStatus()));
  EXPECT_TRUE(IsDeviceLost(DataLossError("x: " + std::string(kDeviceLostText) + " after")));
}

TEST(OutOfDeviceMemoryError, NamesTheGpusFreeAndTotalMemoryAndThePool) {
  const Status oom = CudaErrorStatus(cudaErrorMemoryAllocation, "allocate 4.00 GiB on cuda:0");
  CudaMemoryFigures f;
  f.have_gpu = true;
  f.free_bytes = size_t{3} << 30;
  f.total_bytes = size_t{80} << 30;
  f.have_pool = true;
  f.pool_reserved_bytes = uint64_t{2} << 30;
  f.pool_used_bytes = uint64_t{1} << 30;
  const Status s = OutOfDeviceMemoryError(oom, "cuda:0", f);
  EXPECT_EQ(s.code(), StatusCode::kResourceExhausted);
  const std::string m(s.message());
  EXPECT_THAT(m, StartsWith(std::string(oom.message()) + "; "));
  EXPECT_THAT(m, HasSubstr("cuda:0 has " + FormatBytes(f.free_bytes) + " free of " +
                           FormatBytes(f.total_bytes)));
  EXPECT_THAT(m, HasSubstr("torch.cuda.empty_cache()"));
  EXPECT_THAT(m, HasSubstr("Strata's memory pool holds " + FormatBytes(f.pool_reserved_bytes) +
                           ", " + FormatBytes(f.pool_used_bytes) + " of it in use"));
}

TEST(OutOfDeviceMemoryError, LeavesOutFiguresItDoesNotHave) {
  const Status oom = CudaErrorStatus(cudaErrorMemoryAllocation, "allocate 4.00 GiB on cuda:0");
  const Status s = OutOfDeviceMemoryError(oom, "cuda:0", CudaMemoryFigures{});
  EXPECT_EQ(s, oom);
}

}  // namespace
}  // namespace strata::internal
