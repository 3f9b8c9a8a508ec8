// What this build of Strata contains and what the machine offers it, for `strata version` and
// the start-up report. Thread safe.
#pragma once

#include <string>

namespace strata::engine {

// Multi-line report: Strata version, libtorch version, CUDA compiled in, CPU kernel ISA, I/O
// backends available.
std::string build_info();
// The libtorch version this binary was compiled against, e.g. "2.11.0".
std::string libtorch_version();

}  // namespace strata::engine
