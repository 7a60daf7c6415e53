#pragma once

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include <ferry/options.hpp>
#include <ferry/rdma_metadata.hpp>

#include "loop/log.hpp"
#include "transport/transport.hpp"

struct uv_loop_s;

namespace ferry::transport::verbs {
struct VerbsApi;
}

namespace ferry::detail {

/// What a transport is built from: the connector's loop, its settings and identity.
struct TransportContext {
  uv_loop_s* loop = nullptr;
  /// Runs a task after the current loop callback (EventLoop::defer).
  std::function<void(std::function<void()>)> defer;
  const ConnectorOptions* options = nullptr;
  const PeerIdentity* identity = nullptr;
  /// The connector's log.
  loop::Log log;
  /// The address to listen on for network methods: TcpOptions::bind_address, else the NATS
  /// socket's local address, else 127.0.0.1.
  std::string bind_address;
};

/// How to make one method's transport. `make` returns null and says why in `why` when this
/// host cannot offer the method (no device, not permitted); it throws Error for bad options.
struct TransportFactory {
  std::string method;
  std::function<std::unique_ptr<transport::Transport>(const TransportContext& context,
                                                      std::string& why)>
      make;
  int rank = 0;  ///< the rank its transport reports (for probe_methods)
  /// Why this host cannot offer the method under `options`, without starting anything
  /// (empty: it can). Null: it always can.
  std::function<std::string(const ConnectorOptions& options)> unavailable{};
  /// What the method needs of a peer, shown when it is available.
  std::string needs{};
  /// Whether its transport moves CUDA memory (Capabilities::memory_kinds) where CUDA is usable.
  bool moves_cuda = false;
  /// Whether it moves host memory (every method but cuda_ipc).
  bool moves_host = true;
};

/// The methods this library has, then those added by add_transport_factory, in that order.
/// Every connector starts one transport per factory, unless ConnectorOptions::transports
/// leaves it out. Any thread.
std::vector<TransportFactory> transport_factories();

/// Adds a method for connectors created from now on, in this process (tests add a fake
/// transport this way). Replaces the factory of the same method, built in or added before
/// (tests wrap a real transport in a fault-injecting one this way). Any thread.
void add_transport_factory(TransportFactory factory);
/// Removes a method added by add_transport_factory. Any thread.
void remove_transport_factory(const std::string& method);

/// The verbs transport of a connector, calling `api` (the system's, or a simulated fabric in
/// tests). Throws Error(Unsupported) where ferry was built without verbs.
std::unique_ptr<transport::Transport> make_verbs_transport(const TransportContext& context,
                                                           const transport::verbs::VerbsApi* api);

}  // namespace ferry::detail
