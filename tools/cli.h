// The `strata` command line: each subcommand lives in its own file and is
// added to the app by one Add*Command function listed in main.cc.
//
// Exit codes: 0 success, 1 the work failed (the Status is printed), 2 the
// command line was wrong (CLI11 prints what and where).
#pragma once

#include <CLI/CLI.hpp>

#include <string>

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

// Runs `body` as a subcommand's action: prints a failed Status as
// "strata <name>: <status>" and records the exit code.
void RunAction(Cli& cli, std::string_view name, const std::function<Status()>& body);

// The whole text of a config file; NotFound naming it when it cannot be read.
Result<std::string> ReadConfigFile(const std::string& path);

void AddInfoCommand(Cli& cli);
void AddBenchNvmeCommand(Cli& cli);
void AddBenchAdamCommand(Cli& cli);
void AddPlanCommand(Cli& cli);
void AddBenchPcieCommand(Cli& cli);
void AddBenchStepCommand(Cli& cli);
void AddCheckpointCommands(Cli& cli);  // inspect, export

}  // namespace strata::cli
