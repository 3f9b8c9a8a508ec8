// CPU optimizer and precision kernels on raw pointers: Adam/AdamW steps, gradient sum of squares,
// unscale with overflow detection, fp32 <-> bf16/fp16 conversions.
//
// Every kernel has three paths in one binary (scalar, AVX2+FMA+F16C, AVX-512F/BW), chosen at run
// time from the CPU (CpuExec::isa, default: the best this CPU runs). The paths are the same
// template instantiated for three vector widths, so they perform the same IEEE operations in the
// same order: results are bitwise identical whatever the ISA and the thread count; the scalar path
// is the reference. Sum of squares is made order-independent of threads by a fixed reduction tree
// (see sum_squares).
//
// Conversions to bf16 and fp16 round to nearest even; NaN stays NaN, as libtorch writes it
// (bf16 0x7FC0, fp16 sign|0x7E00), so outputs equal libtorch's conversion of the same fp32 value.
//
// Callable on any sub-range (pointers offset by the caller): nothing depends on absolute
// position. Thread safety: kernels may run concurrently on disjoint memory; CpuExec::threads
// workers (the caller included) come from one shared pool.
#pragma once

#include <cstddef>
#include <cstdint>

#include "strata/kernels/cpu_features.h"

namespace strata::kernels {

enum class DType : uint8_t { kF32, kBF16, kF16 };
const char* to_string(DType dtype);
size_t dtype_bytes(DType dtype);

struct CpuExec {
  unsigned threads = 1;
  Isa isa = cpu_features().best();  // must be runnable here (checked_isa)
};

// Hyper-parameters as doubles, like libtorch's options; each is rounded to float once per call.
struct AdamConfig {
  double lr = 1e-3;
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = 1e-8;
  double weight_decay = 0.0;
  bool decoupled_weight_decay = false;  // true: AdamW (p *= 1 - lr*wd); false: Adam (g += wd*p)
  int64_t step = 1;                     // 1-based step count after this update (bias correction)
  double grad_scale = 1.0;              // gradients are multiplied by this first (1/loss scale,
                                        // times the clipping coefficient); 1 leaves them exact
};

// One Adam/AdamW update of n elements, in place on fp32 `param`, `exp_avg`, `exp_avg_sq`, with
// gradients `grad` of `grad_dtype`. If `param_out` is not null, the updated parameters are also
// written there as `out_dtype` (the compute copy for the next forward) in the same pass.
// Throws std::invalid_argument on invalid hyper-parameters (step < 1, lr < 0, betas outside
// [0, 1), eps <= 0). Follows libtorch's torch::optim::Adam/AdamW (no amsgrad):
//   g = grad * grad_scale;  Adam: g += wd * p;  AdamW: p *= 1 - lr * wd
//   m = beta1 * m + (1 - beta1) * g;  v = beta2 * v + (1 - beta2) * g * g
//   p -= (lr / (1 - beta1^t)) * m / (sqrt(v) / sqrt(1 - beta2^t) + eps)
void adam_step(const AdamConfig& config, float* param, float* exp_avg, float* exp_avg_sq,
               const void* grad, DType grad_dtype, void* param_out, DType out_dtype, size_t n,
               const CpuExec& exec = {});

// Sum of x*x over n elements of `dtype`, accumulated in fp64 in a fixed order: 16 lanes (element
// i to lane i mod 16) within blocks of 4096 elements, lanes added pairwise, blocks in order.
double sum_squares(const void* x, DType dtype, size_t n, const CpuExec& exec = {});

// x *= scale in place (fp32); returns true if any result is inf or NaN (fp16 loss scaling).
bool unscale_and_check(float* x, float scale, size_t n, const CpuExec& exec = {});

// Element conversions. Any pair of {kF32, kBF16, kF16} with one side kF32.
void convert(const void* src, DType src_dtype, void* dst, DType dst_dtype, size_t n,
             const CpuExec& exec = {});

// Scalar conversions (the reference the SIMD paths match bit for bit).
uint16_t float_to_bf16(float f);
float bf16_to_float(uint16_t h);
uint16_t float_to_fp16(float f);
float fp16_to_float(uint16_t h);

}  // namespace strata::kernels
