// `strata bench ckpt`: checkpoint save and restore bandwidth of an engine's state, beside fio's
// sequential write and read (1 MiB, queue depth 32) on the same directory and beside
// torch::save / torch::load of the same tensors, in one run. A save counts until it is durable
// (fsync), so the fio write baseline is timed up to an fsync of its file as well.
#pragma once

#include <cstdint>
#include <filesystem>
#include <string>

namespace strata::bench {

struct CkptBenchOptions {
  std::filesystem::path dir = "strata-bench-ckpt";
  std::string preset = "gpt2";  // model whose fp32 master and moments are saved
  int64_t layers = 0;           // 0: the preset's
  std::string fio = "fio";      // or "none"
  unsigned rounds = 3;          // every side once per round; medians reported
};

void run_ckpt_bench(const CkptBenchOptions& options);

}  // namespace strata::bench
