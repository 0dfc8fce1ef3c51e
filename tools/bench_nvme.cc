// `strata bench nvme`: sequential read or write throughput of the storage
// engine on one or more drives, optionally against fio on the same files with
// the same engine, block size and queue depth, interleaved, best of several.
#include <fcntl.h>
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <limits>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <thread>
#include <vector>

#include "runtime/device.h"
#include "runtime/log.h"
#include "runtime/machine.h"
#include "runtime/pinned.h"
#include "runtime/storage.h"
#include "runtime/units.h"
#include "tools/baselines.h"
#include "tools/cleanup.h"
#include "tools/cli.h"

namespace strata::cli {
namespace {

struct NvmeArgs {
  std::string dir;
  std::vector<std::string> paths;
  std::string size = "1GiB";
  std::string block = "1MiB";
  uint32_t qd = 8;
  std::string op = "read";
  std::string backend = "uring";
  std::string buffers = "thp";
  int repeat = 3;
  std::string order = "alternate";
  bool fresh_buffers = false;
  bool vs_fio = false;
  bool json = false;
};

// IO buffers from the engine's own allocator: a PinnedPool on the host device
// (one slab, page-locked where permitted, huge-page backed where the kernel
// allows), as the state store's staging buffers are.
struct PinnedBuffers {
  static Result<std::unique_ptr<PinnedBuffers>> Create(Device& device, size_t count, size_t bytes) {
    constexpr uint64_t kHuge = 2 << 20;
    const uint64_t total = (count * bytes + kHuge - 1) / kHuge * kHuge;
    STRATA_ASSIGN_OR_RETURN(
        PinnedPool pool, PinnedPool::Create(device, {.budget_bytes = total, .slab_bytes = total}));
    auto out = std::make_unique<PinnedBuffers>(std::move(pool));
    for (size_t i = 0; i < count; ++i) {
      STRATA_ASSIGN_OR_RETURN(PinnedBuffer b, out->pool.Allocate(bytes));
      out->spans.push_back(b.bytes().first(bytes));
      out->buffers.push_back(std::move(b));
    }
    return out;
  }
  explicit PinnedBuffers(PinnedPool p) : pool(std::move(p)) {}
  PinnedPool pool;
  std::vector<PinnedBuffer> buffers;
  std::vector<std::span<std::byte>> spans;
};

// IO buffers in one mapping backed by transparent huge pages where the kernel
// allows: a 1 MiB buffer of scattered 4 KiB pages is 256 DMA segments, more
// than many devices take in one request (virtio-blk: 254), so the block layer
// would split every request.
enum class HugePages : uint8_t { kOff, kTransparent };

struct AlignedBuffers {
  explicit AlignedBuffers(std::unique_ptr<PinnedBuffers> from_pool)
      : map(nullptr), map_bytes(0), spans(from_pool->spans), pinned(std::move(from_pool)) {}
  AlignedBuffers(size_t count, size_t bytes, HugePages huge) {
    constexpr size_t kHuge = 2 << 20;
    map_bytes = (count * bytes + kHuge - 1) / kHuge * kHuge + kHuge;
    void* p =
        ::mmap(nullptr, map_bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) {
      map = nullptr;
      return;
    }
    map = static_cast<std::byte*>(p);
    std::byte* base = reinterpret_cast<std::byte*>((reinterpret_cast<uintptr_t>(map) + kHuge - 1) /
                                                   kHuge * kHuge);
    if (huge == HugePages::kTransparent) ::madvise(base, map_bytes - kHuge, MADV_HUGEPAGE);
    for (size_t i = 0; i < count; ++i) spans.emplace_back(base + i * bytes, bytes);
  }
  // Called after registration, which faults the pages in all at once (as fio's
  // buffers are): pages faulted one store at a time, between other processes'
  // allocations, end up more scattered in physical memory, i.e. more DMA
  // segments per request.
  void Fill() {
    for (size_t i = 0; i < spans.size(); ++i) {
      for (size_t j = 0; j < spans[i].size(); ++j)
        spans[i][j] = static_cast<std::byte>((j * 131 + i * 7) & 0xff);
    }
  }
  ~AlignedBuffers() {
    if (map != nullptr) ::munmap(map, map_bytes);
  }
  std::byte* map;
  size_t map_bytes;
  std::vector<std::span<std::byte>> spans;
  std::unique_ptr<PinnedBuffers> pinned;
};

// `kind`: thp, plain (mmap) or pinned (the engine's PinnedPool on `device`).
Result<std::unique_ptr<AlignedBuffers>> MakeIoBuffers(const std::string& kind, Device& device,
                                                      size_t count, size_t bytes) {
  if (kind == "pinned") {
    STRATA_ASSIGN_OR_RETURN(auto pinned, PinnedBuffers::Create(device, count, bytes));
    return std::make_unique<AlignedBuffers>(std::move(pinned));
  }
  auto b = std::make_unique<AlignedBuffers>(
      count, bytes, kind == "thp" ? HugePages::kTransparent : HugePages::kOff);
  if (b->map == nullptr) {
    return ResourceExhaustedError(fmt::format("map {} x {} of IO buffers: {}", count,
                                              FormatBytes(bytes),
                                              ErrnoError(errno, "mmap").message()));
  }
  return b;
}

// Mean number of physically contiguous runs per buffer: the scatter-gather
// segments a request on that buffer needs once the block layer has merged
// adjacent pages. Read from /proc/self/pagemap, whose frame numbers only
// root (CAP_SYS_ADMIN) sees; returns 0 where they are hidden.
double MeanPhysicalSegments(std::span<const std::span<std::byte>> buffers) {
  const int fd = ::open("/proc/self/pagemap", O_RDONLY | O_CLOEXEC);
  if (fd < 0) return 0;
  const size_t page = static_cast<size_t>(::sysconf(_SC_PAGESIZE));
  uint64_t runs = 0;
  for (std::span<std::byte> b : buffers) {
    const size_t pages = (b.size() + page - 1) / page;
    std::vector<uint64_t> entries(pages);
    const off_t off = static_cast<off_t>(reinterpret_cast<uintptr_t>(b.data()) / page * 8);
    if (::pread(fd, entries.data(), pages * 8, off) != static_cast<ssize_t>(pages * 8)) {
      ::close(fd);
      return 0;
    }
    constexpr uint64_t kPfnMask = (1ull << 55) - 1;
    constexpr uint64_t kPresent = 1ull << 63;
    for (size_t i = 0; i < pages; ++i) {
      const uint64_t pfn = entries[i] & kPfnMask;
      if ((entries[i] & kPresent) == 0 || pfn == 0) {
        ::close(fd);
        return 0;
      }
      if (i == 0 || pfn != (entries[i - 1] & kPfnMask) + 1) ++runs;
    }
  }
  ::close(fd);
  return buffers.empty() ? 0 : static_cast<double>(runs) / buffers.size();
}

// Sequential IO over [0, size_bytes) of one file with `qd` requests in flight.
// With qd buffers each request slot keeps its own; with more, chunk c uses
// buffers[c % buffers.size()]: the IO walks through a large region, as the
// engine's does through its extent buffers (on a VM the "DMA" is a memcpy by
// the host, and a few cache-resident buffers would flatter the drive).
Status RunFile(File& file, IoOp op, uint64_t size_bytes, uint64_t block_bytes, uint32_t qd,
               std::span<const std::span<std::byte>> buffers, std::atomic<uint64_t>* progress) {
  std::vector<IoRequest> reqs(qd);
  std::vector<IoRequest*> done(qd);
  auto buffer_for = [&](uint64_t slot, uint64_t offset) {
    return buffers.size() == qd ? buffers[slot] : buffers[(offset / block_bytes) % buffers.size()];
  };
  uint64_t next = 0;
  size_t active = 0;
  for (uint32_t i = 0; i < qd && next < size_bytes; ++i, next += block_bytes) {
    reqs[i] = IoRequest{op, next, buffer_for(i, next).first(std::min(block_bytes, size_bytes - next)),
                        i, {}, 0, 0};
    ++active;
  }
  STRATA_RETURN_IF_ERROR(file.Submit(std::span(reqs).first(active)));
  while (active > 0) {
    STRATA_ASSIGN_OR_RETURN(size_t n, file.Reap(done, 1));
    for (size_t i = 0; i < n; ++i) {
      IoRequest* r = done[i];
      STRATA_RETURN_IF_ERROR(r->status);
      if (progress) progress->fetch_add(r->transferred_bytes, std::memory_order_relaxed);
      if (next < size_bytes) {
        *r = IoRequest{op,
                       next,
                       buffer_for(r->user_data, next).first(std::min(block_bytes, size_bytes - next)),
                       r->user_data,
                       {},
                       0,
                       0};
        next += block_bytes;
        STRATA_RETURN_IF_ERROR(file.Submit(std::span(r, 1)));
      } else {
        --active;
      }
    }
  }
  return OkStatus();
}

enum class Progress : uint8_t { kQuiet, kShow };

// One pass over every file, one thread per file (as fio runs one job per
// file). Returns bytes per second over all files.
Result<double> RunPass(std::vector<std::unique_ptr<File>>& files, IoOp op, uint64_t per_file_bytes,
                       uint64_t block_bytes, uint32_t qd,
                       std::vector<std::unique_ptr<AlignedBuffers>>& bufs, Progress show_progress) {
  std::vector<Status> results(files.size());
  std::atomic<uint64_t> progress{0};
  std::atomic<bool> finished{false};
  const auto t0 = std::chrono::steady_clock::now();
  std::vector<std::thread> threads;
  for (size_t f = 0; f < files.size(); ++f) {
    threads.emplace_back([&, f] {
      results[f] =
          RunFile(*files[f], op, per_file_bytes, block_bytes, qd, bufs[f]->spans, &progress);
    });
  }
  std::thread reporter;
  if (show_progress == Progress::kShow) {
    reporter = std::thread([&] {
      const uint64_t total = per_file_bytes * files.size();
      while (!finished.load()) {
        std::fprintf(stderr, "\rwriting test files: %s / %s ", FormatBytes(progress.load()).c_str(),
                     FormatBytes(total).c_str());
        for (int i = 0; i < 10 && !finished.load(); ++i)
          std::this_thread::sleep_for(std::chrono::milliseconds(50));
      }
      std::fprintf(stderr, "\rwriting test files: %s done%20s\n", FormatBytes(total).c_str(), "");
    });
  }
  for (auto& t : threads) t.join();
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  finished = true;
  if (reporter.joinable()) reporter.join();
  for (Status& s : results) STRATA_RETURN_IF_ERROR(s);
  return static_cast<double>(per_file_bytes * files.size()) / secs;
}

// fio's command line: its arguments, and the same as one shell line (in
// --json and in errors, to run it by hand).
struct FioCommand {
  std::vector<std::string> argv;
  std::string text;
};

FioCommand MakeFioCommand(const NvmeArgs& a, const std::vector<std::string>& files,
                          uint64_t per_file_bytes, uint64_t block_bytes) {
  FioCommand c;
  c.argv = {"fio",
            "--output-format=json",
            fmt::format("--ioengine={}", a.backend == "uring" ? "io_uring" : "psync"),
            "--direct=1",
            fmt::format("--rw={}", a.op),
            fmt::format("--bs={}", block_bytes),
            fmt::format("--iodepth={}", a.qd),
            fmt::format("--size={}", per_file_bytes),
            "--group_reporting"};
  if (a.backend == "uring") {
    c.argv.push_back("--fixedbufs");
    c.argv.push_back("--registerfiles");
  }
  c.text = fmt::format("{}", fmt::join(c.argv, " "));
  for (size_t i = 0; i < files.size(); ++i) {
    // fio's own separator ':' escaped.
    std::string escaped;
    for (char ch : files[i]) {
      if (ch == ':') escaped += '\\';
      escaped += ch;
    }
    c.argv.push_back(fmt::format("--name=job{}", i));
    c.argv.push_back("--filename=" + escaped);
    c.text += fmt::format(" --name=job{} --filename={}", i, ShellQuote(escaped));
  }
  return c;
}

// Runs fio as a child of this process (not through a shell), so that a
// signal that ends the bench kills it before the test files are removed: a
// fio left running would re-create them. Its stderr is discarded.
Result<double> RunFio(const FioCommand& cmd, const std::string& op) {
  int fds[2];
  if (::pipe2(fds, O_CLOEXEC) != 0) return ErrnoError(errno, "run fio: pipe");
  const int null_fd = ::open("/dev/null", O_WRONLY | O_CLOEXEC);
  if (null_fd < 0) {
    const int err = errno;
    ::close(fds[0]);
    ::close(fds[1]);
    return ErrnoError(err, "run fio: open /dev/null");
  }
  CleanupScope fio;
  Result<pid_t> pid = fio.Spawn(cmd.argv, fds[1], null_fd);
  ::close(fds[1]);
  ::close(null_fd);
  if (!pid.ok()) {
    ::close(fds[0]);
    if (pid.status().code() == StatusCode::kNotFound) {
      return FailedPreconditionError(fmt::format(
          "run fio: {}; install the fio package (scripts/setup does) or leave out --vs-fio",
          pid.status().message()));
    }
    return std::move(pid).status().WithContext("run fio");
  }
  std::string out;
  char buf[4096];
  for (;;) {
    const ssize_t n = ::read(fds[0], buf, sizeof(buf));
    if (n > 0) {
      out.append(buf, static_cast<size_t>(n));
    } else if (n == 0 || errno != EINTR) {
      break;
    }
  }
  ::close(fds[0]);
  STRATA_ASSIGN_OR_RETURN(const int wait_status, fio.Wait(*pid));
  if (WIFSIGNALED(wait_status)) {
    return FailedPreconditionError(fmt::format("run `{}`: killed by signal {} ({})", cmd.text,
                                               WTERMSIG(wait_status),
                                               ::strsignal(WTERMSIG(wait_status))));
  }
  if (WEXITSTATUS(wait_status) != 0) {
    return FailedPreconditionError(
        fmt::format("run `{}`: exit status {} (its stderr is not shown: run the command by hand "
                    "to see why)",
                    cmd.text, WEXITSTATUS(wait_status)));
  }
  // fio may print notes before the JSON object.
  const size_t brace = out.find('{');
  nlohmann::json j =
      nlohmann::json::parse(brace == std::string::npos ? out : out.substr(brace), nullptr, false);
  if (j.is_discarded() || !j.contains("jobs") || j["jobs"].empty()) {
    return InternalError("parse fio's JSON output of `" + cmd.text + "`");
  }
  double bw = 0;
  // contains() before each const lookup: operator[] of a missing key is
  // undefined on a const object, and get<>() of a non-number throws.
  for (const auto& job : j["jobs"]) {
    if (!job.is_object() || !job.contains(op) || !job[op].is_object() ||
        !job[op].contains("bw_bytes") || !job[op]["bw_bytes"].is_number()) {
      return InternalError(
          fmt::format("fio's JSON output of `{}` has no jobs[].{}.bw_bytes", cmd.text, op));
    }
    bw += job[op]["bw_bytes"].get<double>();
  }
  return bw;
}

Status RunBenchNvme(const NvmeArgs& a) {
  std::vector<std::string> dirs = a.paths;
  if (dirs.empty()) dirs.push_back(a.dir);
  if (dirs.empty() || dirs[0].empty())
    return InvalidArgumentError(
        "no drive to measure: give --dir DIR (a directory on the drive, e.g. where "
        "nvme_path will point) or --paths DIR1,DIR2 (several drives, striped as the engine "
        "stripes them)");
  const char* option = a.paths.empty() ? "--dir" : "--paths";
  std::vector<std::pair<dev_t, ino_t>> seen;
  for (size_t i = 0; i < dirs.size(); ++i) {
    const std::string& d = dirs[i];
    struct stat st;
    if (::stat(d.c_str(), &st) != 0 || !S_ISDIR(st.st_mode)) {
      return InvalidArgumentError(fmt::format(
          "{} {}: not an existing directory; create it on the drive to measure", option, d));
    }
    // As the engine's nvme_path: the same directory twice (also spelled
    // "/d/" or through a symlink) would stripe two files onto one drive.
    const auto same = std::find(seen.begin(), seen.end(), std::pair(st.st_dev, st.st_ino));
    if (same != seen.end()) {
      const size_t j = static_cast<size_t>(same - seen.begin());
      return InvalidArgumentError(fmt::format(
          "--paths: {} and {} (entries {} and {}) are the same directory; each entry is a "
          "directory on its own drive, striped: list each once",
          dirs[j], d, j, i));
    }
    seen.emplace_back(st.st_dev, st.st_ino);
  }
  STRATA_ASSIGN_OR_RETURN(uint64_t size_bytes, ParseBytes(a.size));
  STRATA_ASSIGN_OR_RETURN(uint64_t block_bytes, ParseBytes(a.block));
  if (block_bytes == 0 || block_bytes % 4096 != 0) {
    return InvalidArgumentError(
        fmt::format("--block {}: must be a positive multiple of 4096 (O_DIRECT)", a.block));
  }
  if (a.qd == 0 || a.qd > 1024) return InvalidArgumentError("--qd must be 1..1024");
  if (a.repeat < 1) return InvalidArgumentError("--repeat must be at least 1");
  const uint64_t per_file_bytes = size_bytes / dirs.size() / block_bytes * block_bytes;
  if (per_file_bytes == 0) {
    return InvalidArgumentError(fmt::format("--size {}: smaller than one block per path", a.size));
  }
  const IoOp op = a.op == "read" ? IoOp::kRead : IoOp::kWrite;
  STRATA_RETURN_IF_ERROR(CheckProbeFits(dirs, 1, per_file_bytes, block_bytes, "--size",
                                        "give --dir a drive with more room"));

  STRATA_ASSIGN_OR_RETURN(
      auto storage, CreateStorage({.backend = a.backend == "posix" ? StorageBackend::kPosix
                                                                   : StorageBackend::kUring}));
  // Only for --buffers pinned; holds no memory otherwise.
  STRATA_ASSIGN_OR_RETURN(std::unique_ptr<Device> host, CreateHostDevice());
  CleanupScope test_files;  // removed afterwards, also on Ctrl-C
  std::vector<std::string> test_paths;
  std::vector<std::unique_ptr<File>> files;
  std::vector<std::unique_ptr<AlignedBuffers>> bufs;
  for (const std::string& d : dirs) {
    const std::string path = fmt::format("{}/strata-bench-nvme.{}.dat", d, ::getpid());
    test_files.AddFile(path);
    test_paths.push_back(path);
    STRATA_ASSIGN_OR_RETURN(auto f, storage->Open(path, {.create = FileCreate::kCreate,
                                                         .direct = DirectIo::kAuto,
                                                         .queue_depth = a.qd}));
    STRATA_ASSIGN_OR_RETURN(auto b, MakeIoBuffers(a.buffers, *host, a.qd, block_bytes));
    bufs.push_back(std::move(b));
    STRATA_RETURN_IF_ERROR(f->RegisterBuffers(bufs.back()->spans));
    bufs.back()->Fill();
    files.push_back(std::move(f));
  }
  const FileInfo& info = files[0]->info();
  std::fprintf(
      stderr,
      "bench nvme: %s %s sequential, %zu file(s) x %s, block %s, qd %u, %s backend (%s%s)\n",
      a.op.c_str(), info.io_mode == IoMode::kDirect ? "O_DIRECT" : "buffered", files.size(),
      FormatBytes(per_file_bytes).c_str(), FormatBytes(block_bytes).c_str(), a.qd,
      std::string(storage->name()).c_str(),
      info.fixed_buffers ? "fixed buffers" : "unregistered buffers",
      info.fixed_file ? ", registered file" : "");
  const double segments = MeanPhysicalSegments(bufs[0]->spans);
  if (segments > 0) {
    std::fprintf(stderr, "IO buffers: %.1f physically contiguous runs per %s buffer\n", segments,
                 FormatBytes(block_bytes).c_str());
  }
  // Lay the files out (also what the write test overwrites, as fio does).
  STRATA_RETURN_IF_ERROR(
      RunPass(files, IoOp::kWrite, per_file_bytes, block_bytes, a.qd, bufs, Progress::kShow)
          .status());
  for (auto& f : files) STRATA_RETURN_IF_ERROR(f->Sync());

  const FioCommand fio_cmd = MakeFioCommand(a, test_paths, per_file_bytes, block_bytes);
  // fio allocates its buffers anew in every run (a new process); with 4 KiB
  // pages their physical layout, and so the segments per request, is drawn
  // anew each time. --fresh-buffers does the same for the engine's side.
  const auto reallocate = [&]() -> Status {
    for (size_t f = 0; f < files.size(); ++f) {
      // The new buffers are taken before the old ones are freed: pages freed
      // just before would come straight back, in reverse order (the
      // allocator's per-CPU lists are LIFO), i.e. one segment per page.
      STRATA_ASSIGN_OR_RETURN(auto fresh, MakeIoBuffers(a.buffers, *host, a.qd, block_bytes));
      STRATA_RETURN_IF_ERROR(files[f]->RegisterBuffers(fresh->spans));
      fresh->Fill();
      bufs[f] = std::move(fresh);
    }
    return OkStatus();
  };
  std::vector<double> ours, fio, ours_segments;
  // Interleaved, and the order alternates so neither side always runs on a
  // drive (or host cache) the other just warmed.
  for (int i = 0; i < a.repeat; ++i) {
    double f = 0;
    const bool fio_first =
        a.vs_fio && (a.order == "fio-first" || (a.order == "alternate" && i % 2 == 1));
    if (a.fresh_buffers) STRATA_RETURN_IF_ERROR(reallocate());
    ours_segments.push_back(MeanPhysicalSegments(bufs[0]->spans));
    if (fio_first) {
      STRATA_ASSIGN_OR_RETURN(f, RunFio(fio_cmd, a.op));
    }
    STRATA_ASSIGN_OR_RETURN(
        double bw, RunPass(files, op, per_file_bytes, block_bytes, a.qd, bufs, Progress::kQuiet));
    ours.push_back(bw);
    if (a.vs_fio && !fio_first) {
      STRATA_ASSIGN_OR_RETURN(f, RunFio(fio_cmd, a.op));
    }
    std::fprintf(stderr, "  run %d: strata %s", i + 1, FormatRate(bw).c_str());
    if (ours_segments.back() > 0)
      std::fprintf(stderr, " (%.0f segments/block)", ours_segments.back());
    if (a.vs_fio) {
      fio.push_back(f);
      std::fprintf(stderr, ", fio %s", FormatRate(f).c_str());
    }
    std::fprintf(stderr, "\n");
  }
  const double best = *std::max_element(ours.begin(), ours.end());
  const double fio_best = fio.empty() ? 0 : *std::max_element(fio.begin(), fio.end());
  const double median = Median(ours);
  const double fio_median = Median(fio);
  if (a.json) {
    nlohmann::json j = {{"op", a.op},
                        {"paths", dirs},
                        {"size_bytes", per_file_bytes * files.size()},
                        {"block_bytes", block_bytes},
                        {"queue_depth", a.qd},
                        {"backend", std::string(storage->name())},
                        {"io_mode", info.io_mode == IoMode::kDirect ? "direct" : "buffered"},
                        {"fixed_buffers", info.fixed_buffers},
                        {"buffers", a.buffers},
                        {"buffer_segments_per_block", segments},
                        {"repeat", a.repeat},
                        {"order", a.vs_fio ? a.order : "none"},
                        {"fresh_buffers", a.fresh_buffers},
                        {"runs_segments_per_block", ours_segments},
                        {"median_bytes_per_sec", median},
                        {"bytes_per_sec", best},
                        {"runs_bytes_per_sec", ours}};
    if (a.vs_fio) {
      j["fio_bytes_per_sec"] = fio_best;
      j["fio_runs_bytes_per_sec"] = fio;
      j["ratio_to_fio"] = fio_best > 0 ? best / fio_best : 0.0;
      j["fio_median_bytes_per_sec"] = fio_median;
      j["ratio_to_fio_median"] = fio_median > 0 ? median / fio_median : 0.0;
      j["fio_command"] = fio_cmd.text;
    }
    PrintJson(j);
  } else {
    std::printf("nvme %s  block %s  qd %u  files %zu: strata %s (best of %d)", a.op.c_str(),
                FormatBytes(block_bytes).c_str(), a.qd, files.size(), FormatRate(best).c_str(),
                a.repeat);
    if (a.vs_fio) {
      std::printf("  fio %s  ratio %.3f (medians: %s vs %s, ratio %.3f)",
                  FormatRate(fio_best).c_str(), fio_best > 0 ? best / fio_best : 0.0,
                  FormatRate(median).c_str(), FormatRate(fio_median).c_str(),
                  fio_median > 0 ? median / fio_median : 0.0);
    }
    std::printf("\n");
  }
  return OkStatus();
}

}  // namespace

Result<uint64_t> ProbeRoom(std::span<const std::string> dirs, uint32_t files_per_dir,
                           uint64_t block_bytes) {
  // Free space and the number of directories, per filesystem.
  std::map<uint64_t, std::pair<uint64_t, uint64_t>> filesystems;
  for (const std::string& d : dirs) {
    const DirectoryProbe p = ProbeDirectory(d, DirectoryChecks::kSpace);
    if (!p.space.ok()) {
      return Status(p.space).WithContext(fmt::format("measure the drive under {}", d));
    }
    auto& [free, count] = filesystems[p.device_id];
    free = p.free_bytes;
    ++count;
  }
  uint64_t room = std::numeric_limits<uint64_t>::max();
  for (const auto& [id, fs] : filesystems) {
    room = std::min(room, fs.first / 10 * 9 / (files_per_dir * fs.second));
  }
  return room / block_bytes * block_bytes;
}

Status CheckProbeFits(std::span<const std::string> dirs, uint32_t files_per_dir,
                      uint64_t file_bytes, uint64_t block_bytes, std::string_view size_flag,
                      std::string_view other_way) {
  STRATA_ASSIGN_OR_RETURN(const uint64_t room, ProbeRoom(dirs, files_per_dir, block_bytes));
  if (file_bytes <= room) return OkStatus();
  const char* files = files_per_dir == 1 ? "a file" : "two files";
  return ResourceExhaustedError(fmt::format(
      "measure the drive under {}: {} of {} in each directory {} not fit (room for {} of {}, "
      "9/10 of the free space); free some space, {}or {}",
      fmt::join(dirs, ", "), files, FormatBytes(file_bytes), files_per_dir == 1 ? "does" : "do",
      files_per_dir == 1 ? "one" : "two",
      FormatBytes(room),
      room * dirs.size() >= kMiB
          ? fmt::format("give {} {}MiB or less, ", size_flag, room * dirs.size() / kMiB)
          : std::string(),
      other_way));
}

Result<std::optional<uint64_t>> ParseDriveProbe(std::string_view text) {
  if (text == "auto") return std::optional<uint64_t>();
  Result<uint64_t> b = ParseBytes(text);
  if (!b.ok()) {
    return InvalidArgumentError(fmt::format(
        "--drive-probe {}: give a size (256MiB, 1GiB), 0 to skip the drive baseline, or auto",
        text));
  }
  return std::optional<uint64_t>(*b);
}

Result<DriveRates> MeasureDriveRates(std::span<const std::string> dirs, uint64_t bytes_per_dir,
                                     uint64_t block_bytes, uint32_t queue_depth,
                                     std::string_view size_flag, std::string_view skip_hint) {
  if (dirs.empty()) return InvalidArgumentError("measure the drive: no directory");
  for (const std::string& d : dirs) {
    std::error_code ec;
    if (!std::filesystem::is_directory(d, ec)) {
      return FailedPreconditionError(fmt::format(
          "measure the drive under {}: not an existing directory; create it (mkdir -p) or give "
          "another",
          d));
    }
  }
  if (block_bytes == 0 || block_bytes % 4096 != 0) {
    return InvalidArgumentError(fmt::format(
        "measure the drive: block {} is not a positive multiple of 4096 (O_DIRECT)", block_bytes));
  }
  const uint64_t per_file = std::max(bytes_per_dir / block_bytes, uint64_t{1}) * block_bytes;
  // Refused before anything is written: a probe that fills the disk fails
  // half-way with ENOSPC and says nothing of its size.
  STRATA_RETURN_IF_ERROR(
      CheckProbeFits(dirs, 2, per_file, block_bytes, size_flag, skip_hint));
  // A 256 MiB region of buffers per file (at least one per request slot).
  const size_t probe_buffers =
      std::max<size_t>(queue_depth, std::min<uint64_t>(per_file, 256 * kMiB) / block_bytes);
  STRATA_ASSIGN_OR_RETURN(auto storage, CreateStorage({}));
  STRATA_ASSIGN_OR_RETURN(std::unique_ptr<Device> host, CreateHostDevice());
  CleanupScope test_files;  // removed afterwards, also on Ctrl-C
  // One file per directory, its buffers registered, laid out and synced.
  struct FileSet {
    std::vector<std::unique_ptr<File>> files;
    std::vector<std::unique_ptr<AlignedBuffers>> bufs;
    double new_synced_sec = 0;  // the first pass into the new files, and their fdatasync
    Result<double> Pass(IoOp op, uint64_t bytes, uint64_t block, uint32_t qd) {
      return RunPass(files, op, bytes, block, qd, bufs, Progress::kQuiet);
    }
  };
  auto open_set = [&](const char* name) -> Result<FileSet> {
    FileSet set;
    for (const std::string& d : dirs) {
      const std::string path = fmt::format("{}/strata-drive-probe.{}.{}", d, ::getpid(), name);
      test_files.AddFile(path);
      STRATA_ASSIGN_OR_RETURN(auto f, storage->Open(path, {.create = FileCreate::kCreate,
                                                           .direct = DirectIo::kAuto,
                                                           .queue_depth = queue_depth}));
      STRATA_ASSIGN_OR_RETURN(auto b, MakeIoBuffers("thp", *host, probe_buffers, block_bytes));
      STRATA_RETURN_IF_ERROR(f->RegisterBuffers(b->spans));
      b->Fill();
      set.bufs.push_back(std::move(b));
      set.files.push_back(std::move(f));
    }
    const auto start = std::chrono::steady_clock::now();
    STRATA_RETURN_IF_ERROR(set.Pass(IoOp::kWrite, per_file, block_bytes, queue_depth).status());
    for (auto& f : set.files) STRATA_RETURN_IF_ERROR(f->Sync());
    set.new_synced_sec =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    return set;
  };
  STRATA_ASSIGN_OR_RETURN(FileSet first, open_set("dat"));
  auto pass = [&](IoOp op) { return first.Pass(op, per_file, block_bytes, queue_depth); };
  DriveRates r{.bytes = per_file * first.files.size(),
               .direct = first.files[0]->info().io_mode == IoMode::kDirect};
  r.synced_write_bytes_per_sec = static_cast<double>(r.bytes) / first.new_synced_sec;
  STRATA_ASSIGN_OR_RETURN(r.write_bytes_per_sec, pass(IoOp::kWrite));
  for (auto& f : first.files) STRATA_RETURN_IF_ERROR(f->Sync());
  STRATA_ASSIGN_OR_RETURN(r.read_bytes_per_sec, pass(IoOp::kRead));
  // Mixed: the files are read while a second file per directory is written.
  STRATA_ASSIGN_OR_RETURN(FileSet second, open_set("w.dat"));
  Result<double> reads = 0.0;
  const auto t0 = std::chrono::steady_clock::now();
  std::thread reader([&] { reads = pass(IoOp::kRead); });
  Result<double> writes = second.Pass(IoOp::kWrite, per_file, block_bytes, queue_depth);
  reader.join();
  const double sec = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  STRATA_RETURN_IF_ERROR(reads.status());
  STRATA_RETURN_IF_ERROR(writes.status());
  r.mixed_bytes_per_sec = 2.0 * static_cast<double>(r.bytes) / sec;
  return r;
}

void AddBenchNvmeCommand(Cli& cli) {
  auto args = std::make_shared<NvmeArgs>();
  CLI::App* cmd =
      cli.bench->add_subcommand("nvme", "Sequential NVMe read/write throughput, optionally vs fio");
  auto* dir =
      cmd->add_option("--dir", args->dir, "Directory for the test file (removed afterwards)");
  auto* paths = cmd->add_option("--paths", args->paths,
                                "Directories, one per drive (striped), comma separated")
                    ->delimiter(',');
  dir->excludes(paths);
  paths->excludes(dir);
  cmd->add_option("--size", args->size, "Bytes moved per run, over all paths (e.g. 1GiB)")
      ->capture_default_str();
  cmd->add_option("--block", args->block, "Block (request) size, a multiple of 4096")
      ->capture_default_str();
  cmd->add_option("--qd", args->qd, "Requests in flight per file")
      ->capture_default_str()
      ->check(Within(1, 1024));
  cmd->add_option("--op", args->op, "read or write")
      ->capture_default_str()
      ->check(CLI::IsMember({"read", "write"}));
  cmd->add_option("--backend", args->backend, "uring or posix")
      ->capture_default_str()
      ->check(CLI::IsMember({"uring", "posix"}));
  cmd->add_option("--buffers", args->buffers,
                  "IO buffer memory: thp (transparent huge pages, fewer DMA segments), plain (4 "
                  "KiB pages, as fio uses) or pinned (the engine's PinnedPool: page-locked, "
                  "2 MiB-aligned slabs advised MADV_HUGEPAGE)")
      ->capture_default_str()
      ->check(CLI::IsMember({"thp", "plain", "pinned"}));
  cmd->add_option("--repeat", args->repeat, "Runs of each (best is reported)")
      ->capture_default_str()
      ->check(Within(1, 100));
  cmd->add_option("--order", args->order,
                  "With --vs-fio: alternate (strata first in odd runs, fio first in even runs), "
                  "strata-first or fio-first")
      ->capture_default_str()
      ->check(CLI::IsMember({"alternate", "strata-first", "fio-first"}));
  cmd->add_flag("--fresh-buffers", args->fresh_buffers,
                "Allocate and register new IO buffers before every run (as each fio run does)");
  cmd->add_flag("--vs-fio", args->vs_fio,
                "Also run fio with the same engine, file, size, block and depth");
  cmd->add_flag("--json", args->json, "Print one JSON object on stdout");
  cmd->callback([&cli, args] {
    RunAction(cli, "bench nvme", OutputOf(args->json), [args] { return RunBenchNvme(*args); });
  });
}

}  // namespace strata::cli
