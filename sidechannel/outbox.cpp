#include "sidechannel/outbox.hpp"

#include <utility>

namespace ferry::sidechannel {

Outbox::Outbox() : thread_([this] { run(); }) {}

Outbox::~Outbox() { stop(); }

void Outbox::run() {
  for (;;) {
    Task task;
    {
      std::unique_lock lock(mu_);
      cv_.wait(lock, [&] { return finishing_ || !tasks_.empty(); });
      if (tasks_.empty()) return;  // finishing, and everything queued has run
      task = std::move(tasks_.front());
      tasks_.pop_front();
    }
    task();
  }
}

void Outbox::push(Task task) {
  {
    std::lock_guard lock(mu_);
    if (finishing_) return;
    tasks_.push_back(std::move(task));
  }
  cv_.notify_one();
}

void Outbox::finish() {
  {
    std::lock_guard lock(mu_);
    finishing_ = true;
  }
  cv_.notify_one();
}

void Outbox::stop() {
  finish();
  if (thread_.joinable()) thread_.join();
}

}  // namespace ferry::sidechannel
