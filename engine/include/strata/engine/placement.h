// Automatic placement: for each state kind the configuration leaves at "auto", the tier that
// holds it, filling the GPU first, then host RAM, then NVMe swap, within byte budgets.
//
// Policy (fastest training first): everything on the device if it all fits; otherwise the
// compute copies on the device (gathers then need no host copies) and the optimizer group
// (fp32 master, moments and gradient accumulators, which must live together, except that
// gradients may stay on the host beside NVMe master and moments) in host RAM, else in NVMe swap
// with the gradients on the host, else with them in swap too; compute copies that do not fit on
// the device go to the host, else to swap. Master and moments that do not fit in host RAM whole
// are split by unit: the first units (the next forward needs them first) in what host RAM is
// left once the gradients (touched every micro-batch) and the compute copies the device cannot
// hold (read at every gather) have their room, the rest in swap. Kinds the configuration places explicitly keep their
// tier and their bytes count against it. Gradients that are not stored (gradients_transient)
// take only their buffers in host RAM (StateBytes::grad_buffers) beside a master off the device.
//
// Pure functions; thread-safe. Errors: std::runtime_error naming the bytes needed and the
// budgets when the state fits nowhere.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "strata/engine/config.h"

namespace strata::engine {

// This rank's bytes of each kind, and the shard elements of each unit in forward order (what a
// split by unit needs; none: no split). grad_buffers: the host buffers gradients that are not
// stored need instead of `grads` (gradients_transient).
struct StateBytes {
  uint64_t params = 0, grads = 0, master = 0, moments = 0;
  std::vector<uint64_t> unit_numel;
  uint64_t grad_buffers = 0;
};

// Bytes of state each tier may take on this rank (the device's after its working set).
struct TierBudgets {
  uint64_t device = 0, host = 0, nvme = 0;
};

// master == moments == kNvme with host_units > 0: the optimizer group was split by unit, and
// the first host_units units' master and moments (and gradients, where grads is kNvme too: they
// stay with their master) live in host RAM, the rest in swap.
// grads_transient: gradients are not stored (see gradients_transient); grads is then kHost,
// where each unit's gradient waits for its update in one of a few buffers.
struct PlacementPlan {
  Placement params, grads, master, moments;
  size_t host_units = 0;
  bool grads_transient = false;
};

// True when gradients need no accumulators: the update runs during backward
// (optimizer.overlap "backward"), a step has one micro-batch, and the master weights are off the
// device (`master`: where they are, or will be, placed). Each unit's reduced gradient then goes to
// a host buffer that its update consumes and frees, so gradients take no room in any tier.
bool gradients_transient(const EngineConfig& config, Placement master);

PlacementPlan plan_placement(const EngineConfig& config, const StateBytes& need, const TierBudgets& budgets);

// Host and NVMe budgets from the configuration, or from this machine where it says 0: 80% of
// MemAvailable and 95% of the free space of offload.nvme_dirs (0 without directories), each
// divided among `local_ranks` processes. `device` is passed through.
TierBudgets machine_budgets(const EngineConfig& config, uint64_t device, int local_ranks);

// device.prefetch "auto": the gather depth, tuned from what each step measured. `waited` is the
// fraction of the last step spent waiting for parameters (summed over ranks, so that every rank
// decides alike). While it exceeds 2% the depth grows by one a step, up to `deepest` (what the
// byte budget holds); a deepening that did not cut the waits by at least 10% (the transfers,
// not their start, are the bottleneck) is undone, and the depth stays there. Plain value type.
struct PrefetchTuner {
  int depth = 1;
  int deepest = 1;
  double waited_before = -1;  // the waits that the last deepening was meant to cut; -1: none
  bool settled = false;
  int next(double waited);    // the depth for the next step
};

// "params device 2.6 GiB, grads host 10.4 GiB, master nvme ..., moments nvme ...".
std::string describe_plan(const PlacementPlan& plan, const StateBytes& need);

}  // namespace strata::engine
