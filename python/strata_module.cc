// strata._strata: the pybind11 module behind strata.torch. It binds the
// engine (OffloadOptimizer) on raw pointers, so it needs no PyTorch headers:
// strata/torch.py passes tensors' data_ptr() and keeps the tensors alive.
//
// Errors: a non-OK Status becomes StrataError (a RuntimeError) whose message
// is Status::ToString(); InvalidArgument becomes ValueError,
// ResourceExhausted MemoryError-like StrataResourceError, so Python callers
// can catch what they expect.
//
// GIL: every call into the engine releases the GIL. The engine runs its
// collectives on device stream threads; with a Python communicator
// (torch.distributed over gloo) those threads take the GIL to call Python,
// while the thread that called step() waits with the GIL released.
#include <fmt/format.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <memory>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "offload/checkpoint.h"
#include "offload/config.h"
#include "offload/one_caller.h"
#include "offload/optimizer.h"
#include "runtime/comm.h"
#include "runtime/device.h"
#include "runtime/log.h"
#include "runtime/status.h"
#include "runtime/trace.h"
#include "runtime/utf8.h"

namespace py = pybind11;

namespace strata {
namespace {

// Python exception types, made once at import.
py::object* g_error = nullptr;             // StrataError(RuntimeError)
py::object* g_invalid_argument = nullptr;  // InvalidArgumentError(StrataError, ValueError)
py::object* g_resource = nullptr;          // ResourceExhaustedError(StrataError, MemoryError)

[[noreturn]] void Raise(const Status& status) {
  py::object* type = g_error;
  if (status.code() == StatusCode::kInvalidArgument) type = g_invalid_argument;
  if (status.code() == StatusCode::kResourceExhausted) type = g_resource;
  // A message may quote bytes that are not UTF-8 (a path): Python's str needs text.
  PyErr_SetString(type->ptr(), EscapeNonUtf8(status.ToString()).c_str());
  throw py::error_already_set();
}

void Check(const Status& status) {
  if (!status.ok()) Raise(status);
}

// Unwraps a Result into `lhs` or raises.
#define STRATA_ASSIGN_OR_RAISE(lhs, expr)                 \
  do {                                                    \
    auto strata_py_r_ = (expr);                           \
    if (!strata_py_r_.ok()) Raise(strata_py_r_.status()); \
    lhs = *std::move(strata_py_r_);                       \
  } while (false)

// Runs `f` (returning a Status) without the GIL, then raises on failure.
template <typename F>
void Call(F&& f) {
  Status s;
  {
    py::gil_scoped_release release;
    s = f();
  }
  Check(s);
}

std::string_view DTypeString(DType t) {
  switch (t) {
    case DType::kF32:
      return "float32";
    case DType::kF16:
      return "float16";
    case DType::kBF16:
      return "bfloat16";
    case DType::kF64:
      return "float64";
    default:
      return DTypeName(t);
  }
}

// A Communicator whose collectives call a Python object with methods
//   all_reduce(send: memoryview, recv: memoryview, count, dtype: str, op: str)
//   reduce_scatter(send, recv, recv_count, dtype, op)
//   all_gather(send, recv, send_count, dtype)
//   barrier()
// (strata/torch.py implements them over torch.distributed). The memoryviews
// are raw bytes over the engine's buffers, valid only during the call.
// Each collective is a host task on the given stream: on the host device it
// runs on the stream's worker thread, which takes the GIL for the call.
class PythonCommunicator final : public Communicator {
 public:
  PythonCommunicator(int rank, int world_size, Device& device, py::object impl)
      : rank_(rank), world_size_(world_size), device_(device), impl_(std::move(impl)) {}
  ~PythonCommunicator() override {
    py::gil_scoped_acquire gil;
    impl_ = py::object();
  }

  int rank() const override { return rank_; }
  int world_size() const override { return world_size_; }
  Device& device() const override { return device_; }
  std::string_view backend() const override { return "python"; }
  // The Python side's `failed`: the first collective that failed, or None.
  Status health() const override {
    py::gil_scoped_acquire gil;
    py::object failed = impl_.attr("failed");
    if (failed.is_none()) return OkStatus();
    return UnavailableError(py::str(failed).cast<std::string>());
  }

  Status AllReduce(const void* send, void* recv, size_t count, DType dtype, ReduceOp op,
                   StreamRef stream) override {
    STRATA_RETURN_IF_ERROR(CheckArgs("all-reduce", send, recv, dtype));
    const size_t bytes = count * DTypeSize(dtype);
    return Enqueue(stream, "all_reduce", [=, this] {
      impl_.attr("all_reduce")(View(send, bytes), View(recv, bytes), count, DTypeString(dtype),
                               ReduceOpName(op));
    });
  }

  Status ReduceScatter(const void* send, void* recv, size_t recv_count, DType dtype, ReduceOp op,
                       StreamRef stream) override {
    STRATA_RETURN_IF_ERROR(CheckArgs("reduce-scatter", send, recv, dtype));
    const size_t bytes = recv_count * DTypeSize(dtype);
    return Enqueue(stream, "reduce_scatter", [=, this] {
      impl_.attr("reduce_scatter")(View(send, bytes * world_size_), View(recv, bytes), recv_count,
                                   DTypeString(dtype), ReduceOpName(op));
    });
  }

  Status AllGather(const void* send, void* recv, size_t send_count, DType dtype,
                   StreamRef stream) override {
    STRATA_RETURN_IF_ERROR(CheckArgs("all-gather", send, recv, dtype));
    const size_t bytes = send_count * DTypeSize(dtype);
    return Enqueue(stream, "all_gather", [=, this] {
      impl_.attr("all_gather")(View(send, bytes), View(recv, bytes * world_size_), send_count,
                               DTypeString(dtype));
    });
  }

  Status Barrier(StreamRef stream) override {
    return Enqueue(stream, "barrier", [this] { impl_.attr("barrier")(); });
  }

 private:
  static py::memoryview View(const void* p, size_t bytes) {
    return py::memoryview::from_memory(const_cast<void*>(p), static_cast<py::ssize_t>(bytes));
  }

  Status CheckArgs(std::string_view op, const void* send, const void* recv, DType dtype) const {
    if (send == nullptr || recv == nullptr) {
      return InvalidArgumentError(fmt::format("{} on python communicator: null buffer", op));
    }
    if (!device_.caps().host_addressable_memory) {
      return InvalidArgumentError(fmt::format(
          "{} on python communicator: device {} memory is not host-addressable; use NCCL", op,
          device_.name()));
    }
    return OkStatus();
  }

  template <typename F>
  Status Enqueue(StreamRef stream, const char* what, F body) {
    return device_.LaunchHostTask(stream, [this, what, body = std::move(body)]() -> Status {
      py::gil_scoped_acquire gil;
      try {
        body();
      } catch (py::error_already_set& e) {
        return UnavailableError(fmt::format("{} (rank {} of {}) through torch.distributed: {}",
                                            what, rank_, world_size_, e.what()));
      }
      return OkStatus();
    });
  }

  const int rank_;
  const int world_size_;
  Device& device_;
  py::object impl_;
};

// "debug", "info", "warning", "error", "off"; ValueError otherwise.
LogLevel LevelFromName(const std::string& name) {
  for (LogLevel l :
       {LogLevel::kDebug, LogLevel::kInfo, LogLevel::kWarning, LogLevel::kError, LogLevel::kOff}) {
    if (name == LogLevelName(l)) return l;
  }
  Raise(InvalidArgumentError(
      fmt::format("log level '{}': use debug, info, warning, error or off", name)));
}

// Sends the engine's log lines to `handler(level: str, message: str)`, or
// back to stderr for None. The sink runs on whichever thread logs (engine
// stream and IO threads too) and takes the GIL for the call; engine calls
// release the GIL, so such a thread never waits on one that waits on it. An
// exception in the handler is reported as unraisable and the line goes to
// stderr. strata/__init__.py installs its handler at import and removes it
// at exit, before the interpreter finalizes.
void SetLogHandler(py::object handler) {
  if (handler.is_none()) {
    LogSink previous = SetLogSink(nullptr);
    return;  // `previous` (and the handler it holds) is released here, with the GIL held
  }
  // The Python object may be released on any thread: take the GIL for it.
  std::shared_ptr<py::object> held(new py::object(std::move(handler)), [](py::object* o) {
    if (Py_IsInitialized()) {
      py::gil_scoped_acquire gil;
      delete o;
    } else {
      o->release();  // the interpreter is gone: leak the reference, never touch it
      delete o;
    }
  });
  LogSink previous = SetLogSink([held](LogLevel level, std::string_view message) {
    if (!Py_IsInitialized()) {
      WriteLogToStderr(level, message);
      return;
    }
    py::gil_scoped_acquire gil;
    try {
      (*held)(LogLevelName(level), py::str(EscapeNonUtf8(message)));  // a path may not be UTF-8
    } catch (py::error_already_set& e) {
      e.discard_as_unraisable("strata log handler");
      WriteLogToStderr(level, message);
    }
  });
}

// One optimizer with the device, communicator and stream it runs on.
class Engine {
 public:
  // groups: [{"params": [(name, data_ptr, grad_ptr, elems, shape), ...], "lr": ...,
  //           "betas": (b1, b2), "eps": ..., "weight_decay": ...}, ...]
  // (shape: a tuple of ints, recorded in checkpoints and checked on load).
  // comm: None (one rank), ("python", rank, world, impl), or ("nccl", rank, world, id_bytes).
  // stream: a native stream handle (cudaStream_t as int) or None.
  Engine(const std::string& device_name, const std::string& config_json, py::list groups,
         py::object comm, py::object stream) {
    STRATA_ASSIGN_OR_RAISE(config_, ParseConfigJson(config_json));
    Check(ValidateConfig(config_));
    STRATA_ASSIGN_OR_RAISE(device_,
                           OpenDevice(device_name, {.external_memory = ExternalMemory::kAccept}));
    std::vector<ParamGroup> param_groups;
    for (py::handle g : groups) {
      py::dict d = py::reinterpret_borrow<py::dict>(g);
      ParamGroup pg;
      pg.hyper = HyperFrom(d);
      for (py::handle t : d["params"]) {
        auto tup = py::reinterpret_borrow<py::tuple>(t);
        pg.params.push_back({.name = tup[0].cast<std::string>(),
                             .data = reinterpret_cast<void*>(tup[1].cast<uintptr_t>()),
                             .grad = reinterpret_cast<void*>(tup[2].cast<uintptr_t>()),
                             .elems = tup[3].cast<uint64_t>()});
        shapes_.push_back(tup[4].cast<std::vector<uint64_t>>());
      }
      param_groups.push_back(std::move(pg));
    }
    if (!comm.is_none()) {
      auto c = comm.cast<py::tuple>();
      const auto kind = c[0].cast<std::string>();
      const int rank = c[1].cast<int>();
      const int world = c[2].cast<int>();
      if (kind == "python") {
        comm_ = std::make_unique<PythonCommunicator>(rank, world, *device_, c[3]);
      } else if (kind == "nccl") {
        const auto bytes = c[3].cast<std::string>();
        NcclUniqueId id;
        if (bytes.size() != id.bytes.size()) {
          Raise(InvalidArgumentError(fmt::format("nccl unique id has {} bytes; it needs {}",
                                                 bytes.size(), id.bytes.size())));
        }
        std::memcpy(id.bytes.data(), bytes.data(), id.bytes.size());
        // The process group's timeout bounds the engine's collectives too.
        NcclOptions options;
        if (c.size() > 4 && !c[4].is_none()) {
          // Capped before the cast (timedelta.max would overflow it); the
          // watchdog uses at most a year.
          const double ms = std::min(std::ceil(c[4].cast<double>() * 1000.0), 1e15);
          options.timeout = std::chrono::milliseconds(static_cast<int64_t>(ms));
        }
        Call([&]() -> Status {
          STRATA_ASSIGN_OR_RETURN(comm_,
                                  CreateNcclCommunicator(id, rank, world, *device_, options));
          return OkStatus();
        });
      } else {
        Raise(InvalidArgumentError(fmt::format("unknown communicator kind '{}'", kind)));
      }
    }
    // Every engine has a recorder: off, it costs the engine one relaxed load
    // per event, and its ring holds one step until trace_start grows it.
    STRATA_ASSIGN_OR_RAISE(trace_, TraceRecorder::Create({.steps = 1}));
    EngineContext context{.device = device_.get(),
                          .comm = comm_.get(),
                          .storage = nullptr,
                          .stream = {},
                          .trace = trace_.get()};
    if (!stream.is_none()) {
      STRATA_ASSIGN_OR_RAISE(
          stream_, device_->WrapNativeStream(reinterpret_cast<void*>(stream.cast<uintptr_t>())));
      context.stream = stream_.ref();
    }
    Call([&]() -> Status {
      STRATA_ASSIGN_OR_RETURN(opt_, OffloadOptimizer::Create(context, config_, param_groups));
      return OkStatus();
    });
    Refresh();
  }

  ~Engine() {
    // A forked child (a DataLoader worker that frees an inherited optimizer)
    // has none of the engine's or the device's threads: destroying them
    // would block for ever. It leaves them alone.
    if (creator_pid_ != ::getpid()) {
      (void)opt_.release();
      (void)trace_.release();
      (void)comm_.release();
      (void)device_.release();
      new Stream(std::move(stream_));
      return;
    }
    // The engine's streams may still hold tasks that take the GIL.
    py::gil_scoped_release release;
    opt_.reset();
    trace_.reset();
    stream_ = Stream();
    comm_.reset();
    device_.reset();
  }

  // On the host device the trainer's CPU code is not ordered on a device
  // stream: wait until the tensors are written before returning to it.
  void Step() {
    Run("step", [&] { return HostSync(opt_->Step()); });
  }
  void ZeroGrad() {
    Run("zero_grad", [&] { return HostSync(opt_->ZeroGrad()); });
  }
  void ReduceGradients() {
    Run("reduce_gradients", [&] { return HostSync(opt_->ReduceGradients()); });
  }
  void GradReady(uint32_t i) {
    Run("grad_ready", [&] { return opt_->GradReady(i); });
  }
  // Checkpoints record the tensors' shapes, and a load checks them.
  void Save(const std::string& dir) {
    Run("save_checkpoint", [&] { return SaveCheckpoint(*opt_, dir, {.shapes = shapes_}); });
  }
  void Load(const std::string& dir) {
    Run("load_checkpoint",
        [&] { return HostSync(LoadCheckpoint(*opt_, dir, {.shapes = shapes_})); });
  }
  // The step state machine (offload/optimizer.h).
  void RetryStep() {
    Run("retry_step", [&] { return HostSync(opt_->RetryStep()); });
  }
  // The params from the committed master weights (a collective).
  void UploadParams() {
    Run("upload_params", [&] { return HostSync(opt_->UploadParams()); });
  }
  bool step_failed() const { return Read().step_failed; }
  // The failure that stopped the communicator for good; "" while it can run
  // collectives (or with one rank).
  std::string comm_failure() const {
    if (!comm_) return "";
    const Status s = comm_->health();
    return s.ok() ? "" : EscapeNonUtf8(std::string(s.message()));
  }
  std::string step_failure() const { return EscapeNonUtf8(Read().step_failure); }
  std::string incomplete_state() const { return EscapeNonUtf8(Read().incomplete_state); }
  // (index, data, grad) per moved param, all or none (OffloadOptimizer::RebindParams).
  void RebindParams(const std::vector<std::tuple<uint32_t, uintptr_t, uintptr_t>>& moves) {
    std::vector<ParamBinding> b;
    for (const auto& [index, data, grad] : moves) {
      b.push_back({.index = index,
                   .data = reinterpret_cast<void*>(data),
                   .grad = reinterpret_cast<void*>(grad)});
    }
    Run("rebind_params", [&] { return opt_->RebindParams(b); });
  }
  // Raises what RestoreCounters would, without changing anything.
  void CheckCounters(int64_t step, py::dict d) const {
    if (step < 0) Raise(InvalidArgumentError(fmt::format("step {} is negative", step)));
    LossScalerState s = ScalerFrom(d);
    Result<LossScaler> scaler = LossScaler::Create(opt_->config().loss_scaler);
    if (!scaler.ok()) Raise(scaler.status());
    Check(scaler->Restore(s));
  }
  // Each registered tensor's (offset_elems, elems) in the flat layout.
  std::vector<std::pair<uint64_t, uint64_t>> Layout() const {
    std::vector<std::pair<uint64_t, uint64_t>> out;
    for (const TensorSlot& t : opt_->layout().tensors) out.emplace_back(t.offset_elems, t.elems);
    return out;
  }
  void Synchronize() {
    Run("synchronize", [&] { return opt_->device().Synchronize(); });
  }

  // The step trace (runtime/trace.h). Each call first waits for the device,
  // so no engine thread records while the ring is resized or read.
  // Starts recording into an empty ring that keeps the newest `steps` steps.
  void TraceStart(uint32_t steps) {
    Run("trace_start", [&]() -> Status {
      trace_->SetEnabled(false);
      STRATA_RETURN_IF_ERROR(opt_->device().Synchronize());
      STRATA_RETURN_IF_ERROR(trace_->SetSteps(steps));
      trace_->SetEnabled(true);
      return OkStatus();
    });
  }
  // Stops recording; release_ring: shrink the ring back to one step (drops the events).
  void TraceStop(bool release_ring) {
    Run("trace_stop", [&]() -> Status {
      trace_->SetEnabled(false);
      STRATA_RETURN_IF_ERROR(opt_->device().Synchronize());
      return release_ring ? trace_->SetSteps(1) : OkStatus();
    });
  }
  // Writes what the ring holds as Chrome trace JSON; recording goes on if it was on.
  void TraceWrite(const std::string& path, const std::string& other_data_json) {
    Run("trace_write", [&]() -> Status {
      const bool was = trace_->enabled();
      trace_->SetEnabled(false);
      Status s = opt_->device().Synchronize();
      if (s.ok()) s = trace_->WriteChromeTrace(path, other_data_json);
      trace_->SetEnabled(was);
      return s;
    });
  }
  py::dict TraceInfo() const {
    py::dict d;
    d["enabled"] = trace_->enabled();
    d["steps"] = trace_->steps();
    d["capacity"] = trace_->capacity();
    d["recorded"] = trace_->recorded();
    d["dropped"] = trace_->dropped();
    return d;
  }

  double loss_scale() const { return Read().loss_scale; }
  int64_t step_count() const { return Read().step_count; }
  int rank() const { return opt_->rank(); }
  int world_size() const { return opt_->world_size(); }
  uint32_t num_groups() const { return opt_->num_groups(); }
  std::string device_name() const { return opt_->device().name(); }

  py::dict GroupHyperOf(uint32_t g) const {
    if (g >= opt_->num_groups()) {
      Raise(OutOfRangeError(fmt::format("group {} of {}", g, opt_->num_groups())));
    }
    const GroupHyper h = Read().hypers[g];
    py::dict d;
    d["lr"] = h.lr;
    d["betas"] = py::make_tuple(h.beta1, h.beta2);
    d["eps"] = h.eps;
    d["weight_decay"] = h.weight_decay;
    return d;
  }
  void SetGroupHyper(uint32_t g, py::dict d) {
    const GroupHyper h = HyperFrom(d);
    Run("set_group_hyper", [&] { return opt_->SetGroupHyper(g, h); });
  }

  py::dict LastStep() const {
    const StepStats s = Read().last;
    py::dict d;
    d["step"] = s.step;
    d["skipped"] = s.skipped;
    d["loss_scale"] = s.loss_scale;
    d["grad_norm"] = s.grad_norm;
    d["clip_coef"] = s.clip_coef;
    d["micro_steps"] = s.micro_steps;
    d["nonfinite_elems"] = s.nonfinite_elems;
    py::dict t;
    t["d2h"] = s.times.d2h;
    t["comm"] = s.times.comm;
    t["read"] = s.times.read;
    t["adam"] = s.times.adam;
    t["device_adam"] = s.times.device_adam;
    t["write"] = s.times.write;
    t["h2d"] = s.times.h2d;
    t["step"] = s.times.step;
    t["grad_stats"] = s.times.grad_stats;
    t["device"] = s.times.device;
    d["times"] = t;
    d["read_bytes"] = s.read_bytes;
    d["write_bytes"] = s.write_bytes;
    d["resident_bytes"] = s.resident_bytes;
    d["d2h_bytes"] = s.d2h_bytes;
    d["h2d_bytes"] = s.h2d_bytes;
    d["text"] = FormatStepStats(s);
    return d;
  }

  py::dict Plan() const {
    const PlacementPlan& p = opt_->plan();
    py::dict d;
    d["text"] = FormatPlan(p);
    d["device_sub_groups"] = p.device_sub_groups;
    d["device_state_bytes"] = p.device_state_bytes;
    d["gpu_fraction"] = p.gpu_fraction();
    d["host_sub_groups"] = p.host_sub_groups;
    d["nvme_sub_groups"] = p.nvme_sub_groups;
    d["host_state_bytes"] = p.host_state_bytes;
    d["nvme_state_bytes"] = p.nvme_state_bytes;
    d["nvme_file_bytes"] = p.nvme_file_bytes;  // on disk: two slots per sub-group
    d["host_staging_bytes"] = p.host_staging_bytes;
    d["device_staging_bytes"] = p.device_staging_bytes;
    // The rates the plan was made with (strata.rates, or measured for
    // gpu_fraction "auto"; 0: unknown) and its per-step estimate in seconds.
    py::dict rates;
    rates["cpu_adam"] = p.rates.cpu_adam_elems_per_sec;
    rates["device_adam"] = p.rates.device_adam_elems_per_sec;
    rates["pcie"] = p.rates.pcie_bytes_per_sec;
    rates["nvme_read"] = p.rates.nvme_read_bytes_per_sec;
    rates["nvme_write"] = p.rates.nvme_write_bytes_per_sec;
    d["rates"] = rates;
    py::dict e;
    e["cpu_adam"] = p.estimate.cpu_adam;
    e["device_adam"] = p.estimate.device_adam;
    e["d2h"] = p.estimate.d2h;
    e["h2d"] = p.estimate.h2d;
    e["nvme"] = p.estimate.nvme;
    e["bound"] = p.estimate.bound();
    d["estimate"] = e;
    d["auto_balanced"] = p.auto_balanced;
    return d;
  }

  std::string config_json() const { return ConfigToJson(opt_->config()); }

  // The sub-groups of this rank's shard as (begin, end) flat elements.
  std::vector<std::pair<uint64_t, uint64_t>> SubGroups() const {
    std::vector<std::pair<uint64_t, uint64_t>> out;
    for (const ElemRange& r : opt_->sub_groups()) out.emplace_back(r.begin, r.end);
    return out;
  }
  uint32_t state_array_count() const { return opt_->StateArrayCount(); }

  // Read/WriteState through a float32 buffer the caller owns (a tensor's
  // data_ptr and numel).
  void ReadState(uint32_t i, uintptr_t ptr, uint64_t n) {
    Run("read_state", [&] { return opt_->ReadState(i, {reinterpret_cast<float*>(ptr), n}); });
  }
  void WriteState(uint32_t i, uintptr_t ptr, uint64_t n) {
    Run("write_state", [&] {
      return opt_->WriteState(i, {reinterpret_cast<const float*>(ptr), n});
    });
  }

  // Values written into params since the engine wrote them become the
  // master weights (OffloadOptimizer::ReloadParams); how many elements changed.
  uint64_t ReloadParams(const std::vector<uint32_t>& params) {
    uint64_t adopted = 0;
    Run("reload_params", [&]() -> Status {
      STRATA_ASSIGN_OR_RETURN(adopted, opt_->ReloadParams(params));
      return OkStatus();
    });
    return adopted;
  }

  py::dict ScalerState() const {
    const LossScalerState s = Read().scaler;
    py::dict d;
    d["scale"] = s.scale;
    d["iteration"] = s.iteration;
    d["last_overflow_iteration"] = s.last_overflow_iteration;
    d["hysteresis_left"] = s.hysteresis_left;
    return d;
  }
  void RestoreCounters(int64_t step, py::dict d) {
    const LossScalerState scaler = ScalerFrom(d);
    Run("restore_counters", [&] { return opt_->RestoreCounters(step, scaler); });
  }

 private:
  // Call() for an engine call, refused (StrataError) while another
  // thread's call on this engine runs: the engine is driven by one thread
  // at a time, and Call() releases the GIL, so two Python threads could
  // otherwise run in it at once.
  template <typename F>
  void Run(const char* op, F&& f) {
    Check(caller_.Enter(op));
    struct Leave {
      Engine& engine;
      ~Leave() {
        engine.Refresh();
        engine.caller_.Leave();
      }
    } leave{*this};
    Call(std::forward<F>(f));
  }

  void Refresh() { values_.Refresh(*opt_); }
  OptimizerValues Read() const { return values_.Read(); }

  Status HostSync(Status s) {
    if (!s.ok() || device_->caps().kind != DeviceKind::kHost) return s;
    return device_->StreamSynchronize(stream_ ? stream_.ref() : device_->DefaultStream());
  }

  static LossScalerState ScalerFrom(const py::dict& d) {
    for (const char* k : {"scale", "iteration", "last_overflow_iteration", "hysteresis_left"}) {
      if (!d.contains(k)) {
        Raise(InvalidArgumentError(fmt::format("loss scaler state: no '{}'", k)));
      }
    }
    return {.scale = d["scale"].cast<double>(),
            .iteration = d["iteration"].cast<int64_t>(),
            .last_overflow_iteration = d["last_overflow_iteration"].cast<int64_t>(),
            .hysteresis_left = d["hysteresis_left"].cast<uint32_t>()};
  }

  static GroupHyper HyperFrom(const py::dict& d) {
    GroupHyper h;
    h.lr = d["lr"].cast<double>();
    auto betas = d["betas"].cast<py::tuple>();
    h.beta1 = betas[0].cast<double>();
    h.beta2 = betas[1].cast<double>();
    h.eps = d["eps"].cast<double>();
    h.weight_decay = d["weight_decay"].cast<double>();
    return h;
  }

  OffloadConfig config_;
  TensorShapes shapes_;
  std::unique_ptr<Device> device_;
  std::unique_ptr<Communicator> comm_;
  Stream stream_;
  std::unique_ptr<TraceRecorder> trace_;  // outlives opt_, which records into it
  std::unique_ptr<OffloadOptimizer> opt_;
  const pid_t creator_pid_ = ::getpid();
  OneCaller caller_;         // refuses a second thread's call while one runs (Run)
  ValuesAfterCalls values_;  // what the getters read: Refresh() after every call
};

// A checkpoint opened for reading (strata.torch.state_dict_from_checkpoint).
class PyCheckpoint {
 public:
  explicit PyCheckpoint(const std::string& dir) {
    Result<std::unique_ptr<CheckpointReader>> r = CheckpointReader::Open(dir);
    if (!r.ok()) Raise(r.status());
    reader_ = *std::move(r);
  }
  // [{"name", "elems", "shape" (None when not recorded)}, ...] in registration order.
  py::list Tensors() const {
    py::list out;
    const CheckpointInfo& info = reader_->info();
    for (uint32_t i = 0; i < info.tensors.size(); ++i) {
      const CheckpointTensor& t = info.tensors[i];
      py::dict d;
      d["name"] = t.name.empty() ? fmt::format("param.{}", i) : t.name;
      d["elems"] = t.elems;
      d["shape"] = t.shape ? py::cast(*t.shape) : py::none();
      out.append(d);
    }
    return out;
  }
  int64_t step() const { return reader_->info().step; }
  std::string save_dir() const { return reader_->info().save_dir; }
  // The fp32 master weights of tensor `i` into a float32 buffer of its elems.
  void ReadMaster(uint32_t i, uintptr_t ptr, uint64_t n) {
    Call([&] { return reader_->ReadTensor(0, i, 0, {reinterpret_cast<float*>(ptr), n}); });
  }

 private:
  std::unique_ptr<CheckpointReader> reader_;
};

std::vector<std::string> Export(const std::string& dir, const std::string& out,
                                const std::string& dtype, uint64_t max_shard_bytes, bool force) {
  ExportOptions o;
  if (dtype == "fp32") {
    o.dtype = DType::kF32;
  } else if (dtype == "bf16") {
    o.dtype = DType::kBF16;
  } else if (dtype == "fp16") {
    o.dtype = DType::kF16;
  } else {
    Raise(InvalidArgumentError(fmt::format("export: dtype '{}'; use fp32, bf16 or fp16", dtype)));
  }
  o.max_shard_bytes = max_shard_bytes;
  o.existing = force ? ExistingFile::kReplace : ExistingFile::kRefuse;
  // Ctrl-C stops a long export between buffers, and it leaves nothing behind;
  // the KeyboardInterrupt (or what the signal's handler raised) propagates.
  bool signalled = false;
  o.interrupted = [&] {
    py::gil_scoped_acquire gil;
    signalled = PyErr_CheckSignals() != 0;
    return signalled;
  };
  std::vector<std::string> files;
  Status s;
  {
    py::gil_scoped_release release;
    Result<ExportResult> r = ExportSafetensors(dir, out, o);
    if (r.ok()) files = std::move(r->files);
    s = r.status();
  }
  if (signalled) throw py::error_already_set();
  Check(s);
  return files;
}

bool CudaAvailable() {
  for (const DeviceCaps& c : ListDevices()) {
    if (c.kind == DeviceKind::kCuda) return true;
  }
  return false;
}

py::bytes NewNcclId() {
  Result<NcclUniqueId> id = NewNcclUniqueId();
  if (!id.ok()) Raise(id.status());
  return py::bytes(reinterpret_cast<const char*>(id->bytes.data()), id->bytes.size());
}

}  // namespace
}  // namespace strata

PYBIND11_MODULE(_strata, m) {
  using strata::Engine;
  m.doc() = "Strata offload engine bindings; use strata.torch.OffloadAdam.";
  static py::object error = py::reinterpret_steal<py::object>(
      PyErr_NewException("strata.StrataError", PyExc_RuntimeError, nullptr));
  static py::object invalid = py::reinterpret_steal<py::object>(
      PyErr_NewException("strata.InvalidArgumentError",
                         py::make_tuple(error, py::handle(PyExc_ValueError)).ptr(), nullptr));
  static py::object resource = py::reinterpret_steal<py::object>(
      PyErr_NewException("strata.ResourceExhaustedError",
                         py::make_tuple(error, py::handle(PyExc_MemoryError)).ptr(), nullptr));
  strata::g_error = &error;
  strata::g_invalid_argument = &invalid;
  strata::g_resource = &resource;
  m.attr("StrataError") = error;
  m.attr("InvalidArgumentError") = invalid;
  m.attr("ResourceExhaustedError") = resource;
  m.attr("TRACE_MAX_STEPS") = strata::TraceOptions::kMaxSteps;

  m.def("cuda_available", &strata::CudaAvailable, "True when a CUDA device can be opened.");
  m.def("nccl_unique_id", &strata::NewNcclId, "A fresh ncclUniqueId (128 bytes).");
  m.def(
      "set_log_level",
      [](const std::string& level) { strata::SetLogLevel(strata::LevelFromName(level)); },
      "Engine log level: debug|info|warning|error|off (lines below it reach no handler).");
  m.def(
      "log",
      [](const std::string& level, const std::string& message) {
        strata::Log(strata::LevelFromName(level), message);  // "off": logs nothing
      },
      py::arg("level"), py::arg("message"),
      "Log a line through the engine's logging (its level, then the handler).");
  m.def("set_log_handler", &strata::SetLogHandler, py::arg("handler"),
        "Send engine log lines to handler(level, message) (None: stderr). strata installs one "
        "that forwards to the `logging` logger 'strata'.");

  py::class_<Engine>(m, "Engine")
      .def(py::init<const std::string&, const std::string&, py::list, py::object, py::object>(),
           py::arg("device"), py::arg("config_json"), py::arg("groups"),
           py::arg("comm") = py::none(), py::arg("stream") = py::none())
      .def("step", &Engine::Step)
      .def("zero_grad", &Engine::ZeroGrad)
      .def("reduce_gradients", &Engine::ReduceGradients)
      .def("grad_ready", &Engine::GradReady)
      .def("save", &Engine::Save)
      .def("load", &Engine::Load)
      .def("synchronize", &Engine::Synchronize)
      .def_property_readonly("loss_scale", &Engine::loss_scale)
      .def_property_readonly("step_count", &Engine::step_count)
      .def_property_readonly("rank", &Engine::rank)
      .def_property_readonly("world_size", &Engine::world_size)
      .def_property_readonly("num_groups", &Engine::num_groups)
      .def_property_readonly("device", &Engine::device_name)
      .def_property_readonly("state_array_count", &Engine::state_array_count)
      .def("group_hyper", &Engine::GroupHyperOf)
      .def("set_group_hyper", &Engine::SetGroupHyper)
      .def("last_step", &Engine::LastStep)
      .def("plan", &Engine::Plan)
      .def("config_json", &Engine::config_json)
      .def("sub_groups", &Engine::SubGroups)
      .def("read_state", &Engine::ReadState)
      .def("reload_params", &Engine::ReloadParams)
      .def("write_state", &Engine::WriteState)
      .def("scaler_state", &Engine::ScalerState)
      .def("restore_counters", &Engine::RestoreCounters)
      .def("check_counters", &Engine::CheckCounters)
      .def("layout", &Engine::Layout)
      .def("retry_step", &Engine::RetryStep)
      .def("upload_params", &Engine::UploadParams)
      .def_property_readonly("step_failed", &Engine::step_failed)
      .def_property_readonly("comm_failure", &Engine::comm_failure)
      .def_property_readonly("step_failure", &Engine::step_failure)
      .def_property_readonly("incomplete_state", &Engine::incomplete_state)
      .def("rebind_params", &Engine::RebindParams)
      .def("trace_start", &Engine::TraceStart, py::arg("steps"))
      .def("trace_stop", &Engine::TraceStop, py::arg("release_ring") = true)
      .def("trace_write", &Engine::TraceWrite, py::arg("path"), py::arg("other_data_json") = "{}")
      .def("trace_info", &Engine::TraceInfo);

  py::class_<strata::PyCheckpoint>(m, "Checkpoint")
      .def(py::init<const std::string&>(), py::arg("dir"))
      .def("tensors", &strata::PyCheckpoint::Tensors)
      .def_property_readonly("step", &strata::PyCheckpoint::step)
      .def_property_readonly("save_dir", &strata::PyCheckpoint::save_dir)
      .def("read_master", &strata::PyCheckpoint::ReadMaster);
  m.def("export_checkpoint", &strata::Export, py::arg("dir"), py::arg("out"),
        py::arg("dtype") = "fp32", py::arg("max_shard_bytes") = 0, py::arg("force") = false,
        "Writes a checkpoint's weights as safetensors (offload/checkpoint.h ExportSafetensors); "
        "returns the files written.");
}
