#include "offload/param_publisher.h"

#include <algorithm>
#include <cstring>

#include "kernels/kernels.h"

namespace strata::internal {

Result<std::unique_ptr<ParamPublisher>> ParamPublisher::Create(
    const ParamPublisherOptions& options) {
  std::unique_ptr<ParamPublisher> p(new ParamPublisher(options));
  STRATA_RETURN_IF_ERROR(p->Init());
  return p;
}

ParamPublisher::~ParamPublisher() {
  if (stream_) o_.device->StreamSynchronize(stream_).IgnoreError();
}

Status ParamPublisher::Init() {
  Device& dev = *o_.device;
  param_bytes_ = DTypeSize(o_.param_dtype);
  uint64_t max_elems = 0, host_max_elems = 0;
  for (uint32_t i = 0; i < o_.sub_groups.size(); ++i) {
    max_elems = std::max(max_elems, o_.sub_groups[i].elems());
    if (i >= o_.device_sub_groups)
      host_max_elems = std::max(host_max_elems, o_.sub_groups[i].elems());
  }
  STRATA_ASSIGN_OR_RETURN(stream_, dev.CreateStream());
  for (uint32_t s = 0; s < o_.slots; ++s) {
    STRATA_ASSIGN_OR_RETURN(PinnedBuffer b, AllocatePinned(dev, host_max_elems * param_bytes_));
    staging_.push_back(std::move(b));
    STRATA_ASSIGN_OR_RETURN(Event e, dev.CreateEvent());
    slot_events_.push_back(std::move(e));
  }
  STRATA_ASSIGN_OR_RETURN(user_event_, dev.CreateEvent());
  STRATA_ASSIGN_OR_RETURN(done_event_, dev.CreateEvent());
  if (o_.world > 1) {
    STRATA_ASSIGN_OR_RETURN(bucket_, dev.Allocate(uint64_t(o_.world) * max_elems * param_bytes_));
  }
  return OkStatus();
}

Status ParamPublisher::OrderAfterUser() {
  return OrderAfter(*o_.device, stream_, o_.user_stream, user_event_);
}

Status ParamPublisher::WaitSlot(uint32_t slot) {
  return o_.device->EventSynchronize(slot_events_[slot]);
}

Status ParamPublisher::Publish(uint32_t i, uint32_t slot, PublishMode mode) {
  Device& dev = *o_.device;
  const uint64_t elems = o_.sub_groups[i].elems();
  const int32_t sg = static_cast<int32_t>(i);
  const std::byte* staging = staging_[slot].data();
  if (o_.world == 1) {
    if (mode == PublishMode::kUpload) {
      const auto pieces = o_.map->own(i);
      uint64_t bytes = 0;
      for (const TensorMap::Piece& p : pieces) bytes += p.elems * param_bytes_;
      h2d_bytes_ += bytes;
      STRATA_RETURN_IF_ERROR(TimedOnStream(
          dev, stream_, &h2d_clock_, *o_.trace, {TraceTrack::kH2D, "h2d", sg, bytes, nullptr},
          [&]() -> Status {
            for (const TensorMap::Piece& p : pieces) {
              auto* dst = static_cast<std::byte*>((*o_.params)[p.tensor].data) +
                          p.tensor_offset_elems * param_bytes_;
              STRATA_RETURN_IF_ERROR(dev.CopyAsync(dst, staging + p.offset_elems * param_bytes_,
                                                   p.elems * param_bytes_, CopyKind::kHostToDevice,
                                                   stream_));
            }
            return OkStatus();
          }));
    }
    return dev.RecordEvent(slot_events_[slot], stream_);
  }
  std::byte* mine = bucket_.as<std::byte>() + o_.rank * elems * param_bytes_;
  Status up = OkStatus();
  if (mode == PublishMode::kUpload) {
    h2d_bytes_ += elems * param_bytes_;
    up = TimedOnStream(dev, stream_, &h2d_clock_, *o_.trace,
                       {TraceTrack::kH2D, "h2d", sg, elems * param_bytes_, nullptr}, [&] {
                         return dev.CopyAsync(mine, staging, elems * param_bytes_,
                                              CopyKind::kHostToDevice, stream_);
                       });
  }
  // An upload that failed still joins the all-gather: the ranks' collectives match.
  STRATA_RETURN_IF_ERROR(GatherAndUnpack(i, up.ok() ? mode : PublishMode::kJoin));
  STRATA_RETURN_IF_ERROR(up);
  return dev.RecordEvent(slot_events_[slot], stream_);
}

Status ParamPublisher::GatherAndUnpack(uint32_t i, PublishMode mode) {
  Device& dev = *o_.device;
  const uint64_t elems = o_.sub_groups[i].elems();
  const int32_t sg = static_cast<int32_t>(i);
  std::byte* bucket = bucket_.as<std::byte>();
  std::byte* mine = bucket + o_.rank * elems * param_bytes_;
  STRATA_RETURN_IF_ERROR(TimedOnStream(
      dev, stream_, &comm_clock_, *o_.trace,
      {TraceTrack::kComm, "all-gather", sg, o_.world * elems * param_bytes_, nullptr},
      [&] { return o_.comm->AllGather(mine, bucket, elems, o_.param_dtype, stream_); }));
  if (mode == PublishMode::kJoin) return OkStatus();
  return TimedOnStream(
      dev, stream_, &device_clock_, *o_.trace,
      {TraceTrack::kDevice, "unpack", sg, o_.world * elems * param_bytes_, nullptr}, [&] {
        return kernels::UnpackParams(dev, stream_, {bucket, o_.world * elems, o_.param_dtype},
                                     o_.map->unpack(i));
      });
}

Status ParamPublisher::PublishDevice(uint32_t i, const float* master, const Event* after) {
  Device& dev = *o_.device;
  const uint64_t elems = o_.sub_groups[i].elems();
  const int32_t sg = static_cast<int32_t>(i);
  if (after != nullptr) STRATA_RETURN_IF_ERROR(dev.StreamWaitEvent(stream_, *after));
  if (o_.world == 1) {
    const auto pieces = o_.map->own(i);
    return TimedOnStream(
        dev, stream_, &device_clock_, *o_.trace,
        {TraceTrack::kDevice, "cast params", sg, elems * (4 + param_bytes_), "device"},
        [&]() -> Status {
          for (const TensorMap::Piece& p : pieces) {
            auto* dst = static_cast<std::byte*>((*o_.params)[p.tensor].data) +
                        p.tensor_offset_elems * param_bytes_;
            STRATA_RETURN_IF_ERROR(kernels::Cast(dev, stream_,
                                                 {master + p.offset_elems, p.elems, DType::kF32},
                                                 {dst, p.elems, o_.param_dtype}));
          }
          return OkStatus();
        });
  }
  std::byte* mine = bucket_.as<std::byte>() + o_.rank * elems * param_bytes_;
  STRATA_RETURN_IF_ERROR(TimedOnStream(
      dev, stream_, &device_clock_, *o_.trace,
      {TraceTrack::kDevice, "cast params", sg, elems * (4 + param_bytes_), "device"}, [&] {
        return kernels::Cast(dev, stream_, {master, elems, DType::kF32},
                             {mine, elems, o_.param_dtype});
      }));
  return GatherAndUnpack(i, PublishMode::kUpload);
}

Status ParamPublisher::Finish() {
  STRATA_RETURN_IF_ERROR(OrderAfter(*o_.device, o_.user_stream, stream_, done_event_));
  return o_.device->StreamSynchronize(stream_);
}

Status ParamPublisher::ReadParams(uint32_t i, uint32_t slot) {
  Device& dev = *o_.device;
  std::byte* dst = staging_[slot].data();
  for (const ElemRange& pad : o_.map->padding(i)) {
    std::memset(dst + pad.begin * param_bytes_, 0, pad.elems() * param_bytes_);
  }
  STRATA_RETURN_IF_ERROR(OrderAfterUser());
  for (const TensorMap::Piece& p : o_.map->own(i)) {
    const auto* src = static_cast<const std::byte*>((*o_.params)[p.tensor].data) +
                      p.tensor_offset_elems * param_bytes_;
    STRATA_RETURN_IF_ERROR(dev.CopyAsync(dst + p.offset_elems * param_bytes_, src,
                                         p.elems * param_bytes_, CopyKind::kDeviceToHost, stream_));
  }
  return dev.RecordEvent(slot_events_[slot], stream_);
}

PublisherTimes ParamPublisher::TakeTimes() {
  PublisherTimes t{h2d_clock_.busy, comm_clock_.busy, device_clock_.busy, h2d_bytes_};
  h2d_clock_.busy = comm_clock_.busy = device_clock_.busy = 0;
  h2d_bytes_ = 0;
  return t;
}

}  // namespace strata::internal
