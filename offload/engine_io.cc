#include "offload/engine_io.h"

#include <utility>

#include "runtime/trace.h"

namespace strata::internal {

IoPump::IoPump(StateStore& store) : store_(store), thread_([this] { Run(); }) {}

IoPump::~IoPump() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  thread_.join();
}

std::future<Status> IoPump::Submit(Request request) {
  Entry e{.request = std::move(request)};
  std::future<Status> result = e.done.get_future();
  {
    std::lock_guard<std::mutex> lock(mu_);
    incoming_.push_back(std::move(e));
  }
  cv_.notify_one();
  return result;
}

double IoPump::TakeBusySec() {
  std::lock_guard<std::mutex> lock(mu_);
  const double b = busy_sec_;
  busy_sec_ = 0;
  return b;
}

void IoPump::Complete(Entry& e, Status s) {
  if (e.request.on_done) s = e.request.on_done(e.begin_ns, TraceRecorder::Now(), std::move(s));
  e.done.set_value(std::move(s));
}

void IoPump::Run() {
  size_t active = 0;  // requests started and not finished
  size_t queued = 0;  // requests in slots_ (started or waiting for their slot)
  uint64_t busy_since = 0;
  for (;;) {
    {
      std::unique_lock<std::mutex> lock(mu_);
      if (queued == 0) {
        // Requests still queued run after stop: their buffers' owners wait.
        cv_.wait(lock, [this] { return stop_ || !incoming_.empty(); });
        if (incoming_.empty()) return;
      }
      while (!incoming_.empty()) {
        Entry e = std::move(incoming_.front());
        incoming_.pop_front();
        slots_[e.request.slot].push_back(std::move(e));
        ++queued;
      }
    }
    // Start the head of every slot that is not running yet.
    for (auto& [slot, queue] : slots_) {
      while (!queue.empty() && !queue.front().started) {
        Entry& e = queue.front();
        const Request& r = e.request;
        e.begin_ns = TraceRecorder::Now();
        Result<StateStore::Ticket> t =
            r.op == IoOp::kRead ? store_.ReadExtent(r.extent, r.buffer, PayloadCheck::kCaller)
                                : store_.WriteExtent(r.extent, r.buffer, r.payload_hash);
        if (!t.ok()) {
          Complete(e, t.status());
          queue.pop_front();
          --queued;
          continue;
        }
        e.started = true;
        e.ticket = *t;
        if (active++ == 0) busy_since = TraceRecorder::Now();
      }
    }
    if (active == 0) continue;
    // Wait for a chunk, then collect the requests that finished.
    Status waited = store_.WaitSome();
    for (auto& [slot, queue] : slots_) {
      if (queue.empty() || !queue.front().started) continue;
      Entry& e = queue.front();
      std::optional<Status> s = store_.Poll(e.ticket);
      if (!s.has_value()) {
        if (waited.ok()) continue;
        s = store_.Wait(e.ticket);  // the storage failed: finish it with its error
      }
      // The busy interval is counted before the request's future is ready:
      // a step that waits for its last write and then takes the busy time
      // gets all of it (it once went to the next step's).
      if (--active == 0) {
        std::lock_guard<std::mutex> lock(mu_);
        busy_sec_ += (TraceRecorder::Now() - busy_since) * 1e-9;
      }
      Complete(e, std::move(*s));
      queue.pop_front();
      --queued;
    }
  }
}

}  // namespace strata::internal
