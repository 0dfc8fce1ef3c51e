// The engine: OffloadOptimizer. docs/offload.md ("The engine") has the whole
// story; the comments here say why the pieces are shaped as they are.
//
// A step, as its stages (Impl::Step):
//   hand-over  GradPath: statistics on the device as each sub-group's grads
//              complete (GradReady during backward, or at the step), with
//              several ranks after pack + reduce-scatter + D2H.
//   decide     the statistics of every rank -> loss scaler, clip coefficient,
//              one gradient multiplier (DecideStep).
//   pipeline   per sub-group in schedule order (MakeSchedule): fetch the
//              gradient into a pinned slot (D2H), acquire the state (DRAM, or
//              an NVMe read queued ahead), CPU Adam reading the 16-bit
//              gradient and writing 16-bit params into a staging slot, NVMe
//              write-behind, publish the params (H2D, all-gather, unpack).
//
// Partial offload (gpu_fraction): the first sub-groups keep their state on
// the device. Right after the decision their updates are queued on the
// device stream (fused Adam reading the gradient where it lies on the
// device, one rank writing the params too), and the CPU pipeline runs the
// rest meanwhile; with several ranks the publish stream casts their master
// weights into the bucket after each update and all-gathers them first. The
// step ends when both sides did.
//
// Streams and threads of one optimizer:
//   calling thread   drives the step; CPU Adam over its TBB arena
//   grad stream      GradPath: statistics, pack, reduce-scatter, D2H; the
//                    small all-reduces of the decision
//   publish stream   ParamPublisher: H2D, all-gather, unpack
//   device stream    partial offload: the device state's updates and copies
//   IO thread        StateTiers: every state store call
//
// Note on overlap: the D2H of gradient slots runs ahead of the update by the
// ring's depth and the NVMe reads by the extent buffers'; the update of
// sub-group i frees both its gradient slot (the fetch of i + slots starts)
// and, for NVMe, its extent buffer (its write, then the read that reuses the
// buffer); its params go up while i + 1 is updated. So on a GPU the step
// costs its slowest resource, CPU Adam or the drive, plus one sub-group's
// D2H at the head and one H2D at the tail.
//
// Retry: each sub-group of a step is "done" once its update is in the state
// the tiers return: a DRAM sub-group when its update ran (in place), an NVMe
// sub-group when its write committed. A failed step keeps its decision and
// the gradients it did not apply (GradPath::Keep for the streamed ones);
// RetryStep redoes only the sub-groups not done, so the result is the one of
// a clean run. Done sub-groups are still published again (their params are
// recomputed from the committed master weights, bitwise what the update
// wrote) because every rank must issue the same collectives.
#include "offload/optimizer.h"

#include <fmt/format.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <limits>
#include <optional>
#include <string_view>
#include <unordered_map>
#include <utility>

#include "cpu_adam/cpu_adam.h"
#include "kernels/kernels.h"
#include "offload/engine_internal.h"
#include "offload/grad_path.h"
#include "offload/param_publisher.h"
#include "offload/rate_probe.h"
#include "offload/state_tiers.h"
#include "offload/step_plan.h"
#include "offload/tensor_map.h"
#include "runtime/log.h"
#include "runtime/machine.h"
#include "runtime/pinned.h"
#include "runtime/units.h"
#include "runtime/utf8.h"

namespace strata {
namespace {

// FNV-1a over the bytes of the values mixed in: the digests the ranks compare.
struct Digest {
  uint64_t h = 1469598103934665603ull;
  template <typename T>
  void Mix(const T& value) {
    const auto* b = reinterpret_cast<const unsigned char*>(&value);
    for (size_t i = 0; i < sizeof(value); ++i) h = (h ^ b[i]) * 1099511628211ull;
  }
};

// The memory of one registered tensor: param `param`'s data or grad.
struct TensorBytes {
  uintptr_t begin = 0;
  uintptr_t end = 0;  // exclusive
  uint32_t param = 0;
  bool grad = false;
};

// The data and grad ranges of `params` (those with elems), or
// InvalidArgument for one that is not aligned to its elements (the device's
// kernels access whole elements; on a GPU a misaligned access is an error
// that poisons the context) or runs past the end of the address space.
Result<std::vector<TensorBytes>> TensorRanges(std::span<const Param> params, DType param_dtype,
                                              DType grad_dtype, std::string_view op) {
  std::vector<TensorBytes> out;
  out.reserve(2 * params.size());
  for (uint32_t i = 0; i < params.size(); ++i) {
    const Param& p = params[i];
    if (p.elems == 0) continue;
    for (const bool grad : {false, true}) {
      const auto begin = reinterpret_cast<uintptr_t>(grad ? p.grad : p.data);
      const DType dtype = grad ? grad_dtype : param_dtype;
      if (begin % DTypeSize(dtype) != 0) {
        return InvalidArgumentError(fmt::format(
            "{}: the {} of param {}{} at {:#x} is not aligned to its {}-byte {} elements; a "
            "tensor must start at a multiple of its element size",
            op, grad ? "grad" : "data", i, p.name.empty() ? "" : " (" + p.name + ")", begin,
            DTypeSize(dtype), DTypeName(dtype)));
      }
      uint64_t bytes = 0;
      uintptr_t end = 0;
      if (__builtin_mul_overflow(p.elems, DTypeSize(dtype), &bytes) ||
          __builtin_add_overflow(begin, bytes, &end)) {
        return InvalidArgumentError(fmt::format(
            "{}: param {}{}: {} elems from {} run past the end of the address space", op, i,
            p.name.empty() ? "" : " (" + p.name + ")", p.elems, grad ? p.grad : p.data));
      }
      out.push_back({.begin = begin, .end = end, .param = i, .grad = grad});
    }
  }
  return out;
}

// InvalidArgument naming two tensors whose memory overlaps, `later` the one
// registered after `earlier`: the engine writes every param and zeroes every
// grad in place, so each must be its own memory.
Status OverlapError(std::span<const Param> params, const TensorBytes& later,
                    const TensorBytes& earlier, std::string_view op) {
  auto name = [&](const TensorBytes& t) {
    const Param& p = params[t.param];
    return fmt::format("the {} of param {}{} ({} bytes at {:#x})", t.grad ? "grad" : "data",
                       t.param, p.name.empty() ? "" : " (" + p.name + ")", t.end - t.begin,
                       t.begin);
  };
  return InvalidArgumentError(fmt::format(
      "{}: {} overlaps {}; every tensor and grad must be its own memory, registered once", op,
      name(later), name(earlier)));
}

// Every data and grad tensor of `params` is aligned to its elements and
// disjoint from every other.
Status CheckTensorMemory(std::span<const Param> params, DType param_dtype, DType grad_dtype,
                         std::string_view op) {
  STRATA_ASSIGN_OR_RETURN(std::vector<TensorBytes> ranges,
                          TensorRanges(params, param_dtype, grad_dtype, op));
  auto registration = [](const TensorBytes& t) { return std::pair(t.param, t.grad); };
  std::sort(ranges.begin(), ranges.end(), [&](const TensorBytes& x, const TensorBytes& y) {
    return x.begin != y.begin ? x.begin < y.begin : registration(x) < registration(y);
  });
  // Sorted by start, a range overlaps an earlier one iff it starts before
  // the furthest end seen so far.
  size_t furthest = 0;
  for (size_t i = 1; i < ranges.size(); ++i) {
    const TensorBytes& a = ranges[furthest];
    const TensorBytes& b = ranges[i];
    if (b.begin < a.end) {
      return registration(a) < registration(b) ? OverlapError(params, b, a, op)
                                               : OverlapError(params, a, b, op);
    }
    if (b.end > a.end) furthest = i;
  }
  return OkStatus();
}

// Checkpoints and exports key the tensors by name ("param.<i>" for an
// unnamed one): two params of one name would leave one of them out of a
// state_dict. InvalidArgument naming both.
Status CheckUniqueNames(std::span<const Param> params, std::span<const uint32_t> group,
                        std::string_view op) {
  std::unordered_map<std::string_view, uint32_t> named;
  for (uint32_t i = 0; i < params.size(); ++i) {
    if (params[i].name.empty()) continue;
    if (params[i].name == "__metadata__") {
      return InvalidArgumentError(fmt::format(
          "{}: param {} (group {}) is named '__metadata__', the key safetensors files keep "
          "for their metadata, so it could not be exported: rename it",
          op, i, group[i]));
    }
    auto [it, inserted] = named.emplace(params[i].name, i);
    if (!inserted) {
      const uint32_t j = it->second;
      return InvalidArgumentError(fmt::format(
          "{}: params {} (group {}) and {} (group {}) are both named '{}'; checkpoints and "
          "exports key tensors by name, so one would replace the other: give every param a "
          "unique name, e.g. from model.named_parameters() of the whole model (not of each "
          "submodule), or none",
          op, j, group[j], i, group[i], params[i].name));
    }
  }
  for (uint32_t i = 0; i < params.size(); ++i) {
    if (!params[i].name.empty()) continue;
    const std::string given = fmt::format("param.{}", i);
    if (auto it = named.find(given); it != named.end()) {
      return InvalidArgumentError(fmt::format(
          "{}: param {} is named '{}', the name unnamed param {} gets in checkpoints and "
          "exports, so one would replace the other: name param {} too, or rename param {}",
          op, it->second, given, i, i, it->second));
    }
  }
  return OkStatus();
}

using internal::GradPath;
using internal::HostSlice;
using internal::NowSec;
using internal::ParamPublisher;
using internal::PublishMode;
using internal::StateTiers;
using internal::StepDecision;
using internal::TensorMap;

uint32_t ArrayCount(OptimizerType type) { return StateBytesPerElem(type) / 4; }

// fp32 -> param dtype, bit for bit what cpu_adam writes to its output.
void ConvertOut(std::span<const float> src, void* dst, DType dtype) {
  if (dtype == DType::kF32) {
    std::memcpy(dst, src.data(), src.size_bytes());
    return;
  }
  auto* out = static_cast<uint16_t*>(dst);
  if (dtype == DType::kBF16) {
    for (size_t i = 0; i < src.size(); ++i) out[i] = F32ToBF16(src[i]);
  } else {
    for (size_t i = 0; i < src.size(); ++i) out[i] = F32ToF16(src[i]);
  }
}

// param dtype -> fp32 (exact).
void ConvertIn(const std::byte* src, DType dtype, std::span<float> dst) {
  if (dtype == DType::kF32) {
    std::memcpy(dst.data(), src, dst.size_bytes());
    return;
  }
  const auto* in = reinterpret_cast<const uint16_t*>(src);
  if (dtype == DType::kBF16) {
    for (size_t i = 0; i < dst.size(); ++i) dst[i] = BF16ToF32(in[i]);
  } else {
    for (size_t i = 0; i < dst.size(); ++i) dst[i] = F16ToF32(in[i]);
  }
}

// A run of a sub-group whose elements all take one group's hyperparameters
// (padding joins the run it sits in: its state and grad are zero and stay zero).
struct Run {
  uint64_t begin = 0;  // relative to the sub-group
  uint64_t end = 0;
  uint32_t group = 0;
};

}  // namespace

Status ValidateGroupHyper(const GroupHyper& h, std::string_view where, OptimizerType type) {
  // The update runs in fp32: a value finite in double but not in fp32, an eps
  // that is 0 there, a beta that rounds to 1, would make NaN params. A field
  // the update does not read (Lion's eps, Adagrad's betas) need only be
  // finite: a checkpoint keeps it, and JSON has no NaN.
  constexpr double kMax = std::numeric_limits<float>::max();
  constexpr double kMinNormal = std::numeric_limits<float>::min();
  const bool betas_used = type != OptimizerType::kAdagrad;
  const bool eps_used = type != OptimizerType::kLion;
  auto beta_ok = [&](double b) {
    return !betas_used || (b >= 0 && b < 1 && static_cast<float>(b) < 1.0f);
  };
  struct Rule {
    const char* field;
    double value;
    bool ok;
    const char* allowed;
  };
  constexpr const char* kUnused = "finite (the update does not read it; checkpoints keep it)";
  const Rule rules[] = {
      {"lr", h.lr, h.lr >= 0 && h.lr <= kMax,
       "finite, >= 0 and at most 3.4e38 (the update runs in fp32)"},
      {"beta1", h.beta1, beta_ok(h.beta1), betas_used ? "in [0, 1), and below 1 in fp32" : kUnused},
      {"beta2", h.beta2, beta_ok(h.beta2), betas_used ? "in [0, 1), and below 1 in fp32" : kUnused},
      {"eps", h.eps, !eps_used || (h.eps >= kMinNormal && h.eps <= kMax),
       eps_used ? "finite and in [1.2e-38, 3.4e38] (the update runs in fp32)" : kUnused},
      {"weight_decay", h.weight_decay, h.weight_decay >= 0 && h.weight_decay <= kMax,
       "finite, >= 0 and at most 3.4e38 (the update runs in fp32)"},
  };
  for (const Rule& r : rules) {
    if (!r.ok || !std::isfinite(r.value)) {
      return InvalidArgumentError(
          fmt::format("{}{} is {}; it must be {}", where, r.field, r.value, r.allowed));
    }
  }
  return OkStatus();
}

GroupHyper DefaultGroupHyper(const OffloadConfig& config) {
  switch (config.optimizer) {
    case OptimizerType::kAdam:
    case OptimizerType::kAdamW:
      return {.lr = config.adam.lr,
              .beta1 = config.adam.beta1,
              .beta2 = config.adam.beta2,
              .eps = config.adam.eps,
              .weight_decay = config.adam.weight_decay};
    case OptimizerType::kAdagrad:
      return {.lr = config.adagrad.lr,
              .eps = config.adagrad.eps,
              .weight_decay = config.adagrad.weight_decay};
    case OptimizerType::kLion:
      return {.lr = config.lion.lr,
              .beta1 = config.lion.beta1,
              .beta2 = config.lion.beta2,
              .weight_decay = config.lion.weight_decay};
  }
  return {};
}

std::string FormatStepStats(const StepStats& s) {
  const StageTimes& t = s.times;
  std::string out = fmt::format(
      "step {}: {}{} (d2h {}, comm {}, read {}, adam {}, write {}, h2d {}, device {}), "
      "loss scale {}, grad norm {:.4g}",
      s.step, FormatSeconds(t.step), s.skipped ? " skipped" : "", FormatSeconds(t.d2h),
      FormatSeconds(t.comm), FormatSeconds(t.read), FormatSeconds(t.adam), FormatSeconds(t.write),
      FormatSeconds(t.h2d), FormatSeconds(t.device), s.loss_scale, s.grad_norm);
  if (s.nonfinite_elems > 0) out += fmt::format(", {} non-finite grads", s.nonfinite_elems);
  if (t.device_adam > 0) out += fmt::format(", device adam {}", FormatSeconds(t.device_adam));
  if (s.clip_coef < 1.0f) out += fmt::format(", clip {:.4g}", s.clip_coef);
  if (s.read_bytes + s.write_bytes > 0) {
    out += fmt::format(", nvme read {} write {}", FormatBytes(s.read_bytes),
                       FormatBytes(s.write_bytes));
    if (s.resident_bytes > 0) {
      out += fmt::format(" ({} still in the buffers, not read)", FormatBytes(s.resident_bytes));
    }
  }
  return out;
}

struct OffloadOptimizer::Impl {
  // The process that built it: a forked child (a DataLoader worker) has
  // none of its threads, so it must not destroy it (~OffloadOptimizer).
  const pid_t creator_pid = ::getpid();
  // ---- set up once ----
  Device* device = nullptr;
  Communicator* comm = nullptr;
  Storage* storage = nullptr;
  StreamRef user_stream;
  OffloadConfig config;
  int rank = 0;
  int world = 1;
  std::vector<GroupHyper> hypers;
  // The hyperparameters the step in progress (or the failed one awaiting
  // RetryStep) updates with: a retry finishes the step as it began, whatever
  // SetGroupHyper did since (that applies to the next step).
  std::vector<GroupHyper> step_hypers;
  std::vector<Param> params;          // flat over groups
  std::vector<uint32_t> param_group;  // group of each param
  FlatLayout layout;
  ElemRange shard;
  std::vector<ElemRange> sub_groups;
  PlacementPlan plan;
  uint32_t arrays = 3;
  uint32_t slots = 1;  // gradient ring and param staging slots
  size_t param_bytes = 2;
  std::vector<std::vector<Run>> runs;  // per sub-group
  TensorMap map;
  internal::TraceContext trace;

  Stream grad_stream;       // GradPath's, and the decision's all-reduces
  Stream device_stream;     // partial offload: updates and copies of the device state
  Event device_event;       // on device_stream, after an update (several ranks: per sub-group)
  Event device_user_event;  // on the trainer's stream, for device_stream to wait on
  internal::StageClock device_adam_clock;
  uint32_t device_count = 0;  // sub-groups on the device: the first ones
  std::optional<PinnedPool> small_pool;
  PinnedBuffer small;  // 4 KiB: all-reduced values to and from the device
  DeviceBuffer dev_small;
  internal::StageClock control_clock;  // the all-reduces of doubles
  std::unique_ptr<GradPath> grads;
  std::unique_ptr<ParamPublisher> publisher;
  std::unique_ptr<StateTiers> tiers;
  std::unique_ptr<CpuAdam> cpu;
  std::optional<LossScaler> scaler;
  PipelineMode mode = PipelineMode::kOverlapped;

  // ---- per step ----
  int64_t step = 0;
  StepStats last;
  std::vector<uint32_t> ready_count;  // per sub-group: its tensors reported this micro-step
  std::vector<uint8_t> tensor_ready;
  // A param reported ready twice in one micro-step: Step and ReduceGradients
  // refuse (naming it) until ZeroGrad.
  std::string ready_twice;
  bool warned_dropped = false;          // ZeroGrad dropped handed-over micro-steps (warned once)
  std::optional<StepDecision> pending;  // a step that failed part way (StepState::kFailed)
  Status failure;                       // its error
  std::vector<uint8_t> done;            // per sub-group, for the pending step
  // Per device sub-group: its tensor pieces whose update the pending step
  // queued (they run even when a later launch fails; a retry goes on from
  // the next).
  std::vector<uint32_t> device_pieces_queued;
  // Per sub-group, whether its state is in line with the others': kOutOfLine
  // while a write of the whole state that failed, or a failed step that was
  // dropped (BeginStateWrite, RestoreCounters), left the sub-groups holding
  // different states and it was not written since; kPartial when a host
  // or device write failed part way through it (an NVMe one keeps its
  // committed state). While any is torn, Step, RetryStep, Save and every
  // whole-state read refuse (CheckStateWhole), and reads of a partial one;
  // step_state() is kFailed, step_failure() the latest cause.
  enum Torn : uint8_t { kInLine = 0, kOutOfLine = 1, kPartial = 2 };
  std::vector<uint8_t> torn;
  uint32_t torn_count = 0;
  Status torn_cause;
  size_t grad_read_bytes = 2;           // bytes per element the optimizer reads (StepStats)
  bool host_stats = false;              // the statistics were a host pass (accumulation)
  LoadedSave loaded_save;               // the save the last checkpoint load read
  std::shared_ptr<const int> identity = std::make_shared<const int>(0);  // identity()
  // The state is what InitState writes from the params (state_from_params()).
  bool state_from_params = false;
  // The statistics of a step the loss scaler refused (an overflow at
  // min_scale): no update, but last_step() shows them.
  std::optional<StepDecision> refused;
  // Steps skipped for non-finite gradients with no scaler to back off (none,
  // a static one, or a dynamic one at its minimum), and their count at the
  // last warning (one per 100 at most).
  uint64_t silent_skips = 0;
  uint64_t silent_skips_warned = 0;

  ~Impl();
  Status Init(const EngineContext& context, std::span<const ParamGroup> groups);
  Status ProbeRates(std::span<const ParamGroup> groups);  // gpu_fraction "auto"
  Status InitPlan(std::span<const ParamGroup> groups);  // validation, layout, placement
  Status AgreeOnPlan(Status planned);                   // several ranks
  Status InitUnits(const EngineContext& context);       // buffers, store, initial state
  Status InitState();
  Status OtherRankFailed() const;
  uint64_t SettingsDigest() const;
  Status CheckRanksAgree(double step_sum, double step_sq_sum, double digest_sum,
                         double digest_sq_sum) const;
  Status AllReduceDoubles(std::span<double> values, ReduceOp op);
  Status Update(uint32_t i, std::span<float> state, GradView grad, void* out,
                const StepDecision& d);
  Status UpdateOnDevice(uint32_t i, const StepDecision& d);
  // A group's Adam/AdamW hyperparameters for the step (CPU and device alike).
  AdamHyper AdamHyperFor(const GroupHyper& h, const StepDecision& d) const {
    return {.lr = h.lr,
            .beta1 = h.beta1,
            .beta2 = h.beta2,
            .eps = h.eps,
            .weight_decay = h.weight_decay,
            .weight_decay_mode = config.optimizer == OptimizerType::kAdam
                                     ? WeightDecayMode::kL2
                                     : WeightDecayMode::kDecoupled,
            .bias_correction = config.adam.bias_correction,
            .step = d.step,
            .grad_scale = d.grad_scale};
  }
  // The device side of a step: updates queued, params published, then waited
  // for (FinishDeviceSide).
  Status StartDeviceSide(const StepDecision& d, std::vector<uint8_t>& updated);
  Status PublishDeviceSide(const std::vector<uint8_t>& updated);
  Status FinishDeviceSide(const std::vector<uint8_t>& updated);
  Status InitDeviceState();
  Status Step();
  Status HandOverAndDecide();
  Status RunPipeline(const StepDecision& d);
  Status KeepUndone(Status error);
  // The pipeline of the update numbered `update_step`: odd ones take their
  // NVMe sub-groups last first, so that each starts with the extents the one
  // before ended with, still in their buffers (state_tiers.h).
  internal::PipelineSchedule Schedule(int64_t update_step) const;
  void FillStats(const StepDecision& d, double t0);
  void WarnSilentSkip(const StepDecision& d);
  Status FailedStepError(std::string_view op) const;
  // FailedPrecondition in a child this process forked (a DataLoader
  // worker): the engine's threads (IO, the device's workers, the CPU arena)
  // stayed in the parent, and a call that waits on them waited for ever.
  Status CheckNotForked(std::string_view op) const {
    if (creator_pid == ::getpid()) return OkStatus();
    return FailedPreconditionError(fmt::format(
        "{}: this optimizer was built by process {} and this is a child it forked (pid {}): "
        "its threads stayed in the parent, so nothing here could finish; use it from the "
        "parent, or build an optimizer in the child",
        op, creator_pid, ::getpid()));
  }
  // OutOfRange for a sub-group index past the last (and CheckNotForked).
  Status CheckStateAccess(uint32_t index, std::string_view op) const {
    STRATA_RETURN_IF_ERROR(CheckNotForked(op));
    if (index < sub_groups.size()) return OkStatus();
    return OutOfRangeError(fmt::format("{}: sub-group {} of {}", op, index, sub_groups.size()));
  }
  // OK, or why no collective can run again (Communicator::health), with the
  // way out: RetryStep() would fail the same way. OK after a lost device,
  // which its own error answers: nothing in this process recovers from it,
  // the rebuild a stopped communicator asks for included.
  Status CommStopped() const {
    if (comm == nullptr || IsDeviceLost(failure)) return OkStatus();
    const Status health = comm->health();
    if (health.ok()) return OkStatus();
    return Status(health.code(),
                  fmt::format("the communicator stopped for good ({}); RetryStep() cannot finish "
                              "the step: build a new communicator and optimizer on every rank and "
                              "load the last checkpoint",
                              health.message()));
  }
  void EndFailedStep() {
    pending.reset();
    failure = OkStatus();
  }
  // visit(i) for the sub-groups from `first` in index order (`reverse`:
  // from the last down to `first`), until one fails (its error), with the
  // NVMe extents read ahead; no read is left in flight.
  Status WalkInOrder(uint32_t first, const std::function<Status(uint32_t)>& visit,
                     bool reverse = false) {
    Status s;
    const auto n = static_cast<uint32_t>(sub_groups.size());
    for (uint32_t j = first; j < n && s.ok(); ++j) {
      const uint32_t i = reverse ? n - 1 - (j - first) : j;
      tiers->ReadAhead(i, reverse);
      s = visit(i);
    }
    tiers->DrainReads();  // what a failed visit left unread
    return s;
  }
  // New state: a failed step awaiting retry no longer applies, and every
  // sub-group stays torn (it may hold either step) until written again.
  void BeginStateWrite() {
    if (pending) DropFailedStep("was dropped for a new state");
    state_from_params = false;
  }
  void DropFailedStep(std::string_view how) {
    MarkTorn(std::nullopt, kOutOfLine,
             FailedPreconditionError(fmt::format("step {}, which failed part way ({}), {}",
                                                 pending->step, failure.ToString(), how)));
    EndFailedStep();
    grads->Consume();
  }
  // Sub-group `i` (nullopt: all) is at least `how` torn, for `cause` (the
  // latest cause is the one named).
  void MarkTorn(std::optional<uint32_t> i, Torn how, Status cause) {
    torn_cause = std::move(cause);
    for (uint32_t j = i.value_or(0); j < (i ? *i + 1 : torn.size()); ++j) {
      torn_count += torn[j] == kInLine;
      torn[j] = std::max<uint8_t>(torn[j], how);
    }
  }
  // A write of sub-group `i` ended: whole and in line when `written` is OK;
  // else a host or device one is partly written.
  Status EndWrite(uint32_t i, Status written) {
    if (written.ok()) {
      torn_count -= torn[i] != kInLine;
      torn[i] = kInLine;
      if (torn_count == 0) torn_cause = OkStatus();
    } else if (!tiers->on_nvme(i)) {
      MarkTorn(i, kPartial,
               FailedPreconditionError(fmt::format("a state write failed part way through {} ({})",
                                                   tiers->Name(i), written.ToString())));
    }
    return written;
  }
  // Which sub-groups may mix two states, since when, and the way out; ""
  // when none may.
  std::string TornText() const {
    if (torn_count == 0) return "";
    std::vector<std::string> names;
    for (uint32_t i = 0; i < torn.size() && names.size() < 3; ++i) {
      if (torn[i] != kInLine) names.push_back(tiers->Name(i));
    }
    return fmt::format(
        "the state of {} of {} sub-groups ({}{}) may mix two states since {}; write it whole "
        "again (load a checkpoint or a state_dict, or reset it from the params) before a step "
        "or a save",
        torn_count, torn.size(), fmt::join(names, ", "), torn_count > names.size() ? ", ..." : "",
        torn_cause.message());
  }
  // FailedPrecondition naming the failed step, or the torn sub-groups and
  // the way out; OK when the state is one step's. With `only`, OK also when
  // that sub-group is whole (its own state is one; the others' may differ).
  Status CheckStateWhole(std::string_view op, std::optional<uint32_t> only = std::nullopt) const {
    if (pending) return FailedStepError(op);
    if (torn_count == 0 || (only && torn[*only] != kPartial)) return OkStatus();
    return FailedPreconditionError(fmt::format("{}: {}", op, TornText()));
  }
  // Forgets the micro-step's reports (and a param reported twice).
  void ResetReadiness() {
    std::fill(ready_count.begin(), ready_count.end(), 0);
    std::fill(tensor_ready.begin(), tensor_ready.end(), 0);
    ready_twice.clear();
  }
  // Drops the gradients handed over and not taken by a Step (once the
  // hand-over's work on the grad stream is done) and the reports.
  Status DropHandOver() {
    STRATA_RETURN_IF_ERROR(device->StreamSynchronize(grad_stream));
    grads->Consume();
    ResetReadiness();
    return OkStatus();
  }
};

// ---- Create -----------------------------------------------------------------

Status OffloadOptimizer::Impl::Init(const EngineContext& context,
                                    std::span<const ParamGroup> groups) {
  constexpr std::string_view kOp = "create offload optimizer";
  if (context.device == nullptr) {
    return InvalidArgumentError(fmt::format("{}: EngineContext::device is null", kOp));
  }
  device = context.device;
  comm = context.comm;
  storage = context.storage;
  user_stream = context.stream ? context.stream : device->DefaultStream();
  if (comm != nullptr) {
    rank = comm->rank();
    world = comm->world_size();
  }
  trace.recorder = context.trace;
  trace.rank = rank;
  // Ranks of one machine share its cores: each takes its share by default,
  // where each took them all (8 ranks ran 8 x cores optimizer threads).
  if (config.threads <= 0) {
    const uint32_t per_node =
        RanksPerNode(comm != nullptr ? comm->backend() : "", static_cast<uint32_t>(world));
    const CpuInfo cpus = ProbeCpus();
    config.threads = DefaultCpuThreads(cpus.usable, cpus.online, per_node);
    if (per_node > 1) {
      LogInfo(fmt::format("rank {}: {} CPU optimizer threads ({} usable cores, {} ranks on this "
                          "machine; strata.threads sets it)",
                          rank, config.threads, cpus.usable, per_node));
    }
  } else if (const CpuInfo cpus = ProbeCpus();
             cpus.usable > 0 && static_cast<uint32_t>(config.threads) > cpus.usable) {
    // oneTBB gives an arena no more threads than the process may run on
    // (and warns on stderr when asked for more): say so once, in our words.
    LogWarning(
        fmt::format("rank {}: strata.threads = {} is more than the {} cores this process "
                    "may use; the CPU optimizer runs {} threads",
                    rank, config.threads, cpus.usable, cpus.usable));
    config.threads = static_cast<int>(cpus.usable);
  }
  // A GPU this build has no kernel image for is refused here, not inside the
  // first step.
  Status runs = kernels::CheckKernelsRunOn(*device).WithContext(kOp);
  // Every rank returns from Create having failed or not together: a rank
  // whose Create succeeded while another's failed would wait for it in the
  // first collective of Step.
  if (world == 1) {
    STRATA_RETURN_IF_ERROR(runs);
    STRATA_RETURN_IF_ERROR(ProbeRates(groups));
    STRATA_RETURN_IF_ERROR(InitPlan(groups));
    return InitUnits(context);
  }
  Status probed = runs.ok() ? ProbeRates(groups) : OkStatus();
  if (config.gpu_fraction == kGpuFractionAuto) {
    // Every rank plans with the same rates (the slowest rank's), so that they
    // keep the same sub-groups on the device.
    PlanRates& r = config.rates;
    double v[3] = {-r.cpu_adam_elems_per_sec, -r.device_adam_elems_per_sec,
                   probed.ok() ? 0.0 : 1.0};
    STRATA_RETURN_IF_ERROR(AllReduceDoubles(v, ReduceOp::kMax).WithContext(kOp));
    if (!probed.ok()) return probed;
    if (v[2] > 0) return OtherRankFailed();
    r.cpu_adam_elems_per_sec = -v[0];
    r.device_adam_elems_per_sec = -v[1];
  }
  Status planned = runs.ok() ? InitPlan(groups) : runs;
  STRATA_RETURN_IF_ERROR(AgreeOnPlan(planned));
  Status built = InitUnits(context);
  double failed[1] = {built.ok() ? 0.0 : 1.0};
  Status agreed = AllReduceDoubles(failed, ReduceOp::kMax);
  if (!built.ok()) return built;
  STRATA_RETURN_IF_ERROR((std::move(agreed)).WithContext(kOp));
  if (failed[0] > 0) return OtherRankFailed();
  control_clock = {};  // the first step's times are the step's own
  return OkStatus();
}

Status OffloadOptimizer::Impl::OtherRankFailed() const {
  return FailedPreconditionError(fmt::format(
      "create offload optimizer: rank {}: another rank failed to create its optimizer (its "
      "error says why); Create fails on every rank together",
      rank));
}

// gpu_fraction "auto" balances the device and CPU sides by their Adam rates
// (placement.h, step 0): the ones strata.rates does not give are measured
// here, in the engine's shapes (offload/rate_probe.h), in a few tenths of a
// second, on as many elements as the shard (1 Mi to 8 Mi) and, on the
// device, in at most a quarter of device_budget (or 1 Mi elements).
Status OffloadOptimizer::Impl::ProbeRates(std::span<const ParamGroup> groups) {
  PlanRates& r = config.rates;
  // A config InitPlan refuses is not worth measuring for.
  if (config.gpu_fraction != kGpuFractionAuto ||
      (r.cpu_adam_elems_per_sec > 0 && r.device_adam_elems_per_sec > 0) ||
      !ValidateConfig(config).ok()) {
    return OkStatus();
  }
  // Fewer elements would measure the launch, not the update.
  constexpr uint64_t kMinProbeElems = uint64_t{1} << 20;
  constexpr uint64_t kMaxProbeElems = uint64_t{8} << 20;
  uint64_t elems = 0;
  for (const ParamGroup& g : groups) {
    for (const Param& p : g.params) elems += p.elems;
  }
  elems = std::clamp<uint64_t>(elems / std::max(world, 1), kMinProbeElems, kMaxProbeElems);
  const AdamShape shape = AdamShape::Of(config, static_cast<uint32_t>(world));
  if (r.cpu_adam_elems_per_sec <= 0) {
    STRATA_ASSIGN_OR_RETURN(cpu, CpuAdam::Create({.threads = config.threads}));
    STRATA_ASSIGN_OR_RETURN(r.cpu_adam_elems_per_sec, MeasureCpuAdamRate(*cpu, shape, elems));
  }
  if (r.device_adam_elems_per_sec <= 0) {
    const uint64_t in_budget = config.device_budget_bytes / 4 / shape.device_memory_per_elem();
    STRATA_ASSIGN_OR_RETURN(
        r.device_adam_elems_per_sec,
        MeasureDeviceAdamRate(*device, shape,
                              std::clamp<uint64_t>(in_budget, kMinProbeElems, elems)));
  }
  LogInfo(fmt::format(
      "rank {}: gpu_fraction \"auto\": CPU Adam {:.3g} G elems/s, device Adam {:.3g} G elems/s "
      "(measured where strata.rates does not give them)",
      rank, r.cpu_adam_elems_per_sec * 1e-9, r.device_adam_elems_per_sec * 1e-9));
  return OkStatus();
}

Status OffloadOptimizer::Impl::InitPlan(std::span<const ParamGroup> groups) {
  constexpr std::string_view kOp = "create offload optimizer";
  STRATA_RETURN_IF_ERROR((ValidateConfig(config)).WithContext(kOp));
  if (config.param_dtype != DType::kF32 && config.param_dtype != DType::kF16 &&
      config.param_dtype != DType::kBF16) {
    return InvalidArgumentError(fmt::format("{}: param dtype {} is not fp32, fp16 or bf16", kOp,
                                            DTypeName(config.param_dtype)));
  }
  if (config.grad_dtype != DType::kF32 && config.grad_dtype != DType::kF16 &&
      config.grad_dtype != DType::kBF16) {
    return InvalidArgumentError(fmt::format("{}: grad dtype {} is not fp32, fp16 or bf16", kOp,
                                            DTypeName(config.grad_dtype)));
  }
  if (groups.empty()) {
    return InvalidArgumentError(fmt::format("{}: no param groups; register at least one", kOp));
  }
  std::vector<TensorSpec> specs;
  for (uint32_t g = 0; g < groups.size(); ++g) {
    if (groups[g].params.empty()) {
      return InvalidArgumentError(
          fmt::format("{}: param group {} has no tensors; drop it or add its params", kOp, g));
    }
    STRATA_RETURN_IF_ERROR(ValidateGroupHyper(
        groups[g].hyper, fmt::format("{}: param group {}: ", kOp, g), config.optimizer));
    hypers.push_back(groups[g].hyper);
    for (uint32_t j = 0; j < groups[g].params.size(); ++j) {
      const Param& p = groups[g].params[j];
      const std::string who = fmt::format("param group {} tensor {}{}", g, j,
                                          p.name.empty() ? "" : " (" + p.name + ")");
      if (const size_t bad = Utf8ErrorAt(p.name); bad != std::string::npos) {
        return InvalidArgumentError(fmt::format(
            "{}: param group {} tensor {} has a name that is not UTF-8 (byte {:#04x} at offset "
            "{}); checkpoints and exports store names as JSON text: give a UTF-8 name",
            kOp, g, j, static_cast<unsigned char>(p.name[bad]), bad));
      }
      if (p.elems > 0 && (p.data == nullptr || p.grad == nullptr)) {
        return InvalidArgumentError(fmt::format("{}: {} has {} elems but a null {} pointer", kOp,
                                                who, p.elems, p.data == nullptr ? "data" : "grad"));
      }
      params.push_back(p);
      param_group.push_back(g);
      specs.push_back({.elems = p.elems, .dtype = config.param_dtype});
    }
  }
  STRATA_RETURN_IF_ERROR(CheckUniqueNames(params, param_group, kOp));
  STRATA_RETURN_IF_ERROR(CheckTensorMemory(params, config.param_dtype, config.grad_dtype, kOp));
  STRATA_ASSIGN_OR_RETURN(layout,
                          PlanFlatLayout(specs, {.align_elems = config.align_elems,
                                                 .world_size = static_cast<uint32_t>(world)}));
  if (layout.tensor_elems == 0) {
    return InvalidArgumentError(fmt::format("{}: every registered tensor has 0 elems", kOp));
  }
  STRATA_ASSIGN_OR_RETURN(shard, ShardRange(layout, static_cast<uint32_t>(rank)));
  const uint64_t sub_group_elems =
      SubGroupElemsFor(config, shard.elems(), static_cast<uint32_t>(world));
  STRATA_ASSIGN_OR_RETURN(sub_groups, CutSubGroups(shard, sub_group_elems));
  std::vector<uint64_t> sizes;
  for (const ElemRange& r : sub_groups) sizes.push_back(r.elems());
  PlacementInputs inputs = PlacementInputsFor(config, sizes, static_cast<uint32_t>(world));
  STRATA_ASSIGN_OR_RETURN(inputs.tensor_pieces, CountPieces(layout, sub_groups));
  // Preflight: refuse a plan this machine cannot hold (placement.h, step 5).
  inputs.machine = ProbeMachineLimits(
      inputs.nvme == NvmeTier::kAvailable ? std::span<const std::string>(config.nvme_paths)
                                          : std::span<const std::string>(),
      static_cast<uint32_t>(rank),
      RanksPerNode(comm != nullptr ? comm->backend() : "", static_cast<uint32_t>(world)),
      /*real_paths=*/storage == nullptr);
  STRATA_ASSIGN_OR_RETURN(plan, PlanPlacement(inputs));
  if (std::string w = PaddingWarning(layout); !w.empty()) plan.warnings.push_back(std::move(w));
  for (const std::string& w : plan.warnings) LogWarning(fmt::format("rank {}: {}", rank, w));
  LogInfo(fmt::format(
      "rank {}/{}: {} tensors, {} elems ({} in the shard, {} sub-groups of {}{})\n{}", rank, world,
      params.size(), layout.tensor_elems, shard.elems(), sub_groups.size(), sub_group_elems,
      config.sub_group_elems == kSubGroupAuto ? ", sub_group_size auto" : "", FormatPlan(plan)));
  // config.buffer_count, at most one per sub-group the CPU side updates (as planned).
  slots = HostSlots(inputs.buffer_count, sub_groups.size(), plan.device_sub_groups);
  return OkStatus();
}

// Several ranks: whether every rank planned, and registered the same tensors
// (a digest of the layout); `planned` is this rank's own outcome.
Status OffloadOptimizer::Impl::AgreeOnPlan(Status planned) {
  constexpr std::string_view kOp = "create offload optimizer";
  // A digest per part that every rank must register alike, each all-reduced
  // with kMax as d and max - d (they agree when both come back unchanged).
  struct Part : Digest {
    std::string_view what;
    explicit Part(std::string_view w) : what(w) {}
  };
  std::array<Part, 5> parts = {
      Part{"the tensors' sizes or dtype"},
      Part{"the tensors' names (the same sizes in another order?)"},
      Part{"which tensor is in which param group"}, Part{"the sub-groups (sub_group_size)"},
      // What shapes the collectives besides the sub-groups: how many stay on
      // the device (gpu_fraction, device_budget) and the wire dtypes.
      Part{"the sub-groups kept on the device (gpu_fraction, device_budget) or the gradient "
           "dtypes (grad_dtype, communication_data_type)"}};
  if (planned.ok()) {
    for (const TensorSlot& t : layout.tensors) parts[0].Mix(t.elems);
    parts[0].Mix(static_cast<uint64_t>(config.param_dtype));
    for (const Param& p : params) {
      parts[1].Mix(p.name.size());
      for (const char c : p.name) parts[1].Mix(c);
    }
    for (uint32_t g : param_group) parts[2].Mix(g);
    for (const ElemRange& r : sub_groups) parts[3].Mix(r.elems());
    parts[4].Mix(plan.device_sub_groups);
    parts[4].Mix(static_cast<uint64_t>(config.grad_dtype));
    parts[4].Mix(static_cast<uint64_t>(config.comm_dtype));
  }
  const double max_digest = static_cast<double>((uint64_t{1} << 52) - 1);
  std::array<double, 2 * parts.size() + 1> v{};
  for (size_t i = 0; i < parts.size(); ++i) {
    const double d = planned.ok() ? static_cast<double>(parts[i].h >> 12) : 0.0;  // exact
    v[2 * i] = d;
    v[2 * i + 1] = max_digest - d;
  }
  v.back() = planned.ok() ? 0.0 : 1.0;
  const std::array<double, v.size()> mine = v;
  Status reduced = AllReduceDoubles(v, ReduceOp::kMax);
  if (!planned.ok()) return planned;
  STRATA_RETURN_IF_ERROR((std::move(reduced)).WithContext(kOp));
  if (v.back() > 0) return OtherRankFailed();
  for (size_t i = 0; i < parts.size(); ++i) {
    if (v[2 * i] != mine[2 * i] || v[2 * i + 1] != mine[2 * i + 1]) {
      return InvalidArgumentError(fmt::format(
          "{}: rank {} registered tensors that differ from another rank's in {}; every rank "
          "must register the same tensors (sizes, dtype, names, groups) in the same order, with "
          "the same sub_group_size, gradient dtypes and device share",
          kOp, rank, parts[i].what));
    }
  }
  return OkStatus();
}

Status OffloadOptimizer::Impl::InitUnits(const EngineContext& context) {
  constexpr std::string_view kOp = "create offload optimizer";
  arrays = ArrayCount(config.optimizer);
  param_bytes = DTypeSize(config.param_dtype);

  // Runs of one group's hyperparameters per sub-group.
  for (const ElemRange& sg : sub_groups) {
    STRATA_ASSIGN_OR_RETURN(std::vector<TensorPiece> own, PiecesInRange(layout, sg));
    std::vector<Run> rs;
    for (const TensorPiece& piece : own) {
      const uint32_t g = param_group[piece.tensor];
      const uint64_t at = piece.flat_offset_elems - sg.begin;
      if (rs.empty()) {
        rs.push_back({0, 0, g});
      } else if (rs.back().group != g) {
        rs.back().end = at;
        rs.push_back({at, 0, g});
      }
    }
    if (rs.empty()) rs.push_back({0, 0, 0});  // all padding
    rs.back().end = sg.elems();
    runs.push_back(std::move(rs));
  }
  STRATA_ASSIGN_OR_RETURN(map, TensorMap::Build({.layout = &layout,
                                                 .shard = shard,
                                                 .sub_groups = sub_groups,
                                                 .rank = rank,
                                                 .world = world,
                                                 .params = params,
                                                 .grad_dtype = config.grad_dtype,
                                                 .param_dtype = config.param_dtype}));
  if (!grad_stream) {
    STRATA_ASSIGN_OR_RETURN(grad_stream, device->CreateStream());
  }
  device_count = plan.device_sub_groups;
  if (device_count > 0) {
    STRATA_ASSIGN_OR_RETURN(device_stream, device->CreateStream());
    STRATA_ASSIGN_OR_RETURN(device_event, device->CreateEvent());
    STRATA_ASSIGN_OR_RETURN(device_user_event, device->CreateEvent());
  }
  if (!small.data()) {
    STRATA_ASSIGN_OR_RETURN(small, internal::AllocatePinned(*device, 4096));
    STRATA_ASSIGN_OR_RETURN(dev_small, device->Allocate(4096));
  }
  if (!cpu) {
    STRATA_ASSIGN_OR_RETURN(cpu, CpuAdam::Create({.threads = config.threads}));
  }
  STRATA_ASSIGN_OR_RETURN(grads, GradPath::Create({.device = device,
                                                   .comm = comm,
                                                   .rank = rank,
                                                   .world = world,
                                                   .stream = grad_stream,
                                                   .user_stream = user_stream,
                                                   .device_sub_groups = device_count,
                                                   .map = &map,
                                                   .params = &params,
                                                   .sub_groups = sub_groups,
                                                   .shard = shard,
                                                   .grad_dtype = config.grad_dtype,
                                                   .wire_dtype = config.comm_dtype,
                                                   .slots = slots,
                                                   .cpu = cpu.get(),
                                                   .trace = &trace}));
  STRATA_ASSIGN_OR_RETURN(publisher, ParamPublisher::Create({.device = device,
                                                             .comm = comm,
                                                             .rank = rank,
                                                             .world = world,
                                                             .user_stream = user_stream,
                                                             .map = &map,
                                                             .params = &params,
                                                             .sub_groups = sub_groups,
                                                             .device_sub_groups = device_count,
                                                             .param_dtype = config.param_dtype,
                                                             .slots = slots,
                                                             .trace = &trace}));
  STRATA_ASSIGN_OR_RETURN(tiers, StateTiers::Create({.device = device,
                                                     .storage = context.storage,
                                                     .config = &config,
                                                     .rank = static_cast<uint32_t>(rank),
                                                     .sub_groups = sub_groups,
                                                     .plan = &plan,
                                                     .arrays = arrays,
                                                     .nvme_buffers = plan.nvme_buffers,
                                                     .trace = &trace,
                                                     .device_stream = device_stream,
                                                     .cpu = cpu.get()}));
  STRATA_ASSIGN_OR_RETURN(LossScaler s, LossScaler::Create(config.loss_scaler));
  scaler.emplace(std::move(s));
  ready_count.assign(sub_groups.size(), 0);
  tensor_ready.assign(params.size(), 0);
  done.assign(sub_groups.size(), 0);
  device_pieces_queued.assign(device_count, 0);
  torn.assign(sub_groups.size(), 0);
  if (trace.recorder != nullptr) {
    // Per sub-group: statistics, D2H, update, read, write, H2D (+ pack,
    // reduce-scatter, all-gather, unpack with several ranks); a few per step.
    trace.recorder->ReserveSteps(sub_groups.size() * (world > 1 ? 10 : 6) + 16);
  }
  STRATA_RETURN_IF_ERROR((InitState()).WithContext(kOp));
  tiers->TakeFigures();  // the initial writes are not a step's
  state_from_params = true;
  return OkStatus();
}

// The master weights start as the params (exact: fp16/bf16 -> fp32); the
// moments and the padding as zero. A pipeline, so that setup runs at memory
// speed: the params of sub-group i + 1 come down while i is converted on
// every optimizer thread, and i's NVMe write runs while i + 1 is filled.
// A progress line when it takes more than a couple of seconds.
Status OffloadOptimizer::Impl::InitState() {
  const uint32_t n = static_cast<uint32_t>(sub_groups.size());
  const uint32_t slots = publisher->slots();
  uint64_t total = 0;
  for (uint32_t i = device_count; i < n; ++i) total += sub_groups[i].elems() * arrays * 4;
  STRATA_RETURN_IF_ERROR(InitDeviceState());  // queued: runs beside the host's
  ProgressReporter progress(fmt::format("rank {}: initial optimizer state", rank), total,
                            ProgressUnit::kBytes);
  auto slot_of = [&](uint32_t i) { return (i - device_count) % slots; };
  auto read = [&](uint32_t i) {
    return publisher->ReadParams(i, slot_of(i))
        .WithContext(fmt::format("read the initial params of {}", tiers->Name(i)));
  };
  if (device_count < n) STRATA_RETURN_IF_ERROR(read(device_count));
  for (uint32_t i = device_count; i < n; ++i) {
    // With one slot the next read would overwrite what is being converted.
    if (slots > 1 && i + 1 < n) STRATA_RETURN_IF_ERROR(read(i + 1));
    STRATA_RETURN_IF_ERROR(publisher->WaitSlot(slot_of(i)));
    const std::byte* staging = publisher->Staging(slot_of(i));
    const uint64_t elems = sub_groups[i].elems();
    const size_t param_bytes = DTypeSize(config.param_dtype);
    STRATA_RETURN_IF_ERROR(
        (tiers->Fill(i, [&](std::span<float> s) {
          cpu->ParallelFor(s.size(), 1 << 20, [&](size_t b, size_t count) {
            const size_t convert = b < elems ? std::min(count, elems - b) : 0;
            ConvertIn(staging + b * param_bytes, config.param_dtype, s.subspan(b, convert));
            std::fill_n(s.data() + b + convert, count - convert, 0.0f);
          });
          return OkStatus();
        })).WithContext(fmt::format("write the initial state of {}", tiers->Name(i))));
    if (slots == 1 && i + 1 < n) STRATA_RETURN_IF_ERROR(read(i + 1));
    progress.Add(elems * arrays * 4);
  }
  STRATA_RETURN_IF_ERROR(
      tiers->FinishWrites([](uint32_t, const Status&) {}).WithContext("write the initial state"));
  if (device_count > 0) {
    STRATA_RETURN_IF_ERROR(
        device->StreamSynchronize(device_stream).WithContext("set up the device state"));
  }
  progress.Finish();
  publisher->TakeTimes();
  return OkStatus();
}

// The device sub-groups' state, on the device: zero, then the master weights
// cast from the params (fp16/bf16 -> fp32 is exact: what the host does).
Status OffloadOptimizer::Impl::InitDeviceState() {
  if (device_count == 0) return OkStatus();
  STRATA_RETURN_IF_ERROR(
      internal::OrderAfter(*device, device_stream, user_stream, device_user_event));
  for (uint32_t i = 0; i < device_count; ++i) {
    float* state = tiers->DeviceState(i);
    STRATA_RETURN_IF_ERROR(kernels::PackGrads(
        *device, device_stream, {}, {state, sub_groups[i].elems() * arrays, DType::kF32}));
    for (const internal::TensorMap::Piece& p : map.own(i)) {
      const auto* src = static_cast<const std::byte*>(params[p.tensor].data) +
                        p.tensor_offset_elems * param_bytes;
      STRATA_RETURN_IF_ERROR(kernels::Cast(*device, device_stream,
                                           {src, p.elems, config.param_dtype},
                                           {state + p.offset_elems, p.elems, DType::kF32}));
    }
  }
  return OkStatus();
}

Status OffloadOptimizer::Impl::AllReduceDoubles(std::span<double> values, ReduceOp op) {
  if (!grad_stream) {
    STRATA_ASSIGN_OR_RETURN(grad_stream, device->CreateStream());
    STRATA_ASSIGN_OR_RETURN(small, internal::AllocatePinned(*device, 4096));
    STRATA_ASSIGN_OR_RETURN(dev_small, device->Allocate(4096));
  }
  auto* host = small.as<double>().data();
  std::copy(values.begin(), values.end(), host);
  STRATA_RETURN_IF_ERROR(internal::TimedOnStream(
      *device, grad_stream, &control_clock, trace, {TraceTrack::kComm, "all-reduce"},
      [&]() -> Status {
        STRATA_RETURN_IF_ERROR(device->CopyAsync(dev_small.data(), host, values.size_bytes(),
                                                 CopyKind::kHostToDevice, grad_stream));
        STRATA_RETURN_IF_ERROR(comm->AllReduce(dev_small.data(), dev_small.data(), values.size(),
                                               DType::kF64, op, grad_stream));
        return device->CopyAsync(host, dev_small.data(), values.size_bytes(),
                                 CopyKind::kDeviceToHost, grad_stream);
      }));
  STRATA_RETURN_IF_ERROR(device->StreamSynchronize(grad_stream));
  std::copy(host, host + values.size(), values.begin());
  return OkStatus();
}

// ---- The update -----------------------------------------------------------------

Status OffloadOptimizer::Impl::Update(uint32_t i, std::span<float> state, GradView grad, void* out,
                                      const StepDecision& d) {
  const uint64_t elems = sub_groups[i].elems();
  const size_t grad_bytes = DTypeSize(grad.dtype);
  for (const Run& run : runs[i]) {
    const size_t n = run.end - run.begin;
    const GroupHyper& h = step_hypers[run.group];
    std::span<float> master = state.subspan(run.begin, n);
    std::span<float> m1 = state.subspan(elems + run.begin, n);
    const GradView g{grad.dtype, static_cast<const std::byte*>(grad.data) + run.begin * grad_bytes,
                     n};
    const OutView o{config.param_dtype, static_cast<std::byte*>(out) + run.begin * param_bytes, n};
    switch (config.optimizer) {
      case OptimizerType::kAdam:
      case OptimizerType::kAdamW: {
        const AdamHyper ah = AdamHyperFor(h, d);
        std::span<float> m2 = state.subspan(2 * elems + run.begin, n);
        STRATA_RETURN_IF_ERROR(cpu->Step(ah, {master, m1, m2}, g, o));
        break;
      }
      case OptimizerType::kAdagrad: {
        const AdagradHyper ah{.lr = h.lr,
                              .lr_decay = config.adagrad.lr_decay,
                              .eps = h.eps,
                              .weight_decay = h.weight_decay,
                              .step = d.step,
                              .grad_scale = d.grad_scale};
        STRATA_RETURN_IF_ERROR(cpu->StepAdagrad(ah, {master, m1}, g, o));
        break;
      }
      case OptimizerType::kLion: {
        const LionHyper lh{.lr = h.lr,
                           .beta1 = h.beta1,
                           .beta2 = h.beta2,
                           .weight_decay = h.weight_decay,
                           .grad_scale = d.grad_scale};
        STRATA_RETURN_IF_ERROR(cpu->StepLion(lh, {master, m1}, g, o));
        break;
      }
    }
  }
  return OkStatus();
}

// Sub-group i's update by the device Adam, piece by piece (padding is not
// touched: its state and gradient are zero and would stay zero), on the
// device stream. One rank writes the params in the same kernel.
Status OffloadOptimizer::Impl::UpdateOnDevice(uint32_t i, const StepDecision& d) {
  const internal::DeviceGradView grad = grads->DeviceGrad(i);
  const size_t grad_bytes = DTypeSize(grad.dtype);
  const uint64_t elems = sub_groups[i].elems();
  float* state = tiers->DeviceState(i);
  const auto pieces = map.own(i);
  return internal::TimedOnStream(
      *device, device_stream, &device_adam_clock, trace,
      {TraceTrack::kDevice, "device adam", static_cast<int32_t>(i),
       elems * (2 * 4 * arrays + grad_bytes + (world == 1 ? param_bytes : 0)), "device"},
      [&]() -> Status {
        for (uint32_t& j = device_pieces_queued[i]; j < pieces.size(); ++j) {
          const internal::TensorMap::Piece& p = pieces[j];
          const AdamHyper ah = AdamHyperFor(step_hypers[param_group[p.tensor]], d);
          const std::byte* g = grad.base != nullptr
                                   ? grad.base + p.offset_elems * grad_bytes
                                   : static_cast<const std::byte*>(params[p.tensor].grad) +
                                         p.tensor_offset_elems * grad_bytes;
          kernels::DeviceTensor out{};
          if (world == 1) {
            out = {static_cast<std::byte*>(params[p.tensor].data) +
                       p.tensor_offset_elems * param_bytes,
                   p.elems, config.param_dtype};
          }
          const uint64_t at = p.offset_elems;
          STRATA_RETURN_IF_ERROR(
              kernels::AdamStep(*device, device_stream, ah,
                                {state + at, state + elems + at, state + 2 * elems + at, p.elems},
                                {g, p.elems, grad.dtype}, out));
        }
        return OkStatus();
      });
}

// Queues the device sub-groups' updates (those not done) after the trainer's
// stream. `updated[i]`: queued here.
Status OffloadOptimizer::Impl::StartDeviceSide(const StepDecision& d,
                                               std::vector<uint8_t>& updated) {
  updated.assign(device_count, 0);
  if (device_count == 0) return OkStatus();
  STRATA_RETURN_IF_ERROR(
      internal::OrderAfter(*device, device_stream, user_stream, device_user_event));
  for (uint32_t i = 0; i < device_count; ++i) {
    if (!done[i]) {
      STRATA_RETURN_IF_ERROR(
          UpdateOnDevice(i, d).WithContext(fmt::format("update {}", tiers->Name(i))));
      updated[i] = 1;
    }
  }
  return OkStatus();
}

// With several ranks, the device sub-groups' publication (every rank, every
// sub-group: the all-gathers must match), after the device side's updates.
// One rank publishes in the update; a done sub-group (a retry) is published
// again, as the host's are. RunPipeline queues this after the CPU side's
// publications: ahead of them on the publisher's stream it held the CPU
// pipeline's staging slots until the whole device side was done.
Status OffloadOptimizer::Impl::PublishDeviceSide(const std::vector<uint8_t>& updated) {
  const Event* after = nullptr;
  if (std::find(updated.begin(), updated.end(), 1) != updated.end()) {
    STRATA_RETURN_IF_ERROR(device->RecordEvent(device_event, device_stream));
    after = &device_event;
  }
  for (uint32_t i = 0; i < device_count; ++i) {
    if (world > 1 || (done[i] && !updated[i])) {
      STRATA_RETURN_IF_ERROR(
          publisher->PublishDevice(i, tiers->DeviceState(i), updated[i] ? after : nullptr));
    }
  }
  return OkStatus();
}

// Waits for the device side; the trainer's stream waits for it too (the
// params it wrote). Updated sub-groups are done once it succeeded.
Status OffloadOptimizer::Impl::FinishDeviceSide(const std::vector<uint8_t>& updated) {
  if (device_count == 0) return OkStatus();
  STRATA_RETURN_IF_ERROR(internal::OrderAfter(*device, user_stream, device_stream, device_event));
  STRATA_RETURN_IF_ERROR(
      device->StreamSynchronize(device_stream).WithContext("update the device sub-groups"));
  for (uint32_t i = 0; i < device_count; ++i) {
    if (updated[i]) done[i] = 1;
  }
  return OkStatus();
}

// A digest of what this step's update depends on besides the gradients: the
// groups' hyperparameters, the clipping norm, the update rule, the loss scale.
uint64_t OffloadOptimizer::Impl::SettingsDigest() const {
  Digest d;
  for (const GroupHyper& g : step_hypers) {
    d.Mix(g.lr), d.Mix(g.beta1), d.Mix(g.beta2), d.Mix(g.eps), d.Mix(g.weight_decay);
  }
  d.Mix(config.max_grad_norm), d.Mix(config.optimizer), d.Mix(scaler->scale());
  return d.h ^ (d.h >> 32);
}

// Every rank's step number and settings digest are this rank's (sums of x and
// x^2 over the ranks, x < AgreeModulus(world) so that the sums are exact).
Status OffloadOptimizer::Impl::CheckRanksAgree(double step_sum, double step_sq_sum,
                                               double digest_sum, double digest_sq_sum) const {
  const auto same = [&](double sum, double sq_sum) {
    return sum * sum == static_cast<double>(world) * sq_sum;
  };
  if (!same(step_sum, step_sq_sum)) {
    return FailedPreconditionError(fmt::format(
        "rank {} is at step {}, and another rank at a different one: a rank skipped step(), or "
        "loaded a checkpoint or state dict alone. Every rank must call step() and the loads "
        "together; load the same checkpoint on every rank to go on (that drops the gradients "
        "handed over for this step). Nothing was updated",
        rank, step + 1));
  }
  if (!same(digest_sum, digest_sq_sum)) {
    std::string mine;
    for (uint32_t g = 0; g < step_hypers.size(); ++g) {
      const GroupHyper& h = step_hypers[g];
      mine += fmt::format("group {}: lr {} betas ({}, {}) eps {} weight_decay {}; ", g, h.lr,
                          h.beta1, h.beta2, h.eps, h.weight_decay);
    }
    return FailedPreconditionError(fmt::format(
        "step {}: rank {}'s update settings differ from another rank's ({}clipping norm {}, "
        "{}, loss scale {}): every rank must build the optimizer alike and change its "
        "hyperparameters alike (the same scheduler on every rank); compare the ranks' messages. "
        "Nothing was updated; the next Step takes the gradients handed over for this one "
        "(ZeroGrad() drops them)",
        step + 1, rank, mine, config.max_grad_norm, OptimizerTypeName(config.optimizer),
        scaler->scale()));
  }
  return OkStatus();
}

// Stages 1 and 2: the gradients handed over, their statistics over every
// rank, the decision. A skipped step ends here.
Status OffloadOptimizer::Impl::HandOverAndDecide() {
  // A micro-step after accumulated ones that reported any param ready is
  // one more micro-step: it joins the accumulation (the params it did not
  // report are read now). Whether a sub-group's reports completed it does
  // not matter: that depends on the sub-group size.
  const bool reported =
      std::find(tensor_ready.begin(), tensor_ready.end(), 1) != tensor_ready.end();
  if (grads->micro_steps() > 0 && (reported || grads->reduced_count() > 0)) {
    STRATA_RETURN_IF_ERROR(grads->Accumulate());
  }
  const double ts = NowSec();
  GradStats st;
  {
    HostSlice slice(trace, {TraceTrack::kStep, "decide"});
    STRATA_ASSIGN_OR_RETURN(st, grads->LocalStats());
    if (world > 1) {
      // Beside the statistics, in the same all-reduce: each rank's step number
      // and a digest of its update settings, as x and x^2 (all ranks agree
      // exactly when sum(x)^2 == world * sum(x^2)).
      const uint64_t modulus = internal::AgreeModulus(static_cast<uint32_t>(world));
      const double s = static_cast<double>((step + 1) % modulus);
      const double h = static_cast<double>(SettingsDigest() % modulus);
      double v[6] = {st.sum_sq, static_cast<double>(st.nonfinite_elems), s, s * s, h, h * h};
      STRATA_RETURN_IF_ERROR(
          (AllReduceDoubles(v, ReduceOp::kSum)).WithContext("all-reduce the gradient statistics"));
      STRATA_RETURN_IF_ERROR(CheckRanksAgree(v[2], v[3], v[4], v[5]));
      st.sum_sq = v[0];
      st.nonfinite_elems = static_cast<uint64_t>(v[1]);
    }
  }
  last.times.grad_stats = NowSec() - ts;
  Result<StepDecision> decided = internal::DecideStep(*scaler, st, config.max_grad_norm, step);
  if (!decided.ok()) {
    refused = StepDecision{.skip = true,
                           .step = step,
                           .loss_scale = scaler->scale(),
                           .grad_norm = std::sqrt(st.sum_sq) / scaler->scale(),
                           .micro_steps = std::max<uint32_t>(grads->micro_steps(), 1),
                           .nonfinite_elems = st.nonfinite_elems};
    return decided.status();
  }
  StepDecision d = *decided;
  d.micro_steps = std::max<uint32_t>(grads->micro_steps(), 1);
  grad_read_bytes = grads->micro_steps() > 0 ? 4 : DTypeSize(grads->wire_dtype());
  host_stats = grads->micro_steps() > 0;
  pending = d;
  return OkStatus();
}

internal::PipelineSchedule OffloadOptimizer::Impl::Schedule(int64_t update_step) const {
  // The CPU side: the sub-groups after the device ones (schedule positions
  // and sub-groups are relative to the first of them).
  const uint32_t n = static_cast<uint32_t>(sub_groups.size());
  std::vector<int32_t> extents(n - device_count);
  for (uint32_t i = device_count; i < n; ++i) extents[i - device_count] = tiers->extent(i);
  return internal::MakeSchedule(extents, slots, tiers->nvme_buffers(), mode,
                                /*reverse_nvme=*/update_step % 2 == 1);
}

// Stage 3: the pipeline (see the note at the top). Errors of one sub-group
// do not stop the others (every rank must issue every collective); the first
// one is returned.
Status OffloadOptimizer::Impl::RunPipeline(const StepDecision& d) {
  const bool serial = mode == PipelineMode::kSerial;
  const uint32_t k = device_count;  // the first CPU-side sub-group (see Schedule)
  const internal::PipelineSchedule schedule = Schedule(d.step);
  Status first_error;
  auto fail = [&](Status s) {
    if (first_error.ok()) first_error = std::move(s);
  };
  if (Status ordered = publisher->OrderAfterUser(); !ordered.ok()) {
    // Nothing was updated; the step's first reads (Step started them) end.
    tiers->DrainReads();
    return KeepUndone(std::move(ordered));
  }
  // Updates queued before a failure still run: FinishDeviceSide marks them
  // done, so that a retry does not apply them twice.
  std::vector<uint8_t> device_updated;
  if (Status s = StartDeviceSide(d, device_updated); !s.ok()) fail(std::move(s));
  if (serial) {
    // Each stage alone: the device side's update before the CPU's. Its
    // params are published below, where the overlapped mode publishes them:
    // every rank issues its all-gathers in one order, whatever its mode.
    if (Status s = FinishDeviceSide(device_updated); !s.ok()) fail(std::move(s));
  }
  for (uint32_t r : schedule.initial_reads) tiers->StartRead(k + r);
  double adam_sec = 0;
  // Sub-groups whose gradient copy failed to start: their slot holds
  // another's, so they are not updated (the retry fetches them again).
  std::vector<uint8_t> unfetched(sub_groups.size(), 0);
  for (const internal::ScheduledUpdate& u : schedule.updates) {
    const uint32_t i = k + u.sub_group;
    for (uint32_t q : u.fetch) {
      const uint32_t f = k + schedule.updates[q].sub_group;
      if (done[f]) continue;
      if (Status s = grads->Fetch(f, schedule.updates[q].slot); !s.ok()) {
        unfetched[f] = 1;
        fail(std::move(s).WithContext(fmt::format("fetch the gradient of {}", tiers->Name(f))));
      }
    }
    bool ok = !unfetched[i];
    if (Status s = publisher->WaitSlot(u.slot); !s.ok()) {
      fail(std::move(s).WithContext("upload params"));
      ok = false;
    }
    std::span<float> state;
    if (ok) {
      Result<std::span<float>> acquired = tiers->Acquire(i);
      if (!acquired.ok()) {
        fail(acquired.status());
        ok = false;
      } else {
        state = *acquired;
      }
    }
    void* staging = publisher->Staging(u.slot);
    if (!ok && !done[i]) {
      // The slot's gradient copy is still in flight and the slot is reused
      // by a later fetch: wait for it (this step already failed).
      (void)grads->Wait(i, u.slot);
    }
    if (ok && done[i]) {
      ConvertOut(state.first(sub_groups[i].elems()), staging, config.param_dtype);
    } else if (ok) {
      Result<GradView> grad = grads->Wait(i, u.slot);
      const double t0 = NowSec();
      Status s = grad.status();
      if (s.ok()) {
        HostSlice slice(
            trace, {TraceTrack::kCpu, "adam", static_cast<int32_t>(i),
                    sub_groups[i].elems() * (2 * 4 * arrays + param_bytes + DTypeSize(grad->dtype)),
                    tiers->on_nvme(i) ? "nvme" : "host"});
        s = Update(i, state, *grad, staging, d);
      }
      adam_sec += NowSec() - t0;
      if (!s.ok()) {
        fail(std::move(s).WithContext(fmt::format("update {}", tiers->Name(i))));
        ok = false;
      } else if (!tiers->on_nvme(i)) {
        done[i] = 1;
      } else {
        tiers->StartWrite(i);
        if (serial) {
          if (Status w = tiers->WaitWrite(i); !w.ok()) {
            fail(std::move(w));
          } else {
            done[i] = 1;
          }
        }
      }
    }
    for (uint32_t r : u.read_after) tiers->StartRead(k + r);
    // Params up. A sub-group that failed here still joins the all-gather
    // (collectives must match) but is not uploaded on this rank. A failed
    // publish stops nothing either: the later sub-groups' all-gathers keep
    // the ranks matched, and the tail below drains the publisher's stream
    // before the step's closing all-reduce (on another stream) is issued.
    if (Status s = publisher->Publish(i, u.slot, ok ? PublishMode::kUpload : PublishMode::kJoin);
        !s.ok()) {
      fail(std::move(s).WithContext(fmt::format("upload the params of {}", tiers->Name(i))));
    }
    if (serial) {
      if (Status s = publisher->WaitSlot(u.slot); !s.ok()) {
        fail(std::move(s).WithContext(fmt::format("upload the params of {}", tiers->Name(i))));
      }
    }
  }
  if (Status s = tiers->FinishWrites([&](uint32_t i, const Status& w) {
        if (w.ok()) done[i] = 1;
      });
      !s.ok()) {
    fail(std::move(s));
  }
  tiers->DrainReads();  // reads queued and never consumed (only after an error above)
  if (Status s = PublishDeviceSide(device_updated); !s.ok()) fail(std::move(s));
  if (Status s = FinishDeviceSide(device_updated); !s.ok()) fail(std::move(s));
  if (Status s = publisher->Finish(); !s.ok()) fail(std::move(s));
  last.times.adam += adam_sec;
  return KeepUndone(std::move(first_error));
}

// After a failed step (`error`), the trainer may zero or reuse its grad
// tensors before the retry: keeps the gradients of what it did not apply.
Status OffloadOptimizer::Impl::KeepUndone(Status error) {
  if (error.ok()) return error;
  for (uint32_t i = 0; i < sub_groups.size(); ++i) {
    if (done[i]) continue;
    if (Status s = grads->Keep(i); !s.ok()) {
      return std::move(error).WithContext(
          fmt::format("the gradients of {} could not be kept for a retry ({}); load a checkpoint",
                      tiers->Name(i), s.ToString()));
    }
  }
  return error;
}

Status OffloadOptimizer::Impl::Step() {
  const double t0 = NowSec();
  state_from_params = false;  // from here on the state may hold an update
  last = StepStats{};
  trace.step = pending ? pending->step : step + 1;
  HostSlice whole(trace, {TraceTrack::kStep, "step"});
  if (!pending) {
    // The first reads do not depend on the gradients: start them now.
    for (uint32_t r : Schedule(step + 1).initial_reads) tiers->StartRead(device_count + r);
    refused.reset();
    Status decided = HandOverAndDecide();
    if (!decided.ok()) {
      tiers->DrainReads();
      if (refused) {
        // The overflow stays visible: its norm, count and scale.
        last.skipped = true;
        FillStats(*refused, t0);
        refused.reset();
      }
      return std::move(decided).WithContext(fmt::format("step {}", step + 1));
    }
    std::fill(done.begin(), done.end(), 0);
    std::fill(device_pieces_queued.begin(), device_pieces_queued.end(), 0);
    if (pending->skip) {
      const StepDecision d = *pending;
      pending.reset();
      tiers->DrainReads();
      grads->Consume();
      ResetReadiness();
      last.skipped = true;
      FillStats(d, t0);
      // A dynamic scaler backs off, which says enough; not at its minimum.
      if (scaler->options().mode != LossScaleMode::kDynamic ||
          d.loss_scale <= scaler->options().min_scale) {
        WarnSilentSkip(d);
      }
      return OkStatus();
    }
  }
  const StepDecision d = *pending;
  Status result = RunPipeline(d);
  if (world > 1) {
    double failed[1] = {result.ok() ? 0.0 : 1.0};
    if (Status s = AllReduceDoubles(failed, ReduceOp::kSum); !s.ok() && result.ok()) result = s;
    if (result.ok() && failed[0] > 0) {
      result = UnavailableError(fmt::format(
          "{} other rank(s) failed this step (see their errors); once the cause is fixed, call "
          "RetryStep() on every rank, or, where a rank's error says its GPU is unusable, restart "
          "every rank and load the last checkpoint",
          failed[0]));
    }
  }
  if (result.ok()) {
    step = d.step;
    EndFailedStep();
    grads->Consume();
    ResetReadiness();
  }
  FillStats(d, t0);
  if (!result.ok()) {
    result = std::move(result).WithContext(fmt::format("step {}", d.step));
    failure = result;
    return result;
  }
  return OkStatus();
}

// A dynamic scaler's skips are its normal work (the scale goes down); without
// one (bf16/fp32, or a static scale), or at its minimum scale, a skipped step
// changes nothing and would otherwise go unnoticed, possibly for the rest of
// the run.
void OffloadOptimizer::Impl::WarnSilentSkip(const StepDecision& d) {
  ++silent_skips;
  if (rank != 0 || (silent_skips > 1 && silent_skips - silent_skips_warned < 100)) return;
  const uint64_t since = silent_skips - silent_skips_warned;
  silent_skips_warned = silent_skips;
  LogWarning(fmt::format(
      "step {} skipped: {} gradient elements are NaN or inf (grad norm {}){}; {} step{} skipped "
      "for non-finite gradients so far{}, the params and optimizer state unchanged by them. "
      "Look for NaN/inf in the loss and the data (a learning rate too high, an overflow in "
      "the forward){}. This warning repeats at most once per 100 skipped steps",
      d.step + 1, d.nonfinite_elems, d.grad_norm,
      scaler->options().mode == LossScaleMode::kStatic
          ? fmt::format(" and the static loss scale {} does not back off", d.loss_scale)
      : scaler->options().mode == LossScaleMode::kDynamic
          ? fmt::format(" at the dynamic loss scale's minimum {}, which cannot back off further",
                        d.loss_scale)
          : std::string(" and there is no loss scaler to back off"),
      silent_skips, silent_skips == 1 ? "" : "s",
      silent_skips == 1 ? "" : fmt::format(" ({} since the last warning)", since),
      scaler->options().mode == LossScaleMode::kDynamic
          ? ""
          : "; fp16 training needs a dynamic loss scale (fp16.loss_scale 0)"));
}

void OffloadOptimizer::Impl::FillStats(const StepDecision& d, double t0) {
  last.step = step;
  last.loss_scale = d.loss_scale;
  last.grad_norm = d.grad_norm;
  last.nonfinite_elems = d.nonfinite_elems;
  last.clip_coef = d.clip_coef;
  last.micro_steps = d.micro_steps;
  const internal::GradPathTimes g = grads->TakeTimes();
  const internal::PublisherTimes p = publisher->TakeTimes();
  const internal::TierFigures io = tiers->TakeFigures();
  last.times.d2h = g.d2h;
  last.times.h2d = p.h2d;
  last.times.comm = g.comm + p.comm + control_clock.busy;
  last.times.device = g.device + p.device;
  last.times.device_adam = device_adam_clock.busy;
  device_adam_clock.busy = 0;
  last.times.adam += g.host_stats;
  last.times.read = io.read_sec;
  last.times.write = io.write_sec;
  last.times.nvme = io.busy_sec;
  last.read_bytes = io.read_bytes;
  last.resident_bytes = io.resident_bytes;
  last.write_bytes = io.write_bytes;
  last.d2h_bytes = g.d2h_bytes;
  last.h2d_bytes = p.h2d_bytes;
  control_clock = {};
  // The CPU's own pass over host DRAM: the optimizer reads the gradient and
  // the state and writes the state and the params (the copy engines' DMA is
  // in d2h/h2d_bytes); accumulation reads its fp32 buffer for the statistics.
  const uint64_t host_elems = shard.elems() - plan.device_elems;
  if (!last.skipped) {
    last.host_dram_bytes = host_elems * (grad_read_bytes + 2 * 4 * arrays + param_bytes);
  }
  if (host_stats) last.host_dram_bytes += host_elems * 4;
  last.times.step = NowSec() - t0;
}

Status OffloadOptimizer::Impl::FailedStepError(std::string_view op) const {
  if (Status stopped = CommStopped(); !stopped.ok()) {
    return Status(stopped.code(),
                  fmt::format("{}: step {} failed part way and cannot be finished ({}): {}", op,
                              pending->step, failure.ToString(), stopped.message()));
  }
  if (IsDeviceLost(failure)) {
    // The device's context is gone (runtime/device.h): RetryStep() and a load
    // would fail the same way in this process, so neither is offered.
    return Status(failure.code(),
                  fmt::format("{}: step {} failed part way and cannot be finished or undone in "
                              "this process ({}); RetryStep() and loading a checkpoint fail the "
                              "same way here: restart the process and load the last checkpoint",
                              op, pending->step, failure.ToString()));
  }
  return FailedPreconditionError(
      fmt::format("{}: step {} failed part way and is not finished ({}); its update reached some "
                  "sub-groups only. RetryStep() finishes it with the gradients it kept; loading a "
                  "checkpoint or a state_dict replaces the state",
                  op, pending->step, failure.ToString()));
}

// ---- OffloadOptimizer -------------------------------------------------------------

OffloadOptimizer::OffloadOptimizer(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

OffloadOptimizer::~OffloadOptimizer() {
  // In a forked child the engine's threads do not exist: joining them, or
  // destroying a condition variable one of them waited on, would block for
  // ever, and the state store would remove the parent's live state file.
  // The child leaves it all alone (its memory goes when the child exits).
  if (impl_ && impl_->creator_pid != ::getpid()) (void)impl_.release();
}

OffloadOptimizer::Impl::~Impl() {
  // Work in flight uses the buffers: let it finish (errors are the steps'
  // business). Also where Create failed part way.
  if (grad_stream) device->StreamSynchronize(grad_stream).IgnoreError();
  if (device_stream) device->StreamSynchronize(device_stream).IgnoreError();
  tiers.reset();
  publisher.reset();
  grads.reset();
}

Result<std::unique_ptr<OffloadOptimizer>> OffloadOptimizer::Create(
    const EngineContext& context, const OffloadConfig& config, std::span<const ParamGroup> groups) {
  auto impl = std::make_unique<Impl>();
  impl->config = config;
  std::unique_ptr<OffloadOptimizer> opt(new OffloadOptimizer(std::move(impl)));
  const Status made = opt->impl_->Init(context, groups);
  if (!made.ok()) opt.reset();  // its buffers, before the cache goes back
  // What Create freed (the rate probe's buffers; everything it allocated
  // when it failed) goes back to the GPU, for torch and for a later Create
  // on the same device. Not a failure of Create: the ranks' Creates have
  // succeeded or failed together by now.
  if (context.device != nullptr) {
    if (Status s = context.device->ReleaseCachedMemory(); !s.ok() && made.ok()) {
      LogWarning(fmt::format("create offload optimizer: {}", s.ToString()));
    }
  }
  STRATA_RETURN_IF_ERROR(made);
  return opt;
}

Status OffloadOptimizer::GradReady(uint32_t index) {
  Impl& m = *impl_;
  STRATA_RETURN_IF_ERROR(m.CheckNotForked("grad ready"));
  if (index >= m.params.size()) {
    return OutOfRangeError(
        fmt::format("grad ready: param {} of {} registered", index, m.params.size()));
  }
  if (m.pending) return m.FailedStepError(fmt::format("grad ready {}", index));
  if (m.tensor_ready[index]) {
    m.ready_twice = fmt::format(
        "param {} was reported ready twice in one micro-step: its gradient was taken as final "
        "at the first report (its statistics and reduction began), so what was added to it "
        "since would be missed. Report each param once, after its last accumulation "
        "(ReduceGradients ends a micro-step); ZeroGrad() and run the backward again",
        index);
    return FailedPreconditionError("grad ready: " + m.ready_twice);
  }
  m.tensor_ready[index] = 1;
  m.trace.step = m.step + 1;  // the hand-over belongs to the next step
  for (uint32_t b : m.map.buckets_of(index)) {
    if (++m.ready_count[b] == m.map.tensors_in(b) && !m.grads->reduced(b)) {
      STRATA_RETURN_IF_ERROR(
          (m.grads->Ready(b))
              .WithContext(fmt::format("grad ready {}: sub-group {} complete", index, b)));
    }
  }
  return OkStatus();
}

Status OffloadOptimizer::ReduceGradients() {
  Impl& m = *impl_;
  STRATA_RETURN_IF_ERROR(m.CheckNotForked("reduce gradients"));
  if (m.pending) return m.FailedStepError("reduce gradients");
  if (!m.ready_twice.empty()) return FailedPreconditionError("reduce gradients: " + m.ready_twice);
  m.trace.step = m.step + 1;
  // The device sub-groups' fp32 sums take device memory the plan does not
  // hold (allocated at the first accumulated micro-step, then kept): within
  // device_budget, or refused before anything is read.
  const PlacementPlan& plan = m.plan;
  const uint64_t sums = plan.accumulation_device_bytes();
  if (m.grads->micro_steps() == 0 && sums > 0 && plan.device_budget_bytes > 0 &&
      plan.device_total_bytes() + sums > plan.device_budget_bytes) {
    return ResourceExhaustedError(fmt::format(
        "reduce gradients: accumulation keeps the device sub-groups' sums in fp32 on the device "
        "({} for {} elements), and with the plan's {} that exceeds strata.device_budget ({}); "
        "raise device_budget to at least {}, lower gpu_fraction, or sum the micro-steps' "
        "gradients in the trainer and call Step() once. Nothing was accumulated",
        FormatBytes(sums), plan.device_elems, FormatBytes(plan.device_total_bytes()),
        FormatBytes(plan.device_budget_bytes), FormatBytes(plan.device_total_bytes() + sums)));
  }
  STRATA_RETURN_IF_ERROR(m.grads->Accumulate());
  m.ResetReadiness();
  return OkStatus();
}

Status OffloadOptimizer::Step() {
  STRATA_RETURN_IF_ERROR(impl_->CheckNotForked("step"));
  STRATA_RETURN_IF_ERROR(impl_->CheckStateWhole("step"));
  if (!impl_->ready_twice.empty()) return FailedPreconditionError("step: " + impl_->ready_twice);
  impl_->step_hypers = impl_->hypers;
  return impl_->Step();
}

Status OffloadOptimizer::RetryStep() {
  STRATA_RETURN_IF_ERROR(impl_->CheckNotForked("retry step"));
  if (!impl_->pending) {
    STRATA_RETURN_IF_ERROR(impl_->CheckStateWhole("retry step"));
    return FailedPreconditionError(
        "retry step: no step failed; there is nothing to retry (call Step() for a new step)");
  }
  if (Status stopped = impl_->CommStopped(); !stopped.ok()) {
    return stopped.WithContext("retry step");
  }
  return impl_->Step();
}

StepState OffloadOptimizer::step_state() const {
  return impl_->pending || impl_->torn_count > 0 ? StepState::kFailed : StepState::kReady;
}

const Status& OffloadOptimizer::step_failure() const {
  return impl_->pending ? impl_->failure : impl_->torn_cause;
}

Status OffloadOptimizer::CheckStateWhole(std::string_view op) const {
  return impl_->CheckStateWhole(op);
}

std::string OffloadOptimizer::incomplete_state() const { return impl_->TornText(); }

Status OffloadOptimizer::RebindParam(uint32_t index, void* data, void* grad) {
  const ParamBinding move{.index = index, .data = data, .grad = grad};
  return RebindParams({&move, 1});
}

Status OffloadOptimizer::RebindParams(std::span<const ParamBinding> moves) {
  Impl& m = *impl_;
  constexpr std::string_view kOp = "rebind";
  STRATA_RETURN_IF_ERROR(m.CheckNotForked(kOp));
  std::vector<Param> next = m.params;
  std::vector<uint8_t> named(m.params.size(), 0);
  for (const ParamBinding& b : moves) {
    if (b.index >= m.params.size()) {
      return OutOfRangeError(
          fmt::format("{}: param {} of {} registered", kOp, b.index, m.params.size()));
    }
    Param& p = next[b.index];
    const std::string who =
        fmt::format("param {}{}", b.index, p.name.empty() ? "" : " (" + p.name + ")");
    if (named[b.index]++ != 0) {
      return InvalidArgumentError(
          fmt::format("{} {}: named twice in one rebind; give each param once", kOp, who));
    }
    // Allowed while a failed step awaits RetryStep: the gradients it did not
    // apply are kept by the engine, and the retry uploads every sub-group.
    if (p.elems > 0 && (b.data == nullptr || b.grad == nullptr)) {
      return InvalidArgumentError(
          fmt::format("{} {}: it has {} elems but the new {} pointer is null", kOp, who, p.elems,
                      b.data == nullptr ? "data" : "grad"));
    }
    if (p.elems > 0 && b.data == b.grad) {
      return InvalidArgumentError(
          fmt::format("{} {}: data and grad are the same pointer {}; every tensor and grad must be "
                      "registered once",
                      kOp, who, b.data));
    }
    p.data = b.data;
    p.grad = b.grad;
  }
  STRATA_RETURN_IF_ERROR(CheckTensorMemory(next, m.config.param_dtype, m.config.grad_dtype, kOp));
  // Queued work may still read or write the old tensors.
  STRATA_RETURN_IF_ERROR((m.device->StreamSynchronize(m.grad_stream)).WithContext(kOp));
  STRATA_RETURN_IF_ERROR((m.device->StreamSynchronize(m.publisher->stream())).WithContext(kOp));
  if (m.device_stream) {
    STRATA_RETURN_IF_ERROR((m.device->StreamSynchronize(m.device_stream)).WithContext(kOp));
  }
  for (const ParamBinding& b : moves) {  // in place: others may view m.params
    m.params[b.index].data = b.data;
    m.params[b.index].grad = b.grad;
  }
  m.map.Rebind(m.params);
  return OkStatus();
}

Status OffloadOptimizer::CheckNotForked(std::string_view op) const {
  return impl_->CheckNotForked(op);
}

Status OffloadOptimizer::ZeroGrad() { return ZeroGrads(/*keep_handed_over=*/false); }
Status OffloadOptimizer::ZeroGradTensors() { return ZeroGrads(/*keep_handed_over=*/true); }

Status OffloadOptimizer::ZeroGrads(bool keep_handed_over) {
  Impl& m = *impl_;
  STRATA_RETURN_IF_ERROR(m.CheckNotForked("zero grad"));
  Device& dev = *m.device;
  // The engine's streams may still read the grad tensors (hand-over) or
  // write the params: the zeroing on the trainer's stream comes after both.
  for (StreamRef s :
       {StreamRef(m.grad_stream), m.publisher->stream(), StreamRef(m.device_stream)}) {
    if (!s) continue;
    STRATA_ASSIGN_OR_RETURN(Event e, dev.CreateEvent());
    STRATA_RETURN_IF_ERROR(internal::OrderAfter(dev, m.user_stream, s, e));
  }
  for (const Param& p : m.params) {
    if (p.elems == 0) continue;
    // A pack with no entries sets the whole "bucket" to +0.
    STRATA_RETURN_IF_ERROR(
        kernels::PackGrads(dev, m.user_stream, {}, {p.grad, p.elems, m.config.grad_dtype}));
  }
  // Grads handed over and not consumed are dropped, except those of a
  // failed step awaiting retry (kept by the gradient path) and, for
  // ZeroGradTensors, the micro-steps that ReduceGradients summed.
  if (!m.pending && !keep_handed_over) {
    if (m.grads->micro_steps() > 0 && !m.warned_dropped) {
      m.warned_dropped = true;
      LogWarning(fmt::format(
          "zero grad: dropped the gradients of {} micro-step(s) handed over by "
          "ReduceGradients and not yet taken by a Step; to clear the grad tensors between "
          "micro-steps and keep the sum, call ZeroGradTensors() (C: "
          "strata_optimizer_zero_grad_tensors). Warned once",
          m.grads->micro_steps()));
    }
    return m.DropHandOver();
  }
  m.grads->ResetMicroStep();
  m.ResetReadiness();
  return OkStatus();
}

void OffloadOptimizer::SetPipelineMode(PipelineMode mode) { impl_->mode = mode; }
PipelineMode OffloadOptimizer::pipeline_mode() const { return impl_->mode; }
double OffloadOptimizer::loss_scale() const { return impl_->scaler->scale(); }
const StepStats& OffloadOptimizer::last_step() const { return impl_->last; }
int64_t OffloadOptimizer::step_count() const { return impl_->step; }
uint32_t OffloadOptimizer::num_groups() const {
  return static_cast<uint32_t>(impl_->hypers.size());
}
std::span<const Param> OffloadOptimizer::params() const { return impl_->params; }
uint32_t OffloadOptimizer::param_group(uint32_t index) const {
  STRATA_CHECK(index < impl_->param_group.size())
      << "param " << index << " of " << impl_->param_group.size();
  return impl_->param_group[index];
}
const GroupHyper& OffloadOptimizer::group_hyper(uint32_t group) const {
  STRATA_CHECK(group < impl_->hypers.size()) << "group " << group << " of " << impl_->hypers.size();
  return impl_->hypers[group];
}

Status OffloadOptimizer::SetGroupHyper(uint32_t group, const GroupHyper& hyper) {
  if (group >= impl_->hypers.size()) {
    return OutOfRangeError(
        fmt::format("set group hyper: group {} of {}", group, impl_->hypers.size()));
  }
  STRATA_RETURN_IF_ERROR(ValidateGroupHyper(
      hyper, fmt::format("set group hyper: group {}: ", group), impl_->config.optimizer));
  impl_->hypers[group] = hyper;
  return OkStatus();
}

const OffloadConfig& OffloadOptimizer::config() const { return impl_->config; }
const FlatLayout& OffloadOptimizer::layout() const { return impl_->layout; }
const PlacementPlan& OffloadOptimizer::plan() const { return impl_->plan; }
ElemRange OffloadOptimizer::shard() const { return impl_->shard; }
std::span<const ElemRange> OffloadOptimizer::sub_groups() const { return impl_->sub_groups; }
int OffloadOptimizer::rank() const { return impl_->rank; }
int OffloadOptimizer::world_size() const { return impl_->world; }
Communicator* OffloadOptimizer::comm() const { return impl_->comm; }
Device& OffloadOptimizer::device() const { return *impl_->device; }
uint32_t OffloadOptimizer::StateArrayCount() const { return impl_->arrays; }

Status OffloadOptimizer::ReadState(uint32_t index, std::span<float> out) {
  Impl& m = *impl_;
  STRATA_RETURN_IF_ERROR(m.CheckStateAccess(index, "read state"));
  STRATA_RETURN_IF_ERROR(m.CheckStateWhole("read state", index));
  const uint64_t want = m.sub_groups[index].elems() * m.arrays;
  if (out.size() != want) {
    return InvalidArgumentError(fmt::format(
        "read state of {}: the output has {} floats; it needs {} ({} arrays of {} elems)",
        m.tiers->Name(index), out.size(), want, m.arrays, m.sub_groups[index].elems()));
  }
  return m.tiers->Read(index, out).WithContext("read state");
}

Status OffloadOptimizer::ReadState(uint32_t index, uint32_t array, uint64_t begin,
                                   std::span<float> out) {
  Impl& m = *impl_;
  STRATA_RETURN_IF_ERROR(m.CheckStateAccess(index, "read state"));
  STRATA_RETURN_IF_ERROR(m.CheckStateWhole("read state", index));
  const uint64_t elems = m.sub_groups[index].elems();
  if (array >= m.arrays || begin > elems || out.size() > elems - begin) {
    return OutOfRangeError(fmt::format(
        "read state of {}: array {} elems [{}, {}) is outside its {} arrays of {} elems",
        m.tiers->Name(index), array, begin, begin + out.size(), m.arrays, elems));
  }
  return m.tiers->Read(index, array, begin, out).WithContext("read state");
}

Status OffloadOptimizer::WriteState(uint32_t index, std::span<const float> state) {
  Impl& m = *impl_;
  STRATA_RETURN_IF_ERROR(m.CheckStateAccess(index, "write state"));
  const uint64_t elems = m.sub_groups[index].elems();
  if (state.size() != elems * m.arrays) {
    return InvalidArgumentError(fmt::format(
        "write state of {}: the input has {} floats; it needs {} ({} arrays of {} elems)",
        m.tiers->Name(index), state.size(), elems * m.arrays, m.arrays, elems));
  }
  return WriteState(
      index,
      [&](uint32_t array, uint64_t begin, std::span<float> piece) {
        std::copy_n(state.begin() + array * elems + begin, piece.size(), piece.begin());
        return OkStatus();
      },
      elems);
}

Status OffloadOptimizer::WriteState(uint32_t index, const StateFill& fill, uint64_t piece_elems) {
  Impl& m = *impl_;
  STRATA_RETURN_IF_ERROR(m.CheckStateAccess(index, "write state"));
  m.BeginStateWrite();
  return m.EndWrite(index, m.tiers->Write(index, fill, piece_elems).WithContext("write state"));
}

Status OffloadOptimizer::ReadStateInOrder(const StateVisit& visit) {
  Impl& m = *impl_;
  STRATA_RETURN_IF_ERROR(m.CheckNotForked("read state"));
  STRATA_RETURN_IF_ERROR(m.CheckStateWhole("read state"));
  return m.WalkInOrder(0, [&](uint32_t i) -> Status {
    if (m.tiers->on_device(i)) {
      for (uint32_t a = 0; a < m.arrays; ++a) STRATA_RETURN_IF_ERROR(visit(i, a, {}));
      return OkStatus();
    }
    Result<std::span<const float>> state = m.tiers->View(i);
    if (!state.ok()) return state.status().WithContext("read state");
    const uint64_t elems = m.sub_groups[i].elems();
    return m.tiers->ForEachArray(
        /*concurrent=*/true,
        [&](uint32_t a) { return visit(i, a, state->subspan(a * elems, elems)); });
  });
}

Status OffloadOptimizer::WriteStateInOrder(const IndexedStateFill& fill, uint64_t piece_elems) {
  Impl& m = *impl_;
  STRATA_RETURN_IF_ERROR(m.CheckNotForked("write state"));
  m.BeginStateWrite();
  // Out of line until the whole write is known to have landed (NVMe writes
  // finish in FinishWrites, after the loop).
  m.MarkTorn(std::nullopt, Impl::kOutOfLine,
             FailedPreconditionError("a write of the whole state began and did not finish"));
  Status s;
  for (uint32_t i = 0; i < m.sub_groups.size() && s.ok(); ++i) {
    s = m.tiers->Write(i,
                       [&](uint32_t array, uint64_t begin, std::span<float> piece) {
                         return fill(i, array, begin, piece);
                       },
                       piece_elems, {.wait = false, .concurrent_arrays = true});
    if (!s.ok()) (void)m.EndWrite(i, s);
  }
  Status written = m.tiers->FinishWrites([](uint32_t, const Status&) {});
  if (s.ok()) s = std::move(written);
  if (s.ok()) {
    for (uint32_t i = 0; i < m.sub_groups.size(); ++i) (void)m.EndWrite(i, s);
  }
  return std::move(s).WithContext("write state");
}

Status OffloadOptimizer::UpdateState(uint32_t index, uint32_t array, const StateUpdate& update,
                                     uint64_t piece_elems) {
  Impl& m = *impl_;
  STRATA_RETURN_IF_ERROR(m.CheckStateAccess(index, "update state"));
  STRATA_RETURN_IF_ERROR(m.CheckStateWhole("update state", index));
  if (array >= m.arrays) {
    return OutOfRangeError(
        fmt::format("update state of {}: array {} of {}", m.tiers->Name(index), array, m.arrays));
  }
  m.state_from_params = false;
  return m.tiers->Update(index, array, update, piece_elems).WithContext("update state");
}

Result<uint64_t> OffloadOptimizer::ReloadParams(std::span<const uint32_t> which) {
  Impl& m = *impl_;
  constexpr std::string_view kOp = "reload params";
  STRATA_RETURN_IF_ERROR(m.CheckNotForked(kOp));
  STRATA_RETURN_IF_ERROR(m.CheckStateWhole(kOp));
  std::vector<uint8_t> wanted(m.params.size(), which.empty() ? 1 : 0);
  for (uint32_t k : which) {
    if (k >= m.params.size()) {
      return OutOfRangeError(fmt::format("{}: param {} of {} registered", kOp, k, m.params.size()));
    }
    wanted[k] = 1;
  }
  const DType dtype = m.config.param_dtype;
  const size_t bytes = DTypeSize(dtype);
  constexpr uint64_t kChunk = uint64_t{1} << 20;  // params read at a time
  // A chunk of params as read, as the engine last wrote it (the master cast
  // to the param dtype), and as fp32.
  std::vector<std::byte> read, written;
  std::vector<float> values;
  uint64_t adopted = 0;
  // Masters taken from the params are still the params' (a state from the
  // params stays one, also when this fails part way).
  const bool from_params = m.state_from_params;
  for (uint32_t i = 0; i < m.sub_groups.size(); ++i) {
    const std::span<const internal::TensorMap::Piece> own = m.map.own(i);
    if (std::none_of(own.begin(), own.end(), [&](const auto& p) { return wanted[p.tensor]; })) {
      continue;
    }
    Status s = UpdateState(i, 0, [&](uint64_t begin, std::span<float> master) -> Result<bool> {
      const uint64_t before = adopted;
      for (const internal::TensorMap::Piece& p : own) {
        if (!wanted[p.tensor]) continue;
        const uint64_t lo = std::max(begin, p.offset_elems);
        const uint64_t hi = std::min(begin + master.size(), p.offset_elems + p.elems);
        for (uint64_t at = lo; at < hi; at += kChunk) {
          const uint64_t n = std::min(kChunk, hi - at);
          const auto* src = static_cast<const std::byte*>(m.params[p.tensor].data) +
                            (p.tensor_offset_elems + at - p.offset_elems) * bytes;
          read.resize(n * bytes);
          written.resize(n * bytes);
          values.resize(n);
          // After the trainer's writes (and the engine's, which it waits for).
          STRATA_RETURN_IF_ERROR(m.device->CopyAsync(read.data(), src, n * bytes,
                                                     CopyKind::kDeviceToHost, m.user_stream));
          STRATA_RETURN_IF_ERROR(m.device->StreamSynchronize(m.user_stream));
          const std::span<float> out = master.subspan(at - begin, n);
          ConvertOut(out, written.data(), dtype);
          ConvertIn(read.data(), dtype, values);
          for (uint64_t k = 0; k < n; ++k) {
            if (std::memcmp(&read[k * bytes], &written[k * bytes], bytes) == 0) continue;
            out[k] = values[k];
            ++adopted;
          }
        }
      }
      return adopted != before;
    });
    m.state_from_params = from_params;
    STRATA_RETURN_IF_ERROR(std::move(s).WithContext(kOp));
  }
  return adopted;
}

bool OffloadOptimizer::state_from_params() const { return impl_->state_from_params; }

Status OffloadOptimizer::ResetStateFromParams() {
  Impl& m = *impl_;
  constexpr std::string_view kOp = "reset the state from the params";
  STRATA_RETURN_IF_ERROR(m.CheckNotForked(kOp));
  if (m.pending) return m.FailedStepError(kOp);
  Status reset = m.InitState().WithContext(kOp);
  if (!reset.ok()) {
    // Which host sub-groups it reached is not told: none is read as whole.
    m.MarkTorn(
        std::nullopt, Impl::kPartial,
        FailedPreconditionError(fmt::format("a reset failed part way ({})", reset.ToString())));
    return reset;
  }
  for (uint32_t i = 0; i < m.sub_groups.size(); ++i) (void)m.EndWrite(i, reset);
  m.tiers->TakeFigures();  // not a step's
  m.state_from_params = true;
  return OkStatus();
}

LossScalerState OffloadOptimizer::loss_scaler_state() const { return impl_->scaler->state(); }

const OffloadOptimizer::LoadedSave& OffloadOptimizer::loaded_save() const {
  return impl_->loaded_save;
}
void OffloadOptimizer::set_loaded_save(LoadedSave save) { impl_->loaded_save = std::move(save); }
std::weak_ptr<const void> OffloadOptimizer::identity() const { return impl_->identity; }

Status OffloadOptimizer::RestoreCounters(int64_t step, const LossScalerState& scaler) {
  if (step < 0) {
    return InvalidArgumentError(fmt::format("restore counters: step {} is negative", step));
  }
  STRATA_RETURN_IF_ERROR((impl_->scaler->Restore(scaler)).WithContext("restore counters"));
  Impl& m = *impl_;
  m.step = step;
  if (m.pending) m.DropFailedStep("was dropped by RestoreCounters()");
  // The counters of a load: gradients handed over for the state it replaced
  // (a step refused before its update keeps them for the next Step) are
  // not for this one; nor are the current micro-step's reports.
  return m.DropHandOver();
}

// The param half of the pipeline for every sub-group, from the committed
// master weights, with the same slots, events and collectives (every rank
// issues one all-gather per sub-group, failed or not).
Status OffloadOptimizer::UploadParams() {
  Impl& m = *impl_;
  STRATA_RETURN_IF_ERROR(m.publisher->OrderAfterUser());
  Status first_error;
  for (uint32_t i = 0; i < m.device_count; ++i) {
    STRATA_RETURN_IF_ERROR(m.publisher->PublishDevice(i, m.tiers->DeviceState(i), nullptr));
  }
  // The masters, NVMe extents read ahead, in the order opposite to the next
  // step's NVMe sub-groups (Schedule: reversed on odd updates), so that the
  // extents read last, left resident, are the ones that step takes first.
  // Every rank has the same step count, so the same order. A rank that
  // fails still joins every collective.
  const bool next_update_forward = (m.step + 1) % 2 == 0;
  auto keep = [&](Status s) {
    if (!s.ok() && first_error.ok()) first_error = std::move(s);
  };
  Status walked = m.WalkInOrder(
      m.device_count,
      [&](uint32_t i) -> Status {
        const uint32_t slot = (i - m.device_count) % m.slots;
        Status s = m.publisher->WaitSlot(slot);
        if (s.ok()) {
          Result<std::span<const float>> state = m.tiers->View(i);
          if (state.ok()) {
            ConvertOut(state->first(m.sub_groups[i].elems()), m.publisher->Staging(slot),
                       m.config.param_dtype);
          }
          s = state.status();
        }
        const bool ok = s.ok();
        keep(std::move(s));
        keep(m.publisher->Publish(i, slot, ok ? PublishMode::kUpload : PublishMode::kJoin));
        return OkStatus();
      },
      /*reverse=*/next_update_forward);
  keep(std::move(walked));
  if (Status s = m.publisher->Finish(); !s.ok() && first_error.ok()) first_error = std::move(s);
  m.publisher->TakeTimes();
  m.tiers->TakeFigures();
  return first_error.WithContext("upload params");
}

}  // namespace strata
