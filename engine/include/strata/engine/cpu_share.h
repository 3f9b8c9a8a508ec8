// One rank's share of its node's CPU: how many threads its compute (libtorch's intra-op pool:
// the host device's kernels, and on a GPU the few ops that run on the CPU) and its CPU optimizer
// kernel use by default. Ranks on one node that each run as many threads as the node has cores
// oversubscribe it (two ranks on two cores: four spinning compute threads, and as many Adam
// threads), which slows every kernel down far more than sharing does; `strata launch` and
// `strata train` give each rank its share instead. The planner's time model assumes the same
// split (the host device's ranks each get 1/local_ranks of the calibrated rates).
//
// Thread safety: usable_cpus and cpu_threads_per_rank are pure reads; apply_compute_threads
// sets process-wide state and belongs at a process's start, before any parallel op runs.
#pragma once

namespace strata::engine {

// The CPUs this process may run on (its affinity mask; hardware_concurrency where that is
// unknown), at least 1.
unsigned usable_cpus();

// usable_cpus() shared by `local_ranks` ranks (<= 0 counts as 1), at least 1 thread.
unsigned cpu_threads_per_rank(int local_ranks);

// Sets libtorch's intra-op threads where several ranks share the node and $OMP_NUM_THREADS is not
// set (libtorch reads that itself): cpu_threads_per_rank(local_ranks), the value `strata launch`
// gives OMP_NUM_THREADS. One rank keeps libtorch's default. Returns the count in effect.
int apply_compute_threads(int local_ranks);

}  // namespace strata::engine
