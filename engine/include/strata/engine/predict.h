// What the engine would decide and hold for a configuration, without a model, a device or a
// communicator: the planner's view of one rank (`strata plan`). It runs the engine's own
// resolution (resolve_head_tiles, resolve_placement, resolve_recompute, resolve_activations,
// the prefetch room and the budget check of every use) on the one memory model, in the order the
// engine's construction runs them, with the units sized from the model configuration
// (models::stage_parameters) and the partition the engine would build at `world_size`. Every
// rank of a homogeneous cluster decides alike, so agreement is the identity here.
// tests/engine/predict_test.cc checks the prediction against engines really built.
//
// Pure function; thread-safe. Errors: none thrown for a configuration that does not fit (the
// prediction says so in `error`); std::invalid_argument for an invalid configuration.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "strata/engine/config.h"
#include "strata/engine/placement.h"
#include "strata/engine/plan/memory_model.h"

namespace strata::engine {

struct StatePrediction {
  bool fits = false;
  std::string error;   // why it does not fit (the engine's own message)
  std::string report;  // the placement line the engine would print

  PlacementPlan placement{Placement::kAuto, Placement::kAuto, Placement::kAuto, Placement::kAuto};
  plan::Choices choice;       // recomputed blocks, activation checkpoints' tier, prefetch depth
  int prefetch_deepest = 1;   // prefetch "auto": the deepest gather window the budget holds
  uint64_t head_tiles = 1;

  // This rank's state by tier, and the device's working set beside it.
  uint64_t device_state = 0, host_state = 0, nvme_state = 0;
  uint64_t working_set = 0;
  uint64_t checkpoint_bytes = 0;  // activation checkpoints of one micro-batch (in choice.activations)

  // The units as the engine partitions them, and the stages' units (the schedule).
  std::vector<uint64_t> unit_numel, padded_numel, shard_numel;
  std::vector<std::vector<size_t>> stage_units;
  uint64_t graph_bytes = 0;   // one kept block's autograd graph a micro-batch
  uint64_t compute_bytes = 2; // bytes of a compute-copy element
  uint64_t device_bytes() const { return device_state + working_set; }
};

// `budgets`: this rank's bytes of device (usable by the engine), host RAM and NVMe, as a run
// would take them (budgets_from: the configuration's own budgets first; no NVMe tier without
// offload.nvme_dirs, for which the planner names placeholder directories).
StatePrediction predict_state(const EngineConfig& config, const models::ModelConfig& model, int world_size,
                              const TierBudgets& budgets);

}  // namespace strata::engine
