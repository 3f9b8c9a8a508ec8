// CUDA versions of the CPU optimizer and precision kernels (cpu_optim.h), on raw device pointers
// and a caller's stream. Built whenever nvcc is found (sm_90 plus PTX). The element operations
// are the CPU kernels' own, in the same order with rounding spelled out (no FMA contraction), so
// results are bitwise those of the CPU kernels; the test suite checks that on a GPU.
//
// All functions enqueue work on `stream` and return without synchronizing; pointers must be
// device memory valid until the work completes. Errors (bad arguments, launch failures) throw
// std::runtime_error naming the kernel and the CUDA error. Thread safety: like CUDA streams.
#pragma once

#include <cstddef>

#include "strata/kernels/cpu_optim.h"

typedef struct CUstream_st* cudaStream_t;

namespace strata::kernels::cuda {

// One tensor of a multi-tensor Adam step (all device pointers; param_out may be null).
struct AdamTensor {
  float* param;
  float* exp_avg;
  float* exp_avg_sq;
  const void* grad;
  void* param_out;
  size_t n;
};

// Fused multi-tensor Adam/AdamW: one launch per up to 64 tensors.
void adam_step(const AdamConfig& config, const AdamTensor* tensors, size_t count, DType grad_dtype,
               DType out_dtype, cudaStream_t stream);

// *result (device double) = sum of x*x, with the CPU kernel's reduction order (bitwise equal).
void sum_squares(const void* x, DType dtype, size_t n, double* result, cudaStream_t stream);

// x *= scale in place; *found_nonfinite (device int) is set to 1 if any result is inf or NaN
// (left untouched otherwise: the caller zeroes it once per step).
void unscale_and_check(float* x, float scale, size_t n, int* found_nonfinite, cudaStream_t stream);

void convert(const void* src, DType src_dtype, void* dst, DType dst_dtype, size_t n,
             cudaStream_t stream);

// True if a CUDA device is usable by this process.
bool device_available();

}  // namespace strata::kernels::cuda
