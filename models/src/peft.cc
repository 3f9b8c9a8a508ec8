#include "strata/models/peft.h"

#include <algorithm>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <stdexcept>

#include "strata/models/model_shapes.h"

namespace strata::models {

ModelConfig::Lora parse_lora_settings(const std::string& json_text, const std::string& source, LoraSettingsFrom from) {
  const bool train_config = from == LoraSettingsFrom::kTrainConfig;
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(json_text);
  } catch (const std::exception& e) {
    throw std::invalid_argument(source + ": not JSON: " + e.what());
  }
  // A training configuration names its keys as the rest of it does ("f.json: model.lora.r ..."),
  // an adapter file as a file's key ("adapter_config.json: \"r\" ...").
  const auto bad = [&](const std::string& key, const std::string& why) {
    return std::invalid_argument(train_config ? source + "." + key + " " + why : source + ": \"" + key + "\" " + why);
  };
  if (!j.is_object()) throw std::invalid_argument(source + ": must be an object");
  const auto empty = [&](const char* key) {
    return !j.contains(key) || j[key].is_null() || j[key].empty() || j[key] == false;
  };
  // Every key this reads; a training configuration may hold no other (an adapter file holds
  // PEFT's other settings, which change nothing Strata computes).
  static const char* const kKnown[] = {"peft_type", "r", "lora_alpha", "use_rslora", "target_modules", "modules_to_save",
                                       "lora_dropout", "use_dora", "rank_pattern", "alpha_pattern", "bias",
                                       "layers_to_transform", "exclude_modules", "lora_bias", "layer_replication",
                                       "target_parameters", "trainable_token_indices", "init_lora_weights"};
  if (train_config)
    for (auto it = j.begin(); it != j.end(); ++it)
      if (std::find(std::begin(kKnown), std::end(kKnown), it.key()) == std::end(kKnown))
        throw bad(it.key(), "is not a known key (see docs/CONFIG.md)");
  const auto number = [&](const char* key) {
    const nlohmann::json& v = j.at(key);
    if (!v.is_number()) throw bad(key, "has the wrong type: " + v.dump());
    return v;
  };
  if (j.value("peft_type", std::string("LORA")) != "LORA") throw bad("peft_type", "is not LORA");
  if (j.contains("lora_dropout") && number("lora_dropout").get<double>() != 0)
    throw bad("lora_dropout", "is not 0: Strata's models have no dropout (train with lora_dropout 0)");
  if (j.value("use_dora", false)) throw bad("use_dora", "is true: DoRA is not supported");
  if (!empty("rank_pattern")) throw bad("rank_pattern", "is set: one rank for every adapter only");
  if (!empty("alpha_pattern")) throw bad("alpha_pattern", "is set: one lora_alpha for every adapter only");
  if (j.value("bias", std::string("none")) != "none") throw bad("bias", "is not \"none\"");
  if (!empty("layers_to_transform")) throw bad("layers_to_transform", "is set: adapters on every layer only");
  for (const char* key : {"exclude_modules", "lora_bias", "layer_replication", "trainable_token_indices"})
    if (!empty(key)) throw bad(key, "is set: not supported");
  // Only the configuration starts adapters; a file's were initialized however they were.
  if (train_config && j.contains("init_lora_weights") && j["init_lora_weights"] != true)
    throw bad("init_lora_weights", "must be true (PEFT's default: A as nn.Linear initializes it, B zero); load other "
                                   "adapters with model.adapter_from");
  ModelConfig::Lora l;
  if (!j.contains("r")) throw bad("r", "is required (the adapters' rank)");
  if (!number("r").is_number_integer()) throw bad("r", "must be an integer");
  l.r = j["r"].get<int64_t>();
  if (l.r < 1) throw bad("r", "must be at least 1");
  if (j.contains("lora_alpha")) l.alpha = number("lora_alpha").get<double>();
  if (j.contains("use_rslora")) {
    if (!j["use_rslora"].is_boolean()) throw bad("use_rslora", "has the wrong type: " + j["use_rslora"].dump());
    l.rslora = j["use_rslora"].get<bool>();
  }
  if (const auto p = j.find("target_parameters"); p != j.end() && !p->is_null()) {
    if (!p->is_array() || !std::all_of(p->begin(), p->end(), [](const nlohmann::json& x) { return x.is_string(); }))
      throw bad("target_parameters", "must be a list of parameter names (\"mlp.experts.gate_up_proj\", "
                                     "\"mlp.experts.down_proj\")");
    l.target_parameters = p->get<std::vector<std::string>>();
  }
  const nlohmann::json* t = j.contains("target_modules") ? &j["target_modules"] : nullptr;
  if (!t || t->is_null()) {
    if (l.target_parameters.empty())
      throw bad("target_modules", "is required (module names such as [\"q_proj\", \"v_proj\"], or \"all-linear\")");
  } else if (t->is_array() && t->empty() && !l.target_parameters.empty()) {
    // the experts alone (target_parameters)
  } else if (t->is_string()) {
    if (t->get<std::string>() != "all-linear")
      throw bad("target_modules", "is a regular expression: Strata takes a list of module names or \"all-linear\"");
    l.target_modules = {"all-linear"};
  } else if (t->is_array() && !t->empty() &&
             std::all_of(t->begin(), t->end(), [](const nlohmann::json& x) { return x.is_string(); })) {
    l.target_modules = t->get<std::vector<std::string>>();
  } else {
    throw bad("target_modules", "must be a list of module names or \"all-linear\"");
  }
  if (const auto m = j.find("modules_to_save"); m != j.end() && !m->is_null()) {
    if (!m->is_array() || !std::all_of(m->begin(), m->end(), [](const nlohmann::json& x) { return x.is_string(); }))
      throw bad("modules_to_save", "must be a list of module names");
    l.modules_to_save = m->get<std::vector<std::string>>();
  }
  return l;
}

ModelConfig::Lora read_peft_adapter_config(const std::filesystem::path& dir) {
  const std::filesystem::path file = dir / kAdapterConfigFile;
  std::ifstream in(file);
  if (!in) throw std::invalid_argument(file.string() + ": cannot read (a PEFT adapter directory holds it)");
  std::stringstream text;
  text << in.rdbuf();
  return parse_lora_settings(text.str(), file.string(), LoraSettingsFrom::kAdapterConfig);
}

std::string peft_adapter_config_json(const ModelConfig& c, const std::string& base_model) {
  const ModelConfig::Lora& l = c.lora;
  nlohmann::json j = {
      {"peft_type", "LORA"},
      {"task_type", "CAUSAL_LM"},
      {"base_model_name_or_path", base_model.empty() ? nlohmann::json() : nlohmann::json(base_model)},
      {"inference_mode", true},
      {"r", l.r},
      {"lora_alpha", l.alpha},
      {"use_rslora", l.rslora},
      {"lora_dropout", 0.0},
      {"bias", "none"},
      // GPT-2's Conv1D layers store W transposed; PEFT's adapters on them do not (decoder.h).
      {"fan_in_fan_out", c.arch == Arch::kGpt2},
      {"init_lora_weights", true},
      {"use_dora", false},
      {"rank_pattern", nlohmann::json::object()},
      {"alpha_pattern", nlohmann::json::object()},
      {"layers_to_transform", nullptr},
      {"modules_to_save", l.modules_to_save.empty() ? nlohmann::json() : nlohmann::json(l.modules_to_save)},
  };
  if (l.target_modules == std::vector<std::string>{"all-linear"}) j["target_modules"] = "all-linear";
  else j["target_modules"] = l.target_modules;
  if (!l.target_parameters.empty()) j["target_parameters"] = l.target_parameters;
  return j.dump(2);
}

std::string peft_key(const ModelConfig& c, const std::string& name) {
  const std::string gate_up = std::string(".mlp.experts.") + kExpertGateUp + ".", down = std::string(".mlp.experts.") + kExpertDown + ".";
  std::string key = name;
  if (const size_t at = key.find(gate_up); at != std::string::npos) {
    const std::string experts = key.substr(0, at) + ".mlp.experts";
    // PEFT wraps the experts module once for each targeted tensor in the order the module
    // registers them (gate_up_proj, then down_proj), the last wrapper outermost.
    key = experts + (c.lora.targets_parameter(experts + "." + kExpertDown) ? ".base_layer" : "") +
          key.substr(at + gate_up.size() - 1);
  } else if (const size_t at2 = key.find(down); at2 != std::string::npos) {
    key = key.substr(0, at2) + ".mlp.experts" + key.substr(at2 + down.size() - 1);
  }
  return "base_model.model." + key;
}

}  // namespace strata::models
