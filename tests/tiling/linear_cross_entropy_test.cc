// The tiled LM-head loss against the untiled one (at::linear, then at::cross_entropy_loss) on
// random inputs of awkward sizes, every way of cutting them; the peak memory of both measured by
// a counting allocator; and the plan's rule for cutting the logits.
#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/autograd.h>

#include <tuple>

#include "counting_allocator.h"
#include "strata/engine/layout/tiles.h"
#include "strata/tiling/linear_cross_entropy.h"

namespace strata::tiling {
namespace {

using engine::layout::head_scratch_bytes;
using engine::layout::logits_tiles;
using engine::layout::LogitsTiles;

struct Result {
  at::Tensor loss, grad_h, grad_w;
};

at::Tensor random_targets(int64_t tokens, int64_t vocab, double ignored, uint64_t seed) {
  at::Generator g = at::detail::createCPUGenerator(seed);
  at::Tensor t = at::randint(vocab, {tokens}, g, at::kLong);
  if (ignored > 0) t.masked_fill_(at::rand({tokens}, g).lt(ignored), -100);
  return t;
}

// Loss and gradients of h and w for the loss's gradient `scale`.
template <typename Loss>
Result run(const at::Tensor& h0, const at::Tensor& w0, double scale, Loss&& loss_of) {
  at::Tensor h = h0.detach().clone().requires_grad_(true), w = w0.detach().clone().requires_grad_(true);
  at::Tensor loss = loss_of(h, w);
  torch::autograd::backward({loss * scale});
  return {loss.detach(), h.grad(), w.grad()};
}

Result untiled(const at::Tensor& h, const at::Tensor& w, const at::Tensor& targets, double scale) {
  return run(h, w, scale, [&](const at::Tensor& hh, const at::Tensor& ww) {
    return at::cross_entropy_loss(at::linear(hh, ww).to(at::kFloat), targets, {}, at::Reduction::Sum, -100);
  });
}

Result tiled(const at::Tensor& h, const at::Tensor& w, const at::Tensor& targets, double scale, int64_t chunk,
             int64_t tile) {
  return run(h, w, scale, [&](const at::Tensor& hh, const at::Tensor& ww) {
    return linear_cross_entropy_sum(hh, ww, targets, chunk, tile);
  });
}

// One pass told the upstream gradient `scale` (as the engine tells it), or `told` instead.
Result one_pass(const at::Tensor& h, const at::Tensor& w, const at::Tensor& targets, double scale, int64_t chunk,
                double told = 0) {
  return run(h, w, scale, [&](const at::Tensor& hh, const at::Tensor& ww) {
    return linear_cross_entropy_sum(hh, ww, targets, chunk, ww.size(0), -100, /*one_pass=*/true, told > 0 ? told : scale);
  });
}

double rel(const at::Tensor& a, const at::Tensor& b) {
  const double scale = b.to(at::kDouble).abs().max().item<double>();
  return (a.to(at::kDouble) - b.to(at::kDouble)).abs().max().item<double>() / std::max(scale, 1e-30);
}

class Cuts : public ::testing::TestWithParam<std::tuple<int64_t, int64_t>> {};

TEST_P(Cuts, EqualsTheUntiledLossAndGradients) {
  const auto [chunk, tile] = GetParam();
  const int64_t tokens = 53, vocab = 211, hidden = 19;
  at::manual_seed(7);
  const at::Tensor h = at::randn({tokens, hidden}), w = at::randn({vocab, hidden}) * 0.5;
  const at::Tensor targets = random_targets(tokens, vocab, 0.2, 11);
  const Result ref = untiled(h, w, targets, 0.37), got = tiled(h, w, targets, 0.37, chunk, tile);
  // Measured: 9e-8 for the loss, 3e-7 to 6e-7 for the gradients (rounding: the untiled loss is
  // that far from an fp64 one too).
  EXPECT_LE(rel(got.loss, ref.loss), 1e-6);
  EXPECT_LE(rel(got.grad_h, ref.grad_h), 2e-6);
  EXPECT_LE(rel(got.grad_w, ref.grad_w), 2e-6);
  // Ignored rows: no gradient at all.
  const at::Tensor ignored = targets.eq(-100);
  ASSERT_GT(ignored.sum().item<int64_t>(), 0);
  EXPECT_EQ(got.grad_h.index({ignored}).abs().max().item<float>(), 0.0f);
}

INSTANTIATE_TEST_SUITE_P(Tiles, Cuts,
                         ::testing::Values(std::tuple<int64_t, int64_t>{53, 211}, std::tuple<int64_t, int64_t>{7, 23},
                                           std::tuple<int64_t, int64_t>{1, 211}, std::tuple<int64_t, int64_t>{53, 1},
                                           std::tuple<int64_t, int64_t>{16, 64}, std::tuple<int64_t, int64_t>{100, 500},
                                           std::tuple<int64_t, int64_t>{13, 210}),
                         [](const auto& i) {
                           return std::to_string(std::get<0>(i.param)) + "x" + std::to_string(std::get<1>(i.param));
                         });

// Soft-capped logits (Gemma 2's final_logit_softcapping, cap 3: most logits here bend): every
// cut, one pass, and the vocabulary pieces the engine's head tiles call, against autograd through
// the untiled soft_cap.
TEST(LinearCrossEntropy, SoftCappedLogitsEqualTheUntiledCappedLoss) {
  const int64_t tokens = 41, vocab = 157, hidden = 23;
  const double cap = 3.0;
  at::manual_seed(17);
  const at::Tensor h = at::randn({tokens, hidden}), w = at::randn({vocab, hidden}) * 0.8;
  const at::Tensor targets = random_targets(tokens, vocab, 0.2, 5);
  const Result ref = run(h, w, 0.7, [&](const at::Tensor& hh, const at::Tensor& ww) {
    return at::cross_entropy_loss(soft_cap(at::linear(hh, ww), cap).to(at::kFloat), targets, {}, at::Reduction::Sum,
                                  -100);
  });
  ASSERT_GT((at::linear(h, w).abs() > cap).sum().item<int64_t>(), tokens * vocab / 4);  // the cap matters
  const auto check = [&](const Result& got, const std::string& what) {
    EXPECT_LE(rel(got.loss, ref.loss), 1e-6) << what;
    EXPECT_LE(rel(got.grad_h, ref.grad_h), 2e-6) << what;
    EXPECT_LE(rel(got.grad_w, ref.grad_w), 2e-6) << what;
  };
  for (const auto& [chunk, tile] : {std::pair<int64_t, int64_t>{7, 23}, {41, 157}, {1, 157}})
    check(run(h, w, 0.7, [&](const at::Tensor& hh, const at::Tensor& ww) {
            return linear_cross_entropy_sum(hh, ww, targets, chunk, tile, -100, false, 1.0, cap);
          }),
          "tiles " + std::to_string(chunk) + "x" + std::to_string(tile));
  check(run(h, w, 0.7, [&](const at::Tensor& hh, const at::Tensor& ww) {
          return linear_cross_entropy_sum(hh, ww, targets, 9, vocab, -100, true, 0.7, cap);
        }),
        "one pass");
  // Vocabulary pieces: rows [0, 60) and [60, vocab), as two head tiles hold them.
  LogSumExp acc(h);
  accumulate_log_sum_exp(h, w.narrow(0, 0, 60), 0, targets, 8, 16, acc, cap);
  accumulate_log_sum_exp(h, w.narrow(0, 60, vocab - 60), 60, targets, 8, 16, acc, cap);
  const at::Tensor lse = finish_log_sum_exp(acc);
  EXPECT_LE(rel(loss_sum(lse, acc, targets, -100), ref.loss), 1e-6);
  const at::Tensor row_scale = targets.ne(-100).to(at::kFloat) * 0.7;
  at::Tensor grad_h = at::zeros({tokens, hidden});
  const at::Tensor g1 = backward_rows(h, w.narrow(0, 60, vocab - 60), 60, targets, lse, row_scale, 8, 16, grad_h, true, cap);
  const at::Tensor g0 = backward_rows(h, w.narrow(0, 0, 60), 0, targets, lse, row_scale, 8, 16, grad_h, true, cap);
  EXPECT_LE(rel(grad_h, ref.grad_h), 2e-6);
  EXPECT_LE(rel(at::cat({g0, g1}), ref.grad_w), 2e-6);
  EXPECT_TRUE(at::equal(soft_cap(h, 0), h));
}

// bf16 inputs: the tiled loss narrows and widens where the untiled one does, so it stays within
// bf16's rounding of it (the input gradient is summed over tiles in fp32, the untiled one in one
// bf16 matmul).
TEST(LinearCrossEntropy, Bf16StaysWithinRoundingOfTheUntiled) {
  at::manual_seed(3);
  const at::Tensor h = at::randn({96, 32}).to(at::kBFloat16), w = (at::randn({333, 32}) * 0.3).to(at::kBFloat16);
  const at::Tensor targets = random_targets(96, 333, 0.1, 5);
  const Result ref = untiled(h, w, targets, 1.0), got = tiled(h, w, targets, 1.0, 17, 40);
  EXPECT_EQ(got.grad_h.scalar_type(), at::kBFloat16);
  EXPECT_EQ(got.grad_w.scalar_type(), at::kBFloat16);
  EXPECT_LE(rel(got.loss, ref.loss), 1e-5);
  EXPECT_LE(rel(got.grad_h, ref.grad_h), 2e-2);
  EXPECT_LE(rel(got.grad_w, ref.grad_w), 2e-2);
}

TEST(LinearCrossEntropy, WithoutGradientsAndEverythingIgnored) {
  at::manual_seed(1);
  const at::Tensor h = at::randn({10, 8}), w = at::randn({30, 8});
  const at::Tensor targets = random_targets(10, 30, 0, 2);
  at::NoGradGuard no_grad;
  EXPECT_LE(rel(linear_cross_entropy_sum(h, w, targets, 3, 7),
                at::cross_entropy_loss(at::linear(h, w), targets, {}, at::Reduction::Sum)),
            1e-6);
  EXPECT_EQ(linear_cross_entropy_sum(h, w, at::full({10}, -100, at::kLong), 3, 7).item<float>(), 0.0f);
}

// Only one input needs a gradient (a frozen LM head, or a frozen trunk): the other gets none,
// and the one asked for equals the untiled one.
TEST(LinearCrossEntropy, GradientOfOneInputOnly) {
  at::manual_seed(2);
  const at::Tensor h = at::randn({20, 8}), w = at::randn({50, 8});
  const at::Tensor targets = random_targets(20, 50, 0.2, 3);
  const Result ref = untiled(h, w, targets, 1.0);
  for (const bool frozen_w : {true, false}) {
    at::Tensor hh = h.clone().requires_grad_(frozen_w), ww = w.clone().requires_grad_(!frozen_w);
    torch::autograd::backward({linear_cross_entropy_sum(hh, ww, targets, 6, 9)});
    if (frozen_w) {
      EXPECT_FALSE(ww.grad().defined());
      EXPECT_LE(rel(hh.grad(), ref.grad_h), 2e-6);
    } else {
      EXPECT_FALSE(hh.grad().defined());
      EXPECT_LE(rel(ww.grad(), ref.grad_w), 2e-6);
    }
  }
}

TEST(LinearCrossEntropy, RefusesBadInput) {
  const at::Tensor h = at::randn({4, 8}), w = at::randn({30, 8});
  EXPECT_THROW(linear_cross_entropy_sum(h, w, at::tensor({1, 2, 30, 0}, at::kLong), 2, 8), std::invalid_argument);
  EXPECT_THROW(linear_cross_entropy_sum(h, w, at::tensor({1, 2, -5, 0}, at::kLong), 2, 8), std::invalid_argument);
  EXPECT_THROW(linear_cross_entropy_sum(h, at::randn({30, 7}), at::zeros({4}, at::kLong), 2, 8), std::invalid_argument);
  EXPECT_THROW(linear_cross_entropy_sum(h, w, at::zeros({3}, at::kLong), 2, 8), std::invalid_argument);
  EXPECT_THROW(linear_cross_entropy_sum(h, w, at::zeros({4}, at::kLong), 0, 8), std::invalid_argument);
  EXPECT_THROW(linear_cross_entropy_sum(h, w.to(at::kBFloat16), at::zeros({4}, at::kLong), 2, 8), std::invalid_argument);
}

// One pass (token chunks over the whole vocabulary, the gradients computed with the loss and
// scaled in the backward): the untiled loss and gradients in fp32 for every chunk size, with
// ignored rows, an upstream gradient other than 1 and only one input wanting a gradient; within
// bf16's rounding in bf16; refused with vocabulary tiles.
TEST(LinearCrossEntropy, OnePassEqualsTheUntiledLossAndGradients) {
  const int64_t tokens = 53, vocab = 211, hidden = 19;
  at::manual_seed(17);
  const at::Tensor h = at::randn({tokens, hidden}), w = at::randn({vocab, hidden}) * 0.5;
  const at::Tensor targets = random_targets(tokens, vocab, 0.2, 12);
  const Result ref = untiled(h, w, targets, 0.37);
  for (int64_t chunk : {1, 7, 16, 52, 53, 100}) {
    const Result got = one_pass(h, w, targets, 0.37, chunk);
    // Told a wrong upstream gradient, corrected in the backward: the same within rounding.
    const Result wrong = one_pass(h, w, targets, 0.37, chunk, 1.0);
    EXPECT_LE(rel(wrong.grad_h, ref.grad_h), 2e-6) << chunk;
    EXPECT_LE(rel(wrong.grad_w, ref.grad_w), 2e-6) << chunk;
    EXPECT_LE(rel(got.loss, ref.loss), 1e-6) << chunk;
    EXPECT_LE(rel(got.grad_h, ref.grad_h), 2e-6) << chunk;
    EXPECT_LE(rel(got.grad_w, ref.grad_w), 2e-6) << chunk;
    EXPECT_EQ(got.grad_h.index({targets.eq(-100)}).abs().max().item<float>(), 0.0f) << chunk;
  }
  for (const bool frozen_w : {true, false}) {
    at::Tensor hh = h.clone().requires_grad_(frozen_w), ww = w.clone().requires_grad_(!frozen_w);
    torch::autograd::backward({linear_cross_entropy_sum(hh, ww, targets, 8, vocab, -100, true) * 0.37});
    EXPECT_EQ(ww.grad().defined(), !frozen_w);
    EXPECT_EQ(hh.grad().defined(), frozen_w);
    EXPECT_LE(rel(frozen_w ? hh.grad() : ww.grad(), frozen_w ? ref.grad_h : ref.grad_w), 2e-6);
  }
  {
    at::NoGradGuard no_grad;
    EXPECT_LE(rel(linear_cross_entropy_sum(h, w, targets, 5, vocab, -100, true), ref.loss), 1e-6);
  }
  EXPECT_THROW(linear_cross_entropy_sum(h, w, targets, 8, vocab - 1, -100, true), std::invalid_argument);

  at::manual_seed(3);
  const at::Tensor hb = at::randn({96, 32}).to(at::kBFloat16), wb = (at::randn({333, 32}) * 0.3).to(at::kBFloat16);
  const at::Tensor tb = random_targets(96, 333, 0.1, 5);
  const Result bref = untiled(hb, wb, tb, 1.0), bgot = one_pass(hb, wb, tb, 1.0, 17);
  EXPECT_EQ(bgot.grad_h.scalar_type(), at::kBFloat16);
  EXPECT_EQ(bgot.grad_w.scalar_type(), at::kBFloat16);
  EXPECT_LE(rel(bgot.loss, bref.loss), 1e-5);
  EXPECT_LE(rel(bgot.grad_h, bref.grad_h), 2e-2);
  EXPECT_LE(rel(bgot.grad_w, bref.grad_w), 2e-2);
}

// The case, 128K vocabulary x 16K tokens, scaled down with the ratio kept (16K x 2K,
// hidden 256, fp32): the head's forward and backward peak, measured by the counting allocator
// beside its inputs and their gradients, tiled into 64 tiles is at most 1/16 of the untiled
// one's; loss and gradients agree to 1e-5, and the plan's byte count bounds what the tiled loss
// holds.
TEST(LinearCrossEntropy, PeakMemoryIsOneTileNotTheLogits) {
  const int64_t tokens = 2048, vocab = 16384, hidden = 256;
  at::manual_seed(9);
  const at::Tensor h = at::randn({tokens, hidden}), w = at::randn({vocab, hidden}) * 0.1;
  const at::Tensor targets = random_targets(tokens, vocab, 0, 4);
  test::CountingAllocator& counting = test::CountingAllocator::install();
  const LogitsTiles cut = logits_tiles(tokens, vocab, 64);
  ASSERT_GE(cut.tiles(tokens, vocab), 64u);

  const auto peak_of = [&](auto&& f) {
    const int64_t before = counting.live();
    counting.reset_peak();
    Result r = f();
    const int64_t peak = counting.peak() - before;
    return std::pair<Result, int64_t>{std::move(r), peak};
  };
  auto [ref, untiled_peak] = peak_of([&] { return untiled(h, w, targets, 1.0); });
  auto [got, tiled_peak] =
      peak_of([&] { return tiled(h, w, targets, 1.0, int64_t(cut.token_chunk), int64_t(cut.vocab_tile)); });
  // What the loss holds beyond run()'s clones of h and w and the gradients of both (which the
  // untiled head holds alike): the part tiling bounds.
  const int64_t copies = 2 * (tokens * hidden * 4 + vocab * hidden * 4);
  untiled_peak -= copies;
  tiled_peak -= copies;
  const int64_t logits = tokens * vocab * 4;
  RecordProperty("untiled_peak", std::to_string(untiled_peak));
  RecordProperty("tiled_peak", std::to_string(tiled_peak));
  std::printf("head forward+backward peak beside inputs and gradients: untiled %.1f MiB (logits %.1f MiB), %s %.2f MiB\n", untiled_peak / 1048576.0,
              logits / 1048576.0, engine::layout::describe(cut, tokens, vocab).c_str(), tiled_peak / 1048576.0);
  EXPECT_GE(untiled_peak, logits);  // the untiled head really holds its logits
  EXPECT_LE(tiled_peak * 16, untiled_peak);
  EXPECT_LE(tiled_peak, int64_t(head_scratch_bytes(tokens, vocab, hidden, 4, cut)));
  EXPECT_LE(rel(got.loss, ref.loss), 1e-5);
  EXPECT_LE(rel(got.grad_h, ref.grad_h), 1e-5);
  EXPECT_LE(rel(got.grad_w, ref.grad_w), 1e-5);
  // In one pass, 64 token chunks over the whole vocabulary: the fp32 weight gradient is held
  // from the forward on, and the plan's count still bounds the peak.
  const LogitsTiles one = engine::layout::one_pass_tiles(tokens, vocab, 64);
  auto [fused, one_pass_peak] = peak_of([&] { return one_pass(h, w, targets, 1.0, int64_t(one.token_chunk)); });
  one_pass_peak -= copies;
  std::printf("%s: %.2f MiB\n", engine::layout::describe(one, tokens, vocab).c_str(), one_pass_peak / 1048576.0);
  EXPECT_LE(one_pass_peak, int64_t(head_scratch_bytes(tokens, vocab, hidden, 4, one)));
  EXPECT_LE(one_pass_peak * 4, untiled_peak);
  EXPECT_LE(rel(fused.loss, ref.loss), 1e-5);
  EXPECT_LE(rel(fused.grad_h, ref.grad_h), 1e-5);
  EXPECT_LE(rel(fused.grad_w, ref.grad_w), 1e-5);
}

// The same operator on a GPU (the engine runs it there): CUDA tensors give the CPU's numbers
// within rounding, in fp32 and bf16. Skips where no GPU is visible (the development machine).
TEST(LinearCrossEntropy, OnTheGpuEqualsTheCpu) {
  if (!at::hasCUDA()) GTEST_SKIP() << "no CUDA device visible";
  at::manual_seed(21);
  for (const at::ScalarType dt : {at::kFloat, at::kBFloat16}) {
    const at::Tensor h = at::randn({300, 64}).to(dt), w = (at::randn({5000, 64}) * 0.1).to(dt);
    const at::Tensor targets = random_targets(300, 5000, 0.1, 8);
    const double tol = dt == at::kFloat ? 1e-5 : 2e-2;
    for (const bool fused : {false, true}) {
      const Result cpu = fused ? one_pass(h, w, targets, 0.5, 64) : tiled(h, w, targets, 0.5, 64, 700);
      const Result gpu = fused ? one_pass(h.cuda(), w.cuda(), targets.cuda(), 0.5, 64)
                               : tiled(h.cuda(), w.cuda(), targets.cuda(), 0.5, 64, 700);
      EXPECT_LE(rel(gpu.loss.cpu(), cpu.loss), dt == at::kFloat ? 1e-6 : 1e-4) << fused;
      EXPECT_LE(rel(gpu.grad_h.cpu(), cpu.grad_h), tol) << fused;
      EXPECT_LE(rel(gpu.grad_w.cpu(), cpu.grad_w), tol) << fused;
      EXPECT_TRUE(gpu.grad_w.is_cuda());
    }
  }
}

TEST(LogitsTilingRule, CutsTheVocabularyFirstAndCoversEveryCount) {
  for (uint64_t tokens : {1ull, 100ull, 8192ull})
    for (uint64_t vocab : {1ull, 512ull, 50257ull})
      EXPECT_FALSE(logits_tiles(tokens, vocab, 1).tiled(tokens, vocab)) << tokens << " x " << vocab;
  const LogitsTiles none = logits_tiles(16384, 131072, 1);
  EXPECT_FALSE(none.tiled(16384, 131072));
  EXPECT_EQ(none.tiles(16384, 131072), 1u);
  const LogitsTiles sixteen = logits_tiles(16384, 131072, 16);
  EXPECT_EQ(sixteen.token_chunk, 16384u);  // the vocabulary alone takes 16 cuts
  EXPECT_EQ(sixteen.vocab_tile, 8192u);
  const LogitsTiles many = logits_tiles(16384, 131072, 1024);
  EXPECT_LT(many.token_chunk, 16384u);  // then tokens too
  for (uint64_t tokens : {1ull, 7ull, 300ull, 4096ull})
    for (uint64_t vocab : {1ull, 13ull, 5000ull, 50257ull})
      for (uint64_t count : {1ull, 2ull, 3ull, 17ull, 64ull, 1000ull, 1ull << 40}) {
        const LogitsTiles t = logits_tiles(tokens, vocab, count);
        const uint64_t n = t.tiles(tokens, vocab);
        EXPECT_GE(n, std::min(count, tokens * vocab)) << tokens << " " << vocab << " " << count;
        EXPECT_LE(n, 2 * std::min(count, tokens * vocab)) << tokens << " " << vocab << " " << count;
        EXPECT_GE(t.token_chunk, 1u);
        EXPECT_GE(t.vocab_tile, 1u);
        // No tile more than twice the even share of the logits (rounding of both cuts).
        EXPECT_LE(t.token_chunk * t.vocab_tile, 2 * (tokens * vocab) / std::min(count, tokens * vocab) + tokens + vocab)
            << tokens << " " << vocab << " " << count;
      }
}

}  // namespace
}  // namespace strata::tiling
