// The tensors of a model, read from the files a user has at hand, so that
// `strata plan --model` lays them out as the engine will: each tensor
// starts at a multiple of align_elems, and that padding can add a sub-group
// to a model of many tensors that `--params N` (one tensor) does not show.
//
//   STRATA_ASSIGN_OR_RETURN(ModelTensors m, ReadModelTensors("model.safetensors"));
//   for (uint64_t elems : m.elems) ...
//
// Accepted:
//   - a .safetensors file (its header: the name and shape of each tensor);
//   - a sharded model's index (*.safetensors.index.json): every file its
//     weight_map names, beside it;
//   - a directory holding one of those (model.safetensors.index.json first,
//     then model.safetensors, then its *.safetensors files by name);
//   - a text file with one tensor per line: an element count (16777216) or
//     a shape (4096x4096); blank lines and '#' comments are skipped.
// Only headers are read: a 100 GB model is planned in milliseconds.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "runtime/status.h"

namespace strata::cli {

struct ModelTensors {
  std::vector<uint64_t> elems;  // per tensor, in the files' order
  uint64_t total_elems = 0;
  std::vector<std::string> files;  // the files read
};

// InvalidArgument naming the file and what is wrong with it (a header that
// is not safetensors, a bad shape, an empty model); NotFound for a missing
// file.
Result<ModelTensors> ReadModelTensors(const std::string& path);

}  // namespace strata::cli
