// IoQueue: the one thread that drives the engine's StateStore. The store is
// driven by one thread (offload/state_store.h); the engine's calling thread
// runs CPU Adam, so NVMe reads and writes are handed to this thread as jobs
// and run in submission order (FIFO), each with the store's full queue depth.
//
//   IoQueue io;
//   std::future<Status> r = io.Submit([&] { return ReadOneExtent(); });
//   ... CPU work ...
//   STRATA_RETURN_IF_ERROR(r.get());
//
// FIFO is part of the contract: the engine relies on "a read queued after a
// write of the same buffer runs after it" to reuse NVMe buffers without
// another handshake. Thread-safety: Submit may be called from any thread.
// The destructor runs the jobs still queued, then joins the thread.
// Internal to offload/.
#pragma once

#include <condition_variable>
#include <deque>
#include <functional>
#include <future>
#include <mutex>
#include <thread>

#include "runtime/status.h"

namespace strata::internal {

class IoQueue {
 public:
  IoQueue();
  ~IoQueue();
  IoQueue(const IoQueue&) = delete;
  IoQueue& operator=(const IoQueue&) = delete;

  // Queues `job`; the future gives its Status once it ran.
  std::future<Status> Submit(std::function<Status()> job);

 private:
  void Run();

  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::packaged_task<Status()>> jobs_;
  bool stop_ = false;
  std::thread thread_;
};

}  // namespace strata::internal
