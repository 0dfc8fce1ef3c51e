// OffloadOptimizer::Save and Load: not implemented yet.
#include "offload/optimizer.h"

namespace strata {

Status OffloadOptimizer::Save(const std::string& dir) {
  return UnimplementedError("OffloadOptimizer::Save(" + dir + "): checkpoints are not built yet");
}

Status OffloadOptimizer::Load(const std::string& dir) {
  return UnimplementedError("OffloadOptimizer::Load(" + dir + "): checkpoints are not built yet");
}

}  // namespace strata
