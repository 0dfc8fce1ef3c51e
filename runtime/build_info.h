// What this build of Strata contains: version and compiled-in backends.
// A backend compiled in may still be unusable at run time (no GPU, io_uring
// refused); the device and storage factories report that.
#pragma once

#include <string_view>

namespace strata {

struct BuildInfo {
  std::string_view version;  // the project version, "0.2.0"
  std::string_view build_type;
  bool cuda;   // CUDA device backend and kernels compiled in
  bool nccl;   // NCCL communicator compiled in
  bool uring;  // io_uring storage backend compiled in
};

const BuildInfo& GetBuildInfo();

}  // namespace strata
