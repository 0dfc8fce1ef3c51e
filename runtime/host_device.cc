// The emulated host device: device memory is host memory under a budget,
// streams are worker threads, events are counters, copies are memcpy through
// a modeled PCIe link (one per direction, shared by all streams).
#include <fmt/format.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <exception>
#include <map>
#include <mutex>
#include <optional>
#include <thread>
#include <vector>

#include "runtime/device.h"
#include "runtime/host_pages_internal.h"
#include "runtime/log.h"
#include "runtime/units.h"

namespace strata {
namespace {

// FailHostTaskForTest: host tasks left until the one that fails (0: none).
std::atomic<int> host_task_fault{0};

using Clock = std::chrono::steady_clock;

constexpr size_t kDeviceAlignment = 256;
constexpr size_t kHostAlignment = 4096;
size_t RoundUp(size_t n, size_t to) { return (n + to - 1) / to * to; }

// mlock through the raw system call: sanitizer runtimes replace mlock(3) with
// a no-op that always succeeds, which would hide the refused-lock fallback
// from the TSan/ASan test runs.
int Mlock(void* p, size_t bytes) { return static_cast<int>(::syscall(SYS_mlock, p, bytes)); }

// One direction of the modeled PCIe link. Copies reserve link time in the
// order they start, so concurrent copies share the bandwidth; completion is
// a deadline computed from bytes (sleep-until, so it does not drift).
class Link {
 public:
  Link(double bytes_per_sec, double latency_sec)
      : bytes_per_sec_(bytes_per_sec), latency_sec_(latency_sec) {}

  bool modeled() const { return bytes_per_sec_ > 0 || latency_sec_ > 0; }

  // The time at which a copy of `bytes` completes when it may start at
  // `ready` (once it is enqueued and its stream's previous work is done):
  // like a DMA engine, the link does not wait for the worker thread to wake.
  Clock::time_point Reserve(size_t bytes, Clock::time_point ready) {
    Clock::duration busy{0};
    if (bytes_per_sec_ > 0) {
      busy = std::chrono::duration_cast<Clock::duration>(
          std::chrono::duration<double>(static_cast<double>(bytes) / bytes_per_sec_));
    }
    std::lock_guard lock(mu_);
    const auto start = std::max(ready, next_free_);
    next_free_ = start + busy;
    return next_free_ +
           std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(latency_sec_));
  }

 private:
  const double bytes_per_sec_;
  const double latency_sec_;
  std::mutex mu_;
  Clock::time_point next_free_{};
};

struct EventState {
  std::mutex mu;
  std::condition_variable cv;
  uint64_t recorded = 0;   // records enqueued
  uint64_t completed = 0;  // highest record that ran
  Status status;           // the recording stream's sticky error at completion
};

// A stream's queue and its worker thread.
class StreamCore {
 public:
  struct Op {
    std::function<Status()> fn;
    bool run_after_error;  // event records and waits keep ordering after a failure
  };

  explicit StreamCore(std::string name) : name_(std::move(name)) {
    worker_ = std::thread([this] { Run(); });
  }
  ~StreamCore() { Shutdown(); }

  const std::string& name() const { return name_; }

  // Worker thread only: when the previous op completed, in the link model's
  // time (a modelled copy's deadline; otherwise when the op returned). A
  // modelled copy reports its deadline with SetModelEnd.
  Clock::time_point previous_end() const { return previous_end_; }
  void SetModelEnd(Clock::time_point end) { model_end_ = end; }

  void Enqueue(Op op) {
    {
      std::lock_guard lock(mu_);
      queue_.push_back(std::move(op));
      ++enqueued_;
    }
    work_cv_.notify_one();
  }

  Status Sync() {
    std::unique_lock lock(mu_);
    const uint64_t target = enqueued_;
    done_cv_.wait(lock, [&] { return done_ >= target; });
    return error_;
  }

  Status error() {
    std::lock_guard lock(mu_);
    return error_;
  }

  // Drains the queue, then stops the worker. Idempotent.
  void Shutdown() {
    {
      std::lock_guard lock(mu_);
      if (stop_) return;
      stop_ = true;
    }
    work_cv_.notify_one();
    if (worker_.joinable()) worker_.join();
  }

 private:
  void Run() {
    std::unique_lock lock(mu_);
    for (;;) {
      work_cv_.wait(lock, [&] { return stop_ || !queue_.empty(); });
      if (queue_.empty()) return;  // stop_ and drained
      Op op = std::move(queue_.front());
      queue_.pop_front();
      const bool failed = !error_.ok();
      lock.unlock();
      Status s;
      if (!failed || op.run_after_error) {
        try {
          s = op.fn();
        } catch (const std::exception& e) {
          s = InternalError(fmt::format("host task threw: {}", e.what()));
        } catch (...) {
          s = InternalError("host task threw a non-standard exception");
        }
      }
      previous_end_ = model_end_ ? *model_end_ : Clock::now();
      model_end_.reset();
      lock.lock();
      if (!s.ok() && error_.ok()) error_ = std::move(s).WithContext("async work on " + name_);
      ++done_;
      done_cv_.notify_all();
    }
  }

  const std::string name_;
  std::mutex mu_;
  std::condition_variable work_cv_;
  std::condition_variable done_cv_;
  std::deque<Op> queue_;
  uint64_t enqueued_ = 0;
  uint64_t done_ = 0;
  bool stop_ = false;
  Status error_;
  Clock::time_point previous_end_{};                // worker thread only
  std::optional<Clock::time_point> model_end_;      // worker thread only
  std::thread worker_;  // last: starts after the members it uses exist
};

class HostDevice;

class HostStream final : public internal::StreamImpl {
 public:
  HostStream(const Device* owner, std::shared_ptr<StreamCore> core,
             std::function<void()> on_destroy)
      : StreamImpl(owner), core_(std::move(core)), on_destroy_(std::move(on_destroy)) {}
  ~HostStream() override {
    // A forked child has no worker thread to stop, and destroying the
    // condition variable the parent's worker waits on blocks: the child
    // leaves the stream's core alone.
    if (creator_pid_ != ::getpid()) {
      new std::shared_ptr<StreamCore>(std::move(core_));
      return;
    }
    core_->Shutdown();
    if (on_destroy_) on_destroy_();
  }
  StreamCore& core() const { return *core_; }
  const std::shared_ptr<StreamCore>& shared_core() const { return core_; }

 private:
  std::shared_ptr<StreamCore> core_;
  std::function<void()> on_destroy_;
  const pid_t creator_pid_ = ::getpid();
};

class HostEvent final : public internal::EventImpl {
 public:
  explicit HostEvent(const Device* owner)
      : EventImpl(owner), state_(std::make_shared<EventState>()) {}
  const std::shared_ptr<EventState>& state() const { return state_; }

 private:
  std::shared_ptr<EventState> state_;
};

class HostDevice final : public Device {
 public:
  HostDevice(const HostDeviceOptions& options, uint64_t budget_bytes)
      : options_(options),
        budget_bytes_(budget_bytes),
        h2d_(options.h2d_bytes_per_sec, options.copy_latency_sec),
        d2h_(options.d2h_bytes_per_sec, options.copy_latency_sec) {
    caps_.name = "host";
    caps_.description = "emulated device on host memory";
    caps_.kind = DeviceKind::kHost;
    caps_.total_memory_bytes = budget_bytes;
    caps_.host_addressable_memory = true;
    caps_.async_alloc = false;
    caps_.copy_bandwidth_capped = h2d_.modeled() || d2h_.modeled();
    default_stream_ = MakeStream("default stream");
  }

  ~HostDevice() override { default_stream_.reset(); }

  const DeviceCaps& caps() const override { return caps_; }

  Result<DeviceBuffer> Allocate(size_t bytes) override {
    if (bytes == 0) return DeviceBuffer();
    const size_t rounded = RoundUp(bytes, kDeviceAlignment);
    {
      std::lock_guard lock(mem_mu_);
      if (rounded > budget_bytes_ || in_use_bytes_ > budget_bytes_ - rounded) {
        return ResourceExhaustedError(fmt::format(
            "allocate {} on device host: memory budget {} with {} in use; raise "
            "HostDeviceOptions::memory_budget_bytes or allocate less",
            FormatBytes(bytes), FormatBytes(budget_bytes_), FormatBytes(in_use_bytes_)));
      }
      in_use_bytes_ += rounded;
    }
    void* p = std::aligned_alloc(kDeviceAlignment, rounded);
    std::lock_guard lock(mem_mu_);
    if (p == nullptr) {
      in_use_bytes_ -= rounded;
      return ResourceExhaustedError(
          fmt::format("allocate {} on device host: host memory exhausted", FormatBytes(bytes)));
    }
    allocations_.emplace(reinterpret_cast<uintptr_t>(p), bytes);
    return DeviceBuffer(this, p, bytes);
  }

  Result<HostAllocation> AllocateHost(size_t bytes) override {
    if (bytes == 0) return HostAllocation();
    const size_t rounded = RoundUp(bytes, kHostAlignment);
    STRATA_ASSIGN_OR_RETURN(void* p, internal::MapHugePageAligned(rounded));
    internal::PrefaultInParallel(p, rounded);  // mlock would fault them in on this thread
    if (Mlock(p, rounded) == 0) return HostAllocation(this, p, rounded, HostMemoryLock::kLocked);
    const int err = errno;
    if (err == EPERM || err == ENOMEM || err == EAGAIN) {
      WarnOnce("host-device-mlock",
               fmt::format(
                   "{}; using unlocked host memory (copies stay correct, page-locked "
                   "speed is not guaranteed). Raise `ulimit -l` or grant CAP_IPC_LOCK to lock it",
                   ErrnoError(err, fmt::format("mlock {}", FormatBytes(rounded))).message()));
      return HostAllocation(this, p, rounded, HostMemoryLock::kUnlocked);
    }
    ::munmap(p, rounded);
    return ErrnoError(err, fmt::format("mlock {} of host memory", FormatBytes(rounded)));
  }

  Result<Stream> CreateStream() override {
    return Stream(MakeStream(fmt::format("stream {}", next_stream_id_.fetch_add(1))));
  }

  Result<Event> CreateEvent() override { return Event(std::make_unique<HostEvent>(this)); }

  StreamRef DefaultStream() override { return StreamRef(default_stream_.get()); }

  Status CopyAsync(void* dst, const void* src, size_t bytes, CopyKind kind,
                   StreamRef stream) override {
    STRATA_ASSIGN_OR_RETURN(HostStream * s, CheckStream(stream, "copy"));
    if (bytes == 0) return OkStatus();
    const auto what = [&] {
      return fmt::format("copy {} {} {} -> {}", CopyKindName(kind), FormatBytes(bytes), src, dst);
    };
    if (dst == nullptr || src == nullptr) {
      return InvalidArgumentError(fmt::format("{} on {}: null pointer", what(), s->core().name()));
    }
    const bool dst_device = kind == CopyKind::kHostToDevice || kind == CopyKind::kDeviceToDevice;
    const bool src_device = kind == CopyKind::kDeviceToHost || kind == CopyKind::kDeviceToDevice;
    if (dst_device && !IsDeviceRange(dst, bytes)) {
      return InvalidArgumentError(
          fmt::format("{}: destination is not inside one device allocation of host; check the copy "
                      "kind and size",
                      what()));
    }
    if (src_device && !IsDeviceRange(src, bytes)) {
      return InvalidArgumentError(fmt::format(
          "{}: source is not inside one device allocation of host; check the copy kind and size",
          what()));
    }
    Link* link = kind == CopyKind::kHostToDevice   ? &h2d_
                 : kind == CopyKind::kDeviceToHost ? &d2h_
                                                   : nullptr;
    if (link != nullptr && !link->modeled()) link = nullptr;
    StreamCore* core = &s->core();
    const auto enqueued = Clock::now();
    core->Enqueue({[dst, src, bytes, link, core, enqueued] {
                     if (link == nullptr) {
                       std::memcpy(dst, src, bytes);
                       return OkStatus();
                     }
                     const auto done =
                         link->Reserve(bytes, std::max(enqueued, core->previous_end()));
                     std::memcpy(dst, src, bytes);
                     core->SetModelEnd(done);
                     std::this_thread::sleep_until(done);
                     return OkStatus();
                   },
                   false});
    return OkStatus();
  }

  Status LaunchHostTask(StreamRef stream, std::function<Status()> task) override {
    STRATA_ASSIGN_OR_RETURN(HostStream * s, CheckStream(stream, "launch host task"));
    if (!task) return InvalidArgumentError("launch host task on host: empty function");
    if (host_task_fault.load(std::memory_order_relaxed) > 0 && host_task_fault.fetch_sub(1) == 1) {
      return InternalError("launch host task on host: failed as a test asked");
    }
    s->core().Enqueue({std::move(task), false});
    return OkStatus();
  }

  Status RecordEvent(Event& event, StreamRef stream) override {
    STRATA_ASSIGN_OR_RETURN(HostStream * s, CheckStream(stream, "record event"));
    STRATA_ASSIGN_OR_RETURN(HostEvent * e, CheckEvent(event, "record event"));
    std::shared_ptr<EventState> state = e->state();
    uint64_t target;
    {
      std::lock_guard lock(state->mu);
      target = ++state->recorded;
    }
    StreamCore* core = &s->core();
    core->Enqueue({[state, target, core] {
                     Status stream_error = core->error();
                     {
                       std::lock_guard lock(state->mu);
                       if (target > state->completed) {
                         state->completed = target;
                         state->status = std::move(stream_error);
                       }
                     }
                     state->cv.notify_all();
                     return OkStatus();
                   },
                   true});
    return OkStatus();
  }

  Status StreamWaitEvent(StreamRef stream, const Event& event) override {
    STRATA_ASSIGN_OR_RETURN(HostStream * s, CheckStream(stream, "wait event"));
    STRATA_ASSIGN_OR_RETURN(HostEvent * e, CheckEvent(event, "wait event"));
    std::shared_ptr<EventState> state = e->state();
    uint64_t target;
    {
      std::lock_guard lock(state->mu);
      target = state->recorded;
      if (state->completed >= target) return OkStatus();  // nothing to wait for
    }
    s->core().Enqueue({[state, target] {
                         std::unique_lock lock(state->mu);
                         state->cv.wait(lock, [&] { return state->completed >= target; });
                         return OkStatus();
                       },
                       true});
    return OkStatus();
  }

  Status EventSynchronize(const Event& event) override {
    STRATA_ASSIGN_OR_RETURN(HostEvent * e, CheckEvent(event, "synchronize event"));
    EventState& state = *e->state();
    std::unique_lock lock(state.mu);
    const uint64_t target = state.recorded;
    state.cv.wait(lock, [&] { return state.completed >= target; });
    return state.status;
  }

  Result<bool> EventQuery(const Event& event) override {
    STRATA_ASSIGN_OR_RETURN(HostEvent * e, CheckEvent(event, "query event"));
    EventState& state = *e->state();
    std::lock_guard lock(state.mu);
    return state.completed >= state.recorded;
  }

  Status StreamSynchronize(StreamRef stream) override {
    STRATA_ASSIGN_OR_RETURN(HostStream * s, CheckStream(stream, "synchronize stream"));
    return s->core().Sync();
  }

  Status Synchronize() override {
    std::vector<std::shared_ptr<StreamCore>> cores;
    {
      std::lock_guard lock(streams_mu_);
      for (const auto& [id, core] : streams_) cores.push_back(core);
    }
    Status first;
    for (const auto& core : cores) {
      Status s = core->Sync();
      if (first.ok() && !s.ok()) first = std::move(s);
    }
    return first;
  }

 private:
  void FreeDevice(void* data, size_t bytes) override {
    {
      std::lock_guard lock(mem_mu_);
      allocations_.erase(reinterpret_cast<uintptr_t>(data));
      in_use_bytes_ -= RoundUp(bytes, kDeviceAlignment);
    }
    std::free(data);
  }

  void FreeHost(void* data, size_t bytes, HostMemoryLock lock) override {
    if (lock == HostMemoryLock::kLocked) ::syscall(SYS_munlock, data, bytes);
    ::munmap(data, bytes);
  }

  std::unique_ptr<HostStream> MakeStream(std::string label) {
    const uint64_t id = next_core_id_.fetch_add(1);
    auto core = std::make_shared<StreamCore>(fmt::format("host:{}", label));
    {
      std::lock_guard lock(streams_mu_);
      streams_.emplace(id, core);
    }
    return std::make_unique<HostStream>(this, std::move(core), [this, id] {
      std::lock_guard lock(streams_mu_);
      streams_.erase(id);
    });
  }

  Result<HostStream*> CheckStream(StreamRef stream, std::string_view op) const {
    if (!stream) return InvalidArgumentError(fmt::format("{} on host: null stream", op));
    if (stream.impl()->owner() != this) {
      return InvalidArgumentError(
          fmt::format("{} on host: the stream belongs to another device", op));
    }
    return static_cast<HostStream*>(stream.impl());
  }

  Result<HostEvent*> CheckEvent(const Event& event, std::string_view op) const {
    if (!event) return InvalidArgumentError(fmt::format("{} on host: empty event", op));
    if (event.impl()->owner() != this) {
      return InvalidArgumentError(
          fmt::format("{} on host: the event belongs to another device", op));
    }
    return static_cast<HostEvent*>(event.impl());
  }

  bool IsDeviceRange(const void* p, size_t bytes) {
    if (options_.external_memory == ExternalMemory::kAccept) return true;
    const auto addr = reinterpret_cast<uintptr_t>(p);
    std::lock_guard lock(mem_mu_);
    auto it = allocations_.upper_bound(addr);
    if (it == allocations_.begin()) return false;
    --it;
    return addr >= it->first && bytes <= it->second && addr - it->first <= it->second - bytes;
  }

  const HostDeviceOptions options_;
  const uint64_t budget_bytes_;
  DeviceCaps caps_;
  Link h2d_;
  Link d2h_;

  std::mutex mem_mu_;
  uint64_t in_use_bytes_ = 0;
  std::map<uintptr_t, size_t> allocations_;  // base -> bytes asked for

  std::mutex streams_mu_;
  std::map<uint64_t, std::shared_ptr<StreamCore>> streams_;
  std::atomic<uint64_t> next_core_id_{0};
  std::atomic<uint64_t> next_stream_id_{1};
  std::unique_ptr<HostStream> default_stream_;
};

}  // namespace

void internal::FailHostTaskForTest(int nth) { host_task_fault.store(nth); }

Result<std::unique_ptr<Device>> CreateHostDevice(const HostDeviceOptions& options) {
  if (!(options.h2d_bytes_per_sec >= 0) || !(options.d2h_bytes_per_sec >= 0) ||
      !(options.copy_latency_sec >= 0)) {
    return InvalidArgumentError(fmt::format(
        "create host device: h2d_bytes_per_sec={}, d2h_bytes_per_sec={}, copy_latency_sec={}: "
        "rates and latency must be >= 0 (0 = unlimited)",
        options.h2d_bytes_per_sec, options.d2h_bytes_per_sec, options.copy_latency_sec));
  }
  uint64_t budget = options.memory_budget_bytes;
  if (budget == 0) {
    const long pages = ::sysconf(_SC_PHYS_PAGES);
    const long page = ::sysconf(_SC_PAGE_SIZE);
    budget = pages > 0 && page > 0 ? static_cast<uint64_t>(pages) * static_cast<uint64_t>(page) / 2
                                   : uint64_t{1} << 32;
  }
  return std::unique_ptr<Device>(std::make_unique<HostDevice>(options, budget));
}

}  // namespace strata
