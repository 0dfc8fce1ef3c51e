// IoPump: the one thread that drives the engine's StateStore (the store is
// driven by one thread, offload/state_store.h; the engine's calling thread
// runs CPU Adam). Reads and writes of different extents are in flight at
// once: each request starts as soon as the buffer it uses is free, and the
// store interleaves the chunks of every op in flight at its queue depth, so a
// write-behind never waits for a read-ahead's whole extent or the other way
// round.
//
//   IoPump pump(*store);
//   std::future<Status> w = pump.Submit({IoOp::kWrite, extent, buf, /*slot=*/0});
//   std::future<Status> r = pump.Submit({IoOp::kRead, next, buf, /*slot=*/0});  // after w
//   ... CPU work ...
//   STRATA_RETURN_IF_ERROR(r.get());
//
// Ordering is per buffer slot: requests naming the same `slot` run one after
// the other in submission order (a read that reuses a buffer starts once the
// write from it finished); requests on different slots run together. The
// caller numbers its buffers; one extent must always use one slot (the store
// refuses two ops on one extent at once). `on_done` runs on the pump thread
// when a request finishes (trace, figures, context for the error).
//
// busy_sec(): wall time with at least one request in flight (the union of
// the requests' times: NVMe busy time as the drive sees it).
//
// Reads leave the payload's checksum to the caller (PayloadCheck::kCaller:
// StateStore::VerifyPayload before the data is used) and writes take it from
// the request, so the pump thread never hashes: it only feeds the drive.
//
// Thread-safety: Submit and TakeBusySec may be called from any thread. The
// destructor finishes every request submitted (their buffers' owners wait on
// them), then joins the thread. Internal to offload/.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <future>
#include <map>
#include <mutex>
#include <span>
#include <thread>

#include "offload/state_store.h"
#include "runtime/status.h"

namespace strata::internal {

class IoPump {
 public:
  struct Request {
    IoOp op = IoOp::kRead;
    uint32_t extent = 0;
    std::span<std::byte> buffer;
    uint64_t payload_hash = 0;  // writes: StateStore::PayloadHash of the buffer
    uint32_t slot = 0;          // requests on one slot run in submission order
    // Runs on the pump thread when the request finished; its result is what
    // the future gives (the place to add context). Empty: the store's status.
    std::function<Status(uint64_t begin_ns, uint64_t end_ns, Status)> on_done{};
  };

  explicit IoPump(StateStore& store);
  ~IoPump();
  IoPump(const IoPump&) = delete;
  IoPump& operator=(const IoPump&) = delete;

  std::future<Status> Submit(Request request);
  // Wall time with a request in flight since the last call.
  double TakeBusySec();

 private:
  struct Entry {
    Request request;
    std::promise<Status> done{};
    bool started = false;
    StateStore::Ticket ticket{};
    uint64_t begin_ns = 0;
  };
  void Run();
  void Complete(Entry& e, Status s);

  StateStore& store_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Entry> incoming_;
  bool stop_ = false;
  double busy_sec_ = 0;  // under mu_
  // Pump thread only: per slot, the requests in order (the head may run).
  std::map<uint32_t, std::deque<Entry>> slots_;
  std::thread thread_;
};

}  // namespace strata::internal
