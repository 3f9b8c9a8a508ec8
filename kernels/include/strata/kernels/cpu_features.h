// Run-time CPU feature detection for choosing kernel paths (AVX-512, AVX2, scalar) in one
// binary built without -march=native. Thread safety: detect() is safe from any thread; its result
// is computed once.
#pragma once

#include <string>

namespace strata::kernels {

enum class Isa { kScalar, kAvx2, kAvx512 };

struct CpuFeatures {
  bool avx2 = false;       // with FMA and F16C (the AVX2 path needs all three)
  bool fma = false;
  bool f16c = false;
  bool avx512f = false;
  bool avx512bw = false;
  bool avx512bf16 = false;
  // Widest path the kernels can use on this CPU.
  Isa best() const;
};

const CpuFeatures& cpu_features();
const char* to_string(Isa isa);
// Parses "scalar" | "avx2" | "avx512"; throws std::invalid_argument otherwise.
Isa parse_isa(const std::string& name);
// `requested` if this CPU supports it, else throws std::invalid_argument naming the missing flag.
Isa checked_isa(Isa requested);

}  // namespace strata::kernels
