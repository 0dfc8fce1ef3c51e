// What the engine's units share: how they time their stages and record them
// in the trace, and pinned allocation. Internal to offload/.
//
// Work on a stream is timed by two host tasks around it, enqueued on the same
// stream: the first takes the start time on the stream's own thread, the
// second adds the busy time to a StageClock and, while tracing, records a
// slice. So a figure is the time the stream spent on the work, not the time
// it waited in the queue. (On CUDA the host tasks are cudaLaunchHostFunc
// callbacks: the figures are as coarse as their scheduling, tens of
// microseconds; Nsight's view of the same work is exact.) Host work on the
// calling or IO thread is timed with HostSlice.
#pragma once

#include <chrono>
#include <cstdint>
#include <span>
#include <utility>
#include <vector>

#include "runtime/device.h"
#include "runtime/pinned.h"
#include "runtime/status.h"
#include "runtime/trace.h"

namespace strata::internal {

inline double NowSec() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

// Busy seconds of one stage on one stream, summed over a step.
// Its begin and end tasks run in stream order, so one clock serves every
// timed piece of its stage on its stream.
struct StageClock {
  double start = 0;
  double busy = 0;
  uint64_t begin_ns = 0;  // of the piece running now, for the trace
};

// What every unit needs to record trace events: the recorder (may be null),
// this rank and the step the work belongs to (the engine sets it).
struct TraceContext {
  TraceRecorder* recorder = nullptr;
  int32_t rank = 0;
  int64_t step = 0;
  bool on() const { return recorder != nullptr && recorder->enabled(); }
};

// Where a timed piece of work goes in the trace.
struct TraceSpot {
  TraceTrack track = TraceTrack::kStep;
  const char* name = "";
  int32_t sub_group = -1;
  uint64_t bytes = 0;
  const char* tier = nullptr;
};

// Work enqueued on `waiter` from now on waits for what `producer` has
// queued so far (through `event`, recorded on `producer` here).
inline Status OrderAfter(Device& device, StreamRef waiter, StreamRef producer, Event& event) {
  STRATA_RETURN_IF_ERROR(device.RecordEvent(event, producer));
  return device.StreamWaitEvent(waiter, event);
}

// Enqueues `enqueue()`'s work on `stream` between the two timing tasks.
template <typename F>
Status TimedOnStream(Device& device, StreamRef stream, StageClock* clock, const TraceContext& trace,
                     const TraceSpot& spot, F&& enqueue) {
  TraceRecorder* recorder = trace.on() ? trace.recorder : nullptr;
  STRATA_RETURN_IF_ERROR(device.LaunchHostFunc(stream, [clock, recorder] {
    clock->start = NowSec();
    if (recorder != nullptr) clock->begin_ns = TraceRecorder::Now();
  }));
  {
    // Nsight Systems projects this range onto the copies and kernels the
    // enqueue launches, so they show under the stage's name.
    NvtxRange nvtx(spot.name, spot.sub_group);
    STRATA_RETURN_IF_ERROR(std::forward<F>(enqueue)());
  }
  return device.LaunchHostFunc(stream, [clock, recorder, rank = trace.rank, step = trace.step,
                                        spot] {
    clock->busy += NowSec() - clock->start;
    if (recorder != nullptr) {
      recorder->Slice(spot.track, spot.name, rank, step, spot.sub_group, clock->begin_ns,
                      spot.bytes, spot.tier);
    }
  });
}

// A slice of host work on the calling thread, recorded when it ends (and an
// NVTX range around it for Nsight).
class HostSlice {
 public:
  HostSlice(const TraceContext& trace, const TraceSpot& spot)
      : trace_(trace), spot_(spot), nvtx_(spot.name, spot.sub_group),
        begin_ns_(trace.on() ? TraceRecorder::Now() : 0) {}
  ~HostSlice() {
    if (begin_ns_ != 0 && trace_.on()) {
      trace_.recorder->Slice(spot_.track, spot_.name, trace_.rank, trace_.step, spot_.sub_group,
                             begin_ns_, spot_.bytes, spot_.tier);
    }
  }
  HostSlice(const HostSlice&) = delete;
  HostSlice& operator=(const HostSlice&) = delete;

 private:
  const TraceContext& trace_;
  TraceSpot spot_;
  NvtxRange nvtx_;
  uint64_t begin_ns_;
};

// One pinned buffer of `bytes` (rounded up to 4 KiB, at least 4 KiB) from a
// pool of its own: the engine's buffers are few and long-lived.
Result<PinnedBuffer> AllocatePinned(Device& device, uint64_t bytes);
// Buffers of these sizes (each rounded up to 4096) from one slab: one
// page-locking call, which the host device faults in on every core.
Result<std::vector<PinnedBuffer>> AllocatePinned(Device& device, std::span<const uint64_t> bytes);

}  // namespace strata::internal
