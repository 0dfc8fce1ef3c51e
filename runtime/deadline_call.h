// CallWithDeadline: waits a bounded time for a blocking call that cannot be
// cancelled (ncclCommInitRank, which waits for every rank to join).
//
//   std::optional<Status> s = CallWithDeadline<Status>(
//       [] { return Init(); }, timeout, [](Status late) { /* drop what it made */ });
//   if (!s) return UnavailableError("not every rank joined within the timeout");
//
// `fn` runs on a thread of its own; the caller waits up to `timeout` for its
// result. Past it the caller gets nullopt and the call is left running: when
// it returns, `abandon(result)` runs on its thread to release what it made.
// The thread shares nothing with the caller's frame, so the caller may
// return (or the process exit) while it still runs. Thread-safe.
#pragma once

#include <chrono>
#include <condition_variable>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <thread>
#include <utility>

namespace strata {

template <typename T>
std::optional<T> CallWithDeadline(std::function<T()> fn, std::chrono::milliseconds timeout,
                                  std::function<void(T)> abandon) {
  struct Shared {
    std::mutex mu;
    std::condition_variable cv;
    std::optional<T> result;
    bool abandoned = false;
  };
  auto shared = std::make_shared<Shared>();
  std::thread([shared, fn = std::move(fn), abandon = std::move(abandon)]() mutable {
    T value = fn();
    {
      std::lock_guard<std::mutex> lock(shared->mu);
      if (!shared->abandoned) {
        shared->result.emplace(std::move(value));
        shared->cv.notify_all();
        return;
      }
    }
    if (abandon) abandon(std::move(value));
  }).detach();
  std::unique_lock<std::mutex> lock(shared->mu);
  if (!shared->cv.wait_for(lock, timeout, [&] { return shared->result.has_value(); })) {
    shared->abandoned = true;
    return std::nullopt;
  }
  return std::move(shared->result);
}

}  // namespace strata
