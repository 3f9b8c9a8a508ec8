// Whole stages of GPT-2 and the Llama family (Mistral, Qwen2, Gemma by ModelConfig's flags), and
// the operations every stage shares (decoder_stages.h).
#include "decoder_stages.h"

#include <cmath>
#include <limits>
#include <optional>

#include "strata/models/model_shapes.h"
#include "strata/models/moe.h"

namespace strata::models::detail {

std::string module_name(std::string hf) {
  for (char& c : hf) c = c == '.' ? '_' : c;
  return hf;
}

at::Tensor dense(const at::Tensor& x, const at::Tensor& w, const at::Tensor& b) {
  return at::linear(x, w, b.defined() ? std::optional<at::Tensor>(b) : std::nullopt);
}

// [B, T, H*hd] -> [B, H, T, hd]
at::Tensor split_heads(const at::Tensor& x, int64_t heads, int64_t head_dim) {
  return x.view({x.size(0), x.size(1), heads, head_dim}).transpose(1, 2);
}
// [B, H, T, hd] -> [B, T, H*hd]
at::Tensor merge_heads(const at::Tensor& x) {
  return x.transpose(1, 2).reshape({x.size(0), x.size(2), x.size(1) * x.size(3)});
}

namespace {

// ---------------------------------------------------------------- GPT-2
class Gpt2Embedding final : public Stage {
 public:
  explicit Gpt2Embedding(const ModelConfig& c) {
    wte = add("transformer.wte.weight", {c.vocab_size, c.hidden});
    wpe = add("transformer.wpe.weight", {c.max_positions, c.hidden});
  }
  at::Tensor forward(const at::Tensor& ids, const TokenLayout& layout) override {
    return at::embedding(wte, ids) + learned_positions(wpe, layout, ids.size(1));
  }
  at::Tensor wte, wpe;
};

class Gpt2Block final : public Stage {
 public:
  Gpt2Block(const ModelConfig& c, int64_t i) : c_(c) {
    const std::string p = "transformer.h." + std::to_string(i) + ".";
    const int64_t d = c.hidden, f = c.intermediate;
    ln1_w = add(p + "ln_1.weight", {d});
    ln1_b = add(p + "ln_1.bias", {d});
    attn_w = add(p + "attn.c_attn.weight", {3 * d, d});
    attn_b = add(p + "attn.c_attn.bias", {3 * d});
    proj_w = add(p + "attn.c_proj.weight", {d, d});
    proj_b = add(p + "attn.c_proj.bias", {d});
    ln2_w = add(p + "ln_2.weight", {d});
    ln2_b = add(p + "ln_2.bias", {d});
    fc_w = add(p + "mlp.c_fc.weight", {f, d});
    fc_b = add(p + "mlp.c_fc.bias", {f});
    mproj_w = add(p + "mlp.c_proj.weight", {d, f});
    mproj_b = add(p + "mlp.c_proj.bias", {d});
    add_adapters(c, i);
  }
  at::Tensor forward(const at::Tensor& x, const TokenLayout& layout) override {
    const int64_t d = c_.hidden;
    at::Tensor h = at::layer_norm(x, {d}, ln1_w, ln1_b, c_.norm_eps);
    auto qkv = adapted(h, attn_w, attn_b, "attn.c_attn").split(d, -1);
    at::Tensor q = split_heads(qkv[0], c_.heads, c_.head_dim);
    at::Tensor k = split_heads(qkv[1], c_.heads, c_.head_dim);
    at::Tensor v = split_heads(qkv[2], c_.heads, c_.head_dim);
    at::Tensor a = attention(q, k, v, layout, 0);
    at::Tensor r = x + adapted(merge_heads(a), proj_w, proj_b, "attn.c_proj");
    h = at::layer_norm(r, {d}, ln2_w, ln2_b, c_.norm_eps);
    return r + mlp(c_, h, {fc_w, fc_b, {}, {}, mproj_w, mproj_b, adapter("mlp.c_fc"), {}, adapter("mlp.c_proj")},
                   mlp_chunk_);
  }

 private:
  ModelConfig c_;
  at::Tensor ln1_w, ln1_b, attn_w, attn_b, proj_w, proj_b, ln2_w, ln2_b, fc_w, fc_b, mproj_w,
      mproj_b;
};

class Gpt2Head final : public HeadStage {
 public:
  Gpt2Head(const ModelConfig& c, const at::Tensor& tied_wte) : c_(c), wte_(tied_wte) {
    lnf_w = add("transformer.ln_f.weight", {c.hidden});
    lnf_b = add("transformer.ln_f.bias", {c.hidden});
    wte_ = lm_head_weight(c, tied_wte);
  }
  at::Tensor normed(const at::Tensor& x) override { return at::layer_norm(x, {c_.hidden}, lnf_w, lnf_b, c_.norm_eps); }
  const at::Tensor& lm_weight() const override { return wte_; }

 private:
  ModelConfig c_;
  at::Tensor wte_, lnf_w, lnf_b;
};

}  // namespace

// ---------------------------------------------------------------- Llama
// RMSNorm as transformers computes it: Llama multiplies by the weight after casting back to the
// input's dtype; Gemma multiplies by (1 + weight) in fp32 and casts last.
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& w, double eps, bool gemma) {
  const at::Tensor xf = x.to(at::kFloat);
  const at::Tensor var = xf.pow(2).mean(-1, /*keepdim=*/true);
  if (gemma) return (xf * at::rsqrt(var + eps) * (1.0 + w.to(at::kFloat))).to(x.scalar_type());
  return w * (xf * at::rsqrt(var + eps)).to(x.scalar_type());
}

namespace {

at::Tensor rotate_half(const at::Tensor& x) {
  const int64_t h = x.size(-1) / 2;
  return at::cat({-x.narrow(-1, h, h), x.narrow(-1, 0, h)}, -1);
}

// Inverse frequencies as transformers computes them in fp32, with Llama 3's scaling when set.
at::Tensor rope_inv_freq(const ModelConfig& c) {
  const int64_t hd = c.head_dim;
  at::Tensor inv_freq =
      1.0 / at::pow(c.rope_theta, at::arange(0, hd, 2, at::kLong).to(at::kFloat) / static_cast<double>(hd));
  const auto& r = c.llama3_rope;
  if (r.factor == 0) return inv_freq;
  const double old_len = static_cast<double>(r.original_max_positions);
  const double low_wavelen = old_len / r.low_freq_factor, high_wavelen = old_len / r.high_freq_factor;
  const at::Tensor wavelen = 2 * M_PI / inv_freq;
  at::Tensor scaled = at::where(wavelen > low_wavelen, inv_freq / r.factor, inv_freq);
  const at::Tensor smooth = (old_len / wavelen - r.low_freq_factor) / (r.high_freq_factor - r.low_freq_factor);
  const at::Tensor smoothed = (1 - smooth) * scaled / r.factor + smooth * scaled;
  const at::Tensor medium = (wavelen < high_wavelen).logical_not() * (wavelen > low_wavelen).logical_not();
  return at::where(medium, smoothed, scaled);
}

}  // namespace

at::Tensor attention(at::Tensor q, at::Tensor k, at::Tensor v, const TokenLayout& layout, int64_t window,
                     double scale, double softcap) {
  const int64_t rep = q.size(1) / k.size(1);
  if (rep > 1) {
    k = k.repeat_interleave(rep, 1);
    v = v.repeat_interleave(rep, 1);
  }
  const int64_t t = q.size(2);
  at::Tensor mask = layout.attention_mask(t, window, q.device());
  const std::optional<double> sdpa_scale = scale > 0 ? std::optional<double>(scale) : std::nullopt;
  if (softcap <= 0) {
    if (!mask.defined()) return at::scaled_dot_product_attention(q, k, v, {}, 0.0, /*is_causal=*/true, sdpa_scale);
    return at::scaled_dot_product_attention(q, k, v, mask, 0.0, false, sdpa_scale);
  }
  // Soft-capped scores (Gemma 2), which no fused kernel computes: as transformers' eager attention
  // does, the T x T scores in the inputs' dtype, capped, masked, softmax in fp32.
  if (!mask.defined()) mask = at::ones({t, t}, q.options().dtype(at::kBool)).tril();
  at::Tensor s = at::matmul(q, k.transpose(-2, -1)) * (scale > 0 ? scale : 1.0 / std::sqrt(double(q.size(-1))));
  s = tiling::soft_cap(s, softcap).masked_fill(mask.logical_not(), -std::numeric_limits<double>::infinity());
  return at::matmul(at::softmax(s, -1, at::kFloat).to(q.scalar_type()), v);
}

// Rotary embeddings as transformers computes them (fp32 angles, cat(freqs, freqs)). `inv_freq`
// caches rope_inv_freq on the input's device: a copy from pageable memory to a GPU blocks the
// host until the GPU catches up, which on every block's forward and recompute would keep the
// host from running ahead.
at::Tensor llama_attention(const ModelConfig& c, at::Tensor q, at::Tensor k, at::Tensor v, const TokenLayout& layout,
                           int64_t window, at::Tensor& inv_freq, const at::Tensor& q_norm, const at::Tensor& k_norm) {
  if (q_norm.defined()) {  // each head normed over its head_dim, before the rotation
    q = rms_norm(q, q_norm, c.norm_eps);
    k = rms_norm(k, k_norm, c.norm_eps);
  }
  const int64_t t = q.size(2);
  if (!inv_freq.defined() || inv_freq.device() != q.device()) inv_freq = rope_inv_freq(c).to(q.device());
  const at::Tensor pos = layout.positions(t, q.device()).to(at::kFloat);    // [1 or B, T]
  const at::Tensor freqs = pos.unsqueeze(-1) * inv_freq;                   // [1 or B, T, hd / 2]
  const at::Tensor emb = at::cat({freqs, freqs}, -1).unsqueeze(1);         // [1 or B, 1, T, hd]
  const at::Tensor cos = emb.cos().to(q.scalar_type()), sin = emb.sin().to(q.scalar_type());
  q = q * cos + rotate_half(q) * sin;
  k = k * cos + rotate_half(k) * sin;
  return attention(q, k, v, layout, window, c.query_pre_attn_scalar > 0 ? 1.0 / std::sqrt(c.query_pre_attn_scalar) : 0,
                   c.attn_softcap);
}

at::Tensor learned_positions(const at::Tensor& wpe, const TokenLayout& layout, int64_t t) {
  TORCH_CHECK(t <= wpe.size(0), "sequence of ", t, " tokens exceeds n_positions ", wpe.size(0));
  if (!layout.packed()) return wpe.narrow(0, 0, t).unsqueeze(0);
  return at::embedding(wpe, layout.positions(t, wpe.device()));
}

// The MLP of `n` (its normed input): with `chunk` > 0 over token chunks (tiling::chunked_mlp: one
// chunk's intermediates at a time), else whole (tiling::plain_mlp, the same operations).
tiling::MlpActivation mlp_activation(const ModelConfig& c) {
  return c.arch == Arch::kGpt2                               ? tiling::MlpActivation::kGeluTanh
         : c.mlp_activation == ModelConfig::Activation::kSilu ? tiling::MlpActivation::kSilu
         : c.mlp_activation == ModelConfig::Activation::kGelu ? tiling::MlpActivation::kGelu
                                                               : tiling::MlpActivation::kGeluTanh;
}

at::Tensor mlp(const ModelConfig& c, const at::Tensor& n, const tiling::MlpWeights& w, int64_t chunk) {
  const tiling::MlpActivation act = mlp_activation(c);
  return chunk > 0 ? tiling::chunked_mlp(n, w, act, chunk) : tiling::plain_mlp(n, w, act);
}

namespace {

class LlamaEmbedding final : public Stage {
 public:
  explicit LlamaEmbedding(const ModelConfig& c) : gemma_(c.gemma), hidden_(c.hidden) {
    wte = add("model.embed_tokens.weight", {c.vocab_size, c.hidden});
  }
  at::Tensor forward(const at::Tensor& ids, const TokenLayout&) override {
    at::Tensor h = at::embedding(wte, ids);
    // Gemma: times sqrt(hidden) rounded to the embeddings' dtype, as transformers does.
    if (gemma_) h = h * at::scalar_tensor(std::sqrt(double(hidden_)), h.options()).to(h.scalar_type());
    return h;
  }
  at::Tensor wte;

 private:
  bool gemma_;
  int64_t hidden_;
};

class LlamaBlock final : public Stage {
  at::Tensor inv_freq_;  // rope_inv_freq on the device of the last forward

 public:
  LlamaBlock(const ModelConfig& c, int64_t i) : c_(c), window_(c.attention_window(i)) {
    const std::string p = "model.layers." + std::to_string(i) + ".";
    const int64_t d = c.hidden, q = c.heads * c.head_dim, kv = c.kv_heads * c.head_dim,
                  f = c.intermediate;
    in_norm = add(p + "input_layernorm.weight", {d});
    wq = add(p + "self_attn.q_proj.weight", {q, d});
    wk = add(p + "self_attn.k_proj.weight", {kv, d});
    wv = add(p + "self_attn.v_proj.weight", {kv, d});
    wo = add(p + "self_attn.o_proj.weight", {d, q});
    if (c.attention_bias) {
      bq = add(p + "self_attn.q_proj.bias", {q});
      bk = add(p + "self_attn.k_proj.bias", {kv});
      bv = add(p + "self_attn.v_proj.bias", {kv});
    }
    if (c.attention_out_bias) bo = add(p + "self_attn.o_proj.bias", {d});
    if (c.qk_norm) {  // Qwen3
      q_norm = add(p + "self_attn.q_norm.weight", {c.head_dim});
      k_norm = add(p + "self_attn.k_norm.weight", {c.head_dim});
    }
    // Gemma 2 norms the attention's output (post_attention_layernorm) and the MLP's input and
    // output (pre_/post_feedforward_layernorm); the others norm the MLP's input with
    // post_attention_layernorm.
    post_norm = add(p + "post_attention_layernorm.weight", {d});
    if (c.sandwich_norms) pre_ff_norm = add(p + "pre_feedforward_layernorm.weight", {d});
    if (c.sparse(i)) {  // the router, then each expert's gate, up and down
      router = add(router_name(c, i), {c.moe.experts, d});
      experts_ = add_experts(c, i, {0, c.moe.experts});
      add_adapters(c, i);
      return;
    }
    wg = add(p + "mlp.gate_proj.weight", {f, d});
    wu = add(p + "mlp.up_proj.weight", {f, d});
    wd = add(p + "mlp.down_proj.weight", {d, f});
    if (c.mlp_bias) {
      bg = add(p + "mlp.gate_proj.bias", {f});
      bu = add(p + "mlp.up_proj.bias", {f});
      bd = add(p + "mlp.down_proj.bias", {d});
    }
    if (c.sandwich_norms) post_ff_norm = add(p + "post_feedforward_layernorm.weight", {d});
    add_adapters(c, i);
  }

  at::Tensor forward(const at::Tensor& x, const TokenLayout& layout) override {
    at::Tensor h = rms_norm(x, in_norm, c_.norm_eps, c_.gemma);
    at::Tensor q = split_heads(adapted(h, wq, bq, "self_attn.q_proj"), c_.heads, c_.head_dim);
    at::Tensor k = split_heads(adapted(h, wk, bk, "self_attn.k_proj"), c_.kv_heads, c_.head_dim);
    at::Tensor v = split_heads(adapted(h, wv, bv, "self_attn.v_proj"), c_.kv_heads, c_.head_dim);
    at::Tensor a = adapted(merge_heads(llama_attention(c_, q, k, v, layout, window_, inv_freq_, q_norm, k_norm)), wo,
                           bo, "self_attn.o_proj");
    const tiling::MlpWeights w{wu, bu, wg, bg, wd, bd, adapter("mlp.up_proj"), adapter("mlp.gate_proj"),
                               adapter("mlp.down_proj")};
    if (!c_.sandwich_norms) {
      at::Tensor r = x + a;
      const at::Tensor n = rms_norm(r, post_norm, c_.norm_eps, c_.gemma);
      return r + (router.defined() ? moe_mlp(c_, n, router, adapted_experts(c_, experts_, 0), stats_, layout.padding())
                                   : mlp(c_, n, w, mlp_chunk_));
    }
    at::Tensor r = x + rms_norm(a, post_norm, c_.norm_eps, c_.gemma);
    at::Tensor m = mlp(c_, rms_norm(r, pre_ff_norm, c_.norm_eps, c_.gemma), w, mlp_chunk_);
    return r + rms_norm(m, post_ff_norm, c_.norm_eps, c_.gemma);
  }
  const RouterStats* router_stats() const override { return router.defined() ? &stats_ : nullptr; }

 private:
  ModelConfig c_;
  int64_t window_;
  at::Tensor in_norm, wq, wk, wv, wo, bq, bk, bv, bo, q_norm, k_norm, post_norm, pre_ff_norm, wg, wu, wd, bg, bu, bd,
      post_ff_norm;
  at::Tensor router;                         // a sparse block's (ModelConfig::Moe)
  std::vector<tiling::MlpWeights> experts_;  // and its experts'
  RouterStats stats_;
};

class LlamaHead final : public HeadStage {
 public:
  LlamaHead(const ModelConfig& c, const at::Tensor& tied) : c_(c), w_(tied) {
    softcap_ = c.final_softcap;
    norm = add("model.norm.weight", {c.hidden});
    w_ = lm_head_weight(c, tied);
  }
  at::Tensor normed(const at::Tensor& x) override { return rms_norm(x, norm, c_.norm_eps, c_.gemma); }
  const at::Tensor& lm_weight() const override { return w_; }

 private:
  ModelConfig c_;
  at::Tensor w_, norm;
};

}  // namespace

std::shared_ptr<Stage> make_block(const ModelConfig& c, int64_t i) {
  if (c.arch == Arch::kGpt2) return std::make_shared<Gpt2Block>(c, i);
  return std::make_shared<LlamaBlock>(c, i);
}

std::shared_ptr<Stage> make_embedding(const ModelConfig& c) {
  if (c.arch == Arch::kGpt2) return std::make_shared<Gpt2Embedding>(c);
  return std::make_shared<LlamaEmbedding>(c);
}

at::Tensor token_weight(const Stage& e) { return e.hf_parameters().at(0).second; }

std::shared_ptr<HeadStage> make_head(const ModelConfig& c, const at::Tensor& tied) {
  if (c.arch == Arch::kGpt2) return std::make_shared<Gpt2Head>(c, tied);
  return std::make_shared<LlamaHead>(c, tied);
}

}  // namespace strata::models::detail
