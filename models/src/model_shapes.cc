#include "strata/models/model_shapes.h"

namespace strata::models {

std::vector<uint64_t> stage_parameters(const ModelConfig& c) {
  const uint64_t d = uint64_t(c.hidden), v = uint64_t(c.vocab_size);
  std::vector<uint64_t> n;
  n.push_back(v * d + (c.arch == Arch::kGpt2 ? uint64_t(c.max_positions) * d : 0));
  for (int64_t i = 0; i < c.layers; ++i) n.push_back(uint64_t(c.block_parameters()));
  n.push_back((c.arch == Arch::kGpt2 ? 2 * d : d) + (c.tie_embeddings ? 0 : v * d));
  return n;
}

uint64_t block_graph_bytes_per_token(const ModelConfig& c, size_t e) {
  const uint64_t d = uint64_t(c.hidden), f = uint64_t(c.intermediate), q = uint64_t(c.heads * c.head_dim),
                 kv = uint64_t(c.kv_heads * c.head_dim), heads = uint64_t(c.heads);
  const uint64_t lse = 4 * heads;  // the attention's fp32 log-sum-exp
  if (c.arch == Arch::kGpt2) {
    // input and ln_1 out, qkv, attention out and its merged copy, the residual and ln_2 out, the
    // MLP's up projection and gelu out; fp32 mean and rstd of both norms.
    return e * (9 * d + 2 * f) + lse + 4 * 4;
  }
  // input, norm outs, residual; q and k before and after their rotation; the attention's q, k, v
  // (repeated for GQA) and out, the merged copy; gate, silu, up and their product; the norms'
  // fp32 copies of their inputs when computing in lower precision.
  return e * (4 * d + 7 * q + 2 * kv + 4 * f) + (e < 4 ? 2 * 4 * d : 0) + lse + 2 * 4;
}

ForwardFlops forward_flops_per_token(const ModelConfig& c, int64_t seq_len) {
  const double d = double(c.hidden), f = double(c.intermediate), q = double(c.heads * c.head_dim),
               kv = double(c.kv_heads * c.head_dim), s = double(seq_len);
  const double mlp = c.arch == Arch::kGpt2 ? 2 * d * f : 3 * d * f;
  const double linear = d * (q + 2 * kv) + q * d + mlp;     // multiply-adds a token
  const double attention = 2 * s * q;                       // q.k over s keys, then p.v
  ForwardFlops out;
  out.blocks = 2 * double(c.layers) * (linear + attention);
  out.head = 2 * d * double(c.vocab_size);
  return out;
}

}  // namespace strata::models
