// Decoder::block_graph_bytes_per_token against what a block's forward with autograd really keeps:
// every CPU allocation goes through a counting allocator while the block runs, and what is still
// allocated afterwards (the output aside) is the graph's saved tensors. The estimate must not be
// below it (the engine budgets kept graphs with it) nor far above it (or it wastes the budget).
#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/autograd.h>

#include "counting_allocator.h"
#include "strata/models/decoder.h"

namespace strata::models {
namespace {

struct Case {
  Arch arch;
  int64_t hidden, heads, kv_heads, intermediate, batch, seq;
  at::ScalarType dtype;
};

class BlockGraph : public ::testing::TestWithParam<Case> {};

TEST_P(BlockGraph, EstimateBoundsWhatAutogradKeeps) {
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
  m.to(k.dtype);
  at::Tensor x = at::randn({k.batch, k.seq, k.hidden}).to(k.dtype).requires_grad_(true);

  test::CountingAllocator& counting = test::CountingAllocator::install();
  const int64_t before = counting.live();
  at::Tensor y = m.block(0).forward(x);
  const int64_t kept = counting.live() - before - int64_t(y.nbytes()) + int64_t(x.nbytes());
  y.backward(at::ones_like(y));  // the graph is real: it runs
  y = at::Tensor();

  const double tokens = double(k.batch * k.seq);
  const double estimate = double(m.block_graph_bytes_per_token(c10::elementSize(k.dtype))) * tokens;
  EXPECT_GE(estimate, double(kept)) << "kept " << kept / tokens << " bytes a token";
  EXPECT_LE(estimate, 1.2 * double(kept)) << "kept " << kept / tokens << " bytes a token";
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, BlockGraph,
    ::testing::Values(Case{Arch::kGpt2, 192, 3, 3, 768, 2, 77, at::kFloat},
                      Case{Arch::kGpt2, 256, 4, 4, 1000, 3, 50, at::kBFloat16},
                      Case{Arch::kLlama, 256, 4, 2, 688, 2, 61, at::kFloat},
                      Case{Arch::kLlama, 256, 4, 2, 688, 2, 61, at::kBFloat16},
                      Case{Arch::kLlama, 128, 4, 4, 344, 1, 130, at::kBFloat16}),
    [](const ::testing::TestParamInfo<Case>& i) {
      return std::string(i.param.arch == Arch::kGpt2 ? "gpt2" : "llama") + "_" + std::to_string(i.param.hidden) +
             "_kv" + std::to_string(i.param.kv_heads) + (i.param.dtype == at::kFloat ? "_fp32" : "_bf16");
    });

}  // namespace
}  // namespace strata::models
