// `strata bench train`: seconds per training step of Strata configurations beside PyTorch's,
// in one run. Each configuration runs as `strata train` in a child process (its own GPU and host
// memory, freed before the next), then bench/train_baseline.py runs plain PyTorch and/or FSDP2 +
// CPUOffloadPolicy on the same GPT-2 shape (layers, hidden, heads, vocabulary, positions,
// sequence length, global batch, clipping). Every run's median step time after the warm-up steps
// is compared with every baseline; the last stdout line is one JSON object with all of them.
//
// Each run's working directory is the bench's work directory: relative paths in a configuration
// (data.path, offload.nvme_dirs) resolve there; configurations that save or resume checkpoints
// are refused.
//
// Errors: std::runtime_error when a run fails (its exit status and the command), when the
// configurations differ in shape, or when the model is not GPT-2 shaped (the baselines are).
#pragma once

#include <cstdint>
#include <filesystem>
#include <string>
#include <vector>

namespace strata::bench {

struct TrainBenchOptions {
  std::vector<std::filesystem::path> configs;  // `strata train` configurations, one shape
  std::filesystem::path dir = "strata-bench-train";  // work directory (logs, relative swap dirs)
  int64_t steps = 6;        // steps per run, warm-up included
  int64_t warmup = 2;       // steps left out of the median
  std::vector<std::string> baselines{"plain", "fsdp2"};  // train_baseline.py modes; empty: none
  std::string python = "python3";
  std::filesystem::path script;  // bench/train_baseline.py
  bool profile = false;          // pass --profile to every run (timeline per step on stderr)
};

void run_train_bench(const TrainBenchOptions& options);

}  // namespace strata::bench
