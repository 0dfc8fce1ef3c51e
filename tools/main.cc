#include <fmt/format.h>
#include <fmt/ranges.h>

#include <cstdio>
#include <fstream>
#include <sstream>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "runtime/build_info.h"
#include "runtime/spelling.h"
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

namespace {

// The options of the bench commands that set a config key: a command that
// lacks one but takes --config reads it from there.
constexpr std::pair<std::string_view, std::string_view> kOptionConfigKeys[] = {
    {"host-budget", "strata.host_budget"},
    {"device-budget", "strata.device_budget"},
    {"gpu-fraction", "strata.gpu_fraction"},
    {"threads", "strata.threads"},
    {"grad", "strata.grad_dtype"},
    {"offload", "zero_optimization.offload_optimizer.device"},
    {"nvme-dir", "zero_optimization.offload_optimizer.nvme_path"},
    {"buffer-count", "zero_optimization.offload_optimizer.buffer_count"},
    {"sub-group", "zero_optimization.sub_group_size"},
    {"block", "aio.block_size"},
    {"queue-depth", "aio.queue_depth"},
};

// Every command below `app` that runs (no subcommands of its own), with its
// path: "strata bench step".
void Leaves(const CLI::App& app, const std::string& path,
            std::vector<std::pair<const CLI::App*, std::string>>& out) {
  const auto subs = app.get_subcommands([](const CLI::App*) { return true; });
  if (subs.empty()) out.emplace_back(&app, path);
  for (const CLI::App* sub : subs) Leaves(*sub, path + " " + sub->get_name(), out);
}

// What to say of one argument `app` did not take: an option close to one of
// its own names is asked about; one that other commands take names them.
std::string Unexpected(const CLI::App& root, const CLI::App& app, const std::string& path,
                       const std::string& arg) {
  if (arg.rfind("--", 0) != 0 || arg.size() < 3) {
    return fmt::format("unexpected argument '{}'", arg);
  }
  const std::string name = arg.substr(2, arg.find('=') - 2);
  std::vector<std::string_view> names;
  for (const CLI::Option* opt : app.get_options()) {
    for (const std::string& lname : opt->get_lnames()) names.push_back(lname);
  }
  if (const std::string_view nearest = NearestSpelling(name, names); !nearest.empty()) {
    return fmt::format("unknown option --{} (did you mean --{}?)", name, nearest);
  }
  std::vector<std::pair<const CLI::App*, std::string>> leaves;
  Leaves(root, "strata", leaves);
  std::vector<std::string> takers;
  for (const auto& [leaf, leaf_path] : leaves) {
    if (leaf != &app && leaf->get_option_no_throw("--" + name) != nullptr) {
      takers.push_back(leaf_path);
    }
  }
  // A command that reads a config file takes the setting there.
  std::string_view key;
  if (app.get_option_no_throw("--config") != nullptr) {
    for (const auto& [option, config_key] : kOptionConfigKeys) {
      if (option == name) key = config_key;
    }
  }
  if (takers.empty() && key.empty()) return fmt::format("unknown option --{}", name);
  std::string said;
  if (!takers.empty()) {
    const std::string last = takers.back();
    takers.pop_back();
    said = fmt::format("{}{} take{} {}", fmt::join(takers, ", "),
                       takers.empty() ? last : " and " + last, takers.empty() ? "s" : "",
                       key.empty() ? "it" : "the option");
  }
  if (key.empty()) return fmt::format("unknown option --{} ({}; {} does not)", name, said, path);
  return fmt::format("unknown option --{} ({} reads it from --config, as {}{}{})", name, path, key,
                     said.empty() ? "" : "; ", said);
}

}  // namespace

// CLI11 says a usage error without the command ("--world-size: Value 0 not
// in range") and lists unexpected arguments backwards. This names the
// command that refused it, the arguments in the order given, what an
// unknown option was likely meant to be, and the help to read.
std::string UsageError(const CLI::App& root, const CLI::ParseError& e) {
  const CLI::App* app = &root;
  std::string path = "strata";
  const CLI::App* refused = nullptr;  // the first command, from the root, with leftovers
  std::string refused_path;
  for (;;) {
    if (refused == nullptr && !app->remaining().empty()) {
      refused = app;
      refused_path = path;
    }
    const std::vector<CLI::App*> parsed = app->get_subcommands();
    if (parsed.empty()) break;
    app = parsed.front();
    path += " " + app->get_name();
  }
  std::string what = e.what();
  if (dynamic_cast<const CLI::ExtrasError*>(&e) != nullptr && refused != nullptr) {
    app = refused;
    path = refused_path;
    std::vector<std::string> said;
    const std::vector<std::string> left = app->remaining();
    for (size_t i = 0; i < left.size(); ++i) {
      said.push_back(Unexpected(root, *app, path, left[i]));
      // The value an unknown option was given is not an argument of its own.
      if (left[i].rfind("--", 0) == 0 && left[i].find('=') == std::string::npos &&
          i + 1 < left.size() && left[i + 1].rfind("-", 0) != 0) {
        ++i;
      }
    }
    what = fmt::format("{}", fmt::join(said, "; "));
  }
  return fmt::format("{}: {}; '{} --help' lists what it takes", path, what, path);
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
    std::fprintf(stderr, "%s\n", strata::cli::UsageError(cli.app, e).c_str());
    return strata::cli::kExitUsage;
  }
  return cli.exit_code;
}
