#include "strata/planner/compute.h"

#include <algorithm>
#include <cmath>

namespace strata::planner {

double Work::gemm_flops() const {
  double sum = 0;
  for (const Gemm& g : gemms) sum += g.flops * g.count;
  return sum;
}

Work Work::scaled(double f) const {
  Work w = *this;
  for (Gemm& g : w.gemms) g.count *= f;
  w.attention_flops *= f;
  w.memory_bytes *= f;
  return w;
}

double activation_bytes_per_token_hidden(const models::ModelConfig& m, int64_t seq_len, const ShardOf& sh) {
  const double t = sh.tp, s = double(seq_len), d = double(m.hidden), a = double(m.heads);
  const double mlp = m.moe.enabled()
                         ? 4 * double(m.moe.top_k) + 6 * double(m.moe.top_k) * double(m.moe.intermediate) / d - 19
                         : 0;  // a mixture's MLP in place of the dense one's 19
  return (sh.sequence_parallel || sh.tp == 1 ? (34 + mlp) / t : 10 + (24 + mlp) / t) +
         (sh.flash_attention ? 0 : 5 * a * s / d / t);
}

Work block_forward(const models::ModelConfig& m, double sequences, int64_t seq_len, const ShardOf& sh) {
  const double t = sh.tp, s = double(seq_len), tokens = sequences * s, d = double(m.hidden),
               q = double(m.heads * m.head_dim), kv = double(m.kv_heads * m.head_dim);
  // The products as the models run them: a whole GPT-2 block one fused q, k, v projection,
  // Llama-style blocks and every attention tile three; then the output projection and the MLP's
  // up (and gate) and down. A tile's products cover its key/value heads (and their query heads).
  const bool gpt2 = m.arch == models::Arch::kGpt2, tiled = sh.block_tiled();
  const int64_t a = std::max<int64_t>(1, sh.attention_tiles), rep = m.heads / std::max<int64_t>(1, m.kv_heads);
  Work w;
  if (gpt2 && !tiled) w.gemms = {{2 * tokens * d * (q + 2 * kv) / t, 1}, {2 * tokens * q * d / t, 1}};
  else
    for (int64_t i = 0; i < a; ++i) {
      const double kv_i = double(models::tile_range(m.kv_heads, a, i).size() * m.head_dim), q_i = kv_i * double(rep);
      w.gemms.insert(w.gemms.end(), {{2 * tokens * d * q_i / t, 1}, {2 * tokens * d * kv_i / t, 2}, {2 * tokens * q_i * d / t, 1}});
    }
  const Work mlp = mlp_forward(m, sequences, seq_len, sh);
  w.gemms.insert(w.gemms.end(), mlp.gemms.begin(), mlp.gemms.end());
  w.attention_flops = 2 * tokens * 2 * s * q / t;
  w.attention_product = w.attention_flops / double(a);  // one batched product over sequences and a tile's heads
  double per_token_hidden = activation_bytes_per_token_hidden(m, seq_len, sh);
  if (tiled) {
    // Per token and hidden unit, in activations: a + m residual adds (read two, write one) where
    // a whole block has two, and a stack (write two, read two) after each tile but the last of
    // its kind; a backward then moves twice that, as for the rest.
    const double mt = double(std::max<int64_t>(1, sh.mlp_tiles)), stacks = double(a - 1) + (mt - 1);
    per_token_hidden += 3 * (double(a) + mt - 2) + 4 * stacks;
  }
  w.memory_bytes = 2 * tokens * d * per_token_hidden * (sh.activation_bytes / 2);
  return w;
}

Work mlp_forward(const models::ModelConfig& m, double sequences, int64_t seq_len, const ShardOf& sh) {
  const double tokens = sequences * double(seq_len), d = double(m.hidden);
  const double per_product = sh.mlp_token_chunk > 0 ? std::min(tokens, double(sh.mlp_token_chunk)) : tokens;
  const double products = (m.arch == models::Arch::kGpt2 ? 2.0 : 3.0) * tokens / per_product;
  const int64_t tiles = std::max<int64_t>(1, sh.mlp_tiles);
  Work w;
  if (m.moe.enabled()) {
    // A sparse block (every block priced as one): the router's product on this GPU's tokens (a
    // tensor-parallel rank's share of the sequence), then each of its experts' three on its share
    // of the choices of the ep GPUs' tokens, evenly spread (experts whole, not tensor-split).
    const double experts = double(m.moe.experts), local = tokens / sh.tp,
                 rows = local * sh.ep * double(m.moe.top_k) / experts;
    w.gemms.push_back({2 * local * d * experts, 1});
    w.gemms.push_back({2 * rows * d * double(m.moe.intermediate), 3 * experts / sh.ep});
    return w;
  }
  for (int64_t j = 0; j < tiles; ++j) {
    const double f_j = double(models::tile_range(m.intermediate, tiles, j).size());
    w.gemms.push_back({2 * per_product * d * f_j / sh.tp, products});
  }
  return w;
}

Work head_forward(const models::ModelConfig& m, double sequences, int64_t seq_len, const ShardOf& sh) {
  const double tokens = sequences * double(seq_len), d = double(m.hidden), v = double(m.vocab_size), t = sh.tp;
  // Each logits tile's product at its own size, the last chunk and the last rows of each side
  // smaller where the cut is uneven (layout::LogitsTiles's tiles); the FLOPs stay the whole head's.
  const double chunk = sh.logits_token_chunk > 0 ? std::min(tokens, sh.logits_token_chunk) : tokens,
               rows = sh.logits_vocab_tile > 0 ? std::min(v, sh.logits_vocab_tile) : v;
  const double full_chunks = std::floor(tokens / chunk), last_chunk = tokens - full_chunks * chunk,
               full_rows = std::floor(v / rows), last_rows = v - full_rows * rows;
  Work w;
  for (auto [c, nc] : {std::pair{chunk, full_chunks}, {last_chunk, 1.0}})
    for (auto [r, nr] : {std::pair{rows, full_rows}, {last_rows, 1.0}})
      if (c > 0 && r > 0 && nc * nr > 0) w.gemms.push_back({2 * c * d * r / t, nc * nr});
  // The logits written, read by the softmax and its gradient written: in fp32.
  w.memory_bytes = 3 * tokens * v / t * 4;
  return w;
}

Seconds seconds_by_kind(const Work& w, const GpuSpec& gpu, bool fp32) {
  Seconds s;
  for (const Work::Gemm& g : w.gemms)
    if (g.flops > 0) s.matmul += g.flops * g.count / matmul_rate(gpu, g.flops, fp32);
  if (w.attention_flops > 0)
    s.attention = w.attention_flops / (matmul_rate(gpu, w.attention_product, fp32) * gpu.attention_efficiency);
  if (w.memory_bytes > 0 && gpu.memory_bandwidth > 0) s.memory = w.memory_bytes / gpu.memory_bandwidth;
  return s;
}

double seconds(const Work& w, const GpuSpec& gpu, bool fp32) { return seconds_by_kind(w, gpu, fp32).total(); }

}  // namespace strata::planner
