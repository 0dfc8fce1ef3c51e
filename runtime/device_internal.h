// Internal to the device backends: the CUDA listing hook used by ListDevices
// and OpenDevice. Defined in cuda_device.cc, or as "no devices" when the
// build has no CUDA.
#pragma once

#include <vector>

#include "runtime/device.h"

namespace strata::internal {

// Caps of every CUDA device present; empty without a GPU, driver or CUDA build.
std::vector<DeviceCaps> ListCudaDevices();

}  // namespace strata::internal
