#pragma once

#include <memory>
#include <string>

namespace ferry::detail {

class Core;

/// A connector's Prometheus endpoint (ConnectorOptions::metrics, docs/operations.md): while
/// the returned handle lives, GET /metrics at `listen` includes `core`'s figures. Every
/// connector of the process that names the same address shares one HTTP server, which serves
/// from the first of them until the process ends (only the figures of live connectors). Throws
/// Error(InvalidArgument) when the address cannot be served, Error(Unsupported) in a build
/// without prometheus-cpp.
std::shared_ptr<void> serve_metrics(const std::shared_ptr<Core>& core, const std::string& listen);

/// `core`'s figures in the Prometheus text format (Connector::metrics()). Throws
/// Error(Unsupported) in a build without prometheus-cpp.
std::string metrics_text(Core& core);

}  // namespace ferry::detail
