#include "offload/placement.h"

#include <fmt/format.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdlib>
#include <limits>
#include <map>

#include "kernels/kernels.h"
#include "runtime/log.h"
#include "runtime/machine.h"
#include "runtime/units.h"

namespace strata {
namespace {

constexpr uint64_t kPage = 4096;
constexpr uint64_t kExtentHeaderBytes = 4096;  // StateStore::kHeaderBytes

uint64_t RoundUpPage(uint64_t bytes) { return (bytes + kPage - 1) / kPage * kPage; }
uint64_t CeilDiv(uint64_t a, uint64_t b) { return (a + b - 1) / b; }

// The knobs that shrink the per-buffer staging.
std::string_view StagingKnob(const PlacementInputs& in) {
  return in.auto_sub_groups
             ? "lower offload_optimizer.buffer_count (sub_group_size \"auto\" already sized the "
               "sub-groups to the budget)"
             : "lower zero_optimization.sub_group_size (\"auto\" sizes it to the budget) or "
               "offload_optimizer.buffer_count";
}

// Bytes of one rank's state file per nvme_path: a superblock, then two slots
// per NVMe sub-group, each slot (one NVMe buffer) cut into block_bytes chunks
// dealt round-robin over the paths (offload/state_store.h); the superblock
// and each file's share of a slot take whole blocks, so that every chunk
// starts on a block boundary.
uint64_t NvmeFileBytes(const PlacementPlan& plan, uint64_t block_bytes, uint64_t paths) {
  if (plan.nvme_sub_groups == 0) return 0;
  const uint64_t chunks = CeilDiv(plan.nvme_buffer_bytes, block_bytes);
  const uint64_t per_file_slot = CeilDiv(chunks, paths) * block_bytes;
  return block_bytes + 2 * uint64_t{plan.nvme_sub_groups} * per_file_slot;
}

// Step 5 of the header: the plan against what the machine has.
Status Preflight(const PlacementInputs& in, PlacementPlan& plan) {
  constexpr std::string_view kOp = "plan placement";
  const MachineLimits& m = in.machine;
  const uint64_t ranks = std::max<uint32_t>(m.ranks_per_node, 1);
  const uint64_t pinned = plan.host_total_bytes();
  if (m.host_available_bytes != 0 && pinned * ranks > m.host_available_bytes) {
    const uint64_t each = m.host_available_bytes / ranks;
    const std::string have =
        ranks > 1 ? fmt::format("{} available ({} total{}) shared by {} ranks: {} each",
                                FormatBytes(m.host_available_bytes),
                                FormatBytes(m.host_total_bytes), m.host_memory_note, ranks,
                                FormatBytes(each))
                  : fmt::format("{} available ({} total{})", FormatBytes(m.host_available_bytes),
                                FormatBytes(m.host_total_bytes), m.host_memory_note);
    std::string knob;
    if (plan.host_staging_bytes > each) {
      // One rank: a ring of sub-group slots; several: the reduced shard.
      const bool shard_buffer = in.world_size > 1;
      knob = fmt::format(
          "the pinned staging alone needs {} ({}: {}); {}{}",
          FormatBytes(plan.host_staging_bytes), plan.buffers[0].name,
          FormatBytes(plan.buffers[0].total_bytes()), StagingKnob(in),
          shard_buffer ? ", or shard over more ranks (the grad shard holds the rank's reduced "
                         "gradient)"
                       : "");
      if (in.nvme != NvmeTier::kAvailable && plan.host_state_bytes > 0) {
        knob += fmt::format(
            "; and the state ({}) needs NVMe: set zero_optimization.offload_optimizer.device to "
            "\"nvme\" with an nvme_path",
            FormatBytes(plan.host_state_bytes));
      }
    } else if (in.nvme == NvmeTier::kAvailable) {
      knob = fmt::format(
          "set strata.host_budget to at most {} so that the rest of the state goes to NVMe",
          FormatBytes(each));
    } else {
      knob = fmt::format(
          "set zero_optimization.offload_optimizer.device to \"nvme\" with an nvme_path and "
          "strata.host_budget to at most {}, or shard over more ranks",
          FormatBytes(each));
    }
    return ResourceExhaustedError(fmt::format(
        "{}: the plan pins {} of host memory ({} state + {} staging) but this machine has {}; {}",
        kOp, FormatBytes(pinned), FormatBytes(plan.host_state_bytes),
        FormatBytes(plan.host_staging_bytes), have, knob));
  }
  // Fits, but with little left: the trainer, CUDA and the engine's pageable
  // memory (a checkpoint's chunks, accumulation's sums) live in the rest.
  if (m.host_available_bytes != 0 && pinned * ranks <= m.host_available_bytes &&
      pinned * ranks * 10 > m.host_available_bytes * 9) {
    plan.warnings.push_back(fmt::format(
        "the plan pins {}{} of the {} of memory available: little is left for the trainer, "
        "CUDA and the engine's pageable memory (a checkpoint's IO chunks, gradient "
        "accumulation's sums); lower strata.host_budget (more state on NVMe) or "
        "zero_optimization.sub_group_size",
        FormatBytes(pinned * ranks), ranks > 1 ? fmt::format(" ({} ranks)", ranks) : "",
        FormatBytes(m.host_available_bytes)));
  } else if (const uint64_t accum = plan.accumulation_host_bytes();
             m.host_available_bytes != 0 && pinned * ranks <= m.host_available_bytes &&
             (pinned + accum) * ranks > m.host_available_bytes) {
    // The plan fits, its own accumulation line does not: say so before a
    // ReduceGradients finds out.
    plan.warnings.push_back(fmt::format(
        "with gradient accumulation (ReduceGradients) the optimizer needs {}{} ({} pinned + "
        "{} of sums) but {} is available: without accumulation it fits; with it, lower "
        "strata.host_budget (more state on NVMe) or shard over more ranks",
        FormatBytes((pinned + accum) * ranks), ranks > 1 ? fmt::format(" ({} ranks)", ranks) : "",
        FormatBytes(pinned), FormatBytes(accum), FormatBytes(m.host_available_bytes)));
  }
  if (in.host_budget_bytes != 0 && m.host_total_bytes != 0 &&
      in.host_budget_bytes * ranks > m.host_total_bytes) {
    plan.warnings.push_back(fmt::format(
        "strata.host_budget {}{} exceeds this machine's {} of memory{}: it bounds nothing here, "
        "the state it lets stay in DRAM may not fit; give at most what the machine has",
        FormatBytes(in.host_budget_bytes), ranks > 1 ? fmt::format(" x {} ranks", ranks) : "",
        FormatBytes(m.host_total_bytes), m.host_memory_note));
  }
  if (m.memlock_bytes != 0 && m.memlock_bytes != kUnlimitedBytes && pinned > m.memlock_bytes) {
    plan.warnings.push_back(fmt::format(
        "the plan pins {} but `ulimit -l` is {}: past it host memory is not page-locked and "
        "io_uring cannot register the NVMe buffers (slower copies and IO, still correct); "
        "raise it (`ulimit -l unlimited`, memlock in /etc/security/limits.conf, "
        "LimitMEMLOCK= in systemd, --ulimit memlock=-1 in docker) or grant CAP_IPC_LOCK",
        FormatBytes(pinned), FormatBytes(m.memlock_bytes)));
  }
  plan.nvme_file_bytes = NvmeFileBytes(plan, in.block_bytes, std::max<size_t>(m.nvme.size(), 1));
  // The engine makes and locks every nvme_path of device "nvme", state on
  // NVMe or not.
  for (const NvmePathSpace& p : m.nvme) {
    if (in.nvme == NvmeTier::kAvailable && !p.not_a_directory.ok()) {
      return FailedPreconditionError(fmt::format(
          "{}: zero_optimization.offload_optimizer.nvme_path {}; give a directory for the "
          "state files (a path that does not exist yet is created)",
          kOp, p.not_a_directory.message()));
    }
  }
  if (plan.nvme_file_bytes == 0 || m.nvme.empty()) return OkStatus();
  // Paths on one filesystem share its free space. The other ranks of this
  // machine write a file each too, under the same nvme_path or on drives of
  // their own (/nvme{local_rank}): this rank cannot tell which, so its own
  // file must fit (or Create is refused), and all of theirs is a warning (the
  // store reserves its blocks at Create, so a shared disk that is too small
  // fails there, naming the file, not mid-step).
  struct Need {
    uint64_t need = 0, free = 0, reclaimable = 0;
    std::string paths;
  };
  std::map<uint64_t, Need> by_device;
  for (const NvmePathSpace& p : m.nvme) {
    Need& n = by_device[p.device_id];
    n.need += plan.nvme_file_bytes;
    n.free = p.free_bytes;
    n.reclaimable += p.reclaimable_bytes;
    n.paths += (n.paths.empty() ? "" : ", ") + p.path;
  }
  for (const auto& [device, n] : by_device) {
    if (n.need > n.free + n.reclaimable) {
      return ResourceExhaustedError(fmt::format(
          "{}: the NVMe state needs {} ({} sub-groups, two slots each) on the filesystem of {} "
          "but it has {} free{}; free space there, add an nvme_path on another drive (the "
          "state is striped over them), or raise strata.host_budget so that more state stays "
          "in DRAM",
          kOp, FormatBytes(n.need), plan.nvme_sub_groups, n.paths, FormatBytes(n.free),
          n.reclaimable > 0
              ? fmt::format(" (+ {} of this rank's old state file)", FormatBytes(n.reclaimable))
              : std::string()));
    }
    if (ranks > 1 && n.need * ranks > n.free + n.reclaimable * ranks) {
      plan.warnings.push_back(fmt::format(
          "the NVMe state of this machine's {} ranks needs {} ({} each) if they share the "
          "filesystem of {}, which has {} free: fine if each rank has a drive of its own, "
          "otherwise a rank's Create will fail reserving its file; free space there, or give "
          "each rank its own nvme_path drive",
          ranks, FormatBytes(n.need * ranks), FormatBytes(n.need), n.paths,
          FormatBytes(n.free)));
    }
  }
  return OkStatus();
}

}  // namespace

std::string_view TierName(Tier tier) {
  switch (tier) {
    case Tier::kHost:
      return "host";
    case Tier::kNvme:
      return "nvme";
    case Tier::kDevice:
      return "device";
  }
  return "?";
}

uint64_t PlacementPlan::shard_elems() const {
  uint64_t all = 0;
  for (const SubGroupPlacement& g : sub_groups) all += g.elems;
  return all;
}

double PlacementPlan::gpu_fraction() const {
  const uint64_t all = shard_elems();
  return all == 0 ? 0.0 : static_cast<double>(device_elems) / static_cast<double>(all);
}

double StepEstimate::cpu_side() const { return std::max({cpu_adam, d2h, h2d, nvme}); }

std::string_view StepEstimate::bottleneck() const {
  const std::pair<double, std::string_view> sides[] = {
      {cpu_adam, "cpu adam"}, {device_adam, "device adam"}, {std::max(d2h, h2d), "pcie"},
      {nvme, "nvme"}};
  std::pair<double, std::string_view> most{0.0, ""};
  for (const auto& s : sides) {
    if (s.first > most.first) most = s;
  }
  return most.second;
}

uint64_t NvmeBufferBytes(uint64_t state_bytes) {
  return RoundUpPage(state_bytes) + kExtentHeaderBytes;
}

namespace {

// What steps 1-3 need, computed once by PlanTiers.
struct Shape {
  PlacementPlan base;                         // every sub-group, budgets; no tiers yet
  std::vector<StagingBuffer> device_buffers;  // device staging independent of the split
  uint64_t fixed_device = 0;                  // their bytes
  uint64_t stats_bytes = 0;                   // "grad stats", on the device and the host
  std::vector<uint64_t> cum_elems;            // elems of the first k sub-groups
  std::vector<uint64_t> cum_device;           // device bytes of the first k (state, grads)
};

Status CheckRate(double rate, std::string_view name) {
  if (std::isfinite(rate) && rate >= 0) return OkStatus();
  return InvalidArgumentError(
      fmt::format("plan placement: strata.rates.{} is {}; a rate must be a finite number >= 0 "
                  "(0: unknown)",
                  name, rate));
}

// Step 6.
StepEstimate Estimate(const PlacementInputs& in, const PlacementPlan& plan) {
  const PlanRates& r = in.rates;
  const uint64_t host_elems = plan.shard_elems() - plan.device_elems;
  StepEstimate e;
  e.d2h_bytes = host_elems * in.grad_bytes_per_elem;
  e.h2d_bytes = host_elems * in.param_bytes_per_elem;
  e.nvme_write_bytes = plan.nvme_state_bytes;
  // Every NVMe sub-group is written once a step; the nvme_buffers a step
  // starts with are still in their buffers from the step before, not read
  // (steps alternate their order: offload/state_tiers.h).
  e.nvme_read_bytes = plan.nvme_state_bytes;
  uint32_t resident = 0;
  for (size_t i = plan.sub_groups.size(); i-- > 0 && resident < plan.nvme_buffers;) {
    if (plan.sub_groups[i].tier != Tier::kNvme) continue;
    e.nvme_read_bytes -= plan.sub_groups[i].state_bytes;
    ++resident;
  }
  auto time = [](double amount, double rate) { return rate > 0 ? amount / rate : 0.0; };
  const double ranks = std::max<uint32_t>(in.machine.ranks_per_node, 1);
  e.cpu_adam = time(static_cast<double>(host_elems), r.cpu_adam_elems_per_sec);
  e.device_adam = time(static_cast<double>(plan.device_elems), r.device_adam_elems_per_sec);
  e.d2h = time(static_cast<double>(e.d2h_bytes), r.pcie_bytes_per_sec);
  e.h2d = time(static_cast<double>(e.h2d_bytes), r.pcie_bytes_per_sec);
  e.nvme = time(ranks * static_cast<double>(e.nvme_read_bytes), r.nvme_read_bytes_per_sec) +
           time(ranks * static_cast<double>(e.nvme_write_bytes), r.nvme_write_bytes_per_sec);
  return e;
}

// Steps 1-3: the first k sub-groups on the device (step 0's choice), the
// others in DRAM and on NVMe.
Result<PlacementPlan> PlaceRest(const PlacementInputs& in, const Shape& sh, size_t k) {
  constexpr std::string_view kOp = "plan placement";
  PlacementPlan plan = sh.base;
  const size_t n = plan.sub_groups.size();
  const bool one_rank = in.world_size == 1;
  uint64_t all_state = 0;
  for (size_t i = 0; i < n; ++i) {
    if (i < k) {
      plan.sub_groups[i].tier = Tier::kDevice;
      plan.device_state_bytes += plan.sub_groups[i].state_bytes;
    } else {
      all_state += plan.sub_groups[i].state_bytes;
    }
  }
  plan.device_sub_groups = static_cast<uint32_t>(k);
  plan.device_elems = sh.cum_elems[k];
  std::vector<StagingBuffer> device_buffers = sh.device_buffers;
  if (k > 0 && !one_rank) {
    device_buffers.push_back(
        {"device grads", Tier::kDevice, 1, sh.cum_elems[k] * in.grad_bytes_per_elem});
  }

  // Host staging serves the other sub-groups only.
  uint64_t host_max_elems = 0;
  for (size_t i = k; i < n; ++i) host_max_elems = std::max(host_max_elems, plan.sub_groups[i].elems);
  const uint64_t host_shard_elems = sh.cum_elems[n] - sh.cum_elems[k];
  // At most one slot per sub-group that passes through the host pipeline
  // (HostSlots: the engine allocates as many).
  const uint32_t slots = HostSlots(in.buffer_count, n, k);
  if (one_rank) {
    plan.buffers.push_back(
        {"grad ring", Tier::kHost, slots, host_max_elems * in.grad_bytes_per_elem});
  } else {
    plan.buffers.push_back(
        {"grad shard", Tier::kHost, 1, host_shard_elems * in.grad_bytes_per_elem});
  }
  plan.buffers.push_back({"param", Tier::kHost, slots, host_max_elems * in.param_bytes_per_elem});
  plan.buffers.push_back({"grad stats", Tier::kHost, 1, sh.stats_bytes});
  const uint64_t fixed_host = plan.buffers[0].total_bytes() + plan.buffers[1].total_bytes() +
                              plan.buffers[2].total_bytes();
  for (StagingBuffer& b : device_buffers) {
    plan.device_staging_bytes += b.total_bytes();
    plan.buffers.push_back(std::move(b));
  }
  const bool nvme = in.nvme == NvmeTier::kAvailable;
  const bool unlimited_host = in.host_budget_bytes == 0 && !nvme;

  if (unlimited_host || fixed_host + all_state <= in.host_budget_bytes) {
    plan.host_sub_groups = static_cast<uint32_t>(n - k);
    plan.host_state_bytes = all_state;
    plan.host_staging_bytes = fixed_host;
    return plan;
  }
  if (!nvme) {
    return ResourceExhaustedError(
        fmt::format("{}: {} sub-groups need {} of pinned host memory ({} state + {} staging) but "
                    "strata.host_budget is {}; raise strata.host_budget to {}, or set "
                    "zero_optimization.offload_optimizer.device to \"nvme\" with an nvme_path",
                    kOp, n - k, FormatBytes(fixed_host + all_state),
                    FormatBytes(all_state), FormatBytes(fixed_host),
                    FormatBytes(in.host_budget_bytes), FormatBytes(fixed_host + all_state)));
  }
  plan.nvme_buffer_bytes = NvmeBufferBytes(host_max_elems * in.state_bytes_per_elem);
  plan.nvme_buffers = slots;
  plan.buffers.push_back({"nvme", Tier::kHost, slots, plan.nvme_buffer_bytes});
  const uint64_t staging = fixed_host + plan.buffers.back().total_bytes();
  plan.host_staging_bytes = staging;
  if (in.host_budget_bytes != 0 && staging > in.host_budget_bytes) {
    return ResourceExhaustedError(fmt::format(
        "{}: with all state on NVMe the pinned staging alone needs {} ({} {}, param {} x "
        "{}, grad stats {}, nvme {} x {}) but strata.host_budget is {}; raise "
        "strata.host_budget to {}, or {}{}",
        kOp, FormatBytes(staging), plan.buffers[0].name, FormatBytes(plan.buffers[0].total_bytes()),
        slots, FormatBytes(plan.buffers[1].bytes_each), FormatBytes(sh.stats_bytes), slots,
        FormatBytes(plan.nvme_buffer_bytes), FormatBytes(in.host_budget_bytes),
        FormatBytes(staging), StagingKnob(in),
        one_rank ? "" : ", or shard over more ranks (the grad shard holds the rank's reduced "
                        "gradient)"));
  }
  // Host budget 0 with NVMe: staging only, every sub-group on NVMe.
  uint64_t room = in.host_budget_bytes == 0 ? 0 : in.host_budget_bytes - staging;
  // The last sub-groups stay in DRAM (see the header for why).
  size_t first_host = n;
  while (first_host > k && plan.sub_groups[first_host - 1].state_bytes <= room) {
    room -= plan.sub_groups[first_host - 1].state_bytes;
    --first_host;
  }
  for (size_t i = k; i < n; ++i) {
    SubGroupPlacement& g = plan.sub_groups[i];
    g.tier = i < first_host ? Tier::kNvme : Tier::kHost;
    if (g.tier == Tier::kHost) {
      ++plan.host_sub_groups;
      plan.host_state_bytes += g.state_bytes;
    } else {
      ++plan.nvme_sub_groups;
      plan.nvme_state_bytes += g.state_bytes;
    }
  }
  // At most one extent buffer per NVMe sub-group (StateTiers allocates as
  // many); what is left over is not pinned.
  if (plan.nvme_sub_groups > 0 && plan.nvme_buffers > plan.nvme_sub_groups) {
    StagingBuffer& b = plan.buffers.back();
    plan.host_staging_bytes -= uint64_t{plan.nvme_buffers - plan.nvme_sub_groups} * b.bytes_each;
    plan.nvme_buffers = plan.nvme_sub_groups;
    b.count = plan.nvme_sub_groups;
  }
  return plan;
}

Result<PlacementPlan> PlanTiers(const PlacementInputs& in) {
  constexpr std::string_view kOp = "plan placement";
  if (in.sub_group_elems.empty()) {
    return InvalidArgumentError(fmt::format("{}: no sub-groups (the shard is empty)", kOp));
  }
  if (in.sub_group_elems.size() > kMaxSubGroups) {
    return InvalidArgumentError(
        fmt::format("{}: {} sub-groups; at most {}: raise zero_optimization.sub_group_size", kOp,
                    in.sub_group_elems.size(), kMaxSubGroups));
  }
  if (in.state_bytes_per_elem == 0 || in.grad_bytes_per_elem == 0 || in.param_bytes_per_elem == 0) {
    return InvalidArgumentError(
        fmt::format("{}: bytes per element (state {}, grad {}, param {}) must all be > 0", kOp,
                    in.state_bytes_per_elem, in.grad_bytes_per_elem, in.param_bytes_per_elem));
  }
  if (in.world_size == 0 || in.world_size > 65536) {
    return InvalidArgumentError(
        fmt::format("{}: world_size is {}; it must be in [1, 65536]", kOp, in.world_size));
  }
  if (in.buffer_count == 0 || in.buffer_count > 1024) {
    return InvalidArgumentError(fmt::format(
        "{}: buffer_count is {}; the pipeline needs 1 to 1024 buffers", kOp, in.buffer_count));
  }
  if (in.block_bytes == 0 || in.block_bytes % kPage != 0) {
    return InvalidArgumentError(fmt::format(
        "{}: aio.block_size {} must be a positive multiple of 4096", kOp, in.block_bytes));
  }
  if (in.state_bytes_per_elem > 64 || in.grad_bytes_per_elem > 64 || in.param_bytes_per_elem > 64) {
    return InvalidArgumentError(
        fmt::format("{}: bytes per element (state {}, grad {}, param {}) must be at most 64", kOp,
                    in.state_bytes_per_elem, in.grad_bytes_per_elem, in.param_bytes_per_elem));
  }
  STRATA_RETURN_IF_ERROR(CheckRate(in.rates.cpu_adam_elems_per_sec, "cpu_adam"));
  STRATA_RETURN_IF_ERROR(CheckRate(in.rates.device_adam_elems_per_sec, "device_adam"));
  STRATA_RETURN_IF_ERROR(CheckRate(in.rates.pcie_bytes_per_sec, "pcie"));
  STRATA_RETURN_IF_ERROR(CheckRate(in.rates.nvme_read_bytes_per_sec, "nvme_read"));
  STRATA_RETURN_IF_ERROR(CheckRate(in.rates.nvme_write_bytes_per_sec, "nvme_write"));
  // Bound every size so products below cannot overflow: 2^44 elements x 64 bytes x 1024 buffers.
  constexpr uint64_t kMaxElems = uint64_t{1} << 44;
  Shape sh;
  sh.base.host_budget_bytes = in.host_budget_bytes;
  sh.base.device_budget_bytes = in.device_budget_bytes;
  sh.base.rates = in.rates;
  const size_t n = in.sub_group_elems.size();
  const bool one_rank = in.world_size == 1;
  const uint64_t device_grad_bytes = one_rank ? 0 : in.grad_bytes_per_elem;
  sh.cum_elems.assign(n + 1, 0);
  sh.cum_device.assign(n + 1, 0);
  uint64_t max_elems = 0;
  for (size_t i = 0; i < n; ++i) {
    const uint64_t e = in.sub_group_elems[i];
    if (e == 0 || e > kMaxElems || sh.cum_elems[i] + e > kMaxElems) {
      return InvalidArgumentError(fmt::format(
          "{}: sub-group {} has {} elems; each must be in [1, 2^44] and the shard at most 2^44",
          kOp, i, e));
    }
    max_elems = std::max(max_elems, e);
    const uint64_t sb = e * in.state_bytes_per_elem;
    sh.base.sub_groups.push_back({e, sb, Tier::kHost});
    sh.cum_elems[i + 1] = sh.cum_elems[i] + e;
    sh.cum_device[i + 1] = sh.cum_device[i] + sb + e * device_grad_bytes;
  }
  const uint64_t shard_elems = sh.cum_elems[n];

  // Device staging that does not depend on the split. The gradient
  // statistics: GradStatsBufferBytes per piece, a 16 B total and 16 B per
  // started block of 4096 elements, so at most 16 B x (2 per piece + the
  // shard's blocks); and the 4 KiB control block that carries the
  // all-reduced doubles. On the device and mirrored in pinned host memory.
  static_assert(sizeof(kernels::DeviceGradStats) == 16 &&
                kernels::kGradStatsBlockElemsDevice == 4096);
  const uint64_t pieces = std::max<uint64_t>(in.tensor_pieces, n);
  sh.stats_bytes = 16 * (2 * pieces + (shard_elems + 4095) / 4096) + 4096;
  sh.device_buffers.push_back({"grad stats", Tier::kDevice, 1, sh.stats_bytes});
  if (!one_rank) {
    // A bucket holds every rank's block: world_size x the largest sub-group,
    // bounded like the shard so that the products below stay in 64 bits.
    if (uint64_t{in.world_size} * max_elems > kMaxElems) {
      return InvalidArgumentError(fmt::format(
          "{}: a device bucket of {} ranks x {} elems exceeds 2^44 elems; lower "
          "zero_optimization.sub_group_size",
          kOp, in.world_size, max_elems));
    }
    const uint64_t block = uint64_t{in.world_size} * max_elems;
    sh.device_buffers.push_back({"grad bucket", Tier::kDevice, 1, block * in.grad_bytes_per_elem});
    sh.device_buffers.push_back(
        {"param bucket", Tier::kDevice, 1, block * in.param_bytes_per_elem});
  }
  for (const StagingBuffer& b : sh.device_buffers) sh.fixed_device += b.total_bytes();
  if (in.device_budget_bytes != 0 && sh.fixed_device > in.device_budget_bytes) {
    return ResourceExhaustedError(fmt::format(
        "{}: device staging needs {} but strata.device_budget is {}; raise "
        "strata.device_budget to {} or lower zero_optimization.sub_group_size",
        kOp, FormatBytes(sh.fixed_device), FormatBytes(in.device_budget_bytes),
        FormatBytes(sh.fixed_device)));
  }

  // Step 0: the first k sub-groups on the device.
  const bool auto_fraction = in.gpu_fraction == kGpuFractionAuto;
  if (!auto_fraction && !(in.gpu_fraction >= 0 && in.gpu_fraction <= 1)) {
    return InvalidArgumentError(
        fmt::format("{}: gpu_fraction is {}; it must be in [0, 1] or \"auto\"", kOp,
                    in.gpu_fraction));
  }
  if (auto_fraction && in.device_budget_bytes == 0) {
    return InvalidArgumentError(fmt::format(
        "{}: gpu_fraction \"auto\" needs strata.device_budget (the device memory the optimizer "
        "may use for its state); set it, or give gpu_fraction a number",
        kOp));
  }
  // The most sub-groups whose device bytes fit the budget.
  auto most_that_fit = [&] {
    size_t c = 0;
    while (c < n && sh.fixed_device + sh.cum_device[c + 1] <= in.device_budget_bytes) ++c;
    return c;
  };
  size_t k = 0;
  bool balanced = false;
  if (auto_fraction) {
    k = most_that_fit();
    if (in.rates.cpu_adam_elems_per_sec > 0 && in.rates.device_adam_elems_per_sec > 0) {
      // The device side grows with c and the CPU side shrinks (a plan that
      // does not fit counts as endless).
      auto sides = [&](size_t c) {
        const double device =
            static_cast<double>(sh.cum_elems[c]) / in.rates.device_adam_elems_per_sec;
        Result<PlacementPlan> p = PlaceRest(in, sh, c);
        const double cpu = p.ok() ? Estimate(in, *p).cpu_side()
                                  : std::numeric_limits<double>::infinity();
        return std::pair<double, double>(device, cpu);
      };
      auto step = [&](size_t c) {
        const auto [device, cpu] = sides(c);
        return std::max(device, cpu);
      };
      // The smallest c in [lo, hi] where `holds` does (it holds from there
      // on), else hi.
      auto first_where = [](size_t lo, size_t hi, const auto& holds) {
        while (lo < hi) {
          const size_t mid = lo + (hi - lo) / 2;
          if (holds(mid)) {
            hi = mid;
          } else {
            lo = mid + 1;
          }
        }
        return lo;
      };
      // Below `cross` the step is the CPU side (non-increasing), from it on
      // the device side (non-decreasing): its least is at cross - 1 or
      // cross. Then the fewest sub-groups that reach it (the CPU side may
      // be flat, e.g. bound by NVMe), to spare device memory.
      const size_t cross = first_where(0, k, [&](size_t c) {
        const auto [device, cpu] = sides(c);
        return device >= cpu;
      });
      const double at_cross = step(cross);
      const double least = cross > 0 ? std::min(step(cross - 1), at_cross) : at_cross;
      const size_t fewest = first_where(0, at_cross == least ? cross : cross - 1,
                                        [&](size_t c) { return step(c) <= least; });
      balanced = fewest < k;
      k = fewest;
    }
  } else if (in.gpu_fraction > 0) {
    // The count whose elements come closest to the fraction (ties: fewer).
    const double target = in.gpu_fraction * static_cast<double>(shard_elems);
    auto miss = [&](size_t c) { return std::abs(static_cast<double>(sh.cum_elems[c]) - target); };
    for (size_t c = 1; c <= n; ++c) {
      if (miss(c) < miss(k)) k = c;
    }
    if (in.device_budget_bytes != 0 &&
        sh.fixed_device + sh.cum_device[k] > in.device_budget_bytes) {
      const size_t fits = most_that_fit();
      return ResourceExhaustedError(fmt::format(
          "{}: gpu_fraction {} keeps {} sub-groups on the device, {} with the staging, but "
          "strata.device_budget is {}; raise strata.device_budget to {}, or lower gpu_fraction "
          "to {:.3g} ({} sub-groups) or use \"auto\"",
          kOp, in.gpu_fraction, k, FormatBytes(sh.fixed_device + sh.cum_device[k]),
          FormatBytes(in.device_budget_bytes), FormatBytes(sh.fixed_device + sh.cum_device[k]),
          static_cast<double>(sh.cum_elems[fits]) / static_cast<double>(shard_elems), fits));
    }
  }
  STRATA_ASSIGN_OR_RETURN(PlacementPlan plan, PlaceRest(in, sh, k));
  plan.auto_balanced = balanced;
  plan.estimate = Estimate(in, plan);
  return plan;
}

}  // namespace

uint64_t AutoSubGroupElems(const AutoSubGroupInputs& in) {
  constexpr uint64_t kMi = uint64_t{1} << 20;
  const uint64_t shard = std::max<uint64_t>(in.shard_elems, 1);
  uint64_t elems = std::max(CeilDiv(shard, kAutoSubGroups), kAutoMinSubGroupElems);
  elems = CeilDiv(elems, kMi) * kMi;
  if (in.nvme && in.host_budget_bytes > 0 && in.staging_bytes_per_elem > 0) {
    constexpr uint64_t k64Ki = uint64_t{1} << 16;
    const uint64_t cap = in.host_budget_bytes / 4 /
                         (std::max<uint32_t>(in.buffer_count, 1) * in.staging_bytes_per_elem);
    elems = std::min(elems, std::max(cap / k64Ki * k64Ki, k64Ki));
  }
  elems = std::min(elems, shard);
  return std::max(elems, CeilDiv(shard, kMaxSubGroups));
}

uint32_t HostSlots(uint32_t buffer_count, size_t sub_groups, size_t device_sub_groups) {
  const uint64_t cpu_side = sub_groups > device_sub_groups ? sub_groups - device_sub_groups : 0;
  return static_cast<uint32_t>(std::max<uint64_t>(1, std::min<uint64_t>(buffer_count, cpu_side)));
}

Result<PlacementPlan> PlanPlacement(const PlacementInputs& inputs) {
  STRATA_ASSIGN_OR_RETURN(PlacementPlan plan, PlanTiers(inputs));
  STRATA_RETURN_IF_ERROR(Preflight(inputs, plan));
  return plan;
}

MachineLimits ProbeMachineLimits(std::span<const std::string> nvme_paths, uint32_t rank,
                                 uint32_t ranks_per_node, bool real_paths) {
  MachineLimits m;
  m.ranks_per_node = std::max<uint32_t>(ranks_per_node, 1);
  if (Result<HostMemory> mem = ProbeHostMemory(); mem.ok()) {
    m.host_available_bytes = mem->available_bytes;
    m.host_total_bytes = mem->total_bytes;
    m.host_memory_note = mem->limit_note();
    m.memlock_bytes =
        mem->memlock == MemlockLimit::kUnlimited ? kUnlimitedBytes : mem->memlock_limit_bytes;
  }
  for (const std::string& path : nvme_paths) {
    DirectoryProbe d = ProbeDirectory(path, DirectoryChecks::kSpace);
    if (!d.space.ok()) {  // unknown space: the disks are not checked
      m.nvme.clear();
      return m;
    }
    // Not a directory, none can be made there, or on a read-only mount
    // (permissions are left to the engine: with its own Storage the paths
    // need not be real, and a fake one under / is not this user's to write).
    const bool blocked =
        d.kind == PathKind::kNotDirectory ||
        (d.kind == PathKind::kMissing && !d.writable.ok() && d.writable_errno == 0) ||
        (real_paths && !d.writable.ok() && d.writable_errno == EROFS);
    // /proc and /sys hold no state file: named as such, not as a disk with
    // 0 B free (tmpfs and ramfs without a size report 0 blocks too, and do
    // hold files).
    Status where = blocked ? d.writable : OkStatus();
    if (where.ok() && real_paths && (d.filesystem == "proc" || d.filesystem == "sysfs")) {
      where = FailedPreconditionError(
          fmt::format("{}: {} is on {}, a filesystem that holds no files", path,
                      d.probed_path == path ? std::string("it") : d.probed_path, d.filesystem));
    }
    // The state file's name is offload/state_store.h's on-disk layout.
    m.nvme.push_back(
        {.path = path,
         .device_id = d.device_id,
         .free_bytes = d.free_bytes,
         .reclaimable_bytes = FileAllocatedBytes(fmt::format("{}/strata-rank{}.state", path, rank)),
         .not_a_directory = std::move(where)});
  }
  return m;
}

uint32_t RanksPerNode(std::string_view comm_backend, uint32_t world_size) {
  if (comm_backend == "local") return std::max<uint32_t>(world_size, 1);
  if (const char* v = std::getenv("LOCAL_WORLD_SIZE"); v != nullptr) {
    char* end = nullptr;
    errno = 0;
    const long n = std::strtol(v, &end, 10);
    if (errno == 0 && end != v && *end == '\0' && n >= 1 && n <= 65536) {
      return static_cast<uint32_t>(n);
    }
    WarnOnce("local-world-size",
             fmt::format("LOCAL_WORLD_SIZE='{}' is not a number of ranks (1 to 65536); the "
                         "memory checks count 1 rank on this machine: fix or unset it",
                         v));
  }
  return 1;
}

int DefaultCpuThreads(uint32_t usable_cpus, uint32_t online_cpus, uint32_t ranks_per_node) {
  const uint32_t usable = std::max<uint32_t>(usable_cpus, 1);
  // A mask no larger than a rank's share of the machine: the launcher bound
  // this rank to cores of its own (a container's cpuset is larger).
  if (ranks_per_node <= 1 || uint64_t{usable} * ranks_per_node <= online_cpus) {
    return static_cast<int>(usable);
  }
  return static_cast<int>(std::max<uint32_t>(usable / ranks_per_node, 1));
}

std::string FormatPlan(const PlacementPlan& plan) {
  auto budget = [](uint64_t b, std::string_view zero) {
    return b == 0 ? std::string(zero) : FormatBytes(b);
  };
  std::string out = "placement plan\n";
  out += fmt::format("  {:<8} {:>10} {:>14} {:>14} {:>14}\n", "tier", "sub-groups", "state",
                     "staging", "budget");
  out += fmt::format("  {:<8} {:>10} {:>14} {:>14} {:>14}\n", "host", plan.host_sub_groups,
                     FormatBytes(plan.host_state_bytes), FormatBytes(plan.host_staging_bytes),
                     budget(plan.host_budget_bytes,
                            plan.nvme_sub_groups > 0 || plan.nvme_buffer_bytes > 0 ? "staging only"
                                                                                   : "unlimited"));
  out += fmt::format("  {:<8} {:>10} {:>14} {:>14} {:>14}\n", "nvme", plan.nvme_sub_groups,
                     FormatBytes(plan.nvme_state_bytes), "-", "-");
  out += fmt::format("  {:<8} {:>10} {:>14} {:>14} {:>14}\n", "device", plan.device_sub_groups,
                     FormatBytes(plan.device_state_bytes), FormatBytes(plan.device_staging_bytes),
                     budget(plan.device_budget_bytes, "unlimited"));
  // Not in the budgets above: allocated at the first ReduceGradients(), then
  // kept (device: checked against device_budget there).
  out += fmt::format(
      "  gradient accumulation (ReduceGradients) adds {} of pageable host memory{}\n",
      FormatBytes(plan.accumulation_host_bytes()),
      plan.accumulation_device_bytes() > 0
          ? fmt::format(" and {} of device memory", FormatBytes(plan.accumulation_device_bytes()))
          : std::string());
  if (plan.nvme_file_bytes > 0) {
    // What the disk holds is not the state figure: two slots per sub-group.
    out += fmt::format(
        "  nvme file {} per rank on each nvme_path (two slots of each sub-group's state, in "
        "whole IO blocks)\n",
        FormatBytes(plan.nvme_file_bytes));
  }
  out += "  buffers:\n";
  for (const StagingBuffer& b : plan.buffers) {
    out += fmt::format("    {:<14} {:<6} {:>3} x {:>12} = {:>12}\n", b.name, TierName(b.tier),
                       b.count, FormatBytes(b.bytes_each), FormatBytes(b.total_bytes()));
  }
  if (plan.device_sub_groups > 0) {
    out += fmt::format("  gpu_fraction: {:.3g} of the shard's elements updated on the device{}\n",
                       plan.gpu_fraction(),
                       plan.auto_balanced ? " (auto: fewer than fit, as more would not make "
                                            "the step shorter)"
                                          : "");
  }
  const PlanRates& r = plan.rates;
  const StepEstimate& e = plan.estimate;
  if (r.cpu_adam_elems_per_sec > 0 || r.device_adam_elems_per_sec > 0 ||
      r.pcie_bytes_per_sec > 0 || r.nvme_read_bytes_per_sec > 0 ||
      r.nvme_write_bytes_per_sec > 0) {
    auto secs = [](double rate, double sec) {
      return rate > 0 ? FormatSeconds(sec) : std::string("? (rate not given)");
    };
    auto elems_rate = [](double rate) {
      return rate > 0 ? fmt::format(" at {:.3g} G elems/s", rate * 1e-9) : std::string();
    };
    auto bytes_rate = [](double rate) {
      return rate > 0 ? fmt::format(" at {}", FormatRate(rate)) : std::string();
    };
    const bool all_known = r.cpu_adam_elems_per_sec > 0 && r.pcie_bytes_per_sec > 0 &&
                           (plan.device_sub_groups == 0 || r.device_adam_elems_per_sec > 0) &&
                           (plan.nvme_sub_groups == 0 || (r.nvme_read_bytes_per_sec > 0 &&
                                                          r.nvme_write_bytes_per_sec > 0));
    out += "  per step at these rates (busy time of each; the step costs at least the largest):\n";
    out += fmt::format("    cpu adam     {:>10}  {} elems{}\n",
                       secs(r.cpu_adam_elems_per_sec, e.cpu_adam),
                       FormatCount(plan.shard_elems() - plan.device_elems),
                       elems_rate(r.cpu_adam_elems_per_sec));
    if (plan.device_sub_groups > 0) {
      out += fmt::format("    device adam  {:>10}  {} elems{}\n",
                         secs(r.device_adam_elems_per_sec, e.device_adam),
                         FormatCount(plan.device_elems), elems_rate(r.device_adam_elems_per_sec));
    }
    out += fmt::format("    pcie         {:>10}  {} down, {} up, each way{}\n",
                       secs(r.pcie_bytes_per_sec, std::max(e.d2h, e.h2d)),
                       FormatBytes(e.d2h_bytes), FormatBytes(e.h2d_bytes),
                       bytes_rate(r.pcie_bytes_per_sec));
    if (plan.nvme_sub_groups > 0) {
      out += fmt::format(
          "    nvme         {:>10}  {} read{} + {} written{} (every rank of the node)\n",
          secs(std::min(r.nvme_read_bytes_per_sec, r.nvme_write_bytes_per_sec), e.nvme),
          FormatBytes(e.nvme_read_bytes), bytes_rate(r.nvme_read_bytes_per_sec),
          FormatBytes(e.nvme_write_bytes), bytes_rate(r.nvme_write_bytes_per_sec));
    }
    if (!e.bottleneck().empty()) {
      // With a rate unknown the bound is of the known ones only: the unknown
      // may be the larger.
      out += fmt::format("    bound        {:>10}  {}{}\n", FormatSeconds(e.bound()),
                         e.bottleneck(),
                         all_known ? "" : " (at least: of the rates given; strata.rates gives "
                                          "the others)");
    }
  }
  out += "  sub-groups:";
  // Runs of consecutive sub-groups on one tier: "0-11 nvme, 12-15 host".
  for (size_t i = 0; i < plan.sub_groups.size();) {
    size_t j = i;
    while (j + 1 < plan.sub_groups.size() &&
           plan.sub_groups[j + 1].tier == plan.sub_groups[i].tier) {
      ++j;
    }
    out += fmt::format("{} {}{} {}", i == 0 ? "" : ",", i,
                       j == i ? std::string() : fmt::format("-{}", j),
                       TierName(plan.sub_groups[i].tier));
    i = j + 1;
  }
  out += "\n";
  for (const std::string& w : plan.warnings) out += "  warning: " + w + "\n";
  return out;
}

}  // namespace strata
