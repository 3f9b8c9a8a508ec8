// models::stage_parameters and forward_flops_per_token against the real modules: the planner
// sizes units without building the model, so its sizes must be the decoder's.
#include <gtest/gtest.h>

#include "strata/models/decoder.h"
#include "strata/models/model_shapes.h"
#include "strata/models/trainable.h"

#include <algorithm>
#include <cmath>

namespace strata::models {
namespace {

ModelConfig small(const std::string& base, bool tied, bool biases) {
  ModelConfig c = preset(base);
  c.layers = 3;
  c.hidden = 96;
  c.heads = 6;
  c.kv_heads = base == "gpt2" ? 6 : 2;
  c.head_dim = 16;
  c.intermediate = 200;
  c.vocab_size = 307;
  c.max_positions = 64;
  c.tie_embeddings = tied;
  c.attention_bias = c.attention_out_bias = c.mlp_bias = biases && base != "gpt2";
  c.validate();
  return c;
}

TEST(ModelShapes, StageParametersAreTheDecodersStages) {
  for (const ModelConfig& c : {small("gpt2", true, false), small("gpt2", false, false), small("llama-1b", true, false),
                               small("llama-1b", false, true)}) {
    Decoder m(c, 1, Decoder::Init::kDeferred);
    const std::vector<uint64_t> predicted = stage_parameters(c);
    const std::vector<Stage*> stages = m.stages();
    ASSERT_EQ(predicted.size(), stages.size());
    uint64_t total = 0;
    for (size_t s = 0; s < stages.size(); ++s) {
      uint64_t n = 0;
      for (auto& [name, t] : stages[s]->hf_parameters()) n += uint64_t(t.numel());
      EXPECT_EQ(predicted[s], n) << c.name << " stage " << s << (c.tie_embeddings ? " tied" : " untied");
      total += predicted[s];
    }
    EXPECT_EQ(total, uint64_t(c.parameters()));
  }
}

// stage_tensors names each stage's tensors as the decoder's stages do, in their order, with the
// sizes of their parts; unit_shapes splits each stage by model.trainable as the engine does.
TEST(ModelShapes, StageTensorsAreTheDecodersTensorsInEveryCut) {
  for (const ModelConfig& c : {small("gpt2", true, false), small("gpt2", false, false), small("llama-1b", true, false),
                               small("llama-1b", false, true)}) {
    for (const LayerTiles& t : {LayerTiles{}, LayerTiles{2, 3, 2}}) {
      Decoder m(c, 1, Decoder::Init::kDeferred);
      m.set_tiles(t);
      const auto predicted = stage_tensors(c, t);
      const std::vector<Stage*> stages = m.stages();
      ASSERT_EQ(predicted.size(), stages.size());
      for (size_t s = 0; s < stages.size(); ++s) {
        const auto named = stages[s]->hf_parameters();
        ASSERT_EQ(predicted[s].size(), named.size()) << c.name << " stage " << s;
        for (size_t k = 0; k < named.size(); ++k) {
          EXPECT_EQ(predicted[s][k].tensor, stages[s]->parts()[k].tensor) << "stage " << s << " tensor " << k;
          EXPECT_EQ(predicted[s][k].numel, uint64_t(named[k].second.numel())) << named[k].first;
        }
      }
      // Split by a selection: each stage's trainable and frozen elements, and the tied head's
      // use of the unit holding the token rows.
      const TrainableTensors trains({"*.h.{1-2}.*", "*layers.{1-2}.*", "*.ln_f.*", "*wpe*", "model.norm.weight"});
      const UnitShapes u = unit_shapes(c, t, trains);
      const StageLayout L = stage_layout(c, t);
      size_t next = 0;
      for (size_t s = 0; s < stages.size(); ++s) {
        uint64_t live = 0, frozen = 0;
        for (const StageTensor& x : predicted[s]) (trains.trainable(x.tensor) ? live : frozen) += x.numel;
        for (const int f : {0, 1}) {
          const uint64_t want = f ? frozen : live;
          if (want == 0) continue;
          ASSERT_LT(next, u.numel.size());
          EXPECT_EQ(u.numel[next], want);
          EXPECT_EQ(int(u.frozen[next]), f);
          EXPECT_EQ(u.stage[next], s);
          ++next;
        }
      }
      EXPECT_EQ(next, u.numel.size());
      if (c.tie_embeddings)
        for (size_t j = 0; j < L.head; ++j) {
          const size_t rows = u.stage_units[L.first_head() + j].back();
          EXPECT_TRUE(u.frozen[rows]) << "the token rows are frozen: the tied head uses that unit";
          EXPECT_EQ(u.stage[rows], j);
        }
      // Everything trainable: the stage_parameters cut.
      const UnitShapes all = unit_shapes(c, t, TrainableTensors());
      EXPECT_EQ(all.stage_units, stage_units(c, t));
      EXPECT_EQ(std::count(all.frozen.begin(), all.frozen.end(), 1), 0);
    }
  }
}

// LoRA adapters: each targeted linear of every block gets A [r, in] and B [out, r] after the
// block's other tensors, as the decoder's stages hold them; PEFT's initialization (A within
// 1 / sqrt(in), B zero); with block tiles, held by the first tile of their part, used by the rest.
TEST(ModelShapes, LoraAdaptersAreTheDecodersTensors) {
  for (ModelConfig c : {small("gpt2", true, false), small("llama-1b", false, true)}) {
    c.lora.r = 4;
    c.lora.alpha = 8;
    c.lora.target_modules = {"c_attn", "mlp.c_proj", "q_proj", "v_proj", "down_proj"};
    Decoder m(c, 1);
    const auto predicted = stage_tensors(c);
    const std::vector<Stage*> stages = m.stages();
    ASSERT_EQ(predicted.size(), stages.size());
    size_t adapters = 0;
    for (size_t s = 0; s < stages.size(); ++s) {
      const auto named = stages[s]->hf_parameters();
      ASSERT_EQ(predicted[s].size(), named.size()) << c.name << " stage " << s;
      for (size_t k = 0; k < named.size(); ++k) {
        EXPECT_EQ(predicted[s][k].tensor, named[k].first);
        EXPECT_EQ(predicted[s][k].numel, uint64_t(named[k].second.numel())) << named[k].first;
        if (!is_adapter_tensor(named[k].first)) continue;
        ++adapters;
        const at::Tensor& t = named[k].second;
        if (named[k].first.ends_with("lora_B.weight")) {
          EXPECT_EQ(t.abs().max().item<double>(), 0.0) << named[k].first;
        } else {
          const double bound = 1.0 / std::sqrt(double(t.size(1)));
          EXPECT_LE(t.abs().max().item<double>(), bound) << named[k].first;
          EXPECT_GT(t.abs().max().item<double>(), 0.5 * bound) << named[k].first;
        }
      }
    }
    // GPT-2: c_attn and the MLP's c_proj (not attn.c_proj); Llama: q, v and down.
    EXPECT_EQ(adapters, size_t(2 * (c.arch == Arch::kGpt2 ? 2 : 3) * c.layers));
    EXPECT_EQ(stage_parameters(c)[1], uint64_t(c.block_parameters()) + [&] {
      uint64_t n = 0;
      for (const AdapterShape& a : block_adapters(c, 0)) n += uint64_t(c.lora.r * (a.in + a.out));
      return n;
    }());
    // Block tiles: the engine's units (model.trainable = the adapters): the first tile of each
    // part holds its adapters in its trainable unit, which the part's later tiles use too.
    const LayerTiles t{2, 3};
    const UnitShapes u = unit_shapes(c, t, TrainableTensors(adapter_patterns()));
    const StageLayout L = stage_layout(c, t);
    for (size_t s = L.first_block(); s < L.first_head(); ++s) {
      const int64_t at = int64_t(s - L.first_block()) % t.block_stages();
      const bool attention = at < t.attention;
      const size_t first = s - size_t(attention ? at : at - t.attention);
      uint64_t adapters = 0;
      for (const AdapterShape& a : block_adapters(c, 0, attention ? BlockPart::kAttention : BlockPart::kMlp))
        adapters += uint64_t(c.lora.r * (a.in + a.out));
      ASSERT_GT(adapters, 0u);
      const size_t trains = u.stage_units[first].at(0);
      EXPECT_FALSE(u.frozen[trains]);
      EXPECT_EQ(u.numel[trains], adapters) << stage_name(c, t, s);
      if (s == first) {
        EXPECT_EQ(u.stage_units[s].size(), 2u) << stage_name(c, t, s) << ": its adapters, then its frozen base";
      } else {
        EXPECT_EQ(u.stage_units[s].size(), 2u) << stage_name(c, t, s) << ": its frozen base, then the first's adapters";
        EXPECT_TRUE(u.frozen[u.stage_units[s][0]]);
        EXPECT_EQ(u.stage_units[s][1], trains);
      }
    }
  }
}

TEST(TrainableTensors, PatternsMatchWholeNamesWithGlobsAndLayerRanges) {
  EXPECT_TRUE(TrainableTensors::matches("model.layers.*.mlp.*", "model.layers.12.mlp.up_proj.weight"));
  EXPECT_FALSE(TrainableTensors::matches("model.layers.*.mlp.*", "model.layers.12.self_attn.q_proj.weight"));
  EXPECT_TRUE(TrainableTensors::matches("lm_head.weight", "lm_head.weight"));
  EXPECT_FALSE(TrainableTensors::matches("lm_head", "lm_head.weight")) << "a pattern matches the whole name";
  EXPECT_TRUE(TrainableTensors::matches("*", "anything.at.all"));
  EXPECT_TRUE(TrainableTensors::matches("model.layers.{0-11}.*", "model.layers.11.mlp.up_proj.weight"));
  EXPECT_TRUE(TrainableTensors::matches("model.layers.{0-11}.*", "model.layers.0.input_layernorm.weight"));
  EXPECT_FALSE(TrainableTensors::matches("model.layers.{0-11}.*", "model.layers.12.mlp.up_proj.weight"));
  EXPECT_FALSE(TrainableTensors::matches("model.layers.{0-11}.*", "model.layers.110.mlp.up_proj.weight"));
  EXPECT_TRUE(TrainableTensors::matches("model.layers.{10-10}{0-9}.*", "model.layers.105.mlp.up_proj.weight"))
      << "a range may stop inside a run of digits";
  const TrainableTensors t({"model.layers.{2-3}.*", "lm_head.weight"});
  EXPECT_TRUE(t.trainable("model.layers.3.mlp.down_proj.weight"));
  EXPECT_FALSE(t.trainable("model.layers.4.mlp.down_proj.weight"));
  EXPECT_FALSE(t.trainable("model.embed_tokens.weight"));
  EXPECT_TRUE(TrainableTensors().trainable("model.embed_tokens.weight"));
  for (const char* bad : {"model.layers.{2-}.*", "model.layers.{3-2}.*", "model.layers.{2-3.*", "a}", ""})
    EXPECT_THROW(TrainableTensors({bad}), std::invalid_argument) << bad;
  const std::vector<std::string> names = tensor_names(small("llama-1b", false, false));
  EXPECT_NO_THROW(t.check_against(names));
  EXPECT_THROW(TrainableTensors({"model.layers.{5-9}.*"}).check_against(names), std::invalid_argument);
}

// The published formula for GPT shapes (Narayanan et al., SC21, eq. 3 without its factor 3 for
// forward + backward): 24 s l h^2 (1 + s / 6h + V / 12 l h) a sequence's forward.
TEST(ModelShapes, ForwardFlopsMatchMegatronsFormula) {
  ModelConfig c = preset("gpt2");
  c.hidden = 2304;
  c.heads = 24;
  c.kv_heads = 24;
  c.head_dim = 96;
  c.intermediate = 4 * 2304;
  c.layers = 24;
  c.vocab_size = 51200;
  const double s = 2048, h = 2304, l = 24, V = 51200;
  const double megatron = 24 * s * l * h * h * (1 + s / (6 * h) + V / (12 * l * h));
  const double ours = forward_flops_per_token(c, 2048).total() * s;
  EXPECT_NEAR(ours / megatron, 1.0, 1e-12);
}

}  // namespace
}  // namespace strata::models
