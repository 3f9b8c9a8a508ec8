// PEFT's LoRA adapter directory, the one place that knows its format: adapter_config.json (read
// into ModelConfig::Lora, written back from it) and the keys of adapter_model.safetensors.
// No libtorch here (strata_formats); loading an adapter into a model is hf_io.h's
// peft_adapter_source, merging one into its base weight hf_io.h's merged_weight.
//
// Errors: std::invalid_argument naming the file (or `source`) and the key. Thread safety: pure
// functions.
#pragma once

#include <filesystem>
#include <string>

#include "strata/models/model_config.h"

namespace strata::models {

inline constexpr const char* kAdapterConfigFile = "adapter_config.json";
inline constexpr const char* kAdapterWeightsFile = "adapter_model.safetensors";

// Where LoRA settings are read from. The keys are PEFT's LoraConfig's either way, with one rule
// for what Strata does not compute; a training configuration's model.lora also refuses keys this
// does not read and an init_lora_weights other than true (the adapters start as PEFT starts them).
enum class LoraSettingsFrom { kAdapterConfig, kTrainConfig };
// The LoRA settings in `json_text` (an object), as ModelConfig::Lora. `source` names it in errors
// ("dir/adapter_config.json", or "f.json: model.lora"). Refuses: another peft_type, lora_dropout
// other than 0 (Strata's models have no dropout), use_dora, rank_pattern or alpha_pattern, a
// target_modules regular expression, bias other than "none", layers_to_transform and the other
// per-layer or per-token settings; requires r >= 1 and target_modules.
ModelConfig::Lora parse_lora_settings(const std::string& json_text, const std::string& source, LoraSettingsFrom from);
// parse_lora_settings of the directory `dir`'s adapter_config.json.
ModelConfig::Lora read_peft_adapter_config(const std::filesystem::path& dir);

// The adapter_config.json PEFT writes for `c.lora` on a `c` base (task CAUSAL_LM, GPT-2's
// Conv1D layers fan_in_fan_out), which peft.PeftModel.from_pretrained loads and
// parse_lora_settings reads back as c.lora. `base_model` (base_model_name_or_path) may be "".
std::string peft_adapter_config_json(const ModelConfig& c, const std::string& base_model);

// The adapter_model.safetensors key of tensor `name` of `c` ("model.layers.0.self_attn.q_proj.
// lora_A.weight" -> "base_model.model.model.layers.0..."), as PEFT saves it (adapter name dropped).
// An expert tensor's adapter is keyed by the module holding the tensor, as PEFT's ParamWrapper
// nests: "...mlp.experts.lora_A.weight" for down_proj, and for gate_up_proj the same, or
// "...mlp.experts.base_layer.lora_A.weight" when down_proj's wrapper holds it.
std::string peft_key(const ModelConfig& c, const std::string& name);

}  // namespace strata::models
