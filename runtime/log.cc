#include "runtime/log.h"

#include <unistd.h>

#include <atomic>
#include <cstdlib>
#include <mutex>
#include <set>
#include <string>

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

std::string_view LevelName(LogLevel level) {
  switch (level) {
    case LogLevel::kDebug: return "debug";
    case LogLevel::kInfo: return "info";
    case LogLevel::kWarning: return "warning";
    case LogLevel::kError: return "error";
    case LogLevel::kOff: break;
  }
  return "";
}

}  // namespace

void SetLogLevel(LogLevel level) { Level().store(static_cast<int>(level)); }
LogLevel GetLogLevel() { return static_cast<LogLevel>(Level().load()); }
bool LogEnabled(LogLevel level) {
  return level != LogLevel::kOff && static_cast<int>(level) >= Level().load();
}

void Log(LogLevel level, std::string_view message) {
  if (!LogEnabled(level)) return;
  std::string line = "strata: ";
  line += LevelName(level);
  line += ": ";
  line += message;
  line += '\n';
  // One write per line so lines from several threads never interleave.
  ssize_t ignored = ::write(STDERR_FILENO, line.data(), line.size());
  (void)ignored;
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

}  // namespace strata
