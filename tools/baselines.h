// Same-run baselines the benchmarks judge the engine against: what the
// machine's link and drive do alone, measured the way the engine uses them.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "runtime/device.h"
#include "runtime/status.h"

namespace strata::cli {

// The median of the figures of several runs (0 for none).
inline double Median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 == 1 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2;
}

// A bench's --drive-probe: a size, 0 (no drive baseline), or "auto"
// (nullopt: the bench chooses); InvalidArgument saying so otherwise.
Result<std::optional<uint64_t>> ParseDriveProbe(std::string_view text);

// A 2 MiB-aligned host array advised for transparent huge pages: what the
// CPU-side baselines and `bench adam` run on, so that the kernel and its
// baseline get the same TLB and the same alignment (the optimizer streams its
// output where the output is aligned, as the engine's pinned slots are).
class HostArray {
 public:
  static Result<HostArray> Create(size_t bytes, std::string_view name);
  template <class T>
  std::span<T> As() const {
    return {reinterpret_cast<T*>(data_.get()), bytes_ / sizeof(T)};
  }
  std::byte* data() const { return data_.get(); }
  size_t bytes() const { return bytes_; }

 private:
  struct Free {
    void operator()(std::byte* p) const;
  };
  std::unique_ptr<std::byte, Free> data_;
  size_t bytes_ = 0;
};

// The link between host and device, each direction alone: Device::CopyAsync
// of pinned host memory (AllocateHost) in `bytes` copies, best of a few
// (bench pcie's pinned figure). On the host device it is the modelled link
// (or memcpy speed without one).
struct LinkRates {
  double h2d_bytes_per_sec = 0;
  double d2h_bytes_per_sec = 0;
};
Result<LinkRates> MeasureLinkRates(Device& device, size_t bytes);

// The drive under `dirs`, reads alone and writes alone: one file of
// `bytes_per_dir` per directory, sequential, `block_bytes` requests with
// `queue_depth` in flight per file, one thread per file, O_DIRECT where the
// filesystem allows (the engine's IO shape; bench nvme's figure). The files
// are laid out first, then overwritten (the write rate), then read; they are
// removed afterwards, also on Ctrl-C.
struct DriveRates {
  double read_bytes_per_sec = 0;
  double write_bytes_per_sec = 0;
  uint64_t bytes = 0;  // per pass, over every directory
  bool direct = false;  // O_DIRECT (else the page cache is measured too)
  // Reads of one file and writes of another at once (`bytes` each), as a
  // step's read-ahead and write-behind run: bytes moved both ways / time.
  double mixed_bytes_per_sec = 0;
  // A durable write of new files, as a checkpoint save makes: the first
  // pass into the probe's new files, then their fdatasync. Below
  // write_bytes_per_sec (an overwrite of those files, not synced) by the
  // allocation and by the time the drive's (or the host's) write cache
  // takes to drain.
  double synced_write_bytes_per_sec = 0;
};
// Writes two files of `bytes_per_dir` (whole blocks) under each directory
// and measures reads, writes and both at once; the files are removed
// afterwards. A probe that would not fit in the free space is refused before
// it writes, naming `size_flag` (the caller's option for the size) and
// saying `skip_hint` (how to do without the probe).
Result<DriveRates> MeasureDriveRates(std::span<const std::string> dirs, uint64_t bytes_per_dir,
                                     uint64_t block_bytes, uint32_t queue_depth,
                                     std::string_view size_flag, std::string_view skip_hint);

// The most bytes each of `files_per_dir` files in every directory of `dirs`
// may take: all of them within 9/10 of the free space of each filesystem
// (directories on one filesystem share it), in whole blocks; 0 when not one
// block fits.
Result<uint64_t> ProbeRoom(std::span<const std::string> dirs, uint32_t files_per_dir,
                           uint64_t block_bytes);
// ResourceExhausted when `file_bytes` exceeds ProbeRoom, saying the size
// that fits (`size_flag`: the caller's option for the total over `dirs`) and
// `other_way` (what else to do).
Status CheckProbeFits(std::span<const std::string> dirs, uint32_t files_per_dir,
                      uint64_t file_bytes, uint64_t block_bytes, std::string_view size_flag,
                      std::string_view other_way);

}  // namespace strata::cli
