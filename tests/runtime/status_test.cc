#include "runtime/status.h"

#include <cerrno>
#include <memory>

#include <gtest/gtest.h>

namespace strata {
namespace {

TEST(Status, OkByDefault) {
  Status s;
  EXPECT_TRUE(s.ok());
  EXPECT_EQ(s.code(), StatusCode::kOk);
  EXPECT_EQ(s.ToString(), "OK");
}

TEST(Status, CarriesCodeAndMessage) {
  Status s = DataLossError("read rank0.state@4096+1MiB: checksum mismatch");
  EXPECT_FALSE(s.ok());
  EXPECT_EQ(s.code(), StatusCode::kDataLoss);
  EXPECT_EQ(s.ToString(), "DataLoss: read rank0.state@4096+1MiB: checksum mismatch");
}

TEST(Status, WithContextPrefixesAndKeepsCode) {
  Status s = ResourceExhaustedError("alloc 2 GiB: budget 1 GiB").WithContext("step 3");
  EXPECT_EQ(s.code(), StatusCode::kResourceExhausted);
  EXPECT_EQ(s.message(), "step 3: alloc 2 GiB: budget 1 GiB");
  EXPECT_TRUE(OkStatus().WithContext("ignored").ok());
}

TEST(Status, ErrnoErrorNamesTheErrno) {
  Status s = ErrnoError(EIO, "read rank0.state@0+4KiB");
  EXPECT_EQ(s.code(), StatusCode::kInternal);
  EXPECT_EQ(s.message(), "read rank0.state@0+4KiB: EIO (Input/output error)");
  EXPECT_EQ(ErrnoError(ENOSPC, "w").code(), StatusCode::kResourceExhausted);
  EXPECT_EQ(ErrnoError(ENOENT, "open").code(), StatusCode::kNotFound);
  EXPECT_EQ(ErrnoError(EINTR, "read").code(), StatusCode::kUnavailable);
  EXPECT_EQ(ErrnoError(EINVAL, "read").code(), StatusCode::kInvalidArgument);
}

Result<int> Half(int x) {
  if (x % 2 != 0) return InvalidArgumentError("half of " + std::to_string(x) + ": odd");
  return x / 2;
}

Result<int> Quarter(int x) {
  STRATA_ASSIGN_OR_RETURN(int h, Half(x));
  STRATA_ASSIGN_OR_RETURN(h, Half(h));
  return h;
}

Status CheckEven(int x) {
  STRATA_RETURN_IF_ERROR(Half(x));
  return OkStatus();
}

TEST(Result, ValueOrError) {
  Result<int> ok = Half(8);
  ASSERT_TRUE(ok.ok());
  EXPECT_EQ(*ok, 4);
  Result<int> bad = Half(3);
  ASSERT_FALSE(bad.ok());
  EXPECT_EQ(bad.status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(bad.value_or(-1), -1);
}

TEST(Result, MacrosPropagate) {
  EXPECT_EQ(*Quarter(12), 3);
  Result<int> r = Quarter(6);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().message(), "half of 3: odd");
  EXPECT_TRUE(CheckEven(2).ok());
  EXPECT_FALSE(CheckEven(1).ok());
}

TEST(Result, MoveOnlyValues) {
  Result<std::unique_ptr<int>> r = std::make_unique<int>(7);
  ASSERT_TRUE(r.ok());
  std::unique_ptr<int> p = std::move(r).value();
  EXPECT_EQ(*p, 7);
}

TEST(Result, FromOkStatusIsAnError) {
  Result<int> r = OkStatus();
  EXPECT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kInternal);
}

TEST(CheckDeathTest, AbortsWithMessage) {
  EXPECT_DEATH(STRATA_CHECK(1 + 1 == 3) << "arithmetic " << 42, "STRATA_CHECK\\(1 \\+ 1 == 3\\) failed: arithmetic 42");
  EXPECT_DEATH((void)Half(3).value(), "half of 3: odd");
}

}  // namespace
}  // namespace strata
