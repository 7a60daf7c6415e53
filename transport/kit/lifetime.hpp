#pragma once

#include <functional>
#include <memory>
#include <utility>

#include "transport/context.hpp"  // Defer

namespace ferry::transport::kit {

/// The life of an object that hands work to later: deferred tasks, jobs on libuv's pool,
/// callbacks of the CUDA driver. Such work holds a Watch and does nothing once the object has
/// ended its lifetime (end(), or its destructor). Loop thread only, like its owner; a Watch
/// may be tested on any thread.
class Lifetime {
 public:
  class Watch {
   public:
    /// Sees nothing alive.
    Watch() = default;
    bool alive() const noexcept { return !token_.expired(); }

   private:
    friend class Lifetime;
    explicit Watch(std::weak_ptr<const int> token) : token_(std::move(token)) {}
    std::weak_ptr<const int> token_;
  };

  Lifetime() = default;
  Lifetime(const Lifetime&) = delete;
  Lifetime& operator=(const Lifetime&) = delete;

  Watch watch() const { return Watch(token_); }
  /// Every Watch taken so far sees the end; later ones see a new life.
  void renew() { token_ = std::make_shared<const int>(0); }
  void end() noexcept { token_.reset(); }
  bool ended() const noexcept { return token_ == nullptr; }

  /// Runs `task` through `defer`, unless this lifetime ends (or renews) first.
  void defer(const Defer& defer, std::function<void()> task) const {
    defer([watch = watch(), task = std::move(task)] {
      if (watch.alive()) task();
    });
  }

 private:
  std::shared_ptr<const int> token_ = std::make_shared<const int>(0);
};

}  // namespace ferry::transport::kit
