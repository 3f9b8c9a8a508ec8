// `strata bench step`: the engine's training step beside plain libtorch on a model that fits,
// same model, data, threads and AdamW settings, one process, in the same run.
#pragma once

#include <cstdint>
#include <string>

namespace strata::bench {

struct StepBenchOptions {
  int64_t layers = 4, hidden = 256, heads = 4, vocab = 8192;
  int64_t seq = 128, batch = 8;
  unsigned steps = 5;     // timed steps per method, round-robin, median reported
  unsigned threads = 0;   // torch intra-op and Strata kernel threads; 0: every hardware thread
  std::string overlap = "forward";  // optimizer.overlap: off, forward (the next one) or backward
  std::string placement = "host";  // every state kind and the activation checkpoints: host or device
  std::string recompute = "auto";  // placement.recompute: all, none, auto or a block count
};

// Prints a final summary line whose value is the engine's step time and whose baseline is plain
// libtorch doing what the engine does: no recompute when the engine recomputes no block, else
// every block recomputed. Both plain variants are timed and printed either way.
void run_step_bench(const StepBenchOptions& options);

}  // namespace strata::bench
