// Block tiles (Decoder::set_block_tiling) against the whole blocks: the same initial weights at
// every tiling, the same logits and gradients (to fp32 summation order), values carried over
// when a loaded model is cut, every tensor element held by exactly one tile, and
// model_shapes' sizes equal to the tiles'. Awkward sizes: head groups and intermediate slices
// that do not divide evenly, grouped-query attention, biases.
#include <gtest/gtest.h>
#include <torch/autograd.h>

#include <map>

#include "strata/models/decoder.h"
#include "strata/models/model_shapes.h"

namespace strata::models {
namespace {

ModelConfig small(const std::string& base, bool biases) {
  ModelConfig c = preset(base);
  c.layers = 2;
  c.hidden = 96;
  c.heads = 6;
  c.kv_heads = base == "gpt2" ? 6 : 3;
  c.head_dim = 16;
  c.intermediate = 203;
  c.vocab_size = 131;
  c.max_positions = 64;
  c.tie_embeddings = base == "gpt2";
  c.attention_bias = c.attention_out_bias = c.mlp_bias = biases && base != "gpt2";
  c.validate();
  return c;
}

// Every parameter assembled into its whole Hugging Face tensor (an untiled model's own).
std::map<std::string, at::Tensor> whole_tensors(Decoder& m, bool grads = false) {
  std::map<std::string, at::Tensor> out;
  std::map<std::string, int64_t> filled;
  for (Stage* st : m.stages()) {
    const auto params = st->hf_parameters();
    for (size_t k = 0; k < params.size(); ++k) {
      const TensorPart& p = st->parts()[k];
      at::Tensor& w = out[p.tensor];
      if (!w.defined()) w = at::full(p.shape, std::nan(""), at::kFloat);
      const at::Tensor src = grads ? params[k].second.grad() : params[k].second;
      w.narrow(p.dim, p.begin, p.end - p.begin).copy_(src);
      filled[p.tensor] += src.numel();
    }
  }
  for (auto& [name, t] : out) EXPECT_EQ(filled[name], t.numel()) << name << " is not covered exactly once";
  return out;
}

double rel(const at::Tensor& a, const at::Tensor& b) {
  return (a - b).abs().max().item<double>() / std::max(1e-30, b.abs().max().item<double>());
}

struct Cut {
  int64_t attention, mlp;
};

TEST(BlockTiles, SameWeightsLogitsAndGradientsAsWholeBlocks) {
  for (const std::string base : {"gpt2", "llama-1b"}) {
    for (bool biases : {false, true}) {
      if (base == "gpt2" && biases) continue;
      const ModelConfig c = small(base, biases);
      const at::Tensor ids = at::randint(0, c.vocab_size, {2, 37}, at::kLong);
      Decoder whole(c, 7);
      at::Tensor ref = whole.forward(ids);
      ref.square().mean().backward();
      const auto w0 = whole_tensors(whole), g0 = whole_tensors(whole, true);
      for (Cut cut : {Cut{1, 3}, Cut{2, 1}, Cut{3, 4}, Cut{c.kv_heads, 203}}) {
        SCOPED_TRACE(base + (biases ? " with biases" : "") + ", " + std::to_string(cut.attention) + " x " +
                     std::to_string(cut.mlp) + " tiles");
        Decoder tiled(c, 7, Decoder::Init::kDeferred);
        tiled.set_block_tiling({cut.attention, cut.mlp});
        ASSERT_EQ(tiled.stages().size(), 2 + size_t(c.layers) * size_t(cut.attention + cut.mlp));
        tiled.initialize_through(tiled.stages().size() - 1);
        // The same initial weights, bit for bit.
        const auto w1 = whole_tensors(tiled);
        ASSERT_EQ(w1.size(), w0.size());
        for (const auto& [name, t] : w0) EXPECT_TRUE(at::equal(w1.at(name), t)) << name;
        // The same logits and gradients, to fp32 summation order.
        at::Tensor out = tiled.forward(ids);
        EXPECT_LT(rel(out, ref), 1e-5);
        out.square().mean().backward();
        const auto g1 = whole_tensors(tiled, true);
        for (const auto& [name, t] : g0) EXPECT_LT(rel(g1.at(name), t), 1e-4) << name;
        // model_shapes sizes the tiles as the modules are.
        const std::vector<uint64_t> predicted = stage_parameters(c, {cut.attention, cut.mlp});
        const std::vector<uint64_t> widths = stage_input_widths(c, {cut.attention, cut.mlp});
        const std::vector<Stage*> stages = tiled.stages();
        ASSERT_EQ(predicted.size(), stages.size());
        ASSERT_EQ(widths.size(), stages.size());
        at::Tensor x = tiled.embedding().forward(ids);
        for (size_t s = 0; s < stages.size(); ++s) {
          uint64_t n = 0;
          for (auto& [name, t] : stages[s]->hf_parameters()) n += uint64_t(t.numel());
          EXPECT_EQ(predicted[s], n) << tiled.stage_name(s);
          if (s >= 1 && s + 1 < stages.size()) {
            EXPECT_EQ(widths[s], uint64_t(x.numel() / (2 * 37 * c.hidden))) << tiled.stage_name(s);
            x = stages[s]->forward(x);
          }
        }
      }
    }
  }
}

TEST(BlockTiles, CuttingALoadedModelKeepsItsValuesAndJoiningRestoresThem) {
  const ModelConfig c = small("llama-1b", true);
  Decoder m(c, 3);
  {
    at::NoGradGuard g;
    for (auto& [name, t] : m.hf_parameters()) t.uniform_(-1, 1);  // not the seed's values
  }
  const auto before = whole_tensors(m);
  const at::Tensor ids = at::randint(0, c.vocab_size, {1, 19}, at::kLong);
  const at::Tensor ref = m.forward(ids).detach();
  m.set_block_tiling({2, 5});
  EXPECT_EQ(m.stage_name(0), "embedding");
  EXPECT_EQ(m.stage_name(1), "block.0.attn.0");
  EXPECT_EQ(m.stage_name(4), "block.0.mlp.1");
  EXPECT_EQ(m.stage_name(8), "block.1.attn.0");
  EXPECT_EQ(m.stage_name(15), "head");
  EXPECT_THROW(m.hf_parameters(), std::logic_error);
  EXPECT_THROW(m.block(0), std::logic_error);
  const auto cut = whole_tensors(m);
  for (const auto& [name, t] : before) EXPECT_TRUE(at::equal(cut.at(name), t)) << name;
  EXPECT_LT(rel(m.forward(ids).detach(), ref), 1e-5);
  m.set_block_tiling({1, 1});
  const auto joined = whole_tensors(m);
  for (const auto& [name, t] : before) EXPECT_TRUE(at::equal(joined.at(name), t)) << name;
  EXPECT_TRUE(at::equal(m.forward(ids).detach(), ref));
  EXPECT_THROW(m.set_block_tiling({4, 1}), std::invalid_argument);  // 3 key/value heads
  EXPECT_THROW(m.set_block_tiling({1, 0}), std::invalid_argument);
}

}  // namespace
}  // namespace strata::models
