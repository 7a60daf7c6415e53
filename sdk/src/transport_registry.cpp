#include "sdk/src/transport_registry.hpp"

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <mutex>

#include "transport/tcp/tcp_transport.hpp"

namespace ferry::detail {

namespace {

std::unique_ptr<transport::Transport> make_tcp(const TransportContext& c, std::string&) {
  const ConnectorOptions& o = *c.options;
  transport::tcp::TcpTransport::Options tcp;
  tcp.bind_address = c.bind_address;
  tcp.port = o.tcp.port;
  tcp.advertise_address = o.tcp.advertise_address;
  tcp.chunk_size = o.tcp.chunk_size;
  tcp.window = o.tcp.window;
  tcp.max_request = o.tcp.max_request;
  tcp.max_connections = o.tcp.max_connections;
  tcp.max_unclaimed = o.tcp.max_unclaimed;
  tcp.unclaimed_timeout = o.tcp.unclaimed_timeout;
  tcp.peer_timeout = o.peer_timeout;
  tcp.local_name = c.identity->name;
  tcp.local_id = std::stoull(c.identity->id, nullptr, 16);
  return std::make_unique<transport::tcp::TcpTransport>(c.loop, c.defer, std::move(tcp));
}

std::mutex added_mu;
std::vector<TransportFactory>& added() {
  static std::vector<TransportFactory> list;
  return list;
}

}  // namespace

std::vector<TransportFactory> transport_factories() {
  std::vector<TransportFactory> out = {
      {"tcp", make_tcp, 100, {}, "a TCP route to the peer's listener"},
  };
  std::lock_guard lock(added_mu);
  for (const auto& f : added()) {
    std::erase_if(out, [&](const TransportFactory& b) { return b.method == f.method; });
    out.push_back(f);
  }
  return out;
}

void add_transport_factory(TransportFactory factory) {
  std::lock_guard lock(added_mu);
  std::erase_if(added(), [&](const TransportFactory& f) { return f.method == factory.method; });
  added().push_back(std::move(factory));
}

void remove_transport_factory(const std::string& method) {
  std::lock_guard lock(added_mu);
  std::erase_if(added(), [&](const TransportFactory& f) { return f.method == method; });
}

}  // namespace ferry::detail
