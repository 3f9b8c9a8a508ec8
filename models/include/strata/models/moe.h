// A sparse block's mixture of experts (ModelConfig::Moe), as transformers' Mixtral and Qwen3-MoE
// compute it, the decoder's sparse blocks run it; public so that tests and `strata bench moe`
// can run it alone.
//
// Pure but for `stats`; differentiable in `n`, the router and every expert's weights. The host
// device and CUDA run the same operations (on CUDA the experts are separate matmuls, no grouped
// GEMM yet; the segments' bounds cost one device sync).
#pragma once

#include <ATen/core/Tensor.h>

#include <vector>

#include "strata/models/decoder.h"
#include "strata/models/model_config.h"
#include "strata/tiling/chunked_mlp.h"

namespace strata::models {

// The router's decision for each token from its logits [tokens, experts] (in the weights' dtype,
// as transformers computes them): probabilities (softmax in fp32), the top_k choices (torch.topk's
// order and ties) and their weights (renormalized when norm_topk; Qwen3-MoE's rounded to the
// logits' dtype). Differentiable in the logits through the weights and probabilities.
struct Routing {
  at::Tensor probabilities;  // [tokens, experts] fp32
  at::Tensor weight;         // [tokens, top_k]
  at::Tensor choice;         // [tokens, top_k] int64
};
Routing route(const ModelConfig& c, const at::Tensor& logits);
// The router's statistics of `r` (RouterStats), the probabilities' sum in their graph, over the
// tokens that are not `padding` (bool, one per token; undefined: every token), as transformers'
// load_balancing_loss_func leaves out what its attention_mask does.
void routing_stats(const ModelConfig& c, const Routing& r, RouterStats& stats, const at::Tensor& padding = {});
// Experts [first, first + experts.size()) of a sparse block's MLP on x [tokens, hidden] under
// `r`: each (token, choice) pair that chose one of them sorted stably by expert, each expert's
// tokens through its gated MLP as one matmul (an expert no token chose is not run: its weights get
// no gradient), the outputs times their weights put back in pair order and summed per token in
// choice order (no atomic adds: a recompute is bitwise the forward on every device); zero for a
// token that chose none of them. An expert tile runs its range; the whole MLP all of them.
// Throws std::invalid_argument for a range outside the model's experts.
at::Tensor experts_mlp(const ModelConfig& c, const at::Tensor& x, const Routing& r,
                       const std::vector<tiling::MlpWeights>& experts, int64_t first);

// Expert `expert`'s adapter in a fused expert tensor's adapter `fused` (A [experts r, in], B
// [out, r experts], PEFT's layout; model_shapes.h AdapterShape): A's rows [expert r, expert r +
// r) and B's columns j experts + expert, rows [row_begin, row_begin + rows) of them (gate_up_proj's
// gate or up half). Views: gradients reach `fused`.
tiling::LowRank expert_adapter(const tiling::LowRank& fused, int64_t experts, int64_t expert, int64_t row_begin,
                               int64_t rows);

// The whole MoE MLP of `n` (the MLP's normed input [..., hidden]): route() on the router's
// logits, then experts_mlp() over every expert. `router` [experts, hidden]; `experts[e]` expert
// e's gate, up and down weights (tiling::MlpWeights, no biases). Writes the router's statistics
// to `stats` (without `padding`'s tokens). Throws std::invalid_argument when `experts` does not
// hold c.moe.experts entries.
at::Tensor moe_mlp(const ModelConfig& c, const at::Tensor& n, const at::Tensor& router,
                   const std::vector<tiling::MlpWeights>& experts, RouterStats& stats, const at::Tensor& padding = {});

}  // namespace strata::models
