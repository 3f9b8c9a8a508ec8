// The decoder's stage modules and the operations they share, internal to strata_models: whole
// stages of GPT-2 and the Llama family (decoder_stages.cc) and block and vocabulary tiles
// (decoder_tiles.cc), which decoder.cc assembles into a Decoder (strata/models/decoder.h states
// the stages' contract). Every function here is pure but for the modules it builds.
#pragma once

#include <ATen/ATen.h>

#include <memory>
#include <string>
#include <vector>

#include "strata/models/decoder.h"
#include "strata/tiling/chunked_mlp.h"
#include "strata/tiling/linear_cross_entropy.h"

namespace strata::models::detail {

// A Hugging Face name as a torch module's parameter name (dots to underscores).
std::string module_name(std::string hf);
// x W^T + b (b may be undefined).
at::Tensor dense(const at::Tensor& x, const at::Tensor& w, const at::Tensor& b = {});
// [B, T, H*hd] -> [B, H, T, hd], and back.
at::Tensor split_heads(const at::Tensor& x, int64_t heads, int64_t head_dim);
at::Tensor merge_heads(const at::Tensor& x);
// RMSNorm as transformers computes it (Gemma: by (1 + w) in fp32).
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& w, double eps, bool gemma = false);
// Attention of q [B, Hq, T, hd] over k, v [B, Hkv, T, hd] (Hq a multiple of Hkv: each key/value
// head serves its Hq / Hkv query heads), causal within each example of `layout`, over the last
// `window` keys when window > 0 (TokenLayout::attention_mask); scores scaled by `scale` (0:
// 1 / sqrt(hd)) and, when softcap > 0, capped to softcap * tanh(s / softcap) (Gemma 2).
at::Tensor attention(at::Tensor q, at::Tensor k, at::Tensor v, const TokenLayout& layout, int64_t window,
                     double scale = 0, double softcap = 0);
// Llama's attention: Qwen3's per-head q/k norms when `q_norm` and `k_norm` are defined ([head_dim],
// ModelConfig::qk_norm), rotary embeddings at the layout's positions, then attention();
// `inv_freq` caches the frequencies on the input's device.
at::Tensor llama_attention(const ModelConfig& c, at::Tensor q, at::Tensor k, at::Tensor v, const TokenLayout& layout,
                           int64_t window, at::Tensor& inv_freq, const at::Tensor& q_norm = {},
                           const at::Tensor& k_norm = {});
// GPT-2's learned positions of `layout` for `tokens` tokens ([1 or B, T, hidden]).
at::Tensor learned_positions(const at::Tensor& wpe, const TokenLayout& layout, int64_t tokens);
// The MLP of `n` (its normed input), over token chunks of `chunk` (> 0) or whole.
at::Tensor mlp(const ModelConfig& c, const at::Tensor& n, const tiling::MlpWeights& w, int64_t chunk);
// The model's MLP activation, as every MLP of it applies it.
tiling::MlpActivation mlp_activation(const ModelConfig& c);

// Whole stages: block i, the embedding, the head over `tied` (the embedding's token weight).
std::shared_ptr<Stage> make_block(const ModelConfig& c, int64_t i);
std::shared_ptr<Stage> make_embedding(const ModelConfig& c);
std::shared_ptr<HeadStage> make_head(const ModelConfig& c, const at::Tensor& tied);
// The token embedding's weight (or a tile's rows): every embedding stage's first tensor.
at::Tensor token_weight(const Stage& e);

// Tiles: block `block`'s attention tiles then its MLP tiles (t.attention x t.mlp; LoRA adapters
// held by the first of each part, used by the rest); embedding tile j of `count` (its rows of the
// vocabulary); head tile j of `count`, tied to `tied_rows` (its embedding tile's) when tied.
std::vector<std::shared_ptr<Stage>> make_block_tiles(const ModelConfig& c, int64_t block, const LayerTiles& t);
std::shared_ptr<Stage> make_embedding_tile(const ModelConfig& c, int64_t j, int64_t count);
std::shared_ptr<HeadStage> make_head_tile(const ModelConfig& c, int64_t j, int64_t count, const at::Tensor& tied_rows);

}  // namespace strata::models::detail
