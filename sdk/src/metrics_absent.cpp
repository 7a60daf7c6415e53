// A build without prometheus-cpp: asking for metrics says so.
#include <ferry/error.hpp>

#include "sdk/src/metrics.hpp"

namespace ferry::detail {

namespace {

[[noreturn]] void absent() {
  throw Error(ErrorCode::Unsupported,
              "this build of ferry has no Prometheus metrics (prometheus-cpp was not found when "
              "it was built; Debian: prometheus-cpp-dev)");
}

}  // namespace

std::shared_ptr<void> serve_metrics(const std::shared_ptr<Core>&, const std::string&) { absent(); }

std::string metrics_text(Core&) { absent(); }

}  // namespace ferry::detail
