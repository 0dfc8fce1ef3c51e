// Internal to the device backends: fresh host memory mapped on a 2 MiB
// boundary and faulted in on every core, before it is locked (host device:
// mlock) or registered with the driver (CUDA: cudaHostRegister). Locking or
// registering alone would fault every page in on the calling thread, where
// the kernel zeroes each one at a few GB/s.
#pragma once

#include <cstddef>

#include "runtime/status.h"

namespace strata::internal {

// Host allocations start on this boundary so that the kernel can back them
// with transparent huge pages: a 1 MiB IO buffer of scattered 4 KiB pages is
// up to 256 DMA segments (more than many devices take in one request), one
// or two on a huge page.
inline constexpr size_t kHostHugePageBytes = size_t{2} << 20;

// An anonymous private mapping of `bytes` (a multiple of 4096) starting on a
// kHostHugePageBytes boundary and advised for transparent huge pages; free it
// with munmap(p, bytes). ResourceExhausted when the mapping is refused.
Result<void*> MapHugePageAligned(size_t bytes);

// Faults the pages of a fresh mapping in from every hardware thread (64 MiB
// chunks): MADV_POPULATE_WRITE (Linux 5.14), else one store per page. Does
// nothing for less than two chunks.
void PrefaultInParallel(void* p, size_t bytes);

}  // namespace strata::internal
