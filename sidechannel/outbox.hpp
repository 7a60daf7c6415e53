#pragma once

#include <condition_variable>
#include <deque>
#include <functional>
#include <mutex>
#include <thread>

namespace ferry::sidechannel {

/// A thread of its own that runs tasks one at a time, in the order they were pushed.
/// NatsChannel makes its calls that take cnats' connection lock here (see its class comment).
/// The destructor runs what is queued, then joins the thread.
class Outbox {
 public:
  using Task = std::function<void()>;

  /// Starts the thread.
  Outbox();
  ~Outbox();
  Outbox(const Outbox&) = delete;
  Outbox& operator=(const Outbox&) = delete;

  /// Queues `task`. Any thread. Dropped once finish() has been called.
  void push(Task task);
  /// Takes no more tasks: the thread runs those queued, then ends. Any thread; idempotent.
  void finish();
  /// finish(), then waits for the thread to end. Any thread but the outbox's own; idempotent.
  void stop();

 private:
  void run();

  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Task> tasks_;  // guarded by mu_
  bool finishing_ = false;  // guarded by mu_
  std::thread thread_;      // last: started once the rest is in place
};

}  // namespace ferry::sidechannel
