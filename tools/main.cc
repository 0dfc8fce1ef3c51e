#include <fmt/format.h>
#include <fmt/ranges.h>

#include <cstdio>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "runtime/build_info.h"
#include "tools/cli.h"

namespace strata::cli {

Result<std::string> ReadConfigFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return NotFoundError(fmt::format("read config {}: cannot open it", path));
  std::ostringstream text;
  text << in.rdbuf();
  return text.str();
}

void RunAction(Cli& cli, std::string_view name, Output output,
               const std::function<Status()>& body) {
  const int printed = json_objects_printed;
  Status s = body();
  if (!s.ok()) {
    if (output == Output::kJson && json_objects_printed == printed) {
      PrintJson(nlohmann::json{{"error", ErrorJson(s)}}, 2);
    }
    std::fprintf(stderr, "strata %.*s: %s\n", static_cast<int>(name.size()), name.data(),
                 s.ToString().c_str());
    cli.exit_code = s.code() == StatusCode::kInvalidArgument ? kExitUsage : kExitFailure;
  }
}

// CLI11 reads a word that is no subcommand as a stray argument and says only
// "A subcommand is required": name the word and list the subcommands. The
// usage error, or "" when the words before the first option are fine.
std::string UnknownSubcommand(const CLI::App& root, int argc, char** argv) {
  const CLI::App* app = &root;
  std::string path = "strata";
  for (int i = 1; i < argc && argv[i][0] != '-'; ++i) {
    const std::string word = argv[i];
    const auto subs = app->get_subcommands([](const CLI::App*) { return true; });
    if (subs.empty()) break;  // a positional argument of a leaf command
    const CLI::App* next = nullptr;
    std::vector<std::string> names;
    for (const CLI::App* sub : subs) {
      names.push_back(sub->get_name());
      if (sub->check_name(word)) next = sub;
    }
    if (next == nullptr) {
      return fmt::format(
          "{}: unknown subcommand '{}'; the subcommands are: {} ({} --help says "
          "what each does)",
          path, word, fmt::join(names, ", "), path);
    }
    app = next;
    path += " " + next->get_name();
  }
  return "";
}

}  // namespace strata::cli

int main(int argc, char** argv) {
  using strata::cli::Cli;
  Cli cli;
  cli.app.require_subcommand(1);
  cli.app.set_version_flag("--version", fmt::format("strata {}", strata::GetBuildInfo().version));
  cli.bench = cli.app.add_subcommand(
      "bench", "Measure PCIe, NVMe, CPU Adam, whole-step and checkpoint throughput");
  cli.bench->require_subcommand(1);

  strata::cli::AddInfoCommand(cli);
  strata::cli::AddBenchNvmeCommand(cli);
  strata::cli::AddBenchAdamCommand(cli);
  strata::cli::AddPlanCommand(cli);
  strata::cli::AddBenchPcieCommand(cli);
  strata::cli::AddBenchStepCommand(cli);
  strata::cli::AddBenchCheckpointCommand(cli);
  strata::cli::AddCheckpointCommands(cli);

  if (const std::string unknown = strata::cli::UnknownSubcommand(cli.app, argc, argv);
      !unknown.empty()) {
    std::fprintf(stderr, "%s\n", unknown.c_str());
    return strata::cli::kExitUsage;
  }
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
