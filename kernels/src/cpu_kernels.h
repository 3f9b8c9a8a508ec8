// Per-ISA kernel tables (private header). Each ISA's translation unit instantiates the templates
// of cpu_kernels_impl.h for its vector width and exports one table.
#pragma once

#include <cstddef>

#include "strata/kernels/cpu_optim.h"

namespace strata::kernels::detail {

// Adam constants derived once per call from AdamConfig (so every path uses the same floats).
struct AdamConsts {
  float grad_scale, wd_l2, decay, beta1, one_minus_beta1, beta2, one_minus_beta2, bc2_sqrt, eps,
      neg_step_size;
};
AdamConsts adam_consts(const AdamConfig& c);

constexpr size_t kSumBlock = 4096;  // elements per reduction block (fixed: determinism)
constexpr size_t kLanes = 16;       // accumulator lanes per block

struct IsaTable {
  void (*adam)(const AdamConsts&, float* p, float* m, float* v, const void* g, DType gt,
               void* out, DType ot, size_t n);
  // Sum of squares of one block (n <= kSumBlock), lanes as documented in cpu_optim.h.
  double (*sum_squares_block)(const void* x, DType dt, size_t n);
  bool (*unscale)(float* x, float scale, size_t n);
  void (*convert)(const void* src, DType st, void* dst, DType dt, size_t n);
};

const IsaTable& scalar_table();
const IsaTable& avx2_table();
const IsaTable& avx512_table();

}  // namespace strata::kernels::detail
