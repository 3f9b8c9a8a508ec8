// What the engine would decide and hold for a configuration, without a model, a device or a
// communicator: the planner's view of one rank (`strata plan`). It calls the engine's own
// resolution (layout/resolve.h: resolve_layout, then resolve_working_set with the state the layout
// would place counted as allocated), with the units sized from the model configuration
// (unit_table) and the partition the engine would build at `world_size`. Every rank of a
// homogeneous cluster decides alike, so agreement is the identity here.
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
#include "strata/engine/layout/memory_model.h"
#include "strata/engine/layout/resolve.h"
#include "strata/models/model_config.h"
#include "strata/models/model_shapes.h"

namespace strata::engine {

struct StatePrediction {
  bool fits = false;
  std::string error;   // why it does not fit (the engine's own message)
  std::string report;  // the placement line the engine would print

  StatePlacement placement{Placement::kAuto, Placement::kAuto, Placement::kAuto, Placement::kAuto};
  layout::Choices choice;       // recomputed block stages, activation checkpoints' tier, prefetch depth
  int prefetch_deepest = 1;   // prefetch "auto": the deepest gather window the budget holds
  uint64_t head_tiles = 1;
  bool head_one_pass = false;  // the head's tiles computed in one pass (layout::LogitsTiles::one_pass)
  layout::LogitsTiles head_logits;  // the cut the loss runs over (MemoryModel::head_logits)
  int64_t mlp_token_chunk = 0; // the MLPs over chunks of this many tokens, 0: whole (resolve_mlp_token_chunk)
  models::LayerTiles tiles;

  // This rank's state by tier, and the device's working set beside it.
  uint64_t device_state = 0, host_state = 0, nvme_state = 0;
  uint64_t working_set = 0;
  TierBudgets budgets;            // what the rank's state could take in each tier (budgets_from)
  uint64_t checkpoint_bytes = 0;  // activation checkpoints of one micro-batch (in choice.activations)

  // The units as the engine partitions them, and the stages' units (the schedule).
  std::vector<uint64_t> unit_numel, padded_numel, shard_numel;
  std::vector<std::vector<size_t>> stage_units;
  std::vector<char> frozen;   // by unit (model.trainable)
  std::vector<uint64_t> dequantized;  // by unit: its 4-bit weights' elements (model.quantize; UnitTable)
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
