// FileLock: an exclusive, advisory lock on a lock file, so that two users of
// one directory (two runs pointed at the same nvme_path, two optimizers of
// one process, two jobs saving into one checkpoint directory) find out
// instead of overwriting each other's files.
//
//   STRATA_ASSIGN_OR_RETURN(FileLock lock, FileLock::Acquire("/nvme/strata-rank0.lock"));
//   ... the files the lock guards are ours until `lock` is destroyed ...
//
// Mechanism: flock(LOCK_EX | LOCK_NB) on the lock file (created, mode 0644,
// when missing), which then holds the holder's pid as text. flock locks
// belong to an open file description, so a second Acquire of the same path
// conflicts even inside one process, and the kernel drops the lock when the
// holder exits or is killed: a lock file left by a dead process never
// blocks. The lock file itself is never removed (removing it would let two
// processes hold locks on two different inodes of one name).
//
// A filesystem without flock (ENOLCK/EOPNOTSUPP: some network mounts) gives
// an unguarded FileLock and one warning, rather than failing every run there.
//
// Errors: FailedPrecondition when another holder has it, naming the path and
// the holder's pid ("held by process 4242", or "held by this process";
// LockHeldByAnother tells it apart); NotFound when the directory is missing;
// the errno of open/flock otherwise, with the reason and what to do when the
// lock file cannot be created or opened for writing (EACCES, EPERM, EROFS:
// FailedPrecondition too, but no holder: a writable directory is the fix).
// Never blocks. Thread-safe (a FileLock is a value; Acquire may run
// concurrently from several threads). Locks on NFS work where the kernel
// maps flock to fcntl locks (Linux >= 2.6.12).
//
// fork(): a child closes its copies of this process's lock descriptors at
// once (a copy would hold the lock until the child exits), and the
// FileLock values it inherited release nothing; the parent's locks are
// unchanged.
#pragma once

#include <sys/types.h>

#include <string>
#include <string_view>

#include "runtime/status.h"

namespace strata {

// In the message of every lock error that means another holder has the lock
// (FileLock, and Storage::Lock of every backend).
inline constexpr std::string_view kLockHeldText = ": held by ";

// Whether `status` (of FileLock::Acquire or Storage::Lock, with any context)
// says another holder has the lock, as opposed to a lock file that could not
// be made or opened (EACCES, EROFS), which is FailedPrecondition as well.
inline bool LockHeldByAnother(const Status& status) {
  return status.code() == StatusCode::kFailedPrecondition &&
         status.message().find(kLockHeldText) != std::string_view::npos;
}

class FileLock {
 public:
  static Result<FileLock> Acquire(const std::string& path);

  FileLock() = default;
  FileLock(FileLock&& other) noexcept;
  FileLock& operator=(FileLock&& other) noexcept;
  FileLock(const FileLock&) = delete;
  FileLock& operator=(const FileLock&) = delete;
  ~FileLock();  // releases the lock

  bool held() const { return fd_ >= 0; }
  const std::string& path() const { return path_; }

 private:
  FileLock(int fd, std::string path);
  int fd_ = -1;
  pid_t owner_ = 0;  // the process that acquired it
  std::string path_;
};

}  // namespace strata
