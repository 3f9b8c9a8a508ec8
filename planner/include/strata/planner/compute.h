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
#include "strata/models/model_shapes.h"
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

// How this GPU's share of the work is cut: 3D parallelism's tensor and sequence parallelism, and
// Strata's tiles (models::LayerTiles, layout::LogitsTiles), whose products run at their own,
// smaller sizes.
struct ShardOf {
  int tp = 1;                      // tensor-parallel ways
  bool sequence_parallel = false;  // norms and dropouts split along the sequence too
  bool flash_attention = true;     // fused attention: no score matrix in memory
  double activation_bytes = 2;     // bytes of an activation element
  int64_t mlp_token_chunk = 0;     // the MLP's products over chunks of this many tokens (0: all at once)
  // A mixture of experts' expert-parallel ways (Megatron-Core's EP, its expert tensor parallelism
  // 1): each GPU holds experts / ep whole experts and runs the choices of ep GPUs' tokens for them.
  int ep = 1;
  // A block cut into attention tiles (groups of key/value heads) and MLP tiles (slices of the
  // intermediate dimension), 1 x 1: whole. Tiles run GPT-2's q, k and v as three products, each
  // of its own slice, and pass the normed input and the running sum from tile to tile.
  int64_t attention_tiles = 1, mlp_tiles = 1;
  // The LM head's logits in tiles of this many tokens x vocabulary rows (0: the whole side).
  double logits_token_chunk = 0, logits_vocab_tile = 0;
  bool block_tiled() const { return attention_tiles > 1 || mlp_tiles > 1; }
};

// Korthikanti et al.'s activation bytes of one block, per token and hidden unit, with 16-bit
// activations (table 2): 34 + 5 a s / h, divided by t with sequence parallelism; 10 + 24 / t +
// 5 a s / (h t) with tensor parallelism alone; the score term only where attention is not fused.
// A mixture of experts replaces the MLP's 19 (its input, its 4h product and activation, a dropout
// mask) with its own: each token's copy for each of its top_k experts and their outputs (4 k),
// their gate and up products and activation (6 k I / h).
double activation_bytes_per_token_hidden(const models::ModelConfig& m, int64_t seq_len, const ShardOf& shard);

// One block's forward for `sequences` sequences of `seq_len` tokens, this GPU's 1/tp of it.
// Its MLP's products (mlp_forward) are a part of it. Cut into tiles (shard.attention_tiles,
// shard.mlp_tiles) it has the same FLOPs in more, smaller products, and more memory traffic: each
// tile adds its output to the running sum (a + m adds where a whole block has 2), and each tile
// but the last of its kind writes the normed input and the sum for the next (at::stack).
Work block_forward(const models::ModelConfig& m, double sequences, int64_t seq_len, const ShardOf& shard);
// One block's MLP: the up (and gate) and down products of each MLP tile, over token chunks when
// the shard says.
Work mlp_forward(const models::ModelConfig& m, double sequences, int64_t seq_len, const ShardOf& shard);
// The LM head's forward (the logits' product, by logits tile; the loss's softmax as memory
// traffic).
Work head_forward(const models::ModelConfig& m, double sequences, int64_t seq_len, const ShardOf& shard);

double seconds(const Work& w, const GpuSpec& gpu, bool fp32 = false);
// The same by kind: matrix products, attention, memory-bound kernels (they add up to seconds()).
struct Seconds {
  double matmul = 0, attention = 0, memory = 0;
  double total() const { return matmul + attention + memory; }
};
Seconds seconds_by_kind(const Work& w, const GpuSpec& gpu, bool fp32 = false);

}  // namespace strata::planner
