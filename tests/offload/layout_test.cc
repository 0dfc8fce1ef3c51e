// Flat layout: hand-checked small layouts, errors, and seeded property tests
// (every flat element belongs to exactly one rank and one sub-group, pieces
// cover exactly the tensor elements of a range, padding never overlaps a
// tensor) against a simple per-element reference.
#include "offload/layout.h"

#include <gtest/gtest.h>

#include <random>
#include <vector>

#include "tests/offload/test_seed.h"

namespace strata {
namespace {

TEST(LayoutTest, AlignsEachTensorAndPadsTotalForWorldSize) {
  const std::vector<TensorSpec> specs = {{100, DType::kBF16}, {64, DType::kBF16}, {1, DType::kF32}};
  Result<FlatLayout> l = PlanFlatLayout(specs, {.align_elems = 64, .world_size = 3});
  ASSERT_TRUE(l.ok()) << l.status();
  ASSERT_EQ(l->tensors.size(), 3u);
  EXPECT_EQ(l->tensors[0].offset_elems, 0u);
  EXPECT_EQ(l->tensors[1].offset_elems, 128u);  // 100 rounded up to 64
  EXPECT_EQ(l->tensors[2].offset_elems, 192u);
  EXPECT_EQ(l->tensors[2].dtype, DType::kF32);
  // 193 elems rounded up to a multiple of 3 x 64 = 192: 384.
  EXPECT_EQ(l->total_elems, 384u);
  EXPECT_EQ(l->shard_elems, 128u);
  EXPECT_EQ(l->tensor_elems, 165u);
  EXPECT_EQ(*ShardRange(*l, 0), (ElemRange{0, 128}));
  EXPECT_EQ(*ShardRange(*l, 2), (ElemRange{256, 384}));
}

TEST(LayoutTest, EmptyAndZeroSizedTensors) {
  Result<FlatLayout> empty = PlanFlatLayout({}, {});
  ASSERT_TRUE(empty.ok());
  EXPECT_EQ(empty->total_elems, 0u);
  const std::vector<TensorSpec> specs = {{0, DType::kF32}, {5, DType::kF32}, {0, DType::kF32}};
  Result<FlatLayout> l = PlanFlatLayout(specs, {.align_elems = 4, .world_size = 1});
  ASSERT_TRUE(l.ok());
  EXPECT_EQ(l->total_elems, 8u);
  Result<std::vector<TensorPiece>> p = PiecesInRange(*l, {0, 8});
  ASSERT_TRUE(p.ok());
  ASSERT_EQ(p->size(), 1u);
  EXPECT_EQ((*p)[0], (TensorPiece{1, 0, 0, 5}));
}

TEST(LayoutTest, PiecesSplitTensorsAtRangeEdges) {
  const std::vector<TensorSpec> specs = {{10, DType::kF16}, {10, DType::kF16}};
  Result<FlatLayout> l = PlanFlatLayout(specs, {.align_elems = 16, .world_size = 2});
  ASSERT_TRUE(l.ok());
  // tensor 0 at [0,10), tensor 1 at [16,26); total 32, shards of 16.
  Result<std::vector<TensorPiece>> p = PiecesInRange(*l, {5, 20});
  ASSERT_TRUE(p.ok());
  ASSERT_EQ(p->size(), 2u);
  EXPECT_EQ((*p)[0], (TensorPiece{0, 5, 5, 5}));
  EXPECT_EQ((*p)[1], (TensorPiece{1, 0, 16, 4}));
  Result<std::vector<TensorPiece>> pad_only = PiecesInRange(*l, {10, 16});
  ASSERT_TRUE(pad_only.ok());
  EXPECT_TRUE(pad_only->empty());
}

TEST(LayoutTest, SubGroupsLastOneShorter) {
  Result<std::vector<ElemRange>> g = CutSubGroups({100, 350}, 100);
  ASSERT_TRUE(g.ok());
  ASSERT_EQ(g->size(), 3u);
  EXPECT_EQ((*g)[0], (ElemRange{100, 200}));
  EXPECT_EQ((*g)[2], (ElemRange{300, 350}));
  EXPECT_TRUE(CutSubGroups({7, 7}, 3)->empty());
}

TEST(LayoutTest, Errors) {
  EXPECT_EQ(PlanFlatLayout({}, {.align_elems = 0}).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(PlanFlatLayout({}, {.world_size = 0}).status().code(), StatusCode::kInvalidArgument);
  const std::vector<TensorSpec> huge = {{~uint64_t{0} - 10, DType::kF32}};
  Result<FlatLayout> overflow = PlanFlatLayout(huge, {.align_elems = 64, .world_size = 1});
  EXPECT_EQ(overflow.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(overflow.status().message().find("overflows"), std::string_view::npos);
  Result<FlatLayout> l =
      PlanFlatLayout(std::vector<TensorSpec>{{10, DType::kF32}}, {.world_size = 2});
  ASSERT_TRUE(l.ok());
  Result<ElemRange> bad_rank = ShardRange(*l, 2);
  EXPECT_EQ(bad_rank.status().code(), StatusCode::kOutOfRange);
  EXPECT_NE(bad_rank.status().message().find("world_size is 2"), std::string_view::npos);
  EXPECT_EQ(CutSubGroups({0, 10}, 0).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(PiecesInRange(*l, {0, l->total_elems + 1}).status().code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(PiecesInRange(*l, {5, 4}).status().code(), StatusCode::kInvalidArgument);
}

// A tiny sub-group size on a large shard fails with the knob, before it
// allocates (1e9 ranges would be 16 GB: once std::bad_alloc, an abort).
TEST(LayoutTest, TooManySubGroupsIsRefusedBeforeAllocating) {
  Result<std::vector<ElemRange>> g = CutSubGroups({0, 1'000'000'000}, 1);
  ASSERT_EQ(g.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(g.status().message().find("make 1000000000 sub-groups; at most 1048576: raise "
                                      "zero_optimization.sub_group_size to at least 954"),
            std::string_view::npos)
      << g.status();
  // Exactly the limit is fine.
  Result<std::vector<ElemRange>> at_limit = CutSubGroups({0, kMaxSubGroupCount * 3}, 3);
  ASSERT_TRUE(at_limit.ok()) << at_limit.status();
  EXPECT_EQ(at_limit->size(), kMaxSubGroupCount);
  EXPECT_EQ(CutSubGroups({0, kMaxSubGroupCount * 3 + 1}, 3).status().code(),
            StatusCode::kInvalidArgument);
}

// Property test against a per-element owner map built the simple way.
TEST(LayoutTest, PropertiesOnRandomLayouts) {
  const uint64_t seed = testing::TestSeed();
  std::mt19937_64 rng(seed);
  for (int iter = 0; iter < 300; ++iter) {
    SCOPED_TRACE(::testing::Message() << "seed " << seed << " iter " << iter);
    const size_t n = rng() % 12;
    std::vector<TensorSpec> specs(n);
    for (auto& s : specs) s = {rng() % 4 == 0 ? 0 : rng() % 300, DType::kBF16};
    const uint64_t align = 1 + rng() % 70;
    const uint32_t world = 1 + static_cast<uint32_t>(rng() % 7);
    const uint64_t sub = 1 + rng() % 150;
    Result<FlatLayout> l = PlanFlatLayout(specs, {.align_elems = align, .world_size = world});
    ASSERT_TRUE(l.ok()) << l.status();
    ASSERT_EQ(l->total_elems % (align * world), 0u);
    ASSERT_EQ(l->shard_elems * world, l->total_elems);

    // owner[e]: the tensor holding flat element e, or -1 for padding.
    std::vector<int> owner(l->total_elems, -1);
    uint64_t prev_end = 0;
    for (size_t t = 0; t < n; ++t) {
      const TensorSlot& s = l->tensors[t];
      ASSERT_EQ(s.offset_elems % align, 0u);
      ASSERT_GE(s.offset_elems, prev_end);          // in order, no overlap
      ASSERT_LT(s.offset_elems - prev_end, align);  // padding is less than one alignment
      ASSERT_EQ(s.elems, specs[t].elems);
      for (uint64_t e = s.offset_elems; e < s.offset_elems + s.elems; ++e) {
        ASSERT_EQ(owner[e], -1) << "element " << e << " in two tensors";
        owner[e] = static_cast<int>(t);
      }
      prev_end = s.offset_elems + s.elems;
    }

    std::vector<int> rank_of(l->total_elems, -1), group_hits(l->total_elems, 0);
    std::vector<int> piece_hits(l->total_elems, 0);
    for (uint32_t r = 0; r < world; ++r) {
      Result<ElemRange> shard = ShardRange(*l, r);
      ASSERT_TRUE(shard.ok());
      for (uint64_t e = shard->begin; e < shard->end; ++e) {
        ASSERT_EQ(rank_of[e], -1);
        rank_of[e] = static_cast<int>(r);
      }
      Result<std::vector<ElemRange>> groups = CutSubGroups(*shard, sub);
      ASSERT_TRUE(groups.ok());
      for (size_t g = 0; g < groups->size(); ++g) {
        const ElemRange& gr = (*groups)[g];
        ASSERT_LE(gr.elems(), sub);
        if (g + 1 < groups->size()) {
          ASSERT_EQ(gr.elems(), sub);
        }
        for (uint64_t e = gr.begin; e < gr.end; ++e) ++group_hits[e];
        Result<std::vector<TensorPiece>> pieces = PiecesInRange(*l, gr);
        ASSERT_TRUE(pieces.ok());
        uint64_t last = gr.begin;
        for (const TensorPiece& p : *pieces) {
          ASSERT_GT(p.elems, 0u);
          ASSERT_GE(p.flat_offset_elems, last);
          ASSERT_LE(p.flat_offset_elems + p.elems, gr.end);
          const TensorSlot& s = l->tensors[p.tensor];
          ASSERT_EQ(s.offset_elems + p.tensor_offset_elems, p.flat_offset_elems);
          ASSERT_LE(p.tensor_offset_elems + p.elems, s.elems);
          for (uint64_t e = p.flat_offset_elems; e < p.flat_offset_elems + p.elems; ++e) {
            ASSERT_EQ(owner[e], static_cast<int>(p.tensor));
            ++piece_hits[e];
          }
          last = p.flat_offset_elems + p.elems;
        }
      }
    }
    for (uint64_t e = 0; e < l->total_elems; ++e) {
      ASSERT_NE(rank_of[e], -1) << "element " << e << " has no rank";
      ASSERT_EQ(group_hits[e], 1) << "element " << e;
      // Pieces cover exactly the tensor elements; padding is never in a piece.
      ASSERT_EQ(piece_hits[e], owner[e] >= 0 ? 1 : 0) << "element " << e;
    }
  }
}

}  // namespace
}  // namespace strata
