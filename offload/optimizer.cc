// The engine: not implemented yet; Create reports it.
#include "offload/optimizer.h"

namespace strata {

struct OffloadOptimizer::Impl {};

OffloadOptimizer::OffloadOptimizer(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
OffloadOptimizer::~OffloadOptimizer() = default;

Result<std::unique_ptr<OffloadOptimizer>> OffloadOptimizer::Create(const EngineContext&,
                                                                   const OffloadConfig&,
                                                                   std::span<const ParamGroup>) {
  return UnimplementedError("OffloadOptimizer::Create: the engine is not built yet");
}

}  // namespace strata
