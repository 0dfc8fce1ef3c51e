#include "offload/engine_internal.h"

#include <algorithm>

namespace strata::internal {

Result<PinnedBuffer> AllocatePinned(Device& device, uint64_t bytes) {
  const uint64_t rounded = (std::max<uint64_t>(bytes, 1) + 4095) / 4096 * 4096;
  STRATA_ASSIGN_OR_RETURN(
      PinnedPool pool, PinnedPool::Create(device, {.budget_bytes = rounded, .slab_bytes = rounded}));
  return pool.Allocate(rounded);
}

Result<std::vector<PinnedBuffer>> AllocatePinned(Device& device,
                                                 std::span<const uint64_t> bytes) {
  auto round = [](uint64_t b) { return (std::max<uint64_t>(b, 1) + 4095) / 4096 * 4096; };
  uint64_t total = 0;
  for (uint64_t b : bytes) total += round(b);
  std::vector<PinnedBuffer> out;
  if (total == 0) return out;
  STRATA_ASSIGN_OR_RETURN(PinnedPool pool,
                          PinnedPool::Create(device, {.budget_bytes = total, .slab_bytes = total}));
  for (uint64_t b : bytes) {
    STRATA_ASSIGN_OR_RETURN(PinnedBuffer buf, pool.Allocate(round(b)));
    out.push_back(std::move(buf));
  }
  return out;
}

}  // namespace strata::internal
