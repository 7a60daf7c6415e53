#include "sdk/src/transport_registry.hpp"

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <mutex>

#include "transport/cma/cma_transport.hpp"
#include "transport/tcp/tcp_transport.hpp"
#ifdef FERRY_WITH_CUDA
#include "transport/cuda/cuda_memory.hpp"
#endif
#ifdef FERRY_WITH_VERBS
#include "transport/verbs/verbs_transport.hpp"
#endif

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
  tcp.log = c.log;
#ifdef FERRY_WITH_CUDA
  // CUDA memory is staged through pinned host buffers where the driver is usable.
  tcp.cuda = transport::cuda::usable_driver();
#endif
  return std::make_unique<transport::tcp::TcpTransport>(c.loop, c.defer, std::move(tcp));
}

bool cma_ptracer_any(const ConnectorOptions& o) {
  if (o.cma.ptracer_any) return true;
  if (!o.use_environment) return false;
  const char* v = std::getenv("FERRY_CMA_PTRACER_ANY");
  return v != nullptr && std::strcmp(v, "1") == 0;
}

std::string cma_unavailable(const ConnectorOptions& o) {
  return transport::cma::CmaTransport::unavailable(cma_ptracer_any(o));
}

/// The cma transport's options (cuda_ipc, its other mode, takes them too).
transport::cma::CmaTransport::Options cma_options(const TransportContext& c) {
  const ConnectorOptions& o = *c.options;
  transport::cma::CmaTransport::Options cma;
  cma.chunk_size = o.cma.chunk_size;
  cma.parallel = o.cma.parallel;
  cma.inline_max = o.cma.inline_max;
  cma.ptracer_any = cma_ptracer_any(o);
  cma.peer_timeout = o.peer_timeout;
  cma.local_name = c.identity->name;
  cma.local_id = std::stoull(c.identity->id, nullptr, 16);
  cma.log = c.log;
  return cma;
}

std::unique_ptr<transport::Transport> make_cma(const TransportContext& c, std::string& why) {
  why = cma_unavailable(*c.options);
  if (!why.empty()) return nullptr;
  transport::cma::CmaTransport::Options cma = cma_options(c);
#ifdef FERRY_WITH_CUDA
  // CUDA memory of the active side is staged through pinned host buffers where the driver is
  // usable.
  cma.cuda = transport::cuda::usable_driver();
#endif
  return std::make_unique<transport::cma::CmaTransport>(c.loop, c.defer, std::move(cma));
}

#ifdef FERRY_WITH_CUDA
std::string cuda_ipc_unavailable(const ConnectorOptions& o) {
  if (std::string why = transport::cuda::unavailable(); !why.empty()) return why;
  // It claims and grants as cma does: it needs what cma needs.
  if (std::string why = cma_unavailable(o); !why.empty()) return why;
  return {};
}

std::unique_ptr<transport::Transport> make_cuda_ipc(const TransportContext& c, std::string& why) {
  why = cuda_ipc_unavailable(*c.options);
  if (!why.empty()) return nullptr;
  transport::cma::CmaTransport::Options ipc = cma_options(c);
  ipc.cuda_ipc = transport::cuda::usable_driver();
  return std::make_unique<transport::cma::CmaTransport>(c.loop, c.defer, std::move(ipc));
}
#endif

#ifdef FERRY_WITH_VERBS
std::string verbs_unavailable(const ConnectorOptions&) {
  return transport::verbs::VerbsTransport::unavailable(nullptr);
}

std::unique_ptr<transport::Transport> make_verbs(const TransportContext& c, std::string& why) {
  const ConnectorOptions& o = *c.options;
  why = verbs_unavailable(o);
  if (!why.empty()) return nullptr;
  return make_verbs_transport(c, transport::verbs::system_verbs());
}
#endif

std::mutex added_mu;
std::vector<TransportFactory>& added() {
  static std::vector<TransportFactory> list;
  return list;
}

}  // namespace

#ifdef FERRY_WITH_VERBS
std::unique_ptr<transport::Transport> make_verbs_transport(const TransportContext& c,
                                                           const transport::verbs::VerbsApi* api) {
  const ConnectorOptions& o = *c.options;
  transport::verbs::VerbsTransport::Options v;
  v.api = api;
  v.bind_address = c.bind_address;
  v.port = o.verbs.port;
  v.queue_depth = o.verbs.queue_depth;
  v.signal_every = o.verbs.signal_every;
  v.max_wr_bytes = o.verbs.max_wr_bytes;
  v.spin = o.verbs.spin;
  v.memory_windows = o.verbs.memory_windows;
  v.peer_timeout = o.peer_timeout;
  v.local_name = c.identity->name;
  v.local_id = std::stoull(c.identity->id, nullptr, 16);
  v.log = c.log;
#ifdef FERRY_WITH_CUDA
  // CUDA memory is registered with the NIC (dmabuf, peermem) or staged, where the driver is
  // usable.
  v.cuda = transport::cuda::usable_driver();
#endif
  return std::make_unique<transport::verbs::VerbsTransport>(c.loop, c.defer, std::move(v));
}
#endif

std::vector<TransportFactory> transport_factories() {
  std::vector<TransportFactory> out = {
#ifdef FERRY_WITH_CUDA
      {"tcp", make_tcp, 100, {}, "a TCP route to the peer's listener", /*moves_cuda=*/true},
#else
      {"tcp", make_tcp, 100, {}, "a TCP route to the peer's listener"},
#endif
      // moves_cuda false: it stages CUDA memory of its active side, but exposes none.
      {"cma", make_cma, 200, cma_unavailable,
       "the peer on this host, in this PID namespace, allowed to read this process"},
#ifdef FERRY_WITH_VERBS
      {"verbs", make_verbs, 300, verbs_unavailable,
       "an RDMA device on both hosts with a route between them (rdma_cm)",
#ifdef FERRY_WITH_CUDA
       /*moves_cuda=*/true
#endif
      },
#endif
#ifdef FERRY_WITH_CUDA
      {"cuda_ipc", make_cuda_ipc, 400, cuda_ipc_unavailable,
       "the exposed memory CUDA memory (the active side's CUDA or host); the peer another "
       "process on this host, in this PID namespace, allowed to read this process",
       /*moves_cuda=*/true, /*moves_host=*/false},
#endif
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

#ifndef FERRY_WITH_VERBS
std::unique_ptr<transport::Transport> make_verbs_transport(const TransportContext&,
                                                           const transport::verbs::VerbsApi*) {
  throw Error(ErrorCode::Unsupported, "ferry was built without verbs (FERRY_WITH_VERBS=OFF)");
}
#endif

}  // namespace ferry::detail
