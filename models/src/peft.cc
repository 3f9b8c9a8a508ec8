#include "strata/models/peft.h"

#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <stdexcept>

namespace strata::models {

ModelConfig::Lora parse_peft_adapter_config(const std::string& json_text, const std::string& source) {
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(json_text);
  } catch (const std::exception& e) {
    throw std::invalid_argument(source + ": not JSON: " + e.what());
  }
  const auto bad = [&](const std::string& key, const std::string& why) {
    return std::invalid_argument(source + ": \"" + key + "\" " + why);
  };
  const auto empty = [&](const char* key) {
    return !j.contains(key) || j[key].is_null() || j[key].empty() || j[key] == false;
  };
  if (j.value("peft_type", std::string("LORA")) != "LORA") throw bad("peft_type", "is not LORA");
  if (j.value("lora_dropout", 0.0) > 0)
    throw bad("lora_dropout", "is above 0: Strata's models have no dropout (train with lora_dropout 0)");
  if (j.value("use_dora", false)) throw bad("use_dora", "is true: DoRA is not supported");
  if (!empty("rank_pattern")) throw bad("rank_pattern", "is set: one rank for every adapter only");
  if (!empty("alpha_pattern")) throw bad("alpha_pattern", "is set: one lora_alpha for every adapter only");
  if (j.value("bias", std::string("none")) != "none") throw bad("bias", "is not \"none\"");
  if (!empty("layers_to_transform")) throw bad("layers_to_transform", "is set: adapters on every layer only");
  for (const char* key : {"exclude_modules", "lora_bias", "layer_replication", "target_parameters",
                          "trainable_token_indices"})
    if (!empty(key)) throw bad(key, "is set: not supported");
  ModelConfig::Lora l;
  try {
    l.r = j.at("r").get<int64_t>();
    l.alpha = j.at("lora_alpha").get<double>();
    l.rslora = j.value("use_rslora", false);
    const nlohmann::json& t = j.at("target_modules");
    if (t.is_string()) {
      if (t.get<std::string>() != "all-linear")
        throw bad("target_modules", "is a regular expression: Strata takes a list of module names or \"all-linear\"");
      l.target_modules = {"all-linear"};
    } else {
      l.target_modules = t.get<std::vector<std::string>>();
    }
    if (!empty("modules_to_save")) l.modules_to_save = j["modules_to_save"].get<std::vector<std::string>>();
  } catch (const nlohmann::json::exception& e) {
    throw std::invalid_argument(source + ": " + e.what());
  }
  if (l.r < 1) throw bad("r", "must be at least 1");
  return l;
}

ModelConfig::Lora read_peft_adapter_config(const std::filesystem::path& dir) {
  const std::filesystem::path file = dir / kAdapterConfigFile;
  std::ifstream in(file);
  if (!in) throw std::invalid_argument(file.string() + ": cannot read (a PEFT adapter directory holds it)");
  std::stringstream text;
  text << in.rdbuf();
  return parse_peft_adapter_config(text.str(), file.string());
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
  return j.dump(2);
}

std::string peft_key(const std::string& name) { return "base_model.model." + name; }

}  // namespace strata::models
