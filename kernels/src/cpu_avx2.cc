// AVX2 + FMA + F16C path (compiled with -mavx2 -mfma -mf16c; FMA is never contracted in).
#include <immintrin.h>

#include "cpu_kernels_impl.h"

namespace strata::kernels::detail {
namespace {

struct Avx2V {
  static constexpr size_t W = 8;
  using F = __m256;
  static F set1(float x) { return _mm256_set1_ps(x); }
  static F load(const float* p) { return _mm256_loadu_ps(p); }
  static void store(float* p, F x) { _mm256_storeu_ps(p, x); }
  static F add(F a, F b) { return _mm256_add_ps(a, b); }
  static F mul(F a, F b) { return _mm256_mul_ps(a, b); }
  static F div(F a, F b) { return _mm256_div_ps(a, b); }
  static F sqrt(F a) { return _mm256_sqrt_ps(a); }

  static F load_as_f32(const void* p, DType t, size_t i) {
    switch (t) {
      case DType::kF32: return _mm256_loadu_ps(static_cast<const float*>(p) + i);
      case DType::kBF16: {
        const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(p) + i));
        return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
      }
      case DType::kF16: {
        const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(p) + i));
        return _mm256_cvtph_ps(h);
      }
    }
    return _mm256_setzero_ps();
  }

  static void store_from_f32(void* p, DType t, size_t i, F x) {
    if (t == DType::kF32) return _mm256_storeu_ps(static_cast<float*>(p) + i, x);
    if (_mm256_movemask_ps(_mm256_cmp_ps(x, x, _CMP_UNORD_Q)) != 0) {
      // NaN present: let the reference write these lanes (canonical NaN, as libtorch).
      alignas(32) float tmp[W];
      _mm256_store_ps(tmp, x);
      for (size_t l = 0; l < W; ++l) ScalarV::store_from_f32(p, t, i + l, tmp[l]);
      return;
    }
    auto* out = reinterpret_cast<__m128i*>(static_cast<uint16_t*>(p) + i);
    if (t == DType::kBF16) {
      const __m256i bits = _mm256_castps_si256(x);
      const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
      const __m256i r = _mm256_srli_epi32(
          _mm256_add_epi32(_mm256_add_epi32(bits, _mm256_set1_epi32(0x7FFF)), lsb), 16);
      const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0x08);
      _mm_storeu_si128(out, _mm256_castsi256_si128(packed));
    } else {
      _mm_storeu_si128(out, _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    }
  }

  static bool any_nonfinite(F x) {
    const __m256i e = _mm256_and_si256(_mm256_castps_si256(x), _mm256_set1_epi32(0x7F800000));
    return _mm256_movemask_epi8(_mm256_cmpeq_epi32(e, _mm256_set1_epi32(0x7F800000))) != 0;
  }

  static void square_accumulate(const void* x, DType t, size_t n, double* lanes) {
    __m256d acc[4] = {_mm256_setzero_pd(), _mm256_setzero_pd(), _mm256_setzero_pd(),
                      _mm256_setzero_pd()};
    for (size_t i = 0; i < n; i += 16) {
      const F a = load_as_f32(x, t, i), b = load_as_f32(x, t, i + 8);
      const __m256d d[4] = {_mm256_cvtps_pd(_mm256_castps256_ps128(a)),
                            _mm256_cvtps_pd(_mm256_extractf128_ps(a, 1)),
                            _mm256_cvtps_pd(_mm256_castps256_ps128(b)),
                            _mm256_cvtps_pd(_mm256_extractf128_ps(b, 1))};
      for (int k = 0; k < 4; ++k) acc[k] = _mm256_add_pd(acc[k], _mm256_mul_pd(d[k], d[k]));
    }
    for (int k = 0; k < 4; ++k) {
      alignas(32) double tmp[4];
      _mm256_store_pd(tmp, acc[k]);
      for (int l = 0; l < 4; ++l) lanes[4 * k + l] += tmp[l];
    }
  }
};

}  // namespace

const IsaTable& avx2_table() { return make_table<Avx2V>(); }

}  // namespace strata::kernels::detail
