#include "bench/ferry_bench/sim_verbs.hpp"

#ifdef FERRY_BENCH_SIMVERBS
#include "tests/support/sim_verbs.hpp"
#endif

namespace ferry_bench {

bool use_simulated_verbs() {
#ifdef FERRY_BENCH_SIMVERBS
  ferry::test::use_simulated_verbs();
  return true;
#else
  return false;
#endif
}

}  // namespace ferry_bench
