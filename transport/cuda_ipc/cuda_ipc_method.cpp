#include "transport/cuda_ipc/cuda_ipc_transport.hpp"
#include "transport/method.hpp"
#include "transport/same_host/system.hpp"

namespace ferry::transport {

const Method& cuda_ipc_method() {
  static const Method method = [] {
    Method m;
    m.name = "cuda_ipc";
    // First: a copy by the GPU between two device memories beats any other way.
    m.rank = 400;
    // The owner's memory is CUDA memory; the active side's either.
    m.moves = bit(MemoryKind::host) | bit(MemoryKind::cuda);
    m.serves = bit(MemoryKind::cuda);
    m.same_host_only = true;
    m.passive_cpu_free = true;
    m.needs =
        "the exposed memory CUDA memory (the active side's CUDA or host); the peer another "
        "process on this host, in this PID namespace, allowed to read this process";
    m.unavailable = [](const ConnectorOptions& o) {
      return cuda_ipc::CudaIpcTransport::unavailable(same_host::ptracer_any(o));
    };
    m.make = [](const Context& context, const ConnectorOptions& o) {
      CmaOptions options = o.cma;
      options.ptracer_any = same_host::ptracer_any(o);
      return std::make_unique<cuda_ipc::CudaIpcTransport>(context, options);
    };
    return m;
  }();
  return method;
}

}  // namespace ferry::transport
