// `strata bench pack`: the packing rule (models::best_fit_decreasing) over millions of synthetic
// example lengths beside its previous method (pack_baseline.h), each in its own child process so
// that its peak memory is its own.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace strata::bench {

struct PackBenchOptions {
  std::vector<uint64_t> examples = {1000000};  // example counts, each measured on its own
  uint64_t seq_len = 4096;                     // windows of seq_len + 1 tokens
  uint64_t seed = 0;                           // the lengths' and the tie order's seed
  unsigned rounds = 3;                         // timed runs of each method (median)
  // End to end: a synthetic sft file of this many examples (0: none) written under `dir`, then
  // loaded and packed as `strata train` does (SftExamples + PackedExamples) in a child process.
  uint64_t file_examples = 0;
  std::string dir = "/tmp/strata-bench-pack";
};

// Prints, for each count, both methods' median seconds and peak resident memory above the
// lengths themselves (from the child's getrusage), and the bins they make; fails (throws) when the
// bins differ. Final JSON line: metric pack_seconds for the first count, against the previous
// method, with both peaks (and, with file_examples, the file's load-and-pack seconds and peak).
void run_pack_bench(const PackBenchOptions& options);

}  // namespace strata::bench
