#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <string>

#include <ferry/options.hpp>

#include "loop/log.hpp"

struct uv_loop_s;

namespace ferry::transport {

namespace cuda {
struct CudaApi;
}

/// Runs a task after the current loop callback (EventLoop::defer): how a transport reports to
/// its observers, never from inside a call into it.
using Defer = std::function<void(std::function<void()>)>;

/// What every transport is built from, besides its method's own options (TcpOptions,
/// CmaOptions, VerbsOptions): the connector's loop, identity and shared settings.
struct Context {
  uv_loop_s* loop = nullptr;
  Defer defer;
  loop::Log log;
  std::string local_name;      ///< the connector's name: peers' errors show it
  std::uint64_t local_id = 0;  ///< the connector's id
  /// How long a peer connection may stay silent while something waits for it.
  std::chrono::milliseconds peer_timeout{2000};
  /// Bounds on the peers a listener accepts before they claim anything.
  ListenerOptions listener;
  /// Where network methods listen (tcp, verbs): a numeric address.
  std::string bind_address = "127.0.0.1";
  /// The CUDA driver, where this process can use CUDA memory; null: host memory only.
  const cuda::CudaApi* cuda = nullptr;
};

}  // namespace ferry::transport
