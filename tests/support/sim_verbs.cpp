#include "tests/support/sim_verbs.hpp"

#include "sdk/src/transport_registry.hpp"
#include "tests/support/simverbs/simverbs.hpp"

namespace ferry::test {

void use_simulated_verbs() {
  detail::add_transport_factory({"verbs",
                                 [](const detail::TransportContext& context, std::string&) {
                                   return detail::make_verbs_transport(context, &simverbs::api());
                                 },
                                 300, nullptr, "the simulated RDMA fabric (tests)"});
}

}  // namespace ferry::test
