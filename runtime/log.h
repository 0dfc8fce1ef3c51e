// Minimal leveled logging, for what a user must see (a fallback taken, a
// budget lowered, the plan) and progress of long work. Not for the data path.
//
//   strata::LogWarning(fmt::format("mlock refused ({}); using unpinned memory", err));
//   strata::WarnOnce("uring-fallback", "io_uring unavailable; using the posix backend");
//
// Where lines go: by default "strata: <level>: <message>\n" on stderr (fd 2).
// SetLogSink() sends them to a callback instead (the Python plug-in forwards
// them to the `logging` module, a GUI or a test collects them):
//
//   strata::LogSink previous = strata::SetLogSink(
//       [](strata::LogLevel level, std::string_view message) { MyLogger(level, message); });
//   ...
//   strata::SetLogSink(std::move(previous));   // or nullptr: back to stderr
//
// Progress of long work (reading a model's state, a checkpoint save) goes
// through the same lines: a ProgressReporter stays silent for work shorter
// than ~2 s, then logs at info level at most one line a second,
//
//   "strata: info: init state: 1.20 GiB of 4.00 GiB (30%), 1.05 GB/s, ~3 s left"
//
// and a last line when the work ends if it had said anything:
//
//   strata::ProgressReporter progress("init state", total_bytes, ProgressUnit::kBytes);
//   for (...) { ...; progress.Add(chunk_bytes); }   // any thread
//   progress.Finish();                              // or let it go out of scope
//
// The level comes from the environment variable STRATA_LOG
// (debug|info|warning|error|off; default info) or SetLogLevel(); lines below
// it reach no sink.
//
// Thread-safety: every function here may be called from any thread. On
// stderr one line is written with one write(2), so lines never interleave.
// A sink is called on the thread that logs, possibly on several threads at
// once, and with no lock of this module held: it must be thread-safe itself,
// and it may log (its lines reach it again) or call SetLogSink. A sink that
// is replaced may still be running a call that started before; it is
// destroyed after that call returns.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <string_view>

namespace strata {

enum class LogLevel : int { kDebug = 0, kInfo = 1, kWarning = 2, kError = 3, kOff = 4 };

std::string_view LogLevelName(LogLevel level);  // "debug", "info", "warning", "error", "off"

void SetLogLevel(LogLevel level);
LogLevel GetLogLevel();
bool LogEnabled(LogLevel level);

// Receives each enabled line: its level and the message (no prefix, no
// trailing newline).
using LogSink = std::function<void(LogLevel level, std::string_view message)>;

// Installs `sink` for the whole process (nullptr or an empty function: the
// default stderr writer) and returns the one it replaces (empty when it was
// the default), so a caller can put it back.
LogSink SetLogSink(LogSink sink);

// The default sink: writes "strata: <level>: <message>\n" to fd 2 with one
// write(2). For sinks that fall back to it (a callback that cannot run now).
void WriteLogToStderr(LogLevel level, std::string_view message);

// Sends `message` to the sink when `level` is enabled.
void Log(LogLevel level, std::string_view message);
inline void LogDebug(std::string_view m) { Log(LogLevel::kDebug, m); }
inline void LogInfo(std::string_view m) { Log(LogLevel::kInfo, m); }
inline void LogWarning(std::string_view m) { Log(LogLevel::kWarning, m); }
inline void LogError(std::string_view m) { Log(LogLevel::kError, m); }

// Logs a warning the first time `key` is seen in this process; later calls
// with the same key are silent. Returns true when it logged.
bool WarnOnce(std::string_view key, std::string_view message);

// What a ProgressReporter counts: bytes print as "1.20 GiB" and rates as
// "1.05 GB/s"; items as "12 of 40" and "3.5/s".
enum class ProgressUnit : uint8_t { kBytes = 0, kItems = 1 };

struct ProgressOptions {
  double quiet_sec = 2.0;     // nothing is logged before this much time has passed
  double interval_sec = 1.0;  // then at most one line per interval
  LogLevel level = LogLevel::kInfo;
  // Seconds on a monotonic clock; empty: std::chrono::steady_clock. For tests.
  std::function<double()> clock{};
};

// Reports the progress of one piece of work of `total` units (0: unknown;
// lines then show what is done and the rate, with no percentage). Add() and
// Set() are thread-safe and cheap (an atomic add and a clock read); the
// line is logged by whichever call finds the interval over. Finish() logs
// the final line, "<what>: done, <amount> in <time> (<rate>)", only when an
// earlier line was logged, so short work stays silent. Work that ends
// without Finish() (an error returned part way) gets no final line: it did
// not get done, and its error says why.
class ProgressReporter {
 public:
  ProgressReporter(std::string what, uint64_t total, ProgressUnit unit,
                   ProgressOptions options = {});
  ~ProgressReporter();
  ProgressReporter(const ProgressReporter&) = delete;
  ProgressReporter& operator=(const ProgressReporter&) = delete;

  void Add(uint64_t units);
  void Set(uint64_t done);  // the amount done so far, when the caller counts itself
  // Logs the final line if any line was logged; later calls do nothing.
  void Finish();

  uint64_t done() const;
  // Lines logged so far (the final one included); for tests.
  uint32_t lines() const;

 private:
  struct State;
  std::unique_ptr<State> state_;
};

}  // namespace strata
