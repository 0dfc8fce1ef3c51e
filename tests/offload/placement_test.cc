// Placement planner: hand-computed plans, every refusal and its advice,
// determinism, and a seeded property test against a brute-force reference
// (the host-resident set is the longest suffix of sub-groups that fits).
#include "offload/placement.h"
#include "runtime/log.h"

#include <gtest/gtest.h>

#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <cmath>
#include <limits>
#include <random>

#include "runtime/machine.h"
#include "runtime/units.h"
#include "tests/offload/test_seed.h"

namespace strata {
namespace {

bool Contains(std::string_view haystack, std::string_view needle) {
  return haystack.find(needle) != std::string_view::npos;
}

PlacementInputs Small() {
  return {.sub_group_elems = {100, 100, 100, 50},
          .state_bytes_per_elem = 12,
          .grad_bytes_per_elem = 4,
          .param_bytes_per_elem = 2,
          .buffer_count = 4,
          .block_bytes = 4096};
}

// The gradient statistics and the control block, pinned on the host and
// allocated on the device alike: 16 B per piece of a tensor in a sub-group
// (here one piece each) and per started block of 4096 elements of a piece
// (at most one more block per piece than the shard has), and 4 KiB.
constexpr uint64_t StatsBytes(uint64_t shard_elems, uint64_t pieces) {
  return 16 * (2 * pieces + (shard_elems + 4095) / 4096) + 4096;
}
constexpr uint64_t kSmallStats = StatsBytes(350, 4);

// One rank: a grad ring of 4 x 100 x 4 + param 4 x 100 x 2 = 2400, and the
// statistics' mirror.
constexpr uint64_t kRing = 1600 + 800;
constexpr uint64_t kFixed = kRing + kSmallStats;
constexpr uint64_t kAllState = 350 * 12;

// Ten sub-groups of 2048 elems and one of 1024, two buffers, with NVMe:
// grad ring 2 x 2048 x 4 = 16384, param 2 x 2048 x 2 = 8192, the statistics,
// nvme 2 x (24576 + 4096).
PlacementInputs Large() {
  PlacementInputs in{.sub_group_elems = {},
                     .state_bytes_per_elem = 12,
                     .grad_bytes_per_elem = 4,
                     .param_bytes_per_elem = 2,
                     .nvme = NvmeTier::kAvailable,
                     .buffer_count = 2,
                     .block_bytes = 4096};
  in.sub_group_elems.assign(10, 2048);
  in.sub_group_elems.push_back(1024);
  return in;
}
constexpr uint64_t kLargeStaging = 16384 + 8192 + StatsBytes(10 * 2048 + 1024, 11) + 2 * 28672;

TEST(PlacementTest, EverythingFitsInHost) {
  PlacementInputs in = Small();
  in.host_budget_bytes = kFixed + kAllState;  // exactly enough
  Result<PlacementPlan> p = PlanPlacement(in);
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_EQ(p->host_sub_groups, 4u);
  EXPECT_EQ(p->nvme_sub_groups, 0u);
  EXPECT_EQ(p->host_state_bytes, kAllState);
  EXPECT_EQ(p->host_staging_bytes, kFixed);
  EXPECT_EQ(p->host_total_bytes(), in.host_budget_bytes);
  EXPECT_EQ(p->nvme_buffer_bytes, 0u);
  // grad ring, param, grad stats (host, device): no nvme buffers
  ASSERT_EQ(p->buffers.size(), 4u);
  EXPECT_EQ(p->buffers[0].name, "grad ring");
  EXPECT_EQ(p->buffers[0].count, 4u);
  EXPECT_EQ(p->buffers[0].total_bytes(), 1600u);
  EXPECT_EQ(p->buffers[1].count, 4u);
  EXPECT_EQ(p->buffers[1].bytes_each, 200u);
  EXPECT_EQ(p->buffers[2].name, "grad stats");
  EXPECT_EQ(p->buffers[2].tier, Tier::kHost);
  EXPECT_EQ(p->buffers[2].total_bytes(), kSmallStats);
  // One rank: the device holds only the statistics (16 bytes per piece,
  // 16 per started block of 4096 elements of a piece, and the control
  // block), no bucket.
  EXPECT_EQ(p->buffers[3].name, "grad stats");
  EXPECT_EQ(p->buffers[3].tier, Tier::kDevice);
  EXPECT_EQ(p->device_staging_bytes, 16u * (2 * 4 + 1) + 4096);
}

// Many tensors: a record per (tensor, sub-group) piece, on both sides. One
// piece per sub-group was planned whatever the tensors, 32 B short for each
// further piece (EnginePlan.ADeviceOfThePlansBytesHoldsTheEngine).
TEST(PlacementTest, TheStatisticsGrowWithTheTensorPieces) {
  PlacementInputs in = Small();
  in.host_budget_bytes = 1 << 20;
  in.tensor_pieces = 3000;
  Result<PlacementPlan> p = PlanPlacement(in);
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_EQ(p->buffers[2].total_bytes(), StatsBytes(350, 3000));
  EXPECT_EQ(p->device_staging_bytes, StatsBytes(350, 3000));
  // Fewer pieces than sub-groups cannot be: at least one each.
  in.tensor_pieces = 1;
  p = PlanPlacement(in);
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_EQ(p->device_staging_bytes, kSmallStats);
}

// Several ranks: the reduced shard waits on the host for the decision (in
// the wire dtype), and the device holds one grad and one param bucket of
// every rank's block of the largest sub-group.
TEST(PlacementTest, SeveralRanksStageTheShardAndTwoBuckets) {
  PlacementInputs in = Small();
  in.world_size = 2;
  Result<PlacementPlan> p = PlanPlacement(in);
  ASSERT_TRUE(p.ok()) << p.status();
  ASSERT_EQ(p->buffers.size(), 6u);
  EXPECT_EQ(p->buffers[0].name, "grad shard");
  EXPECT_EQ(p->buffers[0].total_bytes(), 350u * 4);
  EXPECT_EQ(p->buffers[2].name, "grad stats");
  EXPECT_EQ(p->buffers[3].name, "grad stats");  // on the device: every rank count has them
  EXPECT_EQ(p->buffers[4].name, "grad bucket");
  EXPECT_EQ(p->buffers[4].total_bytes(), 2u * 100 * 4);
  EXPECT_EQ(p->buffers[5].name, "param bucket");
  EXPECT_EQ(p->buffers[5].total_bytes(), 2u * 100 * 2);
  EXPECT_EQ(p->host_staging_bytes, 1400u + 800 + kSmallStats);
  EXPECT_EQ(p->device_staging_bytes, kSmallStats + 800u + 400);
}

TEST(PlacementTest, ZeroHostBudgetWithoutNvmeIsUnlimited) {
  Result<PlacementPlan> p = PlanPlacement(Small());
  ASSERT_TRUE(p.ok());
  EXPECT_EQ(p->host_sub_groups, 4u);
  EXPECT_TRUE(Contains(FormatPlan(*p), "unlimited"));
}

TEST(PlacementTest, RefusesWithoutNvmeAndSaysWhatToRaise) {
  PlacementInputs in = Small();
  in.host_budget_bytes = kFixed + kAllState - 1;
  Result<PlacementPlan> p = PlanPlacement(in);
  ASSERT_EQ(p.status().code(), StatusCode::kResourceExhausted);
  const std::string_view m = p.status().message();
  EXPECT_TRUE(Contains(m, "need " + FormatBytes(kFixed + kAllState))) << m;
  EXPECT_TRUE(Contains(m, "strata.host_budget is " + FormatBytes(kFixed + kAllState - 1))) << m;
  EXPECT_TRUE(Contains(m, "raise strata.host_budget to " + FormatBytes(kFixed + kAllState))) << m;
  EXPECT_TRUE(Contains(m, "nvme_path")) << m;
}

TEST(PlacementTest, LastSubGroupsStayInHostTheRestGoToNvme) {
  PlacementInputs in = Large();
  // Room for the last two (12288 + 24576) but not a third.
  in.host_budget_bytes = kLargeStaging + 12288 + 24576 + 24575;
  Result<PlacementPlan> p = PlanPlacement(in);
  ASSERT_TRUE(p.ok()) << p.status();
  for (size_t i = 0; i < 9; ++i) EXPECT_EQ(p->sub_groups[i].tier, Tier::kNvme) << i;
  EXPECT_EQ(p->sub_groups[9].tier, Tier::kHost);
  EXPECT_EQ(p->sub_groups[10].tier, Tier::kHost);
  EXPECT_EQ(p->host_sub_groups, 2u);
  EXPECT_EQ(p->nvme_sub_groups, 9u);
  EXPECT_EQ(p->host_state_bytes, 36864u);
  EXPECT_EQ(p->nvme_state_bytes, 9u * 24576);
  EXPECT_EQ(p->nvme_buffer_bytes, 28672u);
  EXPECT_EQ(p->host_staging_bytes, kLargeStaging);
  EXPECT_LE(p->host_total_bytes(), in.host_budget_bytes);
  const std::string text = FormatPlan(*p);
  EXPECT_TRUE(Contains(text, "sub-groups: 0-8 nvme, 9-10 host")) << text;
  EXPECT_TRUE(Contains(text, "nvme")) << text;
}

TEST(PlacementTest, ZeroHostBudgetWithNvmeMeansStagingOnly) {
  PlacementInputs in = Small();
  in.nvme = NvmeTier::kAvailable;
  Result<PlacementPlan> p = PlanPlacement(in);
  ASSERT_TRUE(p.ok());
  EXPECT_EQ(p->nvme_sub_groups, 4u);
  EXPECT_EQ(p->host_state_bytes, 0u);
  EXPECT_TRUE(Contains(FormatPlan(*p), "sub-groups: 0-3 nvme"));
}

TEST(PlacementTest, RefusesWhenStagingAloneDoesNotFit) {
  PlacementInputs in = Large();
  in.host_budget_bytes = kLargeStaging - 1;
  Result<PlacementPlan> p = PlanPlacement(in);
  ASSERT_EQ(p.status().code(), StatusCode::kResourceExhausted);
  const std::string_view m = p.status().message();
  EXPECT_TRUE(Contains(m, "staging alone needs " + FormatBytes(kLargeStaging))) << m;
  EXPECT_TRUE(Contains(m, "sub_group_size")) << m;
  EXPECT_TRUE(Contains(m, "buffer_count")) << m;
}

TEST(PlacementTest, RefusesWhenDeviceStagingExceedsDeviceBudget) {
  PlacementInputs in = Small();
  in.world_size = 2;
  // needs the statistics and 2 x 100 x 4 + 2 x 100 x 2 = 1200
  in.device_budget_bytes = kSmallStats + 1199;
  Result<PlacementPlan> p = PlanPlacement(in);
  ASSERT_EQ(p.status().code(), StatusCode::kResourceExhausted);
  EXPECT_TRUE(Contains(p.status().message(), "strata.device_budget")) << p.status();
  EXPECT_TRUE(Contains(p.status().message(), "needs " + FormatBytes(kSmallStats + 1200)))
      << p.status();
  in.device_budget_bytes = kSmallStats + 1200;
  EXPECT_TRUE(PlanPlacement(in).ok());
}

TEST(PlacementTest, MalformedInputs) {
  auto code = [](PlacementInputs in) { return PlanPlacement(in).status().code(); };
  PlacementInputs in = Small();
  in.sub_group_elems = {};
  EXPECT_EQ(code(in), StatusCode::kInvalidArgument);
  in = Small();
  in.sub_group_elems[1] = 0;
  EXPECT_EQ(code(in), StatusCode::kInvalidArgument);
  in = Small();
  in.state_bytes_per_elem = 0;
  EXPECT_EQ(code(in), StatusCode::kInvalidArgument);
  in = Small();
  in.buffer_count = 0;
  EXPECT_EQ(code(in), StatusCode::kInvalidArgument);
  in = Small();
  in.block_bytes = 1000;
  EXPECT_EQ(code(in), StatusCode::kInvalidArgument);
  // Sizes whose byte counts could overflow 64 bits are refused, not wrapped.
  in = Small();
  in.buffer_count = 1025;
  EXPECT_EQ(code(in), StatusCode::kInvalidArgument);
  in = Small();
  in.sub_group_elems = {uint64_t{1} << 43, uint64_t{1} << 43, 1};
  EXPECT_EQ(code(in), StatusCode::kInvalidArgument);
  in = Small();
  in.state_bytes_per_elem = 65;
  EXPECT_EQ(code(in), StatusCode::kInvalidArgument);
}

// ---- Partial offload: the first sub-groups on the device -------------------

TEST(PlacementTest, GpuFractionKeepsTheClosestCountOfFirstSubGroupsOnTheDevice) {
  PlacementInputs in = Small();  // 100, 100, 100, 50 elems
  in.gpu_fraction = 0.3;         // 105 elems: one sub-group (100) is closest
  Result<PlacementPlan> p = PlanPlacement(in);
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_EQ(p->device_sub_groups, 1u);
  EXPECT_EQ(p->sub_groups[0].tier, Tier::kDevice);
  EXPECT_EQ(p->sub_groups[1].tier, Tier::kHost);
  EXPECT_EQ(p->device_state_bytes, 100u * 12);
  EXPECT_EQ(p->device_elems, 100u);
  EXPECT_EQ(p->host_sub_groups, 3u);
  EXPECT_EQ(p->host_state_bytes, 250u * 12);
  EXPECT_NEAR(p->gpu_fraction(), 100.0 / 350, 1e-12);
  // The host staging serves the host sub-groups only (still 100 elems), one
  // slot each at most: 3 of the 4 buffers (the fourth would never be used).
  EXPECT_EQ(p->host_staging_bytes, kRing / 4 * 3 + kSmallStats);
  const std::string text = FormatPlan(*p);
  EXPECT_TRUE(Contains(text, "0 device, 1-3 host")) << text;
  EXPECT_TRUE(Contains(text, "gpu_fraction: 0.286")) << text;

  in.gpu_fraction = 0.8;  // 280 elems: three (300) are closest
  EXPECT_EQ(PlanPlacement(in)->device_sub_groups, 3u);
  in.gpu_fraction = 0.0;
  EXPECT_EQ(PlanPlacement(in)->device_sub_groups, 0u);
  in.gpu_fraction = 1.0;
  p = PlanPlacement(in);
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_EQ(p->device_sub_groups, 4u);
  EXPECT_EQ(p->host_sub_groups, 0u);
  EXPECT_EQ(p->host_state_bytes, 0u);
  // Nothing left for the host: no gradient or param staging, only the
  // statistics' mirror.
  EXPECT_EQ(p->host_staging_bytes, kSmallStats);
}

TEST(PlacementTest, GpuFractionWithNvmePlacesTheRestAsBefore) {
  PlacementInputs in = Large();  // ten of 2048, one of 1024
  in.gpu_fraction = 0.2;         // 4301 elems: two sub-groups (4096)
  in.host_budget_bytes = 0;      // staging only: the rest on NVMe
  Result<PlacementPlan> p = PlanPlacement(in);
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_EQ(p->device_sub_groups, 2u);
  EXPECT_EQ(p->nvme_sub_groups, 9u);
  EXPECT_EQ(p->host_sub_groups, 0u);
  EXPECT_EQ(p->sub_groups[1].tier, Tier::kDevice);
  EXPECT_EQ(p->sub_groups[2].tier, Tier::kNvme);
  EXPECT_EQ(p->nvme_state_bytes, (8 * 2048 + 1024) * 12u);
}

TEST(PlacementTest, GpuFractionAutoTakesWhatFitsTheDeviceBudget) {
  PlacementInputs in = Small();
  in.world_size = 2;  // buckets 2 x 100 x (4 + 2) = 1200; device grads 4 bytes per elem
  in.gpu_fraction = kGpuFractionAuto;
  in.device_budget_bytes = kSmallStats + 1200 + 2 * 100 * 16;  // two sub-groups' state, grads
  Result<PlacementPlan> p = PlanPlacement(in);
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_EQ(p->device_sub_groups, 2u);
  EXPECT_EQ(p->device_total_bytes(), in.device_budget_bytes);
  EXPECT_LE(p->device_total_bytes(), in.device_budget_bytes);
  in.device_budget_bytes -= 1;
  EXPECT_EQ(PlanPlacement(in)->device_sub_groups, 1u);
  in.device_budget_bytes = kSmallStats + 1200;  // the staging only: nothing on the device
  EXPECT_EQ(PlanPlacement(in)->device_sub_groups, 0u);
  // "auto" needs a budget to fill.
  in.device_budget_bytes = 0;
  p = PlanPlacement(in);
  EXPECT_EQ(p.status().code(), StatusCode::kInvalidArgument);
  EXPECT_TRUE(Contains(p.status().message(), "strata.device_budget")) << p.status();
}

TEST(PlacementTest, GpuFractionBeyondTheDeviceBudgetSaysWhatFits) {
  PlacementInputs in = Small();
  in.gpu_fraction = 1.0;
  in.device_budget_bytes = kSmallStats + 250 * 12;  // statistics + 250 elems of state
  Result<PlacementPlan> p = PlanPlacement(in);
  ASSERT_EQ(p.status().code(), StatusCode::kResourceExhausted) << p.status();
  EXPECT_TRUE(Contains(p.status().message(), "lower gpu_fraction to 0.571 (2 sub-groups)"))
      << p.status();
  EXPECT_TRUE(Contains(p.status().message(), "strata.device_budget")) << p.status();
  in.gpu_fraction = 1.5;
  EXPECT_EQ(PlanPlacement(in).status().code(), StatusCode::kInvalidArgument);
}

TEST(PlacementTest, RandomInputsMatchBruteForceAndAreDeterministic) {
  const uint64_t seed = testing::TestSeed();
  std::mt19937_64 rng(seed);
  for (int iter = 0; iter < 500; ++iter) {
    SCOPED_TRACE(::testing::Message() << "seed " << seed << " iter " << iter);
    PlacementInputs in;
    const uint64_t sub = 1 + rng() % 5000;
    const size_t n = 1 + rng() % 20;
    for (size_t i = 0; i < n; ++i) in.sub_group_elems.push_back(sub);
    in.sub_group_elems.back() = 1 + rng() % sub;
    const uint32_t state_choices[] = {8, 12};
    in.state_bytes_per_elem = state_choices[rng() % 2];
    in.buffer_count = 1 + static_cast<uint32_t>(rng() % 6);
    in.nvme = rng() % 2 ? NvmeTier::kAvailable : NvmeTier::kUnavailable;
    in.host_budget_bytes = rng() % 4 == 0 ? 0 : rng() % (n * sub * 20 + 200000);

    Result<PlacementPlan> p = PlanPlacement(in);
    Result<PlacementPlan> again = PlanPlacement(in);
    ASSERT_EQ(p.ok(), again.ok());
    if (!p.ok()) {
      ASSERT_EQ(p.status().code(), StatusCode::kResourceExhausted) << p.status();
      ASSERT_EQ(p.status(), again.status());
      continue;
    }
    ASSERT_EQ(FormatPlan(*p), FormatPlan(*again));
    // Reference: the fixed staging, then the longest suffix that fits.
    uint64_t shard = 0, max_elems = 0;
    for (uint64_t e : in.sub_group_elems) shard += e, max_elems = std::max(max_elems, e);
    // One rank: a ring of buffer_count gradient slots and as many param
    // slots, at most one per sub-group.
    const uint64_t slots = std::min<uint64_t>(in.buffer_count, n);
    const uint64_t fixed = slots * max_elems * in.grad_bytes_per_elem + slots * max_elems * 2 +
                           StatsBytes(shard, n);
    uint64_t all_state = shard * in.state_bytes_per_elem;
    const bool unlimited = in.host_budget_bytes == 0 && in.nvme == NvmeTier::kUnavailable;
    size_t want_host = 0;
    if (unlimited || fixed + all_state <= in.host_budget_bytes) {
      want_host = n;
    } else {
      ASSERT_EQ(in.nvme, NvmeTier::kAvailable);
      const uint64_t nvme_buf = ((max_elems * in.state_bytes_per_elem + 4095) / 4096 + 1) * 4096;
      const uint64_t staging = fixed + slots * nvme_buf;
      uint64_t room = in.host_budget_bytes == 0 ? 0 : in.host_budget_bytes - staging;
      for (size_t k = n; k > 0; --k) {
        const uint64_t b = in.sub_group_elems[k - 1] * in.state_bytes_per_elem;
        if (b > room) break;
        room -= b;
        ++want_host;
      }
      // No more extent buffers than NVMe sub-groups (at least one here: had
      // every sub-group fit with the NVMe staging, all would fit without it).
      const uint64_t nvme_buffers = std::min<uint64_t>(slots, n - want_host);
      ASSERT_GT(nvme_buffers, 0u);
      ASSERT_EQ(p->host_staging_bytes, fixed + nvme_buffers * nvme_buf);
      ASSERT_EQ(p->nvme_buffers, nvme_buffers);
      if (in.host_budget_bytes > 0) {
        ASSERT_LE(p->host_total_bytes(), in.host_budget_bytes);
      }
    }
    ASSERT_EQ(p->host_sub_groups, want_host);
    ASSERT_EQ(p->nvme_sub_groups, n - want_host);
    for (size_t i = 0; i < n; ++i) {
      ASSERT_EQ(p->sub_groups[i].tier, i + want_host >= n ? Tier::kHost : Tier::kNvme) << i;
    }
    ASSERT_EQ(p->host_state_bytes + p->nvme_state_bytes, all_state);
  }
}

// ---- Rates: the per-step estimate and "auto" balancing ---------------------

TEST(PlacementTest, EstimateCountsEachResourceAtTheGivenRates) {
  PlacementInputs in = Small();
  in.sub_group_elems = {1000, 1000, 1000, 500};  // 4 B grads, 2 B params, 12 B state
  in.buffer_count = 1;
  in.nvme = NvmeTier::kAvailable;
  // Staging (grad 4000 + param 2000 + statistics + one 16 KiB NVMe buffer), then the last
  // sub-group.
  in.host_budget_bytes = 6000 + StatsBytes(3500, 4) + 16384 + 500 * 12;
  in.rates = {.cpu_adam_elems_per_sec = 100,
              .pcie_bytes_per_sec = 1000,
              .nvme_read_bytes_per_sec = 3600,
              .nvme_write_bytes_per_sec = 1800};
  Result<PlacementPlan> p = PlanPlacement(in);
  ASSERT_TRUE(p.ok()) << p.status();
  ASSERT_EQ(p->nvme_sub_groups, 3u);
  const StepEstimate& e = p->estimate;
  EXPECT_EQ(e.d2h_bytes, 3500u * 4);
  EXPECT_EQ(e.h2d_bytes, 3500u * 2);
  EXPECT_EQ(e.nvme_read_bytes, 2000u * 12);  // one extent is still in the one buffer
  EXPECT_EQ(e.nvme_write_bytes, 3000u * 12);
  EXPECT_DOUBLE_EQ(e.cpu_adam, 35.0);
  EXPECT_DOUBLE_EQ(e.d2h, 14.0);
  EXPECT_DOUBLE_EQ(e.h2d, 7.0);
  EXPECT_DOUBLE_EQ(e.nvme, 24000.0 / 3600 + 20.0);  // read at 3600 B/s, written at 1800 B/s
  EXPECT_EQ(e.device_adam, 0.0);
  EXPECT_DOUBLE_EQ(e.bound(), 35.0);
  EXPECT_EQ(e.bottleneck(), "cpu adam");
  EXPECT_TRUE(Contains(FormatPlan(*p), "bound")) << FormatPlan(*p);
  // Two ranks on the node share the drive.
  in.machine.ranks_per_node = 2;
  p = PlanPlacement(in);
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_DOUBLE_EQ(p->estimate.nvme, 2 * (24000.0 / 3600 + 20.0));
  EXPECT_EQ(p->estimate.bottleneck(), "nvme");
  EXPECT_FALSE(Contains(FormatPlan(*p), "(at least: of the rates given")) << FormatPlan(*p);
  // With a rate unknown the bound is of the known ones: said so, and no
  // "0 G elems/s" for the unknown.
  in.rates.cpu_adam_elems_per_sec = 0;
  p = PlanPlacement(in);
  EXPECT_TRUE(Contains(FormatPlan(*p), "nvme (at least: of the rates given")) << FormatPlan(*p);
  EXPECT_FALSE(Contains(FormatPlan(*p), "0 G elems/s")) << FormatPlan(*p);
  // Unknown rates cost nothing, and the plan prints no estimate.
  in.rates = {};
  p = PlanPlacement(in);
  EXPECT_EQ(p->estimate.bound(), 0.0);
  EXPECT_EQ(p->estimate.bottleneck(), "");
  EXPECT_FALSE(Contains(FormatPlan(*p), "per step")) << FormatPlan(*p);
  // A bad rate is named.
  in.rates.nvme_write_bytes_per_sec = -1;
  p = PlanPlacement(in);
  EXPECT_EQ(p.status().code(), StatusCode::kInvalidArgument);
  EXPECT_TRUE(Contains(p.status().message(), "strata.rates.nvme_write")) << p.status();
}

TEST(PlacementTest, GpuFractionAutoWithRatesLetsBothSidesFinishTogether) {
  PlacementInputs in;
  in.sub_group_elems.assign(10, 1000);
  in.gpu_fraction = kGpuFractionAuto;
  in.device_budget_bytes = uint64_t{1} << 40;  // everything fits
  in.rates = {.cpu_adam_elems_per_sec = 1000, .device_adam_elems_per_sec = 3000};
  Result<PlacementPlan> p = PlanPlacement(in);
  ASSERT_TRUE(p.ok()) << p.status();
  // 8 on the device: 8/3 s against 2 s on the CPU; 7 would leave the CPU 3 s.
  EXPECT_EQ(p->device_sub_groups, 8u);
  EXPECT_TRUE(p->auto_balanced);
  EXPECT_TRUE(Contains(FormatPlan(*p), "auto: fewer than fit")) << FormatPlan(*p);
  // The budget still caps it.
  in.device_budget_bytes = StatsBytes(10000, 10) + 5 * 12000;  // stats + 5
  p = PlanPlacement(in);
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_EQ(p->device_sub_groups, 5u);
  EXPECT_FALSE(p->auto_balanced);
  // A CPU side bound by PCIe: the device takes more.
  in.device_budget_bytes = uint64_t{1} << 40;
  in.rates.pcie_bytes_per_sec = 1000;  // 2 B down per elem: 2 s per 1000 elems
  EXPECT_EQ(PlanPlacement(in)->device_sub_groups, 9u);  // 3 s vs 2 s; 8: 2.67 vs 4 s
}

// Against every count that fits: the chosen one reaches the least step, and
// no fewer sub-groups do.
TEST(PlacementTest, GpuFractionAutoBalanceMatchesBruteForce) {
  const uint64_t seed = testing::TestSeed();
  std::mt19937_64 rng(seed);
  int compared = 0, between = 0;  // plans checked; of those, 0 < k < n
  for (int iter = 0; iter < 1000; ++iter) {
    SCOPED_TRACE(::testing::Message() << "seed " << seed << " iter " << iter);
    PlacementInputs in;
    const size_t n = 1 + rng() % 12;
    for (size_t i = 0; i < n; ++i) in.sub_group_elems.push_back(1 + rng() % 5000);
    in.world_size = 1 + static_cast<uint32_t>(rng() % 3);
    in.buffer_count = 1 + static_cast<uint32_t>(rng() % 4);
    in.nvme = rng() % 2 ? NvmeTier::kAvailable : NvmeTier::kUnavailable;
    in.host_budget_bytes = in.nvme == NvmeTier::kAvailable ? rng() % 400000 : 0;
    in.device_budget_bytes = 200000 + rng() % 800000;
    in.rates = {.cpu_adam_elems_per_sec = 100.0 + static_cast<double>(rng() % 10000),
                .device_adam_elems_per_sec = 100.0 + static_cast<double>(rng() % 10000),
                .pcie_bytes_per_sec = rng() % 2 ? 0.0 : 100.0 + static_cast<double>(rng() % 50000),
                .nvme_read_bytes_per_sec = 100.0 + static_cast<double>(rng() % 100000),
                .nvme_write_bytes_per_sec = 100.0 + static_cast<double>(rng() % 100000)};
    in.gpu_fraction = kGpuFractionAuto;
    Result<PlacementPlan> p = PlanPlacement(in);
    // Reference: each count c as a fixed fraction (exactly its elements).
    uint64_t shard = 0;
    for (uint64_t e : in.sub_group_elems) shard += e;
    double least = std::numeric_limits<double>::infinity();
    size_t best = 0;
    uint64_t elems = 0;
    for (size_t c = 0; c <= n; ++c) {
      if (c > 0) elems += in.sub_group_elems[c - 1];
      PlacementInputs fixed = in;
      fixed.gpu_fraction = static_cast<double>(elems) / static_cast<double>(shard);
      Result<PlacementPlan> q = PlanPlacement(fixed);
      if (!q.ok() && q.status().code() == StatusCode::kResourceExhausted &&
          Contains(q.status().message(), "strata.device_budget")) {
        break;  // c and more do not fit the device
      }
      if (!q.ok() || q->device_sub_groups != c) continue;
      const double step = q->estimate.bound();
      if (step < least) least = step, best = c;
    }
    if (!p.ok()) {
      ASSERT_TRUE(std::isinf(least)) << p.status();
      continue;
    }
    ASSERT_FALSE(std::isinf(least));
    EXPECT_EQ(p->estimate.bound(), least);
    EXPECT_EQ(p->device_sub_groups, best);
    ++compared;
    between += best > 0 && best < n;
  }
  // The draw reaches the interesting cases, not only refusals and extremes.
  EXPECT_GT(compared, 300) << between;
  EXPECT_GT(between, 100) << compared;
}

// ---- Preflight: the plan against the machine ------------------------------

// Ranks of one machine share its cores; a rank bound to cores of its own
// keeps them.
TEST(PlacementTest, DefaultCpuThreadsShareTheMachineAmongItsRanks) {
  EXPECT_EQ(DefaultCpuThreads(64, 64, 1), 64);
  EXPECT_EQ(DefaultCpuThreads(64, 64, 8), 8);
  EXPECT_EQ(DefaultCpuThreads(2, 2, 4), 1);     // at least one each
  EXPECT_EQ(DefaultCpuThreads(8, 64, 8), 8);    // bound by the launcher: its own 8
  EXPECT_EQ(DefaultCpuThreads(32, 64, 8), 4);   // a container's cpuset shared by 8 ranks
  EXPECT_EQ(DefaultCpuThreads(0, 0, 1), 1);
}

TEST(PreflightTest, NothingCheckedByDefault) {
  PlacementInputs in = Small();
  in.host_budget_bytes = 0;  // unlimited, no NVMe
  Result<PlacementPlan> p = PlanPlacement(in);
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_TRUE(p->warnings.empty());
}

TEST(PreflightTest, StateLargerThanMemoryWithoutNvmeNamesTheNumbersAndTheKnob) {
  PlacementInputs in = Small();  // unlimited host: all 4200 B of state + 6640 staging pinned
  in.machine = {.host_available_bytes = 10000, .host_total_bytes = 16384};
  Result<PlacementPlan> p = PlanPlacement(in);
  ASSERT_EQ(p.status().code(), StatusCode::kResourceExhausted);
  const std::string m(p.status().message());
  EXPECT_TRUE(Contains(m,
                       "the plan pins 10.59 KiB of host memory (4.10 KiB state + 6.48 KiB "
                       "staging) but this machine has 9.77 KiB available (16.00 KiB total)"))
      << m;
  EXPECT_TRUE(Contains(m, "offload_optimizer.device to \"nvme\" with an nvme_path and "
                          "strata.host_budget to at most 9.77 KiB"))
      << m;
  in.machine.host_available_bytes = kFixed + kAllState;  // exactly enough
  EXPECT_TRUE(PlanPlacement(in).ok());
}

TEST(PreflightTest, WithNvmeTheKnobIsTheHostBudget) {
  PlacementInputs in = Large();
  in.host_budget_bytes = kLargeStaging + 5 * 24576;  // five sub-groups in DRAM
  in.machine = {.host_available_bytes = kLargeStaging + 2 * 24576, .host_total_bytes = kGiB};
  Result<PlacementPlan> p = PlanPlacement(in);
  ASSERT_EQ(p.status().code(), StatusCode::kResourceExhausted);
  EXPECT_TRUE(Contains(p.status().message(), "set strata.host_budget to at most"))
      << p.status();
  // Lowering the budget as told makes it fit.
  in.host_budget_bytes = in.machine.host_available_bytes;
  Result<PlacementPlan> fits = PlanPlacement(in);
  ASSERT_TRUE(fits.ok()) << fits.status();
  EXPECT_EQ(fits->host_sub_groups, 2u);
}

TEST(PreflightTest, StagingLargerThanMemoryPointsAtSubGroupsAndWithRanksAtTheShard) {
  PlacementInputs in = Large();
  in.host_budget_bytes = 0;  // staging only
  in.machine = {.host_available_bytes = kLargeStaging - 1, .host_total_bytes = kGiB};
  Result<PlacementPlan> p = PlanPlacement(in);
  ASSERT_EQ(p.status().code(), StatusCode::kResourceExhausted);
  std::string m(p.status().message());
  EXPECT_TRUE(Contains(m, "the pinned staging alone needs")) << m;
  EXPECT_TRUE(Contains(m, "(grad ring: ")) << m;
  EXPECT_TRUE(Contains(m, "sub_group_size")) << m;
  EXPECT_FALSE(Contains(m, "shard over more ranks")) << m;  // one rank holds no shard buffer
  // Two ranks: the reduced shard is the big buffer, more ranks shrink it.
  in.world_size = 2;
  in.machine.host_available_bytes = 1;
  p = PlanPlacement(in);
  ASSERT_EQ(p.status().code(), StatusCode::kResourceExhausted);
  m = std::string(p.status().message());
  EXPECT_TRUE(Contains(m, "(grad shard: ")) << m;
  EXPECT_TRUE(Contains(m, "shard over more ranks")) << m;
  // Sub-groups sized by "auto": the knob left is buffer_count.
  in.world_size = 1;
  in.auto_sub_groups = true;
  p = PlanPlacement(in);
  ASSERT_EQ(p.status().code(), StatusCode::kResourceExhausted);
  m = std::string(p.status().message());
  EXPECT_TRUE(Contains(m, "lower offload_optimizer.buffer_count (sub_group_size \"auto\" already"))
      << m;
  EXPECT_FALSE(Contains(m, "lower zero_optimization.sub_group_size")) << m;
}

TEST(PreflightTest, RanksOnOneNodeShareItsMemory) {
  PlacementInputs in = Small();
  in.machine = {.host_available_bytes = 4 * (kFixed + kAllState), .ranks_per_node = 4};
  EXPECT_TRUE(PlanPlacement(in).ok());
  in.machine.ranks_per_node = 5;
  Result<PlacementPlan> p = PlanPlacement(in);
  ASSERT_EQ(p.status().code(), StatusCode::kResourceExhausted);
  EXPECT_TRUE(Contains(p.status().message(), "shared by 5 ranks")) << p.status();
}

TEST(PreflightTest, MoreThanUlimitLIsAWarningNotARefusal) {
  PlacementInputs in = Small();
  in.machine = {.host_available_bytes = kGiB, .memlock_bytes = 4096};
  Result<PlacementPlan> p = PlanPlacement(in);
  ASSERT_TRUE(p.ok()) << p.status();
  ASSERT_EQ(p->warnings.size(), 1u);
  EXPECT_TRUE(Contains(p->warnings[0], "`ulimit -l` is 4.00 KiB")) << p->warnings[0];
  EXPECT_TRUE(Contains(FormatPlan(*p), "warning: the plan pins")) << FormatPlan(*p);
  in.machine.memlock_bytes = kUnlimitedBytes;
  EXPECT_TRUE(PlanPlacement(in)->warnings.empty());
}

// Large(), all on NVMe: 11 extents of 28672 B (24576 payload + 4 KiB header)
// in 4 KiB blocks, two slots each, plus a 4 KiB superblock per file.
// A plan that fits with less than a tenth of the memory left is run, with a
// warning: the trainer and the engine's pageable memory live in the rest.
TEST(PreflightTest, APlanThatLeavesLittleMemoryIsWarnedAbout) {
  PlacementInputs in = Large();
  in.machine = {.host_available_bytes = uint64_t{1} << 50};
  Result<PlacementPlan> p = PlanPlacement(in);
  ASSERT_TRUE(p.ok()) << p.status();
  const uint64_t pinned = p->host_total_bytes();
  ASSERT_GT(pinned, 0u);
  EXPECT_TRUE(p->warnings.empty());
  in.machine.host_available_bytes = pinned + pinned / 20;  // 95 % pinned
  p = PlanPlacement(in);
  ASSERT_TRUE(p.ok()) << p.status();
  ASSERT_EQ(p->warnings.size(), 1u);
  EXPECT_TRUE(Contains(p->warnings[0], "little is left for the trainer")) << p->warnings[0];
  in.machine.host_available_bytes = 2 * pinned;
  EXPECT_TRUE(PlanPlacement(in)->warnings.empty());
}

// A plan that fits, but not with the accumulation sums its own plan line
// counts: warned before a ReduceGradients finds out. A host_budget larger
// than the machine bounds nothing: warned too.
TEST(PreflightTest, AccumulationBeyondTheMemoryAndABudgetBeyondTheMachineAreWarnedAbout) {
  PlacementInputs in = Large();
  in.host_budget_bytes = 0;  // staging only
  in.machine = {.host_available_bytes = uint64_t{1} << 50, .host_total_bytes = uint64_t{1} << 50};
  Result<PlacementPlan> p = PlanPlacement(in);
  ASSERT_TRUE(p.ok()) << p.status();
  const uint64_t pinned = p->host_total_bytes();
  const uint64_t accum = p->accumulation_host_bytes();
  ASSERT_GT(accum, pinned / 4);
  EXPECT_TRUE(p->warnings.empty());
  in.machine.host_available_bytes = pinned + accum / 2;  // more than 1.1 x pinned
  ASSERT_LT(pinned * 10, in.machine.host_available_bytes * 9);
  p = PlanPlacement(in);
  ASSERT_TRUE(p.ok()) << p.status();
  ASSERT_EQ(p->warnings.size(), 1u);
  EXPECT_TRUE(Contains(p->warnings[0], "with gradient accumulation (ReduceGradients)"))
      << p->warnings[0];
  EXPECT_TRUE(Contains(p->warnings[0], FormatBytes(pinned + accum))) << p->warnings[0];
  in.machine.host_available_bytes = pinned + accum;
  EXPECT_TRUE(PlanPlacement(in)->warnings.empty());

  in.machine = {.host_available_bytes = uint64_t{1} << 50, .host_total_bytes = 1 << 20};
  in.host_budget_bytes = (1 << 20) + 1;
  p = PlanPlacement(in);
  ASSERT_TRUE(p.ok()) << p.status();
  ASSERT_EQ(p->warnings.size(), 1u);
  EXPECT_TRUE(Contains(p->warnings[0], "exceeds this machine's 1.00 MiB of memory"))
      << p->warnings[0];
  in.host_budget_bytes = 1 << 20;
  EXPECT_TRUE(PlanPlacement(in)->warnings.empty());
}

TEST(PreflightTest, DiskSpaceIsCheckedPerFilesystem) {
  PlacementInputs in = Large();
  in.host_budget_bytes = 0;
  constexpr uint64_t kOnePath = 4096 + 2 * 11 * 28672;
  in.machine = {.nvme = {{.path = "/a", .device_id = 1, .free_bytes = kOnePath}}};
  Result<PlacementPlan> p = PlanPlacement(in);
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_EQ(p->nvme_file_bytes, kOnePath);
  // The plan shows the disk's figure (twice the state), not only the state.
  EXPECT_TRUE(Contains(FormatPlan(*p), "nvme file 620.00 KiB per rank on each nvme_path"))
      << FormatPlan(*p);
  in.machine.nvme[0].free_bytes = kOnePath - 1;
  p = PlanPlacement(in);
  ASSERT_EQ(p.status().code(), StatusCode::kResourceExhausted);
  EXPECT_TRUE(Contains(p.status().message(), "on the filesystem of /a but it has")) << p.status();
  EXPECT_TRUE(Contains(p.status().message(), "add an nvme_path on another drive"));
  // This rank's old state file there is given back when the store is made.
  in.machine.nvme[0].reclaimable_bytes = 1;
  EXPECT_TRUE(PlanPlacement(in).ok());
  // Two ranks of this machine write a file each: twice the space if they
  // share the filesystem (they both said "fits", then failed with ENOSPC in
  // the first step), fine if each has a drive of its own. A rank cannot tell,
  // so it is a warning (the store reserves its file's blocks at Create).
  in.machine.nvme[0].reclaimable_bytes = 0;
  in.machine.nvme[0].free_bytes = 2 * kOnePath - 1;
  in.machine.ranks_per_node = 2;
  p = PlanPlacement(in);
  ASSERT_TRUE(p.ok()) << p.status();
  ASSERT_EQ(p->warnings.size(), 1u);
  EXPECT_TRUE(Contains(p->warnings[0], "the NVMe state of this machine's 2 ranks needs"))
      << p->warnings[0];
  in.machine.nvme[0].free_bytes = 2 * kOnePath;
  EXPECT_TRUE(PlanPlacement(in)->warnings.empty());
  in.machine.ranks_per_node = 1;
  in.machine.nvme[0].free_bytes = kOnePath - 1;

  // Two paths: each file holds half of every slot (7 of 4 KiB chunks: 4 and 3).
  constexpr uint64_t kHalf = 4096 + 2 * 11 * 4 * 4096;
  in.machine.nvme = {{.path = "/a", .device_id = 1, .free_bytes = kHalf},
                     {.path = "/b", .device_id = 2, .free_bytes = kHalf}};
  p = PlanPlacement(in);
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_EQ(p->nvme_file_bytes, kHalf);
  // Both on one filesystem: they share its free space.
  in.machine.nvme[1].device_id = 1;
  p = PlanPlacement(in);
  ASSERT_EQ(p.status().code(), StatusCode::kResourceExhausted);
  EXPECT_TRUE(Contains(p.status().message(), "of /a, /b")) << p.status();
}

// An nvme_path that is a file: a plan with state on NVMe is refused (it once
// said "fits this machine"), and so is one of device "nvme" that keeps it
// all in DRAM (the engine makes and locks nvme_path either way); device
// "cpu" (the tier unavailable) is not.
TEST(PreflightTest, AnNvmePathThatIsNotADirectoryIsRefused) {
  PlacementInputs in = Large();
  in.host_budget_bytes = 0;  // all on NVMe
  in.machine = {.nvme = {{.path = "/etc/passwd",
                          .device_id = 1,
                          .free_bytes = kGiB,
                          .reclaimable_bytes = 0,
                          .not_a_directory = FailedPreconditionError(
                              "/etc/passwd: exists and is not a directory (a file)")}}};
  Result<PlacementPlan> p = PlanPlacement(in);
  ASSERT_EQ(p.status().code(), StatusCode::kFailedPrecondition) << p.status();
  EXPECT_TRUE(Contains(p.status().message(),
                       "nvme_path /etc/passwd: exists and is not a directory (a file); give a "
                       "directory"))
      << p.status();
  in.host_budget_bytes = uint64_t{1} << 50;
  p = PlanPlacement(in);
  EXPECT_EQ(p.status().code(), StatusCode::kFailedPrecondition) << p.status();
  in.host_budget_bytes = 0;
  in.nvme = NvmeTier::kUnavailable;
  EXPECT_TRUE(PlanPlacement(in).ok());

  // ProbeMachineLimits fills it in for a file, and for a path under one.
  const std::string dir =
      (std::filesystem::temp_directory_path() / ("strata-notdir-" + std::to_string(getpid())))
          .string();
  std::filesystem::create_directories(dir);
  std::ofstream(dir + "/file") << "x";
  // /proc: a filesystem of no blocks, once read as a disk with "0 B free".
  const std::vector<std::string> paths = {dir, dir + "/file", dir + "/file/sub", dir + "/new",
                                          "/proc/strata-none"};
  MachineLimits m = ProbeMachineLimits(paths, 0, 1);
  ASSERT_EQ(m.nvme.size(), 5u);
  EXPECT_TRUE(m.nvme[0].not_a_directory.ok()) << m.nvme[0].not_a_directory;
  EXPECT_TRUE(Contains(m.nvme[1].not_a_directory.message(), "exists and is not a directory"))
      << m.nvme[1].not_a_directory;
  EXPECT_TRUE(Contains(m.nvme[2].not_a_directory.message(), "is not a directory"))
      << m.nvme[2].not_a_directory;
  EXPECT_TRUE(m.nvme[3].not_a_directory.ok()) << "a missing directory is created";
  EXPECT_TRUE(Contains(m.nvme[4].not_a_directory.message(),
                       "/proc/strata-none: /proc is on proc, a filesystem that holds no files"))
      << m.nvme[4].not_a_directory;
  std::filesystem::remove_all(dir);
}

TEST(PreflightTest, AHugeDeviceBucketIsInvalidNotAnOverflow) {
  PlacementInputs in = Small();
  in.sub_group_elems = {uint64_t{1} << 40};
  in.world_size = 65536;  // 2^56 elems in one bucket: x 4 bytes x buffers would wrap
  Result<PlacementPlan> p = PlanPlacement(in);
  ASSERT_EQ(p.status().code(), StatusCode::kInvalidArgument);
  EXPECT_TRUE(Contains(p.status().message(), "device bucket of 65536 ranks")) << p.status();
}

TEST(PreflightTest, TooManySubGroupsIsInvalid) {
  PlacementInputs in = Small();
  in.sub_group_elems.assign(kMaxSubGroups + 1, 1);
  Result<PlacementPlan> p = PlanPlacement(in);
  ASSERT_EQ(p.status().code(), StatusCode::kInvalidArgument);
  EXPECT_TRUE(Contains(p.status().message(), "raise zero_optimization.sub_group_size"));
}

TEST(PreflightTest, ProbeReadsThisMachineAndCountsTheOldStateFile) {
  const std::string dir =
      (std::filesystem::temp_directory_path() / ("strata-preflight-" + std::to_string(getpid())))
          .string();
  std::filesystem::create_directories(dir);
  {
    std::ofstream f(dir + "/strata-rank3.state");
    f << std::string(1 << 16, 'x');
  }
  const std::vector<std::string> paths = {dir, dir + "/not/yet"};
  MachineLimits m = ProbeMachineLimits(paths, 3, 2);
  EXPECT_GT(m.host_available_bytes, 0u);
  EXPECT_LE(m.host_available_bytes, m.host_total_bytes);
  EXPECT_EQ(m.ranks_per_node, 2u);
  ASSERT_EQ(m.nvme.size(), 2u);
  EXPECT_GT(m.nvme[0].free_bytes, 0u);
  EXPECT_GE(m.nvme[0].reclaimable_bytes, uint64_t{1} << 16);
  // A directory yet to be created answers with its parent's filesystem.
  EXPECT_EQ(m.nvme[1].device_id, m.nvme[0].device_id);
  EXPECT_EQ(m.nvme[1].reclaimable_bytes, 0u);
  std::filesystem::remove_all(dir);
}

TEST(PreflightTest, RanksPerNode) {
  EXPECT_EQ(RanksPerNode("local", 4), 4u);
  ::setenv("LOCAL_WORLD_SIZE", "8", 1);
  EXPECT_EQ(RanksPerNode("nccl", 16), 8u);
  std::vector<std::string> warned;
  LogSink previous = SetLogSink(
      [&](LogLevel, std::string_view m) { warned.emplace_back(m); });
  for (const char* junk : {"junk", "8abc", "0", ""}) {
    ::setenv("LOCAL_WORLD_SIZE", junk, 1);
    EXPECT_EQ(RanksPerNode("nccl", 16), 1u) << junk;
  }
  SetLogSink(std::move(previous));
  // Said once per process (WarnOnce; nothing else here sets a bad value),
  // naming the value.
  ASSERT_EQ(warned.size(), 1u);
  EXPECT_NE(warned[0].find("LOCAL_WORLD_SIZE='junk' is not a number of ranks"), std::string::npos)
      << warned[0];
  ::unsetenv("LOCAL_WORLD_SIZE");
  EXPECT_EQ(RanksPerNode("python", 16), 1u);
}

}  // namespace
TEST(AutoSubGroupTest, AboutThirtyTwoSubGroupsOfWholeMiElements) {
  constexpr uint64_t kMi = uint64_t{1} << 20;
  // 2e9 / 32 = 62.5M, rounded up to 60 Mi.
  const uint64_t e = AutoSubGroupElems({.shard_elems = 2'000'000'000});
  EXPECT_EQ(e, 60 * kMi);
  EXPECT_EQ((2'000'000'000 + e - 1) / e, 32u);
  // Small shards: sub-groups of at least 4 Mi elements, one when smaller.
  EXPECT_EQ(AutoSubGroupElems({.shard_elems = 10'000'000}), kAutoMinSubGroupElems);
  EXPECT_EQ(AutoSubGroupElems({.shard_elems = 1000}), 1000u);
  EXPECT_EQ(AutoSubGroupElems({.shard_elems = 0}), 1u);
}

TEST(AutoSubGroupTest, WithNvmeTheStagingTakesAtMostAQuarterOfTheHostBudget) {
  constexpr uint64_t kMi = uint64_t{1} << 20;
  const AutoSubGroupInputs in{.shard_elems = 6'000'000'000, .staging_bytes_per_elem = 16,
                              .buffer_count = 4, .host_budget_bytes = 16 * kGiB, .nvme = true};
  const uint64_t e = AutoSubGroupElems(in);
  EXPECT_EQ(e, 64 * kMi);  // 16 GiB / 4 / (4 x 16 B)
  EXPECT_LE(in.buffer_count * in.staging_bytes_per_elem * e, in.host_budget_bytes / 4);
  // The same shard without NVMe, or with a budget of 0 (staging only): no cap.
  AutoSubGroupInputs dram = in;
  dram.nvme = false;
  EXPECT_EQ(AutoSubGroupElems(dram), 179 * kMi);  // 6e9 / 32 = 187.5M = 178.8 Mi
  AutoSubGroupInputs staging_only = in;
  staging_only.host_budget_bytes = 0;
  EXPECT_EQ(AutoSubGroupElems(staging_only), 179 * kMi);
  // Capped, whole 64 Ki elements; a budget too small for even 64 Ki per
  // buffer still gives 64 Ki (the planner then names the budget needed).
  AutoSubGroupInputs small = in;
  small.host_budget_bytes = 100 * kMi;  // 100 Mi / 4 / 64 = 409600 -> 393216
  EXPECT_EQ(AutoSubGroupElems(small), 6 * (kMi / 16));
  AutoSubGroupInputs tiny = in;
  tiny.host_budget_bytes = kMi;
  EXPECT_EQ(AutoSubGroupElems(tiny), kMi / 16);
}

TEST(AutoSubGroupTest, InvariantsOverRandomInputs) {
  std::mt19937_64 rng(11);
  for (int i = 0; i < 2000; ++i) {
    const AutoSubGroupInputs in{
        .shard_elems = rng() >> (rng() % 64),
        .staging_bytes_per_elem = 1 + rng() % 32,
        .buffer_count = static_cast<uint32_t>(1 + rng() % 16),
        .host_budget_bytes = rng() % 3 == 0 ? 0 : rng() >> (rng() % 64),
        .nvme = rng() % 2 == 0};
    const uint64_t shard = std::max<uint64_t>(in.shard_elems, 1);
    const uint64_t e = AutoSubGroupElems(in);
    SCOPED_TRACE(::testing::Message() << "shard " << in.shard_elems << " budget "
                                      << in.host_budget_bytes << " nvme " << in.nvme);
    ASSERT_GE(e, 1u);
    ASSERT_LE(e, shard);
    const uint64_t count = shard / e + (shard % e != 0);
    ASSERT_LE(count, kMaxSubGroups);
    ASSERT_TRUE(CutSubGroups({0, shard}, e).ok());
    const bool capped = in.nvme && in.host_budget_bytes > 0;
    if (!capped && shard >= kAutoSubGroups * kAutoMinSubGroupElems) {
      // Rounding up to whole Mi costs at most a quarter here (sub-groups >= 4 Mi).
      ASSERT_LE(count, kAutoSubGroups);
      ASSERT_GE(count, kAutoSubGroups * 4 / 5);
    }
    // Unless held up by the floors (64 Ki; at most kMaxSubGroups) or the shard.
    const uint64_t floor = std::max<uint64_t>(uint64_t{1} << 16,
                                              (shard + kMaxSubGroups - 1) / kMaxSubGroups);
    if (capped && e > floor && e < shard) {
      ASSERT_LE(e * in.buffer_count * in.staging_bytes_per_elem, in.host_budget_bytes / 4);
    }
  }
}

}  // namespace strata
