// The engine layer builds and runs against the pinned libtorch: a matrix product through ATen
// checked against a plain triple loop, and the version the build found.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include "strata/engine/build_info.h"

namespace strata::engine {
namespace {

TEST(Libtorch, MatmulMatchesNaiveLoopsOnAwkwardShapes) {
  at::manual_seed(0);
  const int64_t m = 37, k = 53, n = 29;
  at::Tensor a = at::randn({m, k}, at::kDouble), b = at::randn({k, n}, at::kDouble);
  at::Tensor c = at::matmul(a, b);
  auto A = a.accessor<double, 2>(), B = b.accessor<double, 2>(), C = c.accessor<double, 2>();
  for (int64_t i = 0; i < m; ++i) {
    for (int64_t j = 0; j < n; ++j) {
      double s = 0;
      for (int64_t p = 0; p < k; ++p) s += A[i][p] * B[p][j];
      ASSERT_NEAR(C[i][j], s, 1e-12 * (1 + std::abs(s)));
    }
  }
}

TEST(Libtorch, BuildIsPinnedToTheGpuMachinesVersion) {
  EXPECT_EQ(libtorch_version().rfind("2.11", 0), 0u) << libtorch_version();
  EXPECT_NE(build_info().find("libtorch 2.11"), std::string::npos);
}

}  // namespace
}  // namespace strata::engine
