#include "transport/cma/cma_transport.hpp"
#include "transport/method.hpp"
#include "transport/same_host/system.hpp"

namespace ferry::transport {

const Method& cma_method() {
  static const Method method = [] {
    Method m;
    m.name = "cma";
    m.rank = 200;
    // It stages CUDA memory of its active side, but serves host memory only.
    m.moves = bit(MemoryKind::host) | bit(MemoryKind::cuda);
    m.serves = bit(MemoryKind::host);
    m.same_host_only = true;
    m.passive_cpu_free = true;
    m.needs = "the peer on this host, in this PID namespace, allowed to read this process";
    m.unavailable = [](const ConnectorOptions& o) {
      return cma::CmaTransport::unavailable(same_host::ptracer_any(o));
    };
    m.make = [](const Context& context, const ConnectorOptions& o) {
      CmaOptions options = o.cma;
      options.ptracer_any = same_host::ptracer_any(o);
      return std::make_unique<cma::CmaTransport>(context, options);
    };
    return m;
  }();
  return method;
}

}  // namespace ferry::transport
