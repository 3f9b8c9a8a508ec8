// tiling::grouped_mlp against plain_mlp group by group (libtorch's autograd through every
// intermediate): outputs and every gradient within fp32 rounding, on fresh random inputs of
// awkward sizes with empty groups, with and without LoRA adapters; bf16 within its rounding; the
// graph keeps no stacked copy of the weights; and the weights it refuses.
#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/csrc/autograd/autograd.h>

#include <string>
#include <vector>

#include "counting_allocator.h"
#include "strata/tiling/grouped_mlp.h"

namespace strata::tiling {
namespace {

double rel(const at::Tensor& a, const at::Tensor& b) {
  return (a.to(at::kFloat) - b.to(at::kFloat)).norm().item<double>() / std::max(1e-30, b.to(at::kFloat).norm().item<double>());
}

std::vector<MlpWeights> random_groups(int64_t groups, int64_t d, int64_t f, int64_t r, at::ScalarType dt) {
  const auto p = [&](std::vector<int64_t> shape) { return (at::randn(shape) * 0.1).to(dt).requires_grad_(true); };
  std::vector<MlpWeights> w(static_cast<size_t>(groups));
  for (MlpWeights& g : w) {
    g.up = p({f, d});
    g.gate = p({f, d});
    g.down = p({d, f});
    if (r > 0)
      for (auto [l, in, out] : {std::tuple{&g.up_lora, d, f}, {&g.gate_lora, d, f}, {&g.down_lora, f, d}}) {
        l->a = p({r, in});
        l->b = p({out, r});
        l->scaling = 1.75;
      }
  }
  return w;
}

std::vector<at::Tensor> leaves(const at::Tensor& x, const std::vector<MlpWeights>& w) {
  std::vector<at::Tensor> all{x};
  for (const MlpWeights& g : w)
    for (const at::Tensor& t : {g.up, g.gate, g.down, g.up_lora.a, g.up_lora.b, g.gate_lora.a, g.gate_lora.b,
                                g.down_lora.a, g.down_lora.b})
      if (t.defined()) all.push_back(t);
  return all;
}

// Group by group, the oracle: plain_mlp of each group's rows.
at::Tensor one_by_one(const at::Tensor& x, const std::vector<MlpWeights>& w, const std::vector<int64_t>& rows,
                      MlpActivation act) {
  std::vector<at::Tensor> ys;
  int64_t begin = 0;
  for (size_t g = 0; g < w.size(); ++g) {
    ys.push_back(plain_mlp(x.narrow(0, begin, rows[g]), w[g], act));
    begin += rows[g];
  }
  return at::cat(ys);
}

TEST(GroupedMlp, EachGroupIsThePlainMlpOfItsRowsWithItsWeights) {
  for (const int64_t r : {0, 3}) {
    for (const MlpActivation act : {MlpActivation::kSilu, MlpActivation::kGeluTanh}) {
      SCOPED_TRACE("rank " + std::to_string(r) + ", activation " + std::to_string(int(act)));
      at::manual_seed(7 + r);
      const int64_t d = 23, f = 37;
      const std::vector<int64_t> rows{5, 0, 17, 1, 0, 9};  // empty groups, one in the middle
      int64_t total = 0;
      for (int64_t n : rows) total += n;
      const std::vector<MlpWeights> w = random_groups(int64_t(rows.size()), d, f, r, at::kFloat);
      const at::Tensor x = at::randn({total, d}).requires_grad_(true);
      const at::Tensor ends = at::tensor(std::vector<int64_t>(rows.begin(), rows.end())).cumsum(0).to(at::kInt);
      ASSERT_TRUE(grouped_mlp_supported(x));
      const at::Tensor got = grouped_mlp(x, w, ends, act), want = one_by_one(x, w, rows, act);
      EXPECT_LT(rel(got, want), 1e-6);
      const at::Tensor g = at::randn_like(want);
      const auto got_grads = torch::autograd::grad({got}, leaves(x, w), {g});
      const auto want_grads = torch::autograd::grad({want}, leaves(x, w), {g});
      ASSERT_EQ(got_grads.size(), want_grads.size());
      for (size_t i = 0; i < got_grads.size(); ++i) {
        // An empty group's weights get a zero gradient, as in the loop's (which never used them).
        const at::Tensor expected = want_grads[i].defined() ? want_grads[i] : at::zeros_like(got_grads[i]);
        EXPECT_LT(rel(got_grads[i], expected), 1e-6) << "leaf " << i;
        if (!want_grads[i].defined()) EXPECT_EQ(got_grads[i].abs().max().item<float>(), 0.f) << "leaf " << i;
      }
    }
  }
}

// The forward's graph holds the groups' own tensors, not their stacked copy: what stays alive
// after the forward is the output and the intermediates of the rows, well under the weights.
TEST(GroupedMlp, TheGraphKeepsNoStackedCopyOfTheWeights) {
  test::CountingAllocator& counting = test::CountingAllocator::install();
  at::manual_seed(11);
  const int64_t groups = 16, d = 64, f = 256, rows = 32;
  const std::vector<MlpWeights> w = random_groups(groups, d, f, 0, at::kFloat);
  const at::Tensor x = at::randn({rows, d}).requires_grad_(true);
  const at::Tensor ends = at::arange(1, groups + 1, at::kInt) * int(rows / groups);
  const int64_t before = counting.live(), weights = groups * 3 * d * f * 4;
  at::Tensor y = grouped_mlp(x, w, ends, MlpActivation::kSilu);
  const int64_t kept = counting.live() - before;
  EXPECT_LT(kept, weights / 4) << "kept " << kept << " bytes after the forward; the weights are " << weights;
  y.sum().backward();
  EXPECT_TRUE(w[3].down.grad().defined());
}

TEST(GroupedMlp, Bf16WithinItsRounding) {
  at::manual_seed(3);
  const std::vector<int64_t> rows{40, 3, 0, 21};
  const std::vector<MlpWeights> w = random_groups(4, 32, 48, 0, at::kBFloat16);
  const at::Tensor x = at::randn({64, 32}).to(at::kBFloat16);
  const at::Tensor ends = at::tensor(std::vector<int64_t>{40, 43, 43, 64}).to(at::kInt);
  EXPECT_LT(rel(grouped_mlp(x, w, ends, MlpActivation::kSilu), one_by_one(x, w, rows, MlpActivation::kSilu)), 1e-2);
}

TEST(GroupedMlp, WhatItDoesNotTakeIsRefused) {
  const auto refusal = [](const at::Tensor& x, const std::vector<MlpWeights>& w, const at::Tensor& ends) {
    try {
      grouped_mlp(x, w, ends, MlpActivation::kSilu);
    } catch (const std::invalid_argument& e) {
      return std::string(e.what());
    }
    return std::string();
  };
  const at::Tensor x = at::randn({6, 8}), ends = at::tensor(std::vector<int64_t>{2, 6}).to(at::kInt);
  std::vector<MlpWeights> w = random_groups(2, 8, 12, 0, at::kFloat);
  EXPECT_EQ(refusal(x, w, ends), "");
  EXPECT_NE(refusal(x, w, ends.to(at::kLong)).find("ends must be [2] int32"), std::string::npos);
  EXPECT_NE(refusal(x.narrow(1, 0, 7), w, ends).find("up and gate must be [f, 7]"), std::string::npos);
  std::vector<MlpWeights> biased = w;
  biased[1].up_bias = at::zeros({12});
  EXPECT_NE(refusal(x, biased, ends).find("biases are not taken"), std::string::npos);
  std::vector<MlpWeights> ungated = w;
  ungated[0].gate = at::Tensor();
  EXPECT_NE(refusal(x, ungated, ends).find("needs up, gate and down"), std::string::npos);
  std::vector<MlpWeights> half = random_groups(2, 8, 12, 2, at::kFloat);
  half[1].down_lora = LowRank();
  EXPECT_NE(refusal(x, half, ends).find("on every group's projection"), std::string::npos);
  std::vector<MlpWeights> wide = w;
  wide[1] = random_groups(1, 8, 13, 0, at::kFloat)[0];
  EXPECT_NE(refusal(x, wide, ends).find("one shape"), std::string::npos);
}

}  // namespace
}  // namespace strata::tiling
