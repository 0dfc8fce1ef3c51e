#include "runtime/build_info.h"

namespace strata {

const BuildInfo& GetBuildInfo() {
  static const BuildInfo info{
      .version = STRATA_VERSION,
      .build_type = STRATA_BUILD_TYPE,
      .cuda = STRATA_HAVE_CUDA != 0,
      .nccl = STRATA_HAVE_NCCL != 0,
      .uring = STRATA_HAVE_URING != 0,
  };
  return info;
}

}  // namespace strata
