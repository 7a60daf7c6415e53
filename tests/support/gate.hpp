#pragma once

#include <chrono>
#include <condition_variable>
#include <mutex>

namespace ferry::test {

/// A gate a loop thread waits at (for at most `most`) until the test opens it: while it waits,
/// nothing else runs on that loop. The test may first wait until the loop has entered it.
class Gate {
 public:
  explicit Gate(std::chrono::milliseconds most = std::chrono::seconds(10)) : most_(most) {}

  void wait() {
    std::unique_lock lock(mu_);
    entered_ = true;
    cv_.notify_all();
    cv_.wait_for(lock, most_, [&] { return open_; });
  }
  /// Whether the loop reached wait() within `most`.
  bool wait_entered() {
    std::unique_lock lock(mu_);
    return cv_.wait_for(lock, most_, [&] { return entered_; });
  }
  void open() {
    std::lock_guard lock(mu_);
    open_ = true;
    cv_.notify_all();
  }

 private:
  const std::chrono::milliseconds most_;
  std::mutex mu_;
  std::condition_variable cv_;
  bool entered_ = false;
  bool open_ = false;
};

}  // namespace ferry::test
