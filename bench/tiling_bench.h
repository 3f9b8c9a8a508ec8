// `strata bench tiling`: the engine's tiled LM head beside the untiled one, in the same run.
//   (a) overhead: the step time of one model that fits both ways, the head's logits cut into
//       `tiles` tiles vs whole, its blocks cut into attention x MLP tiles vs whole, and its
//       embedding and LM head cut into `vocab_tiles` vocabulary tiles vs whole (target: at most
//       10% slower each);
//   (b) capacity: in one fixed device budget, the largest vocabulary (doubling) for which the
//       engine constructs and runs a training step, untiled vs placement.tiling "auto" (the
//       head's logits and the vocabulary); reported
//       as logits elements (tokens x vocabulary), the ratio being the gain (target: >= 16x).
//   (c) capacity: in one fixed device budget, the largest hidden size (doubling) of a one-block
//       GPT-2 that trains with whole blocks vs blocks cut "auto" (target: >= 8x).
//   (d) long sequences: in one fixed device budget, the largest sequence (doubling) of a
//       one-block GPT-2 that trains with whole blocks and whole-sequence MLPs vs
//       placement.tiling "auto" (block tiles and MLP token chunks as the memory model decides;
//       the activation side of tiling). No target: attention and the boundary activations still
//       grow with the sequence.
#pragma once

#include <cstdint>
#include <string>

namespace strata::bench {

struct TilingBenchOptions {
  // (a): a GPT-2 shape whose head is a large part of the step.
  int64_t layers = 2, hidden = 256, heads = 4, vocab = 32768, seq = 256, batch = 4;
  uint64_t tiles = 16;
  bool head_one_pass = false;  // (a) the head's tiles with placement.tiling.head_pass "one"
  int64_t attention_tiles = 2, mlp_tiles = 4;  // (a) the blocks' tiles beside whole blocks
  uint64_t vocab_tiles = 8;  // (a) the embedding's and the LM head's tiles beside them whole
  unsigned steps = 5;  // timed steps per side, round-robin, median reported
  // (b): the budget, hidden size and tokens of the capacity search.
  uint64_t budget = 64ull << 20;
  int64_t capacity_hidden = 64, capacity_tokens = 4096;
  int64_t capacity_max_vocab = 262144;  // the doubling stops here (Gemma's vocabulary)
  // (c): the budget, tokens a step and the largest hidden size tried.
  uint64_t hidden_budget = 16ull << 20;
  int64_t hidden_tokens = 64, hidden_max = 4096;
  // (d): the budget, width and longest sequence tried.
  uint64_t sequence_budget = 16ull << 20;
  int64_t sequence_hidden = 128, sequence_max = 65536;
  unsigned threads = 0;  // 0: every hardware thread
  std::string device = "cpu";     // "cpu" (the host device) or "cuda" (GPU 0)
  std::string compute = "fp32";   // precision.compute: fp32 or bf16
  std::string parts = "abcd";     // which parts run
};

// Prints a JSON line per part.
void run_tiling_bench(const TilingBenchOptions& options);

}  // namespace strata::bench
