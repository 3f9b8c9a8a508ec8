// What the planner tests share (planner_published_test.cc, planner_model_test.cc): the DGX A100
// preset cut to a number of GPUs.
#pragma once

#include <algorithm>

#include "strata/planner/cluster.h"

namespace strata::planner::planner_testing {

inline Cluster a100s(int gpus) {
  Cluster c = cluster_preset("dgx-a100");
  c.nodes = std::max(1, gpus / c.node.gpus);
  if (gpus < c.node.gpus) c.node.gpus = gpus;
  return c;
}

}  // namespace strata::planner::planner_testing
