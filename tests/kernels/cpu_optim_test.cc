// CPU optimizer and precision kernels against libtorch (torch::optim::Adam/AdamW, c10's bf16 and
// fp16 conversions, ATen reductions) and against each other: every ISA path and thread count
// must give bitwise the scalar reference's result.
#include <ATen/ATen.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <gtest/gtest.h>
#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>

#include <bit>
#include <cmath>
#include <limits>
#include <random>

#include "strata/kernels/cpu_optim.h"

namespace strata::kernels {
namespace {

std::vector<Isa> runnable_isas() {
  std::vector<Isa> out{Isa::kScalar};
  if (cpu_features().best() != Isa::kScalar) out.push_back(Isa::kAvx2);
  if (cpu_features().best() == Isa::kAvx512) out.push_back(Isa::kAvx512);
  return out;
}

// Random floats over many magnitudes, with zeros, subnormals, infinities, NaNs, and values at
// the rounding boundaries of bf16/fp16.
std::vector<float> nasty_floats(size_t n, uint64_t seed, bool specials = true) {
  std::mt19937_64 rng(seed);
  std::vector<float> v(n);
  for (size_t i = 0; i < n; ++i) {
    switch (specials ? rng() % 8 : 0) {
      case 0: case 1: case 2: case 3:
        v[i] = std::ldexp(static_cast<float>(static_cast<int64_t>(rng() % 2000001) - 1000000) / 1e6f,
                          static_cast<int>(rng() % 40) - 20);
        break;
      case 4: v[i] = std::bit_cast<float>(static_cast<uint32_t>(rng())); break;  // any bits
      case 5: v[i] = std::bit_cast<float>(static_cast<uint32_t>(rng() % 0x00800000u)); break;
      case 6: v[i] = std::bit_cast<float>(static_cast<uint32_t>((rng() & 0xFFFF0000u) | 0x8000u)); break;  // bf16 tie
      default: {
        const float specials_list[] = {0.0f, -0.0f, INFINITY, -INFINITY, NAN, 65504.0f, 65520.0f,
                                       -65519.0f, 5.9604645e-08f, 2.9802322e-08f, 6.1035156e-05f};
        v[i] = specials_list[rng() % 11];
      }
    }
  }
  return v;
}

bool same_bits_or_both_nan(float a, float b) {
  return std::bit_cast<uint32_t>(a) == std::bit_cast<uint32_t>(b) || (std::isnan(a) && std::isnan(b));
}

TEST(Conversions, MatchLibtorchBitForBit) {
  const auto x = nasty_floats(1 << 20, 1);
  for (float f : x) {
    ASSERT_EQ(float_to_bf16(f), c10::BFloat16(f).x) << f << " bits " << std::bit_cast<uint32_t>(f);
    ASSERT_EQ(float_to_fp16(f), c10::Half(f).x) << f << " bits " << std::bit_cast<uint32_t>(f);
  }
  for (uint32_t h = 0; h < 65536; ++h) {
    const float want_bf = c10::BFloat16(static_cast<uint16_t>(h), c10::BFloat16::from_bits());
    const float want_h = c10::Half(static_cast<uint16_t>(h), c10::Half::from_bits());
    ASSERT_TRUE(same_bits_or_both_nan(bf16_to_float(static_cast<uint16_t>(h)), want_bf)) << h;
    ASSERT_TRUE(same_bits_or_both_nan(fp16_to_float(static_cast<uint16_t>(h)), want_h)) << h;
  }
}

TEST(Conversions, EveryIsaAndThreadCountMatchesTheScalarPath) {
  const size_t n = 1000003;
  const auto x = nasty_floats(n, 2);
  for (DType t : {DType::kBF16, DType::kF16}) {
    std::vector<uint16_t> ref(n), got(n);
    convert(x.data(), DType::kF32, ref.data(), t, n, {1, Isa::kScalar});
    std::vector<float> back_ref(n), back(n);
    convert(ref.data(), t, back_ref.data(), DType::kF32, n, {1, Isa::kScalar});
    for (Isa isa : runnable_isas()) {
      for (unsigned threads : {1u, 3u}) {
        convert(x.data(), DType::kF32, got.data(), t, n, {threads, isa});
        ASSERT_EQ(got, ref) << to_string(isa) << " " << to_string(t) << " threads " << threads;
        convert(ref.data(), t, back.data(), DType::kF32, n, {threads, isa});
        ASSERT_EQ(0, std::memcmp(back.data(), back_ref.data(), n * 4)) << to_string(isa);
      }
    }
  }
  EXPECT_THROW(convert(x.data(), DType::kBF16, const_cast<float*>(x.data()), DType::kF16, 1), std::invalid_argument);
}

TEST(SumSquares, MatchesLibtorchAndIsIdenticalAcrossIsasAndThreads) {
  for (size_t n : {1ul, 7ul, 4095ul, 4096ul, 4097ul, 1000003ul}) {
    const auto x = nasty_floats(n, n, /*specials=*/false);
    const double ref = sum_squares(x.data(), DType::kF32, n, {1, Isa::kScalar});
    at::Tensor t = at::from_blob(const_cast<float*>(x.data()), {static_cast<int64_t>(n)}, at::kFloat);
    const double want = t.to(at::kDouble).pow(2).sum().item<double>();
    EXPECT_NEAR(ref, want, 1e-12 * want) << n;
    std::vector<uint16_t> h(n);
    convert(x.data(), DType::kF32, h.data(), DType::kBF16, n);
    const double ref_bf = sum_squares(h.data(), DType::kBF16, n, {1, Isa::kScalar});
    const double want_bf = t.to(at::kBFloat16).to(at::kDouble).pow(2).sum().item<double>();
    EXPECT_NEAR(ref_bf, want_bf, 1e-12 * want_bf) << n;
    for (Isa isa : runnable_isas()) {
      for (unsigned threads : {1u, 2u, 5u}) {
        EXPECT_EQ(sum_squares(x.data(), DType::kF32, n, {threads, isa}), ref) << to_string(isa);
        EXPECT_EQ(sum_squares(h.data(), DType::kBF16, n, {threads, isa}), ref_bf) << to_string(isa);
      }
    }
  }
}

TEST(Unscale, ScalesInPlaceAndFindsInfAndNan) {
  const size_t n = 300007;
  std::mt19937 rng(3);
  for (Isa isa : runnable_isas()) {
    for (int poison : {-1, 0, 17, 299999, 300006}) {  // where an inf/NaN sits (-1: nowhere)
      std::vector<float> x(n);
      for (auto& v : x) v = std::uniform_real_distribution<float>(-1e4f, 1e4f)(rng);
      if (poison >= 0) x[poison] = poison % 2 ? NAN : INFINITY;
      std::vector<float> want = x;
      for (auto& v : want) v *= 1.0f / 1024;
      const bool bad = unscale_and_check(x.data(), 1.0f / 1024, n, {2, isa});
      EXPECT_EQ(bad, poison >= 0) << to_string(isa) << " poison " << poison;
      for (size_t i = 0; i < n; ++i) ASSERT_TRUE(same_bits_or_both_nan(x[i], want[i])) << i;
    }
    // Overflow produced by the scaling itself is detected too.
    std::vector<float> big(100, 3e38f);
    EXPECT_TRUE(unscale_and_check(big.data(), 2.0f, big.size(), {1, isa}));
  }
}

struct AdamCase {
  bool adamw;
  double lr, beta1, beta2, eps, wd;
  DType grad;
};

// Runs 100 steps of libtorch's optimizer and of adam_step on the same parameters and gradients.
void check_against_libtorch(const AdamCase& c, size_t n, DType out_dtype) {
  at::manual_seed(static_cast<uint64_t>(n) * 31 + static_cast<uint64_t>(c.grad));
  at::Tensor p_ref = at::randn({static_cast<int64_t>(n)}, at::kFloat).set_requires_grad(false);
  std::vector<float> p(p_ref.data_ptr<float>(), p_ref.data_ptr<float>() + n), m(n, 0.f), v(n, 0.f);
  at::Tensor p_torch = p_ref.clone().set_requires_grad(true);
  std::unique_ptr<torch::optim::Optimizer> opt;
  if (c.adamw) {
    opt = std::make_unique<torch::optim::AdamW>(
        std::vector<at::Tensor>{p_torch},
        torch::optim::AdamWOptions(c.lr).betas({c.beta1, c.beta2}).eps(c.eps).weight_decay(c.wd));
  } else {
    opt = std::make_unique<torch::optim::Adam>(
        std::vector<at::Tensor>{p_torch},
        torch::optim::AdamOptions(c.lr).betas({c.beta1, c.beta2}).eps(c.eps).weight_decay(c.wd));
  }
  std::vector<uint16_t> g16(n), out16(n);
  std::vector<float> out32(n);
  for (int step = 1; step <= 100; ++step) {
    at::Tensor g = at::randn({static_cast<int64_t>(n)}, at::kFloat) * (1.0 + step % 7);
    if (c.grad != DType::kF32) {
      g = g.to(c.grad == DType::kBF16 ? at::kBFloat16 : at::kHalf);
      std::memcpy(g16.data(), g.data_ptr(), n * 2);
    }
    p_torch.mutable_grad() = g.to(at::kFloat);
    opt->step();
    AdamConfig cfg{c.lr, c.beta1, c.beta2, c.eps, c.wd, c.adamw, step};
    const void* gp = c.grad == DType::kF32 ? static_cast<const void*>(g.data_ptr<float>()) : g16.data();
    void* out = out_dtype == DType::kF32 ? static_cast<void*>(out32.data()) : out16.data();
    adam_step(cfg, p.data(), m.data(), v.data(), gp, c.grad, out, out_dtype, n, {2});
  }
  // Relative error in the 2-norm over the whole tensor: the two implementations round in a
  // different order (ATen fuses multiply-adds), so single elements near zero drift by a few ulps
  // of the update while the tensor as a whole agrees to ~1e-7.
  const float* want = p_torch.data_ptr<float>();
  double diff2 = 0, ref2 = 0, worst_abs = 0;
  for (size_t i = 0; i < n; ++i) {
    const double d = static_cast<double>(p[i]) - want[i];
    diff2 += d * d;
    ref2 += static_cast<double>(want[i]) * want[i];
    worst_abs = std::max(worst_abs, std::abs(d));
  }
  const double rel = std::sqrt(diff2 / ref2);
  EXPECT_LE(rel, 1e-6) << "n=" << n << " adamw=" << c.adamw << " wd=" << c.wd
                       << " grad=" << to_string(c.grad);
  // No single element is off by more than a few float ulps of a unit-sized parameter.
  EXPECT_LE(worst_abs, 2e-6) << "n=" << n << " adamw=" << c.adamw;
  std::printf("adam n=%zu adamw=%d wd=%.1f grad=%s: relative 2-norm error %.2e, max abs %.2e\n", n,
              c.adamw, c.wd, to_string(c.grad), rel, worst_abs);
  // The low-precision copy is libtorch's conversion of the fp32 result, bit for bit.
  at::Tensor ours = at::from_blob(p.data(), {static_cast<int64_t>(n)}, at::kFloat);
  if (out_dtype == DType::kF32) {
    EXPECT_EQ(0, std::memcmp(out32.data(), p.data(), n * 4));
  } else {
    at::Tensor conv = ours.to(out_dtype == DType::kBF16 ? at::kBFloat16 : at::kHalf);
    EXPECT_EQ(0, std::memcmp(conv.data_ptr(), out16.data(), n * 2)) << to_string(out_dtype);
  }
}

TEST(Adam, MatchesLibtorchOver100StepsForEveryOptionCombination) {
  for (bool adamw : {false, true}) {
    for (double wd : {0.0, 0.1}) {
      for (DType grad : {DType::kF32, DType::kBF16, DType::kF16}) {
        for (size_t n : {1ul, 7ul, 1000003ul}) {
          const AdamCase c{adamw, adamw ? 3e-3 : 1e-3, 0.9, adamw ? 0.95 : 0.999,
                           adamw ? 1e-6 : 1e-8, wd, grad};
          const DType out = grad == DType::kF32 ? DType::kBF16 : grad;  // every output dtype
          check_against_libtorch(c, n, n == 7 ? DType::kF32 : out);
        }
      }
    }
  }
}

TEST(Adam, EveryIsaThreadCountAndSubRangeIsBitwiseTheScalarResult) {
  const size_t n = 1000003;
  const auto p0 = nasty_floats(n, 5, false), g = nasty_floats(n, 6, false);
  std::vector<uint16_t> gb(n);
  convert(g.data(), DType::kF32, gb.data(), DType::kBF16, n);
  for (DType gt : {DType::kF32, DType::kBF16}) {
    const void* gp = gt == DType::kF32 ? static_cast<const void*>(g.data()) : gb.data();
    AdamConfig cfg{1e-3, 0.9, 0.999, 1e-8, 0.01, true, 3, 0.5};
    auto run = [&](CpuExec exec, size_t begin, size_t end, std::vector<float>& p,
                   std::vector<float>& m, std::vector<float>& v, std::vector<uint16_t>& out) {
      p = p0;
      m.assign(n, 0.01f);
      v.assign(n, 0.02f);
      out.assign(n, 0);
      for (int s = 0; s < 3; ++s) {
        adam_step(cfg, p.data() + begin, m.data() + begin, v.data() + begin,
                  static_cast<const std::byte*>(gp) + begin * dtype_bytes(gt), gt,
                  out.data() + begin, DType::kBF16, end - begin, exec);
      }
    };
    std::vector<float> pr, mr, vr, p, m, v;
    std::vector<uint16_t> outr, out;
    run({1, Isa::kScalar}, 0, n, pr, mr, vr, outr);
    for (Isa isa : runnable_isas()) {
      for (unsigned threads : {1u, 2u, 7u}) {
        run({threads, isa}, 0, n, p, m, v, out);
        ASSERT_EQ(0, std::memcmp(p.data(), pr.data(), n * 4)) << to_string(isa) << threads;
        ASSERT_EQ(0, std::memcmp(m.data(), mr.data(), n * 4)) << to_string(isa) << threads;
        ASSERT_EQ(0, std::memcmp(v.data(), vr.data(), n * 4)) << to_string(isa) << threads;
        ASSERT_EQ(out, outr) << to_string(isa) << threads;
      }
      // A sub-range (odd start, odd length) updates exactly those elements, identically.
      run({2, isa}, 12345, 987651, p, m, v, out);
      for (size_t i : {12345ul, 500000ul, 987650ul}) {
        ASSERT_EQ(std::bit_cast<uint32_t>(p[i]), std::bit_cast<uint32_t>(pr[i])) << i;
      }
      ASSERT_EQ(std::bit_cast<uint32_t>(p[12344]), std::bit_cast<uint32_t>(p0[12344]));
      ASSERT_EQ(std::bit_cast<uint32_t>(p[987651]), std::bit_cast<uint32_t>(p0[987651]));
    }
  }
}

TEST(Adam, RejectsInvalidHyperParameters) {
  float x = 0;
  AdamConfig bad;
  bad.step = 0;
  EXPECT_THROW(adam_step(bad, &x, &x, &x, &x, DType::kF32, nullptr, DType::kF32, 1), std::invalid_argument);
  bad = {};
  bad.beta2 = 1.0;
  EXPECT_THROW(adam_step(bad, &x, &x, &x, &x, DType::kF32, nullptr, DType::kF32, 1), std::invalid_argument);
  bad = {};
  bad.eps = 0;
  EXPECT_THROW(adam_step(bad, &x, &x, &x, &x, DType::kF32, nullptr, DType::kF32, 1), std::invalid_argument);
}

}  // namespace
}  // namespace strata::kernels
