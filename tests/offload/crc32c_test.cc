// CRC32C against its definition (bit at a time over the reflected Castagnoli polynomial), on
// random buffers of awkward lengths and alignments, whole and continued piece by piece.
#include "strata/offload/crc32c.h"

#include <gtest/gtest.h>

#include <cstring>
#include <random>
#include <string>
#include <vector>

namespace {

uint32_t crc32c_by_definition(const unsigned char* p, size_t n, uint32_t crc = 0) {
  uint32_t c = ~crc;
  for (size_t i = 0; i < n; ++i) {
    c ^= p[i];
    for (int k = 0; k < 8; ++k) c = (c & 1) ? (c >> 1) ^ 0x82F63B78u : c >> 1;
  }
  return ~c;
}

TEST(Crc32c, CheckValue) {
  const std::string s = "123456789";
  EXPECT_EQ(strata::offload::crc32c(s.data(), s.size()), 0xE3069283u);
  EXPECT_EQ(strata::offload::crc32c(s.data(), 0), 0u);
}

TEST(Crc32c, MatchesTheDefinitionOnAwkwardSizesAndAlignments) {
  std::mt19937_64 rng(20261123);
  std::vector<unsigned char> buf((1 << 20) + 64);
  for (auto& b : buf) b = static_cast<unsigned char>(rng());
  // Short (serial path), around the three-stream threshold, and long with odd tails.
  const size_t sizes[] = {1, 7, 8, 9, 63, 4095, 12287, 12288, 12289, 12296, 24577, 65536 + 13,
                          (1 << 20) - 5, 1 << 20};
  for (size_t n : sizes)
    for (size_t align : {0, 1, 3, 8, 13}) {
      const unsigned char* p = buf.data() + align;
      EXPECT_EQ(strata::offload::crc32c(p, n), crc32c_by_definition(p, n)) << "n=" << n << " align=" << align;
    }
}

TEST(Crc32c, ContinuesAcrossPieces) {
  std::mt19937_64 rng(7);
  std::vector<unsigned char> buf(300001);
  for (auto& b : buf) b = static_cast<unsigned char>(rng());
  const uint32_t whole = crc32c_by_definition(buf.data(), buf.size());
  for (int trial = 0; trial < 20; ++trial) {
    uint32_t c = 0;
    for (size_t at = 0; at < buf.size();) {
      const size_t n = std::min<size_t>(buf.size() - at, rng() % 50000);
      c = strata::offload::crc32c(buf.data() + at, n, c);
      at += n;
    }
    EXPECT_EQ(c, whole) << "trial " << trial;
  }
}

}  // namespace
