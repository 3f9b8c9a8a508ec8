// The models the CPU benchmarks train: GPT-2's layout (bench step, bench tiling) with the given
// depth, width, heads and vocabulary, a 4x MLP and room for `seq` positions; Llama's (bench lora)
// with grouped-query attention and a gated MLP of the given width, embeddings untied.
#pragma once

#include <algorithm>
#include <cstdint>
#include <string>

#include "strata/models/model_config.h"

namespace strata::bench {

inline models::ModelConfig gpt2_shape(const std::string& name, int64_t layers, int64_t hidden, int64_t heads,
                                      int64_t vocab, int64_t seq) {
  models::ModelConfig c = models::preset("gpt2");
  c.name = name;
  c.layers = layers;
  c.hidden = hidden;
  c.heads = c.kv_heads = heads;
  c.head_dim = hidden / heads;
  c.intermediate = 4 * hidden;
  c.vocab_size = vocab;
  c.max_positions = std::max<int64_t>(seq, 64);
  c.validate();
  return c;
}

inline models::ModelConfig llama_shape(const std::string& name, int64_t layers, int64_t hidden, int64_t heads,
                                       int64_t kv_heads, int64_t intermediate, int64_t vocab) {
  models::ModelConfig c = models::preset("llama-1b");
  c.name = name;
  c.layers = layers;
  c.hidden = hidden;
  c.heads = heads;
  c.kv_heads = kv_heads;
  c.head_dim = hidden / heads;
  c.intermediate = intermediate;
  c.vocab_size = vocab;
  c.tie_embeddings = false;
  c.validate();
  return c;
}

}  // namespace strata::bench
