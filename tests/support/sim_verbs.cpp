#include "tests/support/sim_verbs.hpp"

#include "sdk/src/transport_registry.hpp"
#include "tests/support/simverbs/simverbs.hpp"
#include "transport/verbs/verbs_transport.hpp"

namespace ferry::test {

void use_simulated_verbs() {
  for (transport::Method method : detail::methods()) {
    if (method.name != "verbs") continue;
    method.unavailable = nullptr;
    method.needs = "the simulated RDMA fabric (tests)";
    method.make = [](const transport::Context& context, const ConnectorOptions& options) {
      return std::make_unique<transport::verbs::VerbsTransport>(context, options.verbs,
                                                                &simverbs::api());
    };
    detail::add_method(std::move(method));
    return;
  }
}

}  // namespace ferry::test
