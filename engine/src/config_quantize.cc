// model.quantize, read for parse_train_config (config_parse.cc): a 4-bit frozen base in
// bitsandbytes' BitsAndBytesConfig vocabulary (its to_dict() is accepted as written), checked
// against the model and what trains.
#include <algorithm>
#include <exception>

#include "config_section.h"
#include "strata/engine/config.h"
#include "strata/engine/config_parse.h"
#include "strata/models/model_shapes.h"
#include "strata/models/trainable.h"

namespace strata::engine {

using config_json::json;
using config_json::Section;

namespace {

// BitsAndBytesConfig's keys from `k` into `q` and `compute_dtype` (as to_dict() writes them); false
// when they write 4-bit quantization out and off. Refuses another method and 8 bits.
bool read_bnb_keys(Section& k, models::QuantizedBase& q, std::string& compute_dtype) {
  bool load_in_8bit = false, private_4bit = true, private_8bit = false;
  std::string method = "bitsandbytes", storage = "uint8";
  k.read("quant_method", method);
  k.read("load_in_4bit", q.load_in_4bit);
  k.read("_load_in_4bit", private_4bit);
  k.read("load_in_8bit", load_in_8bit);
  k.read("_load_in_8bit", private_8bit);
  k.read("bnb_4bit_quant_type", q.quant_type);
  k.read("bnb_4bit_use_double_quant", q.double_quant);
  k.read("bnb_4bit_compute_dtype", compute_dtype);
  k.read("bnb_4bit_quant_storage", storage);
  if (const json* skip = k.get("llm_int8_skip_modules"); skip && !skip->is_null()) {
    if (!skip->is_array()) k.fail("llm_int8_skip_modules", "must be a list of module names or null");
    q.skip_modules.clear();
    for (const json& m : *skip) {
      if (!m.is_string()) k.fail("llm_int8_skip_modules", "must hold module names, not " + m.dump());
      q.skip_modules.push_back(m.get<std::string>());
    }
  }
  // 8-bit settings BitsAndBytesConfig.to_dict() writes beside the 4-bit ones; they change nothing here.
  k.get("llm_int8_threshold");
  k.get("llm_int8_has_fp16_weight");
  k.get("llm_int8_enable_fp32_cpu_offload");
  if (method != "bitsandbytes") k.fail("quant_method", "must be \"bitsandbytes\" (the only quantization Strata loads)");
  if (load_in_8bit || private_8bit) k.fail("load_in_8bit", "is not supported: Strata's quantized base is 4-bit");
  if (!q.load_in_4bit) return false;
  if (!private_4bit) k.fail("_load_in_4bit", "contradicts load_in_4bit");
  if (q.quant_type != "nf4" && q.quant_type != "fp4")
    k.fail("bnb_4bit_quant_type", "must be \"nf4\" or \"fp4\", not \"" + q.quant_type + "\"");
  if (storage != "uint8")
    k.fail("bnb_4bit_quant_storage", "must be \"uint8\" (Strata shards the 4-bit bytes itself), not \"" + storage + "\"");
  return true;
}

}  // namespace

void read_quantize(Section& s, TrainConfig& c, const json* saved) {
  models::QuantizedBase& q = c.model.quantize;
  // A base saved in 4 bits (init_from's quantization_config): its settings are the default, and
  // model.quantize may repeat them (its compute dtype and skipped modules are the run's).
  models::QuantizedBase from_checkpoint;
  if (saved) {
    Section sk(*saved, "init_from's config.json quantization_config", s.source());
    std::string ignored_compute;
    if (!read_bnb_keys(sk, from_checkpoint, ignored_compute))
      sk.fail("load_in_4bit", "is false: the checkpoint is not saved in 4 bits");
    for (auto it = saved->begin(); it != saved->end(); ++it) sk.get(it.key());  // keys of newer versions
  }
  const json* v = s.get("quantize");
  if (!v && !saved) return;
  const json none = json::object();
  Section k(v ? *v : none, v ? "model.quantize" : "model.init_from (saved in 4 bits)", s.source());
  if (!v) {
    q = from_checkpoint;
    // Strata keeps the head in the compute dtype; a head saved in 4 bits loads dequantized.
    if (std::find(q.skip_modules.begin(), q.skip_modules.end(), "lm_head") == q.skip_modules.end())
      q.skip_modules.push_back("lm_head");
  } else if (!read_bnb_keys(k, q, c.quantize_compute_dtype)) {
    if (saved) k.fail("load_in_4bit", "cannot be false: init_from is saved in 4 bits (" + from_checkpoint.describe() + ")");
    if (v->size() > 0 && v->contains("load_in_4bit")) return;  // quantization written out and off
    k.fail("load_in_4bit", "must be true (model.quantize describes a 4-bit base)");
  } else if (saved && (q.quant_type != from_checkpoint.quant_type || q.double_quant != from_checkpoint.double_quant)) {
    k.fail(q.quant_type != from_checkpoint.quant_type ? "bnb_4bit_quant_type" : "bnb_4bit_use_double_quant",
           "differs from init_from's, which is saved in 4 bits (" + from_checkpoint.describe() +
               "): leave model.quantize out, or repeat its settings");
  }
  bool keeps_head = false;
  for (const std::string& m : q.skip_modules) keeps_head = keeps_head || m == "lm_head";
  if (!keeps_head)
    k.fail("llm_int8_skip_modules", "must name \"lm_head\": Strata keeps the head in the compute dtype (as "
                                    "transformers does by default)");
  const models::ModelConfig& mc = c.model;
  if (mc.arch == models::Arch::kGpt2 || mc.moe.enabled())
    k.fail("load_in_4bit", "a 4-bit base is supported for the Llama family's dense models (llama, mistral, qwen2, "
                           "qwen3, gemma, gemma2), not " + (mc.arch == models::Arch::kGpt2 ? std::string("gpt2") : mc.hf_type));
  if (c.engine.trainable.empty())
    k.fail("load_in_4bit", "needs a frozen base: a 4-bit weight cannot train; set model.lora (or model.trainable)");
  try {
    q.skips("");  // every pattern a regular expression
  } catch (const std::exception& ex) {
    k.fail("llm_int8_skip_modules", ex.what());
  }
  // Something must be stored in 4 bits: a frozen block linear no skip pattern keeps.
  const models::TrainableTensors trains(c.engine.trainable);
  bool any = false;
  for (const std::string& t : models::tensor_names(mc)) any = any || (!trains.trainable(t) && models::stored_4bit(mc, t));
  if (!any)
    k.fail("load_in_4bit", "quantizes nothing: every block linear's weight trains or is in llm_int8_skip_modules");
}

}  // namespace strata::engine
