// LoRA's rules over a model's block linears: which get adapters and what they are named
// (model_shapes.h), and which tensors modules_to_save trains whole (PEFT's rule).
#include <algorithm>
#include <set>
#include <stdexcept>
#include <string>
#include <string_view>

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
    for (const AdapterShape& a : block_adapters(c, i)) n += c.lora.r * (a.in + a.out);
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
  return out;
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
