#pragma once

#include <functional>
#include <string>
#include <string_view>

namespace ferry {

/// How much a message of ferry's matters. `off` silences everything.
enum class LogLevel { debug, info, warning, error, off };

/// "debug", "info", "warning", "error", "off".
std::string_view to_string(LogLevel level) noexcept;

/// Where a connector's diagnostics go. ferry writes nothing to stderr itself: every message
/// (a listener that ran out of descriptors, a peer that held a copy grant past its time, a
/// NATS publish that failed, ...) goes to `sink`, when its level is `level` or above. Each
/// message names the connector, then what happened and to which peer or operation.
struct LogOptions {
  /// Messages below this are dropped. FERRY_LOG (debug, info, warning, error, off) sets it
  /// when ConnectorOptions::use_environment is on.
  LogLevel level = LogLevel::warning;
  /// Receives each message that passes `level`, with no trailing newline. Called on the
  /// thread that found the problem (usually the connector's loop thread), sometimes on a
  /// NATS or libuv pool thread; it must not block, and must not call into the connector.
  /// Empty: one line on stderr ("ferry warning: ...").
  std::function<void(LogLevel level, const std::string& message)> sink;
};

}  // namespace ferry
