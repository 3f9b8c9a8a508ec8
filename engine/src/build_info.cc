#include "strata/engine/build_info.h"

#include <torch/version.h>  // narrow header: just the version macros

#include "strata/kernels/cpu_features.h"
#include "strata/offload/io_engine.h"

namespace strata::engine {

std::string libtorch_version() { return TORCH_VERSION; }

std::string build_info() {
  std::string why;
  const bool uring = offload::io_uring_available(&why);
  std::string s;
  s += "strata " STRATA_VERSION "\n";
  s += "libtorch " + libtorch_version() + "\n";
#if defined(STRATA_HAVE_CUDA)
  s += "cuda: compiled in\n";
#else
  s += "cuda: not compiled in\n";
#endif
  s += std::string("cpu kernels: ") + kernels::to_string(kernels::cpu_features().best()) + "\n";
  s += "io backends: threads" + std::string(uring ? ", io_uring" : " (io_uring unavailable: " + why + ")") + "\n";
  return s;
}

}  // namespace strata::engine
