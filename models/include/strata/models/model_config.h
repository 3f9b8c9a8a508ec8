// Decoder-only transformer configurations: parsed from a Hugging Face config.json (GPT-2 and the
// Llama family) or named presets for planning and benchmarks without weights.
#pragma once

#include <cstdint>
#include <filesystem>
#include <string>
#include <vector>

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
  bool attention_bias = false;  // Llama q/k/v/o biases (Qwen2-style configs set it)
  bool mlp_bias = false;
  // Llama 3 frequency-dependent RoPE scaling (rope_type "llama3"); off when factor == 0.
  struct Llama3Rope {
    double factor = 0, low_freq_factor = 1, high_freq_factor = 4;
    int64_t original_max_positions = 8192;
  } llama3_rope;

  // Parameter count (embeddings, blocks, head; tied weights counted once).
  int64_t parameters() const;
  int64_t block_parameters() const;
  // Throws std::invalid_argument with the offending field if inconsistent.
  void validate() const;
  // The config.json that transformers reads back for this model; `dtype` is the weights' dtype
  // as transformers names it ("float32", "bfloat16", "float16").
  std::string to_hf_json(const std::string& dtype = "float32") const;
};

// Throws std::invalid_argument naming the file and key for unsupported or missing settings
// (RoPE scaling other than Llama 3's, activations other than GPT-2's gelu_new and Llama's silu,
// sliding-window attention).
ModelConfig load_hf_config(const std::filesystem::path& config_json);
ModelConfig parse_hf_config(const std::string& json_text, const std::string& source);

// gpt2, gpt2-medium, gpt2-large, gpt2-xl, llama-1b, llama-8b, llama-70b, gpt3-1.3b, gpt3-2.7b,
// gpt3-6.7b, gpt3-13b, gpt3-175b, gpt-1t, and the benchmark shapes gpt-1.4b (24 x 2048) and
// gpt-2.8b (32 x 2560). Throws std::invalid_argument listing the names if unknown.
ModelConfig preset(const std::string& name);
std::vector<std::string> preset_names();

}  // namespace strata::models
