// AVX-512F/BW path (compiled with -mavx512f -mavx512bw -mavx2 -mfma -mf16c; no FMA contraction).
#include <immintrin.h>

#include "cpu_kernels_impl.h"

namespace strata::kernels::detail {
namespace {

struct Avx512V {
  static constexpr size_t W = 16;
  using F = __m512;
  static F set1(float x) { return _mm512_set1_ps(x); }
  static F load(const float* p) { return _mm512_loadu_ps(p); }
  static void store(float* p, F x) { _mm512_storeu_ps(p, x); }
  static F add(F a, F b) { return _mm512_add_ps(a, b); }
  static F mul(F a, F b) { return _mm512_mul_ps(a, b); }
  static F div(F a, F b) { return _mm512_div_ps(a, b); }
  static F sqrt(F a) { return _mm512_sqrt_ps(a); }

  static F load_as_f32(const void* p, DType t, size_t i) {
    switch (t) {
      case DType::kF32: return _mm512_loadu_ps(static_cast<const float*>(p) + i);
      case DType::kBF16: {
        const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(static_cast<const uint16_t*>(p) + i));
        return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
      }
      case DType::kF16: {
        const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(static_cast<const uint16_t*>(p) + i));
        return _mm512_cvtph_ps(h);
      }
    }
    return _mm512_setzero_ps();
  }

  static void store_from_f32(void* p, DType t, size_t i, F x) {
    if (t == DType::kF32) return _mm512_storeu_ps(static_cast<float*>(p) + i, x);
    if (_mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q) != 0) {
      alignas(64) float tmp[W];
      _mm512_store_ps(tmp, x);
      for (size_t l = 0; l < W; ++l) ScalarV::store_from_f32(p, t, i + l, tmp[l]);
      return;
    }
    auto* out = reinterpret_cast<__m256i*>(static_cast<uint16_t*>(p) + i);
    if (t == DType::kBF16) {
      const __m512i bits = _mm512_castps_si512(x);
      const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
      const __m512i r = _mm512_srli_epi32(
          _mm512_add_epi32(_mm512_add_epi32(bits, _mm512_set1_epi32(0x7FFF)), lsb), 16);
      _mm256_storeu_si256(out, _mm512_cvtepi32_epi16(r));
    } else {
      _mm256_storeu_si256(out, _mm512_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    }
  }

  static bool any_nonfinite(F x) {
    const __m512i e = _mm512_and_si512(_mm512_castps_si512(x), _mm512_set1_epi32(0x7F800000));
    return _mm512_cmpeq_epi32_mask(e, _mm512_set1_epi32(0x7F800000)) != 0;
  }

  static void square_accumulate(const void* x, DType t, size_t n, double* lanes) {
    __m512d lo = _mm512_setzero_pd(), hi = _mm512_setzero_pd();
    for (size_t i = 0; i < n; i += 16) {
      const F a = load_as_f32(x, t, i);
      const __m512d dlo = _mm512_cvtps_pd(_mm512_castps512_ps256(a));
      const __m512d dhi = _mm512_cvtps_pd(
          _mm256_castsi256_ps(_mm512_extracti64x4_epi64(_mm512_castps_si512(a), 1)));
      lo = _mm512_add_pd(lo, _mm512_mul_pd(dlo, dlo));
      hi = _mm512_add_pd(hi, _mm512_mul_pd(dhi, dhi));
    }
    alignas(64) double tmp[16];
    _mm512_store_pd(tmp, lo);
    _mm512_store_pd(tmp + 8, hi);
    for (int l = 0; l < 16; ++l) lanes[l] += tmp[l];
  }
};

}  // namespace

const IsaTable& avx512_table() { return make_table<Avx512V>(); }

}  // namespace strata::kernels::detail
