// What a command creates and removes when it is done (benchmark files, the
// state store's files, a temporary directory, a child process such as fio),
// removed also when SIGINT, SIGTERM, SIGHUP or SIGPIPE ends the process (one
// the process was started ignoring stays ignored), so that an interrupted
// benchmark leaves nothing behind.
//
//   CleanupScope cleanup;               // handlers installed while one lives
//   cleanup.AddDir("/var/tmp/x");       // rmdir'ed once its files are gone
//   cleanup.AddFile("/var/tmp/x/a.dat");
//   ...                                 // Ctrl-C here: a.dat and x are removed,
//                                       // then the signal ends the process
//   // ~CleanupScope: the same, without the signal
//
//   // A child that writes a.dat: killed before a.dat is removed (it would
//   // re-create it), and with the command even when SIGKILL ends it.
//   STRATA_ASSIGN_OR_RETURN(pid_t pid, cleanup.Spawn({"fio", "--name=x"}, pipe_fd, null_fd));
//   ...                                 // read its output
//   STRATA_ASSIGN_OR_RETURN(int wait_status, cleanup.Wait(pid));
//
// The handler runs only kill, waitpid, nanosleep, truncate, unlink, rmdir,
// signal and raise (async-signal-safe) on fixed-size copies of the paths and
// pids made when they were added, at most kMaxCleanupPaths of them (a path
// that does not fit is still removed by the destructor). Scopes nest (the
// drive probe's files inside bench step's scope); the child processes of
// every live scope are killed first (SIGKILL, then waited for up to a
// second), then every file goes, then the directories, the last added first.
// The handler runs on the thread that made the outermost scope (the
// command's): a signal another thread receives is passed on to it, so that
// thread adds no path and makes no file while the handler removes them.
// Paths added from other threads (under the caller's lock) can still race it.
#pragma once

#include <sys/types.h>

#include <cstdint>
#include <string>
#include <vector>

#include "runtime/status.h"

namespace strata::cli {

inline constexpr int kMaxCleanupPaths = 512;

class CleanupScope {
 public:
  CleanupScope();
  ~CleanupScope();
  CleanupScope(const CleanupScope&) = delete;
  CleanupScope& operator=(const CleanupScope&) = delete;

  void AddFile(const std::string& path);
  // Removed after the files, and only when empty (rmdir).
  void AddDir(const std::string& path);
  // No longer removed, neither by a signal nor by the destructor: a file
  // that is gone (a temporary renamed over its target) or that the command
  // keeps after all. A path that was not added is ignored.
  void Keep(const std::string& path);

  // Starts argv (argv[0] without a '/' is looked up on PATH) as a child
  // process with `stdout_fd` and `stderr_fd` as its stdout and stderr. Until
  // Wait, a signal that ends the command kills it (SIGKILL) before any file
  // is removed, and so does the destructor; the child also gets SIGKILL when
  // this thread ends (PR_SET_PDEATHSIG: a SIGKILL'ed command). NotFound when
  // argv[0] is not on PATH; the errno of fork or pipe otherwise. A child
  // whose exec fails exits 127.
  Result<pid_t> Spawn(const std::vector<std::string>& argv, int stdout_fd, int stderr_fd);
  // Waits for a child started by Spawn and returns its wait status
  // (WIFEXITED, WEXITSTATUS...). It is no longer killed on a signal from
  // here on (its pid may then be reused by another process).
  Result<int> Wait(pid_t pid);

 private:
  enum class Kind : uint8_t { kFile, kDir, kProcess };
  void Add(const std::string& path, Kind kind);

  struct Entry {
    std::string path;
    Kind kind;
    int slot;   // in the handler's table, or -1 when it was full
    pid_t pid;  // kProcess
  };
  std::vector<Entry> entries_;
};

}  // namespace strata::cli
