#include "strata/kernels/quant4.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <numeric>
#include <stdexcept>
#include <vector>

#include "float_bits.h"

namespace strata::kernels {
namespace {

// bitsandbytes' tables (functional.get_4bit_type), as fp32.
constexpr std::array<float, 16> kNf4 = {
    -1.0f, -0.6961928009986877f, -0.5250730514526367f, -0.39491748809814453f, -0.28444138169288635f,
    -0.18477343022823334f, -0.09105003625154495f, 0.0f, 0.07958029955625534f, 0.16093020141124725f,
    0.24611230194568634f, 0.33791524171829224f, 0.44070982933044434f, 0.5626170039176941f, 0.7229568362236023f,
    1.0f};
// FP4 (1 sign, 2 exponent, 1 mantissa bits, bitsandbytes' scaling). Index 8 is the negative
// zero, as bitsandbytes' scalar CPU kernel decodes it (its table, its AVX-512 kernel and its Python
// fallback for tensors whose last dimension is odd hold +0 there).
constexpr std::array<float, 16> kFp4 = {
    0.0f, 0.0052083334885537624f, 0.6666666865348816f, 1.0f, 0.3333333432674408f, 0.5f, 0.1666666716337204f, 0.25f,
    -0.0f, -0.0052083334885537624f, -0.6666666865348816f, -1.0f, -0.3333333432674408f, -0.5f, -0.1666666716337204f,
    -0.25f};

// The codes sorted (ties in index order, as torch.argsort gives them for these tables) and the
// 15 midpoints between neighbours: a value's index is its count of midpoints strictly below it.
struct Bounds {
  std::array<uint8_t, 16> order;
  std::array<float, 15> mid;
};

Bounds bounds_of(const std::array<float, 16>& code) {
  Bounds b;
  std::iota(b.order.begin(), b.order.end(), 0);
  std::stable_sort(b.order.begin(), b.order.end(), [&](uint8_t i, uint8_t j) { return code[i] < code[j]; });
  for (int i = 0; i < 15; ++i) b.mid[size_t(i)] = (code[b.order[size_t(i)]] + code[b.order[size_t(i) + 1]]) / 2.0f;
  return b;
}

const Bounds& bounds(Quant4 type) {
  static const Bounds nf4 = bounds_of(kNf4), fp4 = bounds_of(kFp4);
  return type == Quant4::kNf4 ? nf4 : fp4;
}

uint8_t index_of(float v, const Bounds& b) {
  int below = 0;
  while (below < 15 && b.mid[size_t(below)] < v) ++below;
  return b.order[size_t(below)];
}

float load(const void* x, DType dtype, int64_t i) {
  switch (dtype) {
    case DType::kF32: return static_cast<const float*>(x)[i];
    case DType::kBF16: return bits::bf16_to_float(static_cast<const uint16_t*>(x)[i]);
    case DType::kF16: return bits::fp16_to_float(static_cast<const uint16_t*>(x)[i]);
  }
  return 0;
}

float max_magnitude(const void* x, DType dtype, int64_t begin, int64_t end) {
  float m = 0;
  for (int64_t i = begin; i < end; ++i) m = std::max(m, std::fabs(load(x, dtype, i)));
  return m;
}

void check(int64_t n, int64_t blocksize) {
  if (n < 1) throw std::invalid_argument("quantize_4bit: no elements");
  if (blocksize < 32 || blocksize > 4096 || (blocksize & (blocksize - 1)) != 0)
    throw std::invalid_argument("quantize_4bit: blocksize " + std::to_string(blocksize) +
                                " (bitsandbytes takes 32, 64, 128, 256, 512, 1024, 2048 or 4096)");
}

// bitsandbytes' create_dynamic_map(signed=True) in fp32 (see the header).
std::array<float, 256> dynamic_map() {
  std::vector<float> codes = {0.0f, 1.0f};
  const double scales[7] = {1e-6, 1e-5, 1e-4, 1e-3, 1e-2, 1e-1, 1.0};
  for (int i = 0; i < 7; ++i) {
    const int64_t steps = (int64_t(1) << i) + 1, halfway = steps / 2;
    const float start = 0.1f, end = 1.0f, step = (end - start) / float(steps - 1);
    std::vector<float> linspace(static_cast<size_t>(steps));
    for (int64_t j = 0; j < steps; ++j)  // torch.linspace on the CPU, its multiply-adds fused
      linspace[size_t(j)] = j < halfway ? std::fma(step, float(j), start) : std::fma(-step, float(steps - 1 - j), end);
    const float scale = static_cast<float>(scales[i]);
    for (int64_t j = 0; j + 1 < steps; ++j) {
      const float mean = (linspace[size_t(j)] + linspace[size_t(j) + 1]) / 2.0f;
      codes.push_back(scale * mean);
      codes.push_back(-scale * mean);
    }
  }
  std::sort(codes.begin(), codes.end());
  std::array<float, 256> out{};
  std::copy(codes.begin(), codes.end(), out.begin());
  return out;
}

// The 8-bit index of each of 65536 bins of [-1, 1]: the code nearest to the bin's centre, the
// lower on a tie (bitsandbytes' lookup table).
constexpr int kBins = 65536;

const std::array<uint8_t, kBins>& bin_index() {
  static const std::array<uint8_t, kBins> table = [] {
    const float* code = dynamic_map_8bit();
    std::array<float, 255> mid;
    for (size_t i = 0; i < 255; ++i) mid[i] = 0.5f * (code[i] + code[i + 1]);
    std::array<uint8_t, kBins> t;
    size_t below = 0;
    for (int b = 0; b < kBins; ++b) {
      const float centre = -1.0f + (2.0f * float(b)) / float(kBins - 1);
      while (below < 255 && mid[below] < centre) ++below;
      t[size_t(b)] = uint8_t(below);
    }
    return t;
  }();
  return table;
}

void check_8bit(int64_t n, int64_t blocksize) {
  if (n < 1) throw std::invalid_argument("quantize_blockwise_8bit: no elements");
  if (blocksize < 1) throw std::invalid_argument("quantize_blockwise_8bit: blocksize " + std::to_string(blocksize));
}

}  // namespace

Quant4 quant4_from_string(const std::string& name) {
  if (name == "nf4") return Quant4::kNf4;
  if (name == "fp4") return Quant4::kFp4;
  throw std::invalid_argument("unknown 4-bit quant type \"" + name + "\" (bitsandbytes' \"nf4\" or \"fp4\")");
}

const char* to_string(Quant4 type) { return type == Quant4::kNf4 ? "nf4" : "fp4"; }

const float* quant4_codes(Quant4 type) { return type == Quant4::kNf4 ? kNf4.data() : kFp4.data(); }

void quantize_4bit(const void* x, DType dtype, int64_t n, Quant4 type, int64_t blocksize, uint8_t* packed,
                   float* absmax) {
  check(n, blocksize);
  const Bounds& b = bounds(type);
  const float tiny = static_cast<float>(1e-38);  // bitsandbytes' clamp, as fp32 (a subnormal)
  const uint8_t zero = index_of(0.0f, b);
  for (int64_t block = 0, begin = 0; begin < n; ++block, begin += blocksize) {
    const int64_t end = std::min(n, begin + blocksize);
    const float m = max_magnitude(x, dtype, begin, end);
    const float am = std::max(m, tiny);
    const bool full = end - begin == blocksize;
    absmax[block] = full ? m : am;  // bitsandbytes keeps the shorter last block's clamped value
    const float reciprocal = 1.0f / am;
    for (int64_t i = begin; i < end; ++i) {
      const float v = full ? load(x, dtype, i) * reciprocal : load(x, dtype, i) / am;
      const uint8_t q = index_of(std::clamp(v, -1.0f, 1.0f), b);
      if (i % 2 == 0)
        packed[i / 2] = uint8_t(q << 4);
      else
        packed[i / 2] = uint8_t(packed[i / 2] | q);
    }
  }
  if (n % 2) packed[n / 2] = uint8_t(packed[n / 2] | zero);
}

namespace {

// Block by block (blocks hold an even count: the byte pairs never straddle two), the dtype's
// store chosen once: the engine dequantizes every gathered 4-bit weight on the host device.
template <typename Store>
void dequantize_blocks(const uint8_t* packed, const float* absmax, int64_t n, const float* code, int64_t blocksize,
                       Store store) {
  for (int64_t block = 0, begin = 0; begin < n; ++block, begin += blocksize) {
    const float a = absmax[block];
    const int64_t end = std::min(n, begin + blocksize);
    int64_t i = begin;
    for (; i + 1 < end; i += 2) {
      const uint8_t b = packed[i / 2];
      store(i, code[b >> 4] * a);
      store(i + 1, code[b & 0xF] * a);
    }
    if (i < end) store(i, code[packed[i / 2] >> 4] * a);
  }
}

}  // namespace

void dequantize_4bit(const uint8_t* packed, const float* absmax, int64_t n, Quant4 type, int64_t blocksize,
                     void* out, DType dtype) {
  check(n, blocksize);
  const float* code = quant4_codes(type);
  switch (dtype) {
    case DType::kF32: {
      float* o = static_cast<float*>(out);
      dequantize_blocks(packed, absmax, n, code, blocksize, [o](int64_t i, float v) { o[i] = v; });
      return;
    }
    case DType::kBF16: {
      uint16_t* o = static_cast<uint16_t*>(out);
      dequantize_blocks(packed, absmax, n, code, blocksize, [o](int64_t i, float v) { o[i] = bits::float_to_bf16(v); });
      return;
    }
    case DType::kF16: {
      uint16_t* o = static_cast<uint16_t*>(out);
      dequantize_blocks(packed, absmax, n, code, blocksize, [o](int64_t i, float v) { o[i] = bits::float_to_fp16(v); });
      return;
    }
  }
}

const float* dynamic_map_8bit() {
  static const std::array<float, 256> codes = dynamic_map();
  return codes.data();
}

void quantize_blockwise_8bit(const float* x, int64_t n, int64_t blocksize, uint8_t* out, float* absmax) {
  check_8bit(n, blocksize);
  const std::array<uint8_t, kBins>& index = bin_index();
  for (int64_t block = 0, begin = 0; begin < n; ++block, begin += blocksize) {
    const int64_t end = std::min(n, begin + blocksize);
    float m = 0;
    for (int64_t i = begin; i < end; ++i) m = std::max(m, std::fabs(x[i]));
    absmax[block] = m;
    if (m == 0.0f) {
      std::fill(out + begin, out + end, uint8_t(0));
      continue;
    }
    const float reciprocal = 1.0f / m;
    for (int64_t i = begin; i < end; ++i) {
      const float s = std::clamp(x[i] * reciprocal, -1.0f, 1.0f);
      const float h = (s + 1.0f) * 0.5f;                     // exact
      const float bin = h * float(kBins - 1) + 0.5f;         // fused or not, the same bin (all fp32 h checked)
      out[i] = index[size_t(static_cast<uint16_t>(bin))];
    }
  }
}

void dequantize_blockwise_8bit(const uint8_t* q, const float* absmax, int64_t n, int64_t blocksize, float* out) {
  check_8bit(n, blocksize);
  const float* code = dynamic_map_8bit();
  for (int64_t i = 0; i < n; ++i) out[i] = code[q[i]] * absmax[i / blocksize];
}

void quant4_absmax(const void* x, DType dtype, int64_t n, int64_t blocksize, float* absmax) {
  check(n, blocksize);
  const float tiny = static_cast<float>(1e-38);  // bitsandbytes' clamp, as in quantize_4bit
  for (int64_t block = 0, begin = 0; begin < n; ++block, begin += blocksize) {
    const int64_t end = std::min(n, begin + blocksize);
    const float m = max_magnitude(x, dtype, begin, end);
    absmax[block] = end - begin == blocksize ? m : std::max(m, tiny);  // as quantize_4bit stores it
  }
}

void quantize_4bit_nested(const void* x, DType dtype, int64_t n, Quant4 type, int64_t blocksize, float offset,
                          uint8_t* packed, uint8_t* qabsmax, float* nested_absmax) {
  check(n, blocksize);
  std::vector<float> absmax(size_t(quant4_blocks(n, blocksize)));
  quantize_4bit(x, dtype, n, type, blocksize, packed, absmax.data());
  for (float& a : absmax) a -= offset;
  quantize_blockwise_8bit(absmax.data(), int64_t(absmax.size()), kQuant4NestedBlocksize, qabsmax, nested_absmax);
}

void dequantize_quant4_absmax(const uint8_t* qabsmax, const float* nested_absmax, float offset, int64_t blocks,
                              float* absmax) {
  if (blocks < 1) throw std::invalid_argument("dequantize_quant4_absmax: no blocks");
  dequantize_blockwise_8bit(qabsmax, nested_absmax, blocks, kQuant4NestedBlocksize, absmax);
  for (int64_t i = 0; i < blocks; ++i) absmax[i] += offset;
}

void dequantize_4bit_nested(const uint8_t* packed, const uint8_t* qabsmax, const float* nested_absmax, float offset,
                            int64_t n, Quant4 type, int64_t blocksize, void* out, DType dtype) {
  check(n, blocksize);
  std::vector<float> absmax(size_t(quant4_blocks(n, blocksize)));
  dequantize_quant4_absmax(qabsmax, nested_absmax, offset, int64_t(absmax.size()), absmax.data());
  dequantize_4bit(packed, absmax.data(), n, type, blocksize, out, dtype);
}

}  // namespace strata::kernels
