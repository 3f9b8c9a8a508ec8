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
// (round to nearest even); FP4's index 8 decodes to -0, as bitsandbytes' CPU kernel does (its
// fallback for a tensor whose last dimension is odd gives +0). Double quantization of the absmax (bitsandbytes'
// compress_statistics) is not here yet.
//
// NaN inputs are not supported (bitsandbytes' result for them is whatever bucketize gives).
// Thread safety: pure functions on caller-owned memory; any thread.
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

}  // namespace strata::kernels
