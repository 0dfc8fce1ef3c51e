// `strata info`: a doctor. What this build contains, what this machine offers
// (CPUs and the SIMD target cpu_adam runs, memory, `ulimit -l` and whether
// pinning works, devices, CUDA/NCCL versions), per --nvme-dir whether io_uring
// and O_DIRECT work there and how much is free, the Pythons that have torch,
// and each problem found with what to do about it. --json prints the same as
// one object. Exit code 0 whatever it finds (problems are reported, not
// fatal), unless --fail-on names a severity that a problem found has: then 1,
// after the report, so a job's prologue can stop before training.
#include <fmt/format.h>
#include <pwd.h>
#include <sys/stat.h>
#include <unistd.h>

#include <array>
#include <cerrno>
#include <cstdio>
#include <filesystem>
#include <memory>
#include <nlohmann/json.hpp>
#include <set>
#include <string>
#include <vector>

#include "cpu_adam/cpu_adam.h"
#include "runtime/build_info.h"
#include "runtime/device.h"
#include "runtime/machine.h"
#include "runtime/storage.h"
#include "runtime/units.h"
#include "tools/cli.h"

#ifndef STRATA_BUILD_PYTHON
#define STRATA_BUILD_PYTHON ""
#endif

namespace strata::cli {
namespace {

using Json = nlohmann::ordered_json;

struct InfoArgs {
  std::vector<std::string> nvme_dirs;
  std::string pin_test = "64MiB";
  bool json = false;
  bool no_python = false;
  std::string fail_on;  // "", "error" or "warning" (errors too)
};

// One finding: what is wrong (or worth knowing) and what to do.
struct Problem {
  std::string severity;  // "error": Strata cannot work as configured; "warning": slower or degraded
  std::string what;
  std::string fix;
};

// Runs `command` through the shell and returns its stdout; "" when it fails.
std::string Capture(const std::string& command) {
  std::unique_ptr<FILE, int (*)(FILE*)> pipe(::popen(command.c_str(), "r"), ::pclose);
  if (!pipe) return "";
  std::string out;
  std::array<char, 4096> buf;
  size_t n;
  while ((n = std::fread(buf.data(), 1, buf.size(), pipe.get())) > 0) out.append(buf.data(), n);
  return out;
}

// The Python script run by each candidate interpreter: one JSON line.
constexpr const char* kPythonProbe = R"PY(
import json, sys
r = {"executable": sys.executable, "version": sys.version.split()[0]}
try:
    import torch
    r["torch"] = torch.__version__
    r["torch_cuda"] = torch.version.cuda
    r["cuda_available"] = bool(torch.cuda.is_available())
    try:
        v = torch.cuda.nccl.version() if torch.cuda.is_available() else None
        r["torch_nccl"] = ".".join(map(str, v)) if isinstance(v, tuple) else v
    except Exception:
        r["torch_nccl"] = None
except Exception as e:
    r["torch_error"] = f"{type(e).__name__}: {e}"
try:
    import strata
    r["strata"] = strata.__file__
except Exception as e:
    r["strata_error"] = f"{type(e).__name__}: {e}"
print(json.dumps(r))
)PY";

// Interpreters worth asking: $STRATA_PYTHON, the one the module was built
// for, python3 on PATH, /usr/bin/python3 (each once, by real path).
std::vector<std::string> PythonCandidates() {
  std::vector<std::string> raw;
  if (const char* env = std::getenv("STRATA_PYTHON"); env != nullptr && *env) raw.push_back(env);
  if (std::string_view(STRATA_BUILD_PYTHON).size() > 0) raw.push_back(STRATA_BUILD_PYTHON);
  std::string on_path = Capture("command -v python3 2>/dev/null");
  while (!on_path.empty() && (on_path.back() == '\n' || on_path.back() == ' ')) on_path.pop_back();
  if (!on_path.empty()) raw.push_back(on_path);
  raw.push_back("/usr/bin/python3");
  std::vector<std::string> out;
  std::set<std::string> seen;
  for (const std::string& p : raw) {
    std::error_code ec;
    if (!std::filesystem::exists(p, ec)) continue;
    // Not canonical(): a venv's python is a symlink to the base interpreter
    // but has its own site-packages.
    if (seen.insert(std::filesystem::absolute(p, ec).lexically_normal().string()).second) {
      out.push_back(p);
    }
  }
  return out;
}

Json ProbePython(const std::string& python) {
  const std::string out =
      Capture(fmt::format("timeout 120 {} -c {} 2>/dev/null", ShellQuote(python),
                          ShellQuote(kPythonProbe)));
  Json r = Json::parse(out, nullptr, /*allow_exceptions=*/false);
  if (r.is_discarded() || !r.is_object()) {
    return Json{{"executable", python}, {"error", "did not run (or printed no JSON)"}};
  }
  r["asked_as"] = python;
  return r;
}

bool NvidiaDevicePresent() {
  struct stat st {};
  return ::stat("/dev/nvidia0", &st) == 0 || ::stat("/dev/nvidiactl", &st) == 0;
}

std::string Onoff(bool b) { return b ? "compiled in" : "not built"; }

// "alice", or "uid 1000" where the user has no name.
std::string CurrentUser() {
  const uid_t uid = ::geteuid();
  if (const passwd* pw = ::getpwuid(uid); pw != nullptr && pw->pw_name != nullptr) {
    return pw->pw_name;
  }
  return fmt::format("uid {}", uid);
}

Status RunInfo(const InfoArgs& args) {
  const BuildInfo& b = GetBuildInfo();
  std::vector<Problem> problems;
  Json j;

  // Build.
  j["strata"] = {{"version", b.version},
                 {"build_type", b.build_type},
                 {"cuda", b.cuda},
                 {"nccl", b.nccl},
                 {"io_uring", b.uring},
                 {"python_module_built_for", STRATA_BUILD_PYTHON}};

  // CPU.
  const CpuInfo cpu = ProbeCpus();
  const std::string simd(CpuAdamTargetName());
  j["cpu"] = {{"model", cpu.model},
              {"usable_cores", cpu.usable},
              {"online_cores", cpu.online},
              {"cpu_adam_simd_target", simd}};
  if (simd == "EMU128" || simd == "SCALAR" || simd == "SSE2") {
    problems.push_back({"warning",
                        fmt::format("cpu_adam runs the {} target on this CPU (no AVX2)", simd),
                        "expect a slow optimizer step; a CPU with AVX2 or AVX-512 is 2-8x faster"});
  }
  if (cpu.usable < cpu.online) {
    problems.push_back(
        {"warning",
         fmt::format("this process may use {} of the {} online cores (affinity or cgroup)",
                     cpu.usable, cpu.online),
         "cpu_adam uses only the usable ones: widen the affinity (taskset, --cpus, "
         "OMP/launcher binding) if the optimizer step is the bottleneck"});
  }

  // Memory and pinning.
  STRATA_ASSIGN_OR_RETURN(uint64_t pin_bytes, ParseBytes(args.pin_test));
  Result<HostMemory> mem = ProbeHostMemory();
  // Locking most of the RAM (as root nothing stops it) would push the rest of
  // the machine into swap or the OOM killer: half of what is available at most.
  if (mem.ok() && pin_bytes > mem->available_bytes / 2) {
    return InvalidArgumentError(fmt::format(
        "--pin-test {}: more than half of the {} of memory available now; give at most {}",
        args.pin_test, FormatBytes(mem->available_bytes), FormatBytes(mem->available_bytes / 2)));
  }
  const Status pin = ProbePinning(pin_bytes);
  if (mem.ok()) {
    const bool unlimited = mem->memlock == MemlockLimit::kUnlimited;
    j["memory"] = {{"total_bytes", mem->total_bytes},
                   {"available_bytes", mem->available_bytes},
                   {"cgroup", mem->cgroup.limit_bytes == kUnlimitedBytes
                                  ? Json(nullptr)
                                  : Json{{"path", mem->cgroup.path},
                                         {"limit_bytes", mem->cgroup.limit_bytes},
                                         {"used_bytes", mem->cgroup.used_bytes}}},
                   {"memlock_limit_bytes", mem->memlock_limit_bytes == kUnlimitedBytes
                                               ? Json(nullptr)
                                               : Json(mem->memlock_limit_bytes)},
                   {"memlock_unlimited", unlimited},
                   {"pin_test_bytes", pin_bytes},
                   {"pin_test", pin_bytes == 0 ? "skipped" : pin.ok() ? "ok" : pin.ToString()}};
    if (!unlimited) {
      problems.push_back(
          {"warning",
           fmt::format("`ulimit -l` is {} and the process lacks CAP_IPC_LOCK: pinned host "
                       "memory past it falls back to unlocked memory (slower copies), and "
                       "io_uring cannot register the NVMe buffers",
                       FormatBytes(mem->memlock_limit_bytes)),
           "`ulimit -l unlimited` before the run (memlock in /etc/security/limits.conf, "
           "LimitMEMLOCK=infinity in systemd, --ulimit memlock=-1 in docker)"});
    }
    if (mem->available_bytes < 2 * kGiB) {
      problems.push_back({"warning",
                          fmt::format("only {} of host memory is available",
                                      FormatBytes(mem->available_bytes)),
                          "the optimizer state and staging need host memory: free some, or "
                          "plan with `strata plan` and put the state on NVMe"});
    }
  } else {
    j["memory"] = {{"error", mem.status().ToString()}};
    problems.push_back({"warning", mem.status().ToString(),
                        "the preflight cannot check memory: is /proc mounted?"});
  }
  if (!pin.ok()) {
    problems.push_back({"warning",
                        fmt::format("pinning {} failed: {}", FormatBytes(pin_bytes), pin.message()),
                        "raise `ulimit -l` (see above) or grant CAP_IPC_LOCK"});
  }

  // io_uring, devices, versions.
  const bool uring = UringAvailable();
  j["io_uring"] = uring;
  if (!uring) {
    problems.push_back(
        {"warning",
         b.uring ? "io_uring is refused by this kernel or sandbox: NVMe IO uses the POSIX "
                   "thread-pool fallback (more CPU, lower queue depth)"
                 : "this build has no io_uring backend (liburing-dev was missing): NVMe IO "
                   "uses the POSIX thread-pool fallback",
         b.uring ? "allow io_uring (docker: a seccomp profile that permits io_uring_setup/"
                   "enter/register; sysctl kernel.io_uring_disabled=0; kernel >= 5.6)"
                 : "install liburing-dev and rebuild"});
  }
  Json devices = Json::array();
  bool cuda_device = false;
  for (const DeviceCaps& d : ListDevices()) {
    cuda_device |= d.kind == DeviceKind::kCuda;
    devices.push_back({{"name", d.name},
                       {"description", d.description},
                       {"memory_bytes", d.total_memory_bytes}});
  }
  j["devices"] = devices;
  const BackendVersions v = ProbeBackendVersions();
  j["versions"] = {{"cuda_runtime", FormatCudaVersion(v.cuda_runtime)},
                   {"cuda_driver", FormatCudaVersion(v.cuda_driver)},
                   {"nccl", FormatNcclVersion(v.nccl)},
                   {"nccl_library", v.nccl_library},
                   {"nccl_error", v.nccl_error}};
  const bool nvidia = NvidiaDevicePresent();
  if (nvidia && !b.cuda) {
    problems.push_back({"error",
                        "an NVIDIA device is present but this build has no CUDA backend",
                        "install the CUDA toolkit (nvcc) and rebuild with -DSTRATA_CUDA=ON"});
  } else if (nvidia && b.cuda && !cuda_device) {
    problems.push_back(
        {"error", "an NVIDIA device node exists but no CUDA device can be opened",
         v.cuda_driver == 0 ? "the NVIDIA driver is not loaded: check `nvidia-smi`"
                            : fmt::format("the driver supports CUDA {} and this build uses {}: "
                                          "update the driver",
                                          FormatCudaVersion(v.cuda_driver),
                                          FormatCudaVersion(v.cuda_runtime))});
  }
  if (b.nccl && cuda_device && !v.nccl_error.empty()) {
    problems.push_back({"warning",
                        "NCCL cannot be loaded, so several GPUs cannot form a process group: " +
                            v.nccl_error,
                        "install NCCL 2 (the toolkit's, or pip's nvidia-nccl-cu13 in the torch "
                        "environment) where the loader finds it (LD_LIBRARY_PATH), or name the "
                        "file in STRATA_NCCL_LIBRARY"});
  }
  if (b.cuda && cuda_device && !b.nccl) {
    problems.push_back({"warning", "this build has no NCCL: only one GPU per process group",
                        "install NCCL (the toolkit's, or pip's nvidia-nccl-cu13 in the torch "
                        "environment) and rebuild: FindNCCL looks in both"});
  }

  // NVMe directories.
  Json dirs = Json::array();
  for (const std::string& dir : args.nvme_dirs) {
    const DirectoryProbe d = ProbeDirectory(dir, DirectoryChecks::kIo);
    auto outcome = [](const Status& s) { return s.ok() ? std::string("ok") : s.ToString(); };
    const bool checked = d.exists && d.writable.ok();
    const std::string unchecked = d.kind == PathKind::kMissing ? "not checked (no directory)"
                                  : d.kind == PathKind::kNotDirectory
                                      ? "not checked (not a directory)"
                                      : "not checked (not writable)";
    dirs.push_back({{"path", d.path},
                    {"exists", d.exists},
                    {"kind", PathKindName(d.kind)},
                    {"writable", outcome(d.writable)},
                    {"filesystem", d.filesystem},
                    {"free_bytes", d.free_bytes},
                    {"total_bytes", d.total_bytes},
                    {"o_direct", checked ? outcome(d.o_direct) : unchecked},
                    {"io_uring", checked ? outcome(d.io_uring) : unchecked}});
    if (!d.space.ok()) {
      problems.push_back({"error", d.space.ToString(), "give a directory this user can reach"});
      continue;
    }
    if (d.kind == PathKind::kNotDirectory) {
      problems.push_back({"error", fmt::format("{} exists and is not a directory", dir),
                          "nvme_path names a directory for the state files: give a directory, "
                          "or a path that does not exist yet (the engine creates it)"});
      continue;
    }
    if (d.filesystem == "proc" || d.filesystem == "sysfs") {  // as the preflight refuses
      problems.push_back(
          {"error", fmt::format("{} is on {}, a filesystem that holds no files", dir, d.filesystem),
           "give a directory on the NVMe drive"});
      continue;
    }
    // Who cannot write here, and what to do about it.
    const std::string user = CurrentUser();
    auto write_fix = [&](const std::string& where) {
      if (d.writable_errno == EROFS) {
        return fmt::format(
            "the filesystem of {} is mounted read-only: remount it read-write, "
            "or choose a directory on another filesystem",
            where);
      }
      return fmt::format(
          "give this user ({}) write access to {} (e.g. `sudo chown {} {}`), or choose a "
          "directory this user can write",
          user, where, user, where);
    };
    if (!d.exists) {
      if (!d.writable.ok()) {
        problems.push_back({"error", std::string(d.writable.message()),
                            d.writable_errno != 0
                                ? fmt::format("create it for this user ({}): `sudo mkdir -p {} "
                                              "&& sudo chown {} {}`; or {}",
                                              user, dir, user, dir, write_fix(d.probed_path))
                                : "give a path under an existing directory"});
        continue;
      }
      problems.push_back(
          {"warning",
           fmt::format("{} does not exist yet (free space is that of {})", dir, d.probed_path),
           "the engine creates it on first use; run `strata info --nvme-dir` "
           "again once it exists to check O_DIRECT and io_uring there"});
      continue;
    }
    if (!d.writable.ok()) {
      problems.push_back(
          {"error", std::string(d.writable.message()),
           write_fix(dir) + "; O_DIRECT and io_uring are checked once it is writable"});
      continue;
    }
    if (!d.o_direct.ok()) {
      problems.push_back(
          {"warning",
           fmt::format("{} ({}) refuses O_DIRECT: {}", dir, d.filesystem, d.o_direct.message()),
           "the state store falls back to buffered IO through the page cache; put nvme_path on "
           "a local ext4/xfs filesystem on the NVMe drive (not tmpfs, overlay or NFS)"});
    }
    if (d.filesystem == "tmpfs" || d.filesystem == "ramfs") {
      problems.push_back(
          {"warning",
           fmt::format("{} is on {}: memory, not a drive", dir, d.filesystem),
           "state \"on NVMe\" there takes host memory beside the pinned DRAM tier (twice the "
           "state: two slots); put nvme_path on the NVMe drive, or keep the state in DRAM "
           "(offload_optimizer.device \"cpu\")"});
    }
    if (uring && !d.io_uring.ok()) {
      problems.push_back({"warning",
                          fmt::format("io_uring IO in {} failed: {}", dir, d.io_uring.message()),
                          "the state store falls back to the POSIX backend there"});
    }
    if (d.free_bytes < kGiB) {
      problems.push_back({"warning",
                          fmt::format("{} has only {} free", dir, FormatBytes(d.free_bytes)),
                          "`strata plan --config ...` says how much the state needs there"});
    }
  }
  j["nvme_dirs"] = dirs;

  // Python environments.
  Json pythons = Json::array();
  if (!args.no_python) {
    bool any_torch = false;
    for (const std::string& py : PythonCandidates()) {
      Json r = ProbePython(py);
      const bool torch = r.contains("torch");
      any_torch |= torch;
      if (torch && !r.contains("strata")) {
        problems.push_back(
            {"warning",
             fmt::format("{} has torch {} but cannot import strata", py,
                         r["torch"].get<std::string>()),
             fmt::format("in that environment, from the source tree: `{} -m pip install "
                         "--no-build-isolation .` (README: Installing)",
                         py)});
      }
      if (torch && cuda_device && r.value("torch_cuda", Json()).is_null()) {
        problems.push_back({"warning",
                            fmt::format("{} has a CPU-only torch on a machine with a GPU", py),
                            "install a CUDA build of torch in that environment"});
      }
      pythons.push_back(std::move(r));
    }
    if (!any_torch) {
      problems.push_back({"warning", "no Python found here imports torch",
                          "install PyTorch in the Python you train with and set STRATA_PYTHON "
                          "to it when building, or run `strata info` inside that environment"});
    }
  }
  j["python"] = pythons;

  Json pj = Json::array();
  for (const Problem& p : problems) {
    pj.push_back({{"severity", p.severity}, {"what", p.what}, {"fix", p.fix}});
  }
  j["problems"] = pj;
  size_t failing = 0;
  for (const Problem& p : problems) {
    failing += !args.fail_on.empty() &&
               (p.severity == "error" || (p.severity == "warning" && args.fail_on == "warning"));
  }
  const Status verdict =
      failing == 0 ? OkStatus()
                   : FailedPreconditionError(fmt::format(
                         "{} problem(s) of severity {}{} found (--fail-on {}): see the fixes {}",
                         failing, args.fail_on, args.fail_on == "warning" ? " or error" : "",
                         args.fail_on, args.json ? "in \"problems\"" : "above"));

  if (args.json) {
    PrintJson(j, 2);
    return verdict;
  }

  // Text.
  std::printf("strata %.*s (%.*s)\n", static_cast<int>(b.version.size()), b.version.data(),
              static_cast<int>(b.build_type.size()), b.build_type.data());
  std::printf("  build:        cuda %s, nccl %s, io_uring %s\n", Onoff(b.cuda).c_str(),
              Onoff(b.nccl).c_str(), Onoff(b.uring).c_str());
  if (std::string_view(STRATA_BUILD_PYTHON).size() > 0) {
    std::printf("  python module built for %s\n", STRATA_BUILD_PYTHON);
  }
  std::printf("  cpu:          %u usable of %u online cores%s%s; cpu_adam SIMD target %s\n",
              cpu.usable, cpu.online, cpu.model.empty() ? "" : ", ", cpu.model.c_str(),
              simd.c_str());
  if (mem.ok()) {
    std::printf("  memory:       %s total, %s available%s\n", FormatBytes(mem->total_bytes).c_str(),
                FormatBytes(mem->available_bytes).c_str(), mem->limit_note().c_str());
    std::printf("  ulimit -l:    %s%s; pinning %s: %s\n",
                mem->memlock_limit_bytes == kUnlimitedBytes
                    ? "unlimited"
                    : FormatBytes(mem->memlock_limit_bytes).c_str(),
                mem->memlock == MemlockLimit::kUnlimited &&
                        mem->memlock_limit_bytes != kUnlimitedBytes
                    ? " (CAP_IPC_LOCK: no limit applies)"
                    : "",
                FormatBytes(pin_bytes).c_str(),
                pin_bytes == 0 ? "skipped" : pin.ok() ? "ok" : pin.ToString().c_str());
  }
  std::printf("  io_uring:     %s\n", uring ? "available" : "not available");
  std::string nccl_text = "-";
  if (v.nccl) {
    nccl_text = fmt::format("{} ({})", FormatNcclVersion(v.nccl), v.nccl_library);
  } else if (!v.nccl_error.empty()) {
    nccl_text = "cannot be loaded (--json: versions.nccl_error)";
  }
  std::printf("  versions:     CUDA runtime %s, driver %s, NCCL %s\n",
              v.cuda_runtime ? FormatCudaVersion(v.cuda_runtime).c_str() : "-",
              v.cuda_driver ? FormatCudaVersion(v.cuda_driver).c_str() : "none", nccl_text.c_str());
  std::printf("  devices:\n");
  for (const DeviceCaps& d : ListDevices()) {
    std::printf("    %-8s %s, %s memory%s\n", d.name.c_str(), d.description.c_str(),
                FormatBytes(d.total_memory_bytes).c_str(),
                d.kind == DeviceKind::kHost ? " (budget)" : "");
  }
  for (const Json& d : dirs) {
    std::printf("  nvme dir %s: %s, %s free of %s; O_DIRECT %s; io_uring %s\n",
                d["path"].get<std::string>().c_str(), d["filesystem"].get<std::string>().c_str(),
                FormatBytes(d["free_bytes"].get<uint64_t>()).c_str(),
                FormatBytes(d["total_bytes"].get<uint64_t>()).c_str(),
                d["o_direct"].get<std::string>().c_str(), d["io_uring"].get<std::string>().c_str());
  }
  if (args.no_python) {
    std::printf("  python:       not checked (--no-python)\n");
  }
  for (const Json& p : pythons) {
    std::string line = fmt::format("  python:       {}", p.value("executable", std::string()));
    if (p.contains("version")) line += " " + p["version"].get<std::string>();
    if (p.contains("torch")) {
      line += fmt::format(": torch {}", p["torch"].get<std::string>());
      const Json cuda = p.value("torch_cuda", Json());
      line += cuda.is_string() ? fmt::format(" (CUDA {}{})", cuda.get<std::string>(),
                                             p.value("cuda_available", false) ? ", GPU visible"
                                                                              : ", no GPU visible")
                               : " (CPU only)";
      const Json nccl = p.value("torch_nccl", Json());
      if (nccl.is_string()) line += ", NCCL " + nccl.get<std::string>();
    } else if (p.contains("torch_error")) {
      line += ": no torch";
    } else if (p.contains("error")) {
      line += ": " + p["error"].get<std::string>();
    }
    if (p.contains("strata")) line += "; strata from " + p["strata"].get<std::string>();
    std::printf("%s\n", line.c_str());
  }
  if (problems.empty()) {
    std::printf("no problems found\n");
  } else {
    std::printf("problems (%zu):\n", problems.size());
    for (const Problem& p : problems) {
      std::printf("  - %s: %s\n    fix: %s\n", p.severity.c_str(), p.what.c_str(),
                  p.fix.c_str());
    }
  }
  return verdict;
}

}  // namespace

void AddInfoCommand(Cli& cli) {
  auto args = std::make_shared<InfoArgs>();
  CLI::App* cmd = cli.app.add_subcommand(
      "info", "Check this build and machine: backends, SIMD, memory and pinning, devices, "
              "versions, NVMe directories, Python environments, problems and fixes");
  cmd->add_option("--nvme-dir", args->nvme_dirs,
                  "a directory meant for nvme_path: free space, O_DIRECT, io_uring (repeatable)")
      ->check(CLI::Validator(
          [](std::string& s) {
            return s.empty() ? std::string("an empty path; give a directory") : "";
          },
          "DIR"));
  cmd->add_option("--pin-test", args->pin_test,
                  "bytes to mlock as the pinning test (at most half of the available memory)")
      ->capture_default_str();
  cmd->add_flag("--no-python", args->no_python, "do not run the Pythons on this machine");
  cmd->add_flag("--json", args->json, "print one JSON object");
  cmd->add_option("--fail-on", args->fail_on,
                  "exit 1 (after the report) when a problem of this severity is found: error, "
                  "or warning (warnings and errors); by default the exit code is 0")
      ->check(CLI::IsMember({"error", "warning"}));
  cmd->callback([&cli, args] {
    RunAction(cli, "info", OutputOf(args->json), [args] { return RunInfo(*args); });
  });
}

}  // namespace strata::cli
