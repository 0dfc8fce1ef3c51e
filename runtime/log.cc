#include "runtime/log.h"

#include <fmt/format.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <mutex>
#include <set>
#include <string>
#include <utility>

#include "runtime/units.h"

namespace strata {
namespace {

LogLevel LevelFromEnv() {
  const char* v = std::getenv("STRATA_LOG");
  if (v == nullptr) return LogLevel::kInfo;
  std::string_view s(v);
  if (s == "debug") return LogLevel::kDebug;
  if (s == "info") return LogLevel::kInfo;
  if (s == "warning" || s == "warn") return LogLevel::kWarning;
  if (s == "error") return LogLevel::kError;
  if (s == "off" || s == "quiet") return LogLevel::kOff;
  return LogLevel::kInfo;
}

std::atomic<int>& Level() {
  static std::atomic<int> level{static_cast<int>(LevelFromEnv())};
  return level;
}

// The installed sink; null means stderr. Held by shared_ptr so that a call
// in flight keeps the sink it started with alive while another thread
// replaces it, and no lock is held while a sink runs.
struct SinkSlot {
  std::mutex mu;
  std::shared_ptr<const LogSink> sink;
};

SinkSlot& Slot() {
  static SinkSlot* slot = new SinkSlot;  // never destroyed: logging works during exit
  return *slot;
}

double SteadySeconds() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

}  // namespace

std::string_view LogLevelName(LogLevel level) {
  switch (level) {
    case LogLevel::kDebug: return "debug";
    case LogLevel::kInfo: return "info";
    case LogLevel::kWarning: return "warning";
    case LogLevel::kError: return "error";
    case LogLevel::kOff: return "off";
  }
  return "?";
}

void WriteLogToStderr(LogLevel level, std::string_view message) {
  std::string line = "strata: ";
  line += LogLevelName(level);
  line += ": ";
  line += message;
  line += '\n';
  // One write per line so lines from several threads never interleave.
  ssize_t ignored = ::write(STDERR_FILENO, line.data(), line.size());
  (void)ignored;
}

void SetLogLevel(LogLevel level) { Level().store(static_cast<int>(level)); }
LogLevel GetLogLevel() { return static_cast<LogLevel>(Level().load()); }
bool LogEnabled(LogLevel level) {
  return level != LogLevel::kOff && static_cast<int>(level) >= Level().load();
}

LogSink SetLogSink(LogSink sink) {
  std::shared_ptr<const LogSink> next;
  if (sink) next = std::make_shared<const LogSink>(std::move(sink));
  std::shared_ptr<const LogSink> previous;
  {
    std::lock_guard<std::mutex> lock(Slot().mu);
    previous = std::exchange(Slot().sink, std::move(next));
  }
  // A copy: another thread may still be inside a call of `previous`.
  return previous ? *previous : LogSink();
}

void Log(LogLevel level, std::string_view message) {
  if (!LogEnabled(level)) return;
  std::shared_ptr<const LogSink> sink;
  {
    std::lock_guard<std::mutex> lock(Slot().mu);
    sink = Slot().sink;
  }
  if (sink) {
    (*sink)(level, message);
  } else {
    WriteLogToStderr(level, message);
  }
}

bool WarnOnce(std::string_view key, std::string_view message) {
  static std::mutex mu;
  static std::set<std::string, std::less<>> seen;
  {
    std::lock_guard<std::mutex> lock(mu);
    if (!seen.emplace(key).second) return false;
  }
  LogWarning(message);
  return true;
}

// ---------------------------------------------------------------------------
// ProgressReporter

struct ProgressReporter::State {
  std::string what;
  uint64_t total = 0;
  ProgressUnit unit = ProgressUnit::kBytes;
  ProgressOptions options;
  double start = 0;
  std::atomic<uint64_t> done{0};
  std::atomic<double> next_line{0};  // clock time before which nothing is logged
  std::atomic<uint32_t> lines{0};
  std::atomic<bool> finished{false};
  std::mutex mu;  // one thread formats and logs a line at a time

  double Now() const { return options.clock ? options.clock() : SteadySeconds(); }

  std::string Amount(uint64_t n) const {
    return unit == ProgressUnit::kBytes ? FormatBytes(n) : std::to_string(n);
  }
  std::string Rate(double per_sec) const {
    return unit == ProgressUnit::kBytes ? FormatRate(per_sec) : fmt::format("{:.1f}/s", per_sec);
  }

  std::string Line(uint64_t n, double now) const {
    const double elapsed = std::max(now - start, 1e-9);
    const double rate = static_cast<double>(n) / elapsed;
    std::string line = what + ": " + Amount(n);
    if (total > 0) {
      const double pct = 100.0 * static_cast<double>(std::min(n, total)) / static_cast<double>(total);
      line += fmt::format(" of {} ({:.0f}%)", Amount(total), std::floor(pct));
    }
    line += ", " + Rate(rate);
    if (total > 0 && n < total && rate > 0) {
      line += ", ~" + FormatSeconds(static_cast<double>(total - n) / rate) + " left";
    }
    return line;
  }

  // Logs a progress line when the interval is over; never blocks on another
  // thread that is logging one.
  void MaybeLog() {
    const double now = Now();
    if (now < next_line.load(std::memory_order_relaxed)) return;
    std::unique_lock<std::mutex> lock(mu, std::try_to_lock);
    if (!lock.owns_lock() || finished.load() || now < next_line.load()) return;
    next_line.store(now + options.interval_sec);
    if (!LogEnabled(options.level)) return;
    Log(options.level, Line(done.load(), now));
    lines.fetch_add(1);
  }
};

ProgressReporter::ProgressReporter(std::string what, uint64_t total, ProgressUnit unit,
                                   ProgressOptions options)
    : state_(std::make_unique<State>()) {
  state_->what = std::move(what);
  state_->total = total;
  state_->unit = unit;
  state_->options = std::move(options);
  state_->start = state_->Now();
  state_->next_line.store(state_->start + state_->options.quiet_sec);
}

ProgressReporter::~ProgressReporter() = default;

void ProgressReporter::Add(uint64_t units) {
  state_->done.fetch_add(units, std::memory_order_relaxed);
  state_->MaybeLog();
}

void ProgressReporter::Set(uint64_t done) {
  state_->done.store(done, std::memory_order_relaxed);
  state_->MaybeLog();
}

void ProgressReporter::Finish() {
  std::lock_guard<std::mutex> lock(state_->mu);
  if (state_->finished.exchange(true)) return;
  if (state_->lines.load() == 0 || !LogEnabled(state_->options.level)) return;
  const double now = state_->Now();
  const double elapsed = std::max(now - state_->start, 1e-9);
  const uint64_t n = state_->done.load();
  Log(state_->options.level,
      fmt::format("{}: done, {} in {} ({})", state_->what, state_->Amount(n),
                  FormatSeconds(elapsed), state_->Rate(static_cast<double>(n) / elapsed)));
  state_->lines.fetch_add(1);
}

uint64_t ProgressReporter::done() const { return state_->done.load(); }
uint32_t ProgressReporter::lines() const { return state_->lines.load(); }

}  // namespace strata
