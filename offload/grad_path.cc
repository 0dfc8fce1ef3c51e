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

// AddInto over `cpu`'s threads, in blocks of 1 Mi elements.
void AddIntoParallel(CpuAdam* cpu, float* dst, const std::byte* src, DType dtype, uint64_t elems,
                     bool first) {
  constexpr uint64_t kGrain = uint64_t{1} << 20;
  if (cpu == nullptr || elems <= kGrain) {
    AddInto(dst, src, dtype, elems, first);
    return;
  }
  const size_t bytes = DTypeSize(dtype);
  cpu->ParallelFor(elems, kGrain, [&](size_t begin, size_t count) {
    AddInto(dst + begin, src + begin * bytes, dtype, count, first);
  });
}

}  // namespace

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
  uint64_t host_max_elems = 0;
  for (uint32_t i = 0; i < n; ++i) {
    const uint64_t e = o_.sub_groups[i].elems();
    max_elems_ = std::max(max_elems_, e);
    if (on_device(i)) {
      device_elems_ += e;
    } else {
      host_max_elems = std::max(host_max_elems, e);
    }
  }
  if (o_.world == 1) {
    const uint64_t slot_bytes = (host_max_elems * wire_bytes_ + 4095) / 4096 * 4096;
    for (uint32_t s = 0; s < o_.slots; ++s) {
      STRATA_ASSIGN_OR_RETURN(PinnedBuffer b, AllocatePinned(dev, slot_bytes));
      ring_.push_back(std::move(b));
      STRATA_ASSIGN_OR_RETURN(Event e, dev.CreateEvent());
      ring_events_.push_back(std::move(e));
    }
  } else {
    STRATA_ASSIGN_OR_RETURN(
        shard_buf_, AllocatePinned(dev, (o_.shard.elems() - device_elems_) * wire_bytes_));
    STRATA_ASSIGN_OR_RETURN(bucket_,
                            dev.Allocate(uint64_t(o_.world) * max_elems_ * wire_bytes_));
    if (device_elems_ > 0) {
      STRATA_ASSIGN_OR_RETURN(dev_grad_, dev.Allocate(device_elems_ * wire_bytes_));
    }
  }
  uint64_t stats_bytes = 0;
  for (uint32_t i = 0; i < n; ++i) {
    if (i == o_.device_sub_groups) device_stats_bytes_ = stats_bytes;
    piece_base_.push_back(stats_offset_.size());
    for (const TensorMap::Piece& p : o_.map->own(i)) {
      stats_offset_.push_back(stats_bytes);
      stats_bytes += Round16(kernels::GradStatsBufferBytes(p.elems));
    }
  }
  piece_base_.push_back(stats_offset_.size());
  if (o_.device_sub_groups >= n) device_stats_bytes_ = stats_bytes;
  if (stats_bytes > 0) {
    STRATA_ASSIGN_OR_RETURN(stats_dev_, dev.Allocate(stats_bytes));
    STRATA_ASSIGN_OR_RETURN(stats_host_, AllocatePinned(dev, stats_bytes));
  }
  STRATA_ASSIGN_OR_RETURN(user_event_, dev.CreateEvent());
  STRATA_ASSIGN_OR_RETURN(done_event_, dev.CreateEvent());
  reduced_.assign(n, 0);
  complete_.assign(n, 0);
  next_ = n;
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
  return OrderAfter(*o_.device, o_.stream, o_.user_stream, user_event_);
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
    if (on_device(i)) {
      // It stays on the device, where it is updated.
      std::byte* dst = dev_grad_.as<std::byte>() + Rel(i) * wire_bytes_;
      STRATA_RETURN_IF_ERROR(TimedOnStream(
          dev, o_.stream, &device_clock_, *o_.trace,
          {TraceTrack::kDevice, "d2d", sg, elems * wire_bytes_, nullptr}, [&] {
            return dev.CopyAsync(dst, mine, elems * wire_bytes_, CopyKind::kDeviceToDevice,
                                 o_.stream);
          }));
    } else {
      std::byte* dst = shard_buf_.data() + HostRel(i) * wire_bytes_;
      STRATA_RETURN_IF_ERROR(TimedOnStream(
          dev, o_.stream, &d2h_clock_, *o_.trace,
          {TraceTrack::kD2H, "d2h", sg, elems * wire_bytes_, nullptr}, [&] {
            return dev.CopyAsync(dst, mine, elems * wire_bytes_, CopyKind::kDeviceToHost,
                                 o_.stream);
          }));
      d2h_bytes_ += elems * wire_bytes_;
    }
  }
  reduced_[i] = 1;
  ++reduced_count_;
  return OkStatus();
}

Status GradPath::Ready(uint32_t i) {
  if (o_.world == 1) return Reduce(i);  // no collective: any order
  complete_[i] = 1;
  while (next_ > 0 && complete_[next_ - 1]) {
    STRATA_RETURN_IF_ERROR(Reduce(next_ - 1));
    --next_;
  }
  return OkStatus();
}

Status GradPath::ReduceRest() {
  for (uint32_t i = static_cast<uint32_t>(reduced_.size()); i-- > 0;) {
    if (!reduced_[i]) STRATA_RETURN_IF_ERROR(Reduce(i));
  }
  next_ = 0;
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

Status GradPath::EnsureDeviceBuffer(DeviceBuffer& buf, uint64_t bytes) {
  if (buf.data() != nullptr || bytes == 0) return OkStatus();
  const uint64_t floats = (bytes + 3) / 4;
  STRATA_ASSIGN_OR_RETURN(buf, o_.device->Allocate(floats * 4));
  // Padding is never written: zero, as the host buffers are.
  return kernels::PackGrads(*o_.device, o_.stream, {}, {buf.data(), floats, DType::kF32});
}

Status GradPath::Accumulate() {
  STRATA_RETURN_IF_ERROR(torn_sum_);
  Device& dev = *o_.device;
  if (accum_.empty()) accum_.assign(o_.shard.elems() - device_elems_, 0.0f);
  if (o_.world == 1) {
    STRATA_RETURN_IF_ERROR(OrderAfterUser());
  } else {
    STRATA_RETURN_IF_ERROR(ReduceRest());
    // The packs have read the trainer's tensors: its stream waits for them,
    // not for the additions below (on CUDA, host functions on one CPU thread
    // the GPU would sit idle behind).
    STRATA_RETURN_IF_ERROR(OrderAfter(dev, o_.user_stream, o_.stream, done_event_));
  }
  STRATA_RETURN_IF_ERROR(EnsureDeviceBuffer(dev_accum_, device_elems_ * 4));
  // From here on a failure leaves some sub-groups with this micro-step
  // added and others without: a sum of no number of micro-steps.
  Status added = AddMicroStep();
  if (added.ok() && o_.world == 1) {
    // One rank: the trainer may reuse its grad tensors once this returns: its
    // stream waits for the copies that read them (each ring slot's next copy
    // waits for the addition that reads it, so that is all of them).
    added = OrderAfter(dev, o_.user_stream, o_.stream, done_event_);
  }
  if (!added.ok()) {
    torn_sum_ = FailedPreconditionError(fmt::format(
        "the accumulated gradients are incomplete: adding micro-step {} failed part way ({}); "
        "ZeroGrad() drops them, then run the micro-steps again",
        micro_steps_ + 1, added.ToString()));
    return added;
  }
  ResetMicroStep();
  ++micro_steps_;
  return OkStatus();
}

Status GradPath::AddMicroStep() {
  Device& dev = *o_.device;
  const uint32_t n = static_cast<uint32_t>(o_.sub_groups.size());
  for (uint32_t i = 0; i < n; ++i) {
    const bool first = !accum_has_[i];
    accum_has_[i] = 1;
    if (on_device(i)) {
      // On the device, piece by piece: the first micro-step converts, later
      // ones add in fp32 (kernels::Cast and Accumulate are AddInto's
      // operations bit for bit).
      float* dst = dev_accum_.as<float>() + Rel(i);
      auto add = [&](const void* src, uint64_t at, uint64_t elems) {
        const kernels::ConstDeviceTensor from{src, elems, wire_};
        const kernels::DeviceTensor to{dst + at, elems, DType::kF32};
        return first ? kernels::Cast(dev, o_.stream, from, to)
                     : kernels::Accumulate(dev, o_.stream, from, to);
      };
      if (o_.world == 1) {
        for (const TensorMap::Piece& p : o_.map->own(i)) {
          const auto* src = static_cast<const std::byte*>((*o_.params)[p.tensor].grad) +
                            p.tensor_offset_elems * wire_bytes_;
          STRATA_RETURN_IF_ERROR(add(src, p.offset_elems, p.elems));
        }
      } else {
        STRATA_RETURN_IF_ERROR(add(dev_grad_.as<std::byte>() + Rel(i) * wire_bytes_, 0,
                                   o_.sub_groups[i].elems()));
      }
      continue;
    }
    float* dst = accum_.data() + HostRel(i);
    if (o_.world == 1) {
      std::byte* slot = ring_[i % ring_.size()].data();
      STRATA_RETURN_IF_ERROR(CopyDown(i, slot, "d2h"));
      std::vector<TensorMap::Piece> pieces(o_.map->own(i).begin(), o_.map->own(i).end());
      const DType wire = wire_;
      const size_t wb = wire_bytes_;
      CpuAdam* cpu = o_.cpu;
      STRATA_RETURN_IF_ERROR(
          dev.LaunchHostFunc(o_.stream, [pieces, dst, slot, first, wire, wb, cpu] {
            for (const TensorMap::Piece& p : pieces) {
              AddIntoParallel(cpu, dst + p.offset_elems, slot + p.offset_elems * wb, wire,
                              p.elems, first);
            }
          }));
    } else {
      const std::byte* src = shard_buf_.data() + HostRel(i) * wire_bytes_;
      const uint64_t elems = o_.sub_groups[i].elems();
      const DType wire = wire_;
      CpuAdam* cpu = o_.cpu;
      STRATA_RETURN_IF_ERROR(dev.LaunchHostFunc(o_.stream, [cpu, dst, src, wire, elems, first] {
        AddIntoParallel(cpu, dst, src, wire, elems, first);
      }));
    }
  }
  return OkStatus();
}

Result<GradStats> GradPath::LocalStats() {
  STRATA_RETURN_IF_ERROR(torn_sum_);
  Device& dev = *o_.device;
  GradStats total;
  const uint32_t n = static_cast<uint32_t>(o_.sub_groups.size());
  if (micro_steps_ > 0) {
    // The device sub-groups' sums on the device, the others' on the host:
    // the same numbers (kernels::GradStats and its host twin agree bit for
    // bit), added in the same order.
    for (uint32_t i = 0; i < o_.device_sub_groups; ++i) {
      STRATA_RETURN_IF_ERROR(StatsOfPieces(
          i, reinterpret_cast<const std::byte*>(dev_accum_.as<float>() + Rel(i)), DType::kF32));
    }
    if (device_stats_bytes_ > 0) {
      STRATA_RETURN_IF_ERROR(dev.CopyAsync(stats_host_.data(), stats_dev_.data(),
                                           device_stats_bytes_, CopyKind::kDeviceToHost,
                                           o_.stream));
    }
    STRATA_RETURN_IF_ERROR(dev.StreamSynchronize(o_.stream));
    const double t0 = NowSec();
    HostSlice slice(*o_.trace, {TraceTrack::kStep, "grad stats (host)"});
    for (uint32_t i = 0; i < n; ++i) {
      const auto pieces = o_.map->own(i);
      for (size_t k = 0; k < pieces.size(); ++k) {
        const TensorMap::Piece& p = pieces[k];
        kernels::DeviceGradStats s;
        if (on_device(i)) {
          std::memcpy(&s, stats_host_.data() + stats_offset_[piece_base_[i] + k], sizeof(s));
        } else {
          STRATA_ASSIGN_OR_RETURN(
              s, kernels::GradStatsOnHost(
                     {accum_.data() + HostRel(i) + p.offset_elems, p.elems, DType::kF32}, 1.0f));
        }
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
  Status s = CopyDown(i, dst, "d2h");
  if (s.ok()) s = o_.device->RecordEvent(ring_events_[slot], o_.stream);
  // Copies queued before a failure still land in the slot, and the slot's
  // event does not cover them: wait for them here, or the slot's next
  // fetch (its padding zeroed on the host at once) would be overwritten.
  if (!s.ok()) (void)o_.device->StreamSynchronize(o_.stream);
  return s;
}

Result<GradView> GradPath::Wait(uint32_t i, uint32_t slot) {
  const uint64_t elems = o_.sub_groups[i].elems();
  switch (SourceOf(i)) {
    case Source::kRing:
      STRATA_RETURN_IF_ERROR(o_.device->EventSynchronize(ring_events_[slot]));
      return GradView{wire_, ring_[slot].data(), elems};
    case Source::kShard:
      return GradView{wire_, shard_buf_.data() + HostRel(i) * wire_bytes_, elems};
    case Source::kAccum:
      return GradView{DType::kF32, accum_.data() + HostRel(i), elems};
    case Source::kKept:
      return GradView{wire_, kept_.data() + HostRel(i) * wire_bytes_, elems};
  }
  return InternalError("gradient path: unknown source");
}

DeviceGradView GradPath::DeviceGrad(uint32_t i) const {
  const auto at = [&](const DeviceBuffer& b, size_t bytes) {
    return b.as<std::byte>() + Rel(i) * bytes;
  };
  if (kept_has_[i]) return {at(dev_grad_, wire_bytes_), wire_};
  if (micro_steps_ > 0) return {at(dev_accum_, 4), DType::kF32};
  if (o_.world == 1) return {nullptr, wire_};
  return {at(dev_grad_, wire_bytes_), wire_};
}

Status GradPath::Keep(uint32_t i) {
  if (SourceOf(i) != Source::kRing) return OkStatus();  // the buffer keeps it
  if (on_device(i)) {
    // The trainer's tensors, copied on the device.
    Device& dev = *o_.device;
    STRATA_RETURN_IF_ERROR(EnsureDeviceBuffer(dev_grad_, device_elems_ * wire_bytes_));
    std::byte* dst = dev_grad_.as<std::byte>() + Rel(i) * wire_bytes_;
    for (const TensorMap::Piece& p : o_.map->own(i)) {
      const auto* src = static_cast<const std::byte*>((*o_.params)[p.tensor].grad) +
                        p.tensor_offset_elems * wire_bytes_;
      STRATA_RETURN_IF_ERROR(dev.CopyAsync(dst + p.offset_elems * wire_bytes_, src,
                                           p.elems * wire_bytes_, CopyKind::kDeviceToDevice,
                                           o_.stream));
    }
    STRATA_RETURN_IF_ERROR(dev.StreamSynchronize(o_.stream));
    kept_has_[i] = 1;
    return OkStatus();
  }
  if (kept_.empty()) kept_.assign((o_.shard.elems() - device_elems_) * wire_bytes_, std::byte{0});
  STRATA_RETURN_IF_ERROR(CopyDown(i, kept_.data() + HostRel(i) * wire_bytes_, "keep grads"));
  STRATA_RETURN_IF_ERROR(o_.device->StreamSynchronize(o_.stream));
  kept_has_[i] = 1;
  return OkStatus();
}

void GradPath::Consume() {
  torn_sum_ = OkStatus();
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
  std::fill(complete_.begin(), complete_.end(), 0);
  next_ = static_cast<uint32_t>(reduced_.size());
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
