// The CUDA dequantization of a 4-bit tensor (and of double quantization's absmax) (quant4.h's layout and rule): codes[index] x absmax
// in fp32 (no contraction: one product), then the output dtype, round to nearest even. Bitwise
// kernels::dequantize_4bit, so a frozen 4-bit base gives the same compute copy on every device.
// Built whenever nvcc is found; enqueues on `stream` without synchronizing (pointers: device
// memory valid until the work completes). Errors: std::runtime_error naming the CUDA error, or
// std::invalid_argument for a blocksize quant4.h refuses. Thread safety: like CUDA streams.
#pragma once

#include <cstdint>

#include "strata/kernels/quant4.h"

typedef struct CUstream_st* cudaStream_t;

namespace strata::kernels::cuda {

void dequantize_4bit(const uint8_t* packed, const float* absmax, int64_t n, Quant4 type, int64_t blocksize, void* out,
                     DType dtype, cudaStream_t stream);

// Double quantization's absmax back (kernels::dequantize_quant4_absmax, bitwise): blocks fp32 values
// code8[qabsmax] x nested_absmax[i / 256] + *offset into `absmax`; `offset` is device memory.
void dequantize_quant4_absmax(const uint8_t* qabsmax, const float* nested_absmax, const float* offset, int64_t blocks,
                              float* absmax, cudaStream_t stream);

}  // namespace strata::kernels::cuda
