// What a model's blocks cost beyond their parameters (model_shapes.h): the bytes a stage's
// autograd graph keeps a token, and the floating-point work of a token.
#include <algorithm>

#include "strata/models/model_shapes.h"

namespace strata::models {

namespace {

// One block stage's graph per token, in parts. `norms` counts the norms the stage runs (each saves
// its output and its per-token statistics; Llama's also its normalized input before the weight,
// and in a lower-precision dtype an fp32 copy of its input; the norm's input is counted where it
// is made: the stage's input, or a whole block's residual), `heads` the query heads of its
// attention (0: none), `mlp` its intermediate features (0: none, or the MLP chunked, which keeps
// only its input: the norm's output).
uint64_t graph_parts(const ModelConfig& c, uint64_t e, uint64_t input_width, uint64_t norms, bool residual,
                     uint64_t heads, uint64_t mlp) {
  const uint64_t d = uint64_t(c.hidden), hd = uint64_t(c.head_dim), rep = uint64_t(c.heads / c.kv_heads);
  const uint64_t q = heads * hd, kv = heads / rep * hd;
  const bool gpt2 = c.arch == Arch::kGpt2;
  uint64_t b = e * input_width * d + (residual ? e * d : 0);
  b += norms * (gpt2 ? e * d + 8 : 2 * e * d + (e < 4 ? 4 * d : 0) + 4);
  // Attention: q, k and v as the kernel takes them (k and v repeated to the query heads for GQA),
  // its output and the merged copy the projection takes: at most 5 query widths (GPT-2: q, k, v
  // are one width each); Llama's rotation keeps k before it. The fp32 log-sum-exp per head.
  if (heads > 0) b += e * (gpt2 ? 5 * q : 5 * q + 2 * kv) + 4 * heads;
  // The MLP: GPT-2's up projection and its activation; Llama's gate, its activation, up and
  // their product.
  b += e * (gpt2 ? 2 : 4) * mlp;
  return b;
}

// A sparse block's experts [a range of `experts_here`] per token, beside its norms: each token's
// top_k copies of its normed input, each expert's MLP over its tokens (as a dense MLP of top_k x
// the expert's features), their weighted outputs, all in the range's share of the choices; and
// the router's fp32 logits, probabilities and weights with the choices' indices, whole in each.
uint64_t experts_graph(const ModelConfig& c, uint64_t e, uint64_t experts_here) {
  const uint64_t k = uint64_t(c.moe.top_k), d = uint64_t(c.hidden), E = uint64_t(c.moe.experts);
  return e * 4 * (k * uint64_t(c.moe.intermediate) * experts_here / E) + k * (2 * e * d + 16) * experts_here / E +
         3 * 4 * E;
}

}  // namespace

std::vector<uint64_t> stage_graph_bytes_per_token(const ModelConfig& c, const LayerTiles& t, size_t elem_bytes,
                                                  bool mlp_chunked) {
  check_tiles(c, t);
  const uint64_t e = elem_bytes;
  std::vector<uint64_t> g(size_t(t.vocab), 0);
  const auto mlp = [&](uint64_t features) { return mlp_chunked ? 0 : features; };
  for (int64_t i = 0; i < c.layers; ++i) {
    if (t.blocks_whole()) {
      // Gemma 2's two more norms; Qwen3's query and key norms are small beside them, not counted.
      if (c.sparse(i)) {
        g.push_back(graph_parts(c, e, 1, 2, /*residual=*/true, uint64_t(c.heads), 0) +
                    experts_graph(c, e, uint64_t(c.moe.experts)));
        continue;
      }
      g.push_back(graph_parts(c, e, 1, c.sandwich_norms ? 4 : 2, /*residual=*/true, uint64_t(c.heads),
                              mlp(uint64_t(c.intermediate))));
      continue;
    }
    const int64_t rep = c.heads / c.kv_heads;
    for (int64_t a = 0; a < t.attention; ++a)
      g.push_back(graph_parts(c, e, a == 0 ? 1 : 2, a == 0 ? 1 : 0, false,
                              uint64_t(tile_range(c.kv_heads, t.attention, a).size() * rep), 0));
    for (int64_t m = 0; m < t.mlp; ++m) {
      if (c.sparse(i)) {  // an expert tile: its input (3 planes after the first), its experts
        g.push_back(graph_parts(c, e, m == 0 ? 1 : 3, m == 0 ? 1 : 0, false, 0, 0) +
                    experts_graph(c, e, uint64_t(tile_range(c.moe.experts, t.mlp, m).size())));
        continue;
      }
      g.push_back(graph_parts(c, e, m == 0 ? 1 : 2, m == 0 ? 1 : 0, false, 0,
                              mlp(uint64_t(tile_range(c.intermediate, t.mlp, m).size()))));
    }
  }
  g.insert(g.end(), size_t(t.vocab), 0);
  return g;
}

uint64_t block_graph_bytes_per_token(const ModelConfig& c, size_t e) {
  return stage_graph_bytes_per_token(c, {}, e).at(1);
}

ForwardFlops forward_flops_per_token(const ModelConfig& c, int64_t seq_len) {
  const double d = double(c.hidden), f = double(c.intermediate), q = double(c.heads * c.head_dim),
               kv = double(c.kv_heads * c.head_dim), s = double(seq_len);
  const double dense_mlp = c.arch == Arch::kGpt2 ? 2 * d * f : 3 * d * f;
  // A sparse block: its router, then top_k experts.
  const double sparse_mlp = d * double(c.moe.experts) + 3 * d * double(c.moe.intermediate) * double(c.moe.top_k);
  const double attention = 2 * s * q;                       // q.k over s keys, then p.v
  ForwardFlops out;
  for (int64_t i = 0; i < c.layers; ++i)  // multiply-adds a token
    out.blocks += 2 * (d * (q + 2 * kv) + q * d + (c.sparse(i) ? sparse_mlp : dense_mlp) + attention);
  out.head = 2 * d * double(c.vocab_size);
  return out;
}

double model_flops_per_token(const ModelConfig& c, int64_t seq_len, int64_t frozen) {
  const double all = double(c.active_parameters() + adapter_parameters(c));
  return 6.0 * (all - double(frozen)) + 4.0 * double(frozen) +
         12.0 * double(c.layers) * double(c.hidden) * double(seq_len);
}

}  // namespace strata::models
