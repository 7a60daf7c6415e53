#include "transport/method.hpp"
#include "transport/tcp/tcp_transport.hpp"

namespace ferry::transport {

const Method& tcp_method() {
  static const Method method = [] {
    Method m;
    m.name = "tcp";
    m.rank = 100;
    // CUDA memory through pinned host chunks, on both sides, where the driver is usable.
    m.moves = bit(MemoryKind::host) | bit(MemoryKind::cuda);
    m.serves = bit(MemoryKind::host) | bit(MemoryKind::cuda);
    m.needs = "a TCP route to the peer's listener";
    m.make = [](const Context& context, const ConnectorOptions& options) {
      return std::make_unique<tcp::TcpTransport>(context, options.tcp);
    };
    return m;
  }();
  return method;
}

}  // namespace ferry::transport
