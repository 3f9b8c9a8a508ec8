// Named model shapes for planning and benchmarks without weights (model_config.h: preset()).
#include <map>
#include <stdexcept>

#include "strata/models/model_config.h"

namespace strata::models {

namespace {

ModelConfig gpt(const std::string& name, int64_t layers, int64_t hidden, int64_t heads,
                int64_t vocab = 50257, int64_t positions = 2048) {
  ModelConfig c;
  c.arch = Arch::kGpt2;
  c.name = name;
  c.vocab_size = vocab;
  c.hidden = hidden;
  c.layers = layers;
  c.heads = c.kv_heads = heads;
  c.head_dim = hidden / heads;
  c.intermediate = 4 * hidden;
  c.max_positions = positions;
  c.tie_embeddings = true;
  return c;
}

ModelConfig llama(const std::string& name, int64_t layers, int64_t hidden, int64_t heads,
                  int64_t kv_heads, int64_t intermediate, int64_t vocab, bool tied) {
  ModelConfig c;
  c.arch = Arch::kLlama;
  c.name = name;
  c.vocab_size = vocab;
  c.hidden = hidden;
  c.layers = layers;
  c.heads = heads;
  c.kv_heads = kv_heads;
  c.head_dim = hidden / heads;
  c.intermediate = intermediate;
  c.max_positions = 8192;
  c.norm_eps = 1e-5;
  c.rope_theta = 500000.0;
  c.tie_embeddings = tied;
  return c;
}

ModelConfig with_head_dim(ModelConfig c, int64_t head_dim) {
  c.head_dim = head_dim;
  return c;
}

// A mixture of experts on the Llama stages: `experts` of `expert_features` each, top_k a token;
// the blocks before `dense_first` (Kimi K2's first_k_dense_replace) keep a dense MLP.
ModelConfig moe(ModelConfig c, const std::string& type, int64_t experts, int64_t top_k, int64_t expert_features,
                bool norm_topk, int64_t dense_first = 0) {
  c.hf_type = type;
  c.qk_norm = type == "qwen3_moe";
  c.moe.experts = experts;
  c.moe.top_k = top_k;
  c.moe.intermediate = expert_features;
  c.moe.norm_topk = norm_topk;
  if (dense_first > 0)
    for (int64_t i = 0; i < c.layers; ++i) c.moe.dense_layers.push_back(i < dense_first);
  return c;
}

const std::map<std::string, ModelConfig>& presets() {
  static const std::map<std::string, ModelConfig> p = [] {
    std::map<std::string, ModelConfig> m;
    auto add = [&](ModelConfig c) { m.emplace(c.name, c); };
    add(gpt("gpt2", 12, 768, 12, 50257, 1024));
    add(gpt("gpt2-medium", 24, 1024, 16, 50257, 1024));
    add(gpt("gpt2-large", 36, 1280, 20, 50257, 1024));
    add(gpt("gpt2-xl", 48, 1600, 25, 50257, 1024));
    add(gpt("gpt3-1.3b", 24, 2048, 16));
    add(gpt("gpt3-2.7b", 32, 2560, 32));
    add(gpt("gpt3-6.7b", 32, 4096, 32));
    add(gpt("gpt3-13b", 40, 5120, 40));  // the paper lists 5140 x 40 heads of 128; 5120 divides
    add(gpt("gpt3-175b", 96, 12288, 96));
    add(gpt("gpt-1t", 128, 25600, 160));
    add(gpt("gpt-1.4b", 24, 2048, 16));  // the brief's benchmark shapes
    add(gpt("gpt-2.8b", 32, 2560, 20));
    add(llama("llama-1b", 16, 2048, 32, 8, 8192, 128256, true));
    add(llama("llama-8b", 32, 4096, 32, 8, 14336, 128256, false));
    add(llama("llama-70b", 80, 8192, 64, 8, 28672, 128256, false));
    // Mixtures of experts (config.json sizes as published; rope_theta 1e6 for all but Kimi K2).
    add(moe(llama("mixtral-8x7b", 32, 4096, 32, 8, 14336, 32000, false), "mixtral", 8, 2, 14336, true));
    add(moe(llama("mixtral-8x22b", 56, 6144, 48, 8, 16384, 32768, false), "mixtral", 8, 2, 16384, true));
    add(moe(with_head_dim(llama("qwen3-30b-a3b", 48, 2048, 32, 4, 6144, 151936, false), 128), "qwen3_moe", 128, 8, 768,
            true));
    add(moe(with_head_dim(llama("qwen3-235b-a22b", 94, 4096, 64, 4, 12288, 151936, false), 128), "qwen3_moe", 128, 8,
            1536, true));
    // Kimi K2 (1.04T parameters, 32B active): 61 blocks of hidden 7168, the first dense (18432
    // features), the others 384 experts of 2048, 8 a token; its multi-head latent attention as
    // standard attention of 64 heads of 128 over 8 key/value heads, no shared expert.
    // A planning shape: Qwen3-MoE's layout (an expert width of its own, a dense first block)
    // without its q/k norms.
    ModelConfig kimi = moe(with_head_dim(llama("kimi-k2-shaped", 61, 7168, 64, 8, 18432, 163840, false), 128),
                           "qwen3_moe", 384, 8, 2048, true, 1);
    kimi.qk_norm = false;
    add(kimi);
    for (auto& [name, c] : m)
      if (c.moe.enabled() && name != "kimi-k2-shaped") c.rope_theta = 1e6;
    return m;
  }();
  return p;
}

}  // namespace


ModelConfig preset(const std::string& name) {
  auto it = presets().find(name);
  if (it == presets().end()) {
    std::string all;
    for (auto& n : preset_names()) all += (all.empty() ? "" : ", ") + n;
    throw std::invalid_argument("unknown model preset '" + name + "' (known: " + all + ")");
  }
  return it->second;
}

std::vector<std::string> preset_names() {
  std::vector<std::string> out;
  for (auto& [n, c] : presets()) out.push_back(n);
  return out;
}

}  // namespace strata::models
