#include "offload/placement.h"

#include <fmt/format.h>

#include <algorithm>
#include <limits>

#include "runtime/units.h"

namespace strata {
namespace {

constexpr uint64_t kPage = 4096;
constexpr uint64_t kExtentHeaderBytes = 4096;  // StateStore::kHeaderBytes

uint64_t RoundUpPage(uint64_t bytes) { return (bytes + kPage - 1) / kPage * kPage; }

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

uint64_t NvmeBufferBytes(uint64_t state_bytes) {
  return RoundUpPage(state_bytes) + kExtentHeaderBytes;
}

Result<PlacementPlan> PlanPlacement(const PlacementInputs& in) {
  constexpr std::string_view kOp = "plan placement";
  if (in.sub_group_elems.empty()) {
    return InvalidArgumentError(fmt::format("{}: no sub-groups (the shard is empty)", kOp));
  }
  if (in.sub_group_elems.size() > std::numeric_limits<uint32_t>::max()) {
    return InvalidArgumentError(
        fmt::format("{}: {} sub-groups; at most 2^32 - 1", kOp, in.sub_group_elems.size()));
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
  // Bound every size so products below cannot overflow: 2^44 elements x 64 bytes x 1024 buffers.
  constexpr uint64_t kMaxElems = uint64_t{1} << 44;
  PlacementPlan plan;
  plan.host_budget_bytes = in.host_budget_bytes;
  plan.device_budget_bytes = in.device_budget_bytes;
  uint64_t shard_elems = 0, max_elems = 0, all_state = 0;
  for (size_t i = 0; i < in.sub_group_elems.size(); ++i) {
    const uint64_t e = in.sub_group_elems[i];
    if (e == 0 || e > kMaxElems || shard_elems + e > kMaxElems) {
      return InvalidArgumentError(fmt::format(
          "{}: sub-group {} has {} elems; each must be in [1, 2^44] and the shard at most 2^44",
          kOp, i, e));
    }
    shard_elems += e;
    max_elems = std::max(max_elems, e);
    const uint64_t sb = e * in.state_bytes_per_elem;
    plan.sub_groups.push_back({e, sb, Tier::kHost});
    all_state += sb;
  }

  const bool one_rank = in.world_size == 1;
  if (one_rank) {
    plan.buffers.push_back(
        {"grad ring", Tier::kHost, in.buffer_count, max_elems * in.grad_bytes_per_elem});
  } else {
    plan.buffers.push_back({"grad shard", Tier::kHost, 1, shard_elems * in.grad_bytes_per_elem});
  }
  plan.buffers.push_back(
      {"param", Tier::kHost, in.buffer_count, max_elems * in.param_bytes_per_elem});
  const size_t first_device = plan.buffers.size();
  if (one_rank) {
    plan.buffers.push_back({"grad stats", Tier::kDevice, 1,
                            16 * ((shard_elems + 4095) / 4096 + in.sub_group_elems.size())});
  } else {
    const uint64_t block = uint64_t{in.world_size} * max_elems;
    plan.buffers.push_back({"grad bucket", Tier::kDevice, 1, block * in.grad_bytes_per_elem});
    plan.buffers.push_back({"param bucket", Tier::kDevice, 1, block * in.param_bytes_per_elem});
  }
  for (size_t b = first_device; b < plan.buffers.size(); ++b) {
    plan.device_staging_bytes += plan.buffers[b].total_bytes();
  }
  if (in.device_budget_bytes != 0 && plan.device_staging_bytes > in.device_budget_bytes) {
    return ResourceExhaustedError(fmt::format(
        "{}: device staging needs {} but strata.device_budget is {}; raise "
        "strata.device_budget to {} or lower zero_optimization.sub_group_size",
        kOp, FormatBytes(plan.device_staging_bytes), FormatBytes(in.device_budget_bytes),
        FormatBytes(plan.device_staging_bytes)));
  }
  const uint64_t fixed_host = plan.buffers[0].total_bytes() + plan.buffers[1].total_bytes();
  const bool nvme = in.nvme == NvmeTier::kAvailable;
  const bool unlimited_host = in.host_budget_bytes == 0 && !nvme;

  if (unlimited_host || fixed_host + all_state <= in.host_budget_bytes) {
    plan.host_sub_groups = static_cast<uint32_t>(plan.sub_groups.size());
    plan.host_state_bytes = all_state;
    plan.host_staging_bytes = fixed_host;
    return plan;
  }
  if (!nvme) {
    return ResourceExhaustedError(
        fmt::format("{}: {} sub-groups need {} of pinned host memory ({} state + {} staging) but "
                    "strata.host_budget is {}; raise strata.host_budget to {}, or set "
                    "zero_optimization.offload_optimizer.device to \"nvme\" with an nvme_path",
                    kOp, plan.sub_groups.size(), FormatBytes(fixed_host + all_state),
                    FormatBytes(all_state), FormatBytes(fixed_host),
                    FormatBytes(in.host_budget_bytes), FormatBytes(fixed_host + all_state)));
  }
  plan.nvme_buffer_bytes = NvmeBufferBytes(max_elems * in.state_bytes_per_elem);
  plan.nvme_buffers = in.buffer_count;
  plan.buffers.push_back({"nvme", Tier::kHost, in.buffer_count, plan.nvme_buffer_bytes});
  const uint64_t staging = fixed_host + plan.buffers.back().total_bytes();
  plan.host_staging_bytes = staging;
  if (in.host_budget_bytes != 0 && staging > in.host_budget_bytes) {
    return ResourceExhaustedError(fmt::format(
        "{}: with all state on NVMe the pinned staging alone needs {} (grad {}, param {} x "
        "{}, nvme {} x {}) but strata.host_budget is {}; raise strata.host_budget to {}, or "
        "lower zero_optimization.sub_group_size or offload_optimizer.buffer_count{}",
        kOp, FormatBytes(staging), FormatBytes(plan.buffers[0].total_bytes()), in.buffer_count,
        FormatBytes(plan.buffers[1].bytes_each), in.buffer_count,
        FormatBytes(plan.nvme_buffer_bytes), FormatBytes(in.host_budget_bytes),
        FormatBytes(staging),
        one_rank ? "" : ", or shard over more ranks (the grad shard holds the rank's reduced "
                        "gradient)"));
  }
  // Host budget 0 with NVMe: staging only, every sub-group on NVMe.
  uint64_t room = in.host_budget_bytes == 0 ? 0 : in.host_budget_bytes - staging;
  // The last sub-groups stay in DRAM (see the header for why).
  size_t first_host = plan.sub_groups.size();
  while (first_host > 0 && plan.sub_groups[first_host - 1].state_bytes <= room) {
    room -= plan.sub_groups[first_host - 1].state_bytes;
    --first_host;
  }
  for (size_t i = 0; i < plan.sub_groups.size(); ++i) {
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
  return plan;
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
  out += fmt::format("  {:<8} {:>10} {:>14} {:>14} {:>14}\n", "device", "-", "-",
                     FormatBytes(plan.device_staging_bytes),
                     budget(plan.device_budget_bytes, "unlimited"));
  out += "  buffers:\n";
  for (const StagingBuffer& b : plan.buffers) {
    out += fmt::format("    {:<14} {:<6} {:>3} x {:>12} = {:>12}\n", b.name, TierName(b.tier),
                       b.count, FormatBytes(b.bytes_each), FormatBytes(b.total_bytes()));
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
  return out;
}

}  // namespace strata
