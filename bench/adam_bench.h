// `strata bench adam`: the CPU Adam kernel's parameters per second on one partition, beside
// ATen's fused AdamW (what PyTorch's fused=True runs), libtorch's torch::optim::AdamW, and the
// memory-bandwidth bound, all at the same thread count in the same run.
#pragma once

#include <cstdint>

namespace strata::bench {

struct AdamBenchOptions {
  uint64_t params = 100'000'000;
  unsigned threads = 0;  // 0: every hardware thread
  unsigned steps = 9;    // timed steps per method, round-robin, median reported
};

// Prints one JSON line per case (fp32; bf16 grads in + bf16 params out) and a final summary.
void run_adam_bench(const AdamBenchOptions& options);

}  // namespace strata::bench
