// model.lora and model.adapter_from, read for parse_train_config (config_parse.cc): PEFT's LoRA
// settings, given or an adapter directory's, checked against the model, and what trains.
#include <algorithm>

#include "config_section.h"
#include "strata/engine/config.h"
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
  if (const json* l = s.get("lora")) {
    Section ls(*l, "model.lora", s.source());
    models::ModelConfig::Lora lora;
    ls.read("r", lora.r);
    if (lora.r < 1) ls.fail("r", "must be at least 1");
    ls.read("lora_alpha", lora.alpha);
    ls.read("use_rslora", lora.rslora);
    if (const json* t = ls.get("target_modules")) {
      if (t->is_string() && t->get<std::string>() == "all-linear") lora.target_modules = {"all-linear"};
      else if (t->is_array() && !t->empty() && std::all_of(t->begin(), t->end(), [](const json& x) { return x.is_string(); }))
        lora.target_modules = t->get<std::vector<std::string>>();
      else ls.fail("target_modules", "must be a list of module names or \"all-linear\" (a regular expression is not supported)");
    } else {
      ls.fail("target_modules", "is required (module names such as [\"q_proj\", \"v_proj\"], or \"all-linear\")");
    }
    if (const json* m = ls.get("modules_to_save"); m && !m->is_null()) {
      if (!m->is_array()) ls.fail("modules_to_save", "must be a list of module names");
      for (const json& x : *m) {
        if (!x.is_string()) ls.fail("modules_to_save", "must be a list of module names");
        lora.modules_to_save.push_back(x.get<std::string>());
      }
    }
    double dropout = 0;
    ls.read("lora_dropout", dropout);
    if (dropout != 0) ls.fail("lora_dropout", "must be 0: Strata's models have no dropout");
    bool dora = false;
    ls.read("use_dora", dora);
    if (dora) ls.fail("use_dora", "is not supported (DoRA)");
    for (const char* k : {"rank_pattern", "alpha_pattern"})
      if (const json* p = ls.get(k); p && !p->is_null() && !p->empty())
        ls.fail(k, "is not supported: one r and lora_alpha for every adapter");
    if (const json* init = ls.get("init_lora_weights"); init && !(init->is_boolean() && init->get<bool>()))
      ls.fail("init_lora_weights", "must be true (PEFT's default: A as nn.Linear initializes it, B zero); load other "
                                   "adapters with model.adapter_from");
    mc.lora = lora;
  }
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
                           for (const models::BlockLinear& l : models::block_linears(mc)) all += (all.empty() ? "" : ", ") + l.module;
                           return all;
                         }() + ")");
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
