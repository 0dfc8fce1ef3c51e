#include <fmt/format.h>
#include <sys/mman.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdint>
#include <thread>
#include <vector>

#include "runtime/host_pages_internal.h"
#include "runtime/host_region.h"
#include "runtime/units.h"

namespace strata::internal {

Result<void*> MapHugePageAligned(size_t bytes) {
  const size_t map_bytes = bytes + kHostHugePageBytes;
  void* m = ::mmap(nullptr, map_bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (m == MAP_FAILED) {
    return ResourceExhaustedError(fmt::format("allocate {} of host memory: {}", FormatBytes(bytes),
                                              ErrnoError(errno, "mmap").message()));
  }
  const auto base = reinterpret_cast<uintptr_t>(m);
  const uintptr_t aligned =
      (base + kHostHugePageBytes - 1) / kHostHugePageBytes * kHostHugePageBytes;
  if (aligned > base) ::munmap(m, aligned - base);
  const uintptr_t end = aligned + bytes;
  if (base + map_bytes > end) ::munmap(reinterpret_cast<void*>(end), base + map_bytes - end);
  void* p = reinterpret_cast<void*>(aligned);
  // Before the first fault: THP (in "madvise" mode, the common default)
  // applies only to ranges advised before it. Where the kernel has no THP the
  // advice fails harmlessly and 4 KiB pages stay.
  ::madvise(p, bytes, MADV_HUGEPAGE);
  return p;
}

void PrefaultInParallel(void* p, size_t bytes) {
  constexpr size_t kChunk = 64 << 20;
  const size_t chunks = (bytes + kChunk - 1) / kChunk;
  const size_t threads = std::min<size_t>(std::thread::hardware_concurrency(), chunks);
  if (threads < 2) return;
#ifndef MADV_POPULATE_WRITE
  constexpr int MADV_POPULATE_WRITE = 23;
#endif
  std::atomic<size_t> next{0};
  auto work = [&] {
    for (size_t c = next.fetch_add(1); c < chunks; c = next.fetch_add(1)) {
      auto* b = static_cast<volatile char*>(p) + c * kChunk;
      const size_t n = std::min(kChunk, bytes - c * kChunk);
      if (::madvise(const_cast<char*>(b), n, MADV_POPULATE_WRITE) == 0) continue;
      for (size_t o = 0; o < n; o += 4096) b[o] = 0;
    }
  };
  std::vector<std::thread> pool;
  for (size_t t = 1; t < threads; ++t) pool.emplace_back(work);
  work();
  for (std::thread& t : pool) t.join();
}

}  // namespace strata::internal

namespace strata {

Result<HostRegion> HostRegion::Map(size_t bytes) {
  constexpr size_t kPage = 4096;
  const size_t unit = bytes >= internal::kHostHugePageBytes ? internal::kHostHugePageBytes : kPage;
  const size_t mapped = (std::max<size_t>(bytes, 1) + unit - 1) / unit * unit;
  STRATA_ASSIGN_OR_RETURN(void* p, internal::MapHugePageAligned(mapped));
  HostRegion r;
  r.data_ = static_cast<std::byte*>(p);
  r.size_ = bytes;
  r.mapped_ = mapped;
  return r;
}

HostRegion& HostRegion::operator=(HostRegion&& o) noexcept {
  std::swap(data_, o.data_);
  std::swap(size_, o.size_);
  std::swap(mapped_, o.mapped_);
  return *this;
}

HostRegion::~HostRegion() {
  if (data_ != nullptr) ::munmap(data_, mapped_);
}

}  // namespace strata
