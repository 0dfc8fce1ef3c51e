// The gradient path (offload/grad_path.h). Why it is shaped this way:
//   - One rank never packs: the statistics run on the trainer's tensors piece
//     by piece, and the D2H copies each piece straight into a pinned ring
//     slot. On a GPU that is one read of the gradients (the statistics) and
//     2 bytes per bf16 element over PCIe, with no device buffer at all.
//   - Several ranks must reduce first: pack into one bucket (every rank's
//     block of a sub-group, in the wire dtype, pre-divided by the world
//     size), reduce-scatter, statistics of the rank's block, D2H into the
//     host shard buffer. The reduced block cannot wait on the device for the
//     decision (the bucket is reused), so it waits on the host, in the wire
//     dtype.
//   - The accumulation buffer is fp32 and pageable: no DMA targets it (the
//     D2H lands in pinned memory first), and it exists only when a trainer
//     hands over several micro-steps.
#include "offload/grad_path.h"

#include <fmt/format.h>

#include <algorithm>
#include <cstring>

#include "kernels/kernels.h"
#include "runtime/dtype.h"

namespace strata::internal {
namespace {

uint64_t Round16(uint64_t b) { return (b + 15) / 16 * 16; }

float LoadAsF32(const std::byte* p, DType dtype, uint64_t k) {
  switch (dtype) {
    case DType::kBF16: {
      uint16_t h;
      std::memcpy(&h, p + 2 * k, 2);
      return BF16ToF32(h);
    }
    case DType::kF16: {
      uint16_t h;
      std::memcpy(&h, p + 2 * k, 2);
      return F16ToF32(h);
    }
    default: {
      float f;
      std::memcpy(&f, p + 4 * k, 4);
      return f;
    }
  }
}

// dst[k] (+)= float(src[k]): the first micro-step converts, later ones add
// in fp32, in element order (exact sums of the same values every time).
void AddInto(float* dst, const std::byte* src, DType dtype, uint64_t elems, bool first) {
  if (first) {
    for (uint64_t k = 0; k < elems; ++k) dst[k] = LoadAsF32(src, dtype, k);
  } else {
    for (uint64_t k = 0; k < elems; ++k) dst[k] += LoadAsF32(src, dtype, k);
  }
}

}  // namespace

uint64_t GradPath::PinnedBytes(int world, uint64_t shard_elems, uint64_t max_sub_group_elems,
                               uint32_t slots, DType wire) {
  return world == 1 ? uint64_t{slots} * max_sub_group_elems * DTypeSize(wire)
                    : shard_elems * DTypeSize(wire);
}

Result<std::unique_ptr<GradPath>> GradPath::Create(const GradPathOptions& options) {
  std::unique_ptr<GradPath> g(new GradPath(options));
  STRATA_RETURN_IF_ERROR(g->Init());
  return g;
}

GradPath::~GradPath() {
  if (o_.device != nullptr && o_.stream) o_.device->StreamSynchronize(o_.stream).IgnoreError();
}

Status GradPath::Init() {
  Device& dev = *o_.device;
  wire_ = o_.world == 1 ? o_.grad_dtype : o_.wire_dtype;
  wire_bytes_ = DTypeSize(wire_);
  const uint32_t n = static_cast<uint32_t>(o_.sub_groups.size());
  for (const ElemRange& r : o_.sub_groups) max_elems_ = std::max(max_elems_, r.elems());
  if (o_.world == 1) {
    const uint64_t slot_bytes = (max_elems_ * wire_bytes_ + 4095) / 4096 * 4096;
    for (uint32_t s = 0; s < o_.slots; ++s) {
      STRATA_ASSIGN_OR_RETURN(PinnedBuffer b, AllocatePinned(dev, slot_bytes));
      ring_.push_back(std::move(b));
      STRATA_ASSIGN_OR_RETURN(Event e, dev.CreateEvent());
      ring_events_.push_back(std::move(e));
    }
  } else {
    STRATA_ASSIGN_OR_RETURN(shard_buf_, AllocatePinned(dev, o_.shard.elems() * wire_bytes_));
    STRATA_ASSIGN_OR_RETURN(bucket_,
                            dev.Allocate(uint64_t(o_.world) * max_elems_ * wire_bytes_));
  }
  uint64_t stats_bytes = 0;
  for (uint32_t i = 0; i < n; ++i) {
    piece_base_.push_back(stats_offset_.size());
    for (const TensorMap::Piece& p : o_.map->own(i)) {
      stats_offset_.push_back(stats_bytes);
      stats_bytes += Round16(kernels::GradStatsBufferBytes(p.elems));
    }
  }
  piece_base_.push_back(stats_offset_.size());
  if (stats_bytes > 0) {
    STRATA_ASSIGN_OR_RETURN(stats_dev_, dev.Allocate(stats_bytes));
    STRATA_ASSIGN_OR_RETURN(stats_host_, AllocatePinned(dev, stats_bytes));
  }
  STRATA_ASSIGN_OR_RETURN(user_event_, dev.CreateEvent());
  STRATA_ASSIGN_OR_RETURN(done_event_, dev.CreateEvent());
  reduced_.assign(n, 0);
  accum_has_.assign(n, 0);
  kept_has_.assign(n, 0);
  return OkStatus();
}

GradPath::Source GradPath::SourceOf(uint32_t i) const {
  if (kept_has_[i]) return Source::kKept;
  if (micro_steps_ > 0) return Source::kAccum;
  return o_.world == 1 ? Source::kRing : Source::kShard;
}

Status GradPath::OrderAfterUser() {
  STRATA_RETURN_IF_ERROR(o_.device->RecordEvent(user_event_, o_.user_stream));
  return o_.device->StreamWaitEvent(o_.stream, user_event_);
}

// The statistics of sub-group i's pieces into their regions of stats_dev_:
// from the trainer's tensors (base == nullptr) or from `base` (the reduced
// block, sub-group relative, in `dtype`).
Status GradPath::StatsOfPieces(uint32_t i, const std::byte* base, DType dtype) {
  Device& dev = *o_.device;
  const auto pieces = o_.map->own(i);
  uint64_t bytes = 0;
  for (const TensorMap::Piece& p : pieces) bytes += p.elems * DTypeSize(dtype);
  return TimedOnStream(
      dev, o_.stream, &device_clock_, *o_.trace,
      {TraceTrack::kDevice, "grad stats", static_cast<int32_t>(i), bytes, nullptr}, [&]() -> Status {
        for (size_t k = 0; k < pieces.size(); ++k) {
          const TensorMap::Piece& p = pieces[k];
          const std::byte* src =
              base != nullptr
                  ? base + p.offset_elems * DTypeSize(dtype)
                  : static_cast<const std::byte*>((*o_.params)[p.tensor].grad) +
                        p.tensor_offset_elems * DTypeSize(dtype);
          const uint64_t at = stats_offset_[piece_base_[i] + k];
          STRATA_RETURN_IF_ERROR(kernels::GradStats(
              dev, o_.stream, {src, p.elems, dtype}, 1.0f, stats_dev_.as<std::byte>() + at,
              kernels::GradStatsBufferBytes(p.elems)));
        }
        return OkStatus();
      });
}

Status GradPath::Reduce(uint32_t i) {
  if (reduced_[i]) return OkStatus();
  Device& dev = *o_.device;
  STRATA_RETURN_IF_ERROR(OrderAfterUser());
  const uint64_t elems = o_.sub_groups[i].elems();
  const int32_t sg = static_cast<int32_t>(i);
  if (o_.world == 1) {
    STRATA_RETURN_IF_ERROR(StatsOfPieces(i, nullptr, o_.grad_dtype));
  } else {
    std::byte* bucket = bucket_.as<std::byte>();
    std::byte* mine = bucket + o_.rank * elems * wire_bytes_;
    STRATA_RETURN_IF_ERROR(TimedOnStream(
        dev, o_.stream, &device_clock_, *o_.trace,
        {TraceTrack::kDevice, "pack", sg, o_.world * elems * wire_bytes_, nullptr}, [&] {
          return kernels::PackGrads(dev, o_.stream, o_.map->pack(i),
                                    {bucket, o_.world * elems, wire_},
                                    1.0f / static_cast<float>(o_.world));
        }));
    STRATA_RETURN_IF_ERROR(TimedOnStream(
        dev, o_.stream, &comm_clock_, *o_.trace,
        {TraceTrack::kComm, "reduce-scatter", sg, o_.world * elems * wire_bytes_, nullptr}, [&] {
          return o_.comm->ReduceScatter(bucket, mine, elems, wire_, ReduceOp::kSum, o_.stream);
        }));
    STRATA_RETURN_IF_ERROR(StatsOfPieces(i, mine, wire_));
    std::byte* dst = shard_buf_.data() + Rel(i) * wire_bytes_;
    STRATA_RETURN_IF_ERROR(TimedOnStream(
        dev, o_.stream, &d2h_clock_, *o_.trace,
        {TraceTrack::kD2H, "d2h", sg, elems * wire_bytes_, nullptr}, [&] {
          return dev.CopyAsync(dst, mine, elems * wire_bytes_, CopyKind::kDeviceToHost, o_.stream);
        }));
    d2h_bytes_ += elems * wire_bytes_;
  }
  reduced_[i] = 1;
  ++reduced_count_;
  return OkStatus();
}

Status GradPath::ReduceRest() {
  for (uint32_t i = 0; i < reduced_.size(); ++i) {
    if (!reduced_[i]) STRATA_RETURN_IF_ERROR(Reduce(i));
  }
  return OkStatus();
}

Status GradPath::CopyDown(uint32_t i, std::byte* dst, const char* what) {
  Device& dev = *o_.device;
  const auto pieces = o_.map->own(i);
  uint64_t bytes = 0;
  for (const TensorMap::Piece& p : pieces) bytes += p.elems * wire_bytes_;
  d2h_bytes_ += bytes;
  return TimedOnStream(dev, o_.stream, &d2h_clock_, *o_.trace,
                       {TraceTrack::kD2H, what, static_cast<int32_t>(i), bytes, nullptr},
                       [&]() -> Status {
                         for (const TensorMap::Piece& p : pieces) {
                           const auto* src =
                               static_cast<const std::byte*>((*o_.params)[p.tensor].grad) +
                               p.tensor_offset_elems * wire_bytes_;
                           STRATA_RETURN_IF_ERROR(dev.CopyAsync(
                               dst + p.offset_elems * wire_bytes_, src, p.elems * wire_bytes_,
                               CopyKind::kDeviceToHost, o_.stream));
                         }
                         return OkStatus();
                       });
}

Status GradPath::Accumulate() {
  Device& dev = *o_.device;
  const uint32_t n = static_cast<uint32_t>(o_.sub_groups.size());
  if (accum_.empty()) accum_.assign(o_.shard.elems(), 0.0f);
  if (o_.world == 1) {
    STRATA_RETURN_IF_ERROR(OrderAfterUser());
    for (uint32_t i = 0; i < n; ++i) {
      std::byte* slot = ring_[i % ring_.size()].data();
      STRATA_RETURN_IF_ERROR(CopyDown(i, slot, "d2h"));
      std::vector<TensorMap::Piece> pieces(o_.map->own(i).begin(), o_.map->own(i).end());
      float* dst = accum_.data() + Rel(i);
      const bool first = !accum_has_[i];
      const DType wire = wire_;
      const size_t wb = wire_bytes_;
      STRATA_RETURN_IF_ERROR(dev.LaunchHostFunc(o_.stream, [pieces, dst, slot, first, wire, wb] {
        for (const TensorMap::Piece& p : pieces) {
          AddInto(dst + p.offset_elems, slot + p.offset_elems * wb, wire, p.elems, first);
        }
      }));
      accum_has_[i] = 1;
    }
  } else {
    STRATA_RETURN_IF_ERROR(ReduceRest());
    for (uint32_t i = 0; i < n; ++i) {
      float* dst = accum_.data() + Rel(i);
      const std::byte* src = shard_buf_.data() + Rel(i) * wire_bytes_;
      const bool first = !accum_has_[i];
      const uint64_t elems = o_.sub_groups[i].elems();
      const DType wire = wire_;
      STRATA_RETURN_IF_ERROR(dev.LaunchHostFunc(
          o_.stream, [dst, src, wire, elems, first] { AddInto(dst, src, wire, elems, first); }));
      accum_has_[i] = 1;
    }
  }
  // The trainer may reuse its grad tensors once this returns: its stream
  // waits for the copies that read them.
  STRATA_RETURN_IF_ERROR(dev.RecordEvent(done_event_, o_.stream));
  STRATA_RETURN_IF_ERROR(dev.StreamWaitEvent(o_.user_stream, done_event_));
  ResetMicroStep();
  ++micro_steps_;
  return OkStatus();
}

Result<GradStats> GradPath::LocalStats() {
  Device& dev = *o_.device;
  GradStats total;
  const uint32_t n = static_cast<uint32_t>(o_.sub_groups.size());
  if (micro_steps_ > 0) {
    STRATA_RETURN_IF_ERROR(dev.StreamSynchronize(o_.stream));
    const double t0 = NowSec();
    HostSlice slice(*o_.trace, {TraceTrack::kStep, "grad stats (host)"});
    for (uint32_t i = 0; i < n; ++i) {
      for (const TensorMap::Piece& p : o_.map->own(i)) {
        STRATA_ASSIGN_OR_RETURN(
            kernels::DeviceGradStats s,
            kernels::GradStatsOnHost({accum_.data() + Rel(i) + p.offset_elems, p.elems,
                                      DType::kF32},
                                     1.0f));
        total.sum_sq += s.sum_sq;
        total.nonfinite_elems += s.nonfinite_elems;
      }
    }
    host_stats_sec_ += NowSec() - t0;
    return total;
  }
  STRATA_RETURN_IF_ERROR(ReduceRest());
  if (stats_dev_.data() != nullptr) {
    STRATA_RETURN_IF_ERROR(dev.CopyAsync(stats_host_.data(), stats_dev_.data(),
                                         stats_dev_.bytes(), CopyKind::kDeviceToHost, o_.stream));
  }
  STRATA_RETURN_IF_ERROR(dev.StreamSynchronize(o_.stream));
  for (uint64_t k = 0; k < stats_offset_.size(); ++k) {
    kernels::DeviceGradStats s;
    std::memcpy(&s, stats_host_.data() + stats_offset_[k], sizeof(s));
    total.sum_sq += s.sum_sq;
    total.nonfinite_elems += s.nonfinite_elems;
  }
  return total;
}

Status GradPath::Fetch(uint32_t i, uint32_t slot) {
  if (SourceOf(i) != Source::kRing) return OkStatus();
  std::byte* dst = ring_[slot].data();
  for (const ElemRange& pad : o_.map->padding(i)) {
    std::memset(dst + pad.begin * wire_bytes_, 0, pad.elems() * wire_bytes_);
  }
  STRATA_RETURN_IF_ERROR(CopyDown(i, dst, "d2h"));
  return o_.device->RecordEvent(ring_events_[slot], o_.stream);
}

Result<GradView> GradPath::Wait(uint32_t i, uint32_t slot) {
  const uint64_t elems = o_.sub_groups[i].elems();
  switch (SourceOf(i)) {
    case Source::kRing:
      STRATA_RETURN_IF_ERROR(o_.device->EventSynchronize(ring_events_[slot]));
      return GradView{wire_, ring_[slot].data(), elems};
    case Source::kShard:
      return GradView{wire_, shard_buf_.data() + Rel(i) * wire_bytes_, elems};
    case Source::kAccum:
      return GradView{DType::kF32, accum_.data() + Rel(i), elems};
    case Source::kKept:
      return GradView{wire_, kept_.data() + Rel(i) * wire_bytes_, elems};
  }
  return InternalError("gradient path: unknown source");
}

Status GradPath::Keep(uint32_t i) {
  if (SourceOf(i) != Source::kRing) return OkStatus();  // the buffer keeps it
  if (kept_.empty()) kept_.assign(o_.shard.elems() * wire_bytes_, std::byte{0});
  STRATA_RETURN_IF_ERROR(CopyDown(i, kept_.data() + Rel(i) * wire_bytes_, "keep grads"));
  STRATA_RETURN_IF_ERROR(o_.device->StreamSynchronize(o_.stream));
  kept_has_[i] = 1;
  return OkStatus();
}

void GradPath::Consume() {
  ResetMicroStep();
  micro_steps_ = 0;
  std::fill(accum_has_.begin(), accum_has_.end(), 0);
  std::fill(kept_has_.begin(), kept_has_.end(), 0);
  kept_.clear();
  kept_.shrink_to_fit();
}

void GradPath::ResetMicroStep() {
  std::fill(reduced_.begin(), reduced_.end(), 0);
  reduced_count_ = 0;
}

GradPathTimes GradPath::TakeTimes() {
  GradPathTimes t{d2h_clock_.busy, comm_clock_.busy, device_clock_.busy, host_stats_sec_,
                  d2h_bytes_};
  d2h_clock_.busy = comm_clock_.busy = device_clock_.busy = 0;
  host_stats_sec_ = 0;
  d2h_bytes_ = 0;
  return t;
}

}  // namespace strata::internal
