#include "offload/engine_internal.h"

#include <algorithm>

namespace strata::internal {

Result<PinnedBuffer> AllocatePinned(Device& device, uint64_t bytes) {
  const uint64_t rounded = (std::max<uint64_t>(bytes, 1) + 4095) / 4096 * 4096;
  STRATA_ASSIGN_OR_RETURN(
      PinnedPool pool, PinnedPool::Create(device, {.budget_bytes = rounded, .slab_bytes = rounded}));
  return pool.Allocate(rounded);
}

}  // namespace strata::internal
