// Status and Result<T>: how every fallible Strata operation reports failure.
//
// Runtime failures (IO, out of memory, CUDA, NCCL, bad input) return a Status;
// programmer errors (a broken invariant) abort through STRATA_CHECK. No
// exceptions cross a module boundary.
//
//   Result<File> OpenState(const std::string& path) {
//     STRATA_ASSIGN_OR_RETURN(auto fd, OpenFd(path));
//     STRATA_RETURN_IF_ERROR(Truncate(fd, bytes)).WithContext("open " + path);
//     return File(std::move(fd));
//   }
//   STRATA_CHECK(n % 8 == 0) << "n=" << n;
//
// Messages read "<op> <object>: <cause>", e.g.
//   "read rank0.state@4096+1MiB: EIO (Input/output error)",
// and gain context while unwinding through WithContext(), which prefixes:
//   "step 12: read rank0.state@4096+1MiB: EIO (Input/output error)".
//
// Codes (a subset of the canonical ones), and what a caller should do:
//   kInvalidArgument    the input is wrong whatever the system state: fix it.
//   kNotFound           a named file/param/device does not exist.
//   kOutOfRange         an index or offset is past the end.
//   kResourceExhausted  a budget or the disk is full: raise it or shrink work.
//   kFailedPrecondition the system is not in the state the call needs.
//   kUnavailable        transient (EINTR, EAGAIN, busy): retrying may work.
//   kDataLoss           stored data is corrupt or torn: restore a checkpoint. Also
//                       a device that lost its memory for the process (a sticky
//                       CUDA error, runtime/device.h IsDeviceLost): restart, then
//                       restore a checkpoint.
//   kCancelled          the operation was stopped before it finished.
//   kUnimplemented      not supported by this backend/build.
//   kInternal           a bug or an unexpected library failure.
//
// Thread-safety: Status and Result are values; copies are independent.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <ostream>
#include <sstream>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>

namespace strata {

enum class StatusCode : int {
  kOk = 0,
  kCancelled = 1,
  kInvalidArgument = 3,
  kNotFound = 5,
  kResourceExhausted = 8,
  kFailedPrecondition = 9,
  kOutOfRange = 11,
  kUnimplemented = 12,
  kInternal = 13,
  kUnavailable = 14,
  kDataLoss = 15,
};

// "InvalidArgument", "DataLoss", ...
std::string_view StatusCodeName(StatusCode code);

class [[nodiscard]] Status {
 public:
  // OK.
  Status() = default;
  Status(StatusCode code, std::string message);

  bool ok() const { return rep_ == nullptr; }
  StatusCode code() const { return rep_ ? rep_->code : StatusCode::kOk; }
  std::string_view message() const { return rep_ ? std::string_view(rep_->message) : ""; }
  // "DataLoss: read x: checksum mismatch", or "OK".
  std::string ToString() const;

  // Prefixes the message with "<context>: " (no-op when OK). Use it to say
  // which higher-level operation was running when this one failed.
  Status WithContext(std::string_view context) const&;
  Status WithContext(std::string_view context) &&;

  // Explicitly drops an error the caller has decided not to act on.
  void IgnoreError() const {}

  friend bool operator==(const Status& a, const Status& b) {
    return a.code() == b.code() && a.message() == b.message();
  }

 private:
  struct Rep {
    StatusCode code;
    std::string message;
  };
  // Null when OK, so the OK path costs one pointer and never allocates.
  std::shared_ptr<const Rep> rep_;
};

std::ostream& operator<<(std::ostream& os, const Status& s);

inline Status OkStatus() { return Status(); }
Status CancelledError(std::string message);
Status InvalidArgumentError(std::string message);
Status NotFoundError(std::string message);
Status OutOfRangeError(std::string message);
Status ResourceExhaustedError(std::string message);
Status FailedPreconditionError(std::string message);
Status UnimplementedError(std::string message);
Status InternalError(std::string message);
Status UnavailableError(std::string message);
Status DataLossError(std::string message);

// Maps an errno value to its code (ENOENT -> NotFound, ENOSPC/ENOMEM/EDQUOT ->
// ResourceExhausted, EINTR/EAGAIN/EBUSY -> Unavailable, EINVAL -> InvalidArgument,
// EACCES/EPERM -> FailedPrecondition, EIO and the rest -> Internal); ErrnoError
// formats "<op>: ENAME (strerror)".
StatusCode ErrnoToCode(int err);
Status ErrnoError(int err, std::string_view op);
// "EIO", "ENOSPC", ... (or "errno 1234").
std::string_view ErrnoName(int err);

// Result<T>: a T or a non-OK Status.
template <typename T>
class [[nodiscard]] Result {
 public:
  static_assert(!std::is_same_v<std::decay_t<T>, Status>, "Result<Status> is meaningless");

  // From an error. Constructing from an OK status is a programmer error.
  Result(Status status) : status_(std::move(status)) {  // NOLINT: implicit by design
    if (status_.ok()) status_ = InternalError("Result constructed from an OK status");
  }
  Result(const T& value) : value_(value) {}        // NOLINT
  Result(T&& value) : value_(std::move(value)) {}  // NOLINT
  template <typename U>
    requires(std::is_constructible_v<T, U &&> && !std::is_same_v<std::decay_t<U>, Status> &&
             !std::is_same_v<std::decay_t<U>, Result<T>> && !std::is_same_v<std::decay_t<U>, T>)
  Result(U&& value) : value_(std::in_place, std::forward<U>(value)) {}  // NOLINT

  bool ok() const { return value_.has_value(); }
  const Status& status() const& { return status_; }
  Status status() && { return std::move(status_); }

  // Accessing the value of an error aborts with the error's message.
  T& value() & {
    CheckOk();
    return *value_;
  }
  const T& value() const& {
    CheckOk();
    return *value_;
  }
  T&& value() && {
    CheckOk();
    return std::move(*value_);
  }
  T& operator*() & { return value(); }
  const T& operator*() const& { return value(); }
  T&& operator*() && { return std::move(*this).value(); }
  T* operator->() { return &value(); }
  const T* operator->() const { return &value(); }

  T value_or(T fallback) const& { return ok() ? *value_ : std::move(fallback); }

 private:
  void CheckOk() const;

  Status status_;  // OK exactly when value_ holds a value
  std::optional<T> value_;
};

namespace internal {

[[noreturn]] void DieOnBadResultAccess(const Status& status);

// Collects the streamed message of a failed STRATA_CHECK, then aborts.
class CheckFailure {
 public:
  CheckFailure(const char* file, int line, const char* condition);
  [[noreturn]] ~CheckFailure();
  std::ostream& stream() { return stream_; }

 private:
  std::ostringstream stream_;
};

// Lets `STRATA_CHECK(c) << x` compile as one expression of type void.
struct Voidify {
  void operator&(std::ostream&) {}
};

inline const Status& AsStatus(const Status& s) { return s; }
template <typename T>
const Status& AsStatus(const Result<T>& r) {
  return r.status();
}

}  // namespace internal

template <typename T>
void Result<T>::CheckOk() const {
  if (!value_.has_value()) internal::DieOnBadResultAccess(status_);
}

}  // namespace strata

#define STRATA_INTERNAL_CONCAT2(a, b) a##b
#define STRATA_INTERNAL_CONCAT(a, b) STRATA_INTERNAL_CONCAT2(a, b)

// Returns the Status of `expr` (a Status or a Result) from the enclosing
// function when it is not OK.
#define STRATA_RETURN_IF_ERROR(expr)                                                   \
  do {                                                                                 \
    if (::strata::Status strata_status_ = ::strata::internal::AsStatus(expr);          \
        !strata_status_.ok()) {                                                        \
      return strata_status_;                                                           \
    }                                                                                  \
  } while (false)

// `STRATA_ASSIGN_OR_RETURN(auto x, MakeX());` declares/assigns `x` from a
// Result, or returns its Status from the enclosing function.
#define STRATA_ASSIGN_OR_RETURN(lhs, expr) \
  STRATA_INTERNAL_ASSIGN_OR_RETURN(STRATA_INTERNAL_CONCAT(strata_result_, __LINE__), lhs, expr)
#define STRATA_INTERNAL_ASSIGN_OR_RETURN(tmp, lhs, expr) \
  auto tmp = (expr);                                     \
  if (!tmp.ok()) return std::move(tmp).status();         \
  lhs = std::move(tmp).value()

// Aborts with file:line, the condition and the streamed message when `cond`
// is false. For broken invariants only; runtime failures return a Status.
#define STRATA_CHECK(cond)                                                  \
  (cond) ? (void)0                                                          \
         : ::strata::internal::Voidify() &                                  \
               ::strata::internal::CheckFailure(__FILE__, __LINE__, #cond).stream()

// Aborts when the Status/Result is not OK.
#define STRATA_CHECK_OK(expr)                                                        \
  do {                                                                               \
    ::strata::Status strata_check_status_ = ::strata::internal::AsStatus(expr);        \
    STRATA_CHECK(strata_check_status_.ok()) << strata_check_status_;                 \
  } while (false)
