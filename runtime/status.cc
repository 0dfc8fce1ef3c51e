#include "runtime/status.h"

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>

namespace strata {

std::string_view StatusCodeName(StatusCode code) {
  switch (code) {
    case StatusCode::kOk: return "OK";
    case StatusCode::kCancelled: return "Cancelled";
    case StatusCode::kInvalidArgument: return "InvalidArgument";
    case StatusCode::kNotFound: return "NotFound";
    case StatusCode::kResourceExhausted: return "ResourceExhausted";
    case StatusCode::kFailedPrecondition: return "FailedPrecondition";
    case StatusCode::kOutOfRange: return "OutOfRange";
    case StatusCode::kUnimplemented: return "Unimplemented";
    case StatusCode::kInternal: return "Internal";
    case StatusCode::kUnavailable: return "Unavailable";
    case StatusCode::kDataLoss: return "DataLoss";
  }
  return "Unknown";
}

Status::Status(StatusCode code, std::string message) {
  if (code != StatusCode::kOk) rep_ = std::make_shared<const Rep>(Rep{code, std::move(message)});
}

std::string Status::ToString() const {
  if (ok()) return "OK";
  std::string s(StatusCodeName(code()));
  s += ": ";
  s += message();
  return s;
}

Status Status::WithContext(std::string_view context) const& { return Status(*this).WithContext(context); }

Status Status::WithContext(std::string_view context) && {
  if (ok() || context.empty()) return std::move(*this);
  std::string m(context);
  m += ": ";
  m += message();
  return Status(code(), std::move(m));
}

std::ostream& operator<<(std::ostream& os, const Status& s) { return os << s.ToString(); }

Status CancelledError(std::string m) { return Status(StatusCode::kCancelled, std::move(m)); }
Status InvalidArgumentError(std::string m) { return Status(StatusCode::kInvalidArgument, std::move(m)); }
Status NotFoundError(std::string m) { return Status(StatusCode::kNotFound, std::move(m)); }
Status OutOfRangeError(std::string m) { return Status(StatusCode::kOutOfRange, std::move(m)); }
Status ResourceExhaustedError(std::string m) {
  return Status(StatusCode::kResourceExhausted, std::move(m));
}
Status FailedPreconditionError(std::string m) {
  return Status(StatusCode::kFailedPrecondition, std::move(m));
}
Status UnimplementedError(std::string m) { return Status(StatusCode::kUnimplemented, std::move(m)); }
Status InternalError(std::string m) { return Status(StatusCode::kInternal, std::move(m)); }
Status UnavailableError(std::string m) { return Status(StatusCode::kUnavailable, std::move(m)); }
Status DataLossError(std::string m) { return Status(StatusCode::kDataLoss, std::move(m)); }

StatusCode ErrnoToCode(int err) {
  switch (err) {
    case 0: return StatusCode::kOk;
    case ENOENT:
    case ENODEV:
    case ENXIO: return StatusCode::kNotFound;
    case ENOSPC:
    case ENOMEM:
    case EDQUOT:
    case EFBIG:
    case EMFILE:
    case ENFILE: return StatusCode::kResourceExhausted;
    case EINTR:
    case EAGAIN:
    case EBUSY: return StatusCode::kUnavailable;
    case EINVAL:
    case ENAMETOOLONG:
    case EBADF:
    case EISDIR:
    case ENOTDIR: return StatusCode::kInvalidArgument;
    case EACCES:
    case EPERM:
    case EROFS:
    case EEXIST: return StatusCode::kFailedPrecondition;
    case ECANCELED: return StatusCode::kCancelled;
    case ENOSYS:
    case EOPNOTSUPP: return StatusCode::kUnimplemented;
    default: return StatusCode::kInternal;
  }
}

std::string_view ErrnoName(int err) {
  // strerrorname_np is glibc >= 2.32 (Debian 12 has 2.36).
  if (const char* name = strerrorname_np(err)) return name;
  return "errno";
}

Status ErrnoError(int err, std::string_view op) {
  std::string name(ErrnoName(err));
  if (name == "errno") name.append(" ").append(std::to_string(err));
  std::string m;
  m.append(op).append(": ").append(name).append(" (").append(std::strerror(err)).append(")");
  StatusCode code = ErrnoToCode(err);
  if (code == StatusCode::kOk) code = StatusCode::kInternal;
  return Status(code, std::move(m));
}

namespace internal {

void DieOnBadResultAccess(const Status& status) {
  std::fprintf(stderr, "strata: value() of a failed Result: %s\n", status.ToString().c_str());
  std::fflush(stderr);
  std::abort();
}

CheckFailure::CheckFailure(const char* file, int line, const char* condition) {
  stream_ << file << ":" << line << ": STRATA_CHECK(" << condition << ") failed: ";
}

CheckFailure::~CheckFailure() {
  std::string m = stream_.str();
  std::fprintf(stderr, "strata: %s\n", m.c_str());
  std::fflush(stderr);
  std::abort();
}

}  // namespace internal
}  // namespace strata
