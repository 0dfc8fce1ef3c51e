// What a command creates and removes when it is done (benchmark files, the
// state store's files, a temporary directory), removed also when SIGINT,
// SIGTERM, SIGHUP or SIGPIPE ends the process (one the process was started
// ignoring stays ignored), so that an interrupted benchmark leaves nothing
// behind.
//
//   CleanupScope cleanup;               // handlers installed while one lives
//   cleanup.AddDir("/var/tmp/x");       // rmdir'ed once its files are gone
//   cleanup.AddFile("/var/tmp/x/a.dat");
//   ...                                 // Ctrl-C here: a.dat and x are removed,
//                                       // then the signal ends the process
//   // ~CleanupScope: the same, without the signal
//
// The handler runs only unlink, rmdir, signal and raise (async-signal-safe) on
// fixed-size copies of the paths made when they were added, at most
// kMaxCleanupPaths of them (one that does not fit is still removed by the
// destructor). Scopes nest (the drive probe's files inside bench step's
// scope); every file of every live scope goes first, then the directories,
// the last added first. Add paths from one thread at a time; the handler may
// run on any thread.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

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

 private:
  enum class Kind : uint8_t { kFile, kDir };
  void Add(const std::string& path, Kind kind);

  struct Entry {
    std::string path;
    Kind kind;
    int slot;  // in the handler's table, or -1 when it was full
  };
  std::vector<Entry> entries_;
};

}  // namespace strata::cli
