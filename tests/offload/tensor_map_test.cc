// TensorMap alone (offload/tensor_map.h), on random layouts of 1-4 ranks:
// each rank's pieces and padding tile its sub-groups exactly, the pieces of
// all ranks cover every tensor element once at its flat position, the pack
// entries put every rank's block of a sub-group at rank x block size in the
// bucket, and buckets_of / tensors_in agree with the pieces.
#include "offload/tensor_map.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <map>
#include <random>
#include <set>

#include "tests/offload/test_seed.h"

namespace strata::internal {
namespace {

// Sorted [begin, end) ranges cover [0, n) with no gap and no overlap.
void ExpectTiles(std::vector<std::pair<uint64_t, uint64_t>> ranges, uint64_t n,
                 const std::string& what) {
  std::sort(ranges.begin(), ranges.end());
  uint64_t at = 0;
  for (auto [b, e] : ranges) {
    ASSERT_EQ(b, at) << what << ": gap or overlap at " << at;
    ASSERT_LT(b, e) << what << ": empty range at " << b;
    at = e;
  }
  EXPECT_EQ(at, n) << what;
}

TEST(TensorMap, PiecesPaddingAndBucketsAgreeWithTheLayout) {
  const uint64_t seed = testing::TestSeed();
  std::mt19937_64 rng(seed);
  for (int trial = 0; trial < 200; ++trial) {
    const int world = 1 + static_cast<int>(rng() % 4);
    const size_t tensors = 1 + rng() % 6;
    std::vector<TensorSpec> specs;
    for (size_t t = 0; t < tensors; ++t) specs.push_back({.elems = 1 + rng() % 700});
    const FlatLayout layout =
        *PlanFlatLayout(specs, {.align_elems = 1u << (rng() % 7),
                                .world_size = static_cast<uint32_t>(world)});
    const uint64_t sub_group_elems = 1 + rng() % 500;
    // Distinct fake pointers: the map only does arithmetic on them.
    std::vector<Param> params;
    for (size_t t = 0; t < tensors; ++t) {
      params.push_back({.data = reinterpret_cast<void*>((t + 1) << 32),
                        .grad = reinterpret_cast<void*>((t + 1) << 40),
                        .elems = specs[t].elems});
    }
    std::vector<std::vector<std::pair<uint64_t, uint64_t>>> covered(tensors);
    for (int r = 0; r < world; ++r) {
      const std::string where = "seed " + std::to_string(seed) + " trial " +
                                std::to_string(trial) + " rank " + std::to_string(r);
      const ElemRange shard = *ShardRange(layout, static_cast<uint32_t>(r));
      const std::vector<ElemRange> sgs = *CutSubGroups(shard, sub_group_elems);
      Result<TensorMap> map = TensorMap::Build({.layout = &layout,
                                                .shard = shard,
                                                .sub_groups = sgs,
                                                .rank = r,
                                                .world = world,
                                                .params = params,
                                                .grad_dtype = DType::kBF16,
                                                .param_dtype = DType::kF32});
      ASSERT_TRUE(map.ok()) << where << ": " << map.status();
      ASSERT_EQ(map->num_sub_groups(), sgs.size());
      uint64_t max_elems = 0;
      for (const ElemRange& g : sgs) max_elems = std::max(max_elems, g.elems());
      std::map<uint32_t, std::set<uint32_t>> subs_of;  // tensor -> sub-groups (this rank)
      for (uint32_t i = 0; i < sgs.size(); ++i) {
        std::vector<std::pair<uint64_t, uint64_t>> tiles;
        for (const TensorMap::Piece& p : map->own(i)) {
          tiles.push_back({p.offset_elems, p.offset_elems + p.elems});
          // At its flat position: the tensor's offset + the offset inside it.
          EXPECT_EQ(layout.tensors[p.tensor].offset_elems + p.tensor_offset_elems,
                    sgs[i].begin + p.offset_elems)
              << where;
          ASSERT_LE(p.tensor_offset_elems + p.elems, specs[p.tensor].elems) << where;
          covered[p.tensor].push_back({p.tensor_offset_elems, p.tensor_offset_elems + p.elems});
          subs_of[p.tensor].insert(i);
        }
        for (const ElemRange& pad : map->padding(i)) tiles.push_back({pad.begin, pad.end});
        ExpectTiles(tiles, sgs[i].elems(), where + " sub-group " + std::to_string(i));
        if (world > 1) {
          // Every rank's block of index i, rank-major, block = the largest sub-group.
          uint64_t packed = 0;
          for (const kernels::PackEntry& e : map->pack(i)) {
            packed += e.tensor.elems;
            EXPECT_LE(e.offset_elems + e.tensor.elems, uint64_t(world) * max_elems) << where;
          }
          EXPECT_EQ(map->unpack(i).size(), map->pack(i).size()) << where;
          uint64_t expect = 0;
          for (int q = 0; q < world; ++q) {
            const ElemRange other = *ShardRange(layout, static_cast<uint32_t>(q));
            const std::vector<ElemRange> qs = *CutSubGroups(other, sub_group_elems);
            const auto pieces = PiecesInRange(layout, qs[i]);
            ASSERT_TRUE(pieces.ok()) << pieces.status();
            for (const TensorPiece& tp : *pieces) expect += tp.elems;
          }
          EXPECT_EQ(packed, expect) << where << " sub-group " << i;
        } else {
          EXPECT_TRUE(map->pack(i).empty()) << where;  // one rank packs nothing
        }
      }
      if (world == 1) {
        // A tensor's grad completes the sub-groups it has pieces in.
        std::vector<uint32_t> count(sgs.size(), 0);
        for (uint32_t t = 0; t < tensors; ++t) {
          const std::span<const uint32_t> b = map->buckets_of(t);
          EXPECT_EQ(std::set<uint32_t>(b.begin(), b.end()), subs_of[t]) << where;
          for (uint32_t i : b) ++count[i];
        }
        for (uint32_t i = 0; i < sgs.size(); ++i) EXPECT_EQ(map->tensors_in(i), count[i]) << where;
      }
    }
    for (size_t t = 0; t < tensors; ++t) {
      ExpectTiles(covered[t], specs[t].elems,
                  "seed " + std::to_string(seed) + " trial " + std::to_string(trial) +
                      " tensor " + std::to_string(t));
    }
  }
}

}  // namespace
}  // namespace strata::internal
