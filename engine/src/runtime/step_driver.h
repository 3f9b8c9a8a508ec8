// The step driver: a step is `micro_batches` micro-batches, each the schedule's uses in their order
// (forward over the embedding and the blocks, the head, the backward in reverse). Use k of the
// step, counted over the whole step (micro-batch k / uses().size()), is what the parameter
// coordinator's gathers and prefetch count, so the driver hands each use its k. What a use does
// (gathers, compute, reductions, the loss) is the runner's; the order is the driver's alone.
// Evaluation walks the same schedule with the same runner, its forward uses only
// (run_forward_uses).
//
// No libtorch. Threads: the caller's (the training thread). Errors: whatever the runner throws
// propagates at once; the driver keeps no state of its own across calls.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>

#include "strata/engine/layout/schedule.h"

namespace strata::engine::runtime {

class UseRunner {
 public:
  virtual ~UseRunner() = default;
  // Micro-batch m starts (`last`: the step's last), before its first use, and ends after its last.
  virtual void begin_micro_batch(int64_t m, bool last) = 0;
  virtual void end_micro_batch() = 0;
  virtual void forward(size_t stage, size_t k) = 0;
  virtual void head(size_t stage, size_t k) = 0;  // the loss (training: then the head's backward)
  virtual void backward(size_t stage, size_t k) = 0;
};

// Runs every use of the step through `runner`; returns the uses run (micro_batches x uses()).
inline size_t run_step_uses(const layout::Schedule& schedule, int64_t micro_batches, UseRunner& runner) {
  size_t k = 0;
  for (int64_t m = 0; m < micro_batches; ++m) {
    runner.begin_micro_batch(m, m == micro_batches - 1);
    for (const layout::Use& use : schedule.uses()) {
      switch (use.kind) {
        case layout::Use::kForward: runner.forward(use.stage, k); break;
        case layout::Use::kHead: runner.head(use.stage, k); break;
        case layout::Use::kBackward: runner.backward(use.stage, k); break;
      }
      ++k;
    }
    runner.end_micro_batch();
  }
  return k;
}

// Evaluation's uses of one micro-batch: the schedule's first uses, up to and including the head's
// (the loss); nothing is learned, so nothing runs past it.
inline size_t forward_uses(const layout::Schedule& schedule) {
  size_t n = 0;
  while (schedule.uses().at(n).kind != layout::Use::kHead) ++n;
  return n + 1;
}

// Runs every micro-batch's forward_uses through `runner`, each numbered within its micro-batch
// (the gathers plan over forward_uses of them at a time, never across micro-batches); returns
// the uses run.
inline size_t run_forward_uses(const layout::Schedule& schedule, int64_t micro_batches, UseRunner& runner) {
  const size_t n = forward_uses(schedule);
  for (int64_t m = 0; m < micro_batches; ++m) {
    runner.begin_micro_batch(m, m == micro_batches - 1);
    for (size_t k = 0; k < n; ++k) {
      const layout::Use& use = schedule.uses()[k];
      if (use.kind == layout::Use::kHead) runner.head(use.stage, k);
      else runner.forward(use.stage, k);
    }
    runner.end_micro_batch();
  }
  return n * size_t(std::max<int64_t>(micro_batches, 0));
}

}  // namespace strata::engine::runtime
