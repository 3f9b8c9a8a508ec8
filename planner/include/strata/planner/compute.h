// The work of a transformer's forward on one GPU and its time there: dense matrix products at the
// achieved rate for their size (ClusterSpec's efficiency curve), the attention's score products,
// and the memory-bound kernels (norms, activations, softmax, residuals, dropout) at the memory
// bandwidth. Both system models (Strata's and 3D parallelism's) time their compute here.
//
// The memory-bound traffic of a block's forward is taken as twice the bytes Korthikanti et al.
// (2022) count as its saved activations (written once, read once): per token, 34 h bytes with
// 16-bit activations, plus 5 a s bytes for the attention scores where attention is not fused
// (flash attention keeps no scores); with tensor parallelism of t and no sequence parallelism,
// 10 + 24 / t instead of 34 (norms and dropouts run replicated). A backward is twice its forward.
//
// Pure functions; thread-safe.
#pragma once

#include <cstdint>
#include <vector>

#include "strata/models/model_config.h"
#include "strata/planner/cluster.h"

namespace strata::planner {

struct Work {
  // Dense products (the linear layers, the LM head), each with its own FLOPs: a product's size sets
  // the rate it reaches (ClusterSpec's efficiency curve), so a block's small attention projections
  // run slower than its MLP.
  struct Gemm {
    double flops = 0;  // of one product
    double count = 1;  // how many such products
  };
  std::vector<Gemm> gemms;
  double attention_flops = 0;  // q.k and p.v
  double attention_product = 0;
  double memory_bytes = 0;     // memory-bound kernels' traffic
  double gemm_flops() const;   // all the dense products together
  Work scaled(double f) const;
};

struct ShardOf {
  int tp = 1;                      // tensor-parallel ways
  bool sequence_parallel = false;  // norms and dropouts split along the sequence too
  bool flash_attention = true;     // fused attention: no score matrix in memory
  double activation_bytes = 2;     // bytes of an activation element
  int64_t mlp_token_chunk = 0;     // the MLP's products over chunks of this many tokens (0: all at once)
};

// Korthikanti et al.'s activation bytes of one block, per token and hidden unit, with 16-bit
// activations (table 2): 34 + 5 a s / h, divided by t with sequence parallelism; 10 + 24 / t +
// 5 a s / (h t) with tensor parallelism alone; the score term only where attention is not fused.
double activation_bytes_per_token_hidden(const models::ModelConfig& m, int64_t seq_len, const ShardOf& shard);

// One block's forward for `sequences` sequences of `seq_len` tokens, this GPU's 1/tp of it.
// Its MLP's products (mlp_forward) are a part of it.
Work block_forward(const models::ModelConfig& m, double sequences, int64_t seq_len, const ShardOf& shard);
// One block's MLP: the up (and gate) and down products, over token chunks when the shard says.
Work mlp_forward(const models::ModelConfig& m, double sequences, int64_t seq_len, const ShardOf& shard);
// The LM head's forward (the logits' product; the loss's softmax as memory traffic).
Work head_forward(const models::ModelConfig& m, double sequences, int64_t seq_len, const ShardOf& shard);

double seconds(const Work& w, const GpuSpec& gpu, bool fp32 = false);
// The same by kind: matrix products, attention, memory-bound kernels (they add up to seconds()).
struct Seconds {
  double matmul = 0, attention = 0, memory = 0;
  double total() const { return matmul + attention + memory; }
};
Seconds seconds_by_kind(const Work& w, const GpuSpec& gpu, bool fp32 = false);

}  // namespace strata::planner
