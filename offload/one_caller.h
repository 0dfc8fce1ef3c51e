// One thread at a time drives an optimizer. The C API and the Python module
// (whose calls release the GIL) wrap each call on an optimizer in a
// OneCaller, so a second thread's call while one runs is refused, naming the
// running call, instead of racing with it inside the engine. Their value
// getters, which any thread may call, read a ValuesAfterCalls instead: the
// optimizer's values as of the end of the last call, never its fields while a
// call writes them.
#pragma once

#include <fmt/format.h>

#include <atomic>
#include <mutex>
#include <string>
#include <vector>

#include "offload/optimizer.h"
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

struct OptimizerValues {
  double loss_scale = 1.0;
  int64_t step_count = 0;
  bool step_failed = false;
  std::string step_failure;  // "" unless failed
  std::string incomplete_state;  // OffloadOptimizer::incomplete_state()
  StepStats last;
  std::vector<GroupHyper> hypers;
  LossScalerState scaler;
};

class ValuesAfterCalls {
 public:
  // Takes the values; at creation and at the end of every call.
  void Refresh(const OffloadOptimizer& opt) {
    OptimizerValues v{.loss_scale = opt.loss_scale(),
                      .step_count = opt.step_count(),
                      .step_failed = opt.step_state() == StepState::kFailed,
                      .step_failure = opt.step_failure().ok() ? "" : opt.step_failure().ToString(),
                      .incomplete_state = opt.incomplete_state(),
                      .last = opt.last_step(),
                      .hypers = {},
                      .scaler = opt.loss_scaler_state()};
    for (uint32_t g = 0; g < opt.num_groups(); ++g) v.hypers.push_back(opt.group_hyper(g));
    std::lock_guard lock(mu_);
    values_ = std::move(v);
  }
  OptimizerValues Read() const {
    std::lock_guard lock(mu_);
    return values_;
  }

 private:
  mutable std::mutex mu_;
  OptimizerValues values_;
};

}  // namespace strata
