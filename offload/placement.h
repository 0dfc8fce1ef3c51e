// The placement planner: given a rank's sub-groups, the bytes of optimizer
// state per element, the pinned-host and device budgets and whether NVMe is
// available, decides where each sub-group's state (fp32 master weights and the
// optimizer moments) lives — pinned DRAM or NVMe — and sizes the staging
// buffers the pipeline needs. The engine prints FormatPlan() at start-up.
//
//   PlacementInputs in{.sub_group_elems = {32'000'000, 32'000'000, 7'000'000},
//                      .state_bytes_per_elem = 12,           // Adam: master, m, v
//                      .host_budget_bytes = 64 * kGiB,
//                      .nvme = NvmeTier::kAvailable,
//                      .buffer_count = 4};
//   STRATA_ASSIGN_OR_RETURN(PlacementPlan plan, PlanPlacement(in));
//   LogInfo(FormatPlan(plan));
//
// How it decides (docs/offload.md has the whole story):
//   1. Staging that is always needed, in pinned host memory: the gradients
//      as they arrive over PCIe (grad_bytes_per_elem: the trainer's dtype
//      with one rank) — with one rank a ring of buffer_count slots of the
//      largest sub-group, with several the rank's whole reduced shard (it
//      waits on the host for the decision) — and buffer_count param
//      buffers of the largest sub-group (param dtype) for the H2D uploads.
//      On the device: with one rank only the gradient statistics (16 bytes
//      per 4096 elements and per tensor); with several a grad bucket and a
//      param bucket of world_size x the largest sub-group, each holding
//      every rank's block of one sub-group index for the reduce-scatter and
//      the all-gather. 0 device budget means "not limited". No fp32
//      gradient of the shard is planned: it exists only when a trainer
//      accumulates micro-steps (ReduceGradients), in pageable memory
//      outside the pinned budget (4 bytes per shard element).
//   2. If all state fits in what is left of the host budget, everything is
//      host-resident. A host budget of 0 means "not limited" when NVMe is not
//      available, and "staging only" when it is (DeepSpeed's device: nvme).
//   3. Otherwise buffer_count NVMe buffers are added (one extent each: the
//      largest sub-group's state rounded up to 4 KiB plus the store's 4 KiB
//      header), and the *last* k sub-groups, with k as large as fits, stay in
//      DRAM; the first n - k go to NVMe. The NVMe sub-groups are updated
//      before the DRAM ones (alternately first to last and last to first:
//      offload/step_plan.h), so the NVMe reads can start before the
//      gradients are ready (state reads do not depend on them), and the write-
//      behind of the last NVMe sub-groups overlaps the updates of the
//      host-resident ones at the end instead of trailing the step.
//   0. With gpu_fraction > 0 (partial offload) the *first* k sub-groups keep
//      their state in device memory and are updated there by the device Adam,
//      on a stream of their own, while the CPU pipeline updates the rest:
//      k is the count whose elements come closest to gpu_fraction of the
//      shard, or with kGpuFractionAuto the largest k whose state (and with
//      several ranks their reduced gradients, 'device grads') fits
//      device_budget next to the device staging — or, when PlacementInputs::
//      rates has both Adam rates, the k among those whose device update and
//      CPU side (CPU Adam, PCIe, NVMe of the rest: step 6's estimate) finish
//      closest together (the fewest that reach it). The first ones, because
//      the device side starts right after the decision: with several ranks
//      their all-gathers then lead the publish stream instead of trailing
//      the CPU's last sub-group. Steps 1-3 place the other n - k.
//   4. Impossible plans are ResourceExhausted with what is needed, what is
//      available and which knob to turn (strata.host_budget,
//      zero_optimization.offload_optimizer.nvme_path, sub_group_size,
//      buffer_count, strata.device_budget).
//
//   5. Preflight, when PlacementInputs::machine says what this machine has
//      (ProbeMachineLimits fills it in; the default checks nothing): a plan
//      that pins more host memory than the machine has available (shared by
//      the ranks of one node), or puts more state on a filesystem than it has
//      free, is ResourceExhausted with the numbers and the knob to turn; an
//      nvme_path that exists and is not a directory (or cannot be made one)
//      is FailedPrecondition when the plan puts state on NVMe. A
//      plan that pins more than `ulimit -l` is kept, with a warning in
//      PlacementPlan::warnings (the pinned pool then falls back to unlocked
//      memory and io_uring cannot register its buffers).
//
//   6. With PlacementInputs::rates, PlacementPlan::estimate gives each
//      resource's busy time per step at those rates (the step costs at least
//      the largest: the pipeline overlaps them); FormatPlan prints it.
//
// PlanPlacement is pure, deterministic (same inputs, same plan) and
// thread-safe; ProbeMachineLimits reads the machine. InvalidArgument for
// malformed inputs (no sub-groups, more than kMaxSubGroups, a 0-elem
// sub-group, 0 bytes per element, buffer_count 0, a block size that is not a
// multiple of 4096, a gpu_fraction outside [0, 1], kGpuFractionAuto with no
// device budget, a negative or non-finite rate).
#pragma once

#include <algorithm>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "offload/layout.h"
#include "runtime/status.h"

namespace strata {

enum class NvmeTier : uint8_t { kUnavailable = 0, kAvailable = 1 };

// PlacementInputs::gpu_fraction (and OffloadConfig::gpu_fraction): the
// largest share of the state that fits device_budget.
inline constexpr double kGpuFractionAuto = -1.0;

// At most this many sub-groups per rank (2^20, CutSubGroups' limit): the
// engine keeps a few hundred bytes of bookkeeping per sub-group, so a tiny
// sub_group_size on a large model would otherwise exhaust memory before any
// check ran.
inline constexpr uint64_t kMaxSubGroups = kMaxSubGroupCount;

// sub_group_size "auto" (kSubGroupAuto): the elements per sub-group for a
// rank's shard, from what the size trades off:
//   - the step's head (the first sub-group's copy down and update, before
//     anything overlaps) and its tail (the last one's upload and NVMe write)
//     are one sub-group each: kAutoSubGroups sub-groups keep each near
//     1/32 of the step;
//   - each sub-group costs fixed work (events, IO ops, a hand-over): at
//     least kAutoMinSubGroupElems elements;
//   - with NVMe and a host budget, the staging (buffer_count buffers of
//     `staging_bytes_per_elem` per element) takes at most a quarter of the
//     budget, so the rest keeps sub-groups in DRAM (each saves a read and a
//     write per step).
// Rounded up to whole Mi elements (down to whole 64 Ki where the budget caps
// it, at least 64 Ki), at most the shard, and large enough that the shard
// has at most kMaxSubGroups. Pure.
inline constexpr uint64_t kSubGroupAuto = 0;
inline constexpr uint64_t kAutoSubGroups = 32;
inline constexpr uint64_t kAutoMinSubGroupElems = uint64_t{4} << 20;

struct AutoSubGroupInputs {
  uint64_t shard_elems = 0;
  // Per element of one pipeline buffer: state (NVMe extent), param slot and,
  // with one rank, gradient slot bytes.
  uint64_t staging_bytes_per_elem = 0;
  uint32_t buffer_count = 4;
  uint64_t host_budget_bytes = 0;  // 0: not limited (or staging only)
  bool nvme = false;
};
uint64_t AutoSubGroupElems(const AutoSubGroupInputs& in);

// One nvme_path as the preflight sees it.
struct NvmePathSpace {
  std::string path{};
  uint64_t device_id = 0;          // paths on one filesystem share its free space
  uint64_t free_bytes = 0;         // available to this user now
  uint64_t reclaimable_bytes = 0;  // this rank's old state file there, replaced on create
  // OK, or why no directory can be there: the path exists and is not a
  // directory, or its nearest existing ancestor is not one (so it cannot be
  // created), or it is on a read-only mount or on /proc or /sys. A plan
  // with device "nvme" is refused with it, state on NVMe or not (the
  // engine makes and locks nvme_path either way).
  Status not_a_directory{};
};

// What this machine offers the plan; 0 / empty fields are not checked.
struct MachineLimits {
  uint64_t host_available_bytes = 0;  // memory available now (MemAvailable, or a cgroup's room)
  uint64_t host_total_bytes = 0;      // for the message only
  std::string host_memory_note{};     // for the message: HostMemory::limit_note()
  uint64_t memlock_bytes = 0;         // `ulimit -l`; 0 or kUnlimitedBytes: no warning
  uint32_t ranks_per_node = 1;        // ranks that share this machine's memory
  std::vector<NvmePathSpace> nvme{};  // one per nvme_path, in config order
};

enum class Tier : uint8_t { kHost = 0, kNvme = 1, kDevice = 2 };
std::string_view TierName(Tier tier);  // "host", "nvme", "device"

// What the machine does per second (0: unknown): measured (`strata bench`,
// `strata plan --probe-drive`, the engine's probe for gpu_fraction "auto")
// or given in the config (strata.rates).
struct PlanRates {
  double cpu_adam_elems_per_sec = 0;     // one rank's CPU Adam, all its threads
  double device_adam_elems_per_sec = 0;  // the device Adam (partial offload)
  double pcie_bytes_per_sec = 0;         // host <-> device, each way
  double nvme_read_bytes_per_sec = 0;    // the drives of the nvme_paths, together
  double nvme_write_bytes_per_sec = 0;
};

// One rank's step at PlanRates: each resource's bytes and busy seconds (0
// where the rate is unknown). The drives serve every rank of the node
// (MachineLimits::ranks_per_node), so `nvme` counts all of theirs.
struct StepEstimate {
  uint64_t d2h_bytes = 0, h2d_bytes = 0;  // the host sub-groups' grads down, params up
  // This rank's: every NVMe sub-group written, all but nvme_buffers of them
  // read (those are still in the buffers from the step before).
  uint64_t nvme_read_bytes = 0, nvme_write_bytes = 0;
  double cpu_adam = 0, device_adam = 0, d2h = 0, h2d = 0;
  double nvme = 0;  // reads / read rate + writes / write rate (one drive serves both)
  // The CPU side (everything but the device Adam), and the whole step's bound.
  double cpu_side() const;
  double bound() const { return std::max(cpu_side(), device_adam); }
  std::string_view bottleneck() const;  // "cpu adam", "device adam", "pcie", "nvme"; "" if none known
};

struct PlacementInputs {
  std::vector<uint64_t> sub_group_elems;  // the rank's sub-groups, in update order
  uint32_t state_bytes_per_elem = 12;     // Adam/AdamW 12, Adagrad 8, Lion 8
  uint32_t grad_bytes_per_elem = 2;       // gradient element as it crosses PCIe
  uint32_t param_bytes_per_elem = 2;      // fp16/bf16 params uploaded H2D
  uint64_t host_budget_bytes = 0;         // pinned DRAM for state + staging
  uint64_t device_budget_bytes = 0;       // device bytes for staging; 0: not limited
  NvmeTier nvme = NvmeTier::kUnavailable;
  uint32_t buffer_count = 4;       // pipeline depth (DeepSpeed offload_optimizer.buffer_count)
  uint64_t block_bytes = 1 << 20;  // NVMe IO size (aio.block_size); a multiple of 4096
  uint32_t world_size = 1;         // ranks: a device bucket holds every rank's block (>= 1)
  // Share of the shard's state kept and updated on the device, in [0, 1],
  // or kGpuFractionAuto (needs device_budget_bytes). Step 0.
  double gpu_fraction = 0.0;
  PlanRates rates{};               // step 6, and "auto" balancing in step 0
  // The sub-groups were sized by AutoSubGroupElems (the staging errors then
  // name buffer_count, not sub_group_size: "auto" already sized them to the
  // budget).
  bool auto_sub_groups = false;
  MachineLimits machine{};         // the preflight's view of the machine (step 5)
  // The shard's (tensor, sub-group) pieces (CountPieces): the gradient
  // statistics keep a record per piece. 0: one per sub-group.
  uint64_t tensor_pieces = 0;
};

struct SubGroupPlacement {
  uint64_t elems = 0;
  uint64_t state_bytes = 0;  // elems x state_bytes_per_elem
  Tier tier = Tier::kHost;
};

struct StagingBuffer {
  std::string name;  // "grad", "param", "nvme", "device bucket"
  Tier tier = Tier::kHost;
  uint32_t count = 0;
  uint64_t bytes_each = 0;
  uint64_t total_bytes() const { return uint64_t{count} * bytes_each; }
};

struct PlacementPlan {
  std::vector<SubGroupPlacement> sub_groups;  // one per input sub-group, same order
  std::vector<StagingBuffer> buffers;
  uint32_t device_sub_groups = 0;  // the first ones (step 0)
  uint32_t host_sub_groups = 0;
  uint32_t nvme_sub_groups = 0;
  uint64_t device_state_bytes = 0;
  uint64_t device_elems = 0;  // elements of the device sub-groups
  uint64_t host_state_bytes = 0;
  uint64_t nvme_state_bytes = 0;  // payload; extents add 4 KiB rounding + header
  uint64_t host_staging_bytes = 0;
  uint64_t device_staging_bytes = 0;  // buckets, statistics, device grads
  uint64_t host_budget_bytes = 0;  // as given (0: see PlacementInputs)
  uint64_t device_budget_bytes = 0;
  uint64_t nvme_buffer_bytes = 0;  // bytes of one NVMe buffer (0 when no NVMe)
  uint32_t nvme_buffers = 0;       // NVMe extent buffers: the read-ahead depth (0 when no NVMe)
  uint64_t nvme_file_bytes = 0;    // bytes of each rank's state file per nvme_path (checked inputs)
  PlanRates rates{};       // as given
  StepEstimate estimate{};  // step 6
  // gpu_fraction "auto" chose fewer device sub-groups than fit the budget:
  // more would not make the step shorter (the device side would be the
  // slower one, or the CPU side would not shrink).
  bool auto_balanced = false;
  std::vector<std::string> warnings;  // the preflight's: fine to run, worth knowing
  uint64_t host_total_bytes() const { return host_state_bytes + host_staging_bytes; }
  // What gradient accumulation (ReduceGradients) adds at its first micro-step,
  // outside the totals above: fp32 sums of the CPU side's elements in pageable
  // host memory, and of the device sub-groups' in device memory.
  uint64_t accumulation_host_bytes() const { return 4 * (shard_elems() - device_elems); }
  uint64_t accumulation_device_bytes() const { return 4 * device_elems; }
  uint64_t device_total_bytes() const { return device_state_bytes + device_staging_bytes; }
  uint64_t shard_elems() const;  // every sub-group's elements
  // The share of the shard's elements updated on the device.
  double gpu_fraction() const;
};

Result<PlacementPlan> PlanPlacement(const PlacementInputs& inputs);

// The gradient ring's and the param staging's slots, and the most NVMe
// extent buffers: buffer_count, but at most one per sub-group that the CPU
// side updates (the others' slots would never be used), and at least 1.
uint32_t HostSlots(uint32_t buffer_count, size_t sub_groups, size_t device_sub_groups);

// The start-up table: bytes and sub-groups per tier, the buffers, the
// budgets, and the preflight's warnings.
std::string FormatPlan(const PlacementPlan& plan);

// This machine's limits for the plan of `rank` whose state files go to
// `nvme_paths` (may be empty): MemAvailable, `ulimit -l`, and per path its
// free space (of the nearest existing ancestor when the directory is yet to
// be created) and the size of this rank's old state file. Reads
// /proc/meminfo, getrlimit and statvfs; fields it cannot read stay 0 (not
// checked). `real_paths` false (an engine given its own Storage, whose paths
// need not exist): a read-only or block-less filesystem under them is not
// held against them.
MachineLimits ProbeMachineLimits(std::span<const std::string> nvme_paths, uint32_t rank,
                                 uint32_t ranks_per_node, bool real_paths = true);

// Ranks that share this machine: all of them for the in-process
// communicator ("local"), else LOCAL_WORLD_SIZE from the environment (set by
// torchrun), else 1.
uint32_t RanksPerNode(std::string_view comm_backend, uint32_t world_size);

// The CPU optimizer threads of one rank when the config leaves them to the
// engine (strata.threads 0): the usable cores shared by the ranks on this
// machine, at least 1 each; all of them where the rank runs alone, or where
// its affinity mask is no larger than a rank's share of the machine (its
// launcher bound it to cores of its own).
int DefaultCpuThreads(uint32_t usable_cpus, uint32_t online_cpus, uint32_t ranks_per_node);

// The bytes one NVMe buffer needs for a sub-group state of `state_bytes`:
// rounded up to 4 KiB, plus the state store's 4 KiB extent header.
uint64_t NvmeBufferBytes(uint64_t state_bytes);

}  // namespace strata
