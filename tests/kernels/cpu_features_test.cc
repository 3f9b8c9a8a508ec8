#include <gtest/gtest.h>

#include <fstream>
#include <set>
#include <sstream>

#include "strata/kernels/cpu_features.h"

namespace strata::kernels {
namespace {

// Oracle: the kernel's own view of the CPU in /proc/cpuinfo.
std::set<std::string> proc_cpu_flags() {
  std::ifstream in("/proc/cpuinfo");
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind("flags", 0) == 0) {
      std::istringstream ss(line.substr(line.find(':') + 1));
      std::set<std::string> flags;
      std::string f;
      while (ss >> f) flags.insert(f);
      return flags;
    }
  }
  return {};
}

TEST(CpuFeatures, AgreesWithProcCpuinfo) {
  const auto flags = proc_cpu_flags();
  if (flags.empty()) GTEST_SKIP() << "no /proc/cpuinfo flags line";
  const CpuFeatures& f = cpu_features();
  EXPECT_EQ(f.avx2, flags.count("avx2") == 1);
  EXPECT_EQ(f.fma, flags.count("fma") == 1);
  EXPECT_EQ(f.f16c, flags.count("f16c") == 1);
  EXPECT_EQ(f.avx512f, flags.count("avx512f") == 1);
  EXPECT_EQ(f.avx512bw, flags.count("avx512bw") == 1);
  EXPECT_EQ(f.avx512bf16, flags.count("avx512_bf16") == 1);
}

TEST(CpuFeatures, BestPathIsRunnableAndNamesRoundTrip) {
  const Isa best = cpu_features().best();
  EXPECT_EQ(checked_isa(best), best);
  EXPECT_EQ(checked_isa(Isa::kScalar), Isa::kScalar);
  for (Isa isa : {Isa::kScalar, Isa::kAvx2, Isa::kAvx512}) EXPECT_EQ(parse_isa(to_string(isa)), isa);
  EXPECT_THROW(parse_isa("sse9"), std::invalid_argument);
  if (!cpu_features().avx512f) {
    EXPECT_THROW(checked_isa(Isa::kAvx512), std::invalid_argument);
  }
}

}  // namespace
}  // namespace strata::kernels
