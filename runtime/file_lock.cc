#include "runtime/file_lock.h"

#include <fcntl.h>
#include <pthread.h>
#include <fmt/format.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <mutex>
#include <set>
#include <utility>

#include "runtime/log.h"

namespace strata {
namespace {

// The pid the holder wrote, or 0 when the file holds none (yet).
long ReadHolderPid(int fd) {
  char buf[32] = {};
  const ssize_t n = ::pread(fd, buf, sizeof(buf) - 1, 0);
  if (n <= 0) return 0;
  char* end = nullptr;
  const long pid = std::strtol(buf, &end, 10);
  return end != buf && pid > 0 ? pid : 0;
}

// The descriptors of the locks this process holds. fork() duplicates them,
// and a child's copy keeps the lock (flock belongs to the open file
// description) until the child exits: a DataLoader worker forked after an
// optimizer was built held the optimizer's nvme_path after its close(). A
// child closes its copies at once; its FileLock values, the parent's, then
// leave the descriptor numbers alone (they may be reused by then).
std::mutex& HeldMutex() {
  static auto* mu = new std::mutex;  // never destroyed: fork may run at exit
  return *mu;
}
std::set<int>& Held() {
  static auto* held = new std::set<int>;
  return *held;
}

void RegisterHeld(int fd) {
  static std::once_flag installed;
  std::call_once(installed, [] {
    // The forking thread holds the mutex across fork(), so the child sees
    // the set whole; the child is single-threaded when it closes them.
    ::pthread_atfork([] { HeldMutex().lock(); }, [] { HeldMutex().unlock(); },
                     [] {
                       for (int fd : Held()) ::close(fd);
                       Held().clear();
                       HeldMutex().unlock();
                     });
  });
  std::lock_guard lock(HeldMutex());
  Held().insert(fd);
}

// Closes `fd` if this process opened it (not in a forked child, which
// closed its copy already).
void Release(int fd, pid_t owner) {
  if (fd < 0 || owner != ::getpid()) return;
  {
    std::lock_guard lock(HeldMutex());
    Held().erase(fd);
  }
  ::close(fd);
}

}  // namespace

Result<FileLock> FileLock::Acquire(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
  if (fd < 0) {
    const int err = errno;
    if (err == ENOENT) {
      return NotFoundError(
          fmt::format("lock {}: its directory does not exist; create it first", path));
    }
    // Not a holder's doing (that is flock's EWOULDBLOCK below): the file
    // cannot be made or opened for writing.
    const std::string dir = path.substr(0, path.find_last_of('/') + 1);
    struct stat st {};
    const bool exists = ::lstat(path.c_str(), &st) == 0;
    std::string fix;
    if (err == EROFS) {
      fix = fmt::format("{} is on a read-only filesystem; give a directory on a writable one", dir);
    } else if (err == EACCES || err == EPERM) {
      fix = exists ? fmt::format(
                         "the lock file exists and this user (uid {}) may not write it (it is "
                         "uid {}'s, mode {:o}); give a directory of your own, or remove the file "
                         "when no process of its owner uses the directory",
                         ::geteuid(), st.st_uid, st.st_mode & 07777)
                   : fmt::format(
                         "this user (uid {}) may not create files in {}; give a directory it "
                         "can write",
                         ::geteuid(), dir);
    } else {
      fix = fmt::format("the lock file cannot be {}; give a writable directory",
                        exists ? "opened for writing" : "created");
    }
    const Status cause = ErrnoError(err, "lock " + path);
    return Status(cause.code(), fmt::format("{}: {}", cause.message(), fix));
  }
  if (::flock(fd, LOCK_EX | LOCK_NB) != 0) {
    const int err = errno;
    if (err == ENOLCK || err == EOPNOTSUPP) {
      // A filesystem without locks (some network mounts): work on, unguarded.
      static std::once_flag warned;
      std::call_once(warned, [&] {
        LogWarning(fmt::format("lock {}: the filesystem does not support flock ({}); two users "
                               "of one directory there are not detected",
                               path, ErrnoName(err)));
      });
      RegisterHeld(fd);
      return FileLock(fd, path);
    }
    const long pid = err == EWOULDBLOCK ? ReadHolderPid(fd) : 0;
    ::close(fd);
    if (err != EWOULDBLOCK) return ErrnoError(err, "lock " + path);
    std::string holder = "another user (its pid is not recorded yet)";
    if (pid == static_cast<long>(::getpid())) {
      holder = fmt::format("this process (pid {})", pid);
    } else if (pid > 0) {
      holder = fmt::format("process {}", pid);
    }
    return FailedPreconditionError(fmt::format("lock {}{}{}", path, kLockHeldText, holder));
  }
  // Ours now: record who holds it, for the next one who asks.
  const std::string text = fmt::format("{}\n", static_cast<long>(::getpid()));
  if (::ftruncate(fd, 0) != 0 ||
      ::pwrite(fd, text.data(), text.size(), 0) != static_cast<ssize_t>(text.size())) {
    const int err = errno;
    ::close(fd);
    return ErrnoError(err, "lock " + path + ": write the holder's pid");
  }
  RegisterHeld(fd);
  return FileLock(fd, path);
}

FileLock::FileLock(int fd, std::string path)
    : fd_(fd), owner_(::getpid()), path_(std::move(path)) {}

FileLock::FileLock(FileLock&& other) noexcept
    : fd_(std::exchange(other.fd_, -1)), owner_(other.owner_), path_(std::move(other.path_)) {}

FileLock& FileLock::operator=(FileLock&& other) noexcept {
  if (this != &other) {
    Release(fd_, owner_);
    fd_ = std::exchange(other.fd_, -1);
    owner_ = other.owner_;
    path_ = std::move(other.path_);
  }
  return *this;
}

FileLock::~FileLock() {
  // Closing the last descriptor of the open file description releases the lock.
  Release(fd_, owner_);
}

}  // namespace strata
