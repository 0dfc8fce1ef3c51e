// Host memory for IO buffers, on a 2 MiB boundary and advised for
// transparent huge pages: a 1 MiB request from scattered 4 KiB pages is up
// to 256 DMA segments, and a virtio disk served such buffers 2-5x slower
// than huge pages (docs/perf/nvme.md). Not locked; unmapped with the object.
#pragma once

#include <cstddef>
#include <span>

#include "runtime/status.h"

namespace strata {

class HostRegion {
 public:
  HostRegion() = default;
  // `bytes` of fresh zeroed memory (rounded up to 4096, or to 2 MiB from
  // 2 MiB on, so that huge pages back all of it); ResourceExhausted when the
  // mapping is refused.
  static Result<HostRegion> Map(size_t bytes);
  HostRegion(HostRegion&& o) noexcept { *this = std::move(o); }
  HostRegion& operator=(HostRegion&& o) noexcept;
  HostRegion(const HostRegion&) = delete;
  HostRegion& operator=(const HostRegion&) = delete;
  ~HostRegion();

  std::byte* data() const { return data_; }
  size_t size() const { return size_; }  // as asked, not rounded
  std::span<std::byte> span() const { return {data_, size_}; }

 private:
  std::byte* data_ = nullptr;
  size_t size_ = 0, mapped_ = 0;
};

}  // namespace strata
