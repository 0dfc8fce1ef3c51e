// The engine: OffloadOptimizer. docs/offload.md ("The engine") has the whole
// story; the comments here say why the pieces are shaped as they are.
//
// Streams and threads of one optimizer:
//   calling thread   CPU optimizer (CpuAdam over its TBB arena), drives the step
//   grad stream      pack grads -> reduce-scatter -> D2H (+ host add for accumulation),
//                    and the small all-reduces of the statistics
//   h2d stream       H2D of the param staging -> all-gather -> unpack into the tensors
//   IO thread        every StateStore call (internal::IoQueue), FIFO
//
// Retry: each sub-group of a step is "done" once its update is in the state
// that Read/WriteState see: a host sub-group when its update ran (in place),
// an NVMe sub-group when its write committed. A failed step keeps its
// decision (step number, grad multiplier, loss scale) and its gradients;
// Step() again redoes only the sub-groups that are not done, so the result is
// the one of a clean run. Done sub-groups are still uploaded again (their
// params are recomputed from the committed master weights, bitwise what the
// update wrote) because every rank must issue the same collectives.
#include "offload/optimizer.h"

#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <future>
#include <mutex>
#include <numeric>
#include <optional>
#include <unordered_map>
#include <utility>

#include "cpu_adam/cpu_adam.h"
#include "kernels/kernels.h"
#include "offload/engine_io.h"
#include "offload/state_store.h"
#include "runtime/log.h"
#include "runtime/machine.h"
#include "runtime/pinned.h"
#include "runtime/units.h"

namespace strata {
namespace {

double Now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

// Busy time of one stage on one stream: host tasks before and after its work
// take timestamps on the stream's own thread, so the figure is the time the
// stream spent on the work, not the time it waited in the queue.
struct StageClock {
  double start = 0;
  double busy = 0;
};

template <typename F>
Status Timed(Device& device, StreamRef stream, StageClock* clock, F&& enqueue) {
  STRATA_RETURN_IF_ERROR(device.LaunchHostFunc(stream, [clock] { clock->start = Now(); }));
  STRATA_RETURN_IF_ERROR(enqueue());
  return device.LaunchHostFunc(stream, [clock] { clock->busy += Now() - clock->start; });
}

Status ValidateHyper(const GroupHyper& h, std::string_view what) {
  auto bad = [&](std::string_view field, double v, std::string_view allowed) {
    return InvalidArgumentError(
        fmt::format("{}: {} is {}; it must be {}", what, field, v, allowed));
  };
  if (!std::isfinite(h.lr) || h.lr < 0) return bad("lr", h.lr, "finite and >= 0");
  if (!std::isfinite(h.beta1) || h.beta1 < 0 || h.beta1 >= 1)
    return bad("beta1", h.beta1, "in [0, 1)");
  if (!std::isfinite(h.beta2) || h.beta2 < 0 || h.beta2 >= 1)
    return bad("beta2", h.beta2, "in [0, 1)");
  if (!std::isfinite(h.eps) || h.eps <= 0) return bad("eps", h.eps, "finite and > 0");
  if (!std::isfinite(h.weight_decay) || h.weight_decay < 0) {
    return bad("weight_decay", h.weight_decay, "finite and >= 0");
  }
  return OkStatus();
}

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

OutView MakeOut(DType dtype, void* data, size_t elems) { return OutView{dtype, data, elems}; }

// A run of a sub-group whose elements all take one group's hyperparameters
// (padding joins the run it sits in: its state and grad are zero and stay zero).
struct Run {
  uint64_t begin = 0;  // relative to the sub-group
  uint64_t end = 0;
  uint32_t group = 0;
};

struct Pending {
  int64_t step = 0;
  float grad_scale = 1.0f;
  double loss_scale = 1.0;
  double grad_norm = 0.0;
  float clip_coef = 1.0f;
  uint32_t micro_steps = 0;
};

}  // namespace

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
  if (s.clip_coef < 1.0f) out += fmt::format(", clip {:.4g}", s.clip_coef);
  if (s.read_bytes + s.write_bytes > 0) {
    out += fmt::format(", nvme read {} write {}", FormatBytes(s.read_bytes),
                       FormatBytes(s.write_bytes));
  }
  return out;
}

struct OffloadOptimizer::Impl {
  // ---- set up once ----
  Device* device = nullptr;
  Communicator* comm = nullptr;
  StreamRef user_stream;
  OffloadConfig config;
  int rank = 0;
  int world = 1;
  std::vector<GroupHyper> hypers;
  std::vector<Param> params;          // flat over groups
  std::vector<uint32_t> param_group;  // group of each param
  FlatLayout layout;
  ElemRange shard;
  std::vector<ElemRange> sub_groups;
  PlacementPlan plan;
  uint32_t arrays = 3;
  uint64_t max_sg_elems = 0;
  uint32_t buffer_count = 1;
  size_t param_bytes = 2;
  std::vector<std::vector<Run>> runs;                     // per sub-group
  std::vector<std::vector<kernels::PackEntry>> pack;      // per sub-group, every rank's block
  std::vector<std::vector<kernels::UnpackEntry>> unpack;  // per sub-group, every rank's block
  std::vector<std::vector<uint32_t>> tensor_buckets;      // per tensor: sub-groups it touches
  std::vector<uint32_t> bucket_need;                      // per sub-group: tensors touching it
  std::vector<int32_t> extent_of;                         // per sub-group: NVMe extent or -1
  std::vector<uint32_t> nvme_order;                       // sub-groups on NVMe, in order

  std::unique_ptr<Storage> owned_storage;
  std::unique_ptr<StateStore> store;
  std::unique_ptr<internal::IoQueue> io;
  std::optional<PinnedPool> pool;
  PinnedBuffer grad_buf;                    // shard_elems fp32
  std::vector<PinnedBuffer> param_staging;  // buffer_count x max_sg_elems x param dtype
  std::vector<PinnedBuffer> nvme_bufs;      // buffer_count x ExtentBufferBytes
  std::vector<PinnedBuffer> host_state;     // per sub-group (empty for NVMe ones)
  std::vector<PinnedBuffer> accum_scratch;  // buffer_count x max_sg_elems fp32, on first use
  std::optional<PinnedPool> small_pool;     // `small` before `pool` exists (several ranks)
  PinnedBuffer small;                       // 4 KiB: statistics to and from the device
  std::vector<DeviceBuffer> buckets;        // buffer_count x world x max_sg_elems x 4 bytes
  DeviceBuffer dev_small;
  Stream grad_stream;
  Stream h2d_stream;
  Event user_event;
  Event grad_event;
  Event h2d_event;
  std::vector<Event> slot_events;  // one per param staging buffer
  std::unique_ptr<CpuAdam> cpu;
  std::optional<LossScaler> scaler;
  PipelineMode mode = PipelineMode::kOverlapped;

  // ---- per step ----
  int64_t step = 0;
  StepStats last;
  uint32_t micro_steps = 0;
  std::vector<uint8_t> reduced;  // per bucket: reduced in the current micro-step
  uint32_t reduced_count = 0;
  std::vector<uint8_t> has_grad;  // per bucket: the grad buffer holds this step's grads
  std::vector<uint32_t> ready_count;
  std::vector<uint8_t> tensor_ready;
  std::optional<Pending> pending;  // a step that failed part way (StepState::kFailed)
  Status failure;                  // its error
  std::vector<uint8_t> done;               // per sub-group, for the pending step
  std::vector<std::future<Status>> reads;  // per NVMe extent: its read in flight
  StageClock d2h_clock, comm_grad_clock, comm_h2d_clock, h2d_clock;
  StageClock pack_clock, unpack_clock;  // device kernels, one clock per stream
  std::mutex io_mu;  // guards the IO counters below
  double read_sec = 0, write_sec = 0;
  uint64_t read_bytes = 0, write_bytes = 0;

  std::span<float> GradShard() const { return grad_buf.as<float>().first(shard.elems()); }
  uint64_t Rel(uint32_t i) const { return sub_groups[i].begin - shard.begin; }
  std::byte* Bucket(uint32_t i) const {
    return static_cast<std::byte*>(buckets[i % buffer_count].data());
  }
  std::span<std::byte> NvmeBuf(uint32_t i) const {
    return nvme_bufs[static_cast<uint32_t>(extent_of[i]) % buffer_count].bytes().first(
        store->ExtentBufferBytes());
  }
  std::span<float> NvmeState(uint32_t i) const {
    auto payload = store->Payload(NvmeBuf(i));
    return {reinterpret_cast<float*>(payload.data()), sub_groups[i].elems() * arrays};
  }
  std::span<float> HostState(uint32_t i) const {
    return host_state[i].as<float>().first(sub_groups[i].elems() * arrays);
  }
  std::string SubGroupName(uint32_t i) const {
    return extent_of[i] >= 0 ? fmt::format("sub-group {} (nvme extent {})", i, extent_of[i])
                             : fmt::format("sub-group {} (host)", i);
  }

  Status Init(const EngineContext& context, std::span<const ParamGroup> groups);
  Status InitPlan(std::span<const ParamGroup> groups);  // validation, layout, placement
  Status AgreeOnPlan(Status planned);                   // several ranks
  Status InitBuffers(const EngineContext& context);     // store, buffers, initial state
  Status OtherRankFailed() const;
  Status LaunchBucket(uint32_t i);
  Status OrderAfterUser();
  Status ReduceGradients();
  Status AllReduceDoubles(std::span<double> values, ReduceOp op);
  Status Update(uint32_t i, std::span<float> state, void* out, const Pending& p);
  std::future<Status> ReadJob(uint32_t i);
  std::future<Status> WriteJob(uint32_t i);
  Status Step();
  Status RunPipeline(const Pending& p);
  Status FailedStepError(std::string_view op) const;
  void EndFailedStep() {
    pending.reset();
    failure = OkStatus();
  }
  Status BuildEntries();  // pack/unpack entries from the params' pointers
  // Queues the reads of the first buffer_count NVMe extents (not yet queued).
  void StartReads() {
    reads.resize(nvme_order.size());
    for (uint32_t k = 0; k < nvme_order.size() && k < buffer_count; ++k) {
      if (!reads[k].valid()) reads[k] = ReadJob(nvme_order[k]);
    }
  }
  void DrainReads() {
    for (auto& r : reads) {
      if (r.valid()) r.get().IgnoreError();
    }
  }
  void ConsumeGrads();
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
  user_stream = context.stream ? context.stream : device->DefaultStream();
  if (comm != nullptr) {
    rank = comm->rank();
    world = comm->world_size();
  }
  // Every rank returns from Create having failed or not together: a rank
  // whose Create succeeded while another's failed would wait for it in the
  // first collective of Step.
  if (world == 1) {
    STRATA_RETURN_IF_ERROR(InitPlan(groups));
    return InitBuffers(context);
  }
  Status planned = InitPlan(groups);
  STRATA_RETURN_IF_ERROR(AgreeOnPlan(planned));
  Status built = InitBuffers(context);
  double failed[1] = {built.ok() ? 0.0 : 1.0};
  Status agreed = AllReduceDoubles(failed, ReduceOp::kMax);
  if (!built.ok()) return built;
  STRATA_RETURN_IF_ERROR((std::move(agreed)).WithContext(kOp));
  if (failed[0] > 0) return OtherRankFailed();
  comm_grad_clock = StageClock{};  // the first step's times are the step's own
  return OkStatus();
}

Status OffloadOptimizer::Impl::OtherRankFailed() const {
  return FailedPreconditionError(fmt::format(
      "create offload optimizer: rank {}: another rank failed to create its optimizer (its "
      "error says why); Create fails on every rank together",
      rank));
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
  std::unordered_map<const void*, std::string> seen;
  std::vector<TensorSpec> specs;
  for (uint32_t g = 0; g < groups.size(); ++g) {
    if (groups[g].params.empty()) {
      return InvalidArgumentError(
          fmt::format("{}: param group {} has no tensors; drop it or add its params", kOp, g));
    }
    STRATA_RETURN_IF_ERROR(
        ValidateHyper(groups[g].hyper, fmt::format("{}: param group {}", kOp, g)));
    hypers.push_back(groups[g].hyper);
    for (uint32_t j = 0; j < groups[g].params.size(); ++j) {
      const Param& p = groups[g].params[j];
      const std::string who = fmt::format("param group {} tensor {}{}", g, j,
                                          p.name.empty() ? "" : " (" + p.name + ")");
      if (p.elems > 0 && (p.data == nullptr || p.grad == nullptr)) {
        return InvalidArgumentError(fmt::format("{}: {} has {} elems but a null {} pointer", kOp,
                                                who, p.elems, p.data == nullptr ? "data" : "grad"));
      }
      if (p.elems > 0) {
        for (const void* ptr :
             {static_cast<const void*>(p.data), static_cast<const void*>(p.grad)}) {
          auto [it, inserted] = seen.emplace(ptr, who);
          if (!inserted) {
            return InvalidArgumentError(fmt::format(
                "{}: {} uses the pointer {} already registered by {}; every tensor and grad "
                "must be registered once",
                kOp, who, ptr, it->second));
          }
        }
      }
      params.push_back(p);
      param_group.push_back(g);
      specs.push_back({.elems = p.elems, .dtype = config.param_dtype});
    }
  }
  STRATA_ASSIGN_OR_RETURN(layout,
                          PlanFlatLayout(specs, {.align_elems = config.align_elems,
                                                 .world_size = static_cast<uint32_t>(world)}));
  if (layout.tensor_elems == 0) {
    return InvalidArgumentError(fmt::format("{}: every registered tensor has 0 elems", kOp));
  }
  STRATA_ASSIGN_OR_RETURN(shard, ShardRange(layout, static_cast<uint32_t>(rank)));
  STRATA_ASSIGN_OR_RETURN(sub_groups, CutSubGroups(shard, config.sub_group_elems));
  std::vector<uint64_t> sizes;
  for (const ElemRange& r : sub_groups) sizes.push_back(r.elems());
  PlacementInputs inputs = PlacementInputsFor(config, sizes, static_cast<uint32_t>(world));
  // Preflight: refuse a plan this machine cannot hold (placement.h, step 5).
  inputs.machine = ProbeMachineLimits(
      inputs.nvme == NvmeTier::kAvailable ? std::span<const std::string>(config.nvme_paths)
                                          : std::span<const std::string>(),
      static_cast<uint32_t>(rank),
      RanksPerNode(comm != nullptr ? comm->backend() : "", static_cast<uint32_t>(world)));
  STRATA_ASSIGN_OR_RETURN(plan, PlanPlacement(inputs));
  for (const std::string& w : plan.warnings) LogWarning(fmt::format("rank {}: {}", rank, w));
  LogInfo(fmt::format("rank {}/{}: {} tensors, {} elems ({} in the shard, {} sub-groups)\n{}", rank,
                      world, params.size(), layout.tensor_elems, shard.elems(), sub_groups.size(),
                      FormatPlan(plan)));

  buffer_count = inputs.buffer_count;  // config.buffer_count, at most one per sub-group
  return OkStatus();
}

// Several ranks: whether every rank planned, and registered the same tensors
// (a digest of the layout); `planned` is this rank's own outcome.
Status OffloadOptimizer::Impl::AgreeOnPlan(Status planned) {
  constexpr std::string_view kOp = "create offload optimizer";
  const double max_digest = static_cast<double>((uint64_t{1} << 52) - 1);
  double digest = 0;
  if (planned.ok()) {
    uint64_t h = 1469598103934665603ull;
    auto mix = [&](uint64_t v) { h = (h ^ v) * 1099511628211ull; };
    for (const TensorSlot& t : layout.tensors) mix(t.elems);
    mix(static_cast<uint64_t>(config.param_dtype));
    digest = static_cast<double>(h >> 12);  // exact in a double
  }
  // The collectives need a stream and small buffers; the rest comes later.
  STRATA_ASSIGN_OR_RETURN(grad_stream, device->CreateStream());
  STRATA_ASSIGN_OR_RETURN(dev_small, device->Allocate(4096));
  STRATA_ASSIGN_OR_RETURN(PinnedPool p,
                          PinnedPool::Create(*device, {.budget_bytes = 4096, .slab_bytes = 4096}));
  small_pool.emplace(std::move(p));
  STRATA_ASSIGN_OR_RETURN(small, small_pool->Allocate(4096));
  double v[3] = {digest, max_digest - digest, planned.ok() ? 0.0 : 1.0};
  Status reduced = AllReduceDoubles(v, ReduceOp::kMax);
  if (!planned.ok()) return planned;
  STRATA_RETURN_IF_ERROR((std::move(reduced)).WithContext(kOp));
  if (v[2] > 0) return OtherRankFailed();
  if (v[0] != digest || v[1] != max_digest - digest) {
    return InvalidArgumentError(fmt::format(
        "{}: rank {} registered tensors that differ from another rank's (sizes or dtype); "
        "every rank must register the same tensors in the same order",
        kOp, rank));
  }
  return OkStatus();
}

Status OffloadOptimizer::Impl::InitBuffers(const EngineContext& context) {
  constexpr std::string_view kOp = "create offload optimizer";
  arrays = ArrayCount(config.optimizer);
  param_bytes = DTypeSize(config.param_dtype);
  for (const ElemRange& r : sub_groups) max_sg_elems = std::max(max_sg_elems, r.elems());

  // Runs, pack/unpack entries and the tensors each bucket waits for.
  tensor_buckets.assign(params.size(), {});
  bucket_need.assign(sub_groups.size(), 0);
  for (uint32_t i = 0; i < sub_groups.size(); ++i) {
    const uint64_t elems = sub_groups[i].elems();
    STRATA_ASSIGN_OR_RETURN(std::vector<TensorPiece> own, PiecesInRange(layout, sub_groups[i]));
    std::vector<Run> rs;
    for (const TensorPiece& piece : own) {
      const uint32_t g = param_group[piece.tensor];
      const uint64_t at = piece.flat_offset_elems - sub_groups[i].begin;
      if (rs.empty()) {
        rs.push_back({0, 0, g});
      } else if (rs.back().group != g) {
        rs.back().end = at;
        rs.push_back({at, 0, g});
      }
    }
    if (rs.empty()) rs.push_back({0, 0, 0});  // all padding
    rs.back().end = elems;
    runs.push_back(std::move(rs));
    for (int r = 0; r < world; ++r) {
      const ElemRange range{r * layout.shard_elems + Rel(i),
                            r * layout.shard_elems + Rel(i) + elems};
      STRATA_ASSIGN_OR_RETURN(std::vector<TensorPiece> pieces, PiecesInRange(layout, range));
      for (const TensorPiece& piece : pieces) {
        auto& tb = tensor_buckets[piece.tensor];
        if (tb.empty() || tb.back() != i) {
          tb.push_back(i);
          ++bucket_need[i];
        }
      }
    }
  }
  STRATA_RETURN_IF_ERROR(BuildEntries());

  // NVMe store.
  extent_of.assign(sub_groups.size(), -1);
  for (uint32_t i = 0; i < sub_groups.size(); ++i) {
    if (plan.sub_groups[i].tier == Tier::kNvme) {
      extent_of[i] = static_cast<int32_t>(nvme_order.size());
      nvme_order.push_back(i);
    }
  }
  Storage* storage = context.storage;
  if (!nvme_order.empty()) {
    if (storage == nullptr) {
      // The engine's own storage is the filesystem: missing nvme_path
      // folders are made, as DeepSpeed does.
      for (const std::string& dir : config.nvme_paths) {
        STRATA_RETURN_IF_ERROR(CreateDirectories(dir).WithContext(kOp));
      }
      STRATA_ASSIGN_OR_RETURN(owned_storage, CreateStorage({}));
      storage = owned_storage.get();
    }
    STRATA_ASSIGN_OR_RETURN(
        store,
        StateStore::Create(*storage, {.paths = config.nvme_paths,
                                      .rank = static_cast<uint32_t>(rank),
                                      .extent_bytes = max_sg_elems * arrays * 4,
                                      .num_extents = static_cast<uint32_t>(nvme_order.size()),
                                      .block_bytes = config.aio.block_bytes,
                                      .queue_depth = config.aio.queue_depth}));
    io = std::make_unique<internal::IoQueue>();
  }

  // Pinned memory: one slab holding every buffer (all are taken here and
  // kept, so first fit packs them with no gap), plus the accumulation scratch.
  auto round = [](uint64_t b) { return (b + 4095) / 4096 * 4096; };
  uint64_t need = round(shard.elems() * 4) + buffer_count * round(max_sg_elems * param_bytes) +
                  4096 + buffer_count * round(max_sg_elems * 4);
  if (store) need += buffer_count * round(store->ExtentBufferBytes());
  for (uint32_t i = 0; i < sub_groups.size(); ++i) {
    if (extent_of[i] < 0) need += round(sub_groups[i].elems() * arrays * 4);
  }
  STRATA_ASSIGN_OR_RETURN(pool,
                          PinnedPool::Create(*device, {.budget_bytes = need, .slab_bytes = need}));
  STRATA_ASSIGN_OR_RETURN(grad_buf, pool->Allocate(shard.elems() * 4));
  std::memset(grad_buf.data(), 0, grad_buf.size_bytes());
  for (uint32_t b = 0; b < buffer_count; ++b) {
    STRATA_ASSIGN_OR_RETURN(PinnedBuffer pb, pool->Allocate(max_sg_elems * param_bytes));
    param_staging.push_back(std::move(pb));
  }
  STRATA_ASSIGN_OR_RETURN(small, pool->Allocate(4096));
  if (store) {
    std::vector<std::span<std::byte>> spans;
    for (uint32_t b = 0; b < buffer_count; ++b) {
      STRATA_ASSIGN_OR_RETURN(PinnedBuffer nb, pool->Allocate(store->ExtentBufferBytes()));
      std::memset(nb.data(), 0, nb.size_bytes());
      spans.push_back(nb.bytes().first(store->ExtentBufferBytes()));
      nvme_bufs.push_back(std::move(nb));
    }
    STRATA_RETURN_IF_ERROR((store->RegisterBuffers(spans)).WithContext(kOp));
  }
  host_state.resize(sub_groups.size());
  for (uint32_t i = 0; i < sub_groups.size(); ++i) {
    if (extent_of[i] >= 0) continue;
    STRATA_ASSIGN_OR_RETURN(host_state[i], pool->Allocate(sub_groups[i].elems() * arrays * 4));
  }

  // Device side.
  for (uint32_t b = 0; b < buffer_count; ++b) {
    STRATA_ASSIGN_OR_RETURN(
        DeviceBuffer db, device->Allocate(world * max_sg_elems * std::max<size_t>(4, param_bytes)));
    buckets.push_back(std::move(db));
  }
  if (!dev_small.data()) {
    STRATA_ASSIGN_OR_RETURN(dev_small, device->Allocate(4096));
  }
  if (!grad_stream) {
    STRATA_ASSIGN_OR_RETURN(grad_stream, device->CreateStream());
  }
  STRATA_ASSIGN_OR_RETURN(h2d_stream, device->CreateStream());
  STRATA_ASSIGN_OR_RETURN(user_event, device->CreateEvent());
  STRATA_ASSIGN_OR_RETURN(grad_event, device->CreateEvent());
  STRATA_ASSIGN_OR_RETURN(h2d_event, device->CreateEvent());
  for (uint32_t b = 0; b < buffer_count; ++b) {
    STRATA_ASSIGN_OR_RETURN(Event e, device->CreateEvent());
    slot_events.push_back(std::move(e));
  }
  STRATA_ASSIGN_OR_RETURN(cpu, CpuAdam::Create({.threads = config.threads}));
  STRATA_ASSIGN_OR_RETURN(LossScaler s, LossScaler::Create(config.loss_scaler));
  scaler.emplace(std::move(s));

  reduced.assign(sub_groups.size(), 0);
  has_grad.assign(sub_groups.size(), 0);
  ready_count.assign(sub_groups.size(), 0);
  tensor_ready.assign(params.size(), 0);
  done.assign(sub_groups.size(), 0);

  // Master weights from the params (exact: fp16/bf16 -> fp32), moments zero.
  STRATA_RETURN_IF_ERROR((OrderAfterUser()).WithContext(kOp));
  for (uint32_t i = 0; i < sub_groups.size(); ++i) {
    const uint64_t elems = sub_groups[i].elems();
    std::vector<kernels::PackEntry> own;
    for (const kernels::UnpackEntry& e : unpack[i]) {
      if (e.offset_elems >= rank * elems && e.offset_elems < (rank + 1) * elems) {
        own.push_back(
            {{e.tensor.data, e.tensor.elems, e.tensor.dtype}, e.offset_elems - rank * elems});
      }
    }
    std::span<float> state = extent_of[i] >= 0 ? NvmeState(i) : HostState(i);
    STRATA_RETURN_IF_ERROR(
        kernels::PackGrads(*device, grad_stream, own, {Bucket(0), elems, DType::kF32}));
    STRATA_RETURN_IF_ERROR(device->CopyAsync(state.data(), Bucket(0), elems * 4,
                                             CopyKind::kDeviceToHost, grad_stream));
    std::fill(state.begin() + elems, state.end(), 0.0f);
    STRATA_RETURN_IF_ERROR(
        (device->StreamSynchronize(grad_stream))
            .WithContext(fmt::format("{}: read the initial params of {}", kOp, SubGroupName(i))));
    if (extent_of[i] >= 0) {
      STRATA_RETURN_IF_ERROR(
          (WriteJob(i).get())
              .WithContext(fmt::format("{}: write the initial state of {}", kOp, SubGroupName(i))));
    }
  }
  {
    std::lock_guard<std::mutex> lock(io_mu);
    read_sec = write_sec = 0;
    read_bytes = write_bytes = 0;
  }
  return OkStatus();
}

// Every rank's block of each bucket, as pieces of the registered tensors.
Status OffloadOptimizer::Impl::BuildEntries() {
  const size_t grad_size = DTypeSize(config.grad_dtype);
  pack.assign(sub_groups.size(), {});
  unpack.assign(sub_groups.size(), {});
  for (uint32_t i = 0; i < sub_groups.size(); ++i) {
    const uint64_t elems = sub_groups[i].elems();
    for (int r = 0; r < world; ++r) {
      const ElemRange range{r * layout.shard_elems + Rel(i),
                            r * layout.shard_elems + Rel(i) + elems};
      STRATA_ASSIGN_OR_RETURN(std::vector<TensorPiece> pieces, PiecesInRange(layout, range));
      for (const TensorPiece& piece : pieces) {
        const Param& t = params[piece.tensor];
        const size_t off = r * elems + (piece.flat_offset_elems - range.begin);
        pack[i].push_back(
            {{static_cast<const std::byte*>(t.grad) + piece.tensor_offset_elems * grad_size,
              piece.elems, config.grad_dtype},
             off});
        unpack[i].push_back(
            {{static_cast<std::byte*>(t.data) + piece.tensor_offset_elems * param_bytes,
              piece.elems, config.param_dtype},
             off});
      }
    }
  }
  return OkStatus();
}

Status OffloadOptimizer::Impl::FailedStepError(std::string_view op) const {
  return FailedPreconditionError(fmt::format(
      "{}: step {} failed part way and is not finished ({}); its update reached some "
      "sub-groups only. RetryStep() finishes it with the gradients it kept; loading a "
      "checkpoint or a state_dict replaces the state",
      op, pending->step, failure.ToString()));
}

Status OffloadOptimizer::Impl::OrderAfterUser() {
  STRATA_RETURN_IF_ERROR(device->RecordEvent(user_event, user_stream));
  return device->StreamWaitEvent(grad_stream, user_event);
}

// ---- Gradients ----------------------------------------------------------------

Status OffloadOptimizer::Impl::LaunchBucket(uint32_t i) {
  const uint64_t elems = sub_groups[i].elems();
  std::byte* bucket = Bucket(i);
  std::byte* mine = bucket + rank * elems * 4;
  STRATA_RETURN_IF_ERROR(Timed(*device, grad_stream, &pack_clock, [&] {
    return kernels::PackGrads(*device, grad_stream, pack[i], {bucket, world * elems, DType::kF32},
                              1.0f / static_cast<float>(world));
  }));
  if (world > 1) {
    STRATA_RETURN_IF_ERROR(Timed(*device, grad_stream, &comm_grad_clock, [&] {
      return comm->ReduceScatter(bucket, mine, elems, DType::kF32, ReduceOp::kSum, grad_stream);
    }));
  }
  float* dst = GradShard().data() + Rel(i);
  if (!has_grad[i]) {
    STRATA_RETURN_IF_ERROR(Timed(*device, grad_stream, &d2h_clock, [&] {
      return device->CopyAsync(dst, mine, elems * 4, CopyKind::kDeviceToHost, grad_stream);
    }));
    has_grad[i] = 1;
  } else {
    // Accumulation: the micro-step's grads land in a scratch buffer and are
    // added on the host in stream order (fp32, one add per micro-step).
    if (accum_scratch.empty()) {
      for (uint32_t b = 0; b < buffer_count; ++b) {
        STRATA_ASSIGN_OR_RETURN(PinnedBuffer sb, pool->Allocate(max_sg_elems * 4));
        accum_scratch.push_back(std::move(sb));
      }
    }
    float* scratch = accum_scratch[i % buffer_count].as<float>().data();
    STRATA_RETURN_IF_ERROR(Timed(*device, grad_stream, &d2h_clock, [&] {
      return device->CopyAsync(scratch, mine, elems * 4, CopyKind::kDeviceToHost, grad_stream);
    }));
    STRATA_RETURN_IF_ERROR(device->LaunchHostFunc(grad_stream, [dst, scratch, elems] {
      for (uint64_t k = 0; k < elems; ++k) dst[k] += scratch[k];
    }));
  }
  reduced[i] = 1;
  ++reduced_count;
  return OkStatus();
}

Status OffloadOptimizer::Impl::ReduceGradients() {
  if (reduced_count < sub_groups.size()) {
    STRATA_RETURN_IF_ERROR(OrderAfterUser());
    for (uint32_t i = 0; i < sub_groups.size(); ++i) {
      if (!reduced[i]) STRATA_RETURN_IF_ERROR(LaunchBucket(i));
    }
  }
  STRATA_RETURN_IF_ERROR(device->RecordEvent(grad_event, grad_stream));
  std::fill(reduced.begin(), reduced.end(), 0);
  std::fill(ready_count.begin(), ready_count.end(), 0);
  std::fill(tensor_ready.begin(), tensor_ready.end(), 0);
  reduced_count = 0;
  ++micro_steps;
  return OkStatus();
}

void OffloadOptimizer::Impl::ConsumeGrads() {
  std::fill(has_grad.begin(), has_grad.end(), 0);
  micro_steps = 0;
}

Status OffloadOptimizer::Impl::AllReduceDoubles(std::span<double> values, ReduceOp op) {
  auto* host = small.as<double>().data();
  std::copy(values.begin(), values.end(), host);
  STRATA_RETURN_IF_ERROR(Timed(*device, grad_stream, &comm_grad_clock, [&]() -> Status {
    STRATA_RETURN_IF_ERROR(device->CopyAsync(dev_small.data(), host, values.size_bytes(),
                                             CopyKind::kHostToDevice, grad_stream));
    STRATA_RETURN_IF_ERROR(comm->AllReduce(dev_small.data(), dev_small.data(), values.size(),
                                           DType::kF64, op, grad_stream));
    return device->CopyAsync(host, dev_small.data(), values.size_bytes(), CopyKind::kDeviceToHost,
                             grad_stream);
  }));
  STRATA_RETURN_IF_ERROR(device->StreamSynchronize(grad_stream));
  std::copy(host, host + values.size(), values.begin());
  return OkStatus();
}

// ---- The update -----------------------------------------------------------------

Status OffloadOptimizer::Impl::Update(uint32_t i, std::span<float> state, void* out,
                                      const Pending& p) {
  const uint64_t elems = sub_groups[i].elems();
  const float* grad = GradShard().data() + Rel(i);
  for (const Run& run : runs[i]) {
    const size_t n = run.end - run.begin;
    const GroupHyper& h = hypers[run.group];
    std::span<float> master = state.subspan(run.begin, n);
    std::span<float> m1 = state.subspan(elems + run.begin, n);
    const GradView g{DType::kF32, grad + run.begin, n};
    const OutView o =
        MakeOut(config.param_dtype, static_cast<std::byte*>(out) + run.begin * param_bytes, n);
    switch (config.optimizer) {
      case OptimizerType::kAdam:
      case OptimizerType::kAdamW: {
        const AdamHyper ah{.lr = h.lr,
                           .beta1 = h.beta1,
                           .beta2 = h.beta2,
                           .eps = h.eps,
                           .weight_decay = h.weight_decay,
                           .weight_decay_mode = config.optimizer == OptimizerType::kAdam
                                                    ? WeightDecayMode::kL2
                                                    : WeightDecayMode::kDecoupled,
                           .bias_correction = config.adam.bias_correction,
                           .step = p.step,
                           .grad_scale = p.grad_scale};
        std::span<float> m2 = state.subspan(2 * elems + run.begin, n);
        STRATA_RETURN_IF_ERROR(cpu->Step(ah, {master, m1, m2}, g, o));
        break;
      }
      case OptimizerType::kAdagrad: {
        const AdagradHyper ah{.lr = h.lr,
                              .lr_decay = config.adagrad.lr_decay,
                              .eps = h.eps,
                              .weight_decay = h.weight_decay,
                              .step = p.step,
                              .grad_scale = p.grad_scale};
        STRATA_RETURN_IF_ERROR(cpu->StepAdagrad(ah, {master, m1}, g, o));
        break;
      }
      case OptimizerType::kLion: {
        const LionHyper lh{.lr = h.lr,
                           .beta1 = h.beta1,
                           .beta2 = h.beta2,
                           .weight_decay = h.weight_decay,
                           .grad_scale = p.grad_scale};
        STRATA_RETURN_IF_ERROR(cpu->StepLion(lh, {master, m1}, g, o));
        break;
      }
    }
  }
  return OkStatus();
}

std::future<Status> OffloadOptimizer::Impl::ReadJob(uint32_t i) {
  const uint32_t id = static_cast<uint32_t>(extent_of[i]);
  std::span<std::byte> buf = NvmeBuf(i);
  return io->Submit([this, id, buf, i]() -> Status {
    const double t0 = Now();
    Status s = [&]() -> Status {
      STRATA_ASSIGN_OR_RETURN(StateStore::Ticket t, store->ReadExtent(id, buf));
      return store->Wait(t);
    }();
    std::lock_guard<std::mutex> lock(io_mu);
    read_sec += Now() - t0;
    if (s.ok()) read_bytes += buf.size();
    return std::move(s).WithContext(fmt::format("read the state of {}", SubGroupName(i)));
  });
}

std::future<Status> OffloadOptimizer::Impl::WriteJob(uint32_t i) {
  const uint32_t id = static_cast<uint32_t>(extent_of[i]);
  std::span<std::byte> buf = NvmeBuf(i);
  return io->Submit([this, id, buf, i]() -> Status {
    const double t0 = Now();
    Status s = [&]() -> Status {
      STRATA_ASSIGN_OR_RETURN(StateStore::Ticket t, store->WriteExtent(id, buf));
      return store->Wait(t);
    }();
    std::lock_guard<std::mutex> lock(io_mu);
    write_sec += Now() - t0;
    if (s.ok()) write_bytes += buf.size();
    return std::move(s).WithContext(fmt::format("write the state of {}", SubGroupName(i)));
  });
}

// The pipeline over sub-groups, in index order: NVMe reads run ahead up to
// buffer_count extents (the IO queue is FIFO, so the read into a buffer is
// queued after the write that last used it), CPU update into a param staging
// buffer, write-behind, then H2D + all-gather + unpack on the h2d stream.
// Errors of one sub-group do not stop the others (every rank must issue every
// collective); the first one is returned. PipelineMode::kSerial runs the same
// code with each stage waited for before the next starts and no read-ahead,
// so that its stage times are those of each stage alone.
Status OffloadOptimizer::Impl::RunPipeline(const Pending& p) {
  const uint32_t n = static_cast<uint32_t>(sub_groups.size());
  const bool serial = mode == PipelineMode::kSerial;
  std::vector<std::future<Status>> writes(nvme_order.size());
  reads.resize(nvme_order.size());
  if (!serial) StartReads();
  Status first_error;
  auto fail = [&](Status s) {
    if (first_error.ok()) first_error = std::move(s);
  };
  double adam_sec = 0;
  // The h2d stream reuses the buckets the grads were reduced in.
  STRATA_RETURN_IF_ERROR(device->StreamWaitEvent(h2d_stream, grad_event));
  for (uint32_t i = 0; i < n; ++i) {
    const uint64_t elems = sub_groups[i].elems();
    const uint32_t slot = i % buffer_count;
    void* staging = param_staging[slot].data();
    bool ok = true;
    if (Status s = device->EventSynchronize(slot_events[slot]); !s.ok()) {
      fail(std::move(s).WithContext("upload params"));
      ok = false;
    }
    std::span<float> state;
    const int32_t k = extent_of[i];
    if (k >= 0) {
      if (!reads[k].valid()) reads[k] = ReadJob(i);  // serial: read on demand
      if (Status s = reads[k].get(); !s.ok()) {
        fail(std::move(s));
        ok = false;
      } else {
        state = NvmeState(i);
      }
    } else {
      state = HostState(i);
    }
    if (ok) {
      const double t0 = Now();
      if (done[i]) {
        ConvertOut(state.first(elems), staging, config.param_dtype);
      } else if (Status s = Update(i, state, staging, p); !s.ok()) {
        fail(std::move(s).WithContext(fmt::format("update {}", SubGroupName(i))));
        ok = false;
      } else if (k < 0) {
        done[i] = 1;
      } else {
        writes[k] = WriteJob(i);
      }
      adam_sec += Now() - t0;
      if (serial && k >= 0 && writes[k].valid()) writes[k].wait();
    }
    if (!serial && k >= 0 && k + buffer_count < nvme_order.size()) {
      reads[k + buffer_count] = ReadJob(nvme_order[k + buffer_count]);
    }
    // Params up. A sub-group that failed here still joins the all-gather
    // (collectives must match) but is not unpacked on this rank.
    std::byte* bucket = Bucket(i);
    std::byte* mine = bucket + rank * elems * param_bytes;
    if (ok) {
      STRATA_RETURN_IF_ERROR(Timed(*device, h2d_stream, &h2d_clock, [&] {
        return device->CopyAsync(mine, staging, elems * param_bytes, CopyKind::kHostToDevice,
                                 h2d_stream);
      }));
    }
    if (world > 1) {
      STRATA_RETURN_IF_ERROR(Timed(*device, h2d_stream, &comm_h2d_clock, [&] {
        return comm->AllGather(mine, bucket, elems, config.param_dtype, h2d_stream);
      }));
    }
    if (ok) {
      STRATA_RETURN_IF_ERROR(Timed(*device, h2d_stream, &unpack_clock, [&] {
        return kernels::UnpackParams(*device, h2d_stream,
                                     {bucket, world * elems, config.param_dtype}, unpack[i]);
      }));
    }
    STRATA_RETURN_IF_ERROR(device->RecordEvent(slot_events[slot], h2d_stream));
    if (serial) {
      if (Status s = device->StreamSynchronize(h2d_stream); !s.ok()) {
        fail(std::move(s).WithContext(fmt::format("upload the params of {}", SubGroupName(i))));
      }
    }
  }
  for (uint32_t k = 0; k < nvme_order.size(); ++k) {
    if (!writes[k].valid()) continue;
    if (Status s = writes[k].get(); !s.ok()) {
      fail(std::move(s));
    } else {
      done[nvme_order[k]] = 1;
    }
  }
  DrainReads();  // reads queued and never consumed (only after an error above)
  if (Status s = device->StreamSynchronize(h2d_stream); !s.ok()) fail(std::move(s));
  last.times.adam += adam_sec;
  return first_error;
}

Status OffloadOptimizer::Impl::Step() {
  const double t0 = Now();
  last = StepStats{};
  Pending p;
  if (pending) {
    p = *pending;
  } else {
    // The first reads do not depend on the grads: start them now. The
    // pipeline finds them already queued.
    if (mode == PipelineMode::kOverlapped) StartReads();
    if (micro_steps == 0 || reduced_count > 0) {
      STRATA_RETURN_IF_ERROR((ReduceGradients()).WithContext(fmt::format("step {}", step + 1)));
    }
    STRATA_RETURN_IF_ERROR(
        (device->StreamSynchronize(grad_stream))
            .WithContext(fmt::format("step {}: reduce the gradients", step + 1)));
    const double ts = Now();
    STRATA_ASSIGN_OR_RETURN(GradStats st, cpu->ComputeGradStats(GradView::F32(GradShard()), 1.0f));
    last.times.grad_stats = Now() - ts;
    last.times.adam += last.times.grad_stats;
    if (world > 1) {
      double v[2] = {st.sum_sq, static_cast<double>(st.nonfinite_elems)};
      STRATA_RETURN_IF_ERROR(
          (AllReduceDoubles(v, ReduceOp::kSum))
              .WithContext(fmt::format("step {}: all-reduce the gradient statistics", step + 1)));
      st.sum_sq = v[0];
      st.nonfinite_elems = static_cast<uint64_t>(v[1]);
    }
    STRATA_ASSIGN_OR_RETURN(LossScaleDecision d, scaler->Update(st.nonfinite_elems));
    p.step = step + 1;
    p.loss_scale = d.scale_used;
    p.micro_steps = micro_steps;
    p.grad_norm = std::sqrt(st.sum_sq) / d.scale_used;
    if (d.skip_step) {
      last.skipped = true;
    } else {
      p.grad_scale = GradMultiplier(d.scale_used, st.sum_sq, config.max_grad_norm);
      p.clip_coef =
          ClipCoefficient(st.sum_sq / (d.scale_used * d.scale_used), config.max_grad_norm);
      pending = p;
      std::fill(done.begin(), done.end(), 0);
    }
  }
  Status result;
  if (!last.skipped) {
    result = RunPipeline(p);
    if (world > 1) {
      double failed[1] = {result.ok() ? 0.0 : 1.0};
      if (Status s = AllReduceDoubles(failed, ReduceOp::kSum); !s.ok() && result.ok()) result = s;
      if (result.ok() && failed[0] > 0) {
        result = UnavailableError(fmt::format(
            "{} other rank(s) failed this step; call Step() again on every rank", failed[0]));
      }
    }
    if (result.ok()) {
      step = p.step;
      pending.reset();
      ConsumeGrads();
      STRATA_RETURN_IF_ERROR(device->RecordEvent(h2d_event, h2d_stream));
      STRATA_RETURN_IF_ERROR(device->StreamWaitEvent(user_stream, h2d_event));
    }
  } else {
    DrainReads();
    ConsumeGrads();
  }
  last.step = step;
  last.loss_scale = p.loss_scale;
  last.grad_norm = p.grad_norm;
  last.clip_coef = p.clip_coef;
  last.micro_steps = p.micro_steps;
  last.times.d2h = d2h_clock.busy;
  last.times.h2d = h2d_clock.busy;
  last.times.comm = comm_grad_clock.busy + comm_h2d_clock.busy;
  last.times.device = pack_clock.busy + unpack_clock.busy;
  {
    std::lock_guard<std::mutex> lock(io_mu);
    last.times.read = read_sec;
    last.times.write = write_sec;
    last.read_bytes = read_bytes;
    last.write_bytes = write_bytes;
    read_sec = write_sec = 0;
    read_bytes = write_bytes = 0;
  }
  d2h_clock = h2d_clock = comm_grad_clock = comm_h2d_clock = StageClock{};
  pack_clock = unpack_clock = StageClock{};
  last.d2h_bytes = 0;
  last.h2d_bytes = 0;
  for (const ElemRange& r : sub_groups) {
    last.d2h_bytes += r.elems() * 4 * std::max<uint32_t>(p.micro_steps, 1);
    if (!last.skipped) last.h2d_bytes += r.elems() * param_bytes;
  }
  last.times.step = Now() - t0;
  if (!result.ok()) {
    result = std::move(result).WithContext(fmt::format("step {}", p.step));
    if (pending) failure = result;
    return result;
  }
  failure = OkStatus();
  return OkStatus();
}

// ---- OffloadOptimizer -------------------------------------------------------------

OffloadOptimizer::OffloadOptimizer(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

OffloadOptimizer::~OffloadOptimizer() {
  if (!impl_) return;
  // Work in flight uses the buffers: let it finish (errors are the steps' business).
  if (impl_->grad_stream) impl_->device->StreamSynchronize(impl_->grad_stream).IgnoreError();
  if (impl_->h2d_stream) impl_->device->StreamSynchronize(impl_->h2d_stream).IgnoreError();
  impl_->io.reset();
}

Result<std::unique_ptr<OffloadOptimizer>> OffloadOptimizer::Create(
    const EngineContext& context, const OffloadConfig& config, std::span<const ParamGroup> groups) {
  auto impl = std::make_unique<Impl>();
  impl->config = config;
  std::unique_ptr<OffloadOptimizer> opt(new OffloadOptimizer(std::move(impl)));
  STRATA_RETURN_IF_ERROR(opt->impl_->Init(context, groups));
  return opt;
}

Status OffloadOptimizer::GradReady(uint32_t index) {
  Impl& m = *impl_;
  if (index >= m.params.size()) {
    return OutOfRangeError(
        fmt::format("grad ready: param {} of {} registered", index, m.params.size()));
  }
  if (m.tensor_ready[index]) return OkStatus();
  m.tensor_ready[index] = 1;
  bool ordered = false;
  for (uint32_t b : m.tensor_buckets[index]) {
    if (++m.ready_count[b] == m.bucket_need[b] && !m.reduced[b]) {
      if (!ordered) {
        STRATA_RETURN_IF_ERROR(m.OrderAfterUser());
        ordered = true;
      }
      STRATA_RETURN_IF_ERROR(
          (m.LaunchBucket(b))
              .WithContext(fmt::format("grad ready {}: reduce sub-group {}", index, b)));
    }
  }
  return OkStatus();
}

Status OffloadOptimizer::ReduceGradients() { return impl_->ReduceGradients(); }

Status OffloadOptimizer::Step() {
  if (impl_->pending) return impl_->FailedStepError("step");
  return impl_->Step();
}

Status OffloadOptimizer::RetryStep() {
  if (!impl_->pending) {
    return FailedPreconditionError(
        "retry step: no step failed; there is nothing to retry (call Step() for a new step)");
  }
  return impl_->Step();
}

StepState OffloadOptimizer::step_state() const {
  return impl_->pending ? StepState::kFailed : StepState::kReady;
}

const Status& OffloadOptimizer::step_failure() const { return impl_->failure; }

Status OffloadOptimizer::RebindParam(uint32_t index, void* data, void* grad) {
  Impl& m = *impl_;
  constexpr std::string_view kOp = "rebind param";
  if (index >= m.params.size()) {
    return InvalidArgumentError(
        fmt::format("{}: param {} of {} registered", kOp, index, m.params.size()));
  }
  Param& p = m.params[index];
  const std::string who =
      fmt::format("param {}{}", index, p.name.empty() ? "" : " (" + p.name + ")");
  if (m.pending) return m.FailedStepError(fmt::format("{} {}", kOp, who));
  if (p.elems > 0 && (data == nullptr || grad == nullptr)) {
    return InvalidArgumentError(fmt::format("{} {}: it has {} elems but the new {} pointer is null",
                                            kOp, who, p.elems, data == nullptr ? "data" : "grad"));
  }
  for (uint32_t j = 0; j < m.params.size(); ++j) {
    const Param& q = m.params[j];
    if (j == index || q.elems == 0 || p.elems == 0) continue;
    for (const void* ptr : {static_cast<const void*>(data), static_cast<const void*>(grad)}) {
      if (ptr == q.data || ptr == q.grad) {
        return InvalidArgumentError(fmt::format(
            "{} {}: the pointer {} is registered by param {}{}; every tensor and grad must be "
            "registered once",
            kOp, who, ptr, j, q.name.empty() ? "" : " (" + q.name + ")"));
      }
    }
  }
  // Queued work may still read or write the old tensors.
  STRATA_RETURN_IF_ERROR((m.device->StreamSynchronize(m.grad_stream)).WithContext(kOp));
  STRATA_RETURN_IF_ERROR((m.device->StreamSynchronize(m.h2d_stream)).WithContext(kOp));
  p.data = data;
  p.grad = grad;
  return m.BuildEntries();
}

Status OffloadOptimizer::ZeroGrad() {
  Impl& m = *impl_;
  // The grad stream may still read the tensors, and bucket 0 serves as the
  // zero source: order the trainer's stream after both engine streams.
  STRATA_RETURN_IF_ERROR(m.device->RecordEvent(m.grad_event, m.grad_stream));
  STRATA_RETURN_IF_ERROR(m.device->StreamWaitEvent(m.user_stream, m.grad_event));
  STRATA_RETURN_IF_ERROR(m.device->RecordEvent(m.h2d_event, m.h2d_stream));
  STRATA_RETURN_IF_ERROR(m.device->StreamWaitEvent(m.user_stream, m.h2d_event));
  const size_t gsize = DTypeSize(m.config.grad_dtype);
  const size_t zero_bytes = m.buckets[0].bytes();
  STRATA_RETURN_IF_ERROR(kernels::PackGrads(*m.device, m.user_stream, {},
                                            {m.buckets[0].data(), zero_bytes / 4, DType::kF32}));
  for (const Param& p : m.params) {
    const size_t bytes = p.elems * gsize;
    for (size_t off = 0; off < bytes; off += zero_bytes) {
      STRATA_RETURN_IF_ERROR(m.device->CopyAsync(
          static_cast<std::byte*>(p.grad) + off, m.buckets[0].data(),
          std::min(zero_bytes, bytes - off), CopyKind::kDeviceToDevice, m.user_stream));
    }
  }
  // The next reduction must come after the zeroing: it is, since every
  // reduction is ordered after the trainer's stream. Grads handed over and
  // not consumed are dropped, except those of a failed step awaiting retry.
  if (!m.pending) {
    STRATA_RETURN_IF_ERROR(m.device->StreamSynchronize(m.grad_stream));
    m.ConsumeGrads();
  }
  std::fill(m.reduced.begin(), m.reduced.end(), 0);
  std::fill(m.ready_count.begin(), m.ready_count.end(), 0);
  std::fill(m.tensor_ready.begin(), m.tensor_ready.end(), 0);
  m.reduced_count = 0;
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
    return InvalidArgumentError(
        fmt::format("set group hyper: group {} of {}", group, impl_->hypers.size()));
  }
  STRATA_RETURN_IF_ERROR(ValidateHyper(hyper, fmt::format("set group hyper: group {}", group)));
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
  if (index >= m.sub_groups.size()) {
    return OutOfRangeError(
        fmt::format("read state: sub-group {} of {}", index, m.sub_groups.size()));
  }
  if (m.pending) return m.FailedStepError("read state");
  const uint64_t want = m.sub_groups[index].elems() * m.arrays;
  if (out.size() != want) {
    return InvalidArgumentError(fmt::format(
        "read state of {}: the output has {} floats; it needs {} ({} arrays of {} elems)",
        m.SubGroupName(index), out.size(), want, m.arrays, m.sub_groups[index].elems()));
  }
  if (m.extent_of[index] < 0) {
    std::span<float> s = m.HostState(index);
    std::copy(s.begin(), s.end(), out.begin());
    return OkStatus();
  }
  STRATA_RETURN_IF_ERROR((m.ReadJob(index).get()).WithContext("read state"));
  std::span<float> s = m.NvmeState(index);
  std::copy(s.begin(), s.end(), out.begin());
  return OkStatus();
}

Status OffloadOptimizer::WriteState(uint32_t index, std::span<const float> state) {
  Impl& m = *impl_;
  if (index >= m.sub_groups.size()) {
    return OutOfRangeError(
        fmt::format("write state: sub-group {} of {}", index, m.sub_groups.size()));
  }
  const uint64_t want = m.sub_groups[index].elems() * m.arrays;
  if (state.size() != want) {
    return InvalidArgumentError(fmt::format(
        "write state of {}: the input has {} floats; it needs {} ({} arrays of {} elems)",
        m.SubGroupName(index), state.size(), want, m.arrays, m.sub_groups[index].elems()));
  }
  // New state: a failed step awaiting retry no longer applies.
  m.EndFailedStep();
  if (m.extent_of[index] < 0) {
    std::copy(state.begin(), state.end(), m.HostState(index).begin());
    return OkStatus();
  }
  std::span<float> s = m.NvmeState(index);
  std::copy(state.begin(), state.end(), s.begin());
  return m.WriteJob(index).get().WithContext("write state");
}

LossScalerState OffloadOptimizer::loss_scaler_state() const { return impl_->scaler->state(); }

Status OffloadOptimizer::RestoreCounters(int64_t step, const LossScalerState& scaler) {
  if (step < 0) {
    return InvalidArgumentError(fmt::format("restore counters: step {} is negative", step));
  }
  STRATA_RETURN_IF_ERROR((impl_->scaler->Restore(scaler)).WithContext("restore counters"));
  impl_->step = step;
  impl_->EndFailedStep();
  return OkStatus();
}

// The param half of RunPipeline for sub-groups that are done: master ->
// staging -> H2D -> all-gather -> unpack, with the same buffers, events and
// collectives (every rank issues one all-gather per sub-group, failed or not).
Status OffloadOptimizer::UploadParams() {
  Impl& m = *impl_;
  // The copies overwrite params the trainer's stream may still read, and use
  // the buckets the grad stream may still reduce into.
  STRATA_RETURN_IF_ERROR(m.device->RecordEvent(m.user_event, m.user_stream));
  STRATA_RETURN_IF_ERROR(m.device->StreamWaitEvent(m.h2d_stream, m.user_event));
  STRATA_RETURN_IF_ERROR(m.device->RecordEvent(m.grad_event, m.grad_stream));
  STRATA_RETURN_IF_ERROR(m.device->StreamWaitEvent(m.h2d_stream, m.grad_event));
  Status first_error;
  for (uint32_t i = 0; i < m.sub_groups.size(); ++i) {
    const uint64_t elems = m.sub_groups[i].elems();
    const uint32_t slot = i % m.buffer_count;
    void* staging = m.param_staging[slot].data();
    bool ok = true;
    if (Status s = m.device->EventSynchronize(m.slot_events[slot]); !s.ok()) {
      if (first_error.ok()) first_error = std::move(s);
      ok = false;
    }
    if (ok) {
      std::span<float> state;
      if (m.extent_of[i] >= 0) {
        if (Status s = m.ReadJob(i).get(); !s.ok()) {
          if (first_error.ok()) first_error = std::move(s);
          ok = false;
        } else {
          state = m.NvmeState(i);
        }
      } else {
        state = m.HostState(i);
      }
      if (ok) ConvertOut(state.first(elems), staging, m.config.param_dtype);
    }
    std::byte* bucket = m.Bucket(i);
    std::byte* mine = bucket + m.rank * elems * m.param_bytes;
    if (ok) {
      STRATA_RETURN_IF_ERROR(m.device->CopyAsync(mine, staging, elems * m.param_bytes,
                                                 CopyKind::kHostToDevice, m.h2d_stream));
    }
    if (m.world > 1) {
      STRATA_RETURN_IF_ERROR(
          m.comm->AllGather(mine, bucket, elems, m.config.param_dtype, m.h2d_stream));
    }
    if (ok) {
      STRATA_RETURN_IF_ERROR(kernels::UnpackParams(
          *m.device, m.h2d_stream, {bucket, m.world * elems, m.config.param_dtype}, m.unpack[i]));
    }
    STRATA_RETURN_IF_ERROR(m.device->RecordEvent(m.slot_events[slot], m.h2d_stream));
  }
  if (Status s = m.device->StreamSynchronize(m.h2d_stream); !s.ok() && first_error.ok()) {
    first_error = std::move(s);
  }
  STRATA_RETURN_IF_ERROR(first_error.WithContext("upload params"));
  STRATA_RETURN_IF_ERROR(m.device->RecordEvent(m.h2d_event, m.h2d_stream));
  return m.device->StreamWaitEvent(m.user_stream, m.h2d_event);
}

}  // namespace strata
