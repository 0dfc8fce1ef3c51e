// OffloadOptimizer::Save and Load: the format and the work are in
// offload/checkpoint.{h,cc} (docs/checkpoint.md); these use its defaults.
#include <fmt/format.h>

#include "offload/checkpoint.h"
#include "offload/optimizer.h"

namespace strata {

Status OffloadOptimizer::Save(const std::string& dir) {
  // Nothing is written for a state that mixes two steps (ReadState refuses it too).
  if (step_state() == StepState::kFailed) {
    return FailedPreconditionError(fmt::format(
        "save checkpoint {}: step {} failed part way and is not finished ({}); RetryStep() "
        "finishes it, then save",
        dir, step_count() + 1, step_failure().ToString()));
  }
  return SaveCheckpoint(*this, dir);
}

Status OffloadOptimizer::Load(const std::string& dir) { return LoadCheckpoint(*this, dir); }

}  // namespace strata
