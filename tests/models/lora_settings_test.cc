// LoRA settings have one reader (models::parse_lora_settings): a PEFT adapter_config.json and a
// training configuration's model.lora give the same ModelConfig::Lora for the same keys, refuse
// the same things naming the key, and differ only where they must (a configuration refuses keys
// it does not read and adapters that do not start as PEFT starts them).
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "strata/models/model_config.h"
#include "strata/models/peft.h"

namespace strata::models {
namespace {

using nlohmann::json;

ModelConfig::Lora parse(const json& j, LoraSettingsFrom from) {
  return parse_lora_settings(j.dump(), from == LoraSettingsFrom::kTrainConfig ? "f.json: model.lora" : "a/adapter_config.json",
                             from);
}

std::string refusal(const json& j, LoraSettingsFrom from) {
  try {
    parse(j, from);
  } catch (const std::invalid_argument& e) {
    return e.what();
  }
  return "";
}

TEST(LoraSettings, AnAdapterFileAndAConfigurationReadAlike) {
  const std::vector<json> cases = {
      json{{"r", 8}, {"lora_alpha", 16}, {"target_modules", {"q_proj", "v_proj"}}},
      json{{"r", 3}, {"lora_alpha", 5.5}, {"use_rslora", true}, {"target_modules", "all-linear"},
           {"modules_to_save", json::array({"lm_head"})}, {"lora_dropout", 0.0}, {"bias", "none"}},
      json{{"r", 1}, {"target_modules", json::array({"c_attn"})}, {"modules_to_save", nullptr}}};
  for (const json& j : cases) {
    SCOPED_TRACE(j.dump());
    const ModelConfig::Lora a = parse(j, LoraSettingsFrom::kAdapterConfig), c = parse(j, LoraSettingsFrom::kTrainConfig);
    EXPECT_EQ(a.r, c.r);
    EXPECT_EQ(a.alpha, c.alpha);
    EXPECT_EQ(a.rslora, c.rslora);
    EXPECT_EQ(a.target_modules, c.target_modules);
    EXPECT_EQ(a.modules_to_save, c.modules_to_save);
    EXPECT_EQ(a.r, j["r"].get<int64_t>());
    EXPECT_EQ(a.alpha, j.value("lora_alpha", 8.0)) << "PEFT's default lora_alpha is 8";
  }
}

TEST(LoraSettings, WhatStrataDoesNotComputeIsRefusedAlikeNamingTheKey) {
  const json base = {{"r", 4}, {"target_modules", {"q_proj"}}};
  const auto with = [&](const std::string& k, const json& v) {
    json j = base;
    j[k] = v;
    return j;
  };
  for (const auto& [key, value] :
       std::vector<std::pair<std::string, json>>{{"lora_dropout", 0.05},
                                                 {"use_dora", true},
                                                 {"rank_pattern", {{"q_proj", 8}}},
                                                 {"alpha_pattern", {{"q_proj", 8}}},
                                                 {"bias", "all"},
                                                 {"layers_to_transform", {0, 1}},
                                                 {"target_parameters", "experts.gate_up_proj"},
                                                 {"peft_type", "IA3"},
                                                 {"target_modules", ".*proj"},
                                                 {"target_modules", json::array()},
                                                 {"modules_to_save", "lm_head"},
                                                 {"r", 0},
                                                 {"r", 2.5}}) {
    SCOPED_TRACE(key + " = " + value.dump());
    const std::string a = refusal(with(key, value), LoraSettingsFrom::kAdapterConfig),
                      c = refusal(with(key, value), LoraSettingsFrom::kTrainConfig);
    EXPECT_NE(a.find("a/adapter_config.json: \"" + key + "\""), std::string::npos) << a;
    EXPECT_NE(c.find("f.json: model.lora." + key + " "), std::string::npos) << c;
    // The same reason after the key's name.
    const std::string a_key = "\"" + key + "\" ", c_key = "model.lora." + key + " ";
    ASSERT_NE(a.find(a_key), std::string::npos);
    ASSERT_NE(c.find(c_key), std::string::npos);
    EXPECT_EQ(a.substr(a.find(a_key) + a_key.size()), c.substr(c.find(c_key) + c_key.size()));
  }
  for (const char* required : {"r", "target_modules"}) {
    json j = base;
    j.erase(required);
    EXPECT_NE(refusal(j, LoraSettingsFrom::kAdapterConfig).find("is required"), std::string::npos) << required;
    EXPECT_NE(refusal(j, LoraSettingsFrom::kTrainConfig).find("is required"), std::string::npos) << required;
  }
}

TEST(LoraSettings, OnlyAConfigurationRefusesUnknownKeysAndOtherStartingAdapters) {
  json j = {{"r", 4}, {"target_modules", {"q_proj"}}, {"task_type", "CAUSAL_LM"}, {"fan_in_fan_out", false}};
  EXPECT_EQ(parse(j, LoraSettingsFrom::kAdapterConfig).r, 4) << "PEFT's other keys change nothing Strata computes";
  EXPECT_NE(refusal(j, LoraSettingsFrom::kTrainConfig).find(" is not a known key (see docs/CONFIG.md)"), std::string::npos);
  json g = {{"r", 4}, {"target_modules", {"q_proj"}}, {"init_lora_weights", "gaussian"}};
  EXPECT_EQ(parse(g, LoraSettingsFrom::kAdapterConfig).r, 4) << "a file's adapters were initialized however they were";
  EXPECT_NE(refusal(g, LoraSettingsFrom::kTrainConfig).find("init_lora_weights must be true"), std::string::npos);
}

TEST(LoraSettings, WhatStrataWritesReadsBack) {
  ModelConfig c = preset("llama-1b");
  c.lora.r = 6;
  c.lora.alpha = 12;
  c.lora.rslora = true;
  c.lora.target_modules = {"all-linear"};
  c.lora.modules_to_save = {"lm_head"};
  const ModelConfig::Lora back =
      parse_lora_settings(peft_adapter_config_json(c, "base"), "written", LoraSettingsFrom::kAdapterConfig);
  EXPECT_EQ(back.r, 6);
  EXPECT_EQ(back.alpha, 12);
  EXPECT_TRUE(back.rslora);
  EXPECT_EQ(back.target_modules, c.lora.target_modules);
  EXPECT_EQ(back.modules_to_save, c.lora.modules_to_save);

  // The experts alone: PEFT's empty target_modules beside target_parameters.
  ModelConfig moe = preset("qwen3-30b-a3b");
  moe.lora.r = 4;
  moe.lora.target_parameters = {"mlp.experts.down_proj"};
  const ModelConfig::Lora experts =
      parse_lora_settings(peft_adapter_config_json(moe, "base"), "written", LoraSettingsFrom::kAdapterConfig);
  EXPECT_TRUE(experts.target_modules.empty());
  EXPECT_EQ(experts.target_parameters, moe.lora.target_parameters);
}

}  // namespace
}  // namespace strata::models
