// CommWatchdog: a bound on how long a communicator's collectives may run.
//
// NCCL has no timeout of its own. When a rank fails, exits, or issues a
// different collective, its peers' kernels wait for it forever, and so does
// every host thread that waits on their streams (a step's
// StreamSynchronize, a close). The watchdog bounds that wait:
//   - Run() enqueues one collective between two events of its stream,
//     followed by a host task that returns the watchdog's status, so that a
//     failure becomes the stream's sticky error and every wait on the stream
//     returns it;
//   - a thread polls every `poll`: a collective whose stream reached it more
//     than `timeout` ago and that has not finished, or an asynchronous error
//     of the backend (Hooks::async_error), fails the watchdog. It keeps the
//     first failure and calls Hooks::abort once; the abort must end the
//     backend's work in flight (NCCL: ncclCommAbort makes its kernels
//     return). The streams then move on, their host tasks report the
//     failure, and every later Run() returns it without calling the backend.
//   - an enqueue that fails fails the watchdog too: the ranks are out of
//     step from there on.
//
// A collective's clock starts when its stream reaches it, not when it is
// enqueued: one queued behind a long copy or a CPU step does not time out.
//
//   CommWatchdog watchdog(device, "nccl rank 0/2 on cuda:0", {.timeout = 10min},
//                         {.async_error = ..., .abort = ...});
//   STRATA_RETURN_IF_ERROR(watchdog.Run(stream, "all-reduce of 2 x f64", [&] {
//     return NcclError(ncclAllReduce(...), "all-reduce");
//   }));
//   ...
//   watchdog.Drain();  // before destroying the backend: nothing in flight
//   watchdog.Stop();   // no hook runs after this
//
// Thread-safety: every method may be called from any thread. Run() calls are
// serialized: each holds the call lock while the backend enqueues, and the
// abort waits up to `abort_grace` for a call in progress to return before it
// aborts anyway (a backend call blocked on a dead peer returns only after
// the abort). The hooks run on the watchdog's thread or on Drain()'s caller.
#pragma once

#include <chrono>
#include <condition_variable>
#include <functional>
#include <list>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <thread>

#include "runtime/device.h"
#include "runtime/status.h"

namespace strata {

struct CommWatchdogOptions {
  // How long a collective may run once its stream reached it (and how long
  // the backend's call that enqueues it may take). At most a year is used.
  std::chrono::milliseconds timeout{600'000};
  // How often the thread looks.
  std::chrono::milliseconds poll{100};
  // How long the abort waits for a Run() in progress to return first.
  std::chrono::milliseconds abort_grace{2'000};
};

class CommWatchdog {
 public:
  struct Hooks {
    // The backend's asynchronous error: OK while healthy. May be empty.
    std::function<Status()> async_error;
    // Ends the backend's work in flight; called at most once. May be empty.
    std::function<void()> abort;
  };

  // `what` names the communicator in messages ("nccl rank 0/2 on cuda:0").
  // InvalidArgument for a timeout or poll interval that is not positive.
  static Result<std::unique_ptr<CommWatchdog>> Create(Device& device, std::string what,
                                                      const CommWatchdogOptions& options,
                                                      Hooks hooks);
  ~CommWatchdog();  // Stop()
  CommWatchdog(const CommWatchdog&) = delete;
  CommWatchdog& operator=(const CommWatchdog&) = delete;

  // Puts one collective on `stream`: `enqueue` is the backend's call that
  // enqueues it there. Returns the enqueue's error, or the failure that
  // stopped the communicator (then without calling `enqueue`): Unavailable
  // saying that the communicator cannot run collectives again. `op` names the
  // collective in messages.
  Status Run(StreamRef stream, std::string_view op, const std::function<Status()>& enqueue);

  // Waits until every collective Run() enqueued has finished, or the
  // watchdog failed (then that failure). Bounded: what is still in flight
  // `timeout` after the call (a stream that never reaches its collective
  // included) fails the watchdog and aborts the backend.
  Status Drain();

  // Stops the thread: no hook runs on it after this returns (Run() and
  // Drain() may still fail the watchdog, and abort, on their own threads).
  // Does not abort.
  void Stop();

  // OK, or the failure that stopped the communicator.
  Status status() const;
  // Whether Hooks::abort was called (it may still be running until Stop()).
  bool aborted() const;

 private:
  struct Shared;
  class CallScope;
  struct InFlight {
    std::string op;
    // Inside the backend's call (Enqueue): timed from the call; then from
    // when the stream reaches `start`.
    bool in_call = false;
    std::optional<std::chrono::steady_clock::time_point> started_at;
    Event start{};
    Event end{};
  };
  using Clock = std::chrono::steady_clock;

  CommWatchdog(Device& device, std::string what, const CommWatchdogOptions& options, Hooks hooks);
  // Run() under its CallScope: the events, the backend's call, the report.
  Status Enqueue(StreamRef stream, std::string_view op, const std::function<Status()>& enqueue);
  void Loop();
  // Looks at the backend and at every collective in flight; the failure, if
  // one is due. Requires mu_.
  Status Poll(Clock::time_point now);
  // Keeps the first failure, then aborts the backend once.
  void Fail(Status failure);

  Device& device_;
  const std::string what_;
  const CommWatchdogOptions options_;
  const Hooks hooks_;
  // Set while a Run() is in the backend; the abort waits for it to clear.
  // (Not a timed_mutex: ThreadSanitizer does not see its timed lock.)
  std::mutex call_mu_;
  std::condition_variable call_cv_;
  bool calling_ = false;  // guarded by call_mu_
  // The failure, shared with the host tasks on the streams (which may run
  // after the watchdog is gone).
  std::shared_ptr<Shared> shared_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::list<InFlight> in_flight_;  // guarded by mu_
  bool stop_ = false;              // guarded by mu_
  std::thread thread_;
};

}  // namespace strata
