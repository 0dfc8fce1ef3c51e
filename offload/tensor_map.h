// TensorMap: where the trainer's tensors sit in each sub-group of this rank's
// shard, as the engine's gradient path and param publisher need it. Internal
// to offload/.
//
//   STRATA_ASSIGN_OR_RETURN(TensorMap map, TensorMap::Build({...}));
//   for (const TensorMap::Piece& p : map.own(i)) { ... p.tensor, p.offset_elems ... }
//   map.pack(i)      // world > 1: every rank's block of sub-group i, for the bucket
//   map.Rebind(params)  // a tensor moved: recompute the pointer-bearing entries
//
// Sub-group i of rank r is the flat range sub_groups[i]; "own" pieces are
// the parts of registered tensors inside it (padding is what they leave
// uncovered: padding(i)). With several ranks the gradient is reduce-scattered
// through a bucket that holds every rank's block of sub-group index i, one
// after the other (rank-major), and the params are all-gathered through one:
// pack(i) and unpack(i) are those blocks as kernel entries, pointing into the
// registered tensors. A tensor's grad is complete for sub-group i once every
// tensor with a piece in any rank's block of i was reported (buckets_of(t),
// tensors_in(i)): the reduce-scatter needs them all.
//
// Immutable after Build except for Rebind; not thread-safe.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "kernels/kernels.h"
#include "offload/layout.h"
#include "offload/optimizer.h"
#include "runtime/dtype.h"
#include "runtime/status.h"

namespace strata::internal {

class TensorMap {
 public:
  struct Inputs {
    const FlatLayout* layout = nullptr;
    ElemRange shard;
    std::span<const ElemRange> sub_groups;
    int rank = 0;
    int world = 1;
    std::span<const Param> params;  // flat over groups, registration order
    DType grad_dtype = DType::kF32;
    DType param_dtype = DType::kF32;
  };
  // One tensor's part of one of this rank's sub-groups.
  struct Piece {
    uint32_t tensor = 0;
    uint64_t tensor_offset_elems = 0;  // first element in the tensor
    uint64_t offset_elems = 0;         // first element in the sub-group
    uint64_t elems = 0;
  };

  static Result<TensorMap> Build(const Inputs& in);
  // The params' pointers changed (same sizes): recompute pack/unpack.
  void Rebind(std::span<const Param> params);

  std::span<const Piece> own(uint32_t i) const { return own_[i]; }
  // Sub-group-relative ranges no own piece covers, in order.
  std::span<const ElemRange> padding(uint32_t i) const { return padding_[i]; }
  std::span<const kernels::PackEntry> pack(uint32_t i) const { return pack_[i]; }
  std::span<const kernels::UnpackEntry> unpack(uint32_t i) const { return unpack_[i]; }
  std::span<const uint32_t> buckets_of(uint32_t tensor) const { return buckets_of_[tensor]; }
  uint32_t tensors_in(uint32_t i) const { return tensors_in_[i]; }
  uint32_t num_sub_groups() const { return static_cast<uint32_t>(own_.size()); }
  uint64_t total_pieces() const { return total_pieces_; }

 private:
  // A piece of any rank's block of a bucket.
  struct BucketPiece {
    uint32_t tensor;
    uint64_t tensor_offset_elems;
    uint64_t bucket_offset_elems;
    uint64_t elems;
  };
  void BuildEntries(std::span<const Param> params);

  DType grad_dtype_ = DType::kF32;
  DType param_dtype_ = DType::kF32;
  uint64_t total_pieces_ = 0;
  std::vector<std::vector<Piece>> own_;
  std::vector<std::vector<ElemRange>> padding_;
  std::vector<std::vector<BucketPiece>> bucket_pieces_;  // world > 1 only
  std::vector<std::vector<kernels::PackEntry>> pack_;
  std::vector<std::vector<kernels::UnpackEntry>> unpack_;
  std::vector<std::vector<uint32_t>> buckets_of_;
  std::vector<uint32_t> tensors_in_;
};

}  // namespace strata::internal
