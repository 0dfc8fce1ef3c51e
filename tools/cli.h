// The `strata` command line: each subcommand lives in its own file and is
// added to the app by one Add*Command function listed in main.cc.
//
// Exit codes: 0 success, 1 the work failed (the Status is printed), 2 the
// command line was wrong (CLI11 prints what and where).
#pragma once

#include <fmt/format.h>

#include <CLI/CLI.hpp>
#include <charconv>
#include <cstdio>
#include <nlohmann/json.hpp>
#include <string>
#include <type_traits>

#include "runtime/status.h"

namespace strata::cli {

inline constexpr int kExitFailure = 1;
inline constexpr int kExitUsage = 2;

struct Cli {
  CLI::App app{"strata: heterogeneous-memory offload runtime for training past GPU memory",
               "strata"};
  CLI::App* bench = nullptr;  // `strata bench <what>`
  int exit_code = 0;
};

// What a subcommand prints on stdout: text, or one JSON object (--json).
enum class Output { kText, kJson };
inline Output OutputOf(bool json_flag) { return json_flag ? Output::kJson : Output::kText; }

// Runs `body` as a subcommand's action: prints a failed Status as
// "strata <name>: <status>" on stderr and records the exit code. With
// Output::kJson a failure before the body printed its object prints
// {"error": ErrorJson(status)} on stdout, so --json always gives one object.
void RunAction(Cli& cli, std::string_view name, Output output, const std::function<Status()>& body);
inline void RunAction(Cli& cli, std::string_view name, const std::function<Status()>& body) {
  RunAction(cli, name, Output::kText, body);
}

// The "error" member of every --json output: {"code": "NotFound", "message":
// "..."} for a failure, null for OK.
inline nlohmann::json ErrorJson(const Status& s) {
  if (s.ok()) return nullptr;
  return {{"code", std::string(StatusCodeName(s.code()))}, {"message", std::string(s.message())}};
}

// The text of a JSON value (compact, or pretty with `indent` >= 0). Every
// --json output and every JSON the CLI writes goes through here: a string
// that is not UTF-8 (a path on a filesystem that allows any bytes) has its
// bad bytes written as U+FFFD instead of throwing nlohmann's type_error.316,
// so output never aborts. Works for nlohmann::json and ordered_json.
template <typename JsonType>
std::string JsonText(const JsonType& j, int indent = -1) {
  return j.dump(indent, ' ', /*ensure_ascii=*/false, JsonType::error_handler_t::replace);
}

// How many objects PrintJson has printed: RunAction prints an error object
// only for a --json command that printed none.
inline int json_objects_printed = 0;

// Prints JsonText(j, indent) and a newline on stdout.
template <typename JsonType>
void PrintJson(const JsonType& j, int indent = -1) {
  std::printf("%s\n", JsonText(j, indent).c_str());
  ++json_objects_printed;
}

// `s` as one POSIX shell word: single-quoted, each ' written as '\''.
inline std::string ShellQuote(const std::string& s) {
  std::string out = "'";
  for (char c : s) out += c == '\'' ? std::string("'\\''") : std::string(1, c);
  return out + "'";
}

// CLI::Range with a message that says what is wrong: "--ranks: abc is not a
// whole number: give one from 1 to 64", "--ranks: 99 is out of range: give a
// whole number from 1 to 64" (CLI::Range calls both "not in range").
template <typename T>
CLI::Validator Within(T lo, T hi) {
  const std::string range = fmt::format("from {} to {}", lo, hi);
  const std::string kind = std::is_integral_v<T> ? "a whole number" : "a number";
  return CLI::Validator(
      [=](std::string& text) -> std::string {
        T v{};
        const char* end = text.data() + text.size();
        const auto [stop, ec] = std::from_chars(text.data(), end, v);
        const bool negative = std::is_unsigned_v<T> && !text.empty() && text[0] == '-';
        if (ec == std::errc::result_out_of_range || negative ||
            (ec == std::errc() && stop == end && (v < lo || v > hi))) {
          return fmt::format("{} is out of range: give {} {}", text, kind, range);
        }
        if (ec != std::errc() || stop != end) {
          return fmt::format("{} is not {}: give one {}", text, kind, range);
        }
        return std::string();
      },
      fmt::format("in [{} - {}]", lo, hi));
}

// The whole text of a config file; NotFound naming it when it cannot be read.
Result<std::string> ReadConfigFile(const std::string& path);

void AddInfoCommand(Cli& cli);
void AddBenchNvmeCommand(Cli& cli);
void AddBenchAdamCommand(Cli& cli);
void AddPlanCommand(Cli& cli);
void AddBenchPcieCommand(Cli& cli);
void AddBenchStepCommand(Cli& cli);
void AddBenchCheckpointCommand(Cli& cli);
void AddCheckpointCommands(Cli& cli);  // inspect, export

}  // namespace strata::cli
