#pragma once

namespace ferry_bench {

/// Puts the simulated RDMA fabric (tests/support/sim_verbs.hpp) under every connector this
/// process creates from now on. False when this build has no simulated fabric (verbs not
/// built, or the tests not built).
bool use_simulated_verbs();

}  // namespace ferry_bench
