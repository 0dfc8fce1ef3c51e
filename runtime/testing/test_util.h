// Helpers for storage tests: a temporary directory removed on destruction, a
// page-aligned buffer, a seeded byte pattern, and reading back what a test
// wrote (a whole file, a directory's names).
//
//   TempDir dir;                       // /tmp/strata-test-XXXXXX (or $TMPDIR)
//   AlignedBuffer buf(1 << 20);        // 4096-aligned, zeroed
//   AlignedBuffer big(size_t{1} << 30, 4096, BufferPages::kLazyHuge);  // untouched
//   FillPattern(buf.span(), seed);
#pragma once

#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <mutex>
#include <optional>
#include <random>
#include <span>
#include <sstream>
#include <string>
#include <vector>

#include "runtime/log.h"

namespace strata::testing {

class TempDir {
 public:
  explicit TempDir(const std::string& parent = "") {
    std::string base = parent;
    if (base.empty()) {
      const char* t = std::getenv("TMPDIR");
      base = (t != nullptr && t[0] != '\0') ? t : "/tmp";
    }
    std::string tmpl = base + "/strata-test-XXXXXX";
    if (::mkdtemp(tmpl.data()) != nullptr) path_ = tmpl;
  }
  ~TempDir() {
    if (path_.empty()) return;
    std::error_code ec;
    std::filesystem::remove_all(path_, ec);
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;

  bool ok() const { return !path_.empty(); }
  const std::string& path() const { return path_; }
  std::string File(const std::string& name) const { return path_ + "/" + name; }

 private:
  std::string path_;
};

// How an AlignedBuffer gets its pages.
enum class BufferPages : uint8_t {
  kZeroed,    // allocated and zero-filled (every page touched)
  kLazyHuge,  // anonymous mmap advised for transparent huge pages, not touched:
              // only what is used is faulted in (zeros), 2 MiB at a time
              // where the kernel offers huge pages; cheap for GiB buffers
};

class AlignedBuffer {
 public:
  explicit AlignedBuffer(size_t size_bytes, size_t alignment_bytes = 4096,
                         BufferPages pages = BufferPages::kZeroed)
      : size_(size_bytes), pages_(pages) {
    if (pages == BufferPages::kLazyHuge) {  // mmap is page-aligned
      void* p = mmap(nullptr, size_, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
      if (p == MAP_FAILED) std::abort();
      madvise(p, size_, MADV_HUGEPAGE);  // advice only: fine where refused
      data_ = static_cast<std::byte*>(p);
      return;
    }
    data_ = static_cast<std::byte*>(std::aligned_alloc(
        alignment_bytes, (size_bytes + alignment_bytes - 1) / alignment_bytes * alignment_bytes));
    std::memset(data_, 0, size_);
  }
  ~AlignedBuffer() {
    if (pages_ == BufferPages::kLazyHuge) {
      munmap(data_, size_);
    } else {
      std::free(data_);
    }
  }
  AlignedBuffer(const AlignedBuffer&) = delete;
  AlignedBuffer& operator=(const AlignedBuffer&) = delete;

  std::span<std::byte> span() { return {data_, size_}; }
  std::byte* data() { return data_; }
  size_t size() const { return size_; }

 private:
  size_t size_;
  BufferPages pages_;
  std::byte* data_ = nullptr;
};

inline void FillPattern(std::span<std::byte> out, uint64_t seed) {
  std::mt19937_64 rng(seed);
  size_t i = 0;
  for (; i + 8 <= out.size(); i += 8) {
    const uint64_t v = rng();
    std::memcpy(out.data() + i, &v, 8);
  }
  for (; i < out.size(); ++i) out[i] = static_cast<std::byte>(rng());
}

// The whole content of a file ("" when it cannot be read).
inline std::string ReadFileBytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// The names in a directory, sorted.
// A pid that was a process of this host and is no longer: a child that
// exited and was reaped (the kernel hands pids out in order, so it is not
// reused for a long while).
inline pid_t DeadPid() {
  const pid_t pid = ::fork();
  if (pid == 0) ::_exit(0);
  ::waitpid(pid, nullptr, 0);
  return pid;
}

inline std::vector<std::string> DirNames(const std::string& dir) {
  std::vector<std::string> out;
  for (const auto& e : std::filesystem::directory_iterator(dir)) {
    out.push_back(e.path().filename().string());
  }
  std::sort(out.begin(), out.end());
  return out;
}

// Runs `check` as a user whom file modes apply to: in this process when it
// is not root, else in a child switched to uid/gid 65534 (nobody), as
// EACCES tests need (root passes every permission check). `check` returns ""
// when its expectations held, else what failed. nullopt when the child could
// not switch users (skip the test).
inline std::optional<std::string> RunUnprivileged(const std::function<std::string()>& check) {
  if (::geteuid() != 0) return check();
  int fds[2];
  if (::pipe(fds) != 0) return "pipe failed";
  const pid_t pid = ::fork();
  if (pid == 0) {
    ::close(fds[0]);
    constexpr uid_t kNobody = 65534;
    if (::setgid(kNobody) != 0 || ::setuid(kNobody) != 0) ::_exit(100);
    const std::string failed = check();
    ssize_t written = 0;
    while (written < static_cast<ssize_t>(failed.size())) {
      const ssize_t n = ::write(fds[1], failed.data() + written, failed.size() - written);
      if (n <= 0) break;
      written += n;
    }
    ::_exit(0);
  }
  ::close(fds[1]);
  std::string failed;
  char buf[4096];
  for (ssize_t n; (n = ::read(fds[0], buf, sizeof(buf))) > 0;) failed.append(buf, n);
  ::close(fds[0]);
  int status = 0;
  if (::waitpid(pid, &status, 0) != pid || !WIFEXITED(status)) return "the child did not exit";
  if (WEXITSTATUS(status) == 100) return std::nullopt;
  return failed;
}

// Collects every log line at `level` and above while it lives; restores the
// previous sink and level after.
class LogCapture {
 public:
  explicit LogCapture(LogLevel level = LogLevel::kDebug) : level_(GetLogLevel()) {
    SetLogLevel(level);
    previous_ = SetLogSink([this](LogLevel l, std::string_view message) {
      std::lock_guard<std::mutex> lock(mu_);
      lines_.emplace_back(l, std::string(message));
    });
  }
  ~LogCapture() {
    SetLogSink(std::move(previous_));
    SetLogLevel(level_);
  }
  LogCapture(const LogCapture&) = delete;
  LogCapture& operator=(const LogCapture&) = delete;
  // The messages at `level` that contain `text`.
  std::vector<std::string> Find(LogLevel level, std::string_view text) {
    std::lock_guard<std::mutex> lock(mu_);
    std::vector<std::string> out;
    for (const auto& [l, m] : lines_) {
      if (l == level && m.find(text) != std::string::npos) out.push_back(m);
    }
    return out;
  }
  void Clear() {
    std::lock_guard<std::mutex> lock(mu_);
    lines_.clear();
  }

 private:
  LogLevel level_;
  LogSink previous_;
  std::mutex mu_;
  std::vector<std::pair<LogLevel, std::string>> lines_;
};

}  // namespace strata::testing
