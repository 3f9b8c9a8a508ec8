#include "strata/models/model_shapes.h"

#include <algorithm>
#include <stdexcept>
#include <string>

namespace strata::models {

void check_block_tiling(const ModelConfig& c, const BlockTiling& t) {
  if (t.attention < 1 || t.mlp < 1)
    throw std::invalid_argument("block tiles: " + std::to_string(t.attention) + " attention x " + std::to_string(t.mlp) +
                                " MLP tiles: each count must be at least 1");
  if (t.attention > c.kv_heads)
    throw std::invalid_argument("block tiles: " + std::to_string(t.attention) + " attention tiles, but model '" + c.name +
                                "' has " + std::to_string(c.kv_heads) +
                                " key/value heads (an attention tile is a group of them)");
  if (t.mlp > c.intermediate)
    throw std::invalid_argument("block tiles: " + std::to_string(t.mlp) + " MLP tiles, but model '" + c.name + "' has " +
                                std::to_string(c.intermediate) + " intermediate features");
}

Range tile_range(int64_t n, int64_t parts, int64_t i) {
  const int64_t base = n / parts, extra = n % parts;
  const int64_t begin = i * base + std::min(i, extra);
  return {begin, begin + base + (i < extra ? 1 : 0)};
}

namespace {

// Elements of attention tile i (of t.attention) and MLP tile j: the norm (and the output bias)
// belong to the first tile of each.
uint64_t attention_tile_parameters(const ModelConfig& c, const BlockTiling& t, int64_t i) {
  const int64_t d = c.hidden, hd = c.head_dim, rep = c.heads / c.kv_heads;
  const int64_t kv = tile_range(c.kv_heads, t.attention, i).size() * hd, q = kv * rep;
  if (c.arch == Arch::kGpt2) return uint64_t((i == 0 ? 2 * d + d : 0) + 3 * q * d + 3 * q + d * q);
  return uint64_t((i == 0 ? d + (c.attention_out_bias ? d : 0) : 0) + (q + 2 * kv) * d +
                  (c.attention_bias ? q + 2 * kv : 0) + d * q);
}

uint64_t mlp_tile_parameters(const ModelConfig& c, const BlockTiling& t, int64_t j) {
  const int64_t d = c.hidden, f = tile_range(c.intermediate, t.mlp, j).size();
  if (c.arch == Arch::kGpt2) return uint64_t((j == 0 ? 2 * d + d : 0) + 2 * d * f + f);
  return uint64_t((j == 0 ? d + (c.mlp_bias ? d : 0) : 0) + 3 * d * f + (c.mlp_bias ? 2 * f : 0));
}

}  // namespace

std::vector<uint64_t> stage_parameters(const ModelConfig& c, const BlockTiling& t) {
  check_block_tiling(c, t);
  const uint64_t d = uint64_t(c.hidden), v = uint64_t(c.vocab_size);
  std::vector<uint64_t> n;
  n.push_back(v * d + (c.arch == Arch::kGpt2 ? uint64_t(c.max_positions) * d : 0));
  for (int64_t i = 0; i < c.layers; ++i) {
    if (t.whole()) {
      n.push_back(uint64_t(c.block_parameters()));
      continue;
    }
    for (int64_t a = 0; a < t.attention; ++a) n.push_back(attention_tile_parameters(c, t, a));
    for (int64_t m = 0; m < t.mlp; ++m) n.push_back(mlp_tile_parameters(c, t, m));
  }
  n.push_back((c.arch == Arch::kGpt2 ? 2 * d : d) + (c.tie_embeddings ? 0 : v * d));
  return n;
}

std::vector<uint64_t> stage_input_widths(const ModelConfig& c, const BlockTiling& t) {
  check_block_tiling(c, t);
  std::vector<uint64_t> w{1};
  for (int64_t i = 0; i < c.layers; ++i) {
    if (t.whole()) {
      w.push_back(1);
      continue;
    }
    for (int64_t a = 0; a < t.attention; ++a) w.push_back(a == 0 ? 1 : 2);
    for (int64_t m = 0; m < t.mlp; ++m) w.push_back(m == 0 ? 1 : 2);
  }
  w.push_back(1);
  return w;
}

std::string stage_name(const ModelConfig& c, const BlockTiling& t, size_t stage) {
  const size_t per_block = size_t(t.stages());
  if (stage == 0) return "embedding";
  if (stage == 1 + size_t(c.layers) * per_block) return "head";
  if (stage > 1 + size_t(c.layers) * per_block) throw std::out_of_range("no stage " + std::to_string(stage));
  const size_t block = (stage - 1) / per_block;
  const int64_t k = int64_t((stage - 1) % per_block);
  const std::string name = "block." + std::to_string(block);
  if (t.whole()) return name;
  return k < t.attention ? name + ".attn." + std::to_string(k) : name + ".mlp." + std::to_string(k - t.attention);
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
