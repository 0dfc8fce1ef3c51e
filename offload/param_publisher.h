// ParamPublisher: the updated params of each sub-group, from a pinned staging
// slot (where the CPU optimizer writes them in the trainer's dtype) up into
// the trainer's tensors. Internal to offload/.
//
//   one rank      H2D of each tensor piece straight from the slot into the
//                 tensor (no device buffer, no unpack kernel).
//   several       H2D of the rank's block into a bucket, all-gather, unpack
//                 every rank's block into the tensors.
//
//   STRATA_RETURN_IF_ERROR(pub.OrderAfterUser());      // once per step
//   STRATA_RETURN_IF_ERROR(pub.WaitSlot(slot));        // its last upload is done
//   ... write sub-group i's params into pub.Staging(slot) ...
//   STRATA_RETURN_IF_ERROR(pub.Publish(i, slot, PublishMode::kUpload));
//   STRATA_RETURN_IF_ERROR(pub.Finish());              // trainer's stream waits
//
// Reading the params back (Create: the master weights start as the params)
// uses the same pieces in the other direction: ReadParams.
//
// Device sub-groups (partial offload, the first `device_sub_groups`) have no
// staging: PublishDevice casts their fp32 master weights, in device memory,
// into the params (one rank: each piece; several: the rank's block of the
// bucket, then all-gather and unpack like the others).
//
// Streams: its own stream; OrderAfterUser makes it wait for the trainer's
// stream (backward reads the params the uploads overwrite), Finish makes the
// trainer's stream wait for the uploads. Not thread-safe.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include "offload/engine_internal.h"
#include "offload/layout.h"
#include "offload/optimizer.h"
#include "offload/tensor_map.h"
#include "runtime/comm.h"
#include "runtime/device.h"

namespace strata::internal {

// kJoin: this rank has no params for the sub-group (its update failed) but
// joins the all-gather so that every rank issues the same collectives.
enum class PublishMode : uint8_t { kUpload = 0, kJoin = 1 };

struct ParamPublisherOptions {
  Device* device = nullptr;
  Communicator* comm = nullptr;  // world > 1 only
  int rank = 0;
  int world = 1;
  StreamRef user_stream;
  const TensorMap* map = nullptr;
  const std::vector<Param>* params = nullptr;  // read at every use (RebindParam)
  std::span<const ElemRange> sub_groups;
  uint32_t device_sub_groups = 0;  // the first ones: no staging (PublishDevice)
  DType param_dtype = DType::kF32;
  uint32_t slots = 2;
  TraceContext* trace = nullptr;
};

struct PublisherTimes {
  double h2d = 0, comm = 0, device = 0;
  uint64_t h2d_bytes = 0;
};

class ParamPublisher {
 public:
  static Result<std::unique_ptr<ParamPublisher>> Create(const ParamPublisherOptions& options);
  ~ParamPublisher();
  ParamPublisher(const ParamPublisher&) = delete;
  ParamPublisher& operator=(const ParamPublisher&) = delete;

  uint32_t slots() const { return static_cast<uint32_t>(staging_.size()); }
  // Room for the largest host sub-group in the param dtype, 4096-aligned.
  std::byte* Staging(uint32_t slot) const { return staging_[slot].data(); }

  Status OrderAfterUser();
  Status WaitSlot(uint32_t slot);
  Status Publish(uint32_t i, uint32_t slot, PublishMode mode);
  // Device sub-group i's params from `master` (device memory, its fp32
  // master weights), after `after` (the update's event; null: none).
  Status PublishDevice(uint32_t i, const float* master, const Event* after);
  // Waits for every upload; the trainer's stream waits for them too.
  Status Finish();
  // Queues the copy of sub-group i's own pieces of the trainer's params into
  // `slot` (padding zeroed): the values the master weights start from.
  // WaitSlot(slot) waits for it.
  Status ReadParams(uint32_t i, uint32_t slot);

  StreamRef stream() const { return stream_; }
  PublisherTimes TakeTimes();

 private:
  explicit ParamPublisher(const ParamPublisherOptions& options) : o_(options) {}
  Status Init();
  // Several ranks: the all-gather of sub-group i's bucket, then (kUpload)
  // the unpack into the tensors.
  Status GatherAndUnpack(uint32_t i, PublishMode mode);

  ParamPublisherOptions o_;
  size_t param_bytes_ = 2;
  std::vector<PinnedBuffer> staging_;
  std::vector<Event> slot_events_;
  Event user_event_, done_event_;
  DeviceBuffer bucket_;  // several ranks
  StageClock h2d_clock_, comm_clock_, device_clock_;
  uint64_t h2d_bytes_ = 0;
  // Last, so destroyed first: that waits for the queued copies, which use
  // the buffers above (a step that failed part way leaves some queued).
  Stream stream_;
};

}  // namespace strata::internal
