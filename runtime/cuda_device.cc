// The CUDA device backend. Compiled only when STRATA_HAVE_CUDA; reachable
// through CreateCudaDevice/OpenDevice. Every call makes the device current
// for its own duration (a CudaDeviceGuard: the current device is per host
// thread and shared with torch), so any thread may use any device and finds
// its current device unchanged afterwards.
#include <cudaTypedefs.h>  // PFN_cuDevicePrimaryCtxGetState: no link to libcuda
#include <cuda_runtime_api.h>
#include <fmt/format.h>
#include <sys/mman.h>

#include <atomic>
#include <exception>
#include <functional>
#include <limits>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <unordered_set>
#include <vector>

#include "runtime/cuda_internal.h"
#include "runtime/device.h"
#include "runtime/device_internal.h"
#include "runtime/host_pages_internal.h"
#include "runtime/log.h"
#include "runtime/units.h"

namespace strata {
namespace internal {

Status CudaError(cudaError_t err, std::string_view op) {
  if (err == cudaSuccess) return OkStatus();
  (void)cudaGetLastError();  // see the header: a sticky error stays
  std::string m = fmt::format("{}: {} ({})", op, cudaGetErrorName(err), cudaGetErrorString(err));
  switch (err) {
    case cudaErrorMemoryAllocation:
      return ResourceExhaustedError(std::move(m));
    case cudaErrorNoDevice:
    case cudaErrorInsufficientDriver:
    case cudaErrorInitializationError:
    case cudaErrorDevicesUnavailable:
      return UnavailableError(std::move(m));
    case cudaErrorInvalidValue:
    case cudaErrorInvalidDevice:
    case cudaErrorInvalidResourceHandle:
    case cudaErrorInvalidDevicePointer:
    case cudaErrorInvalidMemcpyDirection:
      return InvalidArgumentError(std::move(m));
    case cudaErrorNoKernelImageForDevice:
      return FailedPreconditionError(std::move(m));
    default:
      return InternalError(std::move(m));
  }
}

namespace {

// Whether `ordinal`'s primary context is active (retained by some CUDA
// runtime in the process). Asked of the driver through the runtime's entry
// point lookup, so nothing links libcuda; when the lookup fails the answer is
// yes (switch back, as a plain cudaSetDevice guard would).
struct DriverCalls {
  PFN_cuDeviceGet_v2000 device_get = nullptr;
  PFN_cuDevicePrimaryCtxGetState_v7000 primary_ctx_get_state = nullptr;
};

template <typename Fn>
Fn DriverEntryPoint(const char* symbol) {
  void* fn = nullptr;
  cudaDriverEntryPointQueryResult found = cudaDriverEntryPointSymbolNotFound;
  if (cudaGetDriverEntryPointByVersion(symbol, &fn, 12000, cudaEnableDefault, &found) !=
          cudaSuccess ||
      found != cudaDriverEntryPointSuccess) {
    (void)cudaGetLastError();
    return nullptr;
  }
  return reinterpret_cast<Fn>(fn);
}

bool PrimaryContextActive(int ordinal) {
  static const DriverCalls driver{
      DriverEntryPoint<PFN_cuDeviceGet_v2000>("cuDeviceGet"),
      DriverEntryPoint<PFN_cuDevicePrimaryCtxGetState_v7000>("cuDevicePrimaryCtxGetState")};
  if (driver.device_get == nullptr || driver.primary_ctx_get_state == nullptr) return true;
  CUdevice dev = 0;
  if (driver.device_get(&dev, ordinal) != CUDA_SUCCESS) return true;
  unsigned int flags = 0;
  int active = 0;
  if (driver.primary_ctx_get_state(dev, &flags, &active) != CUDA_SUCCESS) return true;
  return active != 0;
}

}  // namespace

cudaError_t CudaDeviceGuard::Select(int ordinal) {
  int current = -1;
  if (cudaError_t err = cudaGetDevice(&current); err != cudaSuccess) return err;
  if (current == ordinal) return cudaSuccess;
  if (cudaError_t err = cudaSetDevice(ordinal); err != cudaSuccess) return err;
  restore_ = current;
  return cudaSuccess;
}

CudaDeviceGuard::~CudaDeviceGuard() {
  if (restore_ < 0 || !PrimaryContextActive(restore_)) return;
  // Nothing to report from a destructor; keep a failure out of the next
  // launch's cudaGetLastError().
  if (cudaSetDevice(restore_) != cudaSuccess) (void)cudaGetLastError();
}

}  // namespace internal

namespace {

using internal::CudaDeviceGuard;
using internal::CudaError;

// The first failure of host work on a stream; shared with events and callbacks.
class StickyError {
 public:
  void Set(Status s) {
    std::lock_guard lock(mu_);
    if (status_.ok()) status_ = std::move(s);
  }
  Status Get() {
    std::lock_guard lock(mu_);
    return status_;
  }
  bool ok() {
    std::lock_guard lock(mu_);
    return status_.ok();
  }

 private:
  std::mutex mu_;
  Status status_;
};

class CudaStream final : public internal::StreamImpl {
 public:
  enum class Ownership : uint8_t { kOwned = 0, kBorrowed = 1 };
  CudaStream(const Device* owner, int ordinal, cudaStream_t stream, std::string name,
             std::shared_ptr<StickyError> sticky, std::function<void()> on_destroy,
             Ownership ownership = Ownership::kOwned)
      : StreamImpl(owner),
        ordinal_(ordinal),
        ownership_(ownership),
        stream_(stream),
        name_(std::move(name)),
        sticky_(std::move(sticky)),
        on_destroy_(std::move(on_destroy)) {}
  ~CudaStream() override {
    if (ownership_ == Ownership::kOwned) {
      CudaDeviceGuard device_guard;
      device_guard.Select(ordinal_);
      cudaStreamSynchronize(stream_);
      cudaStreamDestroy(stream_);
    }
    if (on_destroy_) on_destroy_();
  }
  cudaStream_t stream() const { return stream_; }
  const std::string& name() const { return name_; }
  const std::shared_ptr<StickyError>& sticky() const { return sticky_; }

 private:
  int ordinal_;
  Ownership ownership_;
  cudaStream_t stream_;
  std::string name_;
  std::shared_ptr<StickyError> sticky_;
  std::function<void()> on_destroy_;  // leaves the device's registry
};

class CudaEvent final : public internal::EventImpl {
 public:
  CudaEvent(const Device* owner, int ordinal, cudaEvent_t event)
      : EventImpl(owner), ordinal_(ordinal), event_(event) {}
  ~CudaEvent() override {
    CudaDeviceGuard device_guard;
    device_guard.Select(ordinal_);
    cudaEventDestroy(event_);
  }
  cudaEvent_t event() const { return event_; }
  // The sticky error of the stream of the latest record.
  std::shared_ptr<StickyError> recorded_on;

 private:
  int ordinal_;
  cudaEvent_t event_;
};

struct HostTaskPayload {
  std::function<Status()> task;
  std::shared_ptr<StickyError> sticky;
  std::string stream_name;
};

void CUDART_CB RunHostTask(void* arg) {
  std::unique_ptr<HostTaskPayload> payload(static_cast<HostTaskPayload*>(arg));
  if (!payload->sticky->ok()) return;
  Status s;
  try {
    s = payload->task();
  } catch (const std::exception& e) {
    s = InternalError(fmt::format("host task threw: {}", e.what()));
  } catch (...) {
    s = InternalError("host task threw a non-standard exception");
  }
  if (!s.ok())
    payload->sticky->Set(std::move(s).WithContext("async work on " + payload->stream_name));
}

Result<DeviceCaps> QueryCaps(int ordinal) {
  cudaDeviceProp prop{};
  STRATA_RETURN_IF_CUDA_ERROR(cudaGetDeviceProperties(&prop, ordinal),
                              fmt::format("query cuda:{}", ordinal));
  int pools = 0;
  STRATA_RETURN_IF_CUDA_ERROR(
      cudaDeviceGetAttribute(&pools, cudaDevAttrMemoryPoolsSupported, ordinal),
      fmt::format("query memory pool support of cuda:{}", ordinal));
  DeviceCaps caps;
  caps.name = fmt::format("cuda:{}", ordinal);
  caps.description = prop.name;
  caps.kind = DeviceKind::kCuda;
  caps.ordinal = ordinal;
  caps.total_memory_bytes = prop.totalGlobalMem;
  caps.host_addressable_memory = false;
  caps.async_alloc = pools != 0;
  caps.copy_bandwidth_capped = false;
  return caps;
}

// Number of CUDA devices; 0 when the runtime reports no device or no driver.
int CudaDeviceCount() {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) {
    cudaGetLastError();  // clear, so later calls do not see it
    return 0;
  }
  return count;
}

cudaMemcpyKind ToCuda(CopyKind kind) {
  switch (kind) {
    case CopyKind::kHostToDevice:
      return cudaMemcpyHostToDevice;
    case CopyKind::kDeviceToHost:
      return cudaMemcpyDeviceToHost;
    case CopyKind::kDeviceToDevice:
      return cudaMemcpyDeviceToDevice;
    case CopyKind::kHostToHost:
      return cudaMemcpyHostToHost;
  }
  return cudaMemcpyDefault;
}

class CudaDevice final : public Device {
 public:
  explicit CudaDevice(DeviceCaps caps) : caps_(std::move(caps)), ordinal_(caps_.ordinal) {}

  Status Init() {
    CudaDeviceGuard device_guard;
    STRATA_RETURN_IF_ERROR(Select(device_guard, "open"));
    // The legacy default stream, the stream a native stream of 0 names (as
    // WrapNativeStream(nullptr)): a trainer that gives no stream runs its
    // kernels there, and work ordered on DefaultStream() must follow them.
    STRATA_ASSIGN_OR_RETURN(default_stream_,
                            MakeStream("default stream", std::optional<cudaStream_t>(nullptr)));
    if (caps_.async_alloc) {
      STRATA_RETURN_IF_CUDA_ERROR(cudaStreamCreateWithFlags(&alloc_stream_, cudaStreamNonBlocking),
                                  fmt::format("create allocation stream on {}", caps_.name));
      // Keep freed memory in the pool instead of returning it to the driver
      // at every synchronize: the engine reallocates the same sizes each step.
      cudaMemPool_t pool = nullptr;
      if (cudaDeviceGetDefaultMemPool(&pool, ordinal_) == cudaSuccess) {
        uint64_t threshold = std::numeric_limits<uint64_t>::max();
        cudaMemPoolSetAttribute(pool, cudaMemPoolAttrReleaseThreshold, &threshold);
      }
    }
    return OkStatus();
  }

  ~CudaDevice() override {
    CudaDeviceGuard device_guard;
    device_guard.Select(ordinal_);
    default_stream_.reset();
    if (alloc_stream_ != nullptr) {
      cudaStreamSynchronize(alloc_stream_);
      cudaStreamDestroy(alloc_stream_);
    }
  }

  const DeviceCaps& caps() const override { return caps_; }

  Result<DeviceBuffer> Allocate(size_t bytes) override {
    if (bytes == 0) return DeviceBuffer();
    CudaDeviceGuard device_guard;
    STRATA_RETURN_IF_ERROR(Select(device_guard, "allocate"));
    void* p = nullptr;
    const std::string op = fmt::format("allocate {} on {}", FormatBytes(bytes), caps_.name);
    if (caps_.async_alloc) {
      STRATA_RETURN_IF_CUDA_ERROR(cudaMallocAsync(&p, bytes, alloc_stream_), op);
      // Make the memory usable from every stream, not only alloc_stream_.
      cudaError_t err = cudaStreamSynchronize(alloc_stream_);
      if (err != cudaSuccess) {
        cudaFreeAsync(p, alloc_stream_);
        return CudaError(err, op);
      }
    } else {
      STRATA_RETURN_IF_CUDA_ERROR(cudaMalloc(&p, bytes), op);
    }
    return DeviceBuffer(this, p, bytes);
  }

  // Large allocations (the optimizer's state slab, tens of GB) are mapped,
  // faulted in on every core and then pinned with one cudaHostRegister:
  // cudaHostAlloc zeroes and pins every page on the calling thread, ~1-3 GB/s.
  // Small ones, and any that the registration refuses, take cudaHostAlloc.
  // Both are portable pinned memory; FreeHost tells them apart.
  static constexpr size_t kRegisterMinBytes = size_t{64} << 20;

  Result<HostAllocation> AllocateHost(size_t bytes) override {
    if (bytes == 0) return HostAllocation();
    CudaDeviceGuard device_guard;
    STRATA_RETURN_IF_ERROR(Select(device_guard, "allocate host memory"));
    const size_t rounded = (bytes + 4095) / 4096 * 4096;
    if (rounded >= kRegisterMinBytes) {
      Result<void*> mapped = internal::MapHugePageAligned(rounded);
      if (mapped.ok()) {
        internal::PrefaultInParallel(*mapped, rounded);
        // A forked child (a DataLoader worker) never needs the optimizer's
        // state, and copy-on-write of pages the device DMAs to is the bug
        // pinned-memory users guard against; cudaHostAlloc's own memory is
        // the driver's to handle.
        ::madvise(*mapped, rounded, MADV_DONTFORK);
        const cudaError_t err = cudaHostRegister(*mapped, rounded, cudaHostRegisterPortable);
        if (err == cudaSuccess) {
          std::lock_guard lock(registered_mu_);
          registered_.insert(*mapped);
          return HostAllocation(this, *mapped, rounded, HostMemoryLock::kLocked);
        }
        cudaGetLastError();  // not sticky, but clear it for the next caller's check
        ::munmap(*mapped, rounded);
        WarnOnce("cuda-host-register",
                 fmt::format("cudaHostRegister {} for {}: {}; using cudaHostAlloc, which pins "
                             "on one thread (slower to set up, the same afterwards)",
                             FormatBytes(rounded), caps_.name, cudaGetErrorString(err)));
      }
    }
    void* p = nullptr;
    STRATA_RETURN_IF_CUDA_ERROR(
        cudaHostAlloc(&p, rounded, cudaHostAllocPortable),
        fmt::format("cudaHostAlloc {} for {}", FormatBytes(rounded), caps_.name));
    return HostAllocation(this, p, rounded, HostMemoryLock::kLocked);
  }

  Result<Stream> CreateStream() override {
    CudaDeviceGuard device_guard;
    STRATA_RETURN_IF_ERROR(Select(device_guard, "create stream"));
    STRATA_ASSIGN_OR_RETURN(auto impl, MakeStream(fmt::format("stream {}", next_stream_id_++)));
    return Stream(std::move(impl));
  }

  Result<Event> CreateEvent() override {
    CudaDeviceGuard device_guard;
    STRATA_RETURN_IF_ERROR(Select(device_guard, "create event"));
    cudaEvent_t e = nullptr;
    STRATA_RETURN_IF_CUDA_ERROR(cudaEventCreateWithFlags(&e, cudaEventDisableTiming),
                                fmt::format("create event on {}", caps_.name));
    return Event(std::make_unique<CudaEvent>(this, ordinal_, e));
  }

  StreamRef DefaultStream() override { return StreamRef(default_stream_.get()); }

  Result<Stream> WrapNativeStream(void* native_stream) override {
    STRATA_ASSIGN_OR_RETURN(auto impl, MakeStream(fmt::format("native stream {}", native_stream),
                                                  std::optional<cudaStream_t>(
                                                      static_cast<cudaStream_t>(native_stream))));
    return Stream(std::move(impl));
  }

  Status CopyAsync(void* dst, const void* src, size_t bytes, CopyKind kind,
                   StreamRef stream) override {
    STRATA_ASSIGN_OR_RETURN(CudaStream * s, CheckStream(stream, "copy"));
    if (bytes == 0) return OkStatus();
    if (dst == nullptr || src == nullptr) {
      return InvalidArgumentError(fmt::format("copy {} {} on {}: null pointer", CopyKindName(kind),
                                              FormatBytes(bytes), s->name()));
    }
    if (!s->sticky()->ok()) return OkStatus();  // skipped: the stream already failed
    CudaDeviceGuard device_guard;
    STRATA_RETURN_IF_ERROR(Select(device_guard, "copy"));
    STRATA_RETURN_IF_CUDA_ERROR(cudaMemcpyAsync(dst, src, bytes, ToCuda(kind), s->stream()),
                                fmt::format("copy {} {} {} -> {} on {}", CopyKindName(kind),
                                            FormatBytes(bytes), src, dst, s->name()));
    return OkStatus();
  }

  Status LaunchHostTask(StreamRef stream, std::function<Status()> task) override {
    STRATA_ASSIGN_OR_RETURN(CudaStream * s, CheckStream(stream, "launch host task"));
    if (!task)
      return InvalidArgumentError(fmt::format("launch host task on {}: empty function", s->name()));
    CudaDeviceGuard device_guard;
    STRATA_RETURN_IF_ERROR(Select(device_guard, "launch host task"));
    auto payload =
        std::make_unique<HostTaskPayload>(HostTaskPayload{std::move(task), s->sticky(), s->name()});
    STRATA_RETURN_IF_CUDA_ERROR(cudaLaunchHostFunc(s->stream(), &RunHostTask, payload.get()),
                                fmt::format("launch host task on {}", s->name()));
    payload.release();  // owned by the callback now
    return OkStatus();
  }

  Status RecordEvent(Event& event, StreamRef stream) override {
    STRATA_ASSIGN_OR_RETURN(CudaStream * s, CheckStream(stream, "record event"));
    STRATA_ASSIGN_OR_RETURN(CudaEvent * e, CheckEvent(event, "record event"));
    CudaDeviceGuard device_guard;
    STRATA_RETURN_IF_ERROR(Select(device_guard, "record event"));
    STRATA_RETURN_IF_CUDA_ERROR(cudaEventRecord(e->event(), s->stream()),
                                fmt::format("record event on {}", s->name()));
    std::lock_guard lock(event_mu_);
    e->recorded_on = s->sticky();
    return OkStatus();
  }

  Status StreamWaitEvent(StreamRef stream, const Event& event) override {
    STRATA_ASSIGN_OR_RETURN(CudaStream * s, CheckStream(stream, "wait event"));
    STRATA_ASSIGN_OR_RETURN(CudaEvent * e, CheckEvent(event, "wait event"));
    CudaDeviceGuard device_guard;
    STRATA_RETURN_IF_ERROR(Select(device_guard, "wait event"));
    STRATA_RETURN_IF_CUDA_ERROR(cudaStreamWaitEvent(s->stream(), e->event(), 0),
                                fmt::format("wait event on {}", s->name()));
    return OkStatus();
  }

  Status EventSynchronize(const Event& event) override {
    STRATA_ASSIGN_OR_RETURN(CudaEvent * e, CheckEvent(event, "synchronize event"));
    CudaDeviceGuard device_guard;
    STRATA_RETURN_IF_ERROR(Select(device_guard, "synchronize event"));
    STRATA_RETURN_IF_CUDA_ERROR(cudaEventSynchronize(e->event()),
                                fmt::format("synchronize event on {}", caps_.name));
    std::shared_ptr<StickyError> sticky;
    {
      std::lock_guard lock(event_mu_);
      sticky = e->recorded_on;
    }
    return sticky ? sticky->Get() : OkStatus();
  }

  Result<bool> EventQuery(const Event& event) override {
    STRATA_ASSIGN_OR_RETURN(CudaEvent * e, CheckEvent(event, "query event"));
    CudaDeviceGuard device_guard;
    STRATA_RETURN_IF_ERROR(Select(device_guard, "query event"));
    cudaError_t err = cudaEventQuery(e->event());
    if (err == cudaSuccess) return true;
    if (err == cudaErrorNotReady) {
      cudaGetLastError();  // not an error; keep it out of later calls
      return false;
    }
    return CudaError(err, fmt::format("query event on {}", caps_.name));
  }

  Status StreamSynchronize(StreamRef stream) override {
    STRATA_ASSIGN_OR_RETURN(CudaStream * s, CheckStream(stream, "synchronize stream"));
    CudaDeviceGuard device_guard;
    STRATA_RETURN_IF_ERROR(Select(device_guard, "synchronize stream"));
    STRATA_RETURN_IF_CUDA_ERROR(cudaStreamSynchronize(s->stream()),
                                fmt::format("synchronize {}", s->name()));
    return s->sticky()->Get();
  }

  Status Synchronize() override {
    CudaDeviceGuard device_guard;
    STRATA_RETURN_IF_ERROR(Select(device_guard, "synchronize"));
    STRATA_RETURN_IF_CUDA_ERROR(cudaDeviceSynchronize(), fmt::format("synchronize {}", caps_.name));
    std::lock_guard lock(streams_mu_);
    Status first;
    for (const auto& [id, sticky] : stickies_) {
      Status s = sticky->Get();
      if (first.ok() && !s.ok()) first = std::move(s);
    }
    return first;
  }

 private:
  void FreeDevice(void* data, size_t bytes) override {
    CudaDeviceGuard device_guard;
    device_guard.Select(ordinal_);
    if (caps_.async_alloc) {
      cudaFreeAsync(data, alloc_stream_);
    } else {
      cudaFree(data);
    }
  }

  void FreeHost(void* data, size_t bytes, HostMemoryLock lock) override {
    CudaDeviceGuard device_guard;
    device_guard.Select(ordinal_);
    bool registered;
    {
      std::lock_guard guard(registered_mu_);
      registered = registered_.erase(data) > 0;
    }
    if (registered) {
      cudaHostUnregister(data);
      ::munmap(data, bytes);
    } else {
      cudaFreeHost(data);
    }
  }

  // Makes this device current until `guard` goes out of scope.
  Status Select(CudaDeviceGuard& guard, std::string_view op) {
    STRATA_RETURN_IF_CUDA_ERROR(guard.Select(ordinal_),
                                fmt::format("{} on {}: select device", op, caps_.name));
    return OkStatus();
  }

  // A stream registered for Synchronize() until it is destroyed; a new one,
  // or `borrowed` (the caller's, never destroyed here; may be the legacy
  // default stream, nullptr).
  Result<std::unique_ptr<CudaStream>> MakeStream(
      const std::string& label, std::optional<cudaStream_t> borrowed = std::nullopt) {
    cudaStream_t s = borrowed.value_or(nullptr);
    if (!borrowed) {
      STRATA_RETURN_IF_CUDA_ERROR(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking),
                                  fmt::format("create {} on {}", label, caps_.name));
    }
    auto sticky = std::make_shared<StickyError>();
    uint64_t id;
    {
      std::lock_guard lock(streams_mu_);
      id = next_registry_id_++;
      stickies_.emplace(id, sticky);
    }
    return std::make_unique<CudaStream>(this, ordinal_, s, fmt::format("{}:{}", caps_.name, label),
                                        std::move(sticky),
                                        [this, id] {
                                          std::lock_guard lock(streams_mu_);
                                          stickies_.erase(id);
                                        },
                                        borrowed ? CudaStream::Ownership::kBorrowed
                                                 : CudaStream::Ownership::kOwned);
  }

  Result<CudaStream*> CheckStream(StreamRef stream, std::string_view op) const {
    if (!stream) return InvalidArgumentError(fmt::format("{} on {}: null stream", op, caps_.name));
    if (stream.impl()->owner() != this) {
      return InvalidArgumentError(
          fmt::format("{} on {}: the stream belongs to another device", op, caps_.name));
    }
    return static_cast<CudaStream*>(stream.impl());
  }

  Result<CudaEvent*> CheckEvent(const Event& event, std::string_view op) const {
    if (!event) return InvalidArgumentError(fmt::format("{} on {}: empty event", op, caps_.name));
    if (event.impl()->owner() != this) {
      return InvalidArgumentError(
          fmt::format("{} on {}: the event belongs to another device", op, caps_.name));
    }
    return static_cast<CudaEvent*>(event.impl());
  }

  const DeviceCaps caps_;
  const int ordinal_;
  std::unique_ptr<CudaStream> default_stream_;
  cudaStream_t alloc_stream_ = nullptr;
  std::mutex event_mu_;
  std::mutex streams_mu_;
  std::mutex registered_mu_;
  std::unordered_set<void*> registered_;  // AllocateHost's cudaHostRegister'd mappings
  std::map<uint64_t, std::shared_ptr<StickyError>> stickies_;  // live streams
  uint64_t next_registry_id_ = 0;
  std::atomic<uint64_t> next_stream_id_{1};
};

}  // namespace

namespace internal {

std::vector<DeviceCaps> ListCudaDevices() {
  std::vector<DeviceCaps> out;
  const int count = CudaDeviceCount();
  for (int i = 0; i < count; ++i) {
    auto caps = QueryCaps(i);
    if (caps.ok()) out.push_back(*std::move(caps));
  }
  return out;
}

Result<cudaStream_t> CudaStreamOf(StreamRef stream) {
  if (!stream) return InvalidArgumentError("cuda stream of a null stream");
  if (stream.impl()->owner()->caps().kind != DeviceKind::kCuda) {
    return InvalidArgumentError(fmt::format(
        "cuda stream of a stream of device {}: not a CUDA device", stream.impl()->owner()->name()));
  }
  return static_cast<CudaStream*>(stream.impl())->stream();
}

Result<int> CudaOrdinalOf(const Device& device) {
  if (device.caps().kind != DeviceKind::kCuda) {
    return InvalidArgumentError(fmt::format("device {} is not a CUDA device", device.name()));
  }
  return device.caps().ordinal;
}

}  // namespace internal

Result<std::unique_ptr<Device>> CreateCudaDevice(int ordinal) {
  int count = 0;
  if (cudaError_t err = cudaGetDeviceCount(&count); err != cudaSuccess) {
    cudaGetLastError();
    return UnavailableError(
        fmt::format("open device cuda:{}: no CUDA device ({}: {}); use \"host\" or check the "
                    "driver with nvidia-smi",
                    ordinal, cudaGetErrorName(err), cudaGetErrorString(err)));
  }
  if (count == 0) {
    return UnavailableError(
        fmt::format("open device cuda:{}: no CUDA device present; use \"host\"", ordinal));
  }
  if (ordinal < 0 || ordinal >= count) {
    return NotFoundError(fmt::format("open device cuda:{}: only {} CUDA device(s), cuda:0..cuda:{}",
                                     ordinal, count, count - 1));
  }
  STRATA_ASSIGN_OR_RETURN(DeviceCaps caps, QueryCaps(ordinal));
  auto device = std::make_unique<CudaDevice>(std::move(caps));
  STRATA_RETURN_IF_ERROR(device->Init());
  return std::unique_ptr<Device>(std::move(device));
}

}  // namespace strata
