// model.lora and model.adapter_from, read for parse_train_config (config_parse.cc): PEFT's LoRA
// settings, given or an adapter directory's, checked against the model, and what trains.
#include <algorithm>
#include <exception>

#include "config_section.h"
#include "strata/engine/config.h"
#include "strata/engine/config_parse.h"
#include "strata/models/model_shapes.h"
#include "strata/models/peft.h"

namespace strata::engine {

using config_json::json;
using config_json::Section;

namespace {

// Every target must adapt some linear layer of a block, every target parameter some sparse
// block's expert tensor; names PEFT would read otherwise in a mixture of experts are refused.
void check_lora_targets(Section& s, const models::ModelConfig& mc);

}  // namespace

// model.lora and model.adapter_from: PEFT's LoRA settings, given or the adapter's; the tensors
// that train follow (engine.trainable: the adapters and modules_to_save).
void read_lora(Section& s, TrainConfig& c) {
  models::ModelConfig& mc = c.model;
  s.read("adapter_from", c.adapter_from);
  if (const json* l = s.get("lora"))
    mc.lora = models::parse_lora_settings(l->dump(), s.source() + ": model.lora", models::LoraSettingsFrom::kTrainConfig);
  if (!c.adapter_from.empty()) {
    models::ModelConfig::Lora from;
    try {
      from = models::read_peft_adapter_config(c.adapter_from);
    } catch (const std::exception& ex) {
      s.fail("adapter_from", ex.what());
    }
    if (!mc.lora.enabled()) {
      mc.lora = from;
    } else {
      auto sorted = [](std::vector<std::string> v) {
        std::sort(v.begin(), v.end());
        return v;
      };
      if (from.r != mc.lora.r || from.alpha != mc.lora.alpha || from.rslora != mc.lora.rslora ||
          sorted(from.target_modules) != sorted(mc.lora.target_modules) ||
          sorted(from.modules_to_save) != sorted(mc.lora.modules_to_save) ||
          sorted(from.target_parameters) != sorted(mc.lora.target_parameters))
        s.fail("lora", "differs from model.adapter_from's adapter_config.json (r, lora_alpha, use_rslora, "
                       "target_modules, modules_to_save, target_parameters): give one of them, or the same");
    }
  }
  if (!mc.lora.enabled()) return;
  check_lora_targets(s, mc);
  // The adapters train, and the modules to save whole (their tensors by name).
  c.engine.trainable = models::adapter_patterns();
  try {
    for (const std::string& t : models::saved_whole_tensors(mc)) c.engine.trainable.push_back(t);
  } catch (const std::invalid_argument& ex) {
    s.fail("lora", ex.what());
  }
}

namespace {

void check_lora_targets(Section& s, const models::ModelConfig& mc) {
  for (const std::string& t : mc.lora.target_modules) {
    bool hit = false;
    models::ModelConfig one = mc;
    one.lora.target_modules = {t};
    one.lora.target_parameters = {};
    for (int64_t i = 0; i < mc.layers && !hit; ++i) hit = !models::block_adapters(one, i).empty();
    if (!hit)
      s.fail("lora", "target_modules \"" + t + "\" names no linear layer of a " + (mc.arch == models::Arch::kGpt2 ? std::string("gpt2") : mc.hf_type) + " block (" +
                         [&] {
                           std::string all;
                           for (const models::BlockLinear& l : models::block_linears(mc))
                             if (l.attention || mc.has_dense_blocks()) all += (all.empty() ? "" : ", ") + l.module;
                           return all;
                         }() + ")" +
                         (mc.moe.enabled() ? "; a sparse block's experts are no linear layers: adapt them with "
                                             "target_parameters (\"mlp.experts.gate_up_proj\", \"mlp.experts.down_proj\")"
                                           : ""));
  }
  // PEFT reads an MLP projection's name in a mixture of experts as transformers 4's per-expert
  // name and adapts the fused experts in its place (rank 2r for gate and up), and "all-linear" the
  // experts and the router: Strata's reading would differ, so both are refused.
  if (mc.moe.enabled())
    for (const std::string& t : mc.lora.target_modules) {
      models::ModelConfig one = mc;
      one.lora.target_modules = {t};
      bool mlp = t == "all-linear";
      for (const models::BlockLinear& l : models::block_linears(mc))
        mlp = mlp || (!l.attention && one.lora.targets(models::block_prefix(mc, 0) + l.module));
      if (mlp)
        s.fail("lora", "target_modules \"" + t + "\" in a mixture of experts: PEFT takes " +
                           (t == "all-linear" ? std::string("\"all-linear\" to mean the experts and the router too")
                                              : "an MLP projection's name for the experts' (transformers 4's name)") +
                           " and adapts the fused experts instead; name the attention's linears in target_modules "
                           "and the experts in target_parameters (\"mlp.experts.gate_up_proj\", "
                           "\"mlp.experts.down_proj\")");
    }
  for (const std::string& t : mc.lora.target_parameters) {
    bool hit = false;
    for (int64_t i = 0; i < mc.layers && !hit; ++i)
      if (mc.sparse(i))
        for (const char* tensor : {models::kExpertGateUp, models::kExpertDown}) {
          models::ModelConfig::Lora one = mc.lora;
          one.target_parameters = {t};
          hit = hit || one.targets_parameter(models::expert_parameter(mc, i, tensor));
        }
    if (!hit)
      s.fail("lora", "target_parameters \"" + t + "\" names no expert tensor of the model" +
                         (mc.moe.enabled() ? std::string(" (a sparse block's: \"mlp.experts.gate_up_proj\", "
                                                         "\"mlp.experts.down_proj\", as transformers 5 names them)")
                                           : std::string(": it has no mixture of experts (target_parameters adapts "
                                                         "a sparse block's experts)")));
  }
}

}  // namespace

}  // namespace strata::engine
