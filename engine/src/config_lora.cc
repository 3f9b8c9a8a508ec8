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
          sorted(from.modules_to_save) != sorted(mc.lora.modules_to_save))
        s.fail("lora", "differs from model.adapter_from's adapter_config.json (r, lora_alpha, use_rslora, "
                       "target_modules, modules_to_save): give one of them, or the same");
    }
  }
  if (!mc.lora.enabled()) return;
  // Every target must adapt some linear layer of a block.
  for (const std::string& t : mc.lora.target_modules) {
    bool hit = false;
    models::ModelConfig one = mc;
    one.lora.target_modules = {t};
    for (int64_t i = 0; i < mc.layers && !hit; ++i) hit = !models::block_adapters(one, i).empty();
    if (!hit)
      s.fail("lora", "target_modules \"" + t + "\" names no linear layer of a " + (mc.arch == models::Arch::kGpt2 ? std::string("gpt2") : mc.hf_type) + " block (" +
                         [&] {
                           std::string all;
                           for (const models::BlockLinear& l : models::block_linears(mc))
                             if (l.attention || mc.has_dense_blocks()) all += (all.empty() ? "" : ", ") + l.module;
                           return all;
                         }() + ")" +
                         (mc.moe.enabled() ? "; a sparse block's experts are not linear layers, and LoRA on them "
                                             "(peft's target_parameters) is not supported yet"
                                           : ""));
  }
  // The adapters train, and the modules to save whole (their tensors by name).
  c.engine.trainable = models::adapter_patterns();
  try {
    for (const std::string& t : models::saved_whole_tensors(mc)) c.engine.trainable.push_back(t);
  } catch (const std::invalid_argument& ex) {
    s.fail("lora", ex.what());
  }
}

}  // namespace strata::engine
