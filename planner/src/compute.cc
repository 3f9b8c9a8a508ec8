#include "strata/planner/compute.h"

#include <algorithm>

namespace strata::planner {

Work Work::scaled(double f) const {
  Work w = *this;
  w.gemm_flops *= f;
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
  const double mlp = m.arch == models::Arch::kGpt2 ? 2 * d * f : 3 * d * f;
  Work w;
  w.gemm_flops = 2 * tokens * (d * (q + 2 * kv) + q * d + mlp) / t;
  w.gemm_product = 2 * tokens * d * f / t;  // the MLP's up projection
  w.attention_flops = 2 * tokens * 2 * s * q / t;
  w.attention_product = w.attention_flops;  // one batched product over sequences and heads
  w.memory_bytes = 2 * tokens * d * activation_bytes_per_token_hidden(m, seq_len, sh) * (sh.activation_bytes / 2);
  return w;
}

Work head_forward(const models::ModelConfig& m, double sequences, int64_t seq_len, const ShardOf& sh) {
  const double tokens = sequences * double(seq_len), d = double(m.hidden), v = double(m.vocab_size), t = sh.tp;
  Work w;
  w.gemm_flops = 2 * tokens * d * v / t;
  w.gemm_product = w.gemm_flops;
  // The logits written, read by the softmax and its gradient written: in fp32.
  w.memory_bytes = 3 * tokens * v / t * 4;
  return w;
}

Seconds seconds_by_kind(const Work& w, const GpuSpec& gpu, bool fp32) {
  Seconds s;
  if (w.gemm_flops > 0) s.matmul = w.gemm_flops / matmul_rate(gpu, w.gemm_product, fp32);
  if (w.attention_flops > 0)
    s.attention = w.attention_flops / (matmul_rate(gpu, w.attention_product, fp32) * gpu.attention_efficiency);
  if (w.memory_bytes > 0 && gpu.memory_bandwidth > 0) s.memory = w.memory_bytes / gpu.memory_bandwidth;
  return s;
}

double seconds(const Work& w, const GpuSpec& gpu, bool fp32) { return seconds_by_kind(w, gpu, fp32).total(); }

}  // namespace strata::planner
