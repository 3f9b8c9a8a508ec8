// What the engine would decide and hold for a configuration, without a model, a device or a
// communicator: the planner's view of one rank (`strata plan`). It runs the engine's own
// resolution (resolve_head_tiles, resolve_placement, resolve_recompute, resolve_activations,
// the prefetch room and the budget check of every use) on the one memory model, in the order the
// engine's construction runs them, with the units sized from the model configuration
// (models::stage_parameters) and the partition the engine would build at `world_size`. Every
// rank of a homogeneous cluster decides alike, so agreement is the identity here.
// tests/engine/predict_test.cc checks the prediction against engines really built.
//
// Pure function; thread-safe. Errors: std::invalid_argument for an invalid configuration or model
// (their validate()); anything the resolution refuses (a budget, an agreed placement that is not
// a valid configuration) is not thrown but reported in `error`, with `fits` false.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "strata/engine/config.h"
#include "strata/engine/placement.h"
#include "strata/engine/plan/memory_model.h"
#include "strata/models/model_config.h"
#include "strata/models/model_shapes.h"

namespace strata::engine {

// The units the engine builds for `mc` cut by `tiling`, partitioned at `world_size` as
// Partition does: one unit per stage owning parameters (models::stage_parameters), a tied head
// (tile) also using its embedding (tile)'s unit (models::stage_units); and each stage's input
// width (models::stage_input_widths).
struct UnitPlan {
  models::LayerTiling tiling;
  std::vector<uint64_t> unit_numel, padded_numel, shard_numel;
  std::vector<std::vector<size_t>> stage_units;
  std::vector<uint64_t> input_widths;
  size_t vocab_tiles = 1;  // embedding and head stages
  plan::Schedule schedule() const;
};
UnitPlan plan_units(const models::ModelConfig& mc, const models::LayerTiling& tiling, int world_size);

// Whether `tiling` lets the device run a step within `usable` bytes: the state `cfg` places on
// the device explicitly plus the largest use's need (construction's budget check: nothing
// gathered ahead) at the leanest automatic choices (every block recomputed unless configured,
// the head's logits, unless configured, in the most tiles "auto" cuts). With `efficient_logits`,
// the logits in no more than plan::max_efficient_logits_tiles, and the configured prefetch window
// counted (resolve_head_tiles' test), unless that cap is max_auto_logits_tiles itself (then the
// same test as without). The test placement.tiling "auto" makes for the blocks and the
// vocabulary (resolve_tiles).
bool tiling_fits(const EngineConfig& cfg, const models::ModelConfig& mc, const models::LayerTiling& tiling,
                 int world_size, uint64_t usable, bool efficient_logits);

struct StatePrediction {
  bool fits = false;
  std::string error;   // why it does not fit (the engine's own message)
  std::string report;  // the placement line the engine would print

  PlacementPlan placement{Placement::kAuto, Placement::kAuto, Placement::kAuto, Placement::kAuto};
  plan::Choices choice;       // recomputed block stages, activation checkpoints' tier, prefetch depth
  int prefetch_deepest = 1;   // prefetch "auto": the deepest gather window the budget holds
  uint64_t head_tiles = 1;
  bool head_one_pass = false;  // the head's tiles computed in one pass (plan::LogitsTiling::one_pass)
  plan::LogitsTiling head_logits;  // the cut the loss runs over (MemoryModel::head_logits)
  int64_t mlp_token_chunk = 0; // the MLPs over chunks of this many tokens, 0: whole (resolve_mlp_token_chunk)
  models::LayerTiling tiles;

  // This rank's state by tier, and the device's working set beside it.
  uint64_t device_state = 0, host_state = 0, nvme_state = 0;
  uint64_t working_set = 0;
  TierBudgets budgets;            // what the rank's state could take in each tier (budgets_from)
  uint64_t checkpoint_bytes = 0;  // activation checkpoints of one micro-batch (in choice.activations)

  // The units as the engine partitions them, and the stages' units (the schedule).
  std::vector<uint64_t> unit_numel, padded_numel, shard_numel;
  std::vector<std::vector<size_t>> stage_units;
  uint64_t graph_bytes = 0;   // one kept block's autograd graph a micro-batch (its stages' together)
  uint64_t compute_bytes = 2; // bytes of a compute-copy element
  uint64_t device_bytes() const { return device_state + working_set; }
};

// What one node offers a rank, as a run sees its machine: the device bytes the engine may use, the
// node's available RAM and the free space of its swap directories, and how many ranks share
// them. The budgets follow budgets_from (the configuration's own first; no NVMe tier without
// offload.nvme_dirs, for which the planner names placeholder directories); checkpoints are placed
// with the RAM left once every local rank's host state is allocated, as a run measures it.
struct MachineShare {
  uint64_t device = UINT64_MAX;
  uint64_t host_available = 0, nvme_free = 0;
  int local_ranks = 1;
};

StatePrediction predict_state(const EngineConfig& config, const models::ModelConfig& model, int world_size,
                              const MachineShare& machine);

}  // namespace strata::engine
