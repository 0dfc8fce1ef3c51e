// The Adam rates strata.rates names (PlanRates::cpu_adam_elems_per_sec and
// device_adam_elems_per_sec), measured the way the engine runs its updates:
// the gradient in the dtype it has when the update reads it (the trainer's
// with one rank, communication_data_type with several) and the params written
// in the param dtype (on the device only with one rank: several all-gather
// them from the master weights). gpu_fraction "auto" measures the ones the
// config does not give; `strata bench step` judges the device side by the
// same probe.
//
//   AdamShape shape = AdamShape::Of(config, world);
//   STRATA_ASSIGN_OR_RETURN(double cpu, MeasureCpuAdamRate(*cpu_adam, shape, 16 << 20));
//   STRATA_ASSIGN_OR_RETURN(double dev, MeasureDeviceAdamRate(device, shape, 16 << 20));
//
// Each runs four updates of `elems` fresh elements (small, varied, finite
// gradients) and keeps the best of the last three (the first faults the pages
// in): elements per second. Allocation failures are the device's or the
// host's errors. Not thread-safe with other users of the same CpuAdam.
#pragma once

#include <cstdint>

#include "cpu_adam/cpu_adam.h"
#include "offload/config.h"
#include "runtime/device.h"
#include "runtime/dtype.h"
#include "runtime/status.h"

namespace strata {

struct AdamShape {
  DType grad = DType::kF32;
  DType out = DType::kF32;
  bool device_writes_params = true;
  static AdamShape Of(const OffloadConfig& config, uint32_t world) {
    return {world == 1 ? config.grad_dtype : config.comm_dtype, config.param_dtype, world == 1};
  }
  // Bytes one element of the device update moves: master, m and v read and
  // written, the gradient read, the params written.
  uint64_t device_bytes_per_elem() const {
    return 24 + DTypeSize(grad) + (device_writes_params ? DTypeSize(out) : 0);
  }
  // Device memory one element of DeviceAdamProbe takes: master, m and v, the
  // gradient, the params.
  uint64_t device_memory_per_elem() const {
    return 12 + DTypeSize(grad) + (device_writes_params ? DTypeSize(out) : 0);
  }
};

Result<double> MeasureCpuAdamRate(CpuAdam& cpu, const AdamShape& shape, uint64_t elems);
Result<double> MeasureDeviceAdamRate(Device& device, const AdamShape& shape, uint64_t elems);

// The device side of MeasureDeviceAdamRate as a value, for callers that run
// it beside other work (`strata bench step` runs it together with the link
// and the CPU): `elems` fresh elements on the device and a stream of its own.
// Launch() queues one update on that stream and returns; Wait() waits for it.
// Not thread-safe; the device must outlive it.
class DeviceAdamProbe {
 public:
  static Result<DeviceAdamProbe> Create(Device& device, const AdamShape& shape, uint64_t elems);
  Status Launch();
  Status Wait();
  uint64_t elems() const { return n_; }

 private:
  DeviceAdamProbe(Device& device, const AdamShape& shape, uint64_t n)
      : device_(&device), shape_(shape), n_(n) {}
  Device* device_;
  AdamShape shape_;
  uint64_t n_;
  DeviceBuffer state_, grad_, out_;
  Stream stream_;
  uint64_t step_ = 0;
};

}  // namespace strata
