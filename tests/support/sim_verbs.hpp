#pragma once

// Connectors on the simulated RDMA fabric (tests/support/simverbs/): there is no RDMA NIC on
// the machines that run the tests, so the verbs method is tested against the simulation.

#include <string>
#include <vector>

namespace ferry::test {

/// From now on, connectors created in this process offer verbs on the simulated fabric.
/// Any thread.
void use_simulated_verbs();

/// The variable that makes tests/support/peer_main.cpp call use_simulated_verbs(); its value
/// is the fabric's configuration (simverbs::to_string), which the child's fabric reads from
/// FERRY_SIMVERBS.
inline constexpr const char* kSimVerbsEnv = "FERRY_TEST_SIMVERBS";

}  // namespace ferry::test
