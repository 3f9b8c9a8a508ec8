// What a model configuration implies for memory and compute, without building the model: the
// parameters each stage owns, the bytes a block's autograd graph keeps, and the floating-point
// work of a training step. The engine sizes its units with the real modules; the planner
// (planner/) sizes them here, and tests/models/model_shapes_test.cc checks that both agree.
//
// No libtorch. Pure functions; thread-safe.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "strata/models/model_config.h"

namespace strata::models {

// Elements of the parameters each stage owns, in schedule order: the embedding (GPT-2: token
// and position embeddings), each block, the head (its final norm, and the LM head when the
// embeddings are not tied). The sum is ModelConfig::parameters().
std::vector<uint64_t> stage_parameters(const ModelConfig& c);

// Bytes one block's forward with autograd keeps for its backward, per token, with compute
// copies of `elem_bytes` bytes (Decoder::block_graph_bytes_per_token; tests/models/
// block_graph_test.cc measures it against a counting allocator).
uint64_t block_graph_bytes_per_token(const ModelConfig& c, size_t elem_bytes);

// Multiply-add work (2 FLOPs each) of one token's forward through the model with a sequence of
// `seq_len` tokens: every linear layer, the attention's two products (causal attention computed
// in full, as the kernels do), and the LM head. The embedding lookup counts nothing.
struct ForwardFlops {
  double blocks = 0;  // per token, all blocks together
  double head = 0;    // per token, the LM head
  double total() const { return blocks + head; }
};
ForwardFlops forward_flops_per_token(const ModelConfig& c, int64_t seq_len);

}  // namespace strata::models
