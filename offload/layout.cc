#include "offload/layout.h"

#include <fmt/format.h>

#include <algorithm>
#include <limits>
#include <optional>
#include <string>

namespace strata {
namespace {

constexpr uint64_t kMaxU64 = std::numeric_limits<uint64_t>::max();

// `value` rounded up to a multiple of `multiple`; nullopt on overflow.
std::optional<uint64_t> RoundUp(uint64_t value, uint64_t multiple) {
  const uint64_t rem = value % multiple;
  if (rem == 0) return value;
  if (value > kMaxU64 - (multiple - rem)) return std::nullopt;
  return value + (multiple - rem);
}

}  // namespace

Result<FlatLayout> PlanFlatLayout(std::span<const TensorSpec> tensors,
                                  const FlatLayoutOptions& options) {
  if (options.align_elems == 0) {
    return InvalidArgumentError("plan flat layout: align_elems is 0; use 1 for no alignment");
  }
  if (options.world_size == 0) {
    return InvalidArgumentError("plan flat layout: world_size is 0; it must be at least 1");
  }
  if (tensors.size() > std::numeric_limits<uint32_t>::max()) {
    return InvalidArgumentError(
        fmt::format("plan flat layout: {} tensors; at most 2^32 - 1", tensors.size()));
  }
  FlatLayout layout;
  layout.align_elems = options.align_elems;
  layout.world_size = options.world_size;
  layout.tensors.reserve(tensors.size());
  uint64_t cursor = 0;
  for (size_t i = 0; i < tensors.size(); ++i) {
    const std::optional<uint64_t> offset = RoundUp(cursor, options.align_elems);
    if (!offset || tensors[i].elems > kMaxU64 - *offset) {
      return InvalidArgumentError(fmt::format(
          "plan flat layout: tensor {} ({} elems) overflows 64-bit offsets", i, tensors[i].elems));
    }
    layout.tensors.push_back({*offset, tensors[i].elems, tensors[i].dtype});
    cursor = *offset + tensors[i].elems;
    layout.tensor_elems += tensors[i].elems;
  }
  const uint64_t unit = options.align_elems * options.world_size;
  const std::optional<uint64_t> total =
      unit / options.world_size == options.align_elems ? RoundUp(cursor, unit) : std::nullopt;
  if (!total) {
    return InvalidArgumentError(fmt::format(
        "plan flat layout: {} elems padded to a multiple of world_size {} x align_elems {} "
        "overflows 64 bits",
        cursor, options.world_size, options.align_elems));
  }
  layout.total_elems = *total;
  layout.shard_elems = *total / options.world_size;
  return layout;
}

std::string PaddingWarning(const FlatLayout& layout) {
  const uint64_t padding = layout.total_elems - layout.tensor_elems;
  if (padding <= layout.tensor_elems || padding < (uint64_t{16} << 20)) return {};
  return fmt::format(
      "the flat layout pads {} tensors of {} elems to {} elems ({:.1f}x; align_elems {}, "
      "world size {}): every padding element takes the state's bytes too; lower "
      "strata.align_elems (default 64)",
      layout.tensors.size(), layout.tensor_elems, layout.total_elems,
      static_cast<double>(layout.total_elems) / static_cast<double>(layout.tensor_elems),
      layout.align_elems, layout.world_size);
}

Result<ElemRange> ShardRange(const FlatLayout& layout, uint32_t rank) {
  if (rank >= layout.world_size) {
    return OutOfRangeError(fmt::format("shard of rank {}: world_size is {}; ranks are 0..{}", rank,
                                       layout.world_size,
                                       layout.world_size == 0 ? 0 : layout.world_size - 1));
  }
  const uint64_t begin = uint64_t{rank} * layout.shard_elems;
  return ElemRange{begin, begin + layout.shard_elems};
}

Result<std::vector<ElemRange>> CutSubGroups(ElemRange range, uint64_t sub_group_elems) {
  if (sub_group_elems == 0) {
    return InvalidArgumentError("cut sub-groups: sub_group_elems is 0; it must be at least 1");
  }
  if (range.end < range.begin) {
    return InvalidArgumentError(
        fmt::format("cut sub-groups: range [{}, {}) is inverted", range.begin, range.end));
  }
  // Bounded before anything is allocated: a tiny sub-group size on a large
  // shard would otherwise ask for billions of ranges.
  const uint64_t count = range.elems() / sub_group_elems + (range.elems() % sub_group_elems != 0);
  if (count > kMaxSubGroupCount) {
    return InvalidArgumentError(fmt::format(
        "cut sub-groups: {} elems in sub-groups of {} make {} sub-groups; at most {}: raise "
        "zero_optimization.sub_group_size to at least {}",
        range.elems(), sub_group_elems, count, kMaxSubGroupCount,
        (range.elems() + kMaxSubGroupCount - 1) / kMaxSubGroupCount));
  }
  std::vector<ElemRange> groups;
  groups.reserve(count);
  for (uint64_t begin = range.begin; begin < range.end;) {
    const uint64_t len = std::min(sub_group_elems, range.end - begin);
    groups.push_back({begin, begin + len});
    begin += len;
  }
  return groups;
}

Result<std::vector<TensorPiece>> PiecesInRange(const FlatLayout& layout, ElemRange range) {
  if (range.end < range.begin || range.end > layout.total_elems) {
    return InvalidArgumentError(
        fmt::format("pieces of flat range [{}, {}): the flat buffer has {} elems", range.begin,
                    range.end, layout.total_elems));
  }
  std::vector<TensorPiece> pieces;
  if (range.begin == range.end) return pieces;
  // First tensor whose end lies past range.begin; offsets increase, so do ends.
  const auto& t = layout.tensors;
  auto it = std::partition_point(t.begin(), t.end(), [&](const TensorSlot& s) {
    return s.offset_elems + s.elems <= range.begin;
  });
  for (; it != t.end() && it->offset_elems < range.end; ++it) {
    if (it->elems == 0) continue;
    const uint64_t lo = std::max(range.begin, it->offset_elems);
    const uint64_t hi = std::min(range.end, it->offset_elems + it->elems);
    if (lo >= hi) continue;
    pieces.push_back({static_cast<uint32_t>(it - t.begin()), lo - it->offset_elems, lo, hi - lo});
  }
  return pieces;
}

Result<uint64_t> CountPieces(const FlatLayout& layout, std::span<const ElemRange> ranges) {
  uint64_t n = 0;
  for (const ElemRange& r : ranges) {
    STRATA_ASSIGN_OR_RETURN(std::vector<TensorPiece> pieces, PiecesInRange(layout, r));
    n += pieces.size();
  }
  return n;
}

}  // namespace strata
