// Bit-exact fp32 <-> bf16/fp16 conversions shared by the CPU and CUDA kernels (private header).
// Round to nearest even; NaN written as libtorch writes it (bf16 0x7FC0, fp16 sign|0x7E00);
// fp16 -> fp32 quiets NaN as F16C does.
#pragma once

#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#define STRATA_HD __host__ __device__ __forceinline__
#else
#define STRATA_HD inline
#endif

namespace strata::kernels::bits {

STRATA_HD uint32_t f2u(float f) {
  uint32_t u;
  memcpy(&u, &f, 4);
  return u;
}
STRATA_HD float u2f(uint32_t u) {
  float f;
  memcpy(&f, &u, 4);
  return f;
}

STRATA_HD uint16_t float_to_bf16(float f) {
  const uint32_t x = f2u(f);
  if ((x & 0x7FFFFFFFu) > 0x7F800000u) return 0x7FC0;
  return static_cast<uint16_t>((x + 0x7FFFu + ((x >> 16) & 1u)) >> 16);
}

STRATA_HD float bf16_to_float(uint16_t h) { return u2f(static_cast<uint32_t>(h) << 16); }

STRATA_HD uint16_t float_to_fp16(float f) {
  const uint32_t x = f2u(f);
  const uint16_t sign = static_cast<uint16_t>((x >> 16) & 0x8000u);
  const uint32_t ax = x & 0x7FFFFFFFu;
  if (ax > 0x7F800000u) return sign | 0x7E00u;   // NaN
  if (ax >= 0x477FF000u) return sign | 0x7C00u;  // >= 65520 rounds to infinity
  if (ax < 0x38800000u) {                        // below 2^-14: subnormal half or zero
    if (ax <= 0x33000000u) return sign;          // <= 2^-25 rounds to zero (ties to even)
    const uint32_t e = ax >> 23, m = (ax & 0x7FFFFFu) | 0x800000u, shift = 126 - e;
    uint32_t r = m >> shift;
    const uint32_t rem = m & ((1u << shift) - 1), half = 1u << (shift - 1);
    if (rem > half || (rem == half && (r & 1u))) ++r;
    return sign | static_cast<uint16_t>(r);
  }
  uint32_t h = (ax - (112u << 23)) >> 13;  // rebias exponent 127 -> 15, drop 13 mantissa bits
  const uint32_t rem = ax & 0x1FFFu;
  if (rem > 0x1000u || (rem == 0x1000u && (h & 1u))) ++h;
  return sign | static_cast<uint16_t>(h);
}

STRATA_HD float fp16_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t e = (h >> 10) & 0x1Fu, m = h & 0x3FFu;
  if (e == 0x1F) return u2f(sign | 0x7F800000u | (m << 13) | (m ? 0x400000u : 0u));
  if (e == 0) {
    // subnormal (or zero): m * 2^-24, exact; built from bits to avoid ldexp on the device
    if (m == 0) return u2f(sign);
    int lead = 9;  // position of the leading 1 (0..9)
    while (!(m >> lead)) --lead;
    const uint32_t exp = static_cast<uint32_t>(lead + 103);  // 2^(lead - 24) -> biased
    const uint32_t mant = (m << (23 - lead)) & 0x7FFFFFu;
    return u2f(sign | (exp << 23) | mant);
  }
  return u2f(sign | ((e + 112) << 23) | (m << 13));
}

}  // namespace strata::kernels::bits
