// CallWithDeadline: a call that returns in time gives its result; one that
// does not is left running, the caller gets nullopt at the deadline, and
// what the late call returns is handed to `abandon` on its own thread.
#include "runtime/deadline_call.h"

#include <gtest/gtest.h>

#include <chrono>
#include <future>
#include <memory>
#include <string>

namespace strata {
namespace {

using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;

TEST(CallWithDeadline, ACallThatReturnsInTimeGivesItsResult) {
  bool abandoned = false;
  std::optional<std::string> r = CallWithDeadline<std::string>(
      [] { return std::string("joined"); }, 10s, [&](std::string) { abandoned = true; });
  ASSERT_TRUE(r.has_value());
  EXPECT_EQ(*r, "joined");
  EXPECT_FALSE(abandoned);
}

TEST(CallWithDeadline, ALateCallIsAbandonedAtTheDeadlineAndItsResultReleased) {
  auto release = std::make_shared<std::promise<void>>();
  std::shared_future<void> released = release->get_future().share();
  std::promise<int> abandoned;
  std::future<int> late = abandoned.get_future();
  const auto t0 = Clock::now();
  std::optional<int> r = CallWithDeadline<int>(
      [released] {
        released.wait();  // a rank that never joins, until the test lets it
        return 7;
      },
      100ms, [&abandoned](int v) { abandoned.set_value(v); });
  const auto waited = Clock::now() - t0;
  EXPECT_FALSE(r.has_value());
  EXPECT_GE(waited, 100ms);
  EXPECT_LT(waited, 5s);
  release->set_value();  // the call returns after its caller gave up
  ASSERT_EQ(late.wait_for(10s), std::future_status::ready);
  EXPECT_EQ(late.get(), 7);
}

}  // namespace
}  // namespace strata
