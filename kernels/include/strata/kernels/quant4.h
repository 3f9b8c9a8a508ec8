// 4-bit blockwise quantization as bitsandbytes computes it (its `quantize_4bit` and
// `dequantize_4bit` on the CPU, bitsandbytes 0.50): the frozen base of a QLoRA run.
//
// Layout (bitsandbytes' own): the tensor flattened, cut into blocks of `blocksize` elements (the
// last may be shorter); each block's absmax (fp32, the largest magnitude; scaling divides by at
// least 1e-38 as fp32, and the shorter last block stores that clamped value) scales it into [-1, 1] (a full block multiplies by the absmax's fp32 reciprocal, the shorter
// last block divides by it), and each scaled value becomes the index of the nearest code of the
// 16-entry table (NF4 or FP4; a value on a midpoint between two codes takes the lower one, as
// torch.bucketize does); two indices make a byte, element 2j in the high nibble, an odd count
// padded with a zero's code. Dequantized: code[index] x absmax in fp32, then the output dtype
// (round to nearest even); FP4's index 8 decodes to -0, as bitsandbytes' scalar CPU kernel does
// (its AVX-512 kernel, which it takes on an AVX-512 CPU for a last dimension that is a multiple of
// 16, and its fallback for a tensor whose last dimension is odd give +0).
//
// Double quantization (bitsandbytes' compress_statistics / bnb_4bit_use_double_quant): the fp32
// absmax above (one per block, the shorter last block's clamped value included) less `offset`, their
// fp32 mean, quantized by the 8-bit blockwise quantization below in blocks of 256: qabsmax (uint8, one
// per 4-bit block) and the nested absmax (fp32, one per 256 of them). Dequantized: code8[qabsmax] x
// nested absmax, + offset (each rounded to fp32), then the 4-bit dequantization with that absmax.
// The offset is the caller's: bitsandbytes takes torch's fp32 mean (absmax.mean(), a vectorized
// cascade sum divided by the count), which a caller with libtorch computes as at::mean of the fp32
// absmax that quant4_absmax gives; this layer has no libtorch.
//
// 8-bit blockwise quantization (bitsandbytes' quantize_blockwise / dequantize_blockwise with its
// default code, the native CPU kernels of 0.50): blocks of `blocksize` fp32 values (the last may be
// shorter), each block's absmax m (fp32, the largest magnitude, not clamped) and each value v scaled
// to s = clamp(v x fp32(1/m), -1, 1). The index is not always the nearest code's: s falls into one of
// 65536 bins, b = trunc(fp32((s + 1) x 0.5 x 65535 + 0.5)), and the index is that of the code
// nearest to the bin's centre -1 + 2b/65535 (fp32), the lower one where the centre lies exactly on a
// midpoint 0.5 x (code[i] + code[i+1]). A block whose absmax is 0 gets index 0 throughout (code
// about -0.993, so it dequantizes to -0). Dequantized: code[index] x absmax in fp32.
// The code (create_dynamic_map(signed=True)): for i = 0..6, the fp32 midpoints (b[j] + b[j+1]) / 2
// of torch.linspace(0.1, 1, 2^i + 1) in fp32 (which torch's CPU build computes with fused
// multiply-adds: start + step x j for the first half, end - step x (steps - 1 - j) for the rest),
// times fp32(10^(i-6)) and times its negative; with 0 and 1, sorted ascending.
//
// NaN inputs are not supported (bitsandbytes' result for them is whatever bucketize gives).
// Thread safety: pure functions on caller-owned memory (the 8-bit code and its bin table are built
// once, on first use, thread-safely); any thread.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include "strata/kernels/cpu_optim.h"

namespace strata::kernels {

enum class Quant4 : uint8_t { kNf4, kFp4 };

// "nf4" / "fp4" (bitsandbytes' bnb_4bit_quant_type); throws std::invalid_argument naming the
// value otherwise.
Quant4 quant4_from_string(const std::string& name);
const char* to_string(Quant4 type);

// The 16 codes of the table, in index order (bitsandbytes' get_4bit_type).
const float* quant4_codes(Quant4 type);

// Bytes of the packed indices and count of absmax values for n elements.
inline int64_t quant4_packed_bytes(int64_t n) { return (n + 1) / 2; }
inline int64_t quant4_blocks(int64_t n, int64_t blocksize) { return (n + blocksize - 1) / blocksize; }

// Quantizes n elements of `x` (dtype `dtype`) into `packed` [quant4_packed_bytes(n)] and `absmax`
// [quant4_blocks(n, blocksize)]. blocksize: 32, 64, ..., 4096 (bitsandbytes' choices); throws
// std::invalid_argument otherwise or for n < 1.
void quantize_4bit(const void* x, DType dtype, int64_t n, Quant4 type, int64_t blocksize, uint8_t* packed,
                   float* absmax);

// The inverse: n elements into `out` (dtype `dtype`).
void dequantize_4bit(const uint8_t* packed, const float* absmax, int64_t n, Quant4 type, int64_t blocksize,
                     void* out, DType dtype);

// The 256 codes of bitsandbytes' signed dynamic 8-bit map, ascending (its create_dynamic_map()).
const float* dynamic_map_8bit();

// 8-bit blockwise quantization of n fp32 values into `out` [n] and `absmax` [quant4_blocks(n,
// blocksize)], and its inverse into `out` [n]. blocksize: any positive count (bitsandbytes' CPU kernel
// takes any). Throws std::invalid_argument for n < 1 or blocksize < 1.
void quantize_blockwise_8bit(const float* x, int64_t n, int64_t blocksize, uint8_t* out, float* absmax);
void dequantize_blockwise_8bit(const uint8_t* q, const float* absmax, int64_t n, int64_t blocksize, float* out);

// Double quantization: the block size of the second level and the count of its absmax values.
inline constexpr int64_t kQuant4NestedBlocksize = 256;
inline int64_t quant4_nested_blocks(int64_t n, int64_t blocksize) {
  return quant4_blocks(quant4_blocks(n, blocksize), kQuant4NestedBlocksize);
}

// The absmax [quant4_blocks(n, blocksize)] that quantize_4bit stores, alone: the caller's offset is
// its fp32 mean (at::mean, as bitsandbytes takes it). Same refusals as quantize_4bit.
void quant4_absmax(const void* x, DType dtype, int64_t n, int64_t blocksize, float* absmax);

// quantize_4bit with double quantization: `packed` as quantize_4bit, `qabsmax` [quant4_blocks(n,
// blocksize)] and `nested_absmax` [quant4_nested_blocks(n, blocksize)] from absmax - offset.
void quantize_4bit_nested(const void* x, DType dtype, int64_t n, Quant4 type, int64_t blocksize, float offset,
                          uint8_t* packed, uint8_t* qabsmax, float* nested_absmax);

// The absmax [blocks] back from qabsmax, nested_absmax and offset (bitsandbytes' dequantize_blockwise
// + offset); throws std::invalid_argument for blocks < 1.
void dequantize_quant4_absmax(const uint8_t* qabsmax, const float* nested_absmax, float offset, int64_t blocks,
                              float* absmax);

// The inverse of quantize_4bit_nested: n elements into `out` (dtype `dtype`).
void dequantize_4bit_nested(const uint8_t* packed, const uint8_t* qabsmax, const float* nested_absmax, float offset,
                            int64_t n, Quant4 type, int64_t blocksize, void* out, DType dtype);

}  // namespace strata::kernels
