// Device: memory, streams, events and async copies of one accelerator, behind
// one small interface with two backends.
//
// The offload engine moves gradients down (D2H) and parameters up (H2D) on
// copy streams while the CPU optimizer runs, and orders its stages with
// events. This header is that vocabulary:
//   - Device          allocates device memory and page-locked host memory,
//                     creates streams and events, enqueues async work.
//   - DeviceBuffer    move-only device memory; freed on destruction.
//   - HostAllocation  move-only page-locked (where permitted) host memory.
//   - Stream          move-only owning queue of async work, executed in order.
//   - StreamRef       non-owning handle to a Stream (or the default stream).
//   - Event           a marker recorded on a stream; other streams or the host
//                     wait for it.
//
//   STRATA_ASSIGN_OR_RETURN(auto dev, OpenDevice("auto"));
//   STRATA_ASSIGN_OR_RETURN(DeviceBuffer d, dev->Allocate(bytes));
//   STRATA_ASSIGN_OR_RETURN(HostAllocation h, dev->AllocateHost(bytes));
//   STRATA_ASSIGN_OR_RETURN(Stream copy, dev->CreateStream());
//   STRATA_ASSIGN_OR_RETURN(Event done, dev->CreateEvent());
//   STRATA_RETURN_IF_ERROR(dev->CopyAsync(h.data(), d.data(), bytes,
//                                         CopyKind::kDeviceToHost, copy));
//   STRATA_RETURN_IF_ERROR(dev->RecordEvent(done, copy));
//   STRATA_RETURN_IF_ERROR(dev->LaunchHostFunc(copy, [&] { Consume(h); }));
//   STRATA_RETURN_IF_ERROR(dev->StreamSynchronize(copy));
//
// Backends:
//   - host (CreateHostDevice): emulated. Device memory is host memory under a
//     byte budget; each stream is a worker thread that runs its queue in
//     order (never inline in the caller); copies are memcpy, optionally
//     capped in bandwidth with a fixed latency, one link per direction shared
//     by every stream of the device (a PCIe model). Device memory is
//     host-addressable, so host twins of kernels run on it via LaunchHostFunc.
//   - cuda (CreateCudaDevice): cudaMallocFromPoolAsync from a memory pool of
//     the device's own, never the process-wide default pool (cudaMalloc
//     where memory pools are unsupported), non-blocking CUDA streams,
//     timing-free events, cudaMemcpyAsync (host memory must come from
//     AllocateHost or a PinnedPool: pageable copies serialize),
//     cudaLaunchHostFunc.
//
// Ordering: work enqueued on one stream runs in enqueue order. Streams run
// concurrently unless ordered by StreamWaitEvent. An enqueue call returns
// before the work runs; data is valid once the stream (or an event recorded
// after the work) is synchronized.
//
// Errors: calls return InvalidArgument synchronously for bad arguments (null
// or foreign stream, a copy range outside device memory on the host device).
// A failure of the async work itself is sticky per stream: work enqueued on
// that stream after it is skipped, and every later StreamSynchronize (and
// Synchronize) on it returns the first error. Events recorded after the
// failure still complete (waiters never hang) and EventSynchronize reports
// the error. (On CUDA, work already handed to the driver when the failure
// is observed still runs; host tasks and copies after that are skipped.)
// A device whose context became unusable returns DataLoss from then on (see
// IsDeviceLost below).
//
// Thread-safety: a Device and its methods are thread-safe. Stream, Event and
// buffer objects are values: one owner at a time; enqueuing on the same
// stream from several threads is safe but their relative order is whatever
// order the calls happen in. Every object made by a Device must be destroyed
// before the Device. Destroying a Stream waits for its queued work; destroy
// a buffer only after the work that uses it completed.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "runtime/status.h"

namespace strata {

class Device;

enum class DeviceKind : uint8_t { kHost = 0, kCuda = 1 };
std::string_view DeviceKindName(DeviceKind kind);  // "host", "cuda"

enum class CopyKind : uint8_t {
  kHostToDevice = 0,
  kDeviceToHost = 1,
  kDeviceToDevice = 2,
  kHostToHost = 3,
};
std::string_view CopyKindName(CopyKind kind);  // "H2D", "D2H", "D2D", "H2H"

// What a backend can do; the caller supplies the fallback for what it cannot.
struct DeviceCaps {
  std::string name;         // "host", "cuda:0"
  std::string description;  // "NVIDIA H100 80GB HBM3", "emulated on host memory"
  DeviceKind kind = DeviceKind::kHost;
  int ordinal = 0;                       // CUDA device ordinal; 0 for host
  uint64_t total_memory_bytes = 0;       // device memory (the budget on the host device)
  bool host_addressable_memory = false;  // device pointers may be dereferenced on the CPU
  bool async_alloc = false;              // cudaMallocAsync memory pools
  bool copy_bandwidth_capped = false;    // host device with a PCIe model
};

namespace internal {
// Backend state behind Stream and Event; defined by each backend.
class StreamImpl {
 public:
  explicit StreamImpl(const Device* owner) : owner_(owner) {}
  virtual ~StreamImpl() = default;
  const Device* owner() const { return owner_; }

 private:
  const Device* owner_;
};
class EventImpl {
 public:
  explicit EventImpl(const Device* owner) : owner_(owner) {}
  virtual ~EventImpl() = default;
  const Device* owner() const { return owner_; }

 private:
  const Device* owner_;
};
// Tests only: the `nth` LaunchHostTask on a host device from now (1: the
// next one) returns Internal instead of enqueueing, as a CUDA launch that
// fails at enqueue would. 0 ends it.
void FailHostTaskForTest(int nth);
}  // namespace internal

// Non-owning handle to a stream; cheap to copy. Valid while the Stream (or,
// for DefaultStream(), the Device) lives. A default-constructed StreamRef is
// null and rejected with InvalidArgument.
class StreamRef {
 public:
  StreamRef() = default;
  explicit StreamRef(internal::StreamImpl* impl) : impl_(impl) {}
  internal::StreamImpl* impl() const { return impl_; }
  explicit operator bool() const { return impl_ != nullptr; }
  friend bool operator==(StreamRef a, StreamRef b) { return a.impl_ == b.impl_; }

 private:
  internal::StreamImpl* impl_ = nullptr;
};

// An owning stream. Move-only; destruction waits for the queued work.
class Stream {
 public:
  Stream() = default;
  explicit Stream(std::unique_ptr<internal::StreamImpl> impl) : impl_(std::move(impl)) {}
  Stream(Stream&&) noexcept = default;
  Stream& operator=(Stream&&) noexcept = default;

  StreamRef ref() const { return StreamRef(impl_.get()); }
  operator StreamRef() const { return ref(); }  // NOLINT: a Stream is usable where a ref is
  explicit operator bool() const { return impl_ != nullptr; }

 private:
  std::unique_ptr<internal::StreamImpl> impl_;
};

// A marker in a stream's queue. Move-only. Recording it again moves the
// marker; waits and queries refer to the latest record made before them. An
// event never recorded counts as complete.
class Event {
 public:
  Event() = default;
  explicit Event(std::unique_ptr<internal::EventImpl> impl) : impl_(std::move(impl)) {}
  Event(Event&&) noexcept = default;
  Event& operator=(Event&&) noexcept = default;

  internal::EventImpl* impl() const { return impl_.get(); }
  explicit operator bool() const { return impl_ != nullptr; }

 private:
  std::unique_ptr<internal::EventImpl> impl_;
};

// Device memory. Move-only; frees on destruction (no-op when empty). Aligned
// to at least 256 bytes. `bytes()` is the size asked for.
class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  DeviceBuffer(Device* device, void* data, size_t bytes)
      : device_(device), data_(data), bytes_(bytes) {}
  DeviceBuffer(DeviceBuffer&& other) noexcept { *this = std::move(other); }
  DeviceBuffer& operator=(DeviceBuffer&& other) noexcept;
  ~DeviceBuffer() { Reset(); }

  void* data() const { return data_; }
  size_t bytes() const { return bytes_; }
  template <typename T>
  T* as() const {
    return static_cast<T*>(data_);
  }
  void Reset();

 private:
  Device* device_ = nullptr;
  void* data_ = nullptr;
  size_t bytes_ = 0;
};

enum class HostMemoryLock : uint8_t { kUnlocked = 0, kLocked = 1 };

// Host memory for async copies, 4096-aligned, size rounded up to 4096.
// Move-only; freed on destruction. `locked()` says whether it is page-locked
// (cudaHostAlloc, or mlock on the host device); when the OS refuses mlock
// (EPERM/ENOMEM) the host device falls back to unlocked memory and warns once.
class HostAllocation {
 public:
  HostAllocation() = default;
  HostAllocation(Device* device, void* data, size_t bytes, HostMemoryLock lock)
      : device_(device), data_(data), bytes_(bytes), lock_(lock) {}
  HostAllocation(HostAllocation&& other) noexcept { *this = std::move(other); }
  HostAllocation& operator=(HostAllocation&& other) noexcept;
  ~HostAllocation() { Reset(); }

  void* data() const { return data_; }
  size_t bytes() const { return bytes_; }  // rounded up to 4096
  bool locked() const { return lock_ == HostMemoryLock::kLocked; }
  void Reset();

 private:
  Device* device_ = nullptr;
  void* data_ = nullptr;
  size_t bytes_ = 0;
  HostMemoryLock lock_ = HostMemoryLock::kUnlocked;
};

class Device {
 public:
  virtual ~Device() = default;
  Device(const Device&) = delete;
  Device& operator=(const Device&) = delete;

  virtual const DeviceCaps& caps() const = 0;
  const std::string& name() const { return caps().name; }

  // ResourceExhausted when the device (or its budget) is full.
  virtual Result<DeviceBuffer> Allocate(size_t bytes) = 0;
  // Page-locked where permitted; see HostAllocation.
  virtual Result<HostAllocation> AllocateHost(size_t bytes) = 0;

  virtual Result<Stream> CreateStream() = 0;
  virtual Result<Event> CreateEvent() = 0;
  // The stream for work with no stream of its own; valid while the device
  // lives. On the host device a stream worker like any other. On CUDA the
  // legacy default stream (native stream 0, the same queue as
  // WrapNativeStream(nullptr)): a trainer that names no stream runs its
  // kernels there, so work ordered on DefaultStream() follows them. It is
  // not private to Strata; work that must not wait for the caller's takes a
  // CreateStream() of its own.
  virtual StreamRef DefaultStream() = 0;
  // A Stream over a native stream the caller owns (a cudaStream_t on CUDA,
  // e.g. PyTorch's current stream), so work enqueued on it joins the
  // caller's queue with no extra synchronization. Destroying the Stream
  // neither waits for nor destroys the native stream. InvalidArgument on the
  // host device, which has no native streams.
  virtual Result<Stream> WrapNativeStream(void* native_stream);

  // Copies `bytes` from `src` to `dst` in stream order. Both ranges must stay
  // valid until the copy completes.
  virtual Status CopyAsync(void* dst, const void* src, size_t bytes, CopyKind kind,
                           StreamRef stream) = 0;
  // Runs `task` on the host in stream order (cudaLaunchHostFunc on CUDA; the
  // stream's worker on the host device). A non-OK result becomes the
  // stream's sticky error. The task must not enqueue work and then wait for
  // it on the same stream, and on CUDA must not call CUDA.
  virtual Status LaunchHostTask(StreamRef stream, std::function<Status()> task) = 0;
  Status LaunchHostFunc(StreamRef stream, std::function<void()> fn);

  virtual Status RecordEvent(Event& event, StreamRef stream) = 0;
  // Work enqueued on `stream` after this call waits for the event's latest record.
  virtual Status StreamWaitEvent(StreamRef stream, const Event& event) = 0;
  // Blocks until the event's latest record completed; its stream's sticky error if any.
  virtual Status EventSynchronize(const Event& event) = 0;
  // true when complete; does not block.
  virtual Result<bool> EventQuery(const Event& event) = 0;
  // Blocks until all work enqueued on `stream` so far completed; the stream's
  // sticky error if any.
  virtual Status StreamSynchronize(StreamRef stream) = 0;
  // Synchronizes every stream of the device; the first sticky error if any.
  virtual Status Synchronize() = 0;
  // Hands device memory the allocator keeps cached for reuse (freed
  // DeviceBuffers) back to the driver, so other allocators in the process
  // (torch's) can have it; buffers still alive are untouched. Waits for the
  // frees already enqueued. The engine calls it at the end of Create (the
  // rate probe's temporary buffers; after a failed Create, all it
  // allocated). A no-op where nothing is cached (the host device, and CUDA
  // without memory pools).
  virtual Status ReleaseCachedMemory() { return OkStatus(); }

 protected:
  Device() = default;

 private:
  friend class DeviceBuffer;
  friend class HostAllocation;
  // Called by the buffers' destructors; must not fail.
  virtual void FreeDevice(void* data, size_t bytes) = 0;
  virtual void FreeHost(void* data, size_t bytes, HostMemoryLock lock) = 0;
};

// A device whose context became unusable (on CUDA, a sticky error: an
// illegal address, a launch failure, an uncorrectable ECC error, ...) returns
// DataLoss whose message contains kDeviceLostText, says that the process
// must restart and that the last checkpoint is intact; the device then
// returns it from every later call. DataLoss because what the device held
// (device-resident optimizer state, params, gradients in flight) is lost to
// this process, and the way back is a checkpoint, loaded in a new process:
// no retry here can succeed. IsDeviceLost() tells it from a damaged file's
// DataLoss, which a retry or a load in this process can fix.
inline constexpr std::string_view kDeviceLostText = "the CUDA context is unusable";
inline bool IsDeviceLost(const Status& status) {
  return status.code() == StatusCode::kDataLoss &&
         status.message().find(kDeviceLostText) != std::string_view::npos;
}

// Whether the host device treats host memory it did not allocate as device
// memory in copies. kAccept is for trainers whose tensors are ordinary host
// memory (PyTorch CPU tensors, the C API): the engine reads and writes them
// in place. kReject keeps the range check that catches a wrong copy kind.
enum class ExternalMemory : uint8_t { kReject = 0, kAccept = 1 };

// Options of the emulated host device. Zero bandwidth means unlimited.
struct HostDeviceOptions {
  uint64_t memory_budget_bytes = 0;  // 0: half of physical memory
  double h2d_bytes_per_sec = 0;      // one link, shared by all streams
  double d2h_bytes_per_sec = 0;      // a second link, parallel to H2D
  double copy_latency_sec = 0;       // added to every H2D/D2H copy
  ExternalMemory external_memory = ExternalMemory::kReject;
};

// InvalidArgument for negative rates or latency.
Result<std::unique_ptr<Device>> CreateHostDevice(const HostDeviceOptions& options = {});
// Unavailable when the build has no CUDA, or no GPU/driver is present
// (cudaGetDeviceCount failing means "no CUDA device"); NotFound past the last
// ordinal.
Result<std::unique_ptr<Device>> CreateCudaDevice(int ordinal);
// Every device this process can open: "host" first, then "cuda:0", ...
std::vector<DeviceCaps> ListDevices();
// "host", "cuda:N", or "auto" (cuda:0 where present, else host).
// InvalidArgument for other names.
Result<std::unique_ptr<Device>> OpenDevice(std::string_view name,
                                           const HostDeviceOptions& host_options = {});

}  // namespace strata
