// Communicator: collectives across the data-parallel ranks, enqueued on a
// device stream.
//
// ZeRO needs four: ReduceScatter (each rank gets the summed gradient of its
// shard), AllReduce (grad norm, overflow flag), AllGather (updated param
// shards to every rank) and Barrier. Two backends:
//   - local (CreateLocalGroup): N ranks are N threads of one process sharing
//     memory, for tests and the host device. Device memory must be
//     host-addressable (DeviceCaps::host_addressable_memory).
//   - nccl (CreateNcclCommunicator): one rank per process or GPU, built with
//     CUDA + NCCL, bootstrapped from an NcclUniqueId that the caller passes
//     around (e.g. torch.distributed) or that rank 0 writes to a shared
//     rendezvous file (WriteNcclUniqueIdFile / ReadNcclUniqueIdFile).
//
//   auto comms = *CreateLocalGroup(4, *device);         // ranks 0..3
//   // on rank r's thread, with r's own stream:
//   comms[r]->ReduceScatter(grads, shard, shard_elems, DType::kF32, ReduceOp::kSum, stream);
//   comms[r]->AllGather(shard, params, shard_elems, DType::kBF16, stream);
//   device->StreamSynchronize(stream);
//
// Ordering: a collective is enqueued in the order of `stream` and never runs
// inline in the call; its buffers must stay valid until the stream reaches
// it. Every rank must issue the same collectives in the same order with the
// same count, dtype and op. On the local backend each rank must use its own
// stream (ranks rendezvous inside the stream; two ranks on one stream would
// wait for each other forever, and the rendezvous times out instead).
//
// Layouts: ReduceScatter's `send` holds world_size * recv_count elements and
// rank r receives the reduction of block r; AllGather's `recv` holds
// world_size * send_count elements, block r from rank r. AllReduce may be
// in place (send == recv); so may ReduceScatter with recv == send +
// rank * recv_count, and AllGather with send == recv + rank * send_count.
//
// Numerics: the local backend reduces in rank order 0, 1, 2, ... so every
// rank gets bitwise the same result, independent of thread timing. fp16 and
// bf16 are summed in fp32 and rounded once; fp32 in fp32; fp64 in fp64;
// integers wrap. NCCL uses its own order and sums fp16/bf16 in their type.
//
// Errors: a mismatch between ranks (count, dtype, op or collective) or a
// rendezvous timeout becomes the stream's sticky error on every rank
// (FailedPrecondition / Unavailable) and the local group stays failed; NCCL
// cannot see a mismatch: its ranks wait (its timeout, NcclOptions, then fails
// the communicator with Unavailable the same way) or, where the calls happen
// to fit together, complete with wrong data;
// invalid arguments (null buffers, an unsupported dtype/op) are returned
// synchronously as InvalidArgument.
//
// Thread-safety: one thread per rank; a Communicator is used by one thread at
// a time. The ranks of a local group may be destroyed in any order.
#pragma once

#include <array>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "runtime/device.h"
#include "runtime/dtype.h"
#include "runtime/status.h"

namespace strata {

enum class ReduceOp : uint8_t { kSum = 0, kMax = 1 };
std::string_view ReduceOpName(ReduceOp op);  // "sum", "max"

class Communicator {
 public:
  virtual ~Communicator() = default;

  virtual int rank() const = 0;
  virtual int world_size() const = 0;
  virtual Device& device() const = 0;
  // "local", "nccl".
  virtual std::string_view backend() const = 0;

  // recv[i] = op over ranks of send[i], for i < count.
  virtual Status AllReduce(const void* send, void* recv, size_t count, DType dtype, ReduceOp op,
                           StreamRef stream) = 0;
  // recv[i] = op over ranks of send[rank * recv_count + i], for i < recv_count.
  virtual Status ReduceScatter(const void* send, void* recv, size_t recv_count, DType dtype,
                               ReduceOp op, StreamRef stream) = 0;
  // recv[r * send_count + i] = send of rank r [i].
  virtual Status AllGather(const void* send, void* recv, size_t send_count, DType dtype,
                           StreamRef stream) = 0;
  // Work enqueued on `stream` after the barrier runs once every rank reached it.
  virtual Status Barrier(StreamRef stream) = 0;

  // OK while the communicator can run collectives; otherwise the failure
  // that stopped it for good (a local group that failed, an NCCL
  // communicator its watchdog aborted): every later collective fails, and
  // only a new communicator on every rank recovers. Any thread.
  virtual Status health() const { return OkStatus(); }
};

struct LocalGroupOptions {
  // How long a rank waits for the others at a collective before the group fails.
  std::chrono::milliseconds rendezvous_timeout{60'000};
};

// A group of `world_size` in-process ranks; rank r uses devices[r] (all may be
// the same device). InvalidArgument for world_size < 1, a device count other
// than world_size, or a device whose memory is not host-addressable.
Result<std::vector<std::unique_ptr<Communicator>>> CreateLocalGroup(
    int world_size, std::span<Device* const> devices, const LocalGroupOptions& options = {});
Result<std::vector<std::unique_ptr<Communicator>>> CreateLocalGroup(
    int world_size, Device& device, const LocalGroupOptions& options = {});

// Opaque bytes of an ncclUniqueId (NCCL_UNIQUE_ID_BYTES == 128).
struct NcclUniqueId {
  std::array<uint8_t, 128> bytes{};
};

// A fresh id (rank 0 makes it and shares it). Unimplemented without NCCL.
Result<NcclUniqueId> NewNcclUniqueId();

struct NcclOptions {
  // How long a collective may run once its stream reached it. NCCL waits
  // for a missing peer forever; past this bound the communicator is aborted
  // (its kernels return), the collective's stream gets an Unavailable sticky
  // error naming it, and every later collective fails at once with it. The
  // communicator cannot be used again: rebuild it (and the optimizer) on
  // every rank. Also bounds the destructor's wait for work in flight, and
  // the creation's wait for every rank to join (Unavailable past it).
  std::chrono::milliseconds timeout{600'000};
};

// Rank `rank` of `world_size` on a CUDA device. Collective: every rank calls
// it with the same id. A rank that never does (it failed first, exited, got
// another id) fails the others with Unavailable after options.timeout
// (ncclCommInitRank itself has none: it is left waiting on a thread of its
// own, and what it makes if it ever returns is aborted). Unimplemented without NCCL;
// InvalidArgument for a non-CUDA device, a rank outside [0, world_size) or a
// timeout that is not positive. An asynchronous NCCL error (a peer's or the
// network's) fails the communicator as a timeout does.
Result<std::unique_ptr<Communicator>> CreateNcclCommunicator(const NcclUniqueId& id, int rank,
                                                             int world_size, Device& device,
                                                             const NcclOptions& options = {});

// Writes the id to `path` atomically (AtomicFileWriter: a temporary file,
// fsync, rename), so a reader never sees a partial id.
Status WriteNcclUniqueIdFile(const std::string& path, const NcclUniqueId& id);
// Waits up to `timeout` for `path` to appear, then reads the id.
// Unavailable naming the path when it does not appear in time; DataLoss when
// its size is wrong.
Result<NcclUniqueId> ReadNcclUniqueIdFile(const std::string& path,
                                          std::chrono::milliseconds timeout);

}  // namespace strata
