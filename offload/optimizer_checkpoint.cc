// OffloadOptimizer::Save and Load: the format and the work are in
// offload/checkpoint.{h,cc} (docs/checkpoint.md); these use its defaults.
#include "offload/checkpoint.h"
#include "offload/optimizer.h"

namespace strata {

Status OffloadOptimizer::Save(const std::string& dir) {
  return SaveCheckpoint(*this, dir);  // refuses a failed step's mixed state itself
}

Status OffloadOptimizer::Load(const std::string& dir) { return LoadCheckpoint(*this, dir); }

}  // namespace strata
