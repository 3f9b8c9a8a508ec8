// LoRA's rules over a model's block linears: which get adapters and what they are named
// (model_shapes.h), and which tensors modules_to_save trains whole (PEFT's rule).
#include <algorithm>
#include <set>
#include <stdexcept>
#include <string>
#include <string_view>
#include <tuple>

#include "strata/models/model_shapes.h"

namespace strata::models {

std::vector<BlockLinear> block_linears(const ModelConfig& c) {
  const int64_t d = c.hidden, q = c.heads * c.head_dim, kv = c.kv_heads * c.head_dim, f = c.intermediate;
  if (c.arch == Arch::kGpt2)
    return {{"attn.c_attn", d, 3 * q, true}, {"attn.c_proj", q, d, true}, {"mlp.c_fc", d, f}, {"mlp.c_proj", f, d}};
  return {{"self_attn.q_proj", d, q, true}, {"self_attn.k_proj", d, kv, true}, {"self_attn.v_proj", d, kv, true},
          {"self_attn.o_proj", q, d, true}, {"mlp.gate_proj", d, f},           {"mlp.up_proj", d, f},
          {"mlp.down_proj", f, d}};
}

std::string block_prefix(const ModelConfig& c, int64_t i) {
  return (c.arch == Arch::kGpt2 ? "transformer.h." : "model.layers.") + std::to_string(i) + ".";
}

int64_t adapter_parameters(const ModelConfig& c) {
  int64_t n = 0;
  for (int64_t i = 0; i < c.layers; ++i)
    for (const AdapterShape& a : block_adapters(c, i)) n += a.elements(c.lora.r);
  return n;
}

std::vector<AdapterShape> block_adapters(const ModelConfig& c, int64_t i, BlockPart part) {
  std::vector<AdapterShape> out;
  if (!c.lora.enabled()) return out;
  for (const BlockLinear& l : block_linears(c)) {
    if (part != BlockPart::kWhole && l.attention != (part == BlockPart::kAttention)) continue;
    if (!l.attention && c.sparse(i)) continue;  // a sparse block's experts are no linear layers
    const std::string module = block_prefix(c, i) + l.module;
    if (c.lora.targets(module)) out.push_back({module, l.in, l.out, l.attention});
  }
  if (part != BlockPart::kAttention && c.sparse(i)) {  // PEFT's order: gate_up_proj, then down_proj
    const int64_t d = c.hidden, f = c.moe.intermediate;
    for (const auto& [tensor, in, outs] : {std::tuple{kExpertGateUp, d, 2 * f}, std::tuple{kExpertDown, f, d}}) {
      const std::string module = expert_parameter(c, i, tensor);
      if (c.lora.targets_parameter(module)) out.push_back({module, in, outs, false, c.moe.experts});
    }
  }
  return out;
}

std::string expert_parameter(const ModelConfig& c, int64_t i, const char* tensor) {
  return block_prefix(c, i) + "mlp.experts." + tensor;
}

std::optional<AdaptedWeight> adapted_weight(const ModelConfig& c, const std::string& weight) {
  if (!c.lora.enabled() || !weight.ends_with(".weight")) return std::nullopt;
  const std::string blocks = block_prefix(c, 0).substr(0, block_prefix(c, 0).size() - 2);  // "model.layers."
  if (!weight.starts_with(blocks)) return std::nullopt;
  const int64_t i = std::stoll(weight.substr(blocks.size()));
  if (i < 0 || i >= c.layers) return std::nullopt;
  const std::string module = weight.substr(0, weight.size() - std::string(".weight").size());
  if (c.sparse(i) && !c.lora.target_parameters.empty()) {
    const int64_t f = c.moe.intermediate;
    for (int64_t e = 0; e < c.moe.experts; ++e) {
      const ExpertTensors x = expert_tensors(c, i, e);
      if (weight != x.gate && weight != x.up && weight != x.down) continue;
      const std::string fused = expert_parameter(c, i, weight == x.down ? kExpertDown : kExpertGateUp);
      if (!c.lora.targets_parameter(fused)) return std::nullopt;
      if (weight == x.down) return AdaptedWeight{fused, e, 0, c.hidden};
      return AdaptedWeight{fused, e, weight == x.gate ? 0 : f, f};
    }
  }
  for (const AdapterShape& a : block_adapters(c, i))
    if (a.experts == 1 && a.module == module) return AdaptedWeight{module};
  return std::nullopt;
}

int64_t adapted_weight_count(const ModelConfig& c, const std::string& module) {
  if (module.ends_with(std::string(".mlp.experts.") + kExpertGateUp)) return 2 * c.moe.experts;
  if (module.ends_with(std::string(".mlp.experts.") + kExpertDown)) return c.moe.experts;
  return 1;
}

std::string adapter_a_name(const std::string& module) { return module + ".lora_A.weight"; }
std::string adapter_b_name(const std::string& module) { return module + ".lora_B.weight"; }
std::string adapted_module(const std::string& adapter_name) { return adapter_name.substr(0, adapter_name.rfind(".lora_")); }
std::vector<std::string> adapter_patterns() { return {adapter_a_name("*"), adapter_b_name("*")}; }

bool is_adapter_tensor(const std::string& name) {
  return name.ends_with(".lora_A.weight") || name.ends_with(".lora_B.weight");
}

namespace {

// PEFT's rule for modules_to_save: a module (every dotted prefix of the tensor's name) ending
// with the entry.
bool selected_by(const std::string& tensor, const std::string& entry) {
  for (size_t dot = tensor.find('.'); dot != std::string::npos; dot = tensor.find('.', dot + 1))
    if (std::string_view(tensor.data(), dot).ends_with(entry)) return true;
  return false;
}

}  // namespace

bool saved_whole(const ModelConfig& c, const std::string& tensor) {
  if (!c.lora.enabled() || is_adapter_tensor(tensor)) return false;
  for (const std::string& entry : c.lora.modules_to_save)
    if (selected_by(tensor, entry)) return true;
  return false;
}

bool in_adapter_export(const ModelConfig& c, const std::string& tensor) {
  return is_adapter_tensor(tensor) || saved_whole(c, tensor);
}

std::vector<std::string> saved_whole_tensors(const ModelConfig& c) {
  std::set<std::string> adapted;
  for (int64_t i = 0; i < c.layers; ++i)
    for (const AdapterShape& a : block_adapters(c, i)) adapted.insert(a.module);
  const std::vector<std::string> names = tensor_names(c);
  const std::string& token_embedding = names.front();  // the embedding stage's first tensor
  std::vector<std::string> out;
  for (const std::string& entry : c.lora.modules_to_save) {
    bool any = false;
    for (const std::string& name : names) {
      if (is_adapter_tensor(name) || !selected_by(name, entry)) continue;
      any = true;
      const std::string module = name.substr(0, name.rfind('.'));
      if (adapted.count(module))
        throw std::invalid_argument("modules_to_save \"" + entry + "\" selects " + module +
                                    ", which LoRA adapts (target_modules): a module either trains whole or gets an adapter");
      if (c.tie_embeddings && name == token_embedding)
        throw std::invalid_argument("modules_to_save \"" + entry + "\" selects the token embedding, which is tied to "
                                    "the LM head (tie_word_embeddings): not supported");
      if (std::find(out.begin(), out.end(), name) == out.end()) out.push_back(name);
    }
    if (!any)
      throw std::invalid_argument("modules_to_save \"" + entry + "\" selects no module of the model" +
                                  (c.tie_embeddings && std::string("lm_head").ends_with(entry)
                                       ? std::string(" (its LM head is the tied token embedding)")
                                       : std::string()));
  }
  return out;
}

}  // namespace strata::models
