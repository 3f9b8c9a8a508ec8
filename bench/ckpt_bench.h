// `strata bench ckpt`: checkpoint save and restore bandwidth of an engine's state, beside fio's
// sequential write and read (1 MiB, queue depth 32) on the same directory and beside
// torch::save / torch::load of the same tensors, in one run. A save counts until it is durable
// (fsync), so the fio write baseline is timed up to an fsync of its file as well.
//
// With `store` (an object-store URL, s3://bucket/prefix), it measures tiered saves instead: the
// upload of a committed checkpoint (CheckpointUploader) and the restore from the store
// (load_checkpoint on the stored checkpoint's URL, ranged GETs), beside boto3's transfer manager
// moving the same rank's data file with the same part size and concurrency (bench/s3_baseline.py
// under `python`), and the time the training thread is blocked by a tiered save.
#pragma once

#include <cstdint>
#include <filesystem>
#include <string>

namespace strata::bench {

struct CkptBenchOptions {
  std::filesystem::path dir = "strata-bench-ckpt";
  std::string preset = "gpt2";  // model whose fp32 master and moments are saved
  int64_t layers = 0;           // 0: the preset's
  int64_t hidden = 0;           // > 0: a GPT-2-shaped model of this width (bench_model.h)
  int64_t vocab = 50257;        // with `hidden`
  std::string fio = "fio";      // or "none"
  unsigned rounds = 3;          // every side once per round; medians reported
  std::string store;            // object-store URL: the tiered-save benchmark instead
  std::string python = "python3";  // with boto3, for the store benchmark's baseline
  std::string baseline_script;     // bench/s3_baseline.py
};

void run_ckpt_bench(const CkptBenchOptions& options);

}  // namespace strata::bench
