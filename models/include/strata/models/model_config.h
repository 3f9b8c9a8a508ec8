// Decoder-only transformer configurations: parsed from a Hugging Face config.json (GPT-2 and the
// Llama family) or named presets for planning and benchmarks without weights.
#pragma once

#include <cstdint>
#include <filesystem>
#include <string>
#include <vector>

#include "strata/models/quantized_base.h"

namespace strata::models {

enum class Arch { kGpt2, kLlama };

struct ModelConfig {
  Arch arch = Arch::kGpt2;
  std::string name;         // preset name or the config's model_type
  int64_t vocab_size = 0;
  int64_t hidden = 0;       // d_model
  int64_t layers = 0;
  int64_t heads = 0;
  int64_t kv_heads = 0;     // == heads without grouped-query attention
  int64_t head_dim = 0;     // hidden / heads unless the config says otherwise
  int64_t intermediate = 0; // MLP width
  int64_t max_positions = 0;
  double norm_eps = 1e-5;
  double rope_theta = 10000.0;  // Llama only
  bool tie_embeddings = true;
  // Llama-family variants (model_type llama, mistral, qwen2, gemma), each as transformers
  // defines it; `hf_type` is the model_type written back on export.
  std::string hf_type = "llama";
  bool attention_bias = false;      // q/k/v biases (Llama's attention_bias; always for Qwen2)
  bool attention_out_bias = false;  // o_proj bias (Llama's attention_bias; never for Qwen2)
  bool mlp_bias = false;
  // Sliding-window attention (Mistral, Qwen2 with use_sliding_window): a token of a sliding layer
  // sees itself and the sliding_window - 1 tokens before it (transformers: key > query - window).
  // 0: none. `sliding_layers` says which layers slide, as config.json's layer_types (Qwen2: from
  // max_window_layers on); empty: all of them.
  int64_t sliding_window = 0;
  std::vector<bool> sliding_layers;
  // The attention window of block `layer`: sliding_window for a sliding layer, else 0 (none).
  int64_t attention_window(int64_t layer) const;
  // Gemma (and Gemma 2): embeddings scaled by sqrt(hidden) and RMSNorm weights applied as (1 + w).
  bool gemma = false;
  // Qwen3: each query and key head RMS-normed over head_dim (self_attn.q_norm, k_norm) before
  // the rotation.
  bool qk_norm = false;
  // Gemma 2: the attention's output normed before the residual add (post_attention_layernorm),
  // the MLP's input by pre_feedforward_layernorm and its output by post_feedforward_layernorm.
  bool sandwich_norms = false;
  // Gemma 2: attention scores scaled by query_pre_attn_scalar^-1/2 (0: head_dim^-1/2) and capped
  // to attn_softcap * tanh(s / attn_softcap); logits capped alike by final_softcap. 0: none.
  double query_pre_attn_scalar = 0, attn_softcap = 0, final_softcap = 0;
  // The gated MLP's activation (Llama family): SiLU, or for Gemma GELU as its hidden_act names
  // it (the tanh approximation, or exact).
  enum class Activation { kSilu, kGeluTanh, kGelu };
  Activation mlp_activation = Activation::kSilu;
  // Llama 3 frequency-dependent RoPE scaling (rope_type "llama3"); off when factor == 0.
  struct Llama3Rope {
    double factor = 0, low_freq_factor = 1, high_freq_factor = 4;
    int64_t original_max_positions = 8192;
  } llama3_rope;

  // Mixture of experts (model_type mixtral, qwen3_moe), as transformers computes it: a sparse
  // block's MLP is `experts` gated MLPs of `intermediate` features each; a router (a bias-free
  // linear layer over the MLP's normed input, softmax in fp32) picks the top_k experts of every
  // token, whose outputs are summed weighted by their probabilities (renormalized to sum 1 when
  // norm_topk: always for Mixtral, Qwen3-MoE's norm_topk_prob). A dense block keeps the MLP of
  // ModelConfig::intermediate features (Qwen3-MoE's mlp_only_layers and decoder_sparse_step).
  struct Moe {
    int64_t experts = 0;       // 0: no experts (a dense model)
    int64_t top_k = 0;         // num_experts_per_tok
    int64_t intermediate = 0;  // each expert's (Mixtral's intermediate_size, Qwen3-MoE's moe_intermediate_size)
    bool norm_topk = true;
    std::vector<bool> dense_layers;  // by layer: true where the block's MLP is dense; empty: none is
    // The load-balancing loss (transformers' load_balancing_loss_func over the sparse blocks'
    // routers) is added to the loss times aux_loss_coef when add_aux_loss (config.json's
    // router_aux_loss_coef, output_router_logits).
    double aux_loss_coef = 0.001;
    bool add_aux_loss = false;
    bool enabled() const { return experts > 0; }
  } moe;
  // Whether block `layer`'s MLP is a mixture of experts; whether any block's is dense (always
  // for a dense model).
  bool sparse(int64_t layer) const;
  bool has_dense_blocks() const;

  // LoRA adapters (model.lora, or model.adapter_from's adapter_config.json) as PEFT defines them:
  // each linear layer y = W x + b of a block whose module name target_modules selects also adds
  // scaling() * B (A x), with A [r, in] and B [out, r] trainable and the rest frozen. No dropout.
  struct Lora {
    int64_t r = 0;                             // rank; 0: no adapters
    double alpha = 8;                          // lora_alpha
    bool rslora = false;                       // use_rslora: alpha / sqrt(r), else alpha / r
    std::vector<std::string> target_modules;   // as PEFT matches a list; {"all-linear"}: every block linear
    std::vector<std::string> modules_to_save;  // modules trained whole beside the adapters
    // PEFT's target_parameters: a sparse block's fused expert tensors ("mlp.experts.gate_up_proj",
    // "mlp.experts.down_proj" as transformers 5 names them), each expert adapted by its own A and B.
    std::vector<std::string> target_parameters;
    bool enabled() const { return r > 0; }
    double scaling() const;
    // Whether the block linear `module` ("model.layers.0.self_attn.q_proj") gets an adapter: it
    // is a target, or ends with "." and a target (PEFT's rule for a list), or "all-linear".
    bool targets(const std::string& module) const;
    // Whether the parameter `key` ("model.layers.0.mlp.experts.gate_up_proj") gets an adapter:
    // PEFT's rule for target_parameters (the key is an entry or ends with "." and one).
    bool targets_parameter(const std::string& key) const;
  } lora;

  // A 4-bit frozen base (model.quantize: bitsandbytes' BitsAndBytesConfig; quantized_base.h).
  QuantizedBase quantize;

  // The config.json's special token ids (bos_token_id, eos_token_id: an id or a list,
  // pad_token_id), as a JSON object's text, written back on export unchanged ("" : none).
  std::string hf_special_tokens;

  // Parameter count (embeddings, blocks, head; tied weights counted once).
  int64_t parameters() const;
  // Block `layer`'s parameters; without a layer the largest block's (a sparse one where any is).
  int64_t block_parameters(int64_t layer) const;
  int64_t block_parameters() const;
  // The parameters one token's forward uses: a sparse block counts top_k of its experts (and its
  // router); the rest as parameters(). Equal to parameters() for a dense model.
  int64_t active_parameters() const;
  // Throws std::invalid_argument with the offending field if inconsistent.
  void validate() const;
  // The config.json that transformers reads back for this model; `dtype` is the weights' dtype
  // as transformers names it ("float32", "bfloat16", "float16").
  std::string to_hf_json(const std::string& dtype = "float32") const;
};

// Throws std::invalid_argument naming the file and key for unsupported or missing settings
// (model types other than gpt2, llama, mistral, qwen2, qwen3, gemma, gemma2, mixtral, qwen3_moe;
// other mixtures of experts such as deepseek_v3 and gpt_oss are named as not supported yet;
// RoPE scaling other than Llama 3's; activations other than GPT-2's gelu_new, silu, and Gemma's
// GELU-tanh; Mixtral's router_jitter_noise).
ModelConfig load_hf_config(const std::filesystem::path& config_json);
ModelConfig parse_hf_config(const std::string& json_text, const std::string& source);

// gpt2, gpt2-medium, gpt2-large, gpt2-xl, llama-1b, llama-8b, llama-70b, gpt3-1.3b, gpt3-2.7b,
// gpt3-6.7b, gpt3-13b, gpt3-175b, gpt-1t, the benchmark shapes gpt-1.4b (24 x 2048) and
// gpt-2.8b (32 x 2560), and the mixtures of experts mixtral-8x7b, mixtral-8x22b, qwen3-30b-a3b,
// qwen3-235b-a22b and kimi-k2-shaped (Kimi K2's sizes with standard attention and no shared
// expert: docs/PLANNER.md). Throws std::invalid_argument listing the names if unknown.
ModelConfig preset(const std::string& name);
std::vector<std::string> preset_names();

}  // namespace strata::models
