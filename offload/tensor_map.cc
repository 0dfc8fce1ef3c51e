#include "offload/tensor_map.h"

namespace strata::internal {

Result<TensorMap> TensorMap::Build(const Inputs& in) {
  TensorMap m;
  m.grad_dtype_ = in.grad_dtype;
  m.param_dtype_ = in.param_dtype;
  const size_t n = in.sub_groups.size();
  m.own_.resize(n);
  m.padding_.resize(n);
  m.bucket_pieces_.resize(n);
  m.buckets_of_.assign(in.params.size(), {});
  m.tensors_in_.assign(n, 0);
  auto touch = [&](uint32_t tensor, uint32_t i) {
    auto& b = m.buckets_of_[tensor];
    if (b.empty() || b.back() != i) {
      b.push_back(i);
      ++m.tensors_in_[i];
    }
  };
  for (uint32_t i = 0; i < n; ++i) {
    const ElemRange sg = in.sub_groups[i];
    STRATA_ASSIGN_OR_RETURN(std::vector<TensorPiece> pieces, PiecesInRange(*in.layout, sg));
    uint64_t covered = 0;
    for (const TensorPiece& p : pieces) {
      if (p.elems == 0) continue;
      const uint64_t at = p.flat_offset_elems - sg.begin;
      if (at > covered) m.padding_[i].push_back({covered, at});
      covered = at + p.elems;
      m.own_[i].push_back({p.tensor, p.tensor_offset_elems, at, p.elems});
      if (in.world == 1) touch(p.tensor, i);
    }
    if (covered < sg.elems()) m.padding_[i].push_back({covered, sg.elems()});
    m.total_pieces_ += m.own_[i].size();
    if (in.world == 1) continue;
    const uint64_t rel = sg.begin - in.shard.begin;
    for (int r = 0; r < in.world; ++r) {
      const uint64_t begin = r * in.layout->shard_elems + rel;
      const ElemRange block{begin, begin + sg.elems()};
      STRATA_ASSIGN_OR_RETURN(std::vector<TensorPiece> all, PiecesInRange(*in.layout, block));
      for (const TensorPiece& p : all) {
        m.bucket_pieces_[i].push_back({p.tensor, p.tensor_offset_elems,
                                       r * sg.elems() + (p.flat_offset_elems - block.begin),
                                       p.elems});
        touch(p.tensor, i);
      }
    }
  }
  m.BuildEntries(in.params);
  return m;
}

void TensorMap::Rebind(std::span<const Param> params) { BuildEntries(params); }

void TensorMap::BuildEntries(std::span<const Param> params) {
  const size_t grad_size = DTypeSize(grad_dtype_);
  const size_t param_size = DTypeSize(param_dtype_);
  pack_.assign(bucket_pieces_.size(), {});
  unpack_.assign(bucket_pieces_.size(), {});
  for (size_t i = 0; i < bucket_pieces_.size(); ++i) {
    for (const BucketPiece& p : bucket_pieces_[i]) {
      const Param& t = params[p.tensor];
      pack_[i].push_back(
          {{static_cast<const std::byte*>(t.grad) + p.tensor_offset_elems * grad_size, p.elems,
            grad_dtype_},
           p.bucket_offset_elems});
      unpack_[i].push_back(
          {{static_cast<std::byte*>(t.data) + p.tensor_offset_elems * param_size, p.elems,
            param_dtype_},
           p.bucket_offset_elems});
    }
  }
}

}  // namespace strata::internal
