// One thread at a time drives an optimizer. The C API and the Python module
// (whose calls release the GIL) wrap each call on an optimizer in a
// OneCaller, so a second thread's call while one runs is refused, naming the
// running call, instead of racing with it inside the engine.
#pragma once

#include <fmt/format.h>

#include <atomic>

#include "runtime/status.h"

namespace strata {

class OneCaller {
 public:
  // OK, and the optimizer is `op`'s until Leave(); FailedPrecondition naming
  // the call that runs otherwise. `op` must outlive the call (a literal).
  Status Enter(const char* op) {
    const char* other = nullptr;
    if (running_.compare_exchange_strong(other, op, std::memory_order_acquire)) return OkStatus();
    return FailedPreconditionError(fmt::format(
        "{}: {} is running on this optimizer in another thread; one thread at a time drives "
        "an optimizer: wait for that call to return (or guard the optimizer with a lock)",
        op, other));
  }
  void Leave() { running_.store(nullptr, std::memory_order_release); }

 private:
  std::atomic<const char*> running_{nullptr};
};

}  // namespace strata
