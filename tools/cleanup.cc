#include "tools/cleanup.h"

#include <fmt/format.h>
#include <pthread.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <climits>
#include <cstdlib>
#include <cstring>
#include <iterator>

namespace strata::cli {
namespace {

// A slot of the table the handler reads. `state` is published last (release)
// so the handler never sees a path being written.
enum SlotState : int { kFree = 0, kWriting = 1, kFile = 2, kDir = 3, kProcess = 4 };
struct Slot {
  std::atomic<int> state{kFree};
  uint64_t order = 0;  // when it was added: directories go last added first
  pid_t pid = 0;       // kProcess
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

// Async-signal-safe: kill, waitpid and nanosleep. A child writing one of
// the files (fio) would re-create it after the unlink, so it goes first.
// SIGKILL ends a process only once its system call in flight returns (an
// open that creates the file, O_DIRECT writes): it is waited for, up to a
// second.
void KillChildren() {
  bool any = false;
  for (Slot& s : g_slots) {
    if (s.state.load(std::memory_order_acquire) != kProcess) continue;
    ::kill(s.pid, SIGKILL);
    any = true;
  }
  for (int i = 0; any && i < 100; ++i) {
    any = false;
    for (Slot& s : g_slots) {
      if (s.state.load(std::memory_order_acquire) == kProcess &&
          ::waitpid(s.pid, nullptr, WNOHANG) == 0) {
        any = true;
      }
    }
    const timespec ten_ms{0, 10'000'000};
    if (any) ::nanosleep(&ten_ms, nullptr);
  }
}

// Async-signal-safe: kill, waitpid, nanosleep, truncate, unlink and rmdir
// only (system calls).
void RemoveEverything() {
  KillChildren();
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

// The thread that made the outermost scope: the command's, which adds the
// paths and makes the files.
pthread_t g_owner;

void OnSignal(int sig) {
  // Only on the command's own thread, which adds no path and makes no file
  // while the handler removes them. Run on another thread, the handler
  // raced the command: a file made after its pass was left behind.
  // (pthread_self and pthread_kill are async-signal-safe.)
  if (!::pthread_equal(::pthread_self(), g_owner)) {
    ::pthread_kill(g_owner, sig);
    return;
  }
  RemoveEverything();
  ::signal(sig, SIG_DFL);
  ::raise(sig);
}

int Claim(const std::string& path, SlotState kind, pid_t pid = 0) {
  if (path.size() >= PATH_MAX) return -1;
  for (int i = 0; i < kMaxCleanupPaths; ++i) {
    int expected = kFree;
    if (!g_slots[i].state.compare_exchange_strong(expected, kWriting)) continue;
    std::memcpy(g_slots[i].path, path.c_str(), path.size() + 1);
    g_slots[i].pid = pid;
    g_slots[i].order = g_next_order.fetch_add(1);
    g_slots[i].state.store(kind, std::memory_order_release);
    return i;
  }
  return -1;
}

// `name` looked up on PATH as execvp would, in the parent: between fork and
// exec a child of a threaded process may call only async-signal-safe
// functions, which execvp is not.
Result<std::string> FindOnPath(const std::string& name) {
  const char* env = std::getenv("PATH");
  const std::string path = env != nullptr ? env : "/usr/local/bin:/usr/bin:/bin";
  for (size_t begin = 0; begin <= path.size();) {
    size_t end = path.find(':', begin);
    if (end == std::string::npos) end = path.size();
    const std::string dir = end == begin ? "." : path.substr(begin, end - begin);
    const std::string candidate = dir + "/" + name;
    struct stat st;
    if (::stat(candidate.c_str(), &st) == 0 && S_ISREG(st.st_mode) &&
        ::access(candidate.c_str(), X_OK) == 0) {
      return candidate;
    }
    begin = end + 1;
  }
  return NotFoundError(fmt::format("{}: not found on PATH ({})", name, path));
}

// Kills and reaps a child of this process.
void KillAndReap(pid_t pid) {
  ::kill(pid, SIGKILL);
  while (::waitpid(pid, nullptr, 0) < 0 && errno == EINTR) {
  }
}

}  // namespace

CleanupScope::CleanupScope() {
  if (g_scopes++ > 0) return;
  g_owner = ::pthread_self();
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
  // Children still running first (an error ended the command before their
  // Wait), then files, then directories, the last added first. A slot is
  // freed only after its path is gone: a signal in between removes it again
  // (ENOENT, harmless) rather than not at all.
  for (Kind pass : {Kind::kProcess, Kind::kFile, Kind::kDir}) {
    for (auto it = entries_.rbegin(); it != entries_.rend(); ++it) {
      if (it->kind != pass) continue;
      if (pass == Kind::kProcess) {
        KillAndReap(it->pid);
      } else if (pass == Kind::kFile) {
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
  entries_.push_back({path, kind, Claim(path, kind == Kind::kFile ? kFile : kDir), 0});
}

void CleanupScope::Keep(const std::string& path) {
  const auto it = std::find_if(entries_.begin(), entries_.end(), [&](const Entry& e) {
    return e.kind != Kind::kProcess && e.path == path;
  });
  if (it == entries_.end()) return;
  if (it->slot >= 0) g_slots[it->slot].state.store(kFree, std::memory_order_release);
  entries_.erase(it);
}

Result<pid_t> CleanupScope::Spawn(const std::vector<std::string>& argv, int stdout_fd,
                                  int stderr_fd) {
  STRATA_CHECK(!argv.empty()) << "Spawn of an empty command";
  std::string exe = argv[0];
  if (exe.find('/') == std::string::npos) {
    STRATA_ASSIGN_OR_RETURN(exe, FindOnPath(exe));
  }
  std::vector<char*> args;
  for (const std::string& a : argv) args.push_back(const_cast<char*>(a.c_str()));
  args.push_back(nullptr);
  // Signals are held until the child is listed, so a handler that runs on
  // this thread kills it; in the child they are held until their handlers
  // are back to the default (ours would remove the parent's files).
  sigset_t all, old;
  sigfillset(&all);
  ::pthread_sigmask(SIG_SETMASK, &all, &old);
  const pid_t parent = ::getpid();
  const pid_t pid = ::fork();
  if (pid == 0) {
    for (int sig : kSignals) {
      struct sigaction cur {};
      if (::sigaction(sig, nullptr, &cur) == 0 && cur.sa_handler != SIG_IGN) {
        ::signal(sig, SIG_DFL);
      }
    }
    // SIGKILL'ed, the command cannot kill the child: the kernel does.
    ::prctl(PR_SET_PDEATHSIG, SIGKILL);
    if (::getppid() != parent) ::_exit(127);  // the parent is already gone
    if (::dup2(stdout_fd, STDOUT_FILENO) < 0 || ::dup2(stderr_fd, STDERR_FILENO) < 0) {
      ::_exit(127);
    }
    ::sigprocmask(SIG_SETMASK, &old, nullptr);
    ::execv(exe.c_str(), args.data());
    ::_exit(127);
  }
  const int err = errno;
  if (pid > 0) entries_.push_back({exe, Kind::kProcess, Claim(exe, kProcess, pid), pid});
  ::pthread_sigmask(SIG_SETMASK, &old, nullptr);
  if (pid < 0) return ErrnoError(err, "start " + exe);
  return pid;
}

Result<int> CleanupScope::Wait(pid_t pid) {
  const auto it = std::find_if(entries_.begin(), entries_.end(), [&](const Entry& e) {
    return e.kind == Kind::kProcess && e.pid == pid;
  });
  STRATA_CHECK(it != entries_.end()) << "Wait for process " << pid << " that Spawn did not start";
  // Waited for without reaping first: as long as it is listed, the pid must
  // stay this child's (a reaped pid may be given to another process).
  siginfo_t info;
  while (::waitid(P_PID, static_cast<id_t>(pid), &info, WEXITED | WNOWAIT) != 0 && errno == EINTR) {
  }
  if (it->slot >= 0) g_slots[it->slot].state.store(kFree, std::memory_order_release);
  entries_.erase(it);
  int status = 0;
  while (::waitpid(pid, &status, 0) < 0) {
    if (errno != EINTR) return ErrnoError(errno, fmt::format("wait for process {}", pid));
  }
  return status;
}

}  // namespace strata::cli
