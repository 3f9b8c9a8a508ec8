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

// The MoE MLP of `n` (the MLP's normed input [..., hidden]): the router's logits in the weights'
// dtype, softmax in fp32, torch.topk, renormalized when norm_topk (Qwen3-MoE then rounds the
// weights to the model's dtype; Mixtral multiplies in fp32); each (token, choice) pair sorted
// stably by expert and each expert's tokens run through its gated MLP as one matmul (an expert
// no token chose is not run: its weights get no gradient); the outputs times their weights put
// back in pair order and summed per token in choice order (no atomic adds: a recompute is
// bitwise the forward on every device). `router` [experts, hidden]; `experts[e]` expert e's
// gate, up and down weights (tiling::MlpWeights, no biases). Writes the router's statistics to
// `stats`. Throws std::invalid_argument when `experts` does not hold c.moe.experts entries.
at::Tensor moe_mlp(const ModelConfig& c, const at::Tensor& n, const at::Tensor& router,
                   const std::vector<tiling::MlpWeights>& experts, RouterStats& stats);

}  // namespace strata::models
