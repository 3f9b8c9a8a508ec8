#include "strata/kernels/cpu_features.h"

#include <stdexcept>

namespace strata::kernels {

Isa CpuFeatures::best() const {
  if (avx512f && avx512bw && fma) return Isa::kAvx512;
  if (avx2 && fma && f16c) return Isa::kAvx2;
  return Isa::kScalar;
}

const CpuFeatures& cpu_features() {
  static const CpuFeatures features = [] {
    CpuFeatures f;
#if defined(__x86_64__) || defined(__i386__)
    __builtin_cpu_init();
    f.avx2 = __builtin_cpu_supports("avx2");
    f.fma = __builtin_cpu_supports("fma");
    f.f16c = __builtin_cpu_supports("f16c");
    f.avx512f = __builtin_cpu_supports("avx512f");
    f.avx512bw = __builtin_cpu_supports("avx512bw");
    f.avx512bf16 = __builtin_cpu_supports("avx512bf16");
#endif
    return f;
  }();
  return features;
}

const char* to_string(Isa isa) {
  switch (isa) {
    case Isa::kScalar: return "scalar";
    case Isa::kAvx2: return "avx2";
    case Isa::kAvx512: return "avx512";
  }
  return "?";
}

Isa parse_isa(const std::string& name) {
  if (name == "scalar") return Isa::kScalar;
  if (name == "avx2") return Isa::kAvx2;
  if (name == "avx512") return Isa::kAvx512;
  throw std::invalid_argument("unknown ISA '" + name + "' (expected scalar, avx2 or avx512)");
}

Isa checked_isa(Isa requested) {
  const CpuFeatures& f = cpu_features();
  if (requested == Isa::kAvx512 && !(f.avx512f && f.avx512bw && f.fma)) {
    throw std::invalid_argument("this CPU lacks AVX-512F/BW: the avx512 path cannot run here");
  }
  if (requested == Isa::kAvx2 && !(f.avx2 && f.fma && f.f16c)) {
    throw std::invalid_argument("this CPU lacks AVX2/FMA/F16C: the avx2 path cannot run here");
  }
  return requested;
}

}  // namespace strata::kernels
