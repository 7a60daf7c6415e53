#pragma once

#include <string>

#include <ferry/log.hpp>

namespace ferry::loop {

/// A connector's log (ConnectorOptions::log): a level, a sink, and the connector's name that
/// starts every message. A small value: each part of a connector keeps a copy. Any thread.
class Log {
 public:
  /// stderr, warnings and errors, no name: for code that runs without a connector.
  Log() = default;
  Log(LogOptions options, std::string origin);

  bool enabled(LogLevel level) const noexcept {
    return level != LogLevel::off && level_ != LogLevel::off && level >= level_;
  }
  /// Passes "<origin>: <message>" to the sink if `level` is enabled. Never throws: a sink
  /// that throws loses that message.
  void write(LogLevel level, const std::string& message) const noexcept;
  void error(const std::string& message) const noexcept { write(LogLevel::error, message); }
  void warning(const std::string& message) const noexcept { write(LogLevel::warning, message); }
  void info(const std::string& message) const noexcept { write(LogLevel::info, message); }
  void debug(const std::string& message) const noexcept { write(LogLevel::debug, message); }

 private:
  LogLevel level_ = LogLevel::warning;
  std::function<void(LogLevel, const std::string&)> sink_;
  std::string origin_;
};

/// The level FERRY_LOG names ("debug", "info", "warning", "error", "off"), or false for
/// anything else.
bool parse_level(const std::string& text, LogLevel& out) noexcept;

}  // namespace ferry::loop
