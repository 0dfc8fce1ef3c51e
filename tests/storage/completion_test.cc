// InterpretCompletion with made-up results: every branch of done / resubmit /
// fail, checked against what the request says.
#include <gtest/gtest.h>

#include <cerrno>
#include <vector>

#include "runtime/storage.h"
#include "runtime/units.h"

namespace strata {
namespace {

std::vector<std::byte> g_buf(1 << 20);

IoRequest Req(IoOp op, uint64_t offset, size_t size, uint64_t done = 0, uint32_t retries = 0) {
  IoRequest r{op, offset, std::span<std::byte>(g_buf).first(size), 0, {}, done, retries};
  return r;
}

TEST(InterpretCompletion, FullTransferIsDone) {
  IoRequest r = Req(IoOp::kRead, 4096, 8192);
  CompletionDecision d = InterpretCompletion(r, "f", 8192);
  EXPECT_EQ(d.action, CompletionAction::kDone);
  EXPECT_EQ(d.transferred_bytes, 8192u);
  EXPECT_TRUE(d.status.ok());
}

TEST(InterpretCompletion, ShortTransferResubmitsTheRemainder) {
  IoRequest r = Req(IoOp::kWrite, 0, 8192);
  CompletionDecision d = InterpretCompletion(r, "f", 4096);
  EXPECT_EQ(d.action, CompletionAction::kResubmit);
  EXPECT_EQ(d.transferred_bytes, 4096u);
  EXPECT_EQ(d.retries, 0u);  // progress is not a retry
  r.transferred_bytes = d.transferred_bytes;
  d = InterpretCompletion(r, "f", 4096);
  EXPECT_EQ(d.action, CompletionAction::kDone);
  EXPECT_EQ(d.transferred_bytes, 8192u);
}

TEST(InterpretCompletion, ManyTinyShortTransfersStillFinish) {
  IoRequest r = Req(IoOp::kRead, 0, 1000);
  int steps = 0;
  for (;;) {
    CompletionDecision d = InterpretCompletion(r, "f", 7);
    r.transferred_bytes = d.transferred_bytes;
    ++steps;
    if (d.action != CompletionAction::kResubmit) {
      // 1000 = 142 * 7 + 6: the last attempt reports 7 for a remainder of 6.
      EXPECT_EQ(d.action, CompletionAction::kFail);
      EXPECT_EQ(d.status.code(), StatusCode::kInternal) << d.status;
      EXPECT_NE(d.status.message().find("remainder of 6"), std::string_view::npos) << d.status;
      break;
    }
  }
  EXPECT_EQ(steps, 143);
}

TEST(InterpretCompletion, EintrAndEagainAreRetriedBounded) {
  for (int err : {EINTR, EAGAIN}) {
    IoRequest r = Req(IoOp::kRead, 0, 4096);
    for (uint32_t i = 0; i < kMaxIoRetries; ++i) {
      CompletionDecision d = InterpretCompletion(r, "f", -err);
      ASSERT_EQ(d.action, CompletionAction::kResubmit) << "attempt " << i;
      EXPECT_EQ(d.retries, i + 1);
      r.retries = d.retries;
    }
    CompletionDecision d = InterpretCompletion(r, "f", -err);
    EXPECT_EQ(d.action, CompletionAction::kFail);
    EXPECT_EQ(d.status.code(), StatusCode::kUnavailable) << d.status;
    EXPECT_NE(d.status.message().find("gave up after"), std::string_view::npos) << d.status;
  }
}

TEST(InterpretCompletion, ErrnoFailsNamingFileOffsetAndSize) {
  IoRequest r = Req(IoOp::kRead, 4096, 1 << 20);
  CompletionDecision d = InterpretCompletion(r, "rank0.state", -EIO);
  EXPECT_EQ(d.action, CompletionAction::kFail);
  EXPECT_EQ(d.status.code(), StatusCode::kInternal);
  EXPECT_EQ(d.status.message(), "read rank0.state@4096+1MiB: EIO (Input/output error)");

  IoRequest w = Req(IoOp::kWrite, 0, 8192, /*done=*/4096);
  d = InterpretCompletion(w, "x", -ENOSPC);
  EXPECT_EQ(d.action, CompletionAction::kFail);
  EXPECT_EQ(d.status.code(), StatusCode::kResourceExhausted);
  EXPECT_EQ(d.status.message(),
            "write x@0+8KiB (after 4096 bytes): ENOSPC (No space left on device)");
  EXPECT_EQ(d.transferred_bytes, 4096u);
}

TEST(InterpretCompletion, ReadAtEndOfFileIsOutOfRange) {
  IoRequest r = Req(IoOp::kRead, 0, 8192, /*done=*/4096);
  CompletionDecision d = InterpretCompletion(r, "f", 0);
  EXPECT_EQ(d.action, CompletionAction::kFail);
  EXPECT_EQ(d.status.code(), StatusCode::kOutOfRange);
  EXPECT_NE(d.status.message().find("end of file after 4096 bytes"), std::string_view::npos)
      << d.status;
}

TEST(InterpretCompletion, ZeroByteWritesAreRetriedThenFail) {
  IoRequest r = Req(IoOp::kWrite, 0, 4096);
  for (uint32_t i = 0; i < kMaxIoRetries; ++i) {
    CompletionDecision d = InterpretCompletion(r, "f", 0);
    ASSERT_EQ(d.action, CompletionAction::kResubmit);
    r.retries = d.retries;
  }
  CompletionDecision d = InterpretCompletion(r, "f", 0);
  EXPECT_EQ(d.action, CompletionAction::kFail);
  EXPECT_EQ(d.status.code(), StatusCode::kUnavailable);
}

TEST(InterpretCompletion, MoreThanAskedIsInternal) {
  IoRequest r = Req(IoOp::kRead, 0, 4096, 2048);
  CompletionDecision d = InterpretCompletion(r, "f", 4096);
  EXPECT_EQ(d.action, CompletionAction::kFail);
  EXPECT_EQ(d.status.code(), StatusCode::kInternal);
}

TEST(IoObjectName, CompactSizes) {
  EXPECT_EQ(IoObjectName("a", 0, 4096), "a@0+4KiB");
  EXPECT_EQ(IoObjectName("a", 8192, 3 * kMiB), "a@8192+3MiB");
  EXPECT_EQ(IoObjectName("a", 1, 1000), "a@1+1000");
  EXPECT_EQ(IoObjectName("a", 0, 2 * kGiB), "a@0+2GiB");
}

}  // namespace
}  // namespace strata
