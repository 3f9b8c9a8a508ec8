// What a training step reports about where its time went (StepTimeline) and, when profiling, the
// trace spans. Plain values, no libtorch: the engine's profiler fills them, the CLI's log,
// TensorBoard writer and `strata bench` read them.
#pragma once

#include <cstdint>
#include <string>

namespace strata::engine {

// Where one step's wall time went and what each path moved: the per-step timeline of
// `strata train --profile`. Waits are host time spent blocked at the engine's synchronization
// points, each named by its cause (on CUDA the host runs ahead of the GPU, so a host wait stalls
// the GPU only once its queue has drained). Always measured (a few clock reads per unit), except
// compute_busy, which needs EngineConfig::profile.
struct StepTimeline {
  double compute_busy = -1;      // device seconds in stage compute (-1: not profiled)
  double wait_params = 0;        // a unit's gather (NVMe read, copy up, all-gather) not done
  double wait_update = 0;        // the overlapped update not done ("forward": a gather; "backward":
                                 // a gradient buffer to free, and the step's end)
  double wait_activations = 0;   // activation checkpoints still on their way to the host
  double wait_grads = 0;         // gradients still on their way to the host / NVMe, or (host
                                 // device) their reduce-scatter among the ranks not done
  double norm = 0;               // global gradient norm (sum of squares, all-reduce)
  double optimizer = 0;          // optimizer work that ran during this step (any thread)
  double optimizer_exposed = 0;  // the part of it the step waited for
  double wait_checkpoint = 0;    // the update (any thread) waiting for a checkpoint's writer to
                                 // release a unit (StateHold): the price of a small staging
  uint64_t h2d_bytes = 0, d2h_bytes = 0;             // host <-> device copies
  uint64_t nvme_read_bytes = 0, nvme_write_bytes = 0;  // swap files
  // What this rank's parameter gathers and gradient reduce-scatters sent, as a ring moves it:
  // (world - 1) / world of each collective's whole buffer (as much again is received).
  uint64_t network_bytes = 0;
  int prefetch = 0;              // units gathered ahead during this step (device.prefetch)
};

// One span of a trace (Chrome trace event format, see docs/ARCHITECTURE.md "Profiling").
struct TraceSpan {
  std::string lane;  // "host", "device compute", "optimizer"
  std::string name;
  double begin = 0, end = 0;  // seconds since the engine was built
};

}  // namespace strata::engine
