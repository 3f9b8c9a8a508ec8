// models::stage_parameters and forward_flops_per_token against the real modules: the planner
// sizes units without building the model, so its sizes must be the decoder's.
#include <gtest/gtest.h>

#include "strata/models/decoder.h"
#include "strata/models/model_shapes.h"

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
