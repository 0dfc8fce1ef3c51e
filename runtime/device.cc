// Backend-independent parts of device.h: buffers, names, device listing.
#include "runtime/device.h"

#include <fmt/format.h>

#include <charconv>
#include <utility>

#include "runtime/device_internal.h"

namespace strata {

std::string_view DeviceKindName(DeviceKind kind) {
  switch (kind) {
    case DeviceKind::kHost:
      return "host";
    case DeviceKind::kCuda:
      return "cuda";
  }
  return "unknown";
}

std::string_view CopyKindName(CopyKind kind) {
  switch (kind) {
    case CopyKind::kHostToDevice:
      return "H2D";
    case CopyKind::kDeviceToHost:
      return "D2H";
    case CopyKind::kDeviceToDevice:
      return "D2D";
    case CopyKind::kHostToHost:
      return "H2H";
  }
  return "copy";
}

DeviceBuffer& DeviceBuffer::operator=(DeviceBuffer&& other) noexcept {
  if (this != &other) {
    Reset();
    device_ = std::exchange(other.device_, nullptr);
    data_ = std::exchange(other.data_, nullptr);
    bytes_ = std::exchange(other.bytes_, 0);
  }
  return *this;
}

void DeviceBuffer::Reset() {
  if (device_ != nullptr && data_ != nullptr) device_->FreeDevice(data_, bytes_);
  device_ = nullptr;
  data_ = nullptr;
  bytes_ = 0;
}

HostAllocation& HostAllocation::operator=(HostAllocation&& other) noexcept {
  if (this != &other) {
    Reset();
    device_ = std::exchange(other.device_, nullptr);
    data_ = std::exchange(other.data_, nullptr);
    bytes_ = std::exchange(other.bytes_, 0);
    lock_ = std::exchange(other.lock_, HostMemoryLock::kUnlocked);
  }
  return *this;
}

void HostAllocation::Reset() {
  if (device_ != nullptr && data_ != nullptr) device_->FreeHost(data_, bytes_, lock_);
  device_ = nullptr;
  data_ = nullptr;
  bytes_ = 0;
  lock_ = HostMemoryLock::kUnlocked;
}

Status Device::LaunchHostFunc(StreamRef stream, std::function<void()> fn) {
  if (!fn)
    return InvalidArgumentError(fmt::format("launch host func on {}: empty function", name()));
  return LaunchHostTask(stream, [fn = std::move(fn)] {
    fn();
    return OkStatus();
  });
}

Result<Stream> Device::WrapNativeStream(void* native_stream) {
  return InvalidArgumentError(
      fmt::format("wrap native stream on {}: the device has no native streams", name()));
}

std::vector<DeviceCaps> ListDevices() {
  std::vector<DeviceCaps> out;
  auto host = CreateHostDevice();
  if (host.ok()) out.push_back((*host)->caps());
  for (DeviceCaps& c : internal::ListCudaDevices()) out.push_back(std::move(c));
  return out;
}

Result<std::unique_ptr<Device>> OpenDevice(std::string_view name,
                                           const HostDeviceOptions& host_options) {
  if (name == "host") return CreateHostDevice(host_options);
  if (name == "auto") {
    if (!internal::ListCudaDevices().empty()) return CreateCudaDevice(0);
    return CreateHostDevice(host_options);
  }
  if (name.starts_with("cuda:")) {
    std::string_view digits = name.substr(5);
    int ordinal = -1;
    auto [end, ec] = std::from_chars(digits.data(), digits.data() + digits.size(), ordinal);
    if (ec == std::errc() && end == digits.data() + digits.size() && !digits.empty() &&
        ordinal >= 0) {
      return CreateCudaDevice(ordinal);
    }
  }
  return InvalidArgumentError(fmt::format(
      "open device '{}': unknown device name; use \"auto\", \"host\" or \"cuda:N\"", name));
}

#if !STRATA_HAVE_CUDA
namespace internal {
std::vector<DeviceCaps> ListCudaDevices() { return {}; }
}  // namespace internal

Result<std::unique_ptr<Device>> CreateCudaDevice(int ordinal) {
  return UnavailableError(
      fmt::format("open device cuda:{}: this build has no CUDA backend; rebuild with "
                  "STRATA_CUDA=ON or use \"host\"",
                  ordinal));
}
#endif

}  // namespace strata
