// PinnedPool: a budgeted pool of page-locked host memory for staging copies
// and O_DIRECT IO.
//
// Page-locking is slow (cudaHostAlloc and mlock take milliseconds per GiB)
// and limited, so the pool takes large slabs from Device::AllocateHost once,
// as needed up to a byte budget, keeps them for its lifetime, and
// sub-allocates buffers from them (first fit, freed ranges coalesce).
//
//   STRATA_ASSIGN_OR_RETURN(PinnedPool pool,
//       PinnedPool::Create(*device, {.budget_bytes = 8 * kGiB, .slab_bytes = 256 * kMiB}));
//   STRATA_ASSIGN_OR_RETURN(PinnedBuffer grads, pool.Allocate(shard_bytes));
//   device->CopyAsync(grads.data(), dgrads, shard_bytes, CopyKind::kDeviceToHost, stream);
//   PinnedPoolStats s = pool.stats();  // capacity, in use, peak, locked
//
// Alignment: every buffer starts on a 4096-byte boundary and its size is
// rounded up to 4096, so it may be used for O_DIRECT as is. On the host
// device every slab starts on a 2 MiB boundary and is advised
// MADV_HUGEPAGE before it is locked, so where the kernel has transparent
// huge pages (even in "madvise" mode) each whole 2 MiB of a slab is one huge
// page: a 1 MiB IO buffer is then one or two DMA segments instead of up to
// 256, which decides O_DIRECT throughput on devices that pay per segment.
// Choose slab_bytes as a multiple of 2 MiB to have no 4 KiB-page tail.
//
// Locking: on CUDA slabs come from cudaHostAlloc; on the host device from
// aligned allocation + mlock, falling back to unlocked memory with one
// warning where the OS refuses (EPERM/ENOMEM: `ulimit -l`, no
// CAP_IPC_LOCK). stats().locked says whether every slab is locked.
//
// Errors: Allocate returns ResourceExhausted naming the request, the budget
// and what is in use when the budget cannot hold it; InvalidArgument for a
// zero-size request. Create returns InvalidArgument for a zero budget.
//
// Thread-safety: all methods are thread-safe. Ownership: a PinnedBuffer
// returns its range on destruction and keeps the pool's slabs alive, so it
// may outlive the PinnedPool object; the Device must outlive both.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>

#include "runtime/device.h"
#include "runtime/status.h"

namespace strata {

struct PinnedPoolOptions {
  uint64_t budget_bytes = 0;           // most host memory the pool may take; > 0
  uint64_t slab_bytes = 256ull << 20;  // slab size; larger requests get a slab of their own
};

struct PinnedPoolStats {
  uint64_t capacity_bytes = 0;  // slabs taken so far
  uint64_t in_use_bytes = 0;    // handed out (rounded sizes)
  uint64_t peak_bytes = 0;      // highest in_use_bytes so far
  uint64_t slabs = 0;
  uint64_t buffers = 0;  // live buffers
  bool locked = true;    // every slab page-locked (true for an empty pool)
};

namespace internal {
class PinnedPoolState;
}

// A range of the pool. Move-only; returns the range on destruction.
class PinnedBuffer {
 public:
  PinnedBuffer() = default;
  PinnedBuffer(std::shared_ptr<internal::PinnedPoolState> pool, std::byte* data, size_t bytes,
               uint32_t slab);
  PinnedBuffer(PinnedBuffer&& other) noexcept { *this = std::move(other); }
  PinnedBuffer& operator=(PinnedBuffer&& other) noexcept;
  ~PinnedBuffer() { Reset(); }

  // The whole range, rounded up to 4096 bytes.
  std::span<std::byte> bytes() const { return {data_, bytes_}; }
  std::byte* data() const { return data_; }
  size_t size_bytes() const { return bytes_; }
  template <typename T>
  std::span<T> as() const {
    return {reinterpret_cast<T*>(data_), bytes_ / sizeof(T)};
  }
  void Reset();

 private:
  std::shared_ptr<internal::PinnedPoolState> pool_;
  std::byte* data_ = nullptr;
  size_t bytes_ = 0;
  uint32_t slab_ = 0;
};

class PinnedPool {
 public:
  static constexpr size_t kAlignment = 4096;

  // Takes no memory yet; slabs are taken on demand.
  static Result<PinnedPool> Create(Device& device, const PinnedPoolOptions& options);

  PinnedPool(PinnedPool&&) noexcept = default;
  PinnedPool& operator=(PinnedPool&&) noexcept = default;
  ~PinnedPool();

  Result<PinnedBuffer> Allocate(size_t bytes);
  PinnedPoolStats stats() const;
  const PinnedPoolOptions& options() const;

 private:
  explicit PinnedPool(std::shared_ptr<internal::PinnedPoolState> state)
      : state_(std::move(state)) {}
  std::shared_ptr<internal::PinnedPoolState> state_;
};

}  // namespace strata
