#include <fmt/format.h>

#include <cstdio>
#include <fstream>
#include <sstream>

#include "tools/cli.h"

namespace strata::cli {

Result<std::string> ReadConfigFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return NotFoundError(fmt::format("read config {}: cannot open it", path));
  std::ostringstream text;
  text << in.rdbuf();
  return text.str();
}

void RunAction(Cli& cli, std::string_view name, const std::function<Status()>& body) {
  Status s = body();
  if (!s.ok()) {
    std::fprintf(stderr, "strata %.*s: %s\n", static_cast<int>(name.size()), name.data(),
                 s.ToString().c_str());
    cli.exit_code = s.code() == StatusCode::kInvalidArgument ? kExitUsage : kExitFailure;
  }
}

}  // namespace strata::cli

int main(int argc, char** argv) {
  using strata::cli::Cli;
  Cli cli;
  cli.app.require_subcommand(1);
  cli.app.set_version_flag("--version", "strata 0.1.0");
  cli.bench = cli.app.add_subcommand("bench", "Measure PCIe, NVMe, CPU Adam and whole-step throughput");
  cli.bench->require_subcommand(1);

  strata::cli::AddInfoCommand(cli);
  strata::cli::AddBenchNvmeCommand(cli);
  strata::cli::AddBenchAdamCommand(cli);
  strata::cli::AddPlanCommand(cli);
  strata::cli::AddBenchPcieCommand(cli);
  strata::cli::AddBenchStepCommand(cli);
  strata::cli::AddCheckpointCommands(cli);

  try {
    cli.app.parse(argc, argv);
  } catch (const CLI::CallForHelp& e) {
    return cli.app.exit(e);
  } catch (const CLI::CallForAllHelp& e) {
    return cli.app.exit(e);
  } catch (const CLI::CallForVersion& e) {
    return cli.app.exit(e);
  } catch (const CLI::ParseError& e) {
    cli.app.exit(e);
    return strata::cli::kExitUsage;
  }
  return cli.exit_code;
}
