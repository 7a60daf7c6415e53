#include "loop/log.hpp"

#include <cstdio>

namespace ferry {

std::string_view to_string(LogLevel level) noexcept {
  switch (level) {
    case LogLevel::debug:
      return "debug";
    case LogLevel::info:
      return "info";
    case LogLevel::warning:
      return "warning";
    case LogLevel::error:
      return "error";
    case LogLevel::off:
      return "off";
  }
  return "?";
}

}  // namespace ferry

namespace ferry::loop {

Log::Log(LogOptions options, std::string origin)
    : level_(options.level), sink_(std::move(options.sink)), origin_(std::move(origin)) {}

void Log::write(LogLevel level, const std::string& message) const noexcept {
  if (!enabled(level)) return;
  try {
    std::string text = origin_.empty() ? message : "connector '" + origin_ + "': " + message;
    if (sink_) {
      sink_(level, text);
      return;
    }
    // The default sink, and the one place where ferry writes to stderr: one line per message,
    // written at once so that lines of several threads do not interleave.
    std::string line = "ferry " + std::string(to_string(level)) + ": " + text + "\n";
    std::fwrite(line.data(), 1, line.size(), stderr);
  } catch (...) {
  }
}

bool parse_level(const std::string& text, LogLevel& out) noexcept {
  for (LogLevel l :
       {LogLevel::debug, LogLevel::info, LogLevel::warning, LogLevel::error, LogLevel::off})
    if (text == to_string(l)) {
      out = l;
      return true;
    }
  return false;
}

}  // namespace ferry::loop
