// `strata info`: what this build contains and what this machine offers.
#include <unistd.h>

#include <cstdio>
#include <thread>

#include "runtime/build_info.h"
#include "runtime/device.h"
#include "runtime/units.h"
#include "tools/cli.h"

namespace strata::cli {

void AddInfoCommand(Cli& cli) {
  CLI::App* cmd = cli.app.add_subcommand("info", "Print the build's backends and this machine's resources");
  cmd->callback([&cli] {
    RunAction(cli, "info", [] {
      const BuildInfo& b = GetBuildInfo();
      std::printf("strata %.*s (%.*s)\n", static_cast<int>(b.version.size()), b.version.data(),
                  static_cast<int>(b.build_type.size()), b.build_type.data());
      std::printf("  cuda backend:   %s\n", b.cuda ? "compiled in" : "not built");
      std::printf("  nccl:           %s\n", b.nccl ? "compiled in" : "not built");
      std::printf("  io_uring:       %s\n", b.uring ? "compiled in" : "not built");
      std::printf("  cpu threads:    %u\n", std::thread::hardware_concurrency());
      long pages = sysconf(_SC_PHYS_PAGES);
      long page = sysconf(_SC_PAGE_SIZE);
      std::printf("  host memory:    %.1f GiB\n",
                  static_cast<double>(pages) * static_cast<double>(page) / (1 << 30));
      std::printf("  devices:\n");
      for (const DeviceCaps& d : ListDevices()) {
        std::printf("    %-8s %s, %s memory%s\n", d.name.c_str(), d.description.c_str(),
                    FormatBytes(d.total_memory_bytes).c_str(),
                    d.kind == DeviceKind::kHost ? " (budget)" : "");
      }
      return OkStatus();
    });
  });
}

}  // namespace strata::cli
