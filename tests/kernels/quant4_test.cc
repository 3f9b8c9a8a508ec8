// kernels::quantize_4bit / dequantize_4bit against bitsandbytes on the CPU (its quantize_4bit and
// dequantize_4bit, tests/kernels/py/bnb_quant4_oracle.py): packed bytes, absmax and the
// dequantized values bitwise (FP4's index 8: -0 where bitsandbytes' CPU kernel runs, +0 from its
// fallback for an odd last dimension), for NF4 and FP4, blocks of 32, 64 and 128, fp32, bf16 and fp16
// inputs of awkward sizes, tiny and large magnitudes, zeros, a constant block and values on the
// tables' midpoints; and the refusals.
#include "strata/kernels/quant4.h"

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <iterator>
#include <vector>

#include "test_util.h"

namespace strata::kernels {
namespace {

std::vector<uint8_t> read_bytes(const std::filesystem::path& p) {
  std::ifstream f(p, std::ios::binary);
  return {std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>()};
}

DType dtype_of(const std::string& name) {
  if (name == "float32") return DType::kF32;
  if (name == "bfloat16") return DType::kBF16;
  if (name == "float16") return DType::kF16;
  throw std::invalid_argument("dtype " + name);
}

TEST(Quant4, BitwiseBitsandbytesOnTheCpu) {
  test::TempDir dir;
  const std::string cmd = std::string(STRATA_PYTHON) + " " + STRATA_TEST_KERNELS_PY_DIR "/bnb_quant4_oracle.py " +
                          dir.path().string();
  ASSERT_EQ(std::system(cmd.c_str()), 0) << cmd;
  std::ifstream index(dir / "cases.json");
  const nlohmann::json cases = nlohmann::json::parse(index);
  ASSERT_GT(cases.size(), 100u);
  int checked = 0;
  for (const nlohmann::json& c : cases) {
    const std::string name = c["name"];
    SCOPED_TRACE(name);
    const int64_t n = c["n"], blocksize = c["blocksize"];
    const Quant4 type = quant4_from_string(c["type"]);
    const DType dtype = dtype_of(c["dtype"]);
    const std::vector<uint8_t> in = read_bytes(dir / (name + ".in")), want_packed = read_bytes(dir / (name + ".packed")),
                               want_absmax = read_bytes(dir / (name + ".absmax")),
                               want_out = read_bytes(dir / (name + ".out"));
    ASSERT_EQ(in.size(), size_t(n) * dtype_bytes(dtype));
    ASSERT_EQ(want_packed.size(), size_t(quant4_packed_bytes(n)));
    ASSERT_EQ(want_absmax.size(), size_t(quant4_blocks(n, blocksize)) * 4);
    std::vector<uint8_t> packed(want_packed.size());
    std::vector<float> absmax(size_t(quant4_blocks(n, blocksize)));
    quantize_4bit(in.data(), dtype, n, type, blocksize, packed.data(), absmax.data());
    EXPECT_EQ(packed, want_packed);
    EXPECT_EQ(std::memcmp(absmax.data(), want_absmax.data(), want_absmax.size()), 0);
    std::vector<uint8_t> out(in.size());
    dequantize_4bit(packed.data(), absmax.data(), n, type, blocksize, out.data(), dtype);
    if (n % 2 == 0 || type == Quant4::kNf4) {
      EXPECT_EQ(out, want_out);
    } else {  // bitsandbytes' Python fallback for an odd last dimension decodes FP4's index 8 as +0
      for (int64_t i = 0; i < n; ++i) {
        const uint8_t q = i % 2 == 0 ? uint8_t(packed[size_t(i / 2)] >> 4) : uint8_t(packed[size_t(i / 2)] & 0xF);
        const size_t at = size_t(i) * dtype_bytes(dtype), bytes = dtype_bytes(dtype);
        if (q == 8)
          EXPECT_TRUE(std::all_of(want_out.begin() + long(at), want_out.begin() + long(at + bytes),
                                  [](uint8_t b) { return b == 0; })) << "element " << i;
        else
          EXPECT_EQ(std::memcmp(out.data() + at, want_out.data() + at, bytes), 0) << "element " << i;
      }
    }
    ++checked;
  }
  std::printf("%d cases bitwise equal to bitsandbytes\n", checked);
}

TEST(Quant4, BadInputIsRefused) {
  EXPECT_THROW(quant4_from_string("int4"), std::invalid_argument);
  EXPECT_EQ(test::error_of([] { quant4_from_string("NF4"); }).find("unknown 4-bit quant type \"NF4\""), 0u);
  float x[3] = {1, 2, 3}, absmax[1];
  uint8_t packed[2];
  EXPECT_NE(test::error_of([&] { quantize_4bit(x, DType::kF32, 3, Quant4::kNf4, 48, packed, absmax); })
                .find("blocksize 48"),
            std::string::npos);
  EXPECT_THROW(quantize_4bit(x, DType::kF32, 0, Quant4::kNf4, 64, packed, absmax), std::invalid_argument);
}

}  // namespace
}  // namespace strata::kernels
