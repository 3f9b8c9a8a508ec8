#include "strata/offload/crc32c.h"

#include <array>
#include <cstring>

namespace strata::offload {
namespace {

constexpr uint32_t kPoly = 0x82F63B78u;  // reflected Castagnoli polynomial

const std::array<uint32_t, 256>& table() {
  static const std::array<uint32_t, 256> t = [] {
    std::array<uint32_t, 256> a{};
    for (uint32_t i = 0; i < 256; ++i) {
      uint32_t c = i;
      for (int k = 0; k < 8; ++k) c = (c >> 1) ^ (kPoly & (0u - (c & 1u)));
      a[i] = c;
    }
    return a;
  }();
  return t;
}

uint32_t crc_table(const unsigned char* p, size_t n, uint32_t c) {
  const auto& t = table();
  for (size_t i = 0; i < n; ++i) c = t[(c ^ p[i]) & 0xFF] ^ (c >> 8);
  return c;
}

// Polynomials mod P in the reflected representation: bit 31 is x^0, bit 0 is x^31.
// a * b mod P, by shift and add (b times x is one reflected step).
uint32_t multiply_mod_p(uint32_t a, uint32_t b) {
  uint32_t product = 0;
  for (uint32_t m = 1u << 31; m != 0; m >>= 1) {
    if (a & m) product ^= b;
    b = (b >> 1) ^ (kPoly & (0u - (b & 1u)));
  }
  return product;
}

// x^(8 n) mod P: what a CRC register is multiplied by when n zero bytes follow.
uint32_t x_pow_8n(uint64_t n) {
  static const std::array<uint32_t, 64> x_pow_2k = [] {  // x^(2^k) mod P
    std::array<uint32_t, 64> a{};
    a[0] = 1u << 30;  // x^1
    for (size_t k = 1; k < a.size(); ++k) a[k] = multiply_mod_p(a[k - 1], a[k - 1]);
    return a;
  }();
  uint32_t r = 1u << 31;  // x^0
  uint64_t bits = n * 8;
  for (size_t k = 0; bits != 0; ++k, bits >>= 1)
    if (bits & 1) r = multiply_mod_p(r, x_pow_2k[k]);
  return r;
}

#if defined(__x86_64__)
__attribute__((target("sse4.2"))) uint32_t crc_sse42_serial(const unsigned char* p, size_t n, uint32_t c) {
  uint64_t c64 = c;
  while (n >= 8) {
    uint64_t v;
    std::memcpy(&v, p, 8);
    c64 = __builtin_ia32_crc32di(c64, v);
    p += 8;
    n -= 8;
  }
  uint32_t c32 = uint32_t(c64);
  while (n--) c32 = __builtin_ia32_crc32qi(c32, *p++);
  return c32;
}

// The crc32 instruction has a latency of about 3 cycles and a throughput of one a cycle: three
// independent streams over thirds of the buffer keep it busy, and the register of the first two
// is carried across the rest (raw(c, A || B) = raw(c, A) * x^(8|B|) ^ raw(0, B)).
__attribute__((target("sse4.2"))) uint32_t crc_sse42(const unsigned char* p, size_t n, uint32_t c) {
  constexpr size_t kMinSplit = 4096;  // below this the combination costs more than it saves
  if (n < 3 * kMinSplit) return crc_sse42_serial(p, n, c);
  const size_t third = n / 3 / 8 * 8;
  const unsigned char* a = p;
  const unsigned char* b = p + third;
  const unsigned char* d = p + 2 * third;
  uint64_t ca = c, cb = 0, cd = 0;
  for (size_t i = 0; i < third; i += 8) {
    uint64_t va, vb, vd;
    std::memcpy(&va, a + i, 8);
    std::memcpy(&vb, b + i, 8);
    std::memcpy(&vd, d + i, 8);
    ca = __builtin_ia32_crc32di(ca, va);
    cb = __builtin_ia32_crc32di(cb, vb);
    cd = __builtin_ia32_crc32di(cd, vd);
  }
  const uint32_t shift = x_pow_8n(third);
  uint32_t r = multiply_mod_p(uint32_t(ca), shift) ^ uint32_t(cb);
  r = multiply_mod_p(r, shift) ^ uint32_t(cd);
  return crc_sse42_serial(d + third, n - 3 * third, r);
}
#endif

}  // namespace

uint32_t crc32c(const void* data, size_t n, uint32_t crc) {
  const auto* p = static_cast<const unsigned char*>(data);
  uint32_t c = ~crc;
#if defined(__x86_64__)
  static const bool hw = __builtin_cpu_supports("sse4.2");
  c = hw ? crc_sse42(p, n, c) : crc_table(p, n, c);
#else
  c = crc_table(p, n, c);
#endif
  return ~c;
}

}  // namespace strata::offload
