// `strata plan --calibrate`: this machine's constants for the planner, measured with the same
// code paths training uses (libtorch's linear layers, fused attention and a real block on the CPU
// or the GPU, host-device copies, the engine's CPU Adam kernel, its I/O engine on the swap
// directory's file system) and written as a cluster description of one node: its "GPU" is the
// host device, or with device "cuda" GPU 0.
#pragma once

#include <string>

#include "strata/planner/cluster.h"

namespace strata::bench {

struct CalibrateOptions {
  std::string output = "strata-cluster.json";
  std::string dir = ".";     // where the disk is measured (a scratch file, removed)
  std::string device = "cpu";  // where compute is measured: "cpu" (the host device) or "cuda"
  double seconds = 0.3;      // per measurement
  bool quiet = false;
};

planner::Cluster calibrate_this_machine(const CalibrateOptions& options);

}  // namespace strata::bench
