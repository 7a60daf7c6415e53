// Queues the loop thread fills without the GIL, and the eventfds that wake asyncio for them.
#pragma once

#include <atomic>
#include <mutex>
#include <string>

#include "binding.hpp"

namespace ferry::python {

/// A nonblocking eventfd: signal() from any thread, clear() from the one that drains.
class EventFd {
 public:
  EventFd();
  ~EventFd();
  EventFd(const EventFd&) = delete;
  EventFd& operator=(const EventFd&) = delete;
  int fd() const noexcept { return fd_; }
  void signal() noexcept;
  void clear() noexcept;

 private:
  int fd_;
};

class Completions {
 public:
  struct Entry {
    std::uint64_t key = 0;
    OperationStatus status = OperationStatus::complete;
    std::optional<Error> error;
    /// The reply to a request (messaging); empty for operations.
    std::optional<Message> message;
  };
  /// Shared with every callback registered, so that it outlives this handle if need be.
  struct Shared {
    EventFd fd;
    std::mutex mu;
    std::vector<Entry> ready;
    void push(Entry e);
    std::vector<Entry> take();
  };

  Completions() : shared_(std::make_shared<Shared>()) {}
  int fd() const noexcept { return shared_->fd.fd(); }
  const std::shared_ptr<Shared>& shared() const noexcept { return shared_; }

 private:
  std::shared_ptr<Shared> shared_;
};

/// Wakes a Python waiter for a stream of events (a region's): the first notify() after a
/// clear() signals the fd, later ones until the next clear() do nothing.
class Notifier {
 public:
  int fd() const noexcept { return fd_.fd(); }
  void notify() noexcept;
  void clear() noexcept;

 private:
  EventFd fd_;
  std::atomic<bool> pending_{false};
};

}  // namespace ferry::python
