// `strata bench plan`: the planner's predictions beside measured runs on this machine. The
// machine is calibrated first (calibrate.h) or described by --cluster; then each of seven
// configurations (sizes, placements on the host and in swap, overlap modes, 1 and 2 ranks, block
// tiles) runs
// as `strata train` on the host device (under `strata launch` for 2 ranks) or on the GPU, and its median step
// time and per-tier memory are compared with what `strata plan` predicts for the same
// configuration; the device bytes in one more run per configuration whose device budget is the
// plan's (without a budget the engine also keeps what it merely has room for). Prints a table of the errors and a final JSON line (metric: the worst step-time
// error; baseline: the measured mean step time).
#pragma once

#include <filesystem>
#include <string>

namespace strata::bench {

struct PlanBenchOptions {
  std::filesystem::path dir = "strata-bench-plan";  // logs, configurations, swap
  std::string cluster;   // a cluster file; empty: calibrate this machine first
  int64_t steps = 8;     // steps per run; the first two are left out of the median
  bool quick = false;    // smaller models (CI)
  // "cpu": seven configurations on the host device (fp32; 1 and 2 ranks); "cuda": seven on GPU 0
  // (bf16, larger models, one rank: placement auto instead of the 2-rank cases).
  std::string device = "cpu";
};

void run_plan_bench(const PlanBenchOptions& options);

}  // namespace strata::bench
