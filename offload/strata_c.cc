// The C API: each function turns its arguments into the C++ types, calls
// the engine and turns the Status into an int plus the thread's last error.
// No C++ exception crosses the boundary: the only ones the C++ side can throw
// here are std::bad_alloc (and friends), caught at the edge.
#include "offload/strata_c.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <cstddef>
#include <cstring>
#include <exception>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "offload/checkpoint.h"
#include "offload/config.h"
#include "offload/one_caller.h"
#include "offload/optimizer.h"
#include "runtime/comm.h"
#include "runtime/device.h"
#include "runtime/json_parse.h"
#include "runtime/json_walker.h"
#include "runtime/log.h"
#include "runtime/status.h"
#include "runtime/trace.h"
#include "runtime/utf8.h"

struct strata_device {
  std::unique_ptr<strata::Device> device;
};

struct strata_comm {
  std::unique_ptr<strata::Communicator> comm;
};

struct strata_optimizer {
  mutable strata::OneCaller caller;  // refuses a second thread's call while one runs
  strata::Stream stream;             // the wrapped native stream, if one was given
  // Outlives opt, which records into it; a 1-step ring until trace_enable.
  std::unique_ptr<strata::TraceRecorder> trace;
  std::unique_ptr<strata::OffloadOptimizer> opt;
  strata::TensorShapes shapes;  // empty until strata_optimizer_set_param_shape

  mutable strata::ValuesAfterCalls values;  // what the value getters read
  void Refresh() const { values.Refresh(*opt); }
  strata::OptimizerValues Read() const { return values.Read(); }
};

namespace {

using strata::Status;

thread_local std::string last_error;

int Report(const Status& status) {
  if (status.ok()) {
    last_error.clear();
    return STRATA_OK;
  }
  // The message may quote the caller's bytes (a path, a name): C callers
  // and their bindings get text that is UTF-8.
  last_error = strata::EscapeNonUtf8(status.ToString());
  return static_cast<int>(status.code());
}

int ReportNull(const char* fn, const char* arg) {
  return Report(strata::InvalidArgumentError(fmt::format("{}: {} is NULL", fn, arg)));
}

// Runs `body` (returning a Status) and reports its result; an escaping
// exception becomes an Internal or ResourceExhausted status.
template <typename F>
int Guard(const char* fn, F&& body) {
  try {
    return Report(body());
  } catch (const std::bad_alloc&) {
    return Report(strata::ResourceExhaustedError(fmt::format("{}: out of host memory", fn)));
  } catch (const std::exception& e) {
    return Report(strata::InternalError(fmt::format("{}: {}", fn, e.what())));
  }
}

// Guard for a call on `opt`, refused (FailedPrecondition) while another
// thread's call on it runs.
template <typename F>
int Exclusive(const strata_optimizer* opt, const char* fn, F&& body) {
  if (Status entered = opt->caller.Enter(fn); !entered.ok()) return Report(entered);
  const int status = Guard(fn, std::forward<F>(body));
  opt->Refresh();
  opt->caller.Leave();
  return status;
}

size_t CopyText(const std::string& text, char* buf, size_t capacity) {
  if (buf != nullptr && capacity > 0) {
    const size_t n = std::min(text.size(), capacity - 1);
    std::memcpy(buf, text.data(), n);
    buf[n] = '\0';
  }
  return text.size();
}

// On the host device the caller's CPU code is not ordered on a device
// stream: return only once the tensors are written.
Status HostSync(strata_optimizer& opt, Status s) {
  strata::Device& device = opt.opt->device();
  if (!s.ok() || device.caps().kind != strata::DeviceKind::kHost) return s;
  return device.StreamSynchronize(opt.stream ? opt.stream.ref() : device.DefaultStream());
}

strata::GroupHyper ToHyper(const strata_hyper& h) {
  return {
      .lr = h.lr, .beta1 = h.beta1, .beta2 = h.beta2, .eps = h.eps, .weight_decay = h.weight_decay};
}

strata_hyper FromHyper(const strata::GroupHyper& h) {
  return {h.lr, h.beta1, h.beta2, h.eps, h.weight_decay};
}

}  // namespace

extern "C" {

const char* strata_last_error(void) { return last_error.c_str(); }

const char* strata_status_name(int status) {
  switch (status) {
    case STRATA_OK:
    case STRATA_CANCELLED:
    case STRATA_INVALID_ARGUMENT:
    case STRATA_NOT_FOUND:
    case STRATA_RESOURCE_EXHAUSTED:
    case STRATA_FAILED_PRECONDITION:
    case STRATA_OUT_OF_RANGE:
    case STRATA_UNIMPLEMENTED:
    case STRATA_INTERNAL:
    case STRATA_UNAVAILABLE:
    case STRATA_DATA_LOSS:
      // StatusCodeName returns views of string literals, so data() is NUL-terminated.
      return strata::StatusCodeName(static_cast<strata::StatusCode>(status)).data();
    default:
      return "Unknown";
  }
}

const char* strata_version(void) { return STRATA_C_VERSION; }

static_assert(static_cast<int>(strata::LogLevel::kDebug) == STRATA_LOG_DEBUG &&
                  static_cast<int>(strata::LogLevel::kInfo) == STRATA_LOG_INFO &&
                  static_cast<int>(strata::LogLevel::kWarning) == STRATA_LOG_WARNING &&
                  static_cast<int>(strata::LogLevel::kError) == STRATA_LOG_ERROR &&
                  static_cast<int>(strata::LogLevel::kOff) == STRATA_LOG_OFF,
              "strata_c.h's log levels are strata::LogLevel's");

int strata_set_log_level(int level) {
  if (level < STRATA_LOG_DEBUG || level > STRATA_LOG_OFF) {
    return Report(strata::InvalidArgumentError(fmt::format(
        "strata_set_log_level: level {}; give STRATA_LOG_DEBUG ({}) to STRATA_LOG_OFF ({})", level,
        static_cast<int>(STRATA_LOG_DEBUG), static_cast<int>(STRATA_LOG_OFF))));
  }
  strata::SetLogLevel(static_cast<strata::LogLevel>(level));
  return Report(strata::OkStatus());
}

int strata_log_level(void) { return static_cast<int>(strata::GetLogLevel()); }

int strata_set_log_callback(strata_log_fn fn, void* user) {
  return Guard("strata_set_log_callback", [&]() -> Status {
    if (fn == nullptr) {
      strata::SetLogSink(nullptr);
    } else {
      strata::SetLogSink([fn, user](strata::LogLevel level, std::string_view message) {
        const std::string text = strata::EscapeNonUtf8(message);
        fn(user, static_cast<int>(level), text.c_str());
      });
    }
    return strata::OkStatus();
  });
}

int strata_device_open(const char* name, strata_device** out) {
  if (out == nullptr) return ReportNull("strata_device_open", "out");
  *out = nullptr;
  if (name == nullptr) return ReportNull("strata_device_open", "name");
  return Guard("strata_device_open", [&]() -> Status {
    // Trainer tensors are the caller's own host memory on the host device.
    STRATA_ASSIGN_OR_RETURN(
        auto device,
        strata::OpenDevice(name, {.external_memory = strata::ExternalMemory::kAccept}));
    *out = new strata_device{std::move(device)};
    return strata::OkStatus();
  });
}

void strata_device_free(strata_device* device) { delete device; }

const char* strata_device_name(const strata_device* device) {
  return device == nullptr ? "" : device->device->name().c_str();
}

int strata_nccl_unique_id(uint8_t id[STRATA_NCCL_UNIQUE_ID_BYTES]) {
  if (id == nullptr) return ReportNull("strata_nccl_unique_id", "id");
  return Guard("strata_nccl_unique_id", [&]() -> Status {
    STRATA_ASSIGN_OR_RETURN(strata::NcclUniqueId uid, strata::NewNcclUniqueId());
    std::memcpy(id, uid.bytes.data(), uid.bytes.size());
    return strata::OkStatus();
  });
}

int strata_comm_nccl_create(strata_device* device, const uint8_t id[STRATA_NCCL_UNIQUE_ID_BYTES],
                            int rank, int world_size, strata_comm** out) {
  if (out == nullptr) return ReportNull("strata_comm_nccl_create", "out");
  *out = nullptr;
  if (device == nullptr) return ReportNull("strata_comm_nccl_create", "device");
  if (id == nullptr) return ReportNull("strata_comm_nccl_create", "id");
  return Guard("strata_comm_nccl_create", [&]() -> Status {
    strata::NcclUniqueId uid;
    std::memcpy(uid.bytes.data(), id, uid.bytes.size());
    STRATA_ASSIGN_OR_RETURN(auto comm,
                            strata::CreateNcclCommunicator(uid, rank, world_size, *device->device));
    *out = new strata_comm{std::move(comm)};
    return strata::OkStatus();
  });
}

void strata_comm_free(strata_comm* comm) { delete comm; }

int strata_optimizer_create(strata_device* device, strata_comm* comm, void* stream,
                            const char* config_json, const strata_param* params, size_t num_params,
                            const strata_hyper* hypers, uint32_t num_groups,
                            strata_optimizer** out) {
  constexpr const char* kFn = "strata_optimizer_create";
  if (out == nullptr) return ReportNull(kFn, "out");
  *out = nullptr;
  if (device == nullptr) return ReportNull(kFn, "device");
  if (config_json == nullptr) return ReportNull(kFn, "config_json");
  if (params == nullptr && num_params > 0) return ReportNull(kFn, "params");
  return Guard(kFn, [&]() -> Status {
    STRATA_ASSIGN_OR_RETURN(strata::OffloadConfig config, strata::ParseConfigJson(config_json));
    STRATA_RETURN_IF_ERROR(strata::ValidateConfig(config));
    if (num_groups == 0) {
      return strata::InvalidArgumentError(fmt::format("{}: num_groups is 0", kFn));
    }
    // Before anything is sized by it: every group needs a param.
    if (num_groups > num_params) {
      return strata::InvalidArgumentError(fmt::format(
          "{}: num_groups is {} but there are {} params; every group needs at least one", kFn,
          num_groups, num_params));
    }
    std::vector<strata::ParamGroup> groups(num_groups);
    for (uint32_t g = 0; g < num_groups; ++g) {
      groups[g].hyper = hypers != nullptr ? ToHyper(hypers[g]) : strata::DefaultGroupHyper(config);
    }
    uint32_t last_group = 0;
    for (size_t i = 0; i < num_params; ++i) {
      const strata_param& p = params[i];
      if (p.group >= num_groups || p.group < last_group) {
        return strata::InvalidArgumentError(fmt::format(
            "{}: param {} is in group {}; groups must be in [0, {}) and non-decreasing along "
            "the params (group 0's params first)",
            kFn, i, p.group, num_groups));
      }
      last_group = p.group;
      groups[p.group].params.push_back({.name = p.name != nullptr ? p.name : "",
                                        .data = p.data,
                                        .grad = p.grad,
                                        .elems = p.elems});
    }
    auto handle = std::make_unique<strata_optimizer>();
    strata::EngineContext context{.device = device->device.get(),
                                  .comm = comm != nullptr ? comm->comm.get() : nullptr,
                                  .storage = nullptr,
                                  .stream = {}};
    if (stream != nullptr) {
      STRATA_ASSIGN_OR_RETURN(handle->stream, device->device->WrapNativeStream(stream));
      context.stream = handle->stream.ref();
    }
    STRATA_ASSIGN_OR_RETURN(handle->trace, strata::TraceRecorder::Create({.steps = 1}));
    context.trace = handle->trace.get();
    STRATA_ASSIGN_OR_RETURN(handle->opt, strata::OffloadOptimizer::Create(context, config, groups));
    handle->Refresh();
    *out = handle.release();
    return strata::OkStatus();
  });
}

void strata_optimizer_free(strata_optimizer* opt) { delete opt; }

int strata_optimizer_grad_ready(strata_optimizer* opt, uint32_t index) {
  if (opt == nullptr) return ReportNull("strata_optimizer_grad_ready", "opt");
  return Exclusive(opt, "strata_optimizer_grad_ready", [&] { return opt->opt->GradReady(index); });
}

int strata_optimizer_reduce_gradients(strata_optimizer* opt) {
  if (opt == nullptr) return ReportNull("strata_optimizer_reduce_gradients", "opt");
  // On the host device the trainer's next micro-step writes the grads from
  // its CPU code, which no stream orders after the engine's reads: return
  // once they are read (a grad_ready's read is waited for here, or by step).
  return Exclusive(opt, "strata_optimizer_reduce_gradients",
                   [&] { return HostSync(*opt, opt->opt->ReduceGradients()); });
}

int strata_optimizer_step(strata_optimizer* opt) {
  if (opt == nullptr) return ReportNull("strata_optimizer_step", "opt");
  return Exclusive(opt, "strata_optimizer_step", [&] { return HostSync(*opt, opt->opt->Step()); });
}

int strata_optimizer_zero_grad(strata_optimizer* opt) {
  if (opt == nullptr) return ReportNull("strata_optimizer_zero_grad", "opt");
  return Exclusive(opt, "strata_optimizer_zero_grad",
                   [&] { return HostSync(*opt, opt->opt->ZeroGrad()); });
}

int strata_optimizer_zero_grad_tensors(strata_optimizer* opt) {
  if (opt == nullptr) return ReportNull("strata_optimizer_zero_grad_tensors", "opt");
  return Exclusive(opt, "strata_optimizer_zero_grad_tensors",
                   [&] { return HostSync(*opt, opt->opt->ZeroGradTensors()); });
}

double strata_optimizer_loss_scale(const strata_optimizer* opt) {
  return opt == nullptr ? 1.0 : opt->Read().loss_scale;
}

int64_t strata_optimizer_step_count(const strata_optimizer* opt) {
  return opt == nullptr ? 0 : opt->Read().step_count;
}

int strata_optimizer_rank(const strata_optimizer* opt) {
  return opt == nullptr ? 0 : opt->opt->rank();
}

int strata_optimizer_world_size(const strata_optimizer* opt) {
  return opt == nullptr ? 1 : opt->opt->world_size();
}

uint32_t strata_optimizer_num_groups(const strata_optimizer* opt) {
  return opt == nullptr ? 0 : opt->opt->num_groups();
}

int strata_optimizer_get_hyper(const strata_optimizer* opt, uint32_t group, strata_hyper* out) {
  if (opt == nullptr) return ReportNull("strata_optimizer_get_hyper", "opt");
  if (out == nullptr) return ReportNull("strata_optimizer_get_hyper", "out");
  return Exclusive(opt, "strata_optimizer_get_hyper", [&]() -> Status {
    if (group >= opt->opt->num_groups()) {
      return strata::OutOfRangeError(
          fmt::format("strata_optimizer_get_hyper: group {} of {}", group, opt->opt->num_groups()));
    }
    *out = FromHyper(opt->opt->group_hyper(group));
    return strata::OkStatus();
  });
}

int strata_optimizer_set_hyper(strata_optimizer* opt, uint32_t group, const strata_hyper* hyper) {
  if (opt == nullptr) return ReportNull("strata_optimizer_set_hyper", "opt");
  if (hyper == nullptr) return ReportNull("strata_optimizer_set_hyper", "hyper");
  return Exclusive(opt, "strata_optimizer_set_hyper",
                   [&] { return opt->opt->SetGroupHyper(group, ToHyper(*hyper)); });
}

int strata_optimizer_set_lr(strata_optimizer* opt, uint32_t group, double lr) {
  if (opt == nullptr) return ReportNull("strata_optimizer_set_lr", "opt");
  return Exclusive(opt, "strata_optimizer_set_lr", [&]() -> Status {
    if (group >= opt->opt->num_groups()) {
      return strata::OutOfRangeError(
          fmt::format("strata_optimizer_set_lr: group {} of {}", group, opt->opt->num_groups()));
    }
    strata::GroupHyper h = opt->opt->group_hyper(group);
    h.lr = lr;
    return opt->opt->SetGroupHyper(group, h);
  });
}

int strata_optimizer_last_step(const strata_optimizer* opt, strata_step_stats* out,
                               size_t out_size) {
  if (opt == nullptr) return ReportNull("strata_optimizer_last_step", "opt");
  if (out == nullptr) return ReportNull("strata_optimizer_last_step", "out");
  // A value getter: the copy taken when the last call ended, never refused.
  return Guard("strata_optimizer_last_step", [&]() -> Status {
    constexpr size_t kLeast = offsetof(strata_step_stats, skipped) + sizeof(int32_t);
    if (out_size < kLeast) {
      return strata::InvalidArgumentError(
          fmt::format("strata_optimizer_last_step: out_size {} is smaller than the first fields of "
                      "strata_step_stats ({} bytes): pass sizeof(strata_step_stats)",
                      out_size, kLeast));
    }
    const strata::StepStats s = opt->Read().last;
    strata_step_stats v;
    std::memset(&v, 0, sizeof v);  // the padding too: the caller gets bytes we chose
    v.step = s.step;
    v.skipped = s.skipped ? 1 : 0;
    v.loss_scale = s.loss_scale;
    v.grad_norm = s.grad_norm;
    v.clip_coef = s.clip_coef;
    v.micro_steps = s.micro_steps;
    v.d2h_sec = s.times.d2h;
    v.comm_sec = s.times.comm;
    v.read_sec = s.times.read;
    v.adam_sec = s.times.adam;
    v.write_sec = s.times.write;
    v.h2d_sec = s.times.h2d;
    v.step_sec = s.times.step;
    v.grad_stats_sec = s.times.grad_stats;
    v.device_sec = s.times.device;
    v.read_bytes = s.read_bytes;
    v.write_bytes = s.write_bytes;
    v.d2h_bytes = s.d2h_bytes;
    v.h2d_bytes = s.h2d_bytes;
    v.nonfinite_elems = s.nonfinite_elems;
    v.resident_bytes = s.resident_bytes;
    v.host_dram_bytes = s.host_dram_bytes;
    // The caller's struct is a prefix of ours (an older header) or ours is a
    // prefix of the caller's (a newer one): copy what both know, zero the rest.
    auto* dst = reinterpret_cast<unsigned char*>(out);
    const size_t known = std::min(out_size, sizeof v);
    std::memcpy(dst, &v, known);
    std::memset(dst + known, 0, out_size - known);
    return strata::OkStatus();
  });
}

uint64_t strata_optimizer_last_step_nonfinite(const strata_optimizer* opt) {
  return opt == nullptr ? 0 : opt->Read().last.nonfinite_elems;
}

size_t strata_optimizer_format_stats(const strata_optimizer* opt, char* buf, size_t capacity) {
  if (opt == nullptr) return CopyText("", buf, capacity);
  return CopyText(strata::FormatStepStats(opt->Read().last), buf, capacity);
}

size_t strata_optimizer_format_plan(const strata_optimizer* opt, char* buf, size_t capacity) {
  if (opt == nullptr) return CopyText("", buf, capacity);
  return CopyText(strata::FormatPlan(opt->opt->plan()), buf, capacity);
}

int strata_optimizer_step_state(const strata_optimizer* opt) {
  return opt != nullptr && opt->Read().step_failed ? STRATA_STEP_FAILED : STRATA_STEP_READY;
}

size_t strata_optimizer_format_step_failure(const strata_optimizer* opt, char* buf,
                                            size_t capacity) {
  return CopyText(opt == nullptr ? "" : opt->Read().step_failure, buf, capacity);
}

int strata_optimizer_retry_step(strata_optimizer* opt) {
  if (opt == nullptr) return ReportNull("strata_optimizer_retry_step", "opt");
  return Exclusive(opt, "strata_optimizer_retry_step",
                   [&] { return HostSync(*opt, opt->opt->RetryStep()); });
}

int strata_optimizer_rebind_param(strata_optimizer* opt, uint32_t index, void* data, void* grad) {
  if (opt == nullptr) return ReportNull("strata_optimizer_rebind_param", "opt");
  return Exclusive(opt, "strata_optimizer_rebind_param",
                   [&] { return opt->opt->RebindParam(index, data, grad); });
}

int strata_optimizer_rebind_params(strata_optimizer* opt, const strata_binding* bindings,
                                   size_t count) {
  constexpr const char* kFn = "strata_optimizer_rebind_params";
  if (opt == nullptr) return ReportNull(kFn, "opt");
  if (bindings == nullptr && count > 0) return ReportNull(kFn, "bindings");
  return Exclusive(opt, kFn, [&]() -> Status {
    std::vector<strata::ParamBinding> moves(count);
    for (size_t i = 0; i < count; ++i) {
      moves[i] = {.index = bindings[i].index, .data = bindings[i].data, .grad = bindings[i].grad};
    }
    return opt->opt->RebindParams(moves);
  });
}

int strata_optimizer_reload_params(strata_optimizer* opt, const uint32_t* indices, size_t count,
                                   uint64_t* adopted) {
  constexpr const char* kFn = "strata_optimizer_reload_params";
  if (opt == nullptr) return ReportNull(kFn, "opt");
  if (indices == nullptr && count > 0) return ReportNull(kFn, "indices");
  return Exclusive(opt, kFn, [&]() -> Status {
    const std::span<const uint32_t> which(indices, count);
    STRATA_ASSIGN_OR_RETURN(const uint64_t n, opt->opt->ReloadParams(which));
    if (adopted != nullptr) *adopted = n;
    return strata::OkStatus();
  });
}

int strata_optimizer_set_param_shape(strata_optimizer* opt, uint32_t index, const uint64_t* dims,
                                     uint32_t ndim) {
  constexpr const char* kFn = "strata_optimizer_set_param_shape";
  if (opt == nullptr) return ReportNull(kFn, "opt");
  if (dims == nullptr && ndim > 0) return ReportNull(kFn, "dims");
  return Exclusive(opt, kFn, [&]() -> Status {
    const auto params = opt->opt->params();
    if (index >= params.size()) {
      return strata::OutOfRangeError(
          fmt::format("{}: param {} of {} registered", kFn, index, params.size()));
    }
    std::vector<uint64_t> shape(dims, dims + ndim);
    uint64_t product = 1;
    bool wraps = false;  // past 2^64: the checkpoint reader would refuse the manifest
    for (uint64_t d : shape) wraps |= __builtin_mul_overflow(product, d, &product);
    if (wraps) {
      return strata::InvalidArgumentError(
          fmt::format("{}: param {} ('{}'): the shape [{}] holds more than 2^64 elements", kFn,
                      index, params[index].name, fmt::join(shape, ", ")));
    }
    if (product != params[index].elems) {
      return strata::InvalidArgumentError(
          fmt::format("{}: param {} ('{}') has {} elems; the shape [{}] holds {}", kFn, index,
                      params[index].name, params[index].elems, fmt::join(shape, ", "), product));
    }
    if (opt->shapes.empty()) {
      for (const strata::Param& p : params) opt->shapes.push_back({p.elems});
    }
    opt->shapes[index] = std::move(shape);
    return strata::OkStatus();
  });
}

int strata_optimizer_trace_enable(strata_optimizer* opt, int steps) {
  constexpr const char* kFn = "strata_optimizer_trace_enable";
  if (opt == nullptr) return ReportNull(kFn, "opt");
  return Exclusive(opt, kFn, [&]() -> Status {
    if (steps < 0) {
      return strata::InvalidArgumentError(fmt::format(
          "{}: steps is {}; give the number of steps to keep (> 0) or 0 to stop", kFn, steps));
    }
    STRATA_RETURN_IF_ERROR(opt->opt->CheckNotForked(kFn));
    strata::TraceRecorder& trace = *opt->trace;
    trace.SetEnabled(false);
    // No engine thread may record while the ring is resized.
    STRATA_RETURN_IF_ERROR(opt->opt->device().Synchronize());
    if (steps == 0) return strata::OkStatus();
    STRATA_RETURN_IF_ERROR(trace.SetSteps(static_cast<uint32_t>(steps)));
    trace.SetEnabled(true);
    return strata::OkStatus();
  });
}

int strata_optimizer_trace_write(strata_optimizer* opt, const char* path,
                                 const char* other_data_json) {
  constexpr const char* kFn = "strata_optimizer_trace_write";
  if (opt == nullptr) return ReportNull(kFn, "opt");
  if (path == nullptr) return ReportNull(kFn, "path");
  return Exclusive(opt, kFn, [&]() -> Status {
    nlohmann::json other = nlohmann::json::object();
    if (other_data_json != nullptr) {
      bool too_deep = false;
      other = strata::ParseJsonBounded<nlohmann::json>(other_data_json, &too_deep);
      if (too_deep) {
        return strata::InvalidArgumentError(
            fmt::format("{}: other_data_json nests deeper than {} levels; give a flatter object",
                        kFn, strata::kMaxJsonDepth));
      }
      if (other.is_discarded()) {
        return strata::InvalidArgumentError(
            fmt::format("{}: other_data_json is not valid JSON ('{}'); give a JSON object or NULL",
                        kFn, other_data_json));
      }
      if (!other.is_object()) {
        return strata::InvalidArgumentError(fmt::format(
            "{}: other_data_json is a JSON {}, not an object ('{}'); give an object or NULL", kFn,
            other.type_name(), other_data_json));
      }
      if (const std::string repeated = strata::RepeatedJsonKey(other_data_json);
          !repeated.empty()) {
        return strata::InvalidArgumentError(fmt::format(
            "{}: other_data_json has the key {} more than once; JSON keeps only the last value, "
            "so remove the others",
            kFn, repeated));
      }
    }
    const strata::OffloadOptimizer& o = *opt->opt;
    const nlohmann::json base = {{"source", "strata C API"},
                                 {"rank", o.rank()},
                                 {"world_size", o.world_size()},
                                 {"params", o.layout().tensor_elems},
                                 {"step_count", o.step_count()}};
    for (const auto& [key, value] : base.items()) {
      if (!other.contains(key)) other[key] = value;
    }
    strata::TraceRecorder& trace = *opt->trace;
    const bool was = trace.enabled();
    trace.SetEnabled(false);
    Status s = opt->opt->device().Synchronize();
    if (s.ok()) s = trace.WriteChromeTrace(path, other.dump());
    trace.SetEnabled(was);
    return s;
  });
}

int strata_optimizer_save(strata_optimizer* opt, const char* dir) {
  if (opt == nullptr) return ReportNull("strata_optimizer_save", "opt");
  if (dir == nullptr) return ReportNull("strata_optimizer_save", "dir");
  return Exclusive(opt, "strata_optimizer_save",
                   [&] { return strata::SaveCheckpoint(*opt->opt, dir, {.shapes = opt->shapes}); });
}

int strata_optimizer_load(strata_optimizer* opt, const char* dir) {
  if (opt == nullptr) return ReportNull("strata_optimizer_load", "opt");
  if (dir == nullptr) return ReportNull("strata_optimizer_load", "dir");
  return Exclusive(opt, "strata_optimizer_load", [&] {
    // A trainer that set no shapes takes the save's, so that its next save
    // (and that save's export) is shaped as the one it resumed from.
    strata::TensorShapes saved;
    STRATA_RETURN_IF_ERROR(HostSync(
        *opt, strata::LoadCheckpoint(*opt->opt, dir,
                                     {.shapes = opt->shapes,
                                      .saved_shapes = opt->shapes.empty() ? &saved : nullptr})));
    if (!saved.empty()) opt->shapes = std::move(saved);
    return strata::OkStatus();
  });
}

int strata_checkpoint_export(const char* dir, const char* out, const char* dtype,
                             uint64_t max_shard_bytes, int force) {
  constexpr const char* kFn = "strata_checkpoint_export";
  if (dir == nullptr) return ReportNull(kFn, "dir");
  if (out == nullptr) return ReportNull(kFn, "out");
  if (dtype == nullptr) return ReportNull(kFn, "dtype");
  return Guard(kFn, [&]() -> Status {
    const std::string d = dtype;
    strata::ExportOptions o;
    if (d == "fp32") {
      o.dtype = strata::DType::kF32;
    } else if (d == "bf16") {
      o.dtype = strata::DType::kBF16;
    } else if (d == "fp16") {
      o.dtype = strata::DType::kF16;
    } else {
      return strata::InvalidArgumentError(
          fmt::format("{}: dtype '{}'; use fp32, bf16 or fp16", kFn, d));
    }
    o.max_shard_bytes = max_shard_bytes;
    o.existing = force != 0 ? strata::ExistingFile::kReplace : strata::ExistingFile::kRefuse;
    return strata::ExportSafetensors(dir, out, o).status();
  });
}

}  // extern "C"
