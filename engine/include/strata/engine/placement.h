// Automatic placement: for each state kind the configuration leaves at "auto", the tier that
// holds it, filling the GPU first, then host RAM, then NVMe, within byte budgets.
//
// Policy (fastest training first): everything on the device if it all fits. Otherwise the
// compute copies on the device where they fit (gathers then need no host copies), then the
// optimizer group (fp32 master, moments and gradient accumulators) by unit in forward order:
// the first units on the device in what is left of it (16 bytes an element: the device updates
// them), the rest in host RAM, else split by unit between host RAM and NVMe. Off the
// device the gradients may stay on the host beside master and moments on NVMe, else they follow
// their master onto NVMe. Host RAM goes first to the gradients (touched every micro-batch) and
// the compute copies the device cannot hold (read at every gather), then to the first units'
// master and moments; compute copies that fit neither device nor host go to NVMe. Units early in
// forward order go to the faster tier because the next forward needs them first. Kinds the
// configuration places explicitly keep their tier and their bytes count against it; the device
// share needs gradients placed automatically (a device unit's gradient lives there too).
// Gradients that are not stored (gradients_transient) take only their buffers in host RAM
// (StateBytes::grad_buffers) beside a master off the device.
//
// Pure functions; thread-safe. Errors: std::runtime_error naming the bytes needed and the
// budgets when the state fits nowhere.
#pragma once

#include <algorithm>

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
  // By unit: the shard elements of its optimizer group (master, moments, gradient: 0 for a frozen
  // unit, which has none).
  std::vector<uint64_t> unit_numel;
  uint64_t grad_buffers = 0;
  // The largest trainable shard: a transient gradient buffer's elements.
  uint64_t largest_trainable_shard() const {
    return unit_numel.empty() ? 0 : *std::max_element(unit_numel.begin(), unit_numel.end());
  }
  // By unit: the shard elements of its compute copy (empty: unit_numel's).
  std::vector<uint64_t> compute_numel;
};

// Bytes of state each tier may take on this rank (the device's after its working set).
struct TierBudgets {
  uint64_t device = 0, host = 0, nvme = 0;
};

// The optimizer group split by unit, in forward order: units [0, device_units) keep master,
// moments and gradients on the device (master, moments and grads then name where the other
// units are: kHost or kNvme); with master == moments == kNvme, units [device_units, host_units)
// keep master and moments (and gradients, where grads is kNvme too: they stay with their master)
// in host RAM and the rest on NVMe (host_units counts from unit 0; it means something only
// with the group on NVMe).
// grads_transient: gradients are not stored (see gradients_transient); grads is then kHost,
// where each unit's gradient waits for its update in one of a few buffers.
struct StatePlacement {
  Placement params, grads, master, moments;
  size_t device_units = 0, host_units = 0;
  bool grads_transient = false;
  // Where unit u's shard of a kind whose tier is `kind_tier` lives under this split; `group`:
  // master, moments or gradients (the kinds split by unit).
  Placement unit_tier(Placement kind_tier, bool group, size_t u) const {
    if (group && u < device_units) return Placement::kDevice;
    return group && kind_tier == Placement::kNvme && u < host_units ? Placement::kHost : kind_tier;
  }
};

namespace state {
// The kinds of state a unit's shard has. The state store holds them (state/state_store.h).
enum Kind : int { kMaster = 0, kExpAvg = 1, kExpAvgSq = 2, kGrad = 3, kCompute = 4, kKinds = 5 };
// The kinds a checkpoint saves, and Engine's state_slice/read_state serve: the fp32 master
// weights and the two moments, the first kSavedKinds of Kind.
constexpr int kSavedKinds = 3;
const char* kind_name(int kind);  // "master", ...; std::out_of_range for an unknown kind
// Where unit u's shard of `kind` lives under `plan`: the kind's tier (of a split optimizer group,
// per unit: StatePlacement::unit_tier). The one rule; the store and automatic placement call it.
Placement kind_tier(const StatePlacement& plan, int kind);
inline Placement unit_kind_tier(const StatePlacement& plan, size_t u, int kind) {
  return plan.unit_tier(kind_tier(plan, kind), kind != kCompute, u);
}
}  // namespace state

// True when gradients need no accumulators: the update runs during backward
// (optimizer.overlap "backward"), a step has one micro-batch, and the master weights are off the
// device (`master`: where they are, or will be, placed). Each unit's reduced gradient then goes to
// a host buffer that its update consumes and frees, so gradients take no room in any tier
// (except the device share's units, StatePlacement::device_units: theirs stay on the device).
bool gradients_transient(const EngineConfig& config, Placement master);

StatePlacement place_state(const EngineConfig& config, const StateBytes& need, const TierBudgets& budgets);

// Host and NVMe budgets from the configuration, or where it says 0 from what a machine offers:
// 80% of `host_available` bytes of RAM and 95% of `nvme_free` bytes in offload.nvme_dirs (none
// without directories), each divided among `local_ranks` processes. `device` is passed through.
// The one rule: a run applies it to this machine (machine_budgets), the planner to a cluster's.
TierBudgets budgets_from(const EngineConfig& config, uint64_t device, uint64_t host_available, uint64_t nvme_free,
                         int local_ranks);
// What this machine offers now: MemAvailable, and the free space of offload.nvme_dirs' file systems.
struct MachineFree {
  uint64_t host_available = 0, nvme_free = 0;
};
MachineFree machine_free(const EngineConfig& config);
// budgets_from this machine (machine_free).
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
std::string describe_placement(const StatePlacement& plan, const StateBytes& need);

}  // namespace strata::engine
