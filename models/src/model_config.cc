#include "strata/models/model_config.h"

#include <algorithm>
#include <cmath>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <sstream>
#include <stdexcept>

namespace strata::models {

namespace {

using nlohmann::json;

std::invalid_argument bad(const std::string& source, const std::string& what) {
  return std::invalid_argument(source + ": " + what);
}

template <class T>
T need(const json& j, const char* key, const std::string& source) {
  if (!j.contains(key) || j[key].is_null()) throw bad(source, std::string("missing \"") + key + "\"");
  try {
    return j[key].get<T>();
  } catch (const json::exception&) {
    throw bad(source, std::string("\"") + key + "\" has the wrong type");
  }
}

template <class T>
T get_or(const json& j, const char* key, T fallback) {
  if (!j.contains(key) || j[key].is_null()) return fallback;
  try {
    return j[key].get<T>();
  } catch (const json::exception&) {
    throw std::invalid_argument(std::string("config: \"") + key + "\" has the wrong type");
  }
}

// The experts of a mixtral or qwen3_moe config.json (ModelConfig::Moe).
void parse_experts(const json& j, const std::string& source, ModelConfig& c) {
  const bool mixtral = c.hf_type == "mixtral";
  // Qwen3-MoE names its count num_experts; transformers 5 writes it back as num_local_experts.
  c.moe.experts = need<int64_t>(j, mixtral || !j.contains("num_experts") ? "num_local_experts" : "num_experts", source);
  if (c.moe.experts <= 0) throw bad(source, "the number of experts must be positive");
  c.moe.top_k = need<int64_t>(j, "num_experts_per_tok", source);
  if (c.moe.top_k < 1 || c.moe.top_k > c.moe.experts)
    throw bad(source, "num_experts_per_tok " + std::to_string(c.moe.top_k) + " must be between 1 and the " +
                          std::to_string(c.moe.experts) + " experts");
  c.moe.intermediate = mixtral ? c.intermediate : need<int64_t>(j, "moe_intermediate_size", source);
  c.moe.norm_topk = mixtral || get_or<bool>(j, "norm_topk_prob", false);
  c.moe.aux_loss_coef = get_or<double>(j, "router_aux_loss_coef", 0.001);
  c.moe.add_aux_loss = get_or<bool>(j, "output_router_logits", false);
  if (get_or<double>(j, "router_jitter_noise", 0.0) != 0)
    throw bad(source, "router_jitter_noise is not supported (Strata's stages are pure functions, recomputed "
                      "bit for bit): set it to 0");
  if (mixtral) return;
  // A Qwen3-MoE layer is dense when listed in mlp_only_layers or off every decoder_sparse_step-th.
  const int64_t step = get_or<int64_t>(j, "decoder_sparse_step", 1);
  if (step < 1) throw bad(source, "decoder_sparse_step must be at least 1");
  std::vector<int64_t> only;
  if (j.contains("mlp_only_layers") && !j["mlp_only_layers"].is_null()) only = need<std::vector<int64_t>>(j, "mlp_only_layers", source);
  for (int64_t i : only)
    if (i < 0 || i >= c.layers) throw bad(source, "mlp_only_layers names layer " + std::to_string(i) + " of " + std::to_string(c.layers));
  std::vector<bool> dense;
  for (int64_t i = 0; i < c.layers; ++i)
    dense.push_back(std::find(only.begin(), only.end(), i) != only.end() || (i + 1) % step != 0);
  if (std::find(dense.begin(), dense.end(), true) != dense.end()) c.moe.dense_layers = dense;
}

}  // namespace

bool ModelConfig::sparse(int64_t layer) const {
  return moe.enabled() && (moe.dense_layers.empty() || !moe.dense_layers.at(size_t(layer)));
}

bool ModelConfig::has_dense_blocks() const {
  for (int64_t i = 0; i < layers; ++i)
    if (!sparse(i)) return true;
  return false;
}

int64_t ModelConfig::block_parameters(int64_t layer) const {
  const int64_t d = hidden, q = heads * head_dim, kv = kv_heads * head_dim, f = intermediate;
  if (arch == Arch::kGpt2) {
    return 2 * 2 * d                    // ln_1, ln_2
           + d * 3 * q + 3 * q          // c_attn
           + q * d + d                  // attn c_proj
           + d * f + f + f * d + d;     // mlp
  }
  const int64_t mlp = sparse(layer) ? moe.experts * (d + 3 * d * moe.intermediate)  // router rows, experts
                                    : 3 * d * f + (mlp_bias ? 2 * f + d : 0);       // gate, up, down
  return (sandwich_norms ? 4 : 2) * d                            // RMSNorms
         + (qk_norm ? 2 * head_dim : 0)                          // Qwen3's q_norm, k_norm
         + d * (q + 2 * kv) + (attention_bias ? q + 2 * kv : 0)  // q, k, v
         + q * d + (attention_out_bias ? d : 0)                   // o
         + mlp;
}

int64_t ModelConfig::block_parameters() const {
  int64_t most = 0;
  for (int64_t i = 0; i < layers; ++i) most = std::max(most, block_parameters(i));
  return most;
}

double ModelConfig::Lora::scaling() const {
  return rslora ? alpha / std::sqrt(double(r)) : alpha / double(r);
}

bool ModelConfig::Lora::targets(const std::string& module) const {
  if (!enabled()) return false;
  for (const std::string& t : target_modules)
    if (t == "all-linear" || module == t ||
        (module.size() > t.size() && module.compare(module.size() - t.size(), t.size(), t) == 0 &&
         module[module.size() - t.size() - 1] == '.'))
      return true;
  return false;
}

bool ModelConfig::Lora::targets_parameter(const std::string& key) const {
  if (!enabled()) return false;
  for (const std::string& t : target_parameters)
    if (key == t || (key.size() > t.size() && key.ends_with(t) && key[key.size() - t.size() - 1] == '.')) return true;
  return false;
}

int64_t ModelConfig::parameters() const {
  int64_t n = vocab_size * hidden;
  for (int64_t i = 0; i < layers; ++i) n += block_parameters(i);
  n += arch == Arch::kGpt2 ? max_positions * hidden + 2 * hidden : hidden;  // wpe + ln_f / norm
  if (!tie_embeddings) n += vocab_size * hidden;
  return n;
}

int64_t ModelConfig::active_parameters() const {
  int64_t n = parameters();
  for (int64_t i = 0; i < layers; ++i)
    if (sparse(i)) n -= (moe.experts - moe.top_k) * 3 * hidden * moe.intermediate;
  return n;
}

int64_t ModelConfig::attention_window(int64_t layer) const {
  if (sliding_window <= 0) return 0;
  return sliding_layers.empty() || sliding_layers.at(size_t(layer)) ? sliding_window : 0;
}

void ModelConfig::validate() const {
  auto req = [&](bool ok, const std::string& what) {
    if (!ok) throw std::invalid_argument("model config '" + name + "': " + what);
  };
  req(vocab_size > 0, "vocab_size must be positive");
  req(hidden > 0 && layers > 0 && heads > 0, "hidden, layers and heads must be positive");
  req(kv_heads > 0 && heads % kv_heads == 0, "heads must be a multiple of kv_heads");
  req(head_dim > 0, "head_dim must be positive");
  req(arch != Arch::kLlama || head_dim % 2 == 0, "head_dim must be even for rotary embeddings");
  req(arch == Arch::kLlama || head_dim * heads == hidden, "GPT-2 needs heads * head_dim == hidden");
  req(intermediate > 0 && max_positions > 0, "intermediate and max_positions must be positive");
  req(arch == Arch::kGpt2 || hf_type == "llama" || hf_type == "mistral" || hf_type == "qwen2" || hf_type == "qwen3" ||
          hf_type == "gemma" || hf_type == "gemma2" || hf_type == "mixtral" || hf_type == "qwen3_moe",
      "model type '" + hf_type + "' is not one of llama, mistral, qwen2, qwen3, gemma, gemma2, mixtral, qwen3_moe");
  if (moe.enabled() || hf_type == "mixtral" || hf_type == "qwen3_moe") {
    req(arch == Arch::kLlama && (hf_type == "mixtral" || hf_type == "qwen3_moe"),
        "experts exist only for model types mixtral and qwen3_moe");
    req(moe.experts > 0 && moe.intermediate > 0, "a mixture of experts needs experts and their intermediate size");
    req(moe.top_k >= 1 && moe.top_k <= moe.experts,
        "num_experts_per_tok " + std::to_string(moe.top_k) + " must be between 1 and the " +
            std::to_string(moe.experts) + " experts");
    req(moe.dense_layers.empty() || int64_t(moe.dense_layers.size()) == layers, "dense_layers must name every layer");
    req(!mlp_bias, "experts have no biases");
    req(hf_type != "mixtral" || moe.intermediate == intermediate, "mixtral's experts are intermediate_size wide");
  }
  req(query_pre_attn_scalar >= 0 && attn_softcap >= 0 && final_softcap >= 0,
      "query_pre_attn_scalar and the soft caps must be >= 0");
  req(sliding_window >= 0, "sliding_window must be >= 0");
  req(sliding_layers.empty() || int64_t(sliding_layers.size()) == layers, "layer_types must name every layer");
  req(arch == Arch::kGpt2 || gemma || mlp_activation == Activation::kSilu, "only gemma's MLP uses GELU");
  // config.json's attention_bias means q/k/v and o biases together, except for Qwen2.
  req(arch == Arch::kGpt2 || hf_type == "qwen2" || attention_bias == attention_out_bias,
      "q/k/v biases without an o_proj bias (or the reverse) exist only for qwen2");
  req(hf_type != "qwen2" || (attention_bias && !attention_out_bias), "qwen2 has q/k/v biases and no o_proj bias");
}

ModelConfig parse_hf_config(const std::string& text, const std::string& source) {
  json j;
  try {
    j = json::parse(text);
  } catch (const json::exception& e) {
    throw bad(source, std::string("not valid JSON: ") + e.what());
  }
  const std::string type = need<std::string>(j, "model_type", source);
  // A checkpoint saved already quantized: bitsandbytes' 4-bit weights are read (their settings by
  // the training configuration, engine/src/config_quantize.cc; the tensors by
  // quant4_checkpoint.h); any other quantization is refused here, before a tensor is read.
  if (j.contains("quantization_config") && j["quantization_config"].is_object()) {
    const json& q = j["quantization_config"];
    const std::string method = q.value("quant_method", std::string("unknown method"));
    const bool four = q.value("load_in_4bit", false) || q.value("_load_in_4bit", false);
    if (method != "bitsandbytes" || !four)
      throw bad(source, "quantization_config: a checkpoint saved " +
                            (method == "bitsandbytes" ? std::string("in 8 bits (bitsandbytes)") : "by " + method) +
                            " is not supported; Strata reads bitsandbytes' 4-bit checkpoints (load_in_4bit), or a "
                            "16-bit base quantized at load by model.quantize");
  }
  ModelConfig c;
  c.name = type;
  if (type == "gpt2") {
    c.arch = Arch::kGpt2;
    c.vocab_size = need<int64_t>(j, "vocab_size", source);
    c.hidden = need<int64_t>(j, "n_embd", source);
    c.layers = need<int64_t>(j, "n_layer", source);
    c.heads = c.kv_heads = need<int64_t>(j, "n_head", source);
    if (c.heads <= 0) throw bad(source, "n_head must be positive");
    c.head_dim = c.hidden / c.heads;
    c.intermediate = get_or<int64_t>(j, "n_inner", 4 * c.hidden);
    c.max_positions = need<int64_t>(j, "n_positions", source);
    c.norm_eps = get_or<double>(j, "layer_norm_epsilon", 1e-5);
    c.tie_embeddings = get_or<bool>(j, "tie_word_embeddings", true);
    const std::string act = get_or<std::string>(j, "activation_function", "gelu_new");
    if (act != "gelu_new") throw bad(source, "activation_function '" + act + "' is not supported (gelu_new only)");
    if (get_or<bool>(j, "scale_attn_by_inverse_layer_idx", false) ||
        get_or<bool>(j, "reorder_and_upcast_attn", false)) {
      throw bad(source, "scale_attn_by_inverse_layer_idx / reorder_and_upcast_attn are not supported");
    }
  } else if (type == "llama" || type == "mistral" || type == "qwen2" || type == "qwen3" || type == "gemma" ||
             type == "gemma2" || type == "mixtral" || type == "qwen3_moe") {
    c.arch = Arch::kLlama;
    c.hf_type = type;
    c.gemma = type == "gemma" || type == "gemma2";
    c.qk_norm = type == "qwen3" || type == "qwen3_moe";
    c.sandwich_norms = type == "gemma2";
    c.vocab_size = need<int64_t>(j, "vocab_size", source);
    c.hidden = need<int64_t>(j, "hidden_size", source);
    c.layers = need<int64_t>(j, "num_hidden_layers", source);
    c.heads = need<int64_t>(j, "num_attention_heads", source);
    if (c.heads <= 0) throw bad(source, "num_attention_heads must be positive");
    c.kv_heads = get_or<int64_t>(j, "num_key_value_heads", c.heads);
    // transformers' defaults: Qwen3's head_dim 128, Gemma 2's 256, the others hidden / heads.
    c.head_dim = get_or<int64_t>(j, "head_dim", type == "qwen3" ? 128 : type == "gemma2" ? 256 : c.hidden / c.heads);
    c.intermediate = need<int64_t>(j, "intermediate_size", source);
    c.max_positions = get_or<int64_t>(j, "max_position_embeddings", 2048);
    c.norm_eps = get_or<double>(j, "rms_norm_eps", 1e-6);
    c.rope_theta = get_or<double>(j, "rope_theta", 10000.0);
    // transformers < 5 writes "rope_scaling" (null when unused), >= 5 "rope_parameters".
    for (const char* key : {"rope_scaling", "rope_parameters"}) {
      if (!j.contains(key) || !j[key].is_object()) continue;
      const json& rp = j[key];
      c.rope_theta = get_or<double>(rp, "rope_theta", c.rope_theta);
      const std::string rt = get_or<std::string>(rp, "rope_type", get_or<std::string>(rp, "type", "default"));
      if (rt == "llama3") {
        c.llama3_rope.factor = need<double>(rp, "factor", source + " " + key);
        c.llama3_rope.low_freq_factor = need<double>(rp, "low_freq_factor", source + " " + key);
        c.llama3_rope.high_freq_factor = need<double>(rp, "high_freq_factor", source + " " + key);
        c.llama3_rope.original_max_positions =
            need<int64_t>(rp, "original_max_position_embeddings", source + " " + key);
      } else if (rt != "default") {
        throw bad(source, std::string(key) + ": rope_type '" + rt + "' is not supported (default, llama3)");
      }
    }
    // Gemma ties its head by default; the others do not.
    c.tie_embeddings = get_or<bool>(j, "tie_word_embeddings", c.gemma);
    if (type == "qwen2") {  // q/k/v projections with biases, o_proj without (transformers' Qwen2)
      c.attention_bias = true;
      c.attention_out_bias = false;
    } else {
      c.attention_bias = c.attention_out_bias = get_or<bool>(j, "attention_bias", false);
    }
    c.mlp_bias = get_or<bool>(j, "mlp_bias", false);
    if (c.gemma) {  // transformers 5 applies Gemma's hidden_act, Gemma 2's hidden_activation
      const std::string act = get_or<std::string>(j, type == "gemma2" ? "hidden_activation" : "hidden_act", "gelu_pytorch_tanh");
      if (act == "gelu_pytorch_tanh" || act == "gelu_new")
        c.mlp_activation = ModelConfig::Activation::kGeluTanh;
      else if (act == "gelu")
        c.mlp_activation = ModelConfig::Activation::kGelu;
      else
        throw bad(source, "hidden_act '" + act + "' is not supported for gemma (gelu_pytorch_tanh, gelu)");
    } else {
      const std::string act = get_or<std::string>(j, "hidden_act", "silu");
      if (act != "silu") throw bad(source, "hidden_act '" + act + "' is not supported (silu only)");
    }
    // Mistral's window is 4096 when the key is absent (transformers' MistralConfig default) and
    // none when it is null; Qwen2's applies only with use_sliding_window, from layer
    // max_window_layers on, unless layer_types names the sliding layers.
    // Gemma 2's window (4096 by default) is on alternate layers, from layer 0, unless layer_types
    // says otherwise.
    // Mixtral's window is none when absent; Qwen3-MoE's, with use_sliding_window, is on every layer.
    if (type == "mistral" || type == "gemma2")
      c.sliding_window = !j.contains("sliding_window") ? 4096 : get_or<int64_t>(j, "sliding_window", 0);
    else if (type == "mixtral")
      c.sliding_window = get_or<int64_t>(j, "sliding_window", 0);
    else if ((type == "qwen2" || type == "qwen3" || type == "qwen3_moe") && get_or<bool>(j, "use_sliding_window", false))
      c.sliding_window = get_or<int64_t>(j, "sliding_window", 0);
    if (type == "mixtral" || type == "qwen3_moe") parse_experts(j, source, c);
    if (type == "gemma2") {
      c.query_pre_attn_scalar = get_or<double>(j, "query_pre_attn_scalar", 256);
      // null: no cap
      c.attn_softcap = !j.contains("attn_logit_softcapping") ? 50.0 : get_or<double>(j, "attn_logit_softcapping", 0);
      c.final_softcap = !j.contains("final_logit_softcapping") ? 30.0 : get_or<double>(j, "final_logit_softcapping", 0);
    }
    if (type == "mixtral" || type == "qwen3_moe") {
      // every layer slides (transformers' Mixtral and Qwen3-MoE have no layer_types)
    } else if (c.sliding_window > 0 && j.contains("layer_types") && j["layer_types"].is_array()) {
      for (const json& t : j["layer_types"]) {
        const std::string name = t.is_string() ? t.get<std::string>() : "";
        if (name != "sliding_attention" && name != "full_attention")
          throw bad(source, "layer_types: '" + t.dump() + "' is not supported (sliding_attention, full_attention)");
        c.sliding_layers.push_back(name == "sliding_attention");
      }
    } else if (c.sliding_window > 0 && type == "gemma2") {
      for (int64_t i = 0; i < c.layers; ++i) c.sliding_layers.push_back(i % 2 == 0);
    } else if (c.sliding_window > 0 && (type == "qwen2" || type == "qwen3")) {
      const int64_t from = get_or<int64_t>(j, "max_window_layers", 28);
      for (int64_t i = 0; i < c.layers; ++i) c.sliding_layers.push_back(i >= from);
    }
    if (c.sliding_window < 0) throw bad(source, "sliding_window must be >= 0");
  } else if (type == "deepseek_v2" || type == "deepseek_v3" || type == "kimi_k2") {
    throw bad(source, "model_type '" + type + "' (DeepSeek-V3's architecture: multi-head latent attention, shared "
                      "experts, sigmoid routing with a bias) is not supported yet; the mixtures of experts Strata "
                      "trains are mixtral and qwen3_moe");
  } else if (type == "gpt_oss" || type.find("moe") != std::string::npos) {
    throw bad(source, "model_type '" + type + "' is a mixture of experts Strata does not support yet (mixtral and "
                      "qwen3_moe are)");
  } else {
    throw bad(source, "model_type '" + type +
                          "' is not supported (gpt2, llama, mistral, qwen2, qwen3, gemma, gemma2, mixtral, qwen3_moe)");
  }
  json special = json::object();
  for (const char* key : {"bos_token_id", "eos_token_id", "pad_token_id"})
    if (j.contains(key) && !j[key].is_null()) special[key] = j[key];
  if (!special.empty()) c.hf_special_tokens = special.dump();
  c.validate();
  return c;
}

ModelConfig load_hf_config(const std::filesystem::path& path) {
  std::ifstream in(path);
  if (!in) throw std::invalid_argument(path.string() + ": cannot open");
  std::stringstream ss;
  ss << in.rdbuf();
  return parse_hf_config(ss.str(), path.string());
}

std::string ModelConfig::to_hf_json(const std::string& dtype) const {
  json j;
  if (arch == Arch::kGpt2) {
    j = {{"model_type", "gpt2"}, {"architectures", {"GPT2LMHeadModel"}},
         {"vocab_size", vocab_size}, {"n_embd", hidden}, {"n_layer", layers}, {"n_head", heads},
         {"n_inner", intermediate}, {"n_positions", max_positions},
         {"layer_norm_epsilon", norm_eps}, {"activation_function", "gelu_new"},
         {"tie_word_embeddings", tie_embeddings}, {"resid_pdrop", 0.0}, {"embd_pdrop", 0.0},
         {"attn_pdrop", 0.0}};
  } else {
    static const std::map<std::string, std::string> architecture = {
        {"llama", "LlamaForCausalLM"}, {"mistral", "MistralForCausalLM"}, {"qwen2", "Qwen2ForCausalLM"},
        {"qwen3", "Qwen3ForCausalLM"}, {"gemma", "GemmaForCausalLM"}, {"gemma2", "Gemma2ForCausalLM"},
        {"mixtral", "MixtralForCausalLM"}, {"qwen3_moe", "Qwen3MoeForCausalLM"}};
    j = {{"model_type", hf_type}, {"architectures", {architecture.at(hf_type)}},
         {"vocab_size", vocab_size}, {"hidden_size", hidden}, {"num_hidden_layers", layers},
         {"num_attention_heads", heads}, {"num_key_value_heads", kv_heads},
         {"head_dim", head_dim}, {"intermediate_size", intermediate},
         {"max_position_embeddings", max_positions}, {"rms_norm_eps", norm_eps},
         {"rope_theta", rope_theta}, {"tie_word_embeddings", tie_embeddings},
         {"mlp_bias", mlp_bias}};
    if (hf_type == "qwen2" || hf_type == "qwen3" || hf_type == "qwen3_moe") {
      if (hf_type != "qwen2") j["attention_bias"] = attention_bias;
      j["use_sliding_window"] = sliding_window > 0;
      if (sliding_window > 0) j["sliding_window"] = sliding_window;
      if (sliding_window > 0 && hf_type != "qwen3_moe") {
        int64_t from = 0;  // older transformers read max_window_layers: the first sliding layer
        while (from < layers && attention_window(from) == 0) ++from;
        j["max_window_layers"] = from;
      }
    } else {
      j["attention_bias"] = attention_bias;
    }
    if (hf_type == "mistral" || hf_type == "gemma2" || hf_type == "mixtral")
      j["sliding_window"] = sliding_window > 0 ? json(sliding_window) : json(nullptr);
    if (moe.enabled()) {
      j["num_experts_per_tok"] = moe.top_k;
      j["router_aux_loss_coef"] = moe.aux_loss_coef;
      j["output_router_logits"] = moe.add_aux_loss;
      if (hf_type == "mixtral") {
        j["num_local_experts"] = moe.experts;
        j["router_jitter_noise"] = 0.0;
      } else {
        j["num_experts"] = moe.experts;
        j["moe_intermediate_size"] = moe.intermediate;
        j["norm_topk_prob"] = moe.norm_topk;
        j["decoder_sparse_step"] = 1;
        json dense = json::array();
        for (int64_t i = 0; i < layers; ++i)
          if (!sparse(i)) dense.push_back(i);
        j["mlp_only_layers"] = dense;
      }
    }
    if (hf_type == "gemma2") {
      // transformers' config checks it is an int (it is one in every released Gemma 2)
      j["query_pre_attn_scalar"] = std::floor(query_pre_attn_scalar) == query_pre_attn_scalar
                                       ? json(int64_t(query_pre_attn_scalar)) : json(query_pre_attn_scalar);
      j["attn_logit_softcapping"] = attn_softcap > 0 ? json(attn_softcap) : json(nullptr);
      j["final_logit_softcapping"] = final_softcap > 0 ? json(final_softcap) : json(nullptr);
    }
    if (sliding_window > 0 && !sliding_layers.empty()) {
      json types = json::array();
      for (int64_t i = 0; i < layers; ++i) types.push_back(attention_window(i) > 0 ? "sliding_attention" : "full_attention");
      j["layer_types"] = types;
    }
    j[hf_type == "gemma2" ? "hidden_activation" : "hidden_act"] = mlp_activation == Activation::kSilu ? "silu"
                                                                  : mlp_activation == Activation::kGelu ? "gelu"
                                                                                                         : "gelu_pytorch_tanh";
    if (llama3_rope.factor != 0) {
      j["rope_scaling"] = {{"rope_type", "llama3"}, {"rope_theta", rope_theta},
                           {"factor", llama3_rope.factor},
                           {"low_freq_factor", llama3_rope.low_freq_factor},
                           {"high_freq_factor", llama3_rope.high_freq_factor},
                           {"original_max_position_embeddings", llama3_rope.original_max_positions}};
    }
  }
  if (!hf_special_tokens.empty()) j.update(json::parse(hf_special_tokens));
  j["dtype"] = dtype;
  return j.dump(2);
}

}  // namespace strata::models
