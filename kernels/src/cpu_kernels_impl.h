// The kernel algorithms, written once over a vector type V (private header; included by exactly
// one translation unit per ISA, compiled with that ISA's flags and -ffp-contract=off).
//
// V provides: W (lanes), F (vector of W floats), set1, load/store, add/mul/div/sqrt,
// load_as_f32 (fp32/bf16/fp16 -> F), store_from_f32 (F -> fp32/bf16/fp16, NaN as the scalar
// reference writes it), any_nonfinite, and square_accumulate into 16 fp64 lanes. Elements past the
// last full vector go through ScalarV, whose operations round identically.
#pragma once

#include <bit>
#include <cmath>
#include <cstring>

#include "cpu_kernels.h"

namespace strata::kernels::detail {

struct ScalarV {
  static constexpr size_t W = 1;
  using F = float;
  static F set1(float x) { return x; }
  static F load(const float* p) { return *p; }
  static void store(float* p, F x) { *p = x; }
  static F add(F a, F b) { return a + b; }
  static F mul(F a, F b) { return a * b; }
  static F div(F a, F b) { return a / b; }
  static F sqrt(F a) { return std::sqrt(a); }
  static F load_as_f32(const void* p, DType t, size_t i) {
    switch (t) {
      case DType::kF32: return static_cast<const float*>(p)[i];
      case DType::kBF16: return bf16_to_float(static_cast<const uint16_t*>(p)[i]);
      case DType::kF16: return fp16_to_float(static_cast<const uint16_t*>(p)[i]);
    }
    return 0;
  }
  static void store_from_f32(void* p, DType t, size_t i, F x) {
    switch (t) {
      case DType::kF32: static_cast<float*>(p)[i] = x; break;
      case DType::kBF16: static_cast<uint16_t*>(p)[i] = float_to_bf16(x); break;
      case DType::kF16: static_cast<uint16_t*>(p)[i] = float_to_fp16(x); break;
    }
  }
  static bool any_nonfinite(F x) { return !std::isfinite(x); }
};

template <class V>
void adam_range(const AdamConsts& k, float* p, float* m, float* v, const void* g, DType gt,
                void* out, DType ot, size_t begin, size_t end) {
  using F = typename V::F;
  const F gs = V::set1(k.grad_scale), wd = V::set1(k.wd_l2), decay = V::set1(k.decay),
          b1 = V::set1(k.beta1), omb1 = V::set1(k.one_minus_beta1), b2 = V::set1(k.beta2),
          omb2 = V::set1(k.one_minus_beta2), bc2 = V::set1(k.bc2_sqrt), eps = V::set1(k.eps),
          nss = V::set1(k.neg_step_size);
  const bool l2 = k.wd_l2 != 0.0f, decoupled = k.decay != 1.0f;
  for (size_t i = begin; i < end; i += V::W) {
    F pi = V::load(p + i);
    F gi = V::mul(V::load_as_f32(g, gt, i), gs);
    if (l2) gi = V::add(gi, V::mul(wd, pi));
    if (decoupled) pi = V::mul(pi, decay);
    const F mi = V::add(V::mul(V::load(m + i), b1), V::mul(omb1, gi));
    const F vi = V::add(V::mul(V::load(v + i), b2), V::mul(V::mul(omb2, gi), gi));
    const F denom = V::add(V::div(V::sqrt(vi), bc2), eps);
    pi = V::add(pi, V::div(V::mul(nss, mi), denom));
    V::store(m + i, mi);
    V::store(v + i, vi);
    V::store(p + i, pi);
    if (out != nullptr) V::store_from_f32(out, ot, i, pi);
  }
}

template <class V>
void adam(const AdamConsts& k, float* p, float* m, float* v, const void* g, DType gt, void* out,
          DType ot, size_t n) {
  const size_t body = n / V::W * V::W;
  adam_range<V>(k, p, m, v, g, gt, out, ot, 0, body);
  adam_range<ScalarV>(k, p, m, v, g, gt, out, ot, body, n);
}

template <class V>
double sum_squares_block(const void* x, DType t, size_t n) {
  double lanes[kLanes] = {};
  const size_t body = n / kLanes * kLanes;
  V::square_accumulate(x, t, body, lanes);
  for (size_t i = body; i < n; ++i) {
    const double xi = ScalarV::load_as_f32(x, t, i);
    lanes[i % kLanes] += xi * xi;
  }
  // Pairwise: ((l0 + l1) + (l2 + l3)) + ..., fixed for every path.
  for (size_t width = kLanes / 2; width >= 1; width /= 2) {
    for (size_t l = 0; l < width; ++l) lanes[l] = lanes[2 * l] + lanes[2 * l + 1];
  }
  return lanes[0];
}

template <class V>
bool unscale(float* x, float scale, size_t n) {
  const size_t body = n / V::W * V::W;
  const auto s = V::set1(scale);
  bool bad = false;
  for (size_t i = 0; i < body; i += V::W) {
    const auto y = V::mul(V::load(x + i), s);
    V::store(x + i, y);
    bad |= V::any_nonfinite(y);
  }
  for (size_t i = body; i < n; ++i) {
    x[i] *= scale;
    bad |= !std::isfinite(x[i]);
  }
  return bad;
}

template <class V>
void convert(const void* src, DType st, void* dst, DType dt, size_t n) {
  const size_t body = n / V::W * V::W;
  for (size_t i = 0; i < body; i += V::W) V::store_from_f32(dst, dt, i, V::load_as_f32(src, st, i));
  for (size_t i = body; i < n; ++i) {
    ScalarV::store_from_f32(dst, dt, i, ScalarV::load_as_f32(src, st, i));
  }
}

template <class V>
const IsaTable& make_table() {
  static const IsaTable table{&adam<V>, &sum_squares_block<V>, &unscale<V>, &convert<V>};
  return table;
}

}  // namespace strata::kernels::detail
