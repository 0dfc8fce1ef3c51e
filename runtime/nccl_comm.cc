// The NCCL communicator. Compiled only when STRATA_HAVE_NCCL (which implies
// CUDA); NCCL itself is loaded at the first use (nccl_internal.h).
// Collectives are enqueued on the CUDA stream behind the StreamRef, with the
// communicator's device current for the call only (CudaDeviceGuard).
#include <cuda_runtime_api.h>
#include <fmt/format.h>

#include <cstring>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <utility>

#include "runtime/comm.h"
#include "runtime/comm_watchdog.h"
#include "runtime/deadline_call.h"
#include "runtime/cuda_internal.h"
#include "runtime/nccl_internal.h"

namespace strata {

namespace {

using internal::CudaDeviceGuard;
using internal::LoadNccl;
using internal::NcclApi;
using internal::NcclError;

Result<ncclDataType_t> ToNccl(DType t) {
  switch (t) {
    case DType::kF32:
      return ncclFloat32;
    case DType::kF64:
      return ncclFloat64;
    case DType::kF16:
      return ncclFloat16;
    case DType::kBF16:
      return ncclBfloat16;
    case DType::kU8:
      return ncclUint8;
    case DType::kI32:
      return ncclInt32;
    case DType::kI64:
      return ncclInt64;
  }
  return InvalidArgumentError("nccl: unknown dtype");
}

ncclRedOp_t ToNccl(ReduceOp op) { return op == ReduceOp::kMax ? ncclMax : ncclSum; }

class NcclCommunicator final : public Communicator {
 public:
  NcclCommunicator(const NcclApi& nccl, ncclComm_t comm, int rank, int world_size, int ordinal,
                   Device& device)
      : nccl_(nccl),
        comm_(comm),
        rank_(rank),
        world_size_(world_size),
        ordinal_(ordinal),
        device_(device) {}

  // The watchdog and the barrier's buffer, after ncclCommInitRank (an
  // allocation that failed before it would leave the other ranks waiting in
  // theirs).
  Status Start(const NcclOptions& options) {
    STRATA_ASSIGN_OR_RETURN(
        watchdog_,
        CommWatchdog::Create(
            device_, fmt::format("nccl rank {}/{} on {}", rank_, world_size_, device_.name()),
            {.timeout = options.timeout},
            {.async_error = [this] { return AsyncError(); }, .abort = [this] { Abort(); }}));
    STRATA_ASSIGN_OR_RETURN(barrier_buffer_, device_.Allocate(sizeof(int32_t)));
    return OkStatus();
  }

  ~NcclCommunicator() override {
    if (watchdog_) {
      // Bounded: what does not finish within the timeout is aborted.
      (void)watchdog_->Drain();
      watchdog_->Stop();
      if (watchdog_->aborted()) return;  // ncclCommAbort freed the communicator
    }
    CudaDeviceGuard device_guard;
    device_guard.Select(ordinal_);
    nccl_.CommDestroy(comm_);
  }

  int rank() const override { return rank_; }
  int world_size() const override { return world_size_; }
  Device& device() const override { return device_; }
  std::string_view backend() const override { return "nccl"; }

  Status AllReduce(const void* send, void* recv, size_t count, DType dtype, ReduceOp op,
                   StreamRef stream) override {
    CudaDeviceGuard device_guard;
    STRATA_ASSIGN_OR_RETURN(cudaStream_t s,
                            Prepare(device_guard, stream, "all-reduce", count, send, recv));
    STRATA_ASSIGN_OR_RETURN(ncclDataType_t t, ToNccl(dtype));
    return Run(stream, "all-reduce", count, dtype,
               [&] { return nccl_.AllReduce(send, recv, count, t, ToNccl(op), comm_, s); });
  }

  Status ReduceScatter(const void* send, void* recv, size_t recv_count, DType dtype, ReduceOp op,
                       StreamRef stream) override {
    CudaDeviceGuard device_guard;
    STRATA_ASSIGN_OR_RETURN(
        cudaStream_t s, Prepare(device_guard, stream, "reduce-scatter", recv_count, send, recv));
    STRATA_ASSIGN_OR_RETURN(ncclDataType_t t, ToNccl(dtype));
    return Run(stream, "reduce-scatter", recv_count, dtype, [&] {
      return nccl_.ReduceScatter(send, recv, recv_count, t, ToNccl(op), comm_, s);
    });
  }

  Status AllGather(const void* send, void* recv, size_t send_count, DType dtype,
                   StreamRef stream) override {
    CudaDeviceGuard device_guard;
    STRATA_ASSIGN_OR_RETURN(cudaStream_t s,
                            Prepare(device_guard, stream, "all-gather", send_count, send, recv));
    STRATA_ASSIGN_OR_RETURN(ncclDataType_t t, ToNccl(dtype));
    return Run(stream, "all-gather", send_count, dtype,
               [&] { return nccl_.AllGather(send, recv, send_count, t, comm_, s); });
  }

  Status health() const override { return watchdog_ ? watchdog_->status() : OkStatus(); }

  Status Barrier(StreamRef stream) override {
    void* p = barrier_buffer_.data();
    CudaDeviceGuard device_guard;
    STRATA_ASSIGN_OR_RETURN(cudaStream_t s, Prepare(device_guard, stream, "barrier", 1, p, p));
    return Run(stream, "barrier", 1, DType::kI32,
               [&] { return nccl_.AllReduce(p, p, 1, ncclInt32, ncclSum, comm_, s); });
  }

 private:
  // Enqueues `call` through the watchdog, which bounds how long it may run.
  Status Run(StreamRef stream, std::string_view op, size_t count, DType dtype,
             const std::function<ncclResult_t()>& call) {
    const std::string what = fmt::format("{} of {} x {}", op, count, DTypeName(dtype));
    return watchdog_->Run(stream, what, [&] {
      return NcclError(call(), fmt::format("nccl {} on rank {}/{} ({})", what, rank_, world_size_,
                                           device_.name()));
    });
  }

  // Checks the arguments and makes the device current until `guard` goes out
  // of scope (the caller's, so it spans the NCCL call).
  Result<cudaStream_t> Prepare(CudaDeviceGuard& guard, StreamRef stream, std::string_view op,
                               size_t count, const void* send, const void* recv) {
    if (!stream || stream.impl()->owner() != &device_) {
      return InvalidArgumentError(fmt::format(
          "nccl {} on rank {}: the stream is not a stream of {}", op, rank_, device_.name()));
    }
    if (count > 0 && (send == nullptr || recv == nullptr)) {
      return InvalidArgumentError(fmt::format("nccl {} on rank {}: null buffer", op, rank_));
    }
    STRATA_RETURN_IF_CUDA_ERROR(guard.Select(ordinal_),
                                fmt::format("nccl {}: select {}", op, device_.name()));
    return internal::CudaStreamOf(stream);
  }

  // The watchdog's view of NCCL: an error a peer or the network raised
  // while collectives ran (ncclInProgress is not one).
  Status AsyncError() {
    ncclResult_t async = ncclSuccess;
    if (ncclResult_t r = nccl_.CommGetAsyncError(comm_, &async); r != ncclSuccess) {
      return NcclError(r, "ncclCommGetAsyncError");
    }
    if (async == ncclSuccess || async == ncclInProgress) return OkStatus();
    const char* detail = nccl_.GetLastError(comm_);
    return NcclError(async, fmt::format("asynchronous error{}{}",
                                        detail != nullptr && *detail != '\0' ? ": " : "",
                                        detail != nullptr ? detail : ""));
  }

  // Ends the collectives in flight (their kernels return) and frees the
  // communicator; called once, by the watchdog.
  void Abort() {
    CudaDeviceGuard device_guard;
    device_guard.Select(ordinal_);
    nccl_.CommAbort(comm_);
  }

  const NcclApi& nccl_;
  ncclComm_t comm_;
  const int rank_;
  const int world_size_;
  const int ordinal_;
  Device& device_;
  DeviceBuffer barrier_buffer_;
  std::unique_ptr<CommWatchdog> watchdog_;  // last: its thread uses the fields above
};

}  // namespace

Result<NcclUniqueId> NewNcclUniqueId() {
  static_assert(sizeof(ncclUniqueId) == sizeof(NcclUniqueId::bytes), "ncclUniqueId size changed");
  STRATA_ASSIGN_OR_RETURN(const NcclApi* nccl, LoadNccl());
  ncclUniqueId raw;
  STRATA_RETURN_IF_ERROR(NcclError(nccl->GetUniqueId(&raw), "new nccl unique id"));
  NcclUniqueId id;
  std::memcpy(id.bytes.data(), &raw, sizeof(raw));
  return id;
}

Result<std::unique_ptr<Communicator>> CreateNcclCommunicator(const NcclUniqueId& id, int rank,
                                                             int world_size, Device& device,
                                                             const NcclOptions& options) {
  const std::string what =
      fmt::format("create nccl communicator rank {}/{} on {}", rank, world_size, device.name());
  if (world_size < 1 || rank < 0 || rank >= world_size) {
    return InvalidArgumentError(what + ": rank must be in [0, world_size)");
  }
  if (options.timeout.count() <= 0) {
    return InvalidArgumentError(fmt::format(
        "{}: the collective timeout must be positive, not {} ms", what, options.timeout.count()));
  }
  Result<const NcclApi*> nccl = LoadNccl();
  if (!nccl.ok()) return std::move(nccl).status().WithContext(what);
  auto ordinal = internal::CudaOrdinalOf(device);
  if (!ordinal.ok()) return std::move(ordinal).status().WithContext(what);
  // The device must be selectable here (Start allocates on it); the init
  // thread below selects it for itself: ncclCommInitRank binds the
  // communicator to its thread's current device.
  CudaDeviceGuard device_guard;
  STRATA_RETURN_IF_CUDA_ERROR(device_guard.Select(*ordinal), what + ": select device");
  ncclUniqueId raw;
  std::memcpy(&raw, id.bytes.data(), sizeof(raw));
  // ncclCommInitRank waits for every rank and cannot be cancelled: it runs on
  // a thread of its own, bounded by the timeout; one that completes after
  // that has its communicator aborted (no collective ever ran on it).
  const NcclApi* api = *nccl;
  const int dev = *ordinal;
  using Init = std::pair<ncclResult_t, ncclComm_t>;
  std::optional<Init> init = CallWithDeadline<Init>(
      [api, raw, rank, world_size, dev]() mutable -> Init {
        ncclComm_t c = nullptr;
        if (cudaSetDevice(dev) != cudaSuccess) return {ncclUnhandledCudaError, nullptr};
        return {api->CommInitRank(&c, world_size, raw, rank), c};
      },
      options.timeout,
      [api](Init late) {
        if (late.first == ncclSuccess) api->CommAbort(late.second);
      });
  if (!init) {
    return UnavailableError(fmt::format(
        "{}: not every rank joined within {} ms (the timeout): a rank exited, failed before "
        "it created its communicator, was never started, or was given another id. Nothing "
        "was created; the wait goes on in the background and what it makes is dropped: "
        "rebuild the communicator on every rank",
        what, options.timeout.count()));
  }
  ncclComm_t comm = init->second;
  STRATA_RETURN_IF_ERROR(NcclError(init->first, what));
  auto communicator =
      std::make_unique<NcclCommunicator>(**nccl, comm, rank, world_size, *ordinal, device);
  STRATA_RETURN_IF_ERROR(communicator->Start(options).WithContext(what));
  return std::unique_ptr<Communicator>(std::move(communicator));
}

}  // namespace strata
