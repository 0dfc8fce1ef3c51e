// Minimal leveled logging to stderr, for warnings a user must see (a fallback
// taken, a budget lowered) and progress of long work. Not for the data path.
//
//   strata::LogWarning(fmt::format("mlock refused ({}); using unpinned memory", err));
//   strata::WarnOnce("uring-fallback", "io_uring unavailable; using the posix backend");
//
// The level comes from the environment variable STRATA_LOG
// (debug|info|warning|error|off; default info) or SetLogLevel().
// Thread-safe: one line is written with one write(2).
#pragma once

#include <string_view>

namespace strata {

enum class LogLevel : int { kDebug = 0, kInfo = 1, kWarning = 2, kError = 3, kOff = 4 };

void SetLogLevel(LogLevel level);
LogLevel GetLogLevel();
bool LogEnabled(LogLevel level);

// Writes "strata: <level>: <message>\n" when `level` is enabled.
void Log(LogLevel level, std::string_view message);
inline void LogDebug(std::string_view m) { Log(LogLevel::kDebug, m); }
inline void LogInfo(std::string_view m) { Log(LogLevel::kInfo, m); }
inline void LogWarning(std::string_view m) { Log(LogLevel::kWarning, m); }
inline void LogError(std::string_view m) { Log(LogLevel::kError, m); }

// Logs a warning the first time `key` is seen in this process; later calls
// with the same key are silent. Returns true when it logged.
bool WarnOnce(std::string_view key, std::string_view message);

}  // namespace strata
