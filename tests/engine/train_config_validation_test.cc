// Configurations the parser refuses name the file and the key (device budgets, every invalid
// value), and model.init_from reads a model directory and rejects reshaping it.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <future>
#include <map>
#include <stdexcept>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include <sys/wait.h>
#include <unistd.h>

#include "strata/engine/comm.h"
#include "strata/engine/config.h"
#include "strata/engine/config_parse.h"
#include "strata/engine/cpu_share.h"
#include "strata/engine/device.h"
#include "strata/engine/partition.h"
#include "strata/models/model_config.h"
#include "test_util.h"
#include "thrown_message.h"

namespace strata::engine {
namespace {

using test::contains;
using test::thrown_message;

// The message of the std::invalid_argument that parsing `json` as "test.json" throws.
std::string config_error(const std::string& json) {
  return thrown_message<std::invalid_argument>([&] { parse_train_config(json, "test.json"); });
}

// `text` as a JSON string literal.
std::string json_string(const std::string& text) {
  std::string out = "\"";
  for (char ch : text) {
    if (ch == '"' || ch == '\\') out += '\\';
    out += ch;
  }
  return out + "\"";
}

// A Hugging Face model directory holding only config.json, for model.init_from.
void write_hf_config(const std::filesystem::path& dir, const models::ModelConfig& mc) {
  std::ofstream out(dir / "config.json");
  out << mc.to_hf_json();
}

TEST(TrainConfig, DeviceBudgetTakesASizeStringOrAByteCount) {
  auto budget_of = [](const std::string& value) {
    return parse_train_config(R"({"device": {"budget": )" + value + "}}", "test.json")
        .engine.device_budget;
  };
  EXPECT_EQ(budget_of(R"("1MiB")"), 1048576u);
  EXPECT_EQ(budget_of("1048576"), 1048576u);
  EXPECT_EQ(budget_of(R"("1.5GiB")"), 3ull << 29);
  for (const char* bad : {R"("12Q")", "0", "-1", "1.5", R"("")", "true"}) {
    const std::string msg = config_error(std::string(R"({"device": {"budget": )") + bad + "}}");
    EXPECT_TRUE(contains(msg, "device.budget")) << bad << ": " << msg;
  }
}

TEST(TrainConfig, InvalidConfigurationsNameTheFileAndKey) {
  struct Bad {
    const char* json;
    const char* names;
  };
  const Bad cases[] = {
      {R"({"optimiser": {}})", "optimiser"},
      {R"({"run": {"checkpoint_part_size": 0}})", "run.checkpoint_part_size"},
      {R"({"run": {"checkpoint_part_size": "6GiB"}})", "run.checkpoint_part_size"},
      {R"({"run": {"checkpoint_concurrency": 0}})", "run.checkpoint_concurrency"},
      {R"({"run": {"checkpoint_concurrency": 65}})", "run.checkpoint_concurrency"},
      {R"({"run": {"checkpoint_part_size": "1GiB", "checkpoint_concurrency": 32}})", "run.checkpoint_part_size"},
      {R"({"optimizer": {"momentum": 0.9}})", "optimizer.momentum"},
      {R"({"model": {"layer": 6}})", "model.layer"},
      {R"({"batch": {"micro_batch": "2"}})", "batch.micro_batch"},
      {R"({"batch": {"micro_batch": 2.0}})", "batch.micro_batch"},
      {R"({"batch": {"micro_batch": 0}})", "batch.micro_batch"},
      {R"({"batch": {"grad_accum": -1}})", "batch.grad_accum"},
      {R"({"batch": 2})", "batch"},
      {R"({"precision": {"compute": "fp8"}})", "precision.compute"},
      {R"({"precision": {"reduce": "fp16"}})", "precision.reduce"},
      {R"({"precision": {"initial_loss_scale": 0}})", "precision.initial_loss_scale"},
      {R"({"precision": {"loss_scale_window": 0}})", "precision.loss_scale_window"},
      {R"({"optimizer": {"type": "sgd"}})", "optimizer.type"},
      {R"({"optimizer": {"betas": [0.9]}})", "optimizer.betas"},
      {R"({"optimizer": {"betas": [0.9, 0.99, 0.999]}})", "optimizer.betas"},
      {R"({"optimizer": {"betas": [0.9, "0.999"]}})", "optimizer.betas"},
      {R"({"optimizer": {"betas": 0.9}})", "optimizer.betas"},
      {R"({"optimizer": {"betas": [0.9, 1.0]}})", "optimizer.betas"},
      {R"({"optimizer": {"lr": "0.1"}})", "optimizer.lr"},
      {R"({"optimizer": {"lr": -0.1}})", "optimizer.lr"},
      {R"({"optimizer": {"eps": 0}})", "optimizer.eps"},
      {R"({"optimizer": {"weight_decay": -1}})", "optimizer.weight_decay"},
      {R"({"optimizer": {"clip_grad_norm": -1}})", "optimizer.clip_grad_norm"},
      {R"({"placement": {"params": "gpu"}})", "placement.params"},
      {R"({"device": {"type": "tpu"}})", "device.type"},
      {R"({"placement": {"master": "device"}})", "placement.master"},
      {R"({"device": {"prefetch": -1}})", "device.prefetch"},
      {R"({"placement": {"recompute": -1}})", "placement.recompute"},
      {R"({"placement": {"recompute": "some"}})", "placement.recompute"},
      {R"({"placement": {"recompute": true}})", "placement.recompute"},
      {R"({"placement": {"recompute": 1.5}})", "placement.recompute"},
      {R"({"device": {"prefetch": "deep"}})", "device.prefetch"},
      {R"({"device": {"cpu_threads": -1}})", "device.cpu_threads"},
      {R"({"distributed": {"timeout_s": 0}})", "distributed.timeout_s"},
      {R"({"data": {"seq_len": 0}})", "data.seq_len"},
      {R"({"data": {"seq_len": 2048}})", "data.seq_len"},
      {R"({"data": {"seed": -1}})", "data.seed"},
      {R"({"run": {"steps": -1}})", "run.steps"},
      {R"({"run": {"progress": 1}})", "run.progress"},
      {R"({"run": {"log": null}})", "run.log"},
      {R"({"model": {"preset": "gpt5"}})", "model.preset"},
      {R"({"model": {"hidden": 64}})", "head_dim"},  // 64 is not a multiple of gpt2's 12 heads
      {R"({"model": {"hf_config": "/nonexistent/config.json"}})", "/nonexistent/config.json"},
      {R"([1, 2])", "test.json"},
      {R"({"model": )", "not valid JSON"},
  };
  for (const Bad& bad : cases) {
    SCOPED_TRACE(bad.json);
    const std::string msg = config_error(bad.json);
    EXPECT_TRUE(contains(msg, bad.names)) << msg;
    EXPECT_EQ(msg.rfind("test.json", 0), 0u) << msg;
  }
}

// model.quantize (bitsandbytes' BitsAndBytesConfig keys): read as transformers writes them, and
// refused where a 4-bit base cannot work, naming the key.
TEST(TrainConfig, AFourBitBaseReadsBitsAndBytesKeysAndRefusesWhatCannotWork) {
  const std::string lora = R"("lora": {"r": 4, "target_modules": ["q_proj", "down_proj"]})";
  const auto with = [&](const std::string& quantize, const std::string& more = "", const std::string& model = "llama-1b",
                        const std::string& lora_part = "") {
    return R"({"model": {"preset": ")" + model + "\", " + (lora_part.empty() ? lora : lora_part) +
           R"(, "quantize": )" + quantize + "}" + more + "}";
  };
  // BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="fp4").to_dict() (transformers 5), as written.
  const std::string to_dict =
      R"({"quant_method": "bitsandbytes", "_load_in_8bit": false, "_load_in_4bit": true, "llm_int8_threshold": 6.0,
          "llm_int8_skip_modules": null, "llm_int8_enable_fp32_cpu_offload": false, "llm_int8_has_fp16_weight": false,
          "bnb_4bit_quant_type": "fp4", "bnb_4bit_use_double_quant": false, "bnb_4bit_compute_dtype": "float32",
          "bnb_4bit_quant_storage": "uint8", "load_in_4bit": true, "load_in_8bit": false})";
  const TrainConfig c = parse_train_config(with(to_dict), "test.json");
  EXPECT_TRUE(c.model.quantize.enabled());
  EXPECT_EQ(c.model.quantize.quant_type, "fp4");
  EXPECT_EQ(c.model.quantize.skip_modules, std::vector<std::string>{"lm_head"});
  EXPECT_TRUE(models::stored_4bit(c.model, "model.layers.3.mlp.down_proj.weight"));
  EXPECT_FALSE(models::stored_4bit(c.model, "model.layers.3.input_layernorm.weight"));
  EXPECT_FALSE(models::stored_4bit(c.model, "lm_head.weight"));
  const TrainConfig skipping = parse_train_config(
      with(R"({"load_in_4bit": true, "llm_int8_skip_modules": ["lm_head", "model.layers.1.mlp", "v_proj"]})"), "test.json");
  // As transformers' should_convert_module (checked there): from the start up to a boundary, or a suffix.
  EXPECT_FALSE(models::stored_4bit(skipping.model, "model.layers.1.mlp.up_proj.weight"));
  EXPECT_TRUE(models::stored_4bit(skipping.model, "model.layers.11.mlp.up_proj.weight"));
  EXPECT_FALSE(models::stored_4bit(skipping.model, "model.layers.11.self_attn.v_proj.weight"));  // a suffix
  // A regular expression whose match may end just after a "." (transformers' lookbehind), checked there.
  const TrainConfig optional = parse_train_config(
      with(R"({"load_in_4bit": true, "llm_int8_skip_modules": ["lm_head", "model.layers.1.(self_attn)?"]})"), "test.json");
  EXPECT_FALSE(models::stored_4bit(optional.model, "model.layers.1.mlp.up_proj.weight"));
  EXPECT_TRUE(models::stored_4bit(optional.model, "model.layers.2.mlp.up_proj.weight"));
  struct Bad {
    std::string json, names;
  };
  const Bad cases[] = {
      {with(R"({"load_in_4bit": true})", "", "llama-1b", R"("trainable": "all")"), "needs a frozen base"},
      {with(R"({"load_in_4bit": true, "bnb_4bit_quant_type": "int4"})"), "bnb_4bit_quant_type"},
      {with(R"({"load_in_4bit": true, "bnb_4bit_use_double_quant": 1})"), "bnb_4bit_use_double_quant"},
      {with(R"({"load_in_4bit": true, "bnb_4bit_quant_storage": "bfloat16"})"), "bnb_4bit_quant_storage"},
      {with(R"({"load_in_4bit": true, "llm_int8_skip_modules": ["q_proj"]})"), "lm_head"},
      {with(R"({"load_in_8bit": true})"), "load_in_8bit"},
      {with(R"({"load_in_4bit": true, "bnb_4bit_compute_dtype": "bfloat16"})"), "bnb_4bit_compute_dtype"},
      {with(R"({"load_in_4bit": true, "bnb_4bit_quant_typ": "nf4"})"), "model.quantize.bnb_4bit_quant_typ"},
      {with(R"({"load_in_4bit": true})", "", "gpt2", R"("lora": {"r": 4, "target_modules": ["c_attn"]})"), "Llama family's dense models"},
      {with(R"({"load_in_4bit": true})", R"(, "run": {"export": "/tmp/x", "export_merged": true})"),
       "export_merged with a 4-bit base"},
      {with(R"({"load_in_4bit": true})", R"(, "run": {"export": "/tmp/x"})", "llama-1b",
            R"("trainable": ["model.layers.0.*"])"),
       "no model.lora"},
      {with(R"({"load_in_4bit": true, "llm_int8_skip_modules": ["lm_head", "model.layers"]})"), "quantizes nothing"},
      {with(R"({"load_in_4bit": true})", "", "llama-1b", R"("trainable": ["model.layers.*"])"), "quantizes nothing"},
  };
  for (const Bad& bad : cases) {
    SCOPED_TRACE(bad.json);
    const std::string msg = config_error(bad.json);
    EXPECT_TRUE(contains(msg, bad.names)) << msg;
  }
}

// A base saved in 4 bits (config.json's quantization_config, as transformers writes it): its
// settings become model.quantize's; model.quantize may repeat them, not change them; other
// quantizations are refused before any tensor is read.
TEST(TrainConfig, AnInitFromSavedIn4BitsGivesItsQuantizationAndRefusesAnother) {
  test::TempDir dir;
  const auto saved_with = [&](const std::string& quantization_config) {
    nlohmann::json j = nlohmann::json::parse(models::preset("llama-1b").to_hf_json());
    j["quantization_config"] = nlohmann::json::parse(quantization_config);
    std::ofstream(dir.path() / "config.json") << j.dump();
  };
  const std::string nf4_double =
      R"({"_load_in_4bit": true, "_load_in_8bit": false, "bnb_4bit_compute_dtype": "float32",
          "bnb_4bit_quant_storage": "uint8", "bnb_4bit_quant_type": "nf4", "bnb_4bit_use_double_quant": true,
          "llm_int8_enable_fp32_cpu_offload": false, "llm_int8_has_fp16_weight": false, "llm_int8_skip_modules": null,
          "llm_int8_threshold": 6.0, "load_in_4bit": true, "load_in_8bit": false, "quant_method": "bitsandbytes"})";
  saved_with(nf4_double);
  const auto config = [&](const std::string& model_more) {
    return R"({"model": {"init_from": )" + json_string(dir.path().string()) +
           R"(, "lora": {"r": 4, "target_modules": ["q_proj"]})" + model_more +
           R"(}, "data": {"path": "tokens.bin", "format": "uint16"}})";
  };
  // bnb_4bit_compute_dtype float32 saved, bfloat16 computed: the compute dtype is the run's.
  const TrainConfig c = parse_train_config(config(""), "test.json");
  EXPECT_TRUE(c.model.quantize.enabled());
  EXPECT_EQ(c.model.quantize.quant_type, "nf4");
  EXPECT_TRUE(c.model.quantize.double_quant);
  EXPECT_TRUE(models::stored_4bit(c.model, "model.layers.0.mlp.down_proj.weight"));
  EXPECT_FALSE(models::stored_4bit(c.model, "lm_head.weight"));
  const TrainConfig repeated = parse_train_config(
      config(R"(, "quantize": {"load_in_4bit": true, "bnb_4bit_use_double_quant": true})"), "test.json");
  EXPECT_TRUE(repeated.model.quantize.double_quant);
  struct Bad {
    std::string json, names;
  };
  const Bad cases[] = {
      {config(R"(, "quantize": {"load_in_4bit": true, "bnb_4bit_quant_type": "fp4", "bnb_4bit_use_double_quant": true})"),
       "differs from init_from's, which is saved in 4 bits (nf4"},
      {config(R"(, "quantize": {"load_in_4bit": true})"), "bnb_4bit_use_double_quant"},
      {config(R"(, "quantize": {"load_in_4bit": false})"), "init_from is saved in 4 bits"},
      {R"({"model": {"init_from": )" + json_string(dir.path().string()) +
           R"(, "trainable": "all"}, "data": {"path": "tokens.bin", "format": "uint16"}})",
       "needs a frozen base"},
  };
  for (const Bad& bad : cases) {
    SCOPED_TRACE(bad.json);
    const std::string msg = config_error(bad.json);
    EXPECT_TRUE(contains(msg, bad.names)) << msg;
  }
  saved_with(R"({"quant_method": "bitsandbytes", "load_in_8bit": true, "_load_in_8bit": true})");
  EXPECT_TRUE(contains(config_error(config("")), "saved in 8 bits (bitsandbytes) is not supported"));
  saved_with(R"({"quant_method": "gptq", "bits": 4})");
  EXPECT_TRUE(contains(config_error(config("")), "saved by gptq is not supported"));
}

TEST(TrainConfig, InitFromReadsTheDirectoryAndRejectsReshaping) {
  test::TempDir dir;
  models::ModelConfig mc = models::preset("gpt2");
  mc.layers = 3;
  mc.hidden = 96;
  mc.heads = mc.kv_heads = 6;
  mc.head_dim = 16;
  mc.intermediate = 384;
  mc.vocab_size = 300;
  mc.max_positions = 128;
  write_hf_config(dir.path(), mc);
  const std::string init = R"({"model": {"init_from": )" + json_string(dir.path().string());

  const TrainConfig c = parse_train_config(init + R"(}, "data": {"path": "tokens.bin", "format": "uint16"}})",
                                           "test.json");
  EXPECT_EQ(c.init_from, dir.path().string());
  EXPECT_EQ(c.data_path, "tokens.bin");
  EXPECT_EQ(c.model.layers, 3);
  EXPECT_EQ(c.model.hidden, 96);
  EXPECT_EQ(c.model.heads, 6);
  EXPECT_EQ(c.model.vocab_size, 300);

  const std::string msg = config_error(init + R"(, "hidden": 192, "heads": 12}})");
  EXPECT_TRUE(contains(msg, "model.init_from")) << msg;
  EXPECT_TRUE(contains(config_error(init + R"(, "heads": 3}})"), "model.init_from"));
  // A directory without config.json.
  test::TempDir empty;
  const std::string missing = config_error(R"({"model": {"init_from": )" +
                                           json_string(empty.path().string()) + "}}");
  EXPECT_TRUE(contains(missing, "config.json")) << missing;
}

// A pretrained model with the default data (raw bytes, valid ids of any vocabulary) would be
// fine-tuned on text its tokenizer never made, silently: data.path must be given.
TEST(TrainConfig, InitFromNeedsDataPathGivenExplicitly) {
  test::TempDir dir;
  write_hf_config(dir.path(), models::preset("gpt2"));
  const std::string init = R"({"model": {"init_from": )" + json_string(dir.path().string()) + "}";
  for (const std::string& data : {std::string(""), std::string(R"(, "data": {"seq_len": 32})")}) {
    const std::string msg = config_error(init + data + "}");
    EXPECT_TRUE(contains(msg, "model.init_from is set but data.path is not")) << msg;
    EXPECT_TRUE(contains(msg, "strata data prepare")) << msg;
  }
  EXPECT_EQ(parse_train_config(init + R"(, "data": {"path": "/usr/share/common-licenses"}})", "t.json").data_path,
            "/usr/share/common-licenses");  // the default, but asked for
}

TEST(TrainConfig, InitFromRejectsALayersOverride) {
  test::TempDir dir;
  write_hf_config(dir.path(), models::preset("gpt2"));
  const std::string msg = config_error(R"({"model": {"init_from": )" +
                                       json_string(dir.path().string()) + R"(, "layers": 2}})");
  EXPECT_TRUE(contains(msg, "model.init_from")) << msg;
}

}  // namespace
}  // namespace strata::engine

namespace strata::engine {
namespace {

// A mixture of experts' keys reshape a preset's experts and switch its load-balancing loss; each
// refusal names the key.
TEST(TrainConfig, MixtureOfExpertsKeys) {
  const std::string base = R"({"model": {"preset": "mixtral-8x7b", "layers": 2, "hidden": 64, "heads": 4,
      "kv_heads": 2, "intermediate": 40, "vocab_size": 256, "experts": 5, "experts_per_token": 2)";
  const TrainConfig tc = parse_train_config(base + R"(, "output_router_logits": true, "router_aux_loss_coef": 0.02}})",
                                            "test.json");
  EXPECT_EQ(tc.model.moe.experts, 5);
  EXPECT_EQ(tc.model.moe.top_k, 2);
  EXPECT_EQ(tc.model.moe.intermediate, 40);  // Mixtral's experts are model.intermediate wide
  EXPECT_TRUE(tc.model.moe.add_aux_loss);
  EXPECT_DOUBLE_EQ(tc.model.moe.aux_loss_coef, 0.02);
  EXPECT_TRUE(contains(config_error(base + R"(, "experts_per_token": 6}})"), "between 1 and the 5 experts"));
  EXPECT_TRUE(contains(config_error(base + R"(, "expert_intermediate": 16}})"), "model.expert_intermediate"));
  EXPECT_TRUE(contains(config_error(base + R"(, "router_aux_loss_coef": -1}})"), "model.router_aux_loss_coef"));
  EXPECT_TRUE(contains(config_error(R"({"model": {"preset": "llama-1b", "experts": 4}})"),
                       "applies only to a mixture of experts"));
  // LoRA: the attention's linears; an expert's projection is no linear layer.
  EXPECT_NO_THROW(parse_train_config(base + R"(, "lora": {"r": 4, "target_modules": ["q_proj", "v_proj"]}}})", "t"));
  const std::string lora_experts = config_error(base + R"(, "lora": {"r": 4, "target_modules": ["w1"]}}})");
  EXPECT_TRUE(contains(lora_experts, "experts are no linear layers: adapt them with target_parameters"))
      << lora_experts;
  EXPECT_FALSE(contains(lora_experts, "mlp.gate_proj")) << "a Mixtral block has no dense MLP to list";
  // ...but a parameter, as PEFT's target_parameters names the fused expert tensors.
  EXPECT_NO_THROW(parse_train_config(
      base + R"(, "lora": {"r": 4, "target_modules": ["q_proj"], "target_parameters": ["mlp.experts.down_proj"]}}})",
      "t"));
  EXPECT_TRUE(contains(
      config_error(base + R"(, "lora": {"r": 4, "target_modules": [], "target_parameters": ["experts.w9"]}}})"),
      "names no expert tensor of the model"));
  EXPECT_TRUE(contains(config_error(base + R"(, "lora": {"r": 4, "target_modules": "all-linear"}}})"),
                       "\"all-linear\" to mean the experts and the router too"));
  EXPECT_TRUE(contains(config_error(R"({"model": {"preset": "llama-1b", "layers": 2, "lora": {"r": 4,
      "target_modules": [], "target_parameters": ["mlp.experts.down_proj"]}}})"),
                       "it has no mixture of experts"));
}

}  // namespace
}  // namespace strata::engine
