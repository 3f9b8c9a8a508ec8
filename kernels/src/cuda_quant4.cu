// The 4-bit dequantization on the GPU, element for element kernels::dequantize_4bit (quant4.cc).
#include <cuda_runtime.h>

#include <stdexcept>
#include <string>

#include "float_bits.h"
#include "strata/kernels/cuda_quant4.h"

namespace strata::kernels::cuda {
namespace {

struct Codes {
  float v[16];
};

// Each thread one byte: its two elements (2j in the high nibble, 2j + 1 in the low).
__global__ void dequantize_kernel(const uint8_t* packed, const float* absmax, int64_t n, Codes codes,
                                  int64_t blocksize, void* out, DType dtype) {
  const int64_t j = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t i = 2 * j;
  if (i >= n) return;
  const uint8_t b = packed[j];
  for (int k = 0; k < 2 && i + k < n; ++k) {
    const float v = __fmul_rn(codes.v[k == 0 ? b >> 4 : b & 0xF], absmax[(i + k) / blocksize]);
    switch (dtype) {
      case DType::kF32: static_cast<float*>(out)[i + k] = v; break;
      case DType::kBF16: static_cast<uint16_t*>(out)[i + k] = bits::float_to_bf16(v); break;
      default: static_cast<uint16_t*>(out)[i + k] = bits::float_to_fp16(v); break;
    }
  }
}

static_assert(kQuant4NestedBlocksize == 256, "the nested blocks of double quantization");

struct Codes8 {
  float v[256];
};

__global__ void absmax_kernel(const uint8_t* q, const float* nested, const float* offset, int64_t blocks, Codes8 codes,
                              float* absmax) {
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= blocks) return;
  absmax[i] = __fadd_rn(__fmul_rn(codes.v[q[i]], nested[i / 256]), *offset);
}

}  // namespace

void dequantize_quant4_absmax(const uint8_t* qabsmax, const float* nested_absmax, const float* offset, int64_t blocks,
                              float* absmax, cudaStream_t stream) {
  if (blocks < 1) throw std::invalid_argument("cuda dequantize_quant4_absmax: no blocks");
  Codes8 codes;
  for (int k = 0; k < 256; ++k) codes.v[k] = dynamic_map_8bit()[k];
  constexpr int kThreads = 256;
  absmax_kernel<<<unsigned((blocks + kThreads - 1) / kThreads), kThreads, 0, stream>>>(qabsmax, nested_absmax, offset,
                                                                                      blocks, codes, absmax);
  const cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess)
    throw std::runtime_error(std::string("cuda dequantize_quant4_absmax launch: ") + cudaGetErrorString(e));
}

void dequantize_4bit(const uint8_t* packed, const float* absmax, int64_t n, Quant4 type, int64_t blocksize, void* out,
                     DType dtype, cudaStream_t stream) {
  if (n < 1 || blocksize < 32 || blocksize > 4096 || (blocksize & (blocksize - 1)) != 0)
    throw std::invalid_argument("cuda dequantize_4bit: " + std::to_string(n) + " elements in blocks of " +
                                std::to_string(blocksize));
  Codes codes;
  for (int k = 0; k < 16; ++k) codes.v[k] = quant4_codes(type)[k];
  constexpr int kThreads = 256;
  const int64_t bytes = (n + 1) / 2;
  dequantize_kernel<<<unsigned((bytes + kThreads - 1) / kThreads), kThreads, 0, stream>>>(packed, absmax, n, codes,
                                                                                         blocksize, out, dtype);
  const cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess) throw std::runtime_error(std::string("cuda dequantize_4bit launch: ") + cudaGetErrorString(e));
}

}  // namespace strata::kernels::cuda
