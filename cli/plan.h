// `strata plan`: what fits where and how fast, Strata beside 3D parallelism (planner/), and
// `strata plan --calibrate`: this machine's constants measured into a cluster file.
#pragma once

#include <string>
#include <vector>

namespace strata::cli {

int plan_command(const std::vector<std::string>& argv);

}  // namespace strata::cli
