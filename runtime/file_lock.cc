#include "runtime/file_lock.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <sys/file.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <mutex>
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

}  // namespace

Result<FileLock> FileLock::Acquire(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
  if (fd < 0) {
    const int err = errno;
    if (err == ENOENT) {
      return NotFoundError(
          fmt::format("lock {}: its directory does not exist; create it first", path));
    }
    return ErrnoError(err, "lock " + path);
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
    return FailedPreconditionError(fmt::format("lock {}: held by {}", path, holder));
  }
  // Ours now: record who holds it, for the next one who asks.
  const std::string text = fmt::format("{}\n", static_cast<long>(::getpid()));
  if (::ftruncate(fd, 0) != 0 ||
      ::pwrite(fd, text.data(), text.size(), 0) != static_cast<ssize_t>(text.size())) {
    const int err = errno;
    ::close(fd);
    return ErrnoError(err, "lock " + path + ": write the holder's pid");
  }
  return FileLock(fd, path);
}

FileLock::FileLock(FileLock&& other) noexcept
    : fd_(std::exchange(other.fd_, -1)), path_(std::move(other.path_)) {}

FileLock& FileLock::operator=(FileLock&& other) noexcept {
  if (this != &other) {
    if (fd_ >= 0) ::close(fd_);
    fd_ = std::exchange(other.fd_, -1);
    path_ = std::move(other.path_);
  }
  return *this;
}

FileLock::~FileLock() {
  // Closing the last descriptor of the open file description releases the lock.
  if (fd_ >= 0) ::close(fd_);
}

}  // namespace strata
