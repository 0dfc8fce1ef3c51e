#include "runtime/pinned.h"

#include <fmt/format.h>

#include <map>
#include <mutex>
#include <utility>
#include <vector>

#include "runtime/units.h"

namespace strata {
namespace internal {

class PinnedPoolState {
 public:
  PinnedPoolState(Device& device, const PinnedPoolOptions& options)
      : device_(device), options_(options) {}

  Result<PinnedBuffer> Allocate(const std::shared_ptr<PinnedPoolState>& self, size_t bytes) {
    if (bytes == 0)
      return InvalidArgumentError("allocate 0 bytes from the pinned pool: size must be > 0");
    const uint64_t rounded = (static_cast<uint64_t>(bytes) + PinnedPool::kAlignment - 1) /
                             PinnedPool::kAlignment * PinnedPool::kAlignment;
    std::lock_guard lock(mu_);
    for (uint32_t i = 0; i < slabs_.size(); ++i) {
      if (std::byte* p = TakeFrom(i, rounded)) return Hand(self, p, rounded, i);
    }
    const uint64_t room = options_.budget_bytes - capacity_bytes_;
    if (rounded > room) {
      return ResourceExhaustedError(fmt::format(
          "allocate {} from the pinned pool: budget {}, {} in use in {} buffers, {} taken in {} "
          "slabs "
          "(largest free range {}); raise PinnedPoolOptions::budget_bytes or free buffers",
          FormatBytes(bytes), FormatBytes(options_.budget_bytes), FormatBytes(in_use_bytes_),
          buffers_, FormatBytes(capacity_bytes_), slabs_.size(), FormatBytes(LargestFreeRange())));
    }
    uint64_t slab_bytes = std::min(std::max<uint64_t>(options_.slab_bytes, rounded), room);
    slab_bytes = slab_bytes / PinnedPool::kAlignment * PinnedPool::kAlignment;
    auto alloc = device_.AllocateHost(slab_bytes);
    if (!alloc.ok()) {
      return std::move(alloc).status().WithContext(
          fmt::format("allocate {} from the pinned pool: take a slab", FormatBytes(bytes)));
    }
    Slab slab;
    slab.memory = *std::move(alloc);
    slab.free.emplace(0, slab.memory.bytes());
    capacity_bytes_ += slab.memory.bytes();
    all_locked_ = all_locked_ && slab.memory.locked();
    slabs_.push_back(std::move(slab));
    const uint32_t index = static_cast<uint32_t>(slabs_.size() - 1);
    std::byte* p = TakeFrom(index, rounded);
    STRATA_CHECK(p != nullptr) << "a fresh slab of " << slab_bytes << " bytes cannot hold "
                               << rounded;
    return Hand(self, p, rounded, index);
  }

  void Free(std::byte* data, size_t bytes, uint32_t slab_index) {
    std::lock_guard lock(mu_);
    Slab& slab = slabs_[slab_index];
    const size_t offset = static_cast<size_t>(data - static_cast<std::byte*>(slab.memory.data()));
    auto [it, inserted] = slab.free.emplace(offset, bytes);
    STRATA_CHECK(inserted) << "pinned range freed twice at offset " << offset;
    // Coalesce with the following and preceding free ranges.
    if (auto next = std::next(it);
        next != slab.free.end() && it->first + it->second == next->first) {
      it->second += next->second;
      slab.free.erase(next);
    }
    if (it != slab.free.begin()) {
      auto prev = std::prev(it);
      if (prev->first + prev->second == it->first) {
        prev->second += it->second;
        slab.free.erase(it);
      }
    }
    in_use_bytes_ -= bytes;
    --buffers_;
  }

  PinnedPoolStats stats() const {
    std::lock_guard lock(mu_);
    return PinnedPoolStats{capacity_bytes_, in_use_bytes_, peak_bytes_,
                           slabs_.size(),   buffers_,      all_locked_};
  }

  const PinnedPoolOptions& options() const { return options_; }

 private:
  struct Slab {
    HostAllocation memory;
    std::map<size_t, size_t> free;  // offset -> bytes, non-adjacent
  };

  std::byte* TakeFrom(uint32_t index, uint64_t bytes) {
    Slab& slab = slabs_[index];
    for (auto it = slab.free.begin(); it != slab.free.end(); ++it) {
      if (it->second < bytes) continue;
      const size_t offset = it->first;
      const size_t left = it->second - bytes;
      slab.free.erase(it);
      if (left > 0) slab.free.emplace(offset + bytes, left);
      return static_cast<std::byte*>(slab.memory.data()) + offset;
    }
    return nullptr;
  }

  PinnedBuffer Hand(const std::shared_ptr<PinnedPoolState>& self, std::byte* p, uint64_t bytes,
                    uint32_t slab) {
    in_use_bytes_ += bytes;
    peak_bytes_ = std::max(peak_bytes_, in_use_bytes_);
    ++buffers_;
    return PinnedBuffer(self, p, bytes, slab);
  }

  uint64_t LargestFreeRange() const {
    uint64_t best = 0;
    for (const Slab& s : slabs_) {
      for (const auto& [offset, bytes] : s.free) best = std::max<uint64_t>(best, bytes);
    }
    return best;
  }

  Device& device_;
  const PinnedPoolOptions options_;
  mutable std::mutex mu_;
  std::vector<Slab> slabs_;
  uint64_t capacity_bytes_ = 0;
  uint64_t in_use_bytes_ = 0;
  uint64_t peak_bytes_ = 0;
  uint64_t buffers_ = 0;
  bool all_locked_ = true;
};

}  // namespace internal

PinnedBuffer::PinnedBuffer(std::shared_ptr<internal::PinnedPoolState> pool, std::byte* data,
                           size_t bytes, uint32_t slab)
    : pool_(std::move(pool)), data_(data), bytes_(bytes), slab_(slab) {}

PinnedBuffer& PinnedBuffer::operator=(PinnedBuffer&& other) noexcept {
  if (this != &other) {
    Reset();
    pool_ = std::move(other.pool_);
    data_ = std::exchange(other.data_, nullptr);
    bytes_ = std::exchange(other.bytes_, 0);
    slab_ = std::exchange(other.slab_, 0);
  }
  return *this;
}

void PinnedBuffer::Reset() {
  if (pool_ != nullptr && data_ != nullptr) pool_->Free(data_, bytes_, slab_);
  pool_.reset();
  data_ = nullptr;
  bytes_ = 0;
  slab_ = 0;
}

Result<PinnedPool> PinnedPool::Create(Device& device, const PinnedPoolOptions& options) {
  if (options.budget_bytes == 0) {
    return InvalidArgumentError(fmt::format(
        "create pinned pool on {}: budget_bytes is 0; give the pool a budget", device.name()));
  }
  if (options.slab_bytes == 0) {
    return InvalidArgumentError(
        fmt::format("create pinned pool on {}: slab_bytes is 0; use e.g. 256 MiB", device.name()));
  }
  return PinnedPool(std::make_shared<internal::PinnedPoolState>(device, options));
}

PinnedPool::~PinnedPool() = default;

Result<PinnedBuffer> PinnedPool::Allocate(size_t bytes) { return state_->Allocate(state_, bytes); }
PinnedPoolStats PinnedPool::stats() const { return state_->stats(); }
const PinnedPoolOptions& PinnedPool::options() const { return state_->options(); }

}  // namespace strata
