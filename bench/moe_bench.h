// `strata bench moe`: a mixture of experts' training step beside a dense model with the same
// active parameters and tokens (both through the engine, one process), and the dispatch alone
// beside transformers' loop over the experts, in the same run.
#pragma once

#include <cstdint>

namespace strata::bench {

struct MoeBenchOptions {
  int64_t layers = 4, hidden = 256, heads = 4, vocab = 8192, seq = 128, batch = 8;
  int64_t experts = 8, top_k = 2, expert_intermediate = 384;
  unsigned steps = 5;    // timed steps per side, round-robin, median reported
  unsigned threads = 0;  // torch intra-op and Strata kernel threads; 0: every hardware thread
};

// Prints the sides and a final JSON line: metric moe_step_vs_dense_active, the mixture's step
// seconds against the dense model's (a Llama of the same shape whose MLP is top_k x the expert
// width: the same active parameters but the routers), and the dispatch's forward + backward
// seconds beside the loop.
void run_moe_bench(const MoeBenchOptions& options);

}  // namespace strata::bench
