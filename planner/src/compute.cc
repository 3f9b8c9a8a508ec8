#include "strata/planner/compute.h"

#include <algorithm>

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
  return (sh.sequence_parallel || sh.tp == 1 ? 34 / t : 10 + 24 / t) + (sh.flash_attention ? 0 : 5 * a * s / d / t);
}

Work block_forward(const models::ModelConfig& m, double sequences, int64_t seq_len, const ShardOf& sh) {
  const double t = sh.tp, s = double(seq_len), tokens = sequences * s, d = double(m.hidden),
               f = double(m.intermediate), q = double(m.heads * m.head_dim), kv = double(m.kv_heads * m.head_dim);
  // The products as the models run them: GPT-2 one fused q, k, v projection, Llama-style blocks
  // three; then the output projection and the MLP's up (and gate) and down.
  const bool gpt2 = m.arch == models::Arch::kGpt2;
  Work w;
  if (gpt2) w.gemms.push_back({2 * tokens * d * (q + 2 * kv) / t, 1});
  else w.gemms = {{2 * tokens * d * q / t, 1}, {2 * tokens * d * kv / t, 2}};
  w.gemms.push_back({2 * tokens * q * d / t, 1});
  w.gemms.push_back(mlp_forward(m, sequences, seq_len, sh).gemms.at(0));
  w.attention_flops = 2 * tokens * 2 * s * q / t;
  w.attention_product = w.attention_flops;  // one batched product over sequences and heads
  w.memory_bytes = 2 * tokens * d * activation_bytes_per_token_hidden(m, seq_len, sh) * (sh.activation_bytes / 2);
  return w;
}

Work mlp_forward(const models::ModelConfig& m, double sequences, int64_t seq_len, const ShardOf& sh) {
  const double tokens = sequences * double(seq_len), d = double(m.hidden), f = double(m.intermediate);
  const double per_product = sh.mlp_token_chunk > 0 ? std::min(tokens, double(sh.mlp_token_chunk)) : tokens;
  const double products = (m.arch == models::Arch::kGpt2 ? 2.0 : 3.0) * tokens / per_product;
  Work w;
  w.gemms.push_back({2 * per_product * d * f / sh.tp, products});
  return w;
}

Work head_forward(const models::ModelConfig& m, double sequences, int64_t seq_len, const ShardOf& sh) {
  const double tokens = sequences * double(seq_len), d = double(m.hidden), v = double(m.vocab_size), t = sh.tp;
  Work w;
  w.gemms = {{2 * tokens * d * v / t, 1}};
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
