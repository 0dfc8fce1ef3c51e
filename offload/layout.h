// Flat layout of the parameters the engine owns: how a trainer's tensors are
// packed into one logical fp32 buffer, which contiguous slice of it each ZeRO
// rank owns, how a rank's shard is cut into sub-groups, and how any range of
// the flat buffer maps back to (tensor, offset, count) pieces.
//
//   std::vector<TensorSpec> specs = {{.elems = 4096 * 4096, .dtype = DType::kBF16},
//                                    {.elems = 4096, .dtype = DType::kBF16}};
//   STRATA_ASSIGN_OR_RETURN(FlatLayout layout,
//                           PlanFlatLayout(specs, {.align_elems = 64, .world_size = 8}));
//   STRATA_ASSIGN_OR_RETURN(ElemRange shard, ShardRange(layout, /*rank=*/3));
//   STRATA_ASSIGN_OR_RETURN(auto groups, CutSubGroups(shard, 32'000'000));
//   STRATA_ASSIGN_OR_RETURN(std::vector<TensorPiece> pieces, PiecesInRange(layout, groups[0]));
//   for (const TensorPiece& p : pieces) {
//     // copy tensor p.tensor elements [p.tensor_offset_elems, +p.elems)
//     // to flat elements [p.flat_offset_elems, +p.elems)
//   }
//
// Packing: tensors are laid out in the order given. Each tensor starts at a
// flat offset that is a multiple of `align_elems`; the gap before it is
// padding. The total is padded up to a multiple of world_size x align_elems,
// so every shard has the same size and starts on an aligned element. Padding
// elements belong to no tensor; the engine keeps them zero.
//
// Offsets and counts are in elements of the flat buffer (one element per
// parameter whatever its dtype); multiply by the element size of the buffer
// at hand (4 for the fp32 master, 2 for bf16 params) for bytes. With
// align_elems = 64 an fp32 buffer starts each tensor on a 256-byte boundary
// (four cache lines), a 16-bit one on 128 bytes.
//
// Every function is pure, deterministic and thread-safe. Errors are
// InvalidArgument (zero alignment or world size, a zero sub-group size, a
// range past the end, sizes that overflow 64 bits) or OutOfRange (a rank >=
// world_size).
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "runtime/dtype.h"
#include "runtime/status.h"

namespace strata {

// One trainer tensor (a parameter and its gradient have the same shape).
struct TensorSpec {
  uint64_t elems = 0;  // 0 is allowed: the tensor occupies no flat elements
  DType dtype = DType::kF32;
};

struct FlatLayoutOptions {
  uint64_t align_elems = 64;  // every tensor starts at a multiple of this
  uint32_t world_size = 1;    // ZeRO ranks sharing the flat buffer
};

// A half-open range [begin, end) of flat elements.
struct ElemRange {
  uint64_t begin = 0;
  uint64_t end = 0;
  uint64_t elems() const { return end - begin; }
  friend bool operator==(const ElemRange&, const ElemRange&) = default;
};

// Where one tensor sits in the flat buffer.
struct TensorSlot {
  uint64_t offset_elems = 0;  // a multiple of align_elems
  uint64_t elems = 0;
  DType dtype = DType::kF32;
};

struct FlatLayout {
  std::vector<TensorSlot> tensors;  // in the order given, offsets increasing
  uint64_t align_elems = 0;
  uint32_t world_size = 0;
  uint64_t total_elems = 0;   // padded: a multiple of world_size x align_elems
  uint64_t shard_elems = 0;   // total_elems / world_size
  uint64_t tensor_elems = 0;  // sum of the tensors' elems (total minus padding)
};

// The part of one tensor that falls in a flat range.
struct TensorPiece {
  uint32_t tensor = 0;               // index into FlatLayout::tensors
  uint64_t tensor_offset_elems = 0;  // first element inside the tensor
  uint64_t flat_offset_elems = 0;    // the same element in the flat buffer
  uint64_t elems = 0;
  friend bool operator==(const TensorPiece&, const TensorPiece&) = default;
};

// Packs `tensors` in order. InvalidArgument when align_elems or world_size is
// 0, or the padded total does not fit in 64 bits.
Result<FlatLayout> PlanFlatLayout(std::span<const TensorSpec> tensors,
                                  const FlatLayoutOptions& options);

// A warning when the padding takes more than the tensors and at least 16 Mi
// elements (every element of it costs the state's bytes: 12-16 B): an
// align_elems far above the tensors' sizes (1 Mi for one-element tensors
// planned gigabytes of pinned memory with no word). Empty otherwise.
std::string PaddingWarning(const FlatLayout& layout);

// The contiguous shard of `rank`: [rank x shard_elems, (rank + 1) x shard_elems).
// OutOfRange when rank >= world_size.
Result<ElemRange> ShardRange(const FlatLayout& layout, uint32_t rank);

// At most this many sub-groups in one cut (2^20), the planner's limit too.
inline constexpr uint64_t kMaxSubGroupCount = uint64_t{1} << 20;

// Cuts `range` into consecutive sub-groups of `sub_group_elems`; the last one
// is shorter when the size does not divide. An empty range gives no
// sub-groups. InvalidArgument when sub_group_elems is 0 or the cut would make
// more than kMaxSubGroupCount sub-groups (checked before allocating).
Result<std::vector<ElemRange>> CutSubGroups(ElemRange range, uint64_t sub_group_elems);

// The tensor pieces inside `range`, in flat order; elements of `range` not
// covered by a piece are padding. InvalidArgument when the range is inverted
// or ends past total_elems.
Result<std::vector<TensorPiece>> PiecesInRange(const FlatLayout& layout, ElemRange range);

// The number of tensor pieces in all of `ranges` (PiecesInRange of each).
Result<uint64_t> CountPieces(const FlatLayout& layout, std::span<const ElemRange> ranges);

}  // namespace strata
