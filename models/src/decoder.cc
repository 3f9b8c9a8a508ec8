#include "strata/models/decoder.h"
#include "strata/models/model_shapes.h"
#include "strata/tiling/chunked_mlp.h"

#include <ATen/CPUGeneratorImpl.h>

#include <cmath>
#include <map>
#include <stdexcept>

namespace strata::models {

namespace {

std::string module_name(std::string hf) {
  for (char& c : hf) c = c == '.' ? '_' : c;
  return hf;
}

at::Tensor dense(const at::Tensor& x, const at::Tensor& w, const at::Tensor& b = {}) {
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

at::Tensor mlp(const ModelConfig& c, const at::Tensor& n, const tiling::MlpWeights& w, int64_t chunk);

// ---------------------------------------------------------------- GPT-2
class Gpt2Embedding final : public Stage {
 public:
  explicit Gpt2Embedding(const ModelConfig& c) {
    wte = add("transformer.wte.weight", {c.vocab_size, c.hidden});
    wpe = add("transformer.wpe.weight", {c.max_positions, c.hidden});
  }
  at::Tensor forward(const at::Tensor& ids) override {
    const int64_t t = ids.size(1);
    TORCH_CHECK(t <= wpe.size(0), "sequence of ", t, " tokens exceeds n_positions ", wpe.size(0));
    return at::embedding(wte, ids) + wpe.narrow(0, 0, t).unsqueeze(0);
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
  at::Tensor forward(const at::Tensor& x) override {
    const int64_t d = c_.hidden;
    at::Tensor h = at::layer_norm(x, {d}, ln1_w, ln1_b, c_.norm_eps);
    auto qkv = adapted(h, attn_w, attn_b, "attn.c_attn").split(d, -1);
    at::Tensor q = split_heads(qkv[0], c_.heads, c_.head_dim);
    at::Tensor k = split_heads(qkv[1], c_.heads, c_.head_dim);
    at::Tensor v = split_heads(qkv[2], c_.heads, c_.head_dim);
    at::Tensor a = at::scaled_dot_product_attention(q, k, v, {}, 0.0, /*is_causal=*/true);
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

// ---------------------------------------------------------------- Llama
// RMSNorm as transformers computes it: Llama multiplies by the weight after casting back to the
// input's dtype; Gemma multiplies by (1 + weight) in fp32 and casts last.
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& w, double eps, bool gemma = false) {
  const at::Tensor xf = x.to(at::kFloat);
  const at::Tensor var = xf.pow(2).mean(-1, /*keepdim=*/true);
  if (gemma) return (xf * at::rsqrt(var + eps) * (1.0 + w.to(at::kFloat))).to(x.scalar_type());
  return w * (xf * at::rsqrt(var + eps)).to(x.scalar_type());
}

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

// Causal attention of Llama's heads q [B, Hq, T, hd] over k, v [B, Hkv, T, hd] (Hq a multiple of
// Hkv): rotary embeddings as transformers computes them (fp32 angles, cat(freqs, freqs)), the
// key/value heads repeated for their query heads. `inv_freq` caches rope_inv_freq on the
// input's device: a copy from pageable memory to a GPU blocks the host until the GPU catches
// up, which on every block's forward and recompute would keep the host from running ahead.
at::Tensor llama_attention(const ModelConfig& c, at::Tensor q, at::Tensor k, at::Tensor v, at::Tensor& inv_freq) {
  const int64_t t = q.size(2);
  if (!inv_freq.defined() || inv_freq.device() != q.device()) inv_freq = rope_inv_freq(c).to(q.device());
  const at::Tensor pos = at::arange(t, at::TensorOptions().dtype(at::kLong).device(q.device())).to(at::kFloat);
  const at::Tensor freqs = at::outer(pos, inv_freq);
  const at::Tensor emb = at::cat({freqs, freqs}, -1);
  const at::Tensor cos = emb.cos().to(q.scalar_type()), sin = emb.sin().to(q.scalar_type());
  q = q * cos + rotate_half(q) * sin;
  k = k * cos + rotate_half(k) * sin;
  const int64_t rep = q.size(1) / k.size(1);
  if (rep > 1) {
    k = k.repeat_interleave(rep, 1);
    v = v.repeat_interleave(rep, 1);
  }
  return at::scaled_dot_product_attention(q, k, v, {}, 0.0, /*is_causal=*/true);
}

// The MLP of `n` (its normed input): with `chunk` > 0 over token chunks (tiling::chunked_mlp: one
// chunk's intermediates at a time), else whole (tiling::plain_mlp, the same operations).
at::Tensor mlp(const ModelConfig& c, const at::Tensor& n, const tiling::MlpWeights& w, int64_t chunk) {
  const tiling::MlpActivation act = c.arch == Arch::kGpt2                               ? tiling::MlpActivation::kGeluTanh
                                    : c.mlp_activation == ModelConfig::Activation::kSilu ? tiling::MlpActivation::kSilu
                                    : c.mlp_activation == ModelConfig::Activation::kGelu ? tiling::MlpActivation::kGelu
                                                                                          : tiling::MlpActivation::kGeluTanh;
  return chunk > 0 ? tiling::chunked_mlp(n, w, act, chunk) : tiling::plain_mlp(n, w, act);
}

class LlamaEmbedding final : public Stage {
 public:
  explicit LlamaEmbedding(const ModelConfig& c) : gemma_(c.gemma), hidden_(c.hidden) {
    wte = add("model.embed_tokens.weight", {c.vocab_size, c.hidden});
  }
  at::Tensor forward(const at::Tensor& ids) override {
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
  LlamaBlock(const ModelConfig& c, int64_t i) : c_(c) {
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
    post_norm = add(p + "post_attention_layernorm.weight", {d});
    wg = add(p + "mlp.gate_proj.weight", {f, d});
    wu = add(p + "mlp.up_proj.weight", {f, d});
    wd = add(p + "mlp.down_proj.weight", {d, f});
    if (c.mlp_bias) {
      bg = add(p + "mlp.gate_proj.bias", {f});
      bu = add(p + "mlp.up_proj.bias", {f});
      bd = add(p + "mlp.down_proj.bias", {d});
    }
    add_adapters(c, i);
  }

  at::Tensor forward(const at::Tensor& x) override {
    c_.check_sequence_length(x.size(1));
    at::Tensor h = rms_norm(x, in_norm, c_.norm_eps, c_.gemma);
    at::Tensor q = split_heads(adapted(h, wq, bq, "self_attn.q_proj"), c_.heads, c_.head_dim);
    at::Tensor k = split_heads(adapted(h, wk, bk, "self_attn.k_proj"), c_.kv_heads, c_.head_dim);
    at::Tensor v = split_heads(adapted(h, wv, bv, "self_attn.v_proj"), c_.kv_heads, c_.head_dim);
    at::Tensor a = llama_attention(c_, q, k, v, inv_freq_);
    at::Tensor r = x + adapted(merge_heads(a), wo, bo, "self_attn.o_proj");
    h = rms_norm(r, post_norm, c_.norm_eps, c_.gemma);
    return r + mlp(c_, h,
                   {wu, bu, wg, bg, wd, bd, adapter("mlp.up_proj"), adapter("mlp.gate_proj"), adapter("mlp.down_proj")},
                   mlp_chunk_);
  }

 private:
  ModelConfig c_;
  at::Tensor in_norm, wq, wk, wv, wo, bq, bk, bv, bo, post_norm, wg, wu, wd, bg, bu, bd;
};

class LlamaHead final : public HeadStage {
 public:
  LlamaHead(const ModelConfig& c, const at::Tensor& tied) : c_(c), w_(tied) {
    norm = add("model.norm.weight", {c.hidden});
    w_ = lm_head_weight(c, tied);
  }
  at::Tensor normed(const at::Tensor& x) override { return rms_norm(x, norm, c_.norm_eps, c_.gemma); }
  const at::Tensor& lm_weight() const override { return w_; }

 private:
  ModelConfig c_;
  at::Tensor w_, norm;
};

// ---------------------------------------------------------------- block tiles
// A block's attention cut into groups of key/value heads, its MLP into slices of the
// intermediate dimension (LayerTiles). A tile's input is the block's input (its first tile) or
// the previous tile's output stacked [2, ...]: the normed input and the running sum. It adds its
// contribution to the sum and passes both on, the last tile only the sum. The first tile of each
// holds the norm and the output projection's bias, so every parameter has one owner.
class Tile : public Stage {
 protected:
  Tile(const ModelConfig& c, int64_t index, int64_t count) : c_(c), first_(index == 0), last_(index + 1 == count) {}
  // (normed input, running sum) from the tile's input. unbind, not two selects: its backward
  // stacks the two gradients in one pass, where each select's would fill a zero tensor of the
  // stacked size, copy its half in, and the two would then be added (five kernels and about ten
  // activation passes more at every tile boundary of the backward).
  std::pair<at::Tensor, at::Tensor> split_input(const at::Tensor& z) {
    if (!first_) {
      const std::vector<at::Tensor> parts = z.unbind(0);
      return {parts[0], parts[1]};
    }
    return {norm(z), z};
  }
  at::Tensor join(const at::Tensor& normed, const at::Tensor& sum) const {
    return last_ ? sum : at::stack({normed, sum});
  }
  at::Tensor norm(const at::Tensor& x) const {
    if (c_.arch == Arch::kGpt2) return at::layer_norm(x, {c_.hidden}, norm_w, norm_b, c_.norm_eps);
    return rms_norm(x, norm_w, c_.norm_eps, c_.gemma);
  }
  void add_norm(const std::string& name) {
    norm_w = add(name + ".weight", {c_.hidden});
    if (c_.arch == Arch::kGpt2) norm_b = add(name + ".bias", {c_.hidden});
  }
  ModelConfig c_;
  bool first_, last_;
  at::Tensor norm_w, norm_b;
};

// LoRA: the attention's adapters are whole tensors of the first tile; each tile takes its rows of
// the q/k/v adapters' B and its columns of the output projection's A (Stage::adapter_part), so the
// tiles' outputs and their sum are the adapted block's.
class AttentionTile final : public Tile {
  at::Tensor inv_freq_;

 public:
  // `first`: the block's first attention tile (null for it).
  AttentionTile(const ModelConfig& c, int64_t block, int64_t index, int64_t count, const Stage* first)
      : Tile(c, index, count) {
    const int64_t d = c.hidden, hd = c.head_dim, rep = c.heads / c.kv_heads;
    const Range kv = tile_range(c.kv_heads, count, index);
    kv_heads_ = kv.size();
    const int64_t k0 = kv.begin * hd, k1 = kv.end * hd, q0 = k0 * rep, q1 = k1 * rep;
    k0_ = k0, k1_ = k1, q0_ = q0, q1_ = q1;
    add_base(c, block, d, k0, k1, q0, q1);
    if (first) share_adapters(*first);
    else add_adapters(c, block, BlockPart::kAttention);
  }

  at::Tensor forward(const at::Tensor& z) override {
    auto [n, sum] = split_input(z);
    c_.check_sequence_length(n.size(1));
    const int64_t hd = c_.head_dim, rep = c_.heads / c_.kv_heads, d = c_.hidden;
    const bool gpt2 = c_.arch == Arch::kGpt2;
    // GPT-2's fused c_attn: q, k and v are rows [0, d), [d, 2d) and [2d, 3d) of its output.
    const auto rows = [&](const std::string& module, int64_t offset, int64_t b, int64_t e) {
      return adapter_part(module, 0, offset + b, offset + e);
    };
    const std::string qm = gpt2 ? "attn.c_attn" : "self_attn.q_proj", km = gpt2 ? qm : "self_attn.k_proj",
                      vm = gpt2 ? qm : "self_attn.v_proj", om = gpt2 ? "attn.c_proj" : "self_attn.o_proj";
    at::Tensor q = split_heads(adapted(n, wq, bq, rows(qm, 0, q0_, q1_)), kv_heads_ * rep, hd);
    at::Tensor k = split_heads(adapted(n, wk, bk, gpt2 ? rows(km, d, q0_, q1_) : rows(km, 0, k0_, k1_)), kv_heads_, hd);
    at::Tensor v = split_heads(adapted(n, wv, bv, gpt2 ? rows(vm, 2 * d, q0_, q1_) : rows(vm, 0, k0_, k1_)), kv_heads_, hd);
    at::Tensor a = gpt2 ? at::scaled_dot_product_attention(q, k, v, {}, 0.0, /*is_causal=*/true)
                        : llama_attention(c_, q, k, v, inv_freq_);
    return join(n, sum + adapted(merge_heads(a), wo, bo, adapter_part(om, 1, q0_, q1_)));
  }

 private:
  void add_base(const ModelConfig& c, int64_t block, int64_t d, int64_t k0, int64_t k1, int64_t q0, int64_t q1) {
    if (c.arch == Arch::kGpt2) {
      const std::string p = "transformer.h." + std::to_string(block) + ".";
      if (first_) add_norm(p + "ln_1");
      const std::string w = p + "attn.c_attn.weight", b = p + "attn.c_attn.bias";
      wq = add_part(w, {3 * d, d}, 0, q0, q1);
      wk = add_part(w, {3 * d, d}, 0, d + q0, d + q1);
      wv = add_part(w, {3 * d, d}, 0, 2 * d + q0, 2 * d + q1);
      bq = add_part(b, {3 * d}, 0, q0, q1);
      bk = add_part(b, {3 * d}, 0, d + q0, d + q1);
      bv = add_part(b, {3 * d}, 0, 2 * d + q0, 2 * d + q1);
      wo = add_part(p + "attn.c_proj.weight", {d, d}, 1, q0, q1);
      if (first_) bo = add(p + "attn.c_proj.bias", {d});
      return;
    }
    const std::string p = "model.layers." + std::to_string(block) + ".";
    const int64_t q = c.heads * c.head_dim, kvd = c.kv_heads * c.head_dim;
    if (first_) add_norm(p + "input_layernorm");
    wq = add_part(p + "self_attn.q_proj.weight", {q, d}, 0, q0, q1);
    wk = add_part(p + "self_attn.k_proj.weight", {kvd, d}, 0, k0, k1);
    wv = add_part(p + "self_attn.v_proj.weight", {kvd, d}, 0, k0, k1);
    wo = add_part(p + "self_attn.o_proj.weight", {d, q}, 1, q0, q1);
    if (c.attention_bias) {
      bq = add_part(p + "self_attn.q_proj.bias", {q}, 0, q0, q1);
      bk = add_part(p + "self_attn.k_proj.bias", {kvd}, 0, k0, k1);
      bv = add_part(p + "self_attn.v_proj.bias", {kvd}, 0, k0, k1);
    }
    if (first_ && c.attention_out_bias) bo = add(p + "self_attn.o_proj.bias", {d});
  }

  int64_t kv_heads_ = 0, k0_ = 0, k1_ = 0, q0_ = 0, q1_ = 0;
  at::Tensor wq, wk, wv, wo, bq, bk, bv, bo;
};

// LoRA: the MLP's adapters are whole tensors of the first tile; each tile takes its rows of the
// up/gate adapters' B and its columns of the down projection's A.
class MlpTile final : public Tile {
 public:
  // `first`: the block's first MLP tile (null for it).
  MlpTile(const ModelConfig& c, int64_t block, int64_t index, int64_t count, const Stage* first)
      : Tile(c, index, count), features_(tile_range(c.intermediate, count, index)) {
    add_base(c, block);
    if (first) share_adapters(*first);
    else add_adapters(c, block, BlockPart::kMlp);
  }

  at::Tensor forward(const at::Tensor& z) override {
    auto [n, sum] = split_input(z);
    const bool gpt2 = c_.arch == Arch::kGpt2;
    const int64_t b = features_.begin, e = features_.end;
    const tiling::LowRank up = adapter_part(gpt2 ? "mlp.c_fc" : "mlp.up_proj", 0, b, e),
                          gate = gpt2 ? tiling::LowRank{} : adapter_part("mlp.gate_proj", 0, b, e),
                          down = adapter_part(gpt2 ? "mlp.c_proj" : "mlp.down_proj", 1, b, e);
    return join(n, sum + mlp(c_, n, {wu, bu, wg, bg, wd, bd, up, gate, down}, mlp_chunk_));
  }

 private:
  void add_base(const ModelConfig& c, int64_t block) {
    const int64_t d = c.hidden, f = c.intermediate;
    const Range r = features_;
    if (c.arch == Arch::kGpt2) {
      const std::string p = "transformer.h." + std::to_string(block) + ".";
      if (first_) add_norm(p + "ln_2");
      wu = add_part(p + "mlp.c_fc.weight", {f, d}, 0, r.begin, r.end);
      bu = add_part(p + "mlp.c_fc.bias", {f}, 0, r.begin, r.end);
      wd = add_part(p + "mlp.c_proj.weight", {d, f}, 1, r.begin, r.end);
      if (first_) bd = add(p + "mlp.c_proj.bias", {d});
      return;
    }
    const std::string p = "model.layers." + std::to_string(block) + ".";
    if (first_) add_norm(p + "post_attention_layernorm");
    wg = add_part(p + "mlp.gate_proj.weight", {f, d}, 0, r.begin, r.end);
    wu = add_part(p + "mlp.up_proj.weight", {f, d}, 0, r.begin, r.end);
    wd = add_part(p + "mlp.down_proj.weight", {d, f}, 1, r.begin, r.end);
    if (c.mlp_bias) {
      bg = add_part(p + "mlp.gate_proj.bias", {f}, 0, r.begin, r.end);
      bu = add_part(p + "mlp.up_proj.bias", {f}, 0, r.begin, r.end);
      if (first_) bd = add(p + "mlp.down_proj.bias", {d});
    }
  }

  Range features_;
  at::Tensor wg, wu, wd, bg, bu, bd;
};

// ---------------------------------------------------------------- vocabulary tiles
// The embedding cut into row ranges (LayerTiles::vocab): a tile's forward is the lookup of the
// token ids in its rows and zero for the others, so that the tiles' sum is the whole lookup
// exactly (every token gets its row from one tile and zeros from the rest); the first tile also
// adds GPT-2's positions.
class EmbeddingTile final : public Stage {
 public:
  EmbeddingTile(const ModelConfig& c, int64_t index, int64_t count) : c_(c) {
    const Range r = tile_range(c.vocab_size, count, index);
    begin_ = r.begin;
    end_ = r.end;
    const bool gpt2 = c.arch == Arch::kGpt2;
    wte = add_part(gpt2 ? "transformer.wte.weight" : "model.embed_tokens.weight", {c.vocab_size, c.hidden}, 0, r.begin,
                   r.end);
    if (gpt2 && index == 0) wpe = add("transformer.wpe.weight", {c.max_positions, c.hidden});
  }
  at::Tensor forward(const at::Tensor& ids) override {
    const at::Tensor here = ids.ge(begin_).logical_and(ids.lt(end_));
    at::Tensor h = at::where(here.unsqueeze(-1), at::embedding(wte, (ids - begin_).clamp(0, end_ - begin_ - 1)), 0.0);
    if (c_.gemma) h = h * at::scalar_tensor(std::sqrt(double(c_.hidden)), h.options()).to(h.scalar_type());
    if (wpe.defined()) {
      const int64_t t = ids.size(1);
      TORCH_CHECK(t <= wpe.size(0), "sequence of ", t, " tokens exceeds n_positions ", wpe.size(0));
      h = h + wpe.narrow(0, 0, t).unsqueeze(0);
    }
    return h;
  }
  at::Tensor wte, wpe;

 private:
  ModelConfig c_;
  int64_t begin_ = 0, end_ = 0;
};

// The LM head cut into row ranges: the first tile holds the final norm; a tied tile uses its
// embedding tile's rows.
class HeadTile final : public HeadStage {
 public:
  HeadTile(const ModelConfig& c, int64_t index, int64_t count, const at::Tensor& tied_rows) : c_(c) {
    const Range r = tile_range(c.vocab_size, count, index);
    begin_ = r.begin;
    if (index == 0) {
      const std::string n = c.arch == Arch::kGpt2 ? "transformer.ln_f" : "model.norm";
      norm_w = add(n + ".weight", {c.hidden});
      if (c.arch == Arch::kGpt2) norm_b = add(n + ".bias", {c.hidden});
    }
    w_ = c.tie_embeddings ? register_parameter("tied_embedding", tied_rows)
                          : add_part("lm_head.weight", {c.vocab_size, c.hidden}, 0, r.begin, r.end);
  }
  at::Tensor normed(const at::Tensor& x) override {
    if (!norm_w.defined()) throw std::logic_error("HeadTile: only the first head tile holds the final norm");
    if (c_.arch == Arch::kGpt2) return at::layer_norm(x, {c_.hidden}, norm_w, norm_b, c_.norm_eps);
    return rms_norm(x, norm_w, c_.norm_eps, c_.gemma);
  }
  const at::Tensor& lm_weight() const override { return w_; }
  int64_t vocab_begin() const override { return begin_; }
  bool has_norm() const override { return norm_w.defined(); }

 private:
  ModelConfig c_;
  int64_t begin_ = 0;
  at::Tensor w_, norm_w, norm_b;
};

std::shared_ptr<Stage> make_block(const ModelConfig& c, int64_t i) {
  if (c.arch == Arch::kGpt2) return std::make_shared<Gpt2Block>(c, i);
  return std::make_shared<LlamaBlock>(c, i);
}

std::shared_ptr<Stage> make_embedding(const ModelConfig& c) {
  if (c.arch == Arch::kGpt2) return std::make_shared<Gpt2Embedding>(c);
  return std::make_shared<LlamaEmbedding>(c);
}

// The token embedding's weight (or a tile's rows): every embedding stage's first tensor.
at::Tensor token_weight(const Stage& e) { return e.hf_parameters().at(0).second; }

// The head over `tied` (the embedding's token weight, or its rows for a tile).
std::shared_ptr<HeadStage> make_head(const ModelConfig& c, const at::Tensor& tied) {
  if (c.arch == Arch::kGpt2) return std::make_shared<Gpt2Head>(c, tied);
  return std::make_shared<LlamaHead>(c, tied);
}

bool is_norm_weight(const std::string& n) {
  return n.find("ln_") != std::string::npos || n.find("norm") != std::string::npos;
}

}  // namespace

at::Tensor HeadStage::forward(const at::Tensor& x) { return dense(normed(x), lm_weight()); }

std::string TensorPart::name() const {
  if (whole()) return tensor;
  return tensor + (dim == 0 ? "[" : "[:,") + std::to_string(begin) + ":" + std::to_string(end) + "]";
}

at::Tensor Stage::add(const std::string& hf_name, std::vector<int64_t> shape) {
  parts_.push_back({hf_name, shape, 0, 0, shape.empty() ? 0 : shape[0]});
  at::Tensor t = register_parameter(module_name(hf_name), at::empty(shape, at::kFloat));
  params_.emplace_back(hf_name, t);
  return t;
}

at::Tensor Stage::add_part(const std::string& hf_name, std::vector<int64_t> whole, int64_t dim, int64_t begin,
                           int64_t end) {
  TensorPart part{hf_name, whole, dim, begin, end};
  std::vector<int64_t> shape = whole;
  shape[size_t(dim)] = end - begin;
  const std::string name = part.name();
  parts_.push_back(std::move(part));
  at::Tensor t = register_parameter(module_name(name), at::empty(shape, at::kFloat));
  params_.emplace_back(name, t);
  return t;
}

at::Tensor Stage::lm_head_weight(const ModelConfig& c, const at::Tensor& tied_embedding) {
  if (!c.tie_embeddings) return add("lm_head.weight", {c.vocab_size, c.hidden});
  return register_parameter("tied_embedding", tied_embedding);
}

std::vector<std::pair<std::string, at::Tensor>> Stage::hf_parameters() const { return params_; }

void Stage::add_adapters(const ModelConfig& c, int64_t block, BlockPart part) {
  const std::string prefix = block_prefix(c, block);
  for (const AdapterShape& a : block_adapters(c, block, part)) {
    tiling::LowRank l;
    l.a = add(adapter_a_name(a.module), {c.lora.r, a.in});
    l.b = add(adapter_b_name(a.module), {a.out, c.lora.r});
    l.scaling = c.lora.scaling();
    adapters_[a.module.substr(prefix.size())] = l;
  }
}

tiling::LowRank Stage::adapter(const std::string& module) const {
  const auto it = adapters_.find(module);
  return it == adapters_.end() ? tiling::LowRank{} : it->second;
}

at::Tensor Stage::adapted(const at::Tensor& x, const at::Tensor& w, const at::Tensor& b, const std::string& module) const {
  return adapted(x, w, b, adapter(module));
}

at::Tensor Stage::adapted(const at::Tensor& x, const at::Tensor& w, const at::Tensor& b, const tiling::LowRank& l) {
  at::Tensor y = dense(x, w, b);
  if (!l.defined()) return y;
  return y + at::linear(at::linear(x, l.a), l.b) * l.scaling;
}

void Stage::share_adapters(const Stage& first) {
  for (const auto& [module, l] : first.adapters_) {
    tiling::LowRank mine = l;
    mine.a = register_parameter("shared_" + module_name(module) + "_lora_A", l.a);
    mine.b = register_parameter("shared_" + module_name(module) + "_lora_B", l.b);
    adapters_[module] = mine;
  }
}

tiling::LowRank Stage::adapter_part(const std::string& module, int64_t dim, int64_t begin, int64_t end) const {
  tiling::LowRank l = adapter(module);
  if (!l.defined()) return l;
  if (dim == 0) l.b = l.b.narrow(0, begin, end - begin);
  else l.a = l.a.narrow(1, begin, end - begin);
  return l;
}

Decoder::Decoder(const ModelConfig& config, uint64_t seed, Init init) : config_(config) {
  config_.validate();
  embeds_ = {make_embedding(config_)};
  heads_ = {make_head(config_, token_weight(*embeds_[0]))};
  for (int64_t i = 0; i < config_.layers; ++i) blocks_.push_back({make_block(config_, i)});
  init_gen_ = at::make_generator<at::CPUGeneratorImpl>(seed);
  adapter_gen_ = at::make_generator<at::CPUGeneratorImpl>(seed ^ 0x9e3779b97f4a7c15ull);
  if (init == Init::kNow) initialize_through(stages().size() - 1);
}

Stage& Decoder::embedding() {
  if (tiles_.vocab != 1) throw std::logic_error("Decoder::embedding: the vocabulary is tiled (read stages())");
  return *embeds_.at(0);
}

HeadStage& Decoder::head() {
  if (tiles_.vocab != 1) throw std::logic_error("Decoder::head: the vocabulary is tiled (head_tile())");
  return *heads_.at(0);
}

Stage& Decoder::block(size_t i) {
  if (!tiles_.blocks_whole()) throw std::logic_error("Decoder::block: the blocks are tiled (read stages())");
  return *blocks_.at(i).at(0);
}

std::vector<std::shared_ptr<Stage>> Decoder::make_tiles(int64_t block) const {
  std::vector<std::shared_ptr<Stage>> tiles;
  for (int64_t a = 0; a < tiles_.attention; ++a)
    tiles.push_back(std::make_shared<AttentionTile>(config_, block, a, tiles_.attention, a ? tiles[0].get() : nullptr));
  const size_t first_mlp = tiles.size();
  for (int64_t m = 0; m < tiles_.mlp; ++m)
    tiles.push_back(std::make_shared<MlpTile>(config_, block, m, tiles_.mlp, m ? tiles[first_mlp].get() : nullptr));
  return tiles;
}

void Decoder::recut(std::vector<Stage*> old, const std::vector<Stage*>& next, bool holds) {
  at::NoGradGuard no_grad;
  // The new stages' tensors take the old ones' dtype and device (a model already converted).
  const at::TensorOptions opts = old.at(0)->hf_parameters().at(0).second.options();
  if (opts.dtype() != at::kFloat || !opts.device().is_cpu())
    for (Stage* st : next)
      for (auto& [name, t] : st->hf_parameters()) t.set_data(at::empty(t.sizes(), opts));
  if (!holds) return;
  std::map<std::string, at::Tensor> whole;  // the group's tensors, assembled from their parts
  for (Stage* st : old)
    for (size_t k = 0; k < st->parts().size(); ++k) {
      const TensorPart& p = st->parts()[k];
      at::Tensor& w = whole[p.tensor];
      if (!w.defined()) w = at::empty(p.shape, at::kFloat);
      w.narrow(p.dim, p.begin, p.end - p.begin).copy_(st->hf_parameters()[k].second);
    }
  for (Stage* st : next)
    for (size_t k = 0; k < st->parts().size(); ++k) {
      const TensorPart& p = st->parts()[k];
      st->hf_parameters()[k].second.copy_(whole.at(p.tensor).narrow(p.dim, p.begin, p.end - p.begin));
    }
}

void Decoder::set_tiles(const LayerTiles& tiling) {
  check_tiles(config_, tiling);
  if (tiling == tiles_) return;
  const LayerTiles was = tiles_;
  tiles_ = tiling;
  if (tiles_.vocab != was.vocab) {
    const auto raw = [](const auto& v) {
      std::vector<Stage*> out;
      for (const auto& st : v) out.push_back(st.get());
      return out;
    };
    std::vector<std::shared_ptr<Stage>> embeds;
    std::vector<std::shared_ptr<HeadStage>> heads;
    if (tiles_.vocab == 1) {
      embeds = {make_embedding(config_)};
      heads = {make_head(config_, token_weight(*embeds[0]))};
    } else {
      for (int64_t j = 0; j < tiles_.vocab; ++j) embeds.push_back(std::make_shared<EmbeddingTile>(config_, j, tiles_.vocab));
      for (int64_t j = 0; j < tiles_.vocab; ++j)
        heads.push_back(std::make_shared<HeadTile>(config_, j, tiles_.vocab, token_weight(*embeds[size_t(j)])));
    }
    // The embedding first: a tied head's tiles use its new tensors, converted there.
    recut(raw(embeds_), raw(embeds), initialized_ > 0);
    embeds_ = std::move(embeds);
    recut(raw(heads_), raw(heads), initialized_ > blocks_.size() + 1);
    heads_ = std::move(heads);
  }
  if (tiles_.attention == was.attention && tiles_.mlp == was.mlp) return;
  for (size_t i = 0; i < blocks_.size(); ++i) {
    std::vector<std::shared_ptr<Stage>> next =
        tiles_.blocks_whole() ? std::vector<std::shared_ptr<Stage>>{make_block(config_, int64_t(i))}
                               : make_tiles(int64_t(i));
    std::vector<Stage*> old, fresh;
    for (auto& st : blocks_[i]) old.push_back(st.get());
    for (auto& st : next) fresh.push_back(st.get());
    recut(old, fresh, 1 + i < initialized_);
    for (auto& st : next) st->set_mlp_token_chunk(mlp_chunk_);
    blocks_[i] = std::move(next);
  }
}

uint64_t Decoder::block_graph_bytes_per_token(size_t e) const { return models::block_graph_bytes_per_token(config_, e); }

size_t Decoder::group_of(size_t stage) const {
  if (stage < embeds_.size()) return 0;
  size_t s = embeds_.size();
  for (size_t i = 0; i < blocks_.size(); ++i) {
    if (stage < s + blocks_[i].size()) return 1 + i;
    s += blocks_[i].size();
  }
  if (stage < s + heads_.size()) return blocks_.size() + 1;
  throw std::out_of_range("Decoder: no stage " + std::to_string(stage));
}

std::vector<Stage*> Decoder::group(size_t g) const {
  std::vector<Stage*> members;
  if (g == 0)
    for (auto& st : embeds_) members.push_back(st.get());
  else if (g == blocks_.size() + 1)
    for (auto& st : heads_) members.push_back(st.get());
  else
    for (auto& st : blocks_.at(g - 1)) members.push_back(st.get());
  return members;
}

std::string Decoder::stage_name(size_t stage) const { return models::stage_name(config_, tiles_, stage); }

// Initial values: the source's where it holds the tensor; else a 1-D tensor a constant by its
// name, any other normal(0, 0.02) from the one stream; each whole in the untiled block's order
// and then cut into the parts that hold it, so that every tiling starts from the same weights.
void Decoder::initialize_group(size_t g) {
  const std::vector<Stage*> members = group(g);
  std::vector<std::pair<std::string, std::vector<int64_t>>> order;  // whole tensors, untiled order
  if (members.size() > 1) {
    // The untiled stage lists them (its untouched pages take no memory).
    const std::shared_ptr<Stage> untiled =
        g == 0 ? make_embedding(config_)
        : g == blocks_.size() + 1
            ? make_head(config_, at::empty({config_.vocab_size, config_.hidden}, at::kFloat))
            : make_block(config_, int64_t(g - 1));
    for (const TensorPart& p : untiled->parts()) order.emplace_back(p.tensor, p.shape);
  } else {
    for (const TensorPart& p : members[0]->parts()) order.emplace_back(p.tensor, p.shape);
  }
  for (const auto& [name, shape] : order) {
    at::Tensor whole;  // the member holding the tensor whole, if any
    for (Stage* st : members)
      for (size_t k = 0; k < st->parts().size(); ++k)
        if (st->parts()[k].tensor == name && st->parts()[k].whole()) whole = st->hf_parameters()[k].second;
    // A tensor held in parts is loaded or drawn whole, then cut.
    at::Tensor drawn;
    bool loaded = false;
    if (source_) {
      drawn = whole.defined() ? whole : at::empty(shape, at::kFloat);
      loaded = source_(name, drawn);
    }
    if (!loaded && shape.size() != 1) {
      if (!drawn.defined()) drawn = whole.defined() ? whole : at::empty(shape, at::kFloat);
      // LoRA as PEFT initializes it: A as nn.Linear's default (kaiming_uniform_ with a = sqrt(5):
      // uniform within 1 / sqrt(in)), B zero, so that the adapted model starts as the base.
      if (name.ends_with(".lora_A.weight")) drawn.uniform_(-1.0 / std::sqrt(double(shape[1])), 1.0 / std::sqrt(double(shape[1])), adapter_gen_);
      else if (name.ends_with(".lora_B.weight")) drawn.zero_();
      else drawn.normal_(0.0, 0.02, init_gen_);
    }
    for (Stage* st : members)
      for (size_t k = 0; k < st->parts().size(); ++k) {
        const TensorPart& p = st->parts()[k];
        if (p.tensor != name) continue;
        at::Tensor t = st->hf_parameters()[k].second;
        const bool filled = loaded || shape.size() != 1;
        if (p.whole() && filled) continue;  // loaded or drawn in place
        if (filled) t.copy_(drawn.narrow(p.dim, p.begin, p.end - p.begin));
        else if (is_norm_weight(name) && name.ends_with("weight")) t.fill_(config_.gemma ? 0.0 : 1.0);  // Gemma: (1 + weight)
        else t.zero_();
      }
  }
}

void Decoder::initialize_through(size_t stage) {
  const size_t last = group_of(stage);
  at::NoGradGuard no_grad;
  for (; initialized_ <= last; ++initialized_) initialize_group(initialized_);
  if (initialized_ == blocks_.size() + 2) source_ = nullptr;  // every group done: its files unmapped
}

void Decoder::set_mlp_token_chunk(int64_t tokens) {
  if (tokens < 0) throw std::invalid_argument("Decoder: the MLP's token chunk must be >= 0, not " + std::to_string(tokens));
  mlp_chunk_ = tokens;
  for (auto& b : blocks_)
    for (auto& st : b) st->set_mlp_token_chunk(tokens);
}

std::vector<Stage*> Decoder::stages() {
  std::vector<Stage*> s;
  for (auto& st : embeds_) s.push_back(st.get());
  for (auto& b : blocks_)
    for (auto& st : b) s.push_back(st.get());
  for (auto& st : heads_) s.push_back(st.get());
  return s;
}

at::Tensor Decoder::forward(const at::Tensor& ids) {
  at::Tensor h = embeds_[0]->forward(ids);
  for (size_t j = 1; j < embeds_.size(); ++j) h = h + embeds_[j]->forward(ids);
  for (auto& b : blocks_)
    for (auto& st : b) h = st->forward(h);
  if (heads_.size() == 1) return heads_[0]->forward(h);
  const at::Tensor n = heads_[0]->normed(h);
  std::vector<at::Tensor> logits;
  for (auto& t : heads_) logits.push_back(at::linear(n, t->lm_weight()));
  return at::cat(logits, -1);
}

std::vector<std::pair<std::string, at::Tensor>> Decoder::hf_parameters() {
  if (!tiles_.blocks_whole() || tiles_.vocab != 1)
    throw std::logic_error("Decoder::hf_parameters: the model is tiled and holds no whole tensor of what is tiled (read "
                           "stages()' parts())");
  std::vector<std::pair<std::string, at::Tensor>> out;
  for (Stage* s : stages()) {
    for (auto& p : s->hf_parameters()) out.push_back(p);
  }
  return out;
}

void Decoder::to(at::ScalarType dtype) {
  at::NoGradGuard no_grad;
  for (Stage* s : stages())
    for (auto& [name, t] : s->hf_parameters()) t.set_data(t.to(dtype));
}

}  // namespace strata::models
