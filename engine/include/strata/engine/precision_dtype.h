// The libtorch dtype of a Precision (the compute copies' dtype): one mapping for the engine, its
// checkpoints and the CLI. Pure.
#pragma once

#include <c10/core/ScalarType.h>

#include "strata/engine/config.h"

namespace strata::engine {

inline at::ScalarType scalar_type(Precision p) {
  switch (p) {
    case Precision::kFp32: return at::kFloat;
    case Precision::kBf16: return at::kBFloat16;
    case Precision::kFp16: return at::kHalf;
  }
  return at::kFloat;
}

}  // namespace strata::engine
