#pragma once

#include <cstddef>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include <ferry/log.hpp>

#include "loop/log.hpp"

namespace ferry::test {

/// Keeps what a part of ferry says through its log, at every level, for a test to read.
class CapturedLog {
 public:
  /// A log whose sink keeps each message; it may outlive this object. Any thread.
  loop::Log log() const {
    LogOptions o;
    o.level = LogLevel::debug;
    o.sink = [kept = kept_](LogLevel, const std::string& message) {
      std::lock_guard lock(kept->mu);
      kept->lines.push_back(message);
    };
    return loop::Log(std::move(o), "test");
  }
  /// Every message so far, one per line.
  std::string text() const {
    std::lock_guard lock(kept_->mu);
    std::string all;
    for (const auto& line : kept_->lines) all += line + "\n";
    return all;
  }
  /// How many messages so far contain `point`.
  std::size_t count(const std::string& point) const {
    std::lock_guard lock(kept_->mu);
    std::size_t n = 0;
    for (const auto& line : kept_->lines) n += line.find(point) != std::string::npos ? 1 : 0;
    return n;
  }

 private:
  struct Kept {
    std::mutex mu;
    std::vector<std::string> lines;
  };
  std::shared_ptr<Kept> kept_ = std::make_shared<Kept>();
};

}  // namespace ferry::test
