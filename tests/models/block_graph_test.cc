// models::stage_graph_bytes_per_token against what each block stage's forward with autograd
// really keeps: every CPU allocation goes through a counting allocator while the stage runs, and
// what is still allocated afterwards (the output aside, the input counted) is the graph's saved
// tensors. Whole blocks, attention and MLP tiles (the first of each with its norm, later ones
// with a stacked input), MLPs over token chunks. The estimate must not be below it (the engine
// budgets kept and recomputed stages' graphs with it) nor far above it (or it wastes the budget).
#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/autograd.h>

#include "counting_allocator.h"
#include "strata/models/decoder.h"
#include "strata/models/model_shapes.h"

namespace strata::models {
namespace {

struct Case {
  Arch arch;
  int64_t hidden, heads, kv_heads, intermediate, batch, seq;
  at::ScalarType dtype;
  LayerTiles tiles;
  int64_t mlp_chunk;
};

class BlockGraph : public ::testing::TestWithParam<Case> {};

TEST_P(BlockGraph, EstimateBoundsWhatAutogradKeepsForEveryStage) {
  const Case k = GetParam();
  ModelConfig c = preset(k.arch == Arch::kGpt2 ? "gpt2" : "llama-1b");
  c.layers = 1;
  c.hidden = k.hidden;
  c.heads = k.heads;
  c.kv_heads = k.kv_heads;
  c.head_dim = k.hidden / k.heads;
  c.intermediate = k.intermediate;
  c.vocab_size = 300;
  c.max_positions = 512;
  c.validate();
  Decoder m(c, 3);
  m.set_tiles(k.tiles);
  m.set_mlp_token_chunk(k.mlp_chunk);
  m.to(k.dtype);
  const size_t e = c10::elementSize(k.dtype);
  const std::vector<uint64_t> per_token = stage_graph_bytes_per_token(c, k.tiles, e, k.mlp_chunk > 0);
  if (k.tiles.blocks_whole() && k.mlp_chunk == 0) EXPECT_EQ(per_token.at(1), m.block_graph_bytes_per_token(e));
  const std::vector<Stage*> stages = m.stages();
  ASSERT_EQ(per_token.size(), stages.size());
  EXPECT_EQ(per_token.front(), 0u);
  EXPECT_EQ(per_token.back(), 0u);

  test::CountingAllocator& counting = test::CountingAllocator::install();
  const double tokens = double(k.batch * k.seq);
  at::Tensor x = at::randn({k.batch, k.seq, k.hidden}).to(k.dtype);
  for (size_t s = 1; s + 1 < stages.size(); ++s) {  // the block's stages, each on the last one's output
    const at::Tensor in = x.detach().requires_grad_(true);
    const int64_t before = counting.live();
    at::Tensor y = stages[s]->forward(in);
    const int64_t kept = counting.live() - before - int64_t(y.nbytes()) + int64_t(in.nbytes());
    y.backward(at::randn_like(y));  // the graph is real: it runs
    x = y.detach();
    y = at::Tensor();
    const double estimate = double(per_token[s]) * tokens;
    EXPECT_GE(estimate, double(kept)) << m.stage_name(s) << ": kept " << kept / tokens << " bytes a token";
    EXPECT_LE(estimate, 1.25 * double(kept)) << m.stage_name(s) << ": kept " << kept / tokens << " bytes a token";
  }
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, BlockGraph,
    ::testing::Values(Case{Arch::kGpt2, 192, 3, 3, 768, 2, 77, at::kFloat, {}, 0},
                      Case{Arch::kGpt2, 256, 4, 4, 1000, 3, 50, at::kBFloat16, {}, 0},
                      Case{Arch::kGpt2, 192, 3, 3, 768, 2, 77, at::kFloat, {3, 2, 1}, 0},
                      Case{Arch::kGpt2, 192, 3, 3, 768, 2, 77, at::kFloat, {}, 40},
                      Case{Arch::kGpt2, 256, 4, 4, 1000, 3, 50, at::kBFloat16, {2, 3, 1}, 64},
                      Case{Arch::kLlama, 256, 4, 2, 688, 2, 61, at::kFloat, {}, 0},
                      Case{Arch::kLlama, 256, 4, 2, 688, 2, 61, at::kBFloat16, {}, 0},
                      Case{Arch::kLlama, 128, 4, 4, 344, 1, 130, at::kBFloat16, {}, 0},
                      Case{Arch::kLlama, 256, 4, 2, 688, 2, 61, at::kBFloat16, {2, 3, 1}, 0},
                      Case{Arch::kLlama, 256, 4, 2, 688, 2, 61, at::kBFloat16, {}, 30},
                      Case{Arch::kLlama, 256, 4, 2, 688, 2, 61, at::kFloat, {2, 3, 1}, 30}),
    [](const ::testing::TestParamInfo<Case>& i) {
      const Case& k = i.param;
      return std::string(k.arch == Arch::kGpt2 ? "gpt2" : "llama") + "_" + std::to_string(k.hidden) + "_kv" +
             std::to_string(k.kv_heads) + (k.dtype == at::kFloat ? "_fp32" : "_bf16") +
             (k.tiles.blocks_whole() ? "" : "_tiles" + std::to_string(k.tiles.attention) + "x" +
                                                  std::to_string(k.tiles.mlp)) +
             (k.mlp_chunk ? "_chunk" + std::to_string(k.mlp_chunk) : "");
    });

}  // namespace
}  // namespace strata::models
