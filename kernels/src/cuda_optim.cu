// CUDA kernels matching the CPU kernels bit for bit: same AdamConsts, same operation order, with
// __f*_rn intrinsics so nvcc cannot contract multiply-adds.
#include <cuda_runtime.h>

#include <stdexcept>
#include <string>
#include <vector>

#include "cpu_kernels.h"
#include "float_bits.h"
#include "strata/kernels/cuda_optim.h"

namespace strata::kernels::cuda {

namespace {

void check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) {
    throw std::runtime_error(std::string("cuda ") + what + ": " + cudaGetErrorString(e));
  }
}

__device__ __forceinline__ float load_f32(const void* p, DType t, size_t i) {
  switch (t) {
    case DType::kF32: return static_cast<const float*>(p)[i];
    case DType::kBF16: return bits::bf16_to_float(static_cast<const uint16_t*>(p)[i]);
    default: return bits::fp16_to_float(static_cast<const uint16_t*>(p)[i]);
  }
}

__device__ __forceinline__ void store_f32(void* p, DType t, size_t i, float x) {
  switch (t) {
    case DType::kF32: static_cast<float*>(p)[i] = x; break;
    case DType::kBF16: static_cast<uint16_t*>(p)[i] = bits::float_to_bf16(x); break;
    default: static_cast<uint16_t*>(p)[i] = bits::float_to_fp16(x); break;
  }
}

constexpr int kThreads = 256;
constexpr int kMaxTensors = 64;
constexpr size_t kPerBlock = kThreads * 8;  // elements per block (8 per thread, strided)

struct AdamBatch {
  AdamTensor t[kMaxTensors];
  unsigned first_block[kMaxTensors + 1];  // prefix sums of blocks per tensor
  int count;
};

__global__ void adam_kernel(const __grid_constant__ AdamBatch batch, detail::AdamConsts k,
                            DType gt, DType ot) {
  int ti = 0;
  while (ti + 1 < batch.count && blockIdx.x >= batch.first_block[ti + 1]) ++ti;
  const AdamTensor& t = batch.t[ti];
  const size_t base = static_cast<size_t>(blockIdx.x - batch.first_block[ti]) * kPerBlock;
  const bool l2 = k.wd_l2 != 0.0f, decoupled = k.decay != 1.0f;
  for (size_t i = base + threadIdx.x; i < t.n && i < base + kPerBlock; i += kThreads) {
    float p = t.param[i];
    float g = __fmul_rn(load_f32(t.grad, gt, i), k.grad_scale);
    if (l2) g = __fadd_rn(g, __fmul_rn(k.wd_l2, p));
    if (decoupled) p = __fmul_rn(p, k.decay);
    const float m = __fadd_rn(__fmul_rn(t.exp_avg[i], k.beta1), __fmul_rn(k.one_minus_beta1, g));
    const float v = __fadd_rn(__fmul_rn(t.exp_avg_sq[i], k.beta2),
                              __fmul_rn(__fmul_rn(k.one_minus_beta2, g), g));
    const float denom = __fadd_rn(__fdiv_rn(__fsqrt_rn(v), k.bc2_sqrt), k.eps);
    p = __fadd_rn(p, __fdiv_rn(__fmul_rn(k.neg_step_size, m), denom));
    t.exp_avg[i] = m;
    t.exp_avg_sq[i] = v;
    t.param[i] = p;
    if (t.param_out != nullptr) store_f32(t.param_out, ot, i, p);
  }
}

// One CUDA block of 16 threads per reduction block of 4096 elements: thread l accumulates
// elements l, l + 16, ... in order (the CPU's lane l), then lanes are added pairwise.
__global__ void sum_squares_blocks(const void* x, DType t, size_t n, double* per_block) {
  const size_t block = blockIdx.x;
  const size_t begin = block * detail::kSumBlock;
  const size_t end = min(n, begin + detail::kSumBlock);
  __shared__ double lanes[detail::kLanes];
  const unsigned l = threadIdx.x;
  double acc = 0;
  for (size_t i = begin + l; i < end; i += detail::kLanes) {
    const double xi = load_f32(x, t, i);
    acc = __dadd_rn(acc, __dmul_rn(xi, xi));
  }
  lanes[l] = acc;
  __syncthreads();
  if (l == 0) {
    for (unsigned width = detail::kLanes / 2; width >= 1; width /= 2) {
      for (unsigned j = 0; j < width; ++j) lanes[j] = __dadd_rn(lanes[2 * j], lanes[2 * j + 1]);
    }
    per_block[block] = lanes[0];
  }
}

__global__ void sum_in_order(const double* per_block, size_t blocks, double* result) {
  double total = 0;
  for (size_t b = 0; b < blocks; ++b) total = __dadd_rn(total, per_block[b]);
  *result = total;
}

__global__ void unscale_kernel(float* x, float scale, size_t n, int* found) {
  bool bad = false;
  for (size_t i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) {
    const float y = __fmul_rn(x[i], scale);
    x[i] = y;
    bad |= !isfinite(y);
  }
  if (__syncthreads_or(bad) && threadIdx.x == 0) atomicExch(found, 1);
}

__global__ void convert_kernel(const void* src, DType st, void* dst, DType dt, size_t n) {
  for (size_t i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) {
    store_f32(dst, dt, i, load_f32(src, st, i));
  }
}

unsigned grid_for(size_t n) {
  return static_cast<unsigned>(std::min<size_t>((n + kThreads - 1) / kThreads, 65535 * 8));
}

}  // namespace

bool device_available() {
  int n = 0;
  const bool ok = cudaGetDeviceCount(&n) == cudaSuccess && n > 0;
  cudaGetLastError();
  return ok;
}

void adam_step(const AdamConfig& config, const AdamTensor* tensors, size_t count, DType grad_dtype,
               DType out_dtype, cudaStream_t stream) {
  const detail::AdamConsts k = detail::adam_consts(config);
  for (size_t start = 0; start < count; start += kMaxTensors) {
    AdamBatch batch{};
    batch.count = static_cast<int>(std::min<size_t>(kMaxTensors, count - start));
    unsigned blocks = 0;
    for (int i = 0; i < batch.count; ++i) {
      batch.t[i] = tensors[start + i];
      batch.first_block[i] = blocks;
      const size_t b = (batch.t[i].n + kPerBlock - 1) / kPerBlock;
      if (blocks + b > 0x7FFFFFFFu) throw std::runtime_error("cuda adam: tensors too large for one launch");
      blocks += static_cast<unsigned>(b);
    }
    batch.first_block[batch.count] = blocks;
    if (blocks == 0) continue;
    adam_kernel<<<blocks, kThreads, 0, stream>>>(batch, k, grad_dtype, out_dtype);
    check(cudaGetLastError(), "adam_step launch");
  }
}

void sum_squares(const void* x, DType dtype, size_t n, double* result, cudaStream_t stream) {
  const size_t blocks = (n + detail::kSumBlock - 1) / detail::kSumBlock;
  if (blocks == 0) {
    check(cudaMemsetAsync(result, 0, sizeof(double), stream), "sum_squares memset");
    return;
  }
  double* per_block = nullptr;
  check(cudaMallocAsync(reinterpret_cast<void**>(&per_block), blocks * sizeof(double), stream),
        "sum_squares alloc");
  sum_squares_blocks<<<static_cast<unsigned>(blocks), detail::kLanes, 0, stream>>>(x, dtype, n, per_block);
  check(cudaGetLastError(), "sum_squares launch");
  sum_in_order<<<1, 1, 0, stream>>>(per_block, blocks, result);
  check(cudaGetLastError(), "sum_squares launch");
  check(cudaFreeAsync(per_block, stream), "sum_squares free");
}

void unscale_and_check(float* x, float scale, size_t n, int* found_nonfinite, cudaStream_t stream) {
  if (n == 0) return;
  unscale_kernel<<<grid_for(n), kThreads, 0, stream>>>(x, scale, n, found_nonfinite);
  check(cudaGetLastError(), "unscale launch");
}

void convert(const void* src, DType src_dtype, void* dst, DType dst_dtype, size_t n,
             cudaStream_t stream) {
  if (src_dtype != DType::kF32 && dst_dtype != DType::kF32) {
    throw std::invalid_argument("cuda convert: one side must be fp32");
  }
  if (n == 0) return;
  convert_kernel<<<grid_for(n), kThreads, 0, stream>>>(src, src_dtype, dst, dst_dtype, n);
  check(cudaGetLastError(), "convert launch");
}

}  // namespace strata::kernels::cuda
