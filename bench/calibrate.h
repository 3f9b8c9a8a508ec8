// `strata plan --calibrate`: this machine's constants for the planner, measured with the same
// code paths training uses (libtorch's linear layers, fused attention and a real block on the CPU
// or the GPU, host-device copies, the engine's CPU Adam kernel, its I/O engine on the swap
// directory's file system) and written as a cluster description of one node: its "GPU" is the
// host device, or with device "cuda" GPU 0.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "strata/planner/cluster.h"

namespace strata::bench {

struct CalibrateOptions {
  std::string output = "strata-cluster.json";
  std::string dir = ".";     // where the disk is measured (a scratch file, removed; created if missing)
  std::string device = "cpu";  // where compute is measured: "cpu" (the host device) or "cuda"
  double seconds = 0.15;     // a probe's window each round (the linear layers' and attention's: half)
  bool quiet = false;
};

// Rounds `calibrate_this_machine` runs.
constexpr int kCalibrationRounds = 7;

// This machine's measurement in rounds. Construction sets up every probe (linear layers by size,
// fused attention, a real block, copies, the CPU Adam kernel) and measures what is measured once
// (loopback TCP, the disk); each round then times every probe once, round-robin. A probe's
// figure is its median over the rounds, so rounds spread over a longer span (strata bench plan
// runs one between its training runs) sample a machine whose speed drifts over that same span.
// Not thread-safe; one at a time per process (probes run on every core).
class Calibration {
 public:
  explicit Calibration(const CalibrateOptions& options);
  ~Calibration();
  Calibration(const Calibration&) = delete;
  Calibration& operator=(const Calibration&) = delete;

  void rounds(int count);
  int rounds_done() const;
  // The cluster description from the rounds so far (at least one), or from rounds `which` (each
  // below rounds_done(); a case of strata bench plan takes those next to its own runs); `say`
  // prints each figure.
  planner::Cluster cluster(bool say = true, const std::vector<int>& which = {}) const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// Calibration(options), kCalibrationRounds rounds, its cluster.
planner::Cluster calibrate_this_machine(const CalibrateOptions& options);

}  // namespace strata::bench
