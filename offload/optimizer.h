// OffloadOptimizer: the optimizer a trainer calls. It owns the fp32 master
// weights and the optimizer moments of this rank's ZeRO shard, keeps them in
// pinned DRAM and on NVMe as the placement plan says, and runs one overlapped
// step: grads down (pack, reduce-scatter, D2H), global decisions (norm,
// non-finite, loss scaler, clipping), the sub-group pipeline (NVMe read-ahead,
// CPU Adam, write-behind, H2D) and params up (all-gather, unpack into the
// trainer's tensors).
//
//   STRATA_ASSIGN_OR_RETURN(OffloadConfig config, ParseConfigJson(json));
//   std::vector<ParamGroup> groups(1);
//   for (Tensor& t : model) {
//     groups[0].params.push_back({.name = t.name, .data = t.data, .grad = t.grad,
//                                 .elems = t.elems});
//   }
//   groups[0].hyper = {.lr = 3e-4, .weight_decay = 0.1};
//   STRATA_ASSIGN_OR_RETURN(auto opt, OffloadOptimizer::Create(
//       {.device = &device, .comm = comm, .stream = compute_stream}, config, groups));
//   for (;;) {
//     forward(); backward(loss * opt->loss_scale());   // writes the grads
//     STRATA_RETURN_IF_ERROR(opt->Step());            // params updated in place
//     STRATA_RETURN_IF_ERROR(opt->ZeroGrad());
//     LogInfo(FormatStepStats(opt->last_step()));
//   }
//
// Tensors: `data` and `grad` are device memory of `context.device` (any
// host memory for the host device), `config.param_dtype` and
// `config.grad_dtype` elements, alive and not moved for the optimizer's
// lifetime. The tensors of all groups are packed in order into one flat
// buffer (offload/layout.h); every rank must register the same tensors in the
// same order with the same sizes. The fp32 master weights start as the
// registered params (read once, in Create).
//
// Gradients and accumulation. Step() consumes the gradients of the last
// backward: with one rank it reads them from the grad tensors (statistics on
// the device, then each sub-group's gradient copied down in the grad dtype
// just before its update), so the trainer must not change them until Step()
// returns; with several ranks they are reduce-scattered into a host buffer.
// GradReady(i) says param i's grad is final for this step, so its
// sub-groups' statistics (several ranks: pack, reduce-scatter, D2H) start
// while backward goes on; it is optional. ReduceGradients() ends a
// micro-step of gradient accumulation: the grads are added, exactly, into an
// fp32 host buffer, and the trainer may then reuse the grad tensors (a
// backward that adds into them clears them with ZeroGradTensors(), which
// keeps the sum; ZeroGrad() drops it). With
// accumulation call it after every micro-step, the last one included; Step()
// then takes the sum (a Step() after micro-steps handed over this way does
// not read the grad tensors again, unless GradReady reported a param since
// the last ReduceGradients: that micro-step then joins the sum, its params
// not reported read at the Step). A param reported twice in one micro-step
// is refused (FailedPrecondition), and Step/ReduceGradients with it until
// ZeroGrad: what was added after the first report would be missed. With
// several ranks the reductions (collectives) go in descending sub-group order
// on every rank, whatever order GradReady comes in. docs/offload.md ("One
// step") has the whole story.
//
// Streams: work that reads the trainer's tensors is ordered after the work
// enqueued on `context.stream` before the call (an event, no host sync);
// Step() makes `context.stream` wait for the param updates before it returns,
// so the next forward enqueued there sees the new params. Step() itself blocks
// the calling thread until the CPU update of every sub-group is done.
//
// Errors: Create returns InvalidArgument for bad groups (null pointers, no
// tensors, groups that differ across ranks, two params of one non-empty
// name, which checkpoints key tensors by), and the planner's
// ResourceExhausted when the state does not fit. With several ranks Create
// fails on every rank together: the ranks whose own part worked return
// FailedPrecondition ("another rank failed to create its optimizer"). Step
// returns the IO error of the NVMe tier (with file, offset and size),
// FailedPrecondition when the loss scaler gives up at min_scale. A step that
// fails part way (an IO error on a later sub-group) has updated some
// sub-groups and not others: the optimizer is then in StepState::kFailed, and
// until the step is finished or replaced it refuses to take another step
// (Step), to save (Save) or to hand out state (ReadState), each with
// FailedPrecondition naming the failed step and the way out, so no checkpoint
// and no new step ever mixes two steps. RetryStep() finishes the failed step
// with the gradients it kept (the result is bitwise a clean run's); Load()
// or WriteState() of every sub-group replace the state and make it ready (a
// write that fails part way leaves it kFailed, refusing the same calls,
// until the state is written whole again: a failed load never becomes a
// step or a checkpoint that mixes two states). With
// several ranks a rank whose own step worked returns Unavailable when another
// failed, and every rank is in kFailed, so all retry; a rank that never calls
// Step leaves the others waiting in a collective (the local communicator's
// rendezvous timeout ends it).
//
// Thread-safety: one thread drives an optimizer. Different ranks' optimizers
// (one per thread with the local communicator) run concurrently.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "offload/config.h"
#include "offload/layout.h"
#include "offload/loss_scaler.h"
#include "offload/placement.h"
#include "runtime/comm.h"
#include "runtime/device.h"
#include "runtime/status.h"
#include "runtime/storage.h"
#include "runtime/trace.h"

namespace strata {

// What the engine runs on; the caller owns these and keeps them alive for
// the optimizer's lifetime.
struct EngineContext {
  Device* device = nullptr;      // required
  Communicator* comm = nullptr;  // nullptr: one rank (world size 1)
  Storage* storage = nullptr;    // NVMe IO; nullptr: the engine opens io_uring (POSIX fallback)
  // The trainer's compute stream: work that reads the trainer's tensors is
  // ordered after what it enqueued there, and the trainer's next work there
  // sees the updates. {}: device->DefaultStream(), which on CUDA is the
  // legacy default stream (native stream 0), where a trainer that names no
  // stream runs its kernels.
  StreamRef stream{};
  // Where the engine records its timeline while the recorder is enabled
  // (runtime/trace.h); nullptr: no trace. Several optimizers may share one.
  TraceRecorder* trace = nullptr;
};

// One trainer tensor.
struct Param {
  std::string name{};    // optional, UTF-8; checkpoints and exports use it
  void* data = nullptr;  // device memory, config.param_dtype
  void* grad = nullptr;  // device memory, config.grad_dtype
  uint64_t elems = 0;
};

// New memory for registered param `index` (OffloadOptimizer::RebindParams).
struct ParamBinding {
  uint32_t index = 0;
  void* data = nullptr;
  void* grad = nullptr;
};

// The hyperparameters of a param group. The config's optimizer section gives
// the defaults; SetGroupHyper changes them between steps (LR schedulers).
struct GroupHyper {
  double lr = 1e-3;
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = 1e-8;
  double weight_decay = 0.0;
};

struct ParamGroup {
  std::vector<Param> params;
  GroupHyper hyper;
};

// The config's optimizer hyperparameters as a group's defaults.
GroupHyper DefaultGroupHyper(const OffloadConfig& config);

// OK when the fp32 update can run with `h`; else InvalidArgument naming the
// field: "{where}{field} is {value}; it must be {allowed}". The one rule for
// every path that takes hyperparameters: registration, SetGroupHyper and a
// checkpoint's manifest (load, `strata inspect --verify`, export). Fields
// `type`'s update does not read (Lion's eps, Adagrad's betas) need only be
// finite.
Status ValidateGroupHyper(const GroupHyper& h, std::string_view where, OptimizerType type);

// Seconds each stage of the last step kept its resource busy, and the step's
// wall time. Stages overlap, so they add up to more than `step`. On a GPU the
// device kernels take milliseconds; on the host device they are host twins
// (kernels/kernels_host.cc) and show up.
struct StageTimes {
  double d2h = 0;    // gradient copies device -> pinned host
  double comm = 0;   // reduce-scatter, all-reduce of the statistics, all-gather
  double read = 0;   // NVMe reads of optimizer state (each read's time; reads overlap)
  double adam = 0;   // CPU optimizer (and, after accumulation, the host statistics pass)
  double write = 0;  // NVMe writes of optimizer state (each write's time)
  double nvme = 0;   // wall time with any NVMe read or write in flight
  double h2d = 0;    // param copies pinned host -> device
  double step = 0;   // wall time of Step(), including the hand-over it waited for
  // Wall time from the start of the step until the decision: waiting for the
  // gradient statistics (computed on the device, during backward when the
  // trainer reports GradReady), the all-reduce over ranks, the loss scaler.
  double grad_stats = 0;
  double device = 0;  // device kernels: statistics, packs and unpacks (several ranks)
  // Partial offload: the device Adam of the sub-groups kept on the device,
  // on its own stream, concurrent with the CPU side (adam).
  double device_adam = 0;
};

// How Step() schedules its stages. kOverlapped (the default) is the
// pipeline: NVMe read-ahead and write-behind, CPU update and H2D of different
// sub-groups at once. kSerial runs every stage alone: no read issued before
// the gradients are on the host, and per sub-group read, update, write and
// upload each wait for the one before (and the device side of a partial
// offload updates first, alone; its params are all-gathered where the
// overlapped mode does it, so ranks may run different modes). Same results
// bit for bit, only slower;
// its StageTimes are each stage's busy time with nothing else running, the
// baseline `strata bench step` divides by (docs/guide.md, "Reading the bench").
enum class PipelineMode : uint8_t { kOverlapped = 0, kSerial = 1 };

struct StepStats {
  int64_t step = 0;           // optimizer steps taken so far (skipped ones not counted)
  bool skipped = false;       // non-finite gradients: no update (a dynamic loss scale went down)
  double loss_scale = 1.0;    // the scale this step's gradients carried
  double grad_norm = 0.0;     // global L2 norm of the unscaled gradients, before clipping
  // Gradient elements that were NaN or inf (all ranks); > 0 means skipped.
  uint64_t nonfinite_elems = 0;
  float clip_coef = 1.0f;     // ClipCoefficient; 1 when not clipped
  uint32_t micro_steps = 0;   // gradients accumulated into this step
  StageTimes times;
  uint64_t read_bytes = 0;    // NVMe
  uint64_t write_bytes = 0;   // NVMe
  // NVMe reads not needed: the extent was still in its buffer from the step
  // before (steps alternate the order of their NVMe sub-groups).
  uint64_t resident_bytes = 0;
  uint64_t d2h_bytes = 0;      // PCIe, device to host (gradients)
  uint64_t h2d_bytes = 0;      // PCIe, host to device (params)
  // Host DRAM bytes the CPU itself reads and writes: the optimizer's one pass
  // (gradient, state in and out, params out: 28 per element for bf16 Adam)
  // and, after accumulation, the statistics pass over the fp32 gradient. The
  // copy engines' DMA is counted in d2h/h2d_bytes, NVMe in read/write_bytes.
  uint64_t host_dram_bytes = 0;
};

// kFailed: the last Step()/RetryStep() returned an error after part of its
// update was applied (see "Errors" above).
enum class StepState : uint8_t { kReady = 0, kFailed = 1 };

// One line: "step 12: 1.23 s (read 1.1 s, adam 0.4 s, ...), loss scale 65536".
std::string FormatStepStats(const StepStats& stats);

class OffloadOptimizer {
 public:
  // Plans the flat layout and the placement (logged with FormatPlan), opens
  // the NVMe store when the plan needs it, allocates the pinned and device
  // buffers and initializes the master weights from the params (a
  // collective: every rank calls it).
  static Result<std::unique_ptr<OffloadOptimizer>> Create(const EngineContext& context,
                                                          const OffloadConfig& config,
                                                          std::span<const ParamGroup> groups);
  ~OffloadOptimizer();
  OffloadOptimizer(const OffloadOptimizer&) = delete;
  OffloadOptimizer& operator=(const OffloadOptimizer&) = delete;

  // The grad of param `index` (flat over groups, registration order) is
  // complete on context.stream. Optional, once per param and micro-step; see
  // "Gradients" above.
  Status GradReady(uint32_t index);
  // Hands over the gradients of the micro-step that just ended.
  Status ReduceGradients();
  // One optimizer step (a collective). FailedPrecondition while kFailed.
  Status Step();
  // Finishes the failed step with the gradients it kept (a collective; every
  // rank calls it); FailedPrecondition when no step failed.
  Status RetryStep();
  // kFailed also while a state write that failed part way (or a failed step
  // dropped before every sub-group was written again) leaves sub-groups
  // that may mix two states: Step, RetryStep, Save and reading those
  // sub-groups refuse until they are written whole again (a load,
  // WriteState of each, ResetStateFromParams()).
  StepState step_state() const;
  // The error of the failed step, or why the state is incomplete; OK while kReady.
  const Status& step_failure() const;
  // OK when the state is one step's; else FailedPrecondition for `op`
  // naming the failed step or the incomplete sub-groups, and the way out.
  Status CheckStateWhole(std::string_view op) const;
  // Why sub-groups may mix two states after a failed write (which, since
  // when, the way out); "" when none may. RetryStep() cannot help there.
  std::string incomplete_state() const;
  // FailedPrecondition in a child this process forked (a DataLoader
  // worker): the engine's threads stayed in the parent, and a call that
  // waits on them would wait for ever. The calls that do check it first;
  // callers that build on them (save, load, the trace) check it before
  // anything of theirs.
  Status CheckNotForked(std::string_view op) const;
  // Zeroes the registered grad tensors (on context.stream) and drops
  // gradients handed over but not yet consumed by a Step (warned once when
  // ReduceGradients had summed some: a loop that clears its grads between
  // micro-steps wants ZeroGradTensors).
  Status ZeroGrad();
  // Zeroes the registered grad tensors only: the micro-steps ReduceGradients
  // summed stay for the next Step. For a backward that adds into the grad
  // tensors, between micro-steps of accumulation.
  Status ZeroGradTensors();

  // Takes effect at the next Step(); a failed step awaiting retry may be
  // retried in either mode. For benchmarks and diagnosis.
  void SetPipelineMode(PipelineMode mode);
  PipelineMode pipeline_mode() const;

  // Param `index` (flat over groups) now lives at `data` / `grad` (the
  // trainer replaced its storage: same elems and dtypes, new memory). Waits
  // for the engine's work in flight, then uses the new pointers from the
  // next operation on. OutOfRange for a bad index; InvalidArgument for a null
  // pointer with elems > 0, or memory that overlaps another tensor's. Allowed
  // while a failed step awaits RetryStep: that step keeps the gradients it
  // did not apply, and the retry writes every param to the new storage.
  Status RebindParam(uint32_t index, void* data, void* grad);
  // Several params at once, all or none: the new memory of one may be where
  // another moved param used to be (the trainer freed and reallocated both),
  // so the check is on the params as they are after every move.
  // InvalidArgument also for an index named twice.
  Status RebindParams(std::span<const ParamBinding> moves);

  // The loss multiplier for the next backward (1 unless fp16 loss scaling).
  double loss_scale() const;
  const StepStats& last_step() const;
  int64_t step_count() const;

  uint32_t num_groups() const;
  // The registered tensors, flat over groups in registration order (names
  // as given, "" when none), and the group of each.
  std::span<const Param> params() const;
  uint32_t param_group(uint32_t index) const;
  const GroupHyper& group_hyper(uint32_t group) const;
  // OutOfRange for a bad group index; InvalidArgument for bad values (lr < 0, betas outside
  // [0, 1), eps <= 0, weight_decay < 0). Applies from the next Step(): a
  // RetryStep finishes the failed step with the values it began with.
  Status SetGroupHyper(uint32_t group, const GroupHyper& hyper);

  const OffloadConfig& config() const;
  const FlatLayout& layout() const;    // the tensors of all groups, in order
  const PlacementPlan& plan() const;   // this rank's placement
  ElemRange shard() const;             // this rank's flat elements
  std::span<const ElemRange> sub_groups() const;  // the shard cut into sub-groups
  int rank() const;
  int world_size() const;
  Communicator* comm() const;  // nullptr for one rank
  Device& device() const;

  // The fp32 state of sub-group `index` as arrays of its elems, one after the
  // other: master, then the moments (Adam: master | exp_avg | exp_avg_sq).
  // StateArrayCount() arrays. Read gives the committed state wherever it
  // lives (FailedPrecondition while kFailed: the state mixes two steps);
  // Write replaces it (NVMe: a new committed generation) and ends a failed
  // step. For checkpoints and tests; not to be called while a step is running.
  uint32_t StateArrayCount() const;
  Status ReadState(uint32_t index, std::span<float> out);
  Status WriteState(uint32_t index, std::span<const float> state);
  // The same piece by piece, with no buffer of a whole sub-group's state
  // (checkpoints of large sub-groups). Read: out.size() elems of array
  // `array` (0 = master) from elem `begin`; OutOfRange past the array's end.
  // Write: `fill(array, begin, piece)` writes elems [begin, begin +
  // piece.size()) of `array`; its calls cover every array once, in order
  // (DRAM and NVMe state: one call per array, in place; device state:
  // pieces of at most `piece_elems`). A fill's error is returned as is; an
  // NVMe sub-group then keeps its committed state, a DRAM one is left
  // partly written.
  Status ReadState(uint32_t index, uint32_t array, uint64_t begin, std::span<float> out);
  using StateFill = std::function<Status(uint32_t array, uint64_t begin, std::span<float> piece)>;
  Status WriteState(uint32_t index, const StateFill& fill, uint64_t piece_elems = 1 << 20);
  // Changes array `array` of sub-group `index` in place (adopting values the
  // trainer wrote into some params): `update(begin, piece)` sees the
  // committed elems [begin, begin + piece.size()), may change them, and
  // returns whether it did. One call for DRAM and NVMe state, in place;
  // device state in pieces of at most `piece_elems`. Only what changed is
  // written back (NVMe: one new generation when anything did). An update's
  // error is returned as is (NVMe state then stays as committed). Refused
  // like ReadState while a failed step awaits its retry.
  using StateUpdate = std::function<Result<bool>(uint64_t begin, std::span<float> piece)>;
  Status UpdateState(uint32_t index, uint32_t array, const StateUpdate& update,
                     uint64_t piece_elems = 1 << 20);
  // The whole state, sub-group by sub-group in index order (checkpoints),
  // with the NVMe IO beside the caller's work and the arrays of a DRAM or
  // NVMe sub-group on the CPU optimizer's threads (`threads`), each array's
  // call on a thread of its own where there are enough: the calls for one
  // sub-group's arrays may run concurrently and must touch only their own
  // array's data; the next sub-group's start after all of them returned.
  // Read: `visit(index, array, state)` for every array of every sub-group;
  // `state` is that array's committed elems (DRAM, or the NVMe extent read
  // and verified while the one before was visited), valid until visit
  // returns; for device state it is empty and visit reads it with ReadState
  // (those calls run in order on the calling thread). No read is left in
  // flight when it returns (the first error: a visit's, as is, the lowest
  // array's of the first sub-group that failed). Write: WriteState of every
  // sub-group from `fill(index, array, begin, piece)`, each NVMe sub-group
  // written while the next ones are filled; it returns once every write is
  // done, with the first error (the sub-groups before it, and any NVMe one
  // whose write succeeded, hold the new state; the others are as WriteState
  // leaves them).
  using StateVisit =
      std::function<Status(uint32_t index, uint32_t array, std::span<const float> state)>;
  Status ReadStateInOrder(const StateVisit& visit);
  using IndexedStateFill =
      std::function<Status(uint32_t index, uint32_t array, uint64_t begin, std::span<float> piece)>;
  Status WriteStateInOrder(const IndexedStateFill& fill, uint64_t piece_elems = 1 << 20);

  // Everything a checkpoint holds besides the arrays.
  LossScalerState loss_scaler_state() const;
  // Sets the step counter and the scaler (checkpoint load), ends a failed
  // step (its sub-groups stay out of line until written: step_state()) and
  // drops the gradients handed over and not yet taken by a Step (a Step
  // refused before its update keeps them), and the micro-step's reports;
  // InvalidArgument for a state the scaler cannot reach or a negative step.
  Status RestoreCounters(int64_t step, const LossScalerState& scaler);

  // Checkpoints (docs/checkpoint.md): a collective; every rank calls it with
  // the same directory.
  Status Save(const std::string& dir);
  Status Load(const std::string& dir);
  // The save the last successful checkpoint load read, and how many saves
  // this optimizer published beside it since. LoadCheckpoint sets it;
  // SaveCheckpoint counts and, until as many saves as retention keeps have
  // followed it, keeps that save.
  struct LoadedSave {
    std::string dir;          // canonical path; "" when none
    uint32_t saves_after = 0;  // saves published into dir's parent since
  };
  const LoadedSave& loaded_save() const;
  void set_loaded_save(LoadedSave save);
  // This optimizer while it lives (expired once it is destroyed): the
  // checkpoint module remembers which live optimizer of the process saves
  // into a directory, and refuses a second one.
  std::weak_ptr<const void> identity() const;

  // Recomputes the trainer's param tensors from the committed fp32 master
  // weights (cast to param_dtype, all-gathered), as a step does after its
  // update; for code that replaced the state with WriteState (checkpoint
  // load). A collective. `context.stream` waits for the copies, as after
  // Step(). Not to be called while a step is running.
  Status UploadParams();

  // The reverse: values the trainer wrote into params since the engine last
  // wrote them (weights loaded after Create, an edit) become the master
  // weights, as DeepSpeed's refresh_fp32_params. Each element of this
  // rank's shard whose param value differs from its master weight cast to
  // param_dtype takes the param's value; the others keep their fp32 master
  // (nothing is rounded), and the moments stay. `params`: registration
  // indices (empty: all). Reads the params in order on `context.stream`.
  // Not a collective: each rank adopts its own shard, so every rank must
  // hold the same values. Returns how many elements changed on this rank.
  // Without it the next step writes every param from the old masters.
  // OutOfRange for a bad index; refused like ReadState while a failed step
  // awaits its retry.
  Result<uint64_t> ReloadParams(std::span<const uint32_t> params = {});

  // Whether the state is the one Create writes from the params: no step (not
  // even a failed or skipped one), load or state write since Create or
  // ResetStateFromParams (ReloadParams keeps it: the masters it takes are
  // the params'). Such a state loses nothing when it is overwritten, since
  // ResetStateFromParams writes it again: a checkpoint load into it reads
  // each file once (LoadCheckpoint).
  bool state_from_params() const;
  // Writes the state as Create does: the master weights from the params as
  // they are now (read on `context.stream`, after what the trainer queued
  // there), the moments zero. The step count, loss scaler and
  // hyperparameters stay. Refused like ReadState while a failed step awaits
  // its retry; the state's IO errors otherwise.
  Status ResetStateFromParams();

 private:
  struct Impl;
  explicit OffloadOptimizer(std::unique_ptr<Impl> impl);
  Status ZeroGrads(bool keep_handed_over);
  std::unique_ptr<Impl> impl_;
};

}  // namespace strata
