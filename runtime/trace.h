// Trace: when each stage of a step ran, on which resource, and what it
// moved, as a timeline (Chrome trace event JSON: Perfetto, chrome://tracing)
// and as NVTX ranges for Nsight Systems.
//
// A TraceRecorder keeps slices (a named piece of work on a track, with its
// begin and end on the steady clock, bytes, tier, sub-group and step) and
// counter samples (bytes in flight, staging slots in use). The engine records
// into the recorder it was given (EngineContext::trace) while the recorder is
// enabled; several engines (ranks of one process) may share one recorder, and
// each rank becomes one process track of the timeline.
//
//   STRATA_ASSIGN_OR_RETURN(auto trace, TraceRecorder::Create({.steps = 4}));
//   ... OffloadOptimizer::Create({.device = dev, .trace = trace.get()}, ...) ...
//   trace->SetEnabled(true);
//   for (int i = 0; i < 4; ++i) STRATA_RETURN_IF_ERROR(opt->Step());
//   trace->SetEnabled(false);
//   STRATA_RETURN_IF_ERROR(trace->WriteChromeTrace("step.json"));
//
// Cost: disabled, Record() is one relaxed atomic load and a branch; callers
// test enabled() before they build an event. Enabled, it is one atomic
// increment and a 64-byte store into a preallocated ring; nothing allocates.
// Memory is bounded: the ring holds `steps` x the events per step that the
// attached engines announced (ReserveSteps), and keeps the newest events when
// it wraps (dropped() counts the overwritten ones).
//
// Thread-safety: Record() and Now() may be called from any thread at once
// (stream workers, the IO thread, the calling thread). Events(), Clear(),
// ReserveSteps() and the writers must not run while another thread records:
// call them between steps, as a step's end already synchronizes with every
// thread that recorded during it.
//
// NVTX: NvtxRange marks a piece of host work for Nsight Systems in the domain
// "strata" when the build has CUDA (the NVTX v3 headers are part of the
// toolkit; nothing is linked, and without a profiler attached a range costs
// a few nanoseconds). Elsewhere it compiles to nothing.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "runtime/status.h"

namespace strata {

// The resources of the timeline, one track each.
enum class TraceTrack : uint8_t {
  kStep = 0,       // the thread that drives the step: waits, decisions
  kDevice = 1,     // device kernels: pack, statistics, unpack
  kD2H = 2,        // the PCIe link, device to host
  kH2D = 3,        // the PCIe link, host to device
  kComm = 4,       // collectives
  kCpu = 5,        // the CPU optimizer
  kNvmeRead = 6,   // state store reads
  kNvmeWrite = 7,  // state store writes
};
inline constexpr int kTraceTrackCount = 8;
// "step", "device", "pcie d2h", "pcie h2d", "comm", "cpu adam", "nvme read",
// "nvme write".
std::string_view TraceTrackName(TraceTrack track);

enum class TraceKind : uint8_t { kSlice = 0, kCounter = 1 };

// One slice or one counter sample. `name` and `tier` point to static
// strings (string literals): the recorder stores the pointers.
struct TraceEvent {
  const char* name = "";
  const char* tier = nullptr;  // "host", "nvme", "device" or nullptr
  uint64_t begin_ns = 0;       // TraceRecorder::Now(); a counter's sample time
  uint64_t end_ns = 0;         // slices only
  uint64_t bytes = 0;          // slices: bytes moved; counters: the value
  int64_t step = 0;            // the optimizer step the work belongs to
  int32_t rank = 0;
  int32_t sub_group = -1;  // -1: not one sub-group's work
  TraceTrack track = TraceTrack::kStep;
  TraceKind kind = TraceKind::kSlice;
};

struct TraceOptions {
  // The most steps a ring keeps: a timeline of more is more than a viewer
  // shows, and steps x the engines' events per step is allocated up front.
  static constexpr uint32_t kMaxSteps = 1000;
  uint32_t steps = 8;  // the ring keeps about this many of the newest steps; 1..kMaxSteps
};

class TraceRecorder {
 public:
  // InvalidArgument for steps outside 1..TraceOptions::kMaxSteps.
  static Result<std::unique_ptr<TraceRecorder>> Create(const TraceOptions& options = {});
  TraceRecorder(const TraceRecorder&) = delete;
  TraceRecorder& operator=(const TraceRecorder&) = delete;

  // Nanoseconds on the steady clock.
  static uint64_t Now();

  bool enabled() const { return enabled_.load(std::memory_order_relaxed); }
  void SetEnabled(bool enabled) { enabled_.store(enabled, std::memory_order_relaxed); }

  // An engine announces that one step of its records up to `events` events:
  // the ring grows to hold `steps` such steps of every engine attached. Drops
  // what was recorded. Not while recording.
  void ReserveSteps(uint64_t events);
  uint64_t capacity() const { return capacity_; }
  // Resizes the ring to keep `steps` steps of the engines attached (the
  // events they announced) and drops what was recorded: a front end that
  // keeps a 1-step ring while off grows it when recording starts.
  // InvalidArgument for steps outside 1..TraceOptions::kMaxSteps, and
  // ResourceExhausted when the ring cannot be allocated; either way the
  // recorder keeps its ring, steps and events. Not while recording.
  Status SetSteps(uint32_t steps);
  uint32_t steps() const { return options_.steps; }

  // Stores the event (no-op while disabled or before any ReserveSteps).
  void Record(const TraceEvent& event) {
    if (!enabled() || capacity_ == 0) return;
    const uint64_t at = cursor_.fetch_add(1, std::memory_order_relaxed);
    ring_[at % capacity_] = event;
  }
  // A slice from `begin_ns` to now.
  void Slice(TraceTrack track, const char* name, int32_t rank, int64_t step, int32_t sub_group,
             uint64_t begin_ns, uint64_t bytes = 0, const char* tier = nullptr) {
    if (!enabled()) return;
    Record({.name = name,
            .tier = tier,
            .begin_ns = begin_ns,
            .end_ns = Now(),
            .bytes = bytes,
            .step = step,
            .rank = rank,
            .sub_group = sub_group,
            .track = track,
            .kind = TraceKind::kSlice});
  }
  void Counter(const char* name, int32_t rank, int64_t step, uint64_t value) {
    if (!enabled()) return;
    Record({.name = name,
            .begin_ns = Now(),
            .bytes = value,
            .step = step,
            .rank = rank,
            .kind = TraceKind::kCounter});
  }

  // The events kept, oldest first (by record order).
  std::vector<TraceEvent> Events() const;
  uint64_t recorded() const { return cursor_.load(std::memory_order_relaxed); }
  uint64_t dropped() const;  // overwritten because the ring wrapped
  void Clear() { cursor_.store(0, std::memory_order_relaxed); }

  // Chrome trace event format: {"traceEvents": [...], "displayTimeUnit": "ms",
  // "otherData": <other_data_json>}. One process per rank ("rank N"), one
  // thread per TraceTrack; slices are complete events named "<name> <sub-group>"
  // with args {step, sub_group, bytes, tier, GB/s}; counters are "C" events.
  // Times in microseconds from the first event. `other_data_json` must be a
  // JSON object (InvalidArgument otherwise).
  Result<std::string> ChromeTraceJson(std::string_view other_data_json = "{}") const;
  // Writes ChromeTraceJson to `path` (through a temporary file and a rename).
  Status WriteChromeTrace(const std::string& path, std::string_view other_data_json = "{}") const;

 private:
  explicit TraceRecorder(const TraceOptions& options) : options_(options) {}

  TraceOptions options_;
  std::atomic<bool> enabled_{false};
  std::atomic<uint64_t> cursor_{0};
  uint64_t per_step_events_ = 0;
  uint64_t capacity_ = 0;
  std::unique_ptr<TraceEvent[]> ring_;
};

// Host work for Nsight Systems: pushes an NVTX range named `name` (a static
// string) with `payload` (e.g. the sub-group) in the "strata" domain, pops it
// on destruction. A no-op in builds without CUDA.
class NvtxRange {
 public:
  explicit NvtxRange(const char* name, int64_t payload = -1);
  ~NvtxRange();
  NvtxRange(const NvtxRange&) = delete;
  NvtxRange& operator=(const NvtxRange&) = delete;

 private:
  bool pushed_ = false;
};

}  // namespace strata
