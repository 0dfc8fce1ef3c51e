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

bool IsStickyCudaError(cudaError_t err) {
  switch (err) {
    case cudaErrorIllegalAddress:
    case cudaErrorLaunchTimeout:
    case cudaErrorAssert:
    case cudaErrorHardwareStackError:
    case cudaErrorIllegalInstruction:
    case cudaErrorMisalignedAddress:
    case cudaErrorInvalidAddressSpace:
    case cudaErrorInvalidPc:
    case cudaErrorLaunchFailure:
    case cudaErrorTensorMemoryLeak:
    case cudaErrorContained:
    case cudaErrorExternalDevice:
    case cudaErrorMpsClientTerminated:
    case cudaErrorECCUncorrectable:
      return true;
    default:
      return false;
  }
}

Status CudaErrorStatus(cudaError_t err, std::string_view op) {
  if (err == cudaSuccess) return OkStatus();
  std::string m = fmt::format("{}: {} ({})", op, cudaGetErrorName(err), cudaGetErrorString(err));
  if (IsStickyCudaError(err)) {
    // DataLoss, not Internal: nothing in this process can recover. The
    // context (shared with torch) fails every later call, and what the GPU
    // held (device-resident optimizer state, params, gradients in flight)
    // is gone for this process: the way back is the last checkpoint,
    // loaded in a new process. That is status.h's DataLoss ("restore a
    // checkpoint"); FailedPrecondition and Unavailable would read as "fix
    // the state, or wait, and call again" (the engine's FailedPrecondition
    // for a failed step is answered by RetryStep()). The message carries
    // kDeviceLostText so that the engine and the Python plug-in tell it from
    // a damaged file's DataLoss (IsDeviceLost) and offer no retry.
    return DataLossError(fmt::format(
        "{}; {} after this error: CUDA fails every later call in this process, torch's "
        "included, so no retry here can succeed. Restart the process and resume from the "
        "last checkpoint, which is intact (a checkpoint is on disk; a save this error "
        "interrupted is not committed, and the one before it stays)",
        m, kDeviceLostText));
  }
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

Status CudaError(cudaError_t err, std::string_view op) {
  if (err == cudaSuccess) return OkStatus();
  (void)cudaGetLastError();  // see the header: a sticky error stays
  return CudaErrorStatus(err, op);
}

Status OutOfDeviceMemoryError(const Status& oom, std::string_view device,
                              const CudaMemoryFigures& figures) {
  std::string m(oom.message());
  if (figures.have_gpu) {
    m += fmt::format(
        "; {} has {} free of {} (memory that other allocators in this process keep cached, "
        "torch's included, counts as used: torch.cuda.empty_cache() hands torch's back)",
        device, FormatBytes(figures.free_bytes), FormatBytes(figures.total_bytes));
  }
  if (figures.have_pool) {
    m +=
        fmt::format("; Strata's memory pool holds {}, {} of it in use",
                    FormatBytes(figures.pool_reserved_bytes), FormatBytes(figures.pool_used_bytes));
  }
  return Status(oom.code(), std::move(m));
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

// Inside CudaDevice: like STRATA_RETURN_IF_CUDA_ERROR, through Fail(), so a
// sticky error is remembered.
#define STRATA_RETURN_IF_DEVICE_CUDA_ERROR(expr, op)                            \
  do {                                                                          \
    if (cudaError_t strata_cuda_err_ = (expr); strata_cuda_err_ != cudaSuccess) \
      return Fail(strata_cuda_err_, (op));                                      \
  } while (false)

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
      STRATA_RETURN_IF_DEVICE_CUDA_ERROR(
          cudaStreamCreateWithFlags(&alloc_stream_, cudaStreamNonBlocking),
          fmt::format("create allocation stream on {}", caps_.name));
      STRATA_RETURN_IF_ERROR(CreatePool());
    }
    return OkStatus();
  }

  ~CudaDevice() override {
    CudaDeviceGuard device_guard;
    device_guard.Select(ordinal_);
    default_stream_.reset();  // borrowed: nothing to wait for or destroy
    if (alloc_stream_ != nullptr) {
      // Every buffer is gone by now (device.h: objects die before their
      // device), but its cudaFreeAsync on alloc_stream_ may not have run.
      // Wait for them, so that the pool has no outstanding allocation when
      // it is destroyed and its memory goes back to the driver at once
      // (cudaMemPoolDestroy defers that while allocations are outstanding);
      // then the stream, which the pool's frees were ordered on.
      cudaStreamSynchronize(alloc_stream_);
      if (pool_ != nullptr) cudaMemPoolDestroy(pool_);
      cudaStreamDestroy(alloc_stream_);
    }
    (void)cudaGetLastError();  // nothing to report from a destructor
  }

  const DeviceCaps& caps() const override { return caps_; }

  Result<DeviceBuffer> Allocate(size_t bytes) override {
    if (bytes == 0) return DeviceBuffer();
    CudaDeviceGuard device_guard;
    STRATA_RETURN_IF_ERROR(Select(device_guard, "allocate"));
    const std::string op = fmt::format("allocate {} on {}", FormatBytes(bytes), caps_.name);
    void* p = nullptr;
    cudaError_t err = AllocateNow(&p, bytes);
    if (err == cudaErrorMemoryAllocation && pool_ != nullptr) {
      // The pool keeps what was freed (its release threshold), possibly in
      // pieces this request does not fit: hand them back to the driver and
      // try once more. The trim counts only frees the host has seen complete.
      (void)cudaGetLastError();
      err = cudaStreamSynchronize(alloc_stream_);
      if (err == cudaSuccess) err = cudaMemPoolTrimTo(pool_, 0);
      if (err == cudaSuccess) err = AllocateNow(&p, bytes);
    }
    if (err == cudaErrorMemoryAllocation) return OutOfMemory(op);
    if (err != cudaSuccess) return Fail(err, op);
    return DeviceBuffer(this, p, bytes);
  }

  Status ReleaseCachedMemory() override {
    if (alloc_mode_ == AllocMode::kMalloc) return OkStatus();  // cudaFree caches nothing
    CudaDeviceGuard device_guard;
    STRATA_RETURN_IF_ERROR(Select(device_guard, "release cached memory"));
    // Frees are enqueued on alloc_stream_, and cudaMemPoolTrimTo counts a
    // freed allocation as outstanding until the host has seen the free
    // complete: synchronize first.
    STRATA_RETURN_IF_DEVICE_CUDA_ERROR(
        cudaStreamSynchronize(alloc_stream_),
        fmt::format("release cached memory on {}: synchronize the allocation stream", caps_.name));
    // kCurrentPool: the pool is not Strata's, and its own release threshold
    // (0 unless someone raised it) already decided at that synchronize what
    // it keeps; it is left alone.
    if (alloc_mode_ == AllocMode::kOwnPool) {
      STRATA_RETURN_IF_DEVICE_CUDA_ERROR(
          cudaMemPoolTrimTo(pool_, 0),
          fmt::format("release cached memory on {}: cudaMemPoolTrimTo", caps_.name));
    }
    return OkStatus();
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
    STRATA_RETURN_IF_DEVICE_CUDA_ERROR(
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
    STRATA_RETURN_IF_DEVICE_CUDA_ERROR(cudaEventCreateWithFlags(&e, cudaEventDisableTiming),
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
    STRATA_RETURN_IF_DEVICE_CUDA_ERROR(cudaMemcpyAsync(dst, src, bytes, ToCuda(kind), s->stream()),
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
    STRATA_RETURN_IF_DEVICE_CUDA_ERROR(cudaLaunchHostFunc(s->stream(), &RunHostTask, payload.get()),
                                       fmt::format("launch host task on {}", s->name()));
    payload.release();  // owned by the callback now
    return OkStatus();
  }

  Status RecordEvent(Event& event, StreamRef stream) override {
    STRATA_ASSIGN_OR_RETURN(CudaStream * s, CheckStream(stream, "record event"));
    STRATA_ASSIGN_OR_RETURN(CudaEvent * e, CheckEvent(event, "record event"));
    CudaDeviceGuard device_guard;
    STRATA_RETURN_IF_ERROR(Select(device_guard, "record event"));
    STRATA_RETURN_IF_DEVICE_CUDA_ERROR(cudaEventRecord(e->event(), s->stream()),
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
    STRATA_RETURN_IF_DEVICE_CUDA_ERROR(cudaStreamWaitEvent(s->stream(), e->event(), 0),
                                       fmt::format("wait event on {}", s->name()));
    return OkStatus();
  }

  Status EventSynchronize(const Event& event) override {
    STRATA_ASSIGN_OR_RETURN(CudaEvent * e, CheckEvent(event, "synchronize event"));
    CudaDeviceGuard device_guard;
    STRATA_RETURN_IF_ERROR(Select(device_guard, "synchronize event"));
    STRATA_RETURN_IF_DEVICE_CUDA_ERROR(cudaEventSynchronize(e->event()),
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
    return Fail(err, fmt::format("query event on {}", caps_.name));
  }

  Status StreamSynchronize(StreamRef stream) override {
    STRATA_ASSIGN_OR_RETURN(CudaStream * s, CheckStream(stream, "synchronize stream"));
    CudaDeviceGuard device_guard;
    STRATA_RETURN_IF_ERROR(Select(device_guard, "synchronize stream"));
    STRATA_RETURN_IF_DEVICE_CUDA_ERROR(cudaStreamSynchronize(s->stream()),
                                       fmt::format("synchronize {}", s->name()));
    return s->sticky()->Get();
  }

  Status Synchronize() override {
    CudaDeviceGuard device_guard;
    STRATA_RETURN_IF_ERROR(Select(device_guard, "synchronize"));
    STRATA_RETURN_IF_DEVICE_CUDA_ERROR(cudaDeviceSynchronize(),
                                       fmt::format("synchronize {}", caps_.name));
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
    // Memory from a pool (Strata's own or the current one) goes back to it
    // in alloc_stream_'s order; cudaFreeAsync returns it to whichever pool
    // it came from.
    const cudaError_t err =
        alloc_mode_ == AllocMode::kMalloc ? cudaFree(data) : cudaFreeAsync(data, alloc_stream_);
    if (err != cudaSuccess) (void)cudaGetLastError();  // not the next launch's error
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

  // Makes this device current until `guard` goes out of scope; once the
  // context is lost, refuses with the error that lost it.
  Status Select(CudaDeviceGuard& guard, std::string_view op) {
    STRATA_RETURN_IF_ERROR(Lost(op));
    STRATA_RETURN_IF_DEVICE_CUDA_ERROR(guard.Select(ordinal_),
                                       fmt::format("{} on {}: select device", op, caps_.name));
    return OkStatus();
  }

  // The Status of a failed CUDA call of this device (CudaError). A sticky
  // error is also remembered: the context is unusable for the rest of the
  // process, and every later call of this device returns it (Lost) instead
  // of reaching the driver, whatever the call.
  Status Fail(cudaError_t err, std::string_view op) {
    Status s = CudaError(err, op);
    if (internal::IsStickyCudaError(err)) {
      std::lock_guard lock(lost_mu_);
      if (lost_.ok()) lost_ = s;
      lost_flag_.store(true, std::memory_order_release);
    }
    return s;
  }

  // OK until a call of this device failed with a sticky error; then that
  // error (DataLoss, IsDeviceLost), naming `op` as refused.
  Status Lost(std::string_view op) {
    if (!lost_flag_.load(std::memory_order_acquire)) return OkStatus();
    std::lock_guard lock(lost_mu_);
    return lost_.WithContext(
        fmt::format("{} on {}: refused, the device failed earlier", op, caps_.name));
  }

  // Device memory comes from a memory pool of this device's own, never from
  // the device's default pool: a pool's settings are process-wide, and
  // raising the default pool's release threshold (as this backend did)
  // kept every byte Strata freed away from torch (whose caching allocator
  // takes cudaMalloc) and anything else in the process. This pool keeps
  // what is freed (release threshold UINT64_MAX, so a buffer made again, a
  // save's or a lazily made one, takes no trip to the driver) until
  // ReleaseCachedMemory(), an allocation that does not fit otherwise, or
  // the device's destruction hands it back. It is never made the device's
  // current pool (cudaDeviceSetMemPool is process-wide as well), and its
  // memory is accessible from this device only, as the default pool's is by
  // default.
  // Where it cannot be made (a driver without pool support for it:
  // cudaErrorNotSupported), allocations take cudaMallocAsync from the
  // device's current pool, whose settings are left alone.
  Status CreatePool() {
    cudaMemPoolProps props{};  // the reserved bytes must be 0
    props.allocType = cudaMemAllocationTypePinned;
    props.handleTypes = cudaMemHandleTypeNone;  // no IPC
    props.location.type = cudaMemLocationTypeDevice;
    props.location.id = ordinal_;
    cudaMemPool_t pool = nullptr;
    cudaError_t err = cudaMemPoolCreate(&pool, &props);
    if (err == cudaSuccess) {
      uint64_t threshold = std::numeric_limits<uint64_t>::max();  // cuuint64_t
      err = cudaMemPoolSetAttribute(pool, cudaMemPoolAttrReleaseThreshold, &threshold);
      if (err != cudaSuccess) {
        cudaMemPoolDestroy(pool);  // empty: released at once
        pool = nullptr;
      }
    }
    if (err == cudaSuccess) {
      pool_ = pool;
      alloc_mode_ = AllocMode::kOwnPool;
      return OkStatus();
    }
    if (internal::IsStickyCudaError(err)) {
      return Fail(err, fmt::format("create a memory pool on {}", caps_.name));
    }
    (void)cudaGetLastError();
    alloc_mode_ = AllocMode::kCurrentPool;
    WarnOnce("cuda-mempool-create",
             fmt::format("create a memory pool on {}: {} ({}); allocating with cudaMallocAsync "
                         "from the device's current memory pool instead (its settings are left "
                         "as they are)",
                         caps_.name, cudaGetErrorName(err), cudaGetErrorString(err)));
    return OkStatus();
  }

  // One allocation attempt, usable from every stream on success (an
  // allocation from a pool is ordered on alloc_stream_ only, until that
  // stream is synchronized).
  cudaError_t AllocateNow(void** p, size_t bytes) {
    if (alloc_mode_ == AllocMode::kMalloc) return cudaMalloc(p, bytes);
    cudaError_t err = alloc_mode_ == AllocMode::kOwnPool
                          ? cudaMallocFromPoolAsync(p, bytes, pool_, alloc_stream_)
                          : cudaMallocAsync(p, bytes, alloc_stream_);
    if (err != cudaSuccess) return err;
    err = cudaStreamSynchronize(alloc_stream_);
    if (err != cudaSuccess) {
      cudaFreeAsync(*p, alloc_stream_);
      *p = nullptr;
    }
    return err;
  }

  // Allocate's out-of-memory error: the GPU's free and total memory, and
  // what Strata's pool holds (OutOfDeviceMemoryError).
  Status OutOfMemory(std::string_view op) {
    Status oom = CudaError(cudaErrorMemoryAllocation, op);  // clears the last error
    internal::CudaMemoryFigures figures;
    if (cudaMemGetInfo(&figures.free_bytes, &figures.total_bytes) == cudaSuccess) {
      figures.have_gpu = true;
    } else {
      (void)cudaGetLastError();
    }
    if (pool_ != nullptr) {
      uint64_t reserved = 0;  // cuuint64_t
      uint64_t used = 0;
      if (cudaMemPoolGetAttribute(pool_, cudaMemPoolAttrReservedMemCurrent, &reserved) ==
              cudaSuccess &&
          cudaMemPoolGetAttribute(pool_, cudaMemPoolAttrUsedMemCurrent, &used) == cudaSuccess) {
        figures.have_pool = true;
        figures.pool_reserved_bytes = reserved;
        figures.pool_used_bytes = used;
      } else {
        (void)cudaGetLastError();
      }
    }
    return internal::OutOfDeviceMemoryError(oom, caps_.name, figures);
  }

  // A stream registered for Synchronize() until it is destroyed; a new one,
  // or `borrowed` (the caller's, never destroyed here; may be the legacy
  // default stream, nullptr).
  Result<std::unique_ptr<CudaStream>> MakeStream(
      const std::string& label, std::optional<cudaStream_t> borrowed = std::nullopt) {
    cudaStream_t s = borrowed.value_or(nullptr);
    if (!borrowed) {
      STRATA_RETURN_IF_DEVICE_CUDA_ERROR(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking),
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
  // How Allocate gets memory; set by Init, then read only. kOwnPool and
  // kCurrentPool allocate and free on alloc_stream_.
  enum class AllocMode : uint8_t { kMalloc = 0, kCurrentPool = 1, kOwnPool = 2 };
  AllocMode alloc_mode_ = AllocMode::kMalloc;
  cudaStream_t alloc_stream_ = nullptr;
  cudaMemPool_t pool_ = nullptr;  // kOwnPool: Strata's own; destroyed with the device
  // The sticky error that made the context unusable (Fail/Lost); never
  // cleared, a context does not recover.
  std::atomic<bool> lost_flag_{false};
  std::mutex lost_mu_;
  Status lost_;
  std::mutex event_mu_;
  std::mutex streams_mu_;
  std::mutex registered_mu_;
  std::unordered_set<void*> registered_;  // AllocateHost's cudaHostRegister'd mappings
  std::map<uint64_t, std::shared_ptr<StickyError>> stickies_;  // live streams
  uint64_t next_registry_id_ = 0;
  std::atomic<uint64_t> next_stream_id_{1};
};

#undef STRATA_RETURN_IF_DEVICE_CUDA_ERROR

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
