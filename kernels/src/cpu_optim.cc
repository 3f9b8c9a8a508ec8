#include "strata/kernels/cpu_optim.h"

#include <bit>
#include <cmath>
#include <stdexcept>
#include <string>
#include <vector>

#include "cpu_kernels.h"
#include "float_bits.h"
#include "parallel.h"

namespace strata::kernels {

namespace {

using detail::IsaTable;

// Elements per parallel task: large enough to amortize scheduling, a multiple of every vector
// width and of the reduction block.
constexpr size_t kChunk = 16 * detail::kSumBlock;

const IsaTable& table(Isa isa) {
  switch (checked_isa(isa)) {
    case Isa::kAvx512: return detail::avx512_table();
    case Isa::kAvx2: return detail::avx2_table();
    case Isa::kScalar: return detail::scalar_table();
  }
  return detail::scalar_table();
}

const std::byte* at(const void* p, DType t, size_t i) {
  return static_cast<const std::byte*>(p) + i * dtype_bytes(t);
}
std::byte* at(void* p, DType t, size_t i) { return static_cast<std::byte*>(p) + i * dtype_bytes(t); }

template <class Fn>
void for_chunks(size_t n, const CpuExec& exec, Fn&& fn) {
  const size_t tasks = (n + kChunk - 1) / kChunk;
  detail::parallel_for(tasks, exec.threads, [&](size_t t) {
    const size_t b = t * kChunk;
    fn(b, std::min(n, b + kChunk) - b);
  });
}

}  // namespace

const char* to_string(DType dtype) {
  switch (dtype) {
    case DType::kF32: return "fp32";
    case DType::kBF16: return "bf16";
    case DType::kF16: return "fp16";
  }
  return "?";
}

size_t dtype_bytes(DType dtype) { return dtype == DType::kF32 ? 4 : 2; }

uint16_t float_to_bf16(float f) { return bits::float_to_bf16(f); }
float bf16_to_float(uint16_t h) { return bits::bf16_to_float(h); }
uint16_t float_to_fp16(float f) { return bits::float_to_fp16(f); }
float fp16_to_float(uint16_t h) { return bits::fp16_to_float(h); }

namespace detail {

AdamConsts adam_consts(const AdamConfig& c) {
  if (c.step < 1) throw std::invalid_argument("adam: step must be >= 1, got " + std::to_string(c.step));
  if (!(c.lr >= 0)) throw std::invalid_argument("adam: lr must be >= 0");
  if (!(c.beta1 >= 0 && c.beta1 < 1) || !(c.beta2 >= 0 && c.beta2 < 1)) {
    throw std::invalid_argument("adam: betas must be in [0, 1)");
  }
  if (!(c.eps > 0)) throw std::invalid_argument("adam: eps must be > 0");
  if (!(c.weight_decay >= 0)) throw std::invalid_argument("adam: weight_decay must be >= 0");
  const double bc1 = 1 - std::pow(c.beta1, static_cast<double>(c.step));
  const double bc2 = 1 - std::pow(c.beta2, static_cast<double>(c.step));
  AdamConsts k;
  k.grad_scale = static_cast<float>(c.grad_scale);
  k.wd_l2 = c.decoupled_weight_decay ? 0.0f : static_cast<float>(c.weight_decay);
  k.decay = c.decoupled_weight_decay ? static_cast<float>(1 - c.lr * c.weight_decay) : 1.0f;
  k.beta1 = static_cast<float>(c.beta1);
  k.one_minus_beta1 = static_cast<float>(1 - c.beta1);
  k.beta2 = static_cast<float>(c.beta2);
  k.one_minus_beta2 = static_cast<float>(1 - c.beta2);
  k.bc2_sqrt = static_cast<float>(std::sqrt(bc2));
  k.eps = static_cast<float>(c.eps);
  k.neg_step_size = static_cast<float>(-(c.lr / bc1));
  return k;
}

}  // namespace detail

void adam_step(const AdamConfig& config, float* param, float* exp_avg, float* exp_avg_sq,
               const void* grad, DType grad_dtype, void* param_out, DType out_dtype, size_t n,
               const CpuExec& exec) {
  const detail::AdamConsts k = detail::adam_consts(config);
  const IsaTable& t = table(exec.isa);
  for_chunks(n, exec, [&](size_t b, size_t len) {
    t.adam(k, param + b, exp_avg + b, exp_avg_sq + b, at(grad, grad_dtype, b), grad_dtype,
           param_out ? at(param_out, out_dtype, b) : nullptr, out_dtype, len);
  });
}

double sum_squares(const void* x, DType dtype, size_t n, const CpuExec& exec) {
  const IsaTable& t = table(exec.isa);
  const size_t blocks = (n + detail::kSumBlock - 1) / detail::kSumBlock;
  std::vector<double> per_block(blocks);
  for_chunks(n, exec, [&](size_t b, size_t len) {
    for (size_t o = 0; o < len; o += detail::kSumBlock) {
      per_block[(b + o) / detail::kSumBlock] =
          t.sum_squares_block(at(x, dtype, b + o), dtype, std::min(detail::kSumBlock, len - o));
    }
  });
  double total = 0;
  for (double s : per_block) total += s;  // in block order: independent of threads
  return total;
}

bool unscale_and_check(float* x, float scale, size_t n, const CpuExec& exec) {
  const IsaTable& t = table(exec.isa);
  const size_t tasks = (n + kChunk - 1) / kChunk;
  std::vector<char> bad(tasks, 0);
  for_chunks(n, exec, [&](size_t b, size_t len) { bad[b / kChunk] = t.unscale(x + b, scale, len); });
  for (char c : bad)
    if (c) return true;
  return false;
}

void convert(const void* src, DType src_dtype, void* dst, DType dst_dtype, size_t n,
             const CpuExec& exec) {
  if (src_dtype != DType::kF32 && dst_dtype != DType::kF32) {
    throw std::invalid_argument(std::string("convert: ") + to_string(src_dtype) + " -> " +
                                to_string(dst_dtype) + " is not supported (one side must be fp32)");
  }
  const IsaTable& t = table(exec.isa);
  for_chunks(n, exec, [&](size_t b, size_t len) {
    t.convert(at(src, src_dtype, b), src_dtype, at(dst, dst_dtype, b), dst_dtype, len);
  });
}

}  // namespace strata::kernels
