#pragma once

#include "bench/ferry_bench/options.hpp"

namespace ferry_bench {

/// The target: serves the control channel at <session>.ctl and holds the passive operations
/// of each point (readables over its source buffers for READ, writables over its destination
/// buffers for WRITE), created ahead of the initiator's need and handed out in batches.
/// Returns the exit status.
int run_target(const Options& options);

}  // namespace ferry_bench
