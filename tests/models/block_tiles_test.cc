// Block and vocabulary tiles (Decoder::set_tiles) against the whole model: the same initial weights at
// every tiling, the same logits and gradients (to fp32 summation order), values carried over
// when a loaded model is cut, every tensor element held by exactly one tile, and
// model_shapes' sizes equal to the tiles', LoRA adapters shared by the tiles. Awkward sizes: head groups and intermediate slices
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
  int64_t attention, mlp, vocab;
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
      for (Cut cut : {Cut{1, 3, 1}, Cut{2, 1, 3}, Cut{3, 4, 2}, Cut{c.kv_heads, 203, 1}, Cut{1, 1, 5}, Cut{1, 1, 131}}) {
        SCOPED_TRACE(base + (biases ? " with biases" : "") + ", " + std::to_string(cut.attention) + " x " +
                     std::to_string(cut.mlp) + " x " + std::to_string(cut.vocab) + " tiles");
        Decoder tiled(c, 7, Decoder::Init::kDeferred);
        const LayerTiles t{cut.attention, cut.mlp, cut.vocab};
        tiled.set_tiles(t);
        const StageLayout layout = stage_layout(c, t);
        ASSERT_EQ(tiled.stages().size(), layout.stages());
        ASSERT_EQ(layout.blocks, size_t(c.layers) * size_t(t.block_stages()));
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
        const std::vector<uint64_t> predicted = stage_parameters(c, t);
        const std::vector<uint64_t> widths = stage_input_widths(c, t);
        const std::vector<Stage*> stages = tiled.stages();
        ASSERT_EQ(predicted.size(), stages.size());
        ASSERT_EQ(widths.size(), stages.size());
        at::NoGradGuard no_grad;
        at::Tensor x = stages[0]->forward(ids);
        for (size_t s = 1; s < layout.first_block(); ++s) x = x + stages[s]->forward(ids);
        // The embedding's tiles sum to the whole lookup exactly.
        EXPECT_TRUE(at::equal(x, whole.embedding().forward(ids)));
        for (size_t s = 0; s < stages.size(); ++s) {
          uint64_t n = 0;
          for (auto& [name, p] : stages[s]->hf_parameters()) n += uint64_t(p.numel());
          EXPECT_EQ(predicted[s], n) << tiled.stage_name(s);
          if (s >= layout.first_block() && s < layout.first_head()) {
            EXPECT_EQ(widths[s], uint64_t(x.numel() / (2 * 37 * c.hidden))) << tiled.stage_name(s);
            x = stages[s]->forward(x);
          }
        }
      }
    }
  }
}

// LoRA with block tiles: the attention's adapters are whole tensors of the first attention tile,
// the MLP's of the first MLP tile, and every later tile uses them (its rows of B where it splits
// the output, its columns of A where it splits the input). With B not zero, the tiled model's
// logits and every gradient (the adapters' summed over the tiles that use them) are the whole
// blocks'; adapters of one part only (the MLP's) leave the attention tiles without any.
TEST(BlockTiles, LoraAdaptersSharedByTilesGiveTheWholeBlocksLogitsAndGradients) {
  struct Case {
    std::string base;
    bool biases;
    std::vector<std::string> targets;
  };
  for (const Case& k : {Case{"gpt2", false, {"c_attn", "attn.c_proj", "c_fc", "mlp.c_proj"}},
                        Case{"llama-1b", true, {"all-linear"}}, Case{"llama-1b", false, {"up_proj", "down_proj"}}}) {
    ModelConfig c = small(k.base, k.biases);
    c.lora.r = 5;
    c.lora.alpha = 7;
    c.lora.target_modules = k.targets;
    const auto nonzero_b = [](Decoder& m) {  // B not zero, the same values in every model
      at::NoGradGuard g;
      for (Stage* st : m.stages())
        for (auto& [name, t] : st->hf_parameters())
          if (name.ends_with("lora_B.weight"))
            t.copy_(at::sin(at::arange(t.numel(), at::kFloat) * 0.37 + double(name.size())).view(t.sizes()) * 0.1);
    };
    const at::Tensor ids = at::randint(0, c.vocab_size, {2, 29}, at::kLong);
    Decoder whole(c, 5);
    nonzero_b(whole);
    at::Tensor ref = whole.forward(ids);
    ref.square().mean().backward();
    const auto w0 = whole_tensors(whole), g0 = whole_tensors(whole, true);
    for (Cut cut : {Cut{2, 3, 1}, Cut{c.kv_heads, 1, 2}, Cut{1, 4, 1}}) {
      SCOPED_TRACE(k.base + " " + k.targets[0] + ", " + std::to_string(cut.attention) + " x " +
                   std::to_string(cut.mlp) + " tiles");
      Decoder tiled(c, 5);
      nonzero_b(tiled);
      const LayerTiles t{cut.attention, cut.mlp, cut.vocab};
      tiled.set_tiles(t);
      const auto w1 = whole_tensors(tiled);
      ASSERT_EQ(w1.size(), w0.size());
      for (const auto& [name, x] : w0) EXPECT_TRUE(at::equal(w1.at(name), x)) << name;
      at::Tensor out = tiled.forward(ids);
      EXPECT_LT(rel(out, ref), 1e-5);
      out.square().mean().backward();
      const auto g1 = whole_tensors(tiled, true);
      size_t adapters = 0;
      for (const auto& [name, x] : g0) {
        EXPECT_LT(rel(g1.at(name), x), 1e-4) << name;
        adapters += is_adapter_tensor(name);
      }
      EXPECT_EQ(adapters, 2 * block_adapters(c, 0).size() * size_t(c.layers));
      // Who holds and who uses them: each adapter owned by its part's first tile (its parts(),
      // as model_shapes says), used by every tile of that part (the same tensor).
      const std::vector<Stage*> stages = tiled.stages();
      const StageLayout L = stage_layout(c, t);
      const auto tensors = stage_tensors(c, t);
      for (size_t s = L.first_block(); s < L.first_head(); ++s) {
        const int64_t at = int64_t(s - L.first_block()) % t.block_stages();
        const bool attention = at < t.attention, first = at == 0 || at == t.attention;
        const std::vector<AdapterShape> own = block_adapters(c, 0, attention ? BlockPart::kAttention : BlockPart::kMlp);
        size_t held = 0;
        for (const TensorPart& p : stages[s]->parts()) held += is_adapter_tensor(p.tensor);
        EXPECT_EQ(held, first ? 2 * own.size() : 0) << tiled.stage_name(s);
        ASSERT_EQ(tensors[s].size(), stages[s]->parts().size()) << tiled.stage_name(s);
        for (size_t j = 0; j < tensors[s].size(); ++j) EXPECT_EQ(tensors[s][j].tensor, stages[s]->parts()[j].tensor);
        const size_t owner = s - size_t(attention ? at : at - t.attention);
        const auto owned = stages[owner]->hf_parameters();
        size_t used = 0;
        for (const at::Tensor& p : stages[s]->parameters())
          for (const auto& [name, x] : owned)
            if (is_adapter_tensor(name) && p.unsafeGetTensorImpl() == x.unsafeGetTensorImpl()) ++used;
        EXPECT_EQ(used, 2 * own.size()) << tiled.stage_name(s) << " uses its part's adapters";
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
  m.set_tiles({2, 5});
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
  m.set_tiles({1, 1});
  const auto joined = whole_tensors(m);
  for (const auto& [name, t] : before) EXPECT_TRUE(at::equal(joined.at(name), t)) << name;
  EXPECT_TRUE(at::equal(m.forward(ids).detach(), ref));
  EXPECT_THROW(m.set_tiles({4, 1}), std::invalid_argument);  // 3 key/value heads
  EXPECT_THROW(m.set_tiles({1, 0}), std::invalid_argument);
  EXPECT_THROW(m.set_tiles({1, 1, 0}), std::invalid_argument);
  EXPECT_THROW(m.set_tiles({1, 1, 132}), std::invalid_argument);  // 131 vocabulary rows
}

// The vocabulary cut (embedding and LM head in row ranges) of a loaded model, tied (GPT-2) and
// untied: every value carried over, named tiles, the whole logits again, and joined back bit
// for bit; a tied head tile uses its embedding tile's rows (the same tensor), and after the first
// owns nothing.
TEST(VocabTiles, CuttingALoadedModelKeepsItsValuesAndJoiningRestoresThem) {
  for (const std::string base : {"gpt2", "llama-1b"}) {
    SCOPED_TRACE(base);
    const ModelConfig c = small(base, false);
    Decoder m(c, 3);
    {
      at::NoGradGuard g;
      for (auto& [name, t] : m.hf_parameters()) t.uniform_(-1, 1);
    }
    const auto before = whole_tensors(m);
    const at::Tensor ids = at::randint(0, c.vocab_size, {2, 19}, at::kLong);
    const at::Tensor ref = m.forward(ids).detach();
    m.set_tiles({1, 2, 4});
    EXPECT_EQ(m.stage_name(0), "embedding.0");
    EXPECT_EQ(m.stage_name(3), "embedding.3");
    EXPECT_EQ(m.stage_name(4), "block.0.attn.0");
    EXPECT_EQ(m.stage_name(10), "head.0");
    EXPECT_EQ(m.stage_name(13), "head.3");
    EXPECT_THROW(m.embedding(), std::logic_error);
    EXPECT_THROW(m.head(), std::logic_error);
    EXPECT_THROW(m.head_tile(1).normed(ref), std::logic_error);
    EXPECT_EQ(m.head_tile(2).vocab_begin(), 2 * 33);  // 131 rows: 33, 33, 33, 32
    const std::vector<Stage*> st = m.stages();
    for (size_t j = 0; j < 4; ++j) {
      if (c.tie_embeddings) {
        EXPECT_TRUE(m.head_tile(j).lm_weight().is_same(st[j]->hf_parameters().at(0).second));
        EXPECT_EQ(st[10 + j]->hf_parameters().size(), j == 0 ? 2u : 0u);
      }
      EXPECT_EQ(m.head_tile(j).lm_weight().size(0), j < 3 ? 33 : 32);
    }
    const auto cut = whole_tensors(m);
    for (const auto& [name, t] : before) EXPECT_TRUE(at::equal(cut.at(name), t)) << name;
    // The tiles' products have other shapes than the whole head's, so the matrix kernels may sum
    // in another order (1.9e-6 seen under a loaded machine); a wrong row would be off by O(1).
    EXPECT_LT(rel(m.forward(ids).detach(), ref), 1e-5);
    m.set_tiles({1, 1, 1});
    const auto joined = whole_tensors(m);
    for (const auto& [name, t] : before) EXPECT_TRUE(at::equal(joined.at(name), t)) << name;
    EXPECT_TRUE(at::equal(m.forward(ids).detach(), ref));
  }
}

}  // namespace
}  // namespace strata::models
