// kernels::quantize_4bit / dequantize_4bit against bitsandbytes on the CPU (its quantize_4bit and
// dequantize_4bit, tests/kernels/py/bnb_quant4_oracle.py): packed bytes, absmax and the
// dequantized values bitwise (FP4's index 8: -0 where bitsandbytes' scalar CPU kernel runs, +0 from
// its AVX-512 kernel and its fallback for an odd last dimension), for NF4 and FP4, blocks of 32, 64 and 128, fp32, bf16 and fp16
// inputs of awkward sizes, tiny and large magnitudes, zeros, a constant block and values on the
// tables' midpoints; double quantization (compress_statistics) and the 8-bit blockwise quantization
// under it (bitwise too, the latter also alone); and the refusals.
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

// `out` against bitsandbytes' dequantized bytes: bitwise, but for FP4's index 8 (ours -0, as its
// scalar CPU kernel gives it), which its Python fallback for an odd last dimension decodes as +0 and
// its AVX-512 kernel (taken for a last dimension that is a multiple of 16 on an AVX-512 CPU) too:
// there bitsandbytes' value must be a zero, of either sign.
void expect_dequantized(const std::vector<uint8_t>& out, const std::vector<uint8_t>& want_out,
                        const std::vector<uint8_t>& packed, int64_t n, Quant4 type, DType dtype) {
  if (type == Quant4::kNf4 || (n % 2 == 0 && n % 16 != 0)) {
    EXPECT_EQ(out, want_out);
    return;
  }
  ASSERT_EQ(out.size(), want_out.size());
  for (int64_t i = 0; i < n; ++i) {
    const uint8_t q = i % 2 == 0 ? uint8_t(packed[size_t(i / 2)] >> 4) : uint8_t(packed[size_t(i / 2)] & 0xF);
    const size_t at = size_t(i) * dtype_bytes(dtype), bytes = dtype_bytes(dtype);
    if (q == 8)  // little-endian: the sign is the top bit of the last byte
      EXPECT_TRUE(std::all_of(want_out.begin() + long(at), want_out.begin() + long(at + bytes - 1),
                              [](uint8_t b) { return b == 0; }) && (want_out[at + bytes - 1] & 0x7F) == 0)
          << "element " << i;
    else
      EXPECT_EQ(std::memcmp(out.data() + at, want_out.data() + at, bytes), 0) << "element " << i;
  }
}

// Runs the oracle for `part` into `dir`.
void run_oracle(const test::TempDir& dir, const std::string& part) {
  const std::string cmd = std::string(STRATA_PYTHON) + " " + STRATA_TEST_KERNELS_PY_DIR "/bnb_quant4_oracle.py " +
                          dir.path().string() + " " + part;
  ASSERT_EQ(std::system(cmd.c_str()), 0) << cmd;
}

TEST(Quant4, BitwiseBitsandbytesOnTheCpu) {
  test::TempDir dir;
  ASSERT_NO_FATAL_FAILURE(run_oracle(dir, "plain"));
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
    expect_dequantized(out, want_out, packed, n, type, dtype);
    ++checked;
  }
  std::printf("%d cases bitwise equal to bitsandbytes\n", checked);
}

template <typename T>
std::vector<T> read_as(const std::filesystem::path& p) {
  const std::vector<uint8_t> bytes = read_bytes(p);
  std::vector<T> out(bytes.size() / sizeof(T));
  std::memcpy(out.data(), bytes.data(), out.size() * sizeof(T));
  return out;
}

bool same_bits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

// Distance in units in the last place between two finite floats of one sign.
int64_t ulps(float a, float b) {
  int32_t ia, ib;
  std::memcpy(&ia, &a, 4);
  std::memcpy(&ib, &b, 4);
  return std::abs(int64_t(ia) - int64_t(ib));
}

// The 8-bit blockwise quantization alone, its code table, and scaled values on its 65536 bins'
// edges and on the codes' midpoints.
TEST(Quant4, Blockwise8bitBitwiseBitsandbytesOnTheCpu) {
  test::TempDir dir;
  ASSERT_NO_FATAL_FAILURE(run_oracle(dir, "blockwise"));
  const std::vector<float> code(dynamic_map_8bit(), dynamic_map_8bit() + 256);
  EXPECT_TRUE(same_bits(code, read_as<float>(dir / "code8.bin")));
  EXPECT_TRUE(same_bits(code, read_as<float>(dir / "code8_state.bin")));  // not altered by quantizing
  std::ifstream index(dir / "blockwise.json");
  const nlohmann::json cases = nlohmann::json::parse(index);
  ASSERT_GE(cases.size(), 27u);
  for (const nlohmann::json& c : cases) {
    const std::string name = c["name"];
    SCOPED_TRACE(name);
    const int64_t n = c["n"], blocksize = c["blocksize"];
    const std::vector<float> in = read_as<float>(dir / (name + ".in"));
    const std::vector<uint8_t> want_q = read_bytes(dir / (name + ".q"));
    ASSERT_EQ(in.size(), size_t(n));
    std::vector<uint8_t> q(static_cast<size_t>(n));
    std::vector<float> absmax(size_t(quant4_blocks(n, blocksize))), out(static_cast<size_t>(n));
    quantize_blockwise_8bit(in.data(), n, blocksize, q.data(), absmax.data());
    EXPECT_EQ(q, want_q);
    EXPECT_TRUE(same_bits(absmax, read_as<float>(dir / (name + ".absmax"))));
    dequantize_blockwise_8bit(q.data(), absmax.data(), n, blocksize, out.data());
    EXPECT_TRUE(same_bits(out, read_as<float>(dir / (name + ".out"))));
  }
  std::printf("%zu 8-bit cases bitwise equal to bitsandbytes\n", cases.size());
}

// Double quantization (compress_statistics=True): packed, qabsmax, nested absmax and the
// dequantized values bitwise, from the oracle's offset (torch's mean; this test has no libtorch).
// The offset is checked against the mean summed in double and rounded to fp32: within 2 units in
// the last place (torch sums in fp32, cascaded); the count of exact matches is printed.
TEST(Quant4, DoubleQuantBitwiseBitsandbytesOnTheCpu) {
  test::TempDir dir;
  ASSERT_NO_FATAL_FAILURE(run_oracle(dir, "nested"));
  std::ifstream index(dir / "nested.json");
  const nlohmann::json cases = nlohmann::json::parse(index);
  ASSERT_GT(cases.size(), 100u);
  int exact_means = 0;
  for (const nlohmann::json& c : cases) {
    const std::string name = c["name"];
    SCOPED_TRACE(name);
    const int64_t n = c["n"], blocksize = c["blocksize"];
    const Quant4 type = quant4_from_string(c["type"]);
    const DType dtype = dtype_of(c["dtype"]);
    const int64_t blocks = quant4_blocks(n, blocksize), nested_blocks = quant4_nested_blocks(n, blocksize);
    const std::vector<uint8_t> in = read_bytes(dir / (name + ".in")), want_packed = read_bytes(dir / (name + ".packed")),
                               want_q = read_bytes(dir / (name + ".qabsmax")), want_out = read_bytes(dir / (name + ".out"));
    const std::vector<float> want_nested = read_as<float>(dir / (name + ".nested"));
    const std::vector<float> offset = read_as<float>(dir / (name + ".offset"));
    ASSERT_EQ(in.size(), size_t(n) * dtype_bytes(dtype));
    ASSERT_EQ(want_q.size(), size_t(blocks));
    ASSERT_EQ(want_nested.size(), size_t(nested_blocks));
    ASSERT_EQ(offset.size(), 1u);

    std::vector<float> absmax(static_cast<size_t>(blocks));
    quant4_absmax(in.data(), dtype, n, blocksize, absmax.data());
    double sum = 0;
    for (float a : absmax) sum += a;
    const float mean = float(sum / double(blocks));
    EXPECT_LE(ulps(mean, offset[0]), 2) << mean << " vs torch's " << offset[0];
    exact_means += mean == offset[0];

    std::vector<uint8_t> packed(want_packed.size()), q(static_cast<size_t>(blocks));
    std::vector<float> nested(static_cast<size_t>(nested_blocks));
    quantize_4bit_nested(in.data(), dtype, n, type, blocksize, offset[0], packed.data(), q.data(), nested.data());
    EXPECT_EQ(packed, want_packed);
    EXPECT_EQ(q, want_q);
    EXPECT_TRUE(same_bits(nested, want_nested));
    std::vector<uint8_t> out(in.size());
    dequantize_4bit_nested(packed.data(), q.data(), nested.data(), offset[0], n, type, blocksize, out.data(), dtype);
    expect_dequantized(out, want_out, packed, n, type, dtype);
  }
  std::printf("%zu double-quantized cases bitwise equal to bitsandbytes; the fp32 mean of the double sum is "
              "torch's exactly in %d\n", cases.size(), exact_means);
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
  EXPECT_THROW(quantize_blockwise_8bit(x, 0, 64, packed, absmax), std::invalid_argument);
  EXPECT_THROW(quantize_blockwise_8bit(x, 3, 0, packed, absmax), std::invalid_argument);
  EXPECT_THROW(quant4_absmax(x, DType::kF32, 3, 100, absmax), std::invalid_argument);
  EXPECT_THROW(quantize_4bit_nested(x, DType::kF32, 3, Quant4::kFp4, 16, 0.0f, packed, packed, absmax),
               std::invalid_argument);
  EXPECT_THROW(dequantize_quant4_absmax(packed, absmax, 0.0f, 0, absmax), std::invalid_argument);
}

}  // namespace
}  // namespace strata::kernels
