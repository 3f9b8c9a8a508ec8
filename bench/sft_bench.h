// `strata bench sft`: supervised fine-tuning packed (data.pack) beside padded, in one run, on chat
// examples the benchmark makes: kExamples examples whose lengths follow a fixed log-normal spread
// (median kMedianTokens, kTailShare of them over kTailTokens: sigma = ln(kTailTokens /
// kMedianTokens) / 2.326, the 99th percentile's z), at least 2 tokens, the first third of each a
// prompt out of the loss, written as a data.format "sft" file and read back as a run reads it
// (models::SftExamples, models::PackedExamples). Both sides train the same Llama-shaped model
// (random init) with the same engine configuration, `batch` windows of seq_len + 1 tokens a step;
// each side's steps run back to back after a warm-up. Reports per side the real tokens a second
// (example tokens, not padding, over the timed steps' wall time) and the packing efficiency (real
// tokens over window tokens); the final JSON line's metric is sft_real_tokens_per_s (packed) with
// the padded run's as its baseline.
#pragma once

#include <cstdint>
#include <string>

namespace strata::bench {

// The examples' spread: stated here, in the usage and in docs/PERFORMANCE.md.
inline constexpr uint64_t kExamples = 4096;
inline constexpr double kMedianTokens = 200, kTailTokens = 1500, kTailShare = 0.01;

struct SftBenchOptions {
  int64_t layers = 2, hidden = 256, heads = 4, kv_heads = 2, intermediate = 688, vocab = 4096;
  int64_t seq = 2048, batch = 2;
  unsigned steps = 3;            // timed steps per side
  std::string device = "cpu";    // "cpu" (the host device) or "cuda"
  std::string compute = "fp32";  // fp32 or bf16
  std::string params = "device"; // placement of the compute copies and state: device, host, nvme, auto
  std::string dir;               // where the examples file goes ("" : a temporary directory)
  unsigned threads = 0;          // 0: every hardware thread
};

void run_sft_bench(const SftBenchOptions& options);

}  // namespace strata::bench
