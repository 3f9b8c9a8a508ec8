#include "strata/engine/cpu_share.h"

#include <ATen/Parallel.h>
#include <sched.h>

#include <algorithm>
#include <cstdlib>
#include <thread>

namespace strata::engine {

unsigned usable_cpus() {
  cpu_set_t set;
  CPU_ZERO(&set);
  if (sched_getaffinity(0, sizeof set, &set) == 0) {
    const int n = CPU_COUNT(&set);
    if (n > 0) return unsigned(n);
  }
  return std::max(1u, std::thread::hardware_concurrency());
}

unsigned cpu_threads_per_rank(int local_ranks) {
  return std::max(1u, usable_cpus() / unsigned(std::max(1, local_ranks)));
}

int apply_compute_threads(int local_ranks) {
  const char* omp = std::getenv("OMP_NUM_THREADS");
  // One rank keeps libtorch's own default (its choice between physical and logical cores).
  if (local_ranks > 1 && !(omp && std::atoi(omp) > 0)) at::set_num_threads(int(cpu_threads_per_rank(local_ranks)));
  return at::get_num_threads();
}

}  // namespace strata::engine
