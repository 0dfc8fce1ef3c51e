#include "runtime/log.h"

#include "runtime/units.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <atomic>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

namespace strata {
namespace {

using ::testing::HasSubstr;
using ::testing::IsEmpty;
using ::testing::SizeIs;

// Collects lines; restores the previous sink and level when it goes away.
class CollectingSink {
 public:
  CollectingSink() : level_(GetLogLevel()) {
    previous_ = SetLogSink([this](LogLevel level, std::string_view message) {
      std::lock_guard<std::mutex> lock(mu_);
      lines_.emplace_back(level, std::string(message));
    });
  }
  ~CollectingSink() {
    SetLogSink(std::move(previous_));
    SetLogLevel(level_);
  }
  std::vector<std::pair<LogLevel, std::string>> lines() {
    std::lock_guard<std::mutex> lock(mu_);
    return lines_;
  }
  std::vector<std::string> messages() {
    std::vector<std::string> out;
    for (auto& [level, m] : lines()) out.push_back(m);
    return out;
  }

 private:
  LogLevel level_;
  LogSink previous_;
  std::mutex mu_;
  std::vector<std::pair<LogLevel, std::string>> lines_;
};

TEST(LogSinkTest, ReceivesEnabledLinesWithTheirLevel) {
  CollectingSink sink;
  SetLogLevel(LogLevel::kInfo);
  LogDebug("not shown");
  LogInfo("plan ready");
  LogWarning("mlock refused");
  LogError("disk full");
  auto lines = sink.lines();
  ASSERT_THAT(lines, SizeIs(3));
  EXPECT_EQ(lines[0].first, LogLevel::kInfo);
  EXPECT_EQ(lines[0].second, "plan ready");  // no prefix, no newline
  EXPECT_EQ(lines[1].first, LogLevel::kWarning);
  EXPECT_EQ(lines[2].first, LogLevel::kError);
  SetLogLevel(LogLevel::kOff);
  LogError("off means off");
  EXPECT_THAT(sink.lines(), SizeIs(3));
}

TEST(LogSinkTest, DefaultWritesPrefixedLinesToStderrAndSetReturnsThePrevious) {
  const LogLevel level = GetLogLevel();
  SetLogLevel(LogLevel::kInfo);
  std::vector<std::string> got;
  LogSink first = [&got](LogLevel, std::string_view m) { got.emplace_back(m); };
  LogSink before = SetLogSink(first);
  EXPECT_FALSE(before) << "the default (stderr) is reported as an empty sink";
  LogInfo("to the sink");
  LogSink replaced = SetLogSink(nullptr);
  ASSERT_TRUE(replaced);
  replaced(LogLevel::kInfo, "called through the returned copy");
  EXPECT_THAT(got, ::testing::ElementsAre("to the sink", "called through the returned copy"));

  ::testing::internal::CaptureStderr();
  LogWarning("back on stderr");
  const std::string err = ::testing::internal::GetCapturedStderr();
  EXPECT_EQ(err, "strata: warning: back on stderr\n");
  SetLogLevel(level);
}

TEST(LogSinkTest, ASinkMayLogAndReplaceItself) {
  CollectingSink outer;
  SetLogLevel(LogLevel::kInfo);
  std::atomic<int> calls{0};
  LogSink previous = SetLogSink([&](LogLevel level, std::string_view m) {
    if (calls.fetch_add(1) == 0) {
      LogInfo("nested");                      // reaches this sink again: no deadlock
      LogSink self = SetLogSink(nullptr);     // replacing itself while running is allowed
      SetLogSink(std::move(self));
    }
  });
  LogInfo("outer");
  EXPECT_EQ(calls.load(), 2);
  SetLogSink(std::move(previous));
}

// Under TSan (scripts/tsan runs this suite): lines from many threads while
// another thread swaps sinks; none is lost or torn.
TEST(LogSinkTest, ConcurrentLogsAndSinkSwapsLoseNothing) {
  const LogSink original = SetLogSink(nullptr);
  const LogLevel level = GetLogLevel();
  SetLogLevel(LogLevel::kInfo);
  std::atomic<int> a{0}, b{0};
  std::atomic<bool> bad{false};
  auto counting = [&bad](std::atomic<int>& n) {
    return [&n, &bad](LogLevel, std::string_view m) {
      if (m.substr(0, 5) != "line ") bad = true;
      n.fetch_add(1);
    };
  };
  SetLogSink(counting(a));
  constexpr int kThreads = 4, kLines = 2000;
  std::atomic<bool> stop{false};
  std::thread swapper([&] {
    for (int i = 0; !stop.load(); ++i) SetLogSink(i % 2 ? counting(a) : counting(b));
  });
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([t] {
      for (int i = 0; i < kLines; ++i) LogInfo("line " + std::to_string(t * kLines + i));
    });
  }
  for (auto& t : threads) t.join();
  stop = true;
  swapper.join();
  SetLogSink(original);
  SetLogLevel(level);
  EXPECT_EQ(a.load() + b.load(), kThreads * kLines);
  EXPECT_FALSE(bad.load());
}

TEST(WarnOnceTest, LogsOncePerKey) {
  CollectingSink sink;
  SetLogLevel(LogLevel::kInfo);
  EXPECT_TRUE(WarnOnce("log-test-key", "first"));
  EXPECT_FALSE(WarnOnce("log-test-key", "second"));
  EXPECT_THAT(sink.messages(), ::testing::ElementsAre("first"));
}

// A clock the test moves by hand.
struct FakeClock {
  std::atomic<double> now{100.0};
  std::function<double()> fn() {
    return [this] { return now.load(); };
  }
};

TEST(ProgressReporterTest, ShortWorkIsSilent) {
  CollectingSink sink;
  SetLogLevel(LogLevel::kInfo);
  FakeClock clock;
  {
    ProgressReporter p("quick", 100, ProgressUnit::kItems, {.clock = clock.fn()});
    for (int i = 0; i < 100; ++i) {
      p.Add(1);
      clock.now = clock.now + 0.019;  // 1.9 s in all: under the 2 s of quiet
    }
    EXPECT_EQ(p.done(), 100u);
    p.Finish();
  }
  EXPECT_THAT(sink.lines(), IsEmpty());
}

// Work that stops part way (an error returned) ends without Finish(): no
// "done" line claims what did not happen.
TEST(ProgressReporterTest, WorkThatEndsWithoutFinishGetsNoDoneLine) {
  CollectingSink sink;
  SetLogLevel(LogLevel::kInfo);
  FakeClock clock;
  {
    ProgressReporter p("save", 10, ProgressUnit::kItems, {.clock = clock.fn()});
    clock.now = clock.now + 3;
    p.Add(4);
  }
  ASSERT_THAT(sink.messages(), SizeIs(1));
  EXPECT_EQ(sink.messages()[0], "save: 4 of 10 (40%), 1.3/s, ~4.50 s left");
}

TEST(ProgressReporterTest, LongWorkLogsAtMostOneLineASecondThenAFinalLine) {
  CollectingSink sink;
  SetLogLevel(LogLevel::kInfo);
  FakeClock clock;
  ProgressReporter p("init state", 8 * kGiB, ProgressUnit::kBytes,
                     {.clock = clock.fn()});
  // 1 GiB every 0.5 s: 8 GiB in 4 s.
  for (int i = 0; i < 8; ++i) {
    clock.now = clock.now + 0.5;
    p.Add(kGiB);
  }
  // Lines at t = 2.0 (4 GiB), 3.0 and 4.0; 2.5 and 3.5 are inside the interval.
  auto lines = sink.lines();
  ASSERT_THAT(lines, SizeIs(3));
  EXPECT_EQ(lines[0].first, LogLevel::kInfo);
  EXPECT_EQ(lines[0].second, "init state: 4.00 GiB of 8.00 GiB (50%), 2.15 GB/s, ~2.00 s left");
  EXPECT_THAT(lines[1].second, HasSubstr("6.00 GiB of 8.00 GiB (75%)"));
  EXPECT_EQ(lines[2].second, "init state: 8.00 GiB of 8.00 GiB (100%), 2.15 GB/s");
  p.Finish();
  p.Finish();  // once only
  lines = sink.lines();
  ASSERT_THAT(lines, SizeIs(4));
  EXPECT_EQ(lines[3].second, "init state: done, 8.00 GiB in 4.00 s (2.15 GB/s)");
  EXPECT_EQ(p.lines(), 4u);
}

TEST(ProgressReporterTest, ItemsAndUnknownTotal) {
  CollectingSink sink;
  SetLogLevel(LogLevel::kInfo);
  FakeClock clock;
  ProgressReporter p("sub-groups", 0, ProgressUnit::kItems, {.clock = clock.fn()});
  clock.now = clock.now + 2.5;
  p.Set(5);
  ASSERT_THAT(sink.messages(), SizeIs(1));
  EXPECT_EQ(sink.messages()[0], "sub-groups: 5, 2.0/s");
}

TEST(ProgressReporterTest, RespectsTheLogLevel) {
  CollectingSink sink;
  SetLogLevel(LogLevel::kWarning);
  FakeClock clock;
  ProgressReporter p("hidden", 10, ProgressUnit::kItems, {.clock = clock.fn()});
  clock.now = clock.now + 10;
  p.Add(10);
  p.Finish();
  EXPECT_THAT(sink.lines(), IsEmpty());
}

// Under TSan: Add from several threads while lines are being logged.
TEST(ProgressReporterTest, ConcurrentAddsCountEverything) {
  CollectingSink sink;
  SetLogLevel(LogLevel::kInfo);
  std::atomic<double> now{0};
  ProgressReporter p("parallel", 0, ProgressUnit::kBytes,
                     {.quiet_sec = 0, .interval_sec = 0, .clock = [&now] {
                        return now.fetch_add(0.001);
                      }});
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&p] {
      for (int i = 0; i < 1000; ++i) p.Add(3);
    });
  }
  for (auto& t : threads) t.join();
  p.Finish();
  EXPECT_EQ(p.done(), 12000u);
  auto messages = sink.messages();
  ASSERT_FALSE(messages.empty());
  EXPECT_THAT(messages.back(), HasSubstr("parallel: done, 11.72 KiB"));
}

}  // namespace
}  // namespace strata
