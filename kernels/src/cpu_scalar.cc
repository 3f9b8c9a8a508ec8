// Scalar path: the reference the SIMD paths must match bit for bit.
#include "cpu_kernels_impl.h"

namespace strata::kernels::detail {

struct ScalarRef : ScalarV {
  static void square_accumulate(const void* x, DType t, size_t n, double* lanes) {
    for (size_t i = 0; i < n; ++i) {
      const double xi = load_as_f32(x, t, i);
      lanes[i % kLanes] += xi * xi;
    }
  }
};

const IsaTable& scalar_table() { return make_table<ScalarRef>(); }

}  // namespace strata::kernels::detail
