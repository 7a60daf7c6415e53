#include "transport/method.hpp"
#include "transport/verbs/verbs_transport.hpp"

namespace ferry::transport {

const Method& verbs_method() {
  static const Method method = [] {
    Method m;
    m.name = "verbs";
    m.rank = 300;
    // CUDA memory: registered with the NIC (GPUDirect), else staged on the active side.
    m.moves = bit(MemoryKind::host) | bit(MemoryKind::cuda);
    m.serves = bit(MemoryKind::host) | bit(MemoryKind::cuda);
    m.passive_cpu_free = true;
    m.needs = "an RDMA device on both hosts with a route between them (rdma_cm)";
    m.unavailable = [](const ConnectorOptions&) {
      return verbs::VerbsTransport::unavailable(nullptr);
    };
    m.make = [](const Context& context, const ConnectorOptions& o) {
      return std::make_unique<verbs::VerbsTransport>(context, o.verbs, nullptr);
    };
    return m;
  }();
  return method;
}

}  // namespace ferry::transport
