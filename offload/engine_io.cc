#include "offload/engine_io.h"

#include <utility>

namespace strata::internal {

IoQueue::IoQueue() : thread_([this] { Run(); }) {}

IoQueue::~IoQueue() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  thread_.join();
}

std::future<Status> IoQueue::Submit(std::function<Status()> job) {
  std::packaged_task<Status()> task(std::move(job));
  std::future<Status> result = task.get_future();
  {
    std::lock_guard<std::mutex> lock(mu_);
    jobs_.push_back(std::move(task));
  }
  cv_.notify_one();
  return result;
}

void IoQueue::Run() {
  for (;;) {
    std::packaged_task<Status()> task;
    {
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait(lock, [this] { return stop_ || !jobs_.empty(); });
      // Queued jobs still run after stop: their buffers' owners wait on them.
      if (jobs_.empty()) return;
      task = std::move(jobs_.front());
      jobs_.pop_front();
    }
    task();
  }
}

}  // namespace strata::internal
