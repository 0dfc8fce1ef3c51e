#include "runtime/trace.h"

#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <nlohmann/json.hpp>

#include "runtime/atomic_file.h"
#include "runtime/json_parse.h"
#include "runtime/json_walker.h"
#include "runtime/storage.h"
#include "runtime/units.h"

#if STRATA_HAVE_CUDA
#include <nvtx3/nvToolsExt.h>
#endif

namespace strata {

std::string_view TraceTrackName(TraceTrack track) {
  switch (track) {
    case TraceTrack::kStep:
      return "step";
    case TraceTrack::kDevice:
      return "device";
    case TraceTrack::kD2H:
      return "pcie d2h";
    case TraceTrack::kH2D:
      return "pcie h2d";
    case TraceTrack::kComm:
      return "comm";
    case TraceTrack::kCpu:
      return "cpu adam";
    case TraceTrack::kNvmeRead:
      return "nvme read";
    case TraceTrack::kNvmeWrite:
      return "nvme write";
  }
  return "?";
}

namespace {

Status CheckSteps(const char* op, uint32_t steps) {
  if (steps >= 1 && steps <= TraceOptions::kMaxSteps) return OkStatus();
  return InvalidArgumentError(
      fmt::format("{}: steps is {}; keep at least 1 and at most {} steps (a timeline of more "
                  "steps is more than a viewer shows: trace a few steps where it matters)",
                  op, steps, TraceOptions::kMaxSteps));
}

}  // namespace

Result<std::unique_ptr<TraceRecorder>> TraceRecorder::Create(const TraceOptions& options) {
  STRATA_RETURN_IF_ERROR(CheckSteps("create trace recorder", options.steps));
  return std::unique_ptr<TraceRecorder>(new TraceRecorder(options));
}

uint64_t TraceRecorder::Now() {
  return static_cast<uint64_t>(std::chrono::duration_cast<std::chrono::nanoseconds>(
                                   std::chrono::steady_clock::now().time_since_epoch())
                                   .count());
}

void TraceRecorder::ReserveSteps(uint64_t events) {
  // The ring first: capacity_ describes the ring in place, also if this throws.
  auto ring = std::make_unique<TraceEvent[]>((per_step_events_ + events) * options_.steps);
  per_step_events_ += events;
  capacity_ = per_step_events_ * options_.steps;
  ring_ = std::move(ring);
  Clear();
}

Status TraceRecorder::SetSteps(uint32_t steps) {
  STRATA_RETURN_IF_ERROR(CheckSteps("resize trace recorder", steps));
  const uint64_t capacity = per_step_events_ * steps;
  std::unique_ptr<TraceEvent[]> ring;
  try {
    if (capacity > 0) ring = std::make_unique<TraceEvent[]>(capacity);
  } catch (const std::bad_alloc&) {
    // The recorder keeps its ring, its steps and its events.
    return ResourceExhaustedError(fmt::format(
        "resize trace recorder: {} steps of {} events need {} of host memory; record fewer "
        "steps",
        steps, per_step_events_, FormatBytes(capacity * sizeof(TraceEvent))));
  }
  options_.steps = steps;
  capacity_ = capacity;
  ring_ = std::move(ring);
  Clear();
  return OkStatus();
}

std::vector<TraceEvent> TraceRecorder::Events() const {
  const uint64_t n = recorded();
  std::vector<TraceEvent> out;
  if (capacity_ == 0) return out;
  const uint64_t first = n > capacity_ ? n - capacity_ : 0;
  out.reserve(n - first);
  for (uint64_t i = first; i < n; ++i) out.push_back(ring_[i % capacity_]);
  return out;
}

uint64_t TraceRecorder::dropped() const {
  const uint64_t n = recorded();
  return n > capacity_ ? n - capacity_ : 0;
}

Result<std::string> TraceRecorder::ChromeTraceJson(std::string_view other_data_json) const {
  bool too_deep = false;
  nlohmann::json other = ParseJsonBounded<nlohmann::json>(other_data_json, &too_deep);
  if (too_deep) {
    return InvalidArgumentError(fmt::format(
        "write chrome trace: the other data nests deeper than {} levels; give a flatter object",
        kMaxJsonDepth));
  }
  if (!other.is_object()) {
    return InvalidArgumentError(fmt::format(
        "write chrome trace: the other data must be a JSON object, got '{}'", other_data_json));
  }
  if (const std::string repeated = RepeatedJsonKey(other_data_json); !repeated.empty()) {
    return InvalidArgumentError(fmt::format(
        "write chrome trace: the other data has the key {} more than once; JSON keeps only the "
        "last value, so remove the others",
        repeated));
  }
  const std::vector<TraceEvent> events = Events();
  uint64_t origin = UINT64_MAX;
  for (const TraceEvent& e : events) origin = std::min(origin, e.begin_ns);
  auto us = [origin](uint64_t ns) { return static_cast<double>(ns - origin) * 1e-3; };

  nlohmann::json list = nlohmann::json::array();
  std::vector<int32_t> ranks;
  for (const TraceEvent& e : events) {
    if (std::find(ranks.begin(), ranks.end(), e.rank) == ranks.end()) ranks.push_back(e.rank);
  }
  std::sort(ranks.begin(), ranks.end());
  for (int32_t rank : ranks) {
    list.push_back({{"ph", "M"},
                    {"name", "process_name"},
                    {"pid", rank},
                    {"args", {{"name", fmt::format("rank {}", rank)}}}});
    list.push_back(
        {{"ph", "M"}, {"name", "process_sort_index"}, {"pid", rank}, {"args", {{"sort_index", rank}}}});
    for (int t = 0; t < kTraceTrackCount; ++t) {
      list.push_back({{"ph", "M"},
                      {"name", "thread_name"},
                      {"pid", rank},
                      {"tid", t},
                      {"args", {{"name", TraceTrackName(static_cast<TraceTrack>(t))}}}});
      list.push_back({{"ph", "M"},
                      {"name", "thread_sort_index"},
                      {"pid", rank},
                      {"tid", t},
                      {"args", {{"sort_index", t}}}});
    }
  }
  for (const TraceEvent& e : events) {
    if (e.kind == TraceKind::kCounter) {
      list.push_back({{"ph", "C"},
                      {"name", e.name},
                      {"pid", e.rank},
                      {"ts", us(e.begin_ns)},
                      {"args", {{"value", e.bytes}}}});
      continue;
    }
    const uint64_t dur_ns = e.end_ns > e.begin_ns ? e.end_ns - e.begin_ns : 0;
    nlohmann::json args = {{"step", e.step}};
    if (e.sub_group >= 0) args["sub_group"] = e.sub_group;
    if (e.bytes > 0) {
      args["bytes"] = e.bytes;
      if (dur_ns > 0) args["GB/s"] = static_cast<double>(e.bytes) / static_cast<double>(dur_ns);
    }
    if (e.tier != nullptr) args["tier"] = e.tier;
    list.push_back({{"ph", "X"},
                    {"name", e.sub_group >= 0 ? fmt::format("{} {}", e.name, e.sub_group)
                                              : std::string(e.name)},
                    {"cat", TraceTrackName(e.track)},
                    {"pid", e.rank},
                    {"tid", static_cast<int>(e.track)},
                    {"ts", us(e.begin_ns)},
                    {"dur", static_cast<double>(dur_ns) * 1e-3},
                    {"args", std::move(args)}});
  }
  nlohmann::json doc = {
      {"traceEvents", std::move(list)}, {"displayTimeUnit", "ms"}, {"otherData", other}};
  if (dropped() > 0) doc["otherData"]["dropped_events"] = dropped();
  return doc.dump();
}

Status TraceRecorder::WriteChromeTrace(const std::string& path,
                                       std::string_view other_data_json) const {
  if (path.empty()) {
    return InvalidArgumentError("write chrome trace: the path is empty; give a file name");
  }
  STRATA_ASSIGN_OR_RETURN(std::string text, ChromeTraceJson(other_data_json));
  return WriteFileAtomically(*CreatePosixStorage(), path, text)
      .WithContext(fmt::format("write chrome trace {}", path));
}

#if STRATA_HAVE_CUDA
namespace {
nvtxDomainHandle_t StrataDomain() {
  static nvtxDomainHandle_t domain = nvtxDomainCreateA("strata");
  return domain;
}
}  // namespace

NvtxRange::NvtxRange(const char* name, int64_t payload) {
  nvtxEventAttributes_t a{};
  a.version = NVTX_VERSION;
  a.size = NVTX_EVENT_ATTRIB_STRUCT_SIZE;
  a.messageType = NVTX_MESSAGE_TYPE_ASCII;
  a.message.ascii = name;
  if (payload >= 0) {
    a.payloadType = NVTX_PAYLOAD_TYPE_INT64;
    a.payload.llValue = payload;
  }
  pushed_ = nvtxDomainRangePushEx(StrataDomain(), &a) >= 0;
}

NvtxRange::~NvtxRange() {
  if (pushed_) nvtxDomainRangePop(StrataDomain());
}
#else
NvtxRange::NvtxRange(const char*, int64_t) {}
NvtxRange::~NvtxRange() {}
#endif

}  // namespace strata
