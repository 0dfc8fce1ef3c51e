#include "tools/cleanup.h"

#include <signal.h>
#include <unistd.h>

#include <atomic>
#include <climits>
#include <cstring>
#include <iterator>

namespace strata::cli {
namespace {

// A slot of the table the handler reads. `state` is published last (release)
// so the handler never sees a path being written.
enum SlotState : int { kFree = 0, kWriting = 1, kFile = 2, kDir = 3 };
struct Slot {
  std::atomic<int> state{kFree};
  uint64_t order = 0;  // when it was added: directories go last added first
  char path[PATH_MAX];
};
static_assert(std::atomic<int>::is_always_lock_free, "the handler reads the slots");

Slot g_slots[kMaxCleanupPaths];
std::atomic<uint64_t> g_next_order{1};
int g_scopes = 0;  // live scopes; the handlers are installed while > 0
// The signals that end a command whose files must go: Ctrl-C, kill, a closed
// terminal or SSH session, output piped into a reader that quit (`| head`).
constexpr int kSignals[] = {SIGINT, SIGTERM, SIGHUP, SIGPIPE};
struct sigaction g_old[std::size(kSignals)];

// A file's blocks go back to the filesystem when its last reference does:
// an io_uring instance (its registered files, requests in flight) lets go of
// its references some time after it is closed, so an unlinked file would
// hold its space a while longer, and a command that measures the free space
// next (the engine's preflight after bench step's drive probe) would see it
// taken. Truncating first frees the blocks at once.
void Remove(const char* path) {
  ::truncate(path, 0);
  ::unlink(path);
}

// Async-signal-safe: truncate, unlink and rmdir only (system calls).
void RemoveEverything() {
  for (Slot& s : g_slots) {
    if (s.state.load(std::memory_order_acquire) == kFile) Remove(s.path);
  }
  uint64_t below = UINT64_MAX;
  for (;;) {
    Slot* last = nullptr;
    for (Slot& s : g_slots) {
      if (s.state.load(std::memory_order_acquire) == kDir && s.order < below &&
          (last == nullptr || s.order > last->order)) {
        last = &s;
      }
    }
    if (last == nullptr) return;
    ::rmdir(last->path);
    below = last->order;
  }
}

void OnSignal(int sig) {
  RemoveEverything();
  ::signal(sig, SIG_DFL);
  ::raise(sig);
}

int Claim(const std::string& path, SlotState kind) {
  if (path.size() >= PATH_MAX) return -1;
  for (int i = 0; i < kMaxCleanupPaths; ++i) {
    int expected = kFree;
    if (!g_slots[i].state.compare_exchange_strong(expected, kWriting)) continue;
    std::memcpy(g_slots[i].path, path.c_str(), path.size() + 1);
    g_slots[i].order = g_next_order.fetch_add(1);
    g_slots[i].state.store(kind, std::memory_order_release);
    return i;
  }
  return -1;
}

}  // namespace

CleanupScope::CleanupScope() {
  if (g_scopes++ > 0) return;
  struct sigaction sa {};
  sa.sa_handler = OnSignal;
  sigemptyset(&sa.sa_mask);
  for (size_t i = 0; i < std::size(kSignals); ++i) {
    ::sigaction(kSignals[i], nullptr, &g_old[i]);
    // One the process was started ignoring (nohup's SIGHUP, a background
    // job's SIGINT) stays ignored: it does not end the command.
    if (g_old[i].sa_handler != SIG_IGN) ::sigaction(kSignals[i], &sa, nullptr);
  }
}

CleanupScope::~CleanupScope() {
  // Files first, then directories, the last added first. A slot is freed
  // only after its path is gone: a signal in between removes it again
  // (ENOENT, harmless) rather than not at all.
  for (Kind pass : {Kind::kFile, Kind::kDir}) {
    for (auto it = entries_.rbegin(); it != entries_.rend(); ++it) {
      if (it->kind != pass) continue;
      if (pass == Kind::kFile) {
        Remove(it->path.c_str());
      } else {
        ::rmdir(it->path.c_str());
      }
      if (it->slot >= 0) g_slots[it->slot].state.store(kFree, std::memory_order_release);
    }
  }
  if (--g_scopes > 0) return;
  for (size_t i = 0; i < std::size(kSignals); ++i) ::sigaction(kSignals[i], &g_old[i], nullptr);
}

void CleanupScope::AddFile(const std::string& path) { Add(path, Kind::kFile); }
void CleanupScope::AddDir(const std::string& path) { Add(path, Kind::kDir); }

void CleanupScope::Add(const std::string& path, Kind kind) {
  entries_.push_back({path, kind, Claim(path, kind == Kind::kFile ? kFile : kDir)});
}

}  // namespace strata::cli
