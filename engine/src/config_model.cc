// model: the preset, a Hugging Face config.json or init_from, reshaped by the shape keys (a
// mixture of experts' too), LoRA (config_lora.cc) and what trains; read for parse_train_config
// (config_parse.cc).
#include <algorithm>
#include <exception>
#include <fstream>
#include <sstream>

#include "config_section.h"
#include "strata/engine/config.h"
#include "strata/engine/config_parse.h"
#include "strata/models/model_shapes.h"
#include "strata/models/trainable.h"
#include "strata/offload/object_store.h"

namespace strata::engine {

using config_json::json;
using config_json::Section;

namespace {

void read_experts(Section& s, TrainConfig& c);

// model's shape keys over the preset or config.json (refused with init_from, whose weights fix it).
void read_model_shape(Section& s, TrainConfig& c) {
  models::ModelConfig& mc = c.model;
  static const char* kShapeKeys[] = {"layers", "hidden", "heads", "kv_heads", "intermediate",
                                     "vocab_size", "max_positions", "tie_embeddings"};
  if (!c.init_from.empty())
    for (const char* k : kShapeKeys)
      if (s.get(k)) s.fail(k, "cannot be combined with model.init_from (the checkpoint fixes the shape)");
  int64_t layers = mc.layers, hidden = mc.hidden, heads = mc.heads, kv = -1, inter = -1,
          vocab = mc.vocab_size, maxpos = mc.max_positions;
  s.read("layers", layers);
  s.read("hidden", hidden);
  s.read("heads", heads);
  s.read("kv_heads", kv);
  s.read("intermediate", inter);
  s.read("vocab_size", vocab);
  s.read("max_positions", maxpos);
  s.read("tie_embeddings", mc.tie_embeddings);
  const bool reshaped = hidden != mc.hidden || heads != mc.heads;
  mc.layers = layers;
  mc.vocab_size = vocab;
  mc.max_positions = maxpos;
  if (reshaped) {
    if (heads <= 0 || hidden % heads != 0)
      s.fail("hidden", "must be a multiple of model.heads (head_dim = hidden / heads)");
    mc.hidden = hidden;
    mc.heads = heads;
    mc.head_dim = hidden / heads;
    if (kv < 0) mc.kv_heads = mc.arch == models::Arch::kGpt2 ? heads : std::min(mc.kv_heads, heads);
    if (inter < 0) mc.intermediate = 4 * hidden;
  }
  if (kv >= 0) mc.kv_heads = kv;
  if (inter >= 0) mc.intermediate = inter;
  read_experts(s, c);
  try {
    mc.validate();
  } catch (const std::exception& ex) {
    s.fail("", ex.what());
  }
}

// A mixture of experts' keys: its shape over the preset or config.json (experts,
// experts_per_token, expert_intermediate; refused with init_from, and for a dense model), and
// the load-balancing loss (output_router_logits, router_aux_loss_coef: as transformers names them,
// over config.json's).
void read_experts(Section& s, TrainConfig& c) {
  models::ModelConfig& mc = c.model;
  static const char* kExpertKeys[] = {"experts", "experts_per_token", "expert_intermediate",
                                      "output_router_logits", "router_aux_loss_coef"};
  if (!mc.moe.enabled()) {
    for (const char* k : kExpertKeys)
      if (s.get(k)) s.fail(k, "applies only to a mixture of experts (model type mixtral or qwen3_moe)");
    return;
  }
  for (const char* k : {"experts", "experts_per_token", "expert_intermediate"})
    if (!c.init_from.empty() && s.get(k)) s.fail(k, "cannot be combined with model.init_from (the checkpoint fixes the shape)");
  s.read("experts", mc.moe.experts);
  s.read("experts_per_token", mc.moe.top_k);
  // Mixtral's experts are intermediate_size wide: model.intermediate is their width.
  if (mc.hf_type == "mixtral") {
    if (s.get("expert_intermediate")) s.fail("expert_intermediate", "is model.intermediate for mixtral");
    mc.moe.intermediate = mc.intermediate;
  }
  s.read("expert_intermediate", mc.moe.intermediate);
  mc.moe.dense_layers.resize(mc.moe.dense_layers.empty() ? 0 : size_t(mc.layers), false);  // model.layers may have changed
  s.read("output_router_logits", mc.moe.add_aux_loss);
  s.read("router_aux_loss_coef", mc.moe.aux_loss_coef);
  if (mc.moe.aux_loss_coef < 0) s.fail("router_aux_loss_coef", "must be >= 0");
}

// model.trainable: the tensors that train ("all", or patterns over the Hugging Face names).
void read_trainable(Section& s, TrainConfig& c) {
  const models::ModelConfig& mc = c.model;
  if (const json* t = s.get("trainable")) {
    if (mc.lora.enabled()) s.fail("trainable", "cannot be combined with LoRA: the adapters (and model.lora's "
                                               "modules_to_save) train, the rest is frozen");
    const char* kind = "must be \"all\" or a list of tensor-name patterns (docs/CONFIG.md), not ";
    if (t->is_array()) {
      if (t->empty()) s.fail("trainable", "is an empty list: nothing would train (\"all\" trains everything)");
      for (const json& p : *t) {
        if (!p.is_string()) s.fail("trainable", kind + p.dump());
        c.engine.trainable.push_back(p.get<std::string>());
      }
    } else if (!t->is_string() || t->get<std::string>() != "all") {
      s.fail("trainable", kind + t->dump());
    }
    try {
      models::TrainableTensors(c.engine.trainable).check_against(models::tensor_names(mc));
    } catch (const std::exception& ex) {
      s.fail("", ex.what());
    }
  }
}

}  // namespace

// model: the preset, a Hugging Face config.json or init_from, reshaped by the shape keys; LoRA,
// and what trains.
void read_model(Section& s, TrainConfig& c) {
  std::string preset_name = "gpt2", hf_config;
  s.read("preset", preset_name);
  s.read("hf_config", hf_config);
  s.read("init_from", c.init_from);
  s.read("seed", c.init_seed);
  const char* source_key = "preset";
  if (!c.init_from.empty()) {
    if (!hf_config.empty()) s.fail("hf_config", "cannot be combined with init_from");
    hf_config = c.init_from + "/config.json";
    source_key = "init_from";
  } else if (!hf_config.empty()) {
    source_key = "hf_config";
  }
  json saved;  // init_from's quantization_config: a checkpoint saved in 4 bits
  try {
    if (hf_config.empty()) {
      c.model = models::preset(preset_name);
    } else {
      std::string text;
      if (offload::is_object_store_url(c.init_from)) {
        // A model in a bucket: its config.json read from there (the weights are fetched later).
        const std::vector<std::byte> bytes = offload::open_object_store(c.init_from)->get_all("config.json");
        text.assign(reinterpret_cast<const char*>(bytes.data()), bytes.size());
      } else {
        std::ifstream in(hf_config);
        if (!in) throw std::invalid_argument(hf_config + ": cannot open");
        std::stringstream ss;
        ss << in.rdbuf();
        text = ss.str();
      }
      c.model = models::parse_hf_config(text, hf_config);
      if (!c.init_from.empty()) saved = json::parse(text).value("quantization_config", json());
    }
  } catch (const std::exception& ex) {
    s.fail(source_key, ex.what());
  }
  read_model_shape(s, c);
  read_lora(s, c);
  read_trainable(s, c);
  read_quantize(s, c, saved.is_object() ? &saved : nullptr);
}

}  // namespace strata::engine
