// `strata plan --calibrate`: this machine's constants for the planner, measured with the same
// code paths training uses (libtorch's matmul on the CPU, the engine's CPU Adam kernel, direct I/O
// on the swap directory's file system) and written as a cluster description whose "GPU" is the
// host device.
#pragma once

#include <string>

#include "strata/planner/cluster.h"

namespace strata::bench {

struct CalibrateOptions {
  std::string output = "strata-cluster.json";
  std::string dir = ".";     // where the disk is measured (a scratch file, removed)
  double seconds = 0.3;      // per measurement
  bool quiet = false;
};

planner::Cluster calibrate_this_machine(const CalibrateOptions& options);

}  // namespace strata::bench
