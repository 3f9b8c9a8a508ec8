// tiling::chunked_mlp against the plain MLP (libtorch's autograd through every intermediate):
// outputs and every gradient on fresh random inputs of awkward sizes, gated and not, with and
// without biases, at chunk sizes from 1 token to more than the sequence; bf16 within its
// rounding; and the peak memory of the forward and backward, measured by a counting allocator,
// bounded by one chunk's intermediates instead of the sequence's.
#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/csrc/autograd/autograd.h>

#include <cstdio>

#include "counting_allocator.h"
#include "strata/tiling/chunked_mlp.h"

namespace strata::tiling {
namespace {

double rel(const at::Tensor& a, const at::Tensor& b) {
  return (a.to(at::kFloat) - b.to(at::kFloat)).norm().item<double>() / std::max(1e-30, b.to(at::kFloat).norm().item<double>());
}

struct Case {
  bool gated, biases;
  MlpActivation act;
};

MlpWeights random_weights(const Case& k, int64_t d, int64_t f, at::ScalarType dt) {
  const auto p = [&](std::vector<int64_t> shape) { return (at::randn(shape) * 0.1).to(dt).requires_grad_(true); };
  MlpWeights w;
  w.up = p({f, d});
  w.down = p({d, f});
  if (k.gated) w.gate = p({f, d});
  if (k.biases) {
    w.up_bias = p({f});
    w.down_bias = p({d});
    if (k.gated) w.gate_bias = p({f});
  }
  return w;
}

std::vector<at::Tensor> leaves(const at::Tensor& x, const MlpWeights& w) {
  std::vector<at::Tensor> out{x};
  for (const at::Tensor* t : {&w.up, &w.up_bias, &w.gate, &w.gate_bias, &w.down, &w.down_bias})
    if (t->defined()) out.push_back(*t);
  return out;
}

TEST(ChunkedMlp, EqualsThePlainMlpInEveryCut) {
  at::manual_seed(3);
  const int64_t d = 48, f = 131;
  for (const Case k : {Case{true, false, MlpActivation::kSilu}, Case{true, true, MlpActivation::kGelu},
                       Case{false, true, MlpActivation::kGeluTanh}, Case{false, false, MlpActivation::kSilu}}) {
    const MlpWeights w = random_weights(k, d, f, at::kFloat);
    const at::Tensor x = at::randn({2, 37, d}).requires_grad_(true);
    const at::Tensor go = at::randn({2, 37, d});
    const std::vector<at::Tensor> in = leaves(x, w);
    const at::Tensor ref = plain_mlp(x, w, k.act);
    const auto ref_g = torch::autograd::grad({ref}, in, {go});
    for (int64_t chunk : {1, 7, 37, 74, 100}) {
      SCOPED_TRACE(std::string(k.gated ? "gated" : "plain") + (k.biases ? " with biases" : "") + ", chunk " +
                   std::to_string(chunk));
      const at::Tensor got = chunked_mlp(x, w, k.act, chunk);
      EXPECT_EQ(got.sizes(), ref.sizes());
      EXPECT_LT(rel(got, ref), 1e-6);
      const auto got_g = torch::autograd::grad({got}, in, {go});
      ASSERT_EQ(got_g.size(), ref_g.size());
      for (size_t i = 0; i < ref_g.size(); ++i) EXPECT_LT(rel(got_g[i], ref_g[i]), 1e-6) << "gradient " << i;
    }
  }
}

TEST(ChunkedMlp, Bf16WithinItsRounding) {
  at::manual_seed(4);
  const Case k{true, false, MlpActivation::kSilu};
  const MlpWeights w = random_weights(k, 64, 160, at::kBFloat16);
  const at::Tensor x = at::randn({3, 50, 64}).to(at::kBFloat16).requires_grad_(true);
  const at::Tensor go = at::randn({3, 50, 64}).to(at::kBFloat16);
  const std::vector<at::Tensor> in = leaves(x, w);
  const at::Tensor ref = plain_mlp(x, w, k.act), got = chunked_mlp(x, w, k.act, 16);
  EXPECT_LT(rel(got, ref), 1e-2);
  const auto a = torch::autograd::grad({ref}, in, {go}), b = torch::autograd::grad({got}, in, {go});
  for (size_t i = 0; i < a.size(); ++i) {
    EXPECT_EQ(b[i].scalar_type(), at::kBFloat16);
    EXPECT_LT(rel(b[i], a[i]), 2e-2) << "gradient " << i;
  }
}

TEST(ChunkedMlp, RefusesBadShapes) {
  const at::Tensor x = at::randn({4, 8});
  MlpWeights w{at::randn({16, 8}), {}, {}, {}, at::randn({8, 16}), {}};
  EXPECT_NO_THROW(chunked_mlp(x, w, MlpActivation::kSilu, 2));
  EXPECT_THROW(chunked_mlp(x, w, MlpActivation::kSilu, 0), std::invalid_argument);
  MlpWeights bad = w;
  bad.down = at::randn({8, 15});
  EXPECT_THROW(chunked_mlp(x, bad, MlpActivation::kSilu, 2), std::invalid_argument);
  bad = w;
  bad.gate = at::randn({16, 7});
  EXPECT_THROW(chunked_mlp(x, bad, MlpActivation::kSilu, 2), std::invalid_argument);
  bad = w;
  bad.up = bad.up.to(at::kBFloat16);
  EXPECT_THROW(chunked_mlp(x, bad, MlpActivation::kSilu, 2), std::invalid_argument);
}

// A long sequence through a gated MLP (Llama's shape, scaled down: 4096 tokens, hidden 128,
// intermediate 512, fp32): the forward and backward's peak beside the inputs, the output and the
// gradients falls from the sequence's intermediates to about one chunk's.
TEST(ChunkedMlp, PeakMemoryIsOneChunkNotTheSequence) {
  const int64_t tokens = 4096, d = 128, f = 512, chunk = 256;
  at::manual_seed(5);
  const Case k{true, false, MlpActivation::kSilu};
  const MlpWeights w = random_weights(k, d, f, at::kFloat);
  const at::Tensor x = at::randn({tokens, d}).requires_grad_(true);
  const at::Tensor go = at::randn({tokens, d});
  const std::vector<at::Tensor> in = leaves(x, w);
  test::CountingAllocator& counting = test::CountingAllocator::install();
  const auto peak_of = [&](auto&& f) {
    const int64_t before = counting.live();
    counting.reset_peak();
    std::vector<at::Tensor> g = f();
    const int64_t peak = counting.peak() - before;
    return std::make_pair(std::move(g), peak);
  };
  auto [ref, plain_peak] = peak_of([&] {
    const at::Tensor y = plain_mlp(x, w, k.act);
    auto g = torch::autograd::grad({y}, in, {go});
    g.push_back(y.detach());
    return g;
  });
  auto [got, chunked_peak] = peak_of([&] {
    const at::Tensor y = chunked_mlp(x, w, k.act, chunk);
    auto g = torch::autograd::grad({y}, in, {go});
    g.push_back(y.detach());
    return g;
  });
  for (size_t i = 0; i < ref.size(); ++i) EXPECT_LT(rel(got[i], ref[i]), 1e-5) << i;
  // What both hold alike: the output, the input's gradient and the weights' gradients (and the
  // chunked MLP's fp32 sums of them, as large as the weights).
  const int64_t results = (2 * tokens * d + 3 * f * d) * 4;
  const int64_t intermediates = tokens * f * 4;  // one [tokens, f] fp32 activation of the sequence
  plain_peak -= results;
  chunked_peak -= results;
  std::printf("MLP forward+backward peak beside inputs, output and gradients: plain %.2f MiB, chunks of %lld tokens "
              "%.2f MiB (one [tokens, intermediate] activation: %.2f MiB)\n",
              plain_peak / 1048576.0, (long long)chunk, chunked_peak / 1048576.0, intermediates / 1048576.0);
  RecordProperty("plain_peak", std::to_string(plain_peak));
  RecordProperty("chunked_peak", std::to_string(chunked_peak));
  EXPECT_GE(plain_peak, 3 * intermediates) << "the plain MLP keeps gate, up and their product";
  EXPECT_LE(chunked_peak, plain_peak / 8);
}

}  // namespace
}  // namespace strata::tiling
