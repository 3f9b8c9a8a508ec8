#include "strata/models/decoder.h"
#include "strata/models/model_shapes.h"

#include <ATen/CPUGeneratorImpl.h>

#include <cmath>

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
  }
  at::Tensor forward(const at::Tensor& x) override {
    const int64_t d = c_.hidden;
    at::Tensor h = at::layer_norm(x, {d}, ln1_w, ln1_b, c_.norm_eps);
    auto qkv = dense(h, attn_w, attn_b).split(d, -1);
    at::Tensor q = split_heads(qkv[0], c_.heads, c_.head_dim);
    at::Tensor k = split_heads(qkv[1], c_.heads, c_.head_dim);
    at::Tensor v = split_heads(qkv[2], c_.heads, c_.head_dim);
    at::Tensor a = at::scaled_dot_product_attention(q, k, v, {}, 0.0, /*is_causal=*/true);
    at::Tensor r = x + dense(merge_heads(a), proj_w, proj_b);
    h = at::layer_norm(r, {d}, ln2_w, ln2_b, c_.norm_eps);
    h = at::gelu(dense(h, fc_w, fc_b), "tanh");  // gelu_new
    return r + dense(h, mproj_w, mproj_b);
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
  }

  at::Tensor forward(const at::Tensor& x) override {
    const int64_t t = x.size(1);
    c_.check_sequence_length(t);
    at::Tensor h = rms_norm(x, in_norm, c_.norm_eps, c_.gemma);
    at::Tensor q = split_heads(dense(h, wq, bq), c_.heads, c_.head_dim);
    at::Tensor k = split_heads(dense(h, wk, bk), c_.kv_heads, c_.head_dim);
    at::Tensor v = split_heads(dense(h, wv, bv), c_.kv_heads, c_.head_dim);
    // Rotary embeddings as transformers computes them (fp32 angles, cat(freqs, freqs)).
    // inv_freq on the CPU as transformers computes it, copied to the input's device once: a
    // copy from pageable memory to a GPU blocks the host until the GPU catches up, which on
    // every block's forward and recompute would keep the host from running ahead.
    if (!inv_freq_.defined() || inv_freq_.device() != x.device()) inv_freq_ = rope_inv_freq(c_).to(x.device());
    const at::Tensor& inv_freq = inv_freq_;
    const at::Tensor pos = at::arange(t, at::TensorOptions().dtype(at::kLong).device(x.device())).to(at::kFloat);
    const at::Tensor freqs = at::outer(pos, inv_freq);
    const at::Tensor emb = at::cat({freqs, freqs}, -1);
    const at::Tensor cos = emb.cos().to(x.scalar_type()), sin = emb.sin().to(x.scalar_type());
    q = q * cos + rotate_half(q) * sin;
    k = k * cos + rotate_half(k) * sin;
    const int64_t rep = c_.heads / c_.kv_heads;
    if (rep > 1) {
      k = k.repeat_interleave(rep, 1);
      v = v.repeat_interleave(rep, 1);
    }
    at::Tensor a = at::scaled_dot_product_attention(q, k, v, {}, 0.0, /*is_causal=*/true);
    at::Tensor r = x + dense(merge_heads(a), wo, bo);
    h = rms_norm(r, post_norm, c_.norm_eps, c_.gemma);
    const at::Tensor gate = dense(h, wg, bg);
    const at::Tensor act = c_.mlp_activation == ModelConfig::Activation::kSilu ? at::silu(gate)
                           : at::gelu(gate, c_.mlp_activation == ModelConfig::Activation::kGelu ? "none" : "tanh");
    return r + dense(act * dense(h, wu, bu), wd, bd);
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

bool is_norm_weight(const std::string& n) {
  return n.find("ln_") != std::string::npos || n.find("norm") != std::string::npos;
}

}  // namespace

at::Tensor HeadStage::forward(const at::Tensor& x) { return dense(normed(x), lm_weight()); }

at::Tensor Stage::add(const std::string& hf_name, std::vector<int64_t> shape) {
  at::Tensor t = register_parameter(module_name(hf_name), at::empty(shape, at::kFloat));
  params_.emplace_back(hf_name, t);
  return t;
}

at::Tensor Stage::lm_head_weight(const ModelConfig& c, const at::Tensor& tied_embedding) {
  if (!c.tie_embeddings) return add("lm_head.weight", {c.vocab_size, c.hidden});
  return register_parameter("tied_embedding", tied_embedding);
}

std::vector<std::pair<std::string, at::Tensor>> Stage::hf_parameters() const { return params_; }

Decoder::Decoder(const ModelConfig& config, uint64_t seed, Init init) : config_(config) {
  config_.validate();
  if (config_.arch == Arch::kGpt2) {
    auto e = std::make_shared<Gpt2Embedding>(config_);
    embed_ = e;
    for (int64_t i = 0; i < config_.layers; ++i) blocks_.push_back(std::make_shared<Gpt2Block>(config_, i));
    head_ = std::make_shared<Gpt2Head>(config_, e->wte);
  } else {
    auto e = std::make_shared<LlamaEmbedding>(config_);
    embed_ = e;
    for (int64_t i = 0; i < config_.layers; ++i) blocks_.push_back(std::make_shared<LlamaBlock>(config_, i));
    head_ = std::make_shared<LlamaHead>(config_, e->wte);
  }
  init_gen_ = at::make_generator<at::CPUGeneratorImpl>(seed);
  if (init == Init::kNow) initialize_through(blocks_.size() + 1);
}

uint64_t Decoder::block_graph_bytes_per_token(size_t e) const { return models::block_graph_bytes_per_token(config_, e); }

void Decoder::initialize_through(size_t stage) {
  const std::vector<Stage*> all = stages();
  if (stage >= all.size()) throw std::out_of_range("Decoder::initialize_through: no stage " + std::to_string(stage));
  at::NoGradGuard no_grad;
  for (; initialized_ <= stage; ++initialized_) {
    for (auto& [name, t] : all[initialized_]->hf_parameters()) {
      if (t.dim() == 1) {
        if (is_norm_weight(name) && name.ends_with("weight")) {
          t.fill_(config_.gemma ? 0.0 : 1.0);  // Gemma's norms scale by (1 + weight)
        } else {
          t.zero_();
        }
      } else {
        t.normal_(0.0, 0.02, init_gen_);
      }
    }
  }
}

std::vector<Stage*> Decoder::stages() {
  std::vector<Stage*> s{embed_.get()};
  for (auto& b : blocks_) s.push_back(b.get());
  s.push_back(head_.get());
  return s;
}

at::Tensor Decoder::forward(const at::Tensor& ids) {
  at::Tensor h = embed_->forward(ids);
  for (auto& b : blocks_) h = b->forward(h);
  return head_->forward(h);
}

std::vector<std::pair<std::string, at::Tensor>> Decoder::hf_parameters() {
  std::vector<std::pair<std::string, at::Tensor>> out;
  for (Stage* s : stages()) {
    for (auto& p : s->hf_parameters()) out.push_back(p);
  }
  return out;
}

void Decoder::to(at::ScalarType dtype) {
  at::NoGradGuard no_grad;
  for (auto& [name, t] : hf_parameters()) t.set_data(t.to(dtype));
}

}  // namespace strata::models
