// Resolution: what a rank decides once, from the configuration, the model's shapes, the machine's
// budgets and the one memory model, with every rank agreeing. The engine's construction and the
// planner's prediction (predict.h) both call it, so the two cannot disagree. The configuration is
// never changed: the decisions are two immutable values, and effective_config() shows them as a
// configuration with nothing left "auto".
//
// Two phases, because some decisions plan beside the state the first places:
//   resolve_layout      (before any state exists) the MLPs' token chunks, the tiles of the blocks
//                       and the vocabulary, the units and their partition, the schedule, the
//                       head's logits cut, the memory model, and the placement of each kind.
//   resolve_working_set (once the layout's state is allocated, or predicted) recompute, the
//                       activation checkpoints' tier, the prefetch window, and the budget check
//                       of every use of the schedule.
//
// The steps inside them, in order:
//   resolve_mlp_token_chunk  placement.tiling "mlp_tokens" "auto": whether the MLPs run over token
//                        chunks (first of all: the blocks' graphs, which every later test
//                        counts, depend on it)
//   resolve_tiles        placement.tiling "auto" for the blocks and the vocabulary: how many
//                        attention and MLP tiles each block is cut into, how many vocabulary
//                        tiles the embedding and the LM head (first: the units depend on it)
//   resolve_head_tiles   placement.tiling "auto": how many tiles the head's logits are cut into
//                        (before the rest: the working set it gives is what they plan with)
//   resolve_placement    each state kind's tier and the optimizer group's split by unit (the
//                        placement table the state store is built on: StateStore::placement)
//   resolve_recompute    recompute "auto": how many blocks keep their graphs (needs the
//                        device-placed state allocated: `base`)
//   resolve_activations  activation checkpoints "auto": device, else host, else NVMe
//   resolve_prefetch     prefetch "auto": how deep the gather window may go
//
// Agreement: every decision that changes collectives or memory is passed through `agree`, which
// returns, element by element, the largest value any rank passed (the engine's: an all-reduce
// max; tests: a simulated peer). Codes are ordered so that the largest is the safe choice: the
// slowest tier, the fewest units kept in a faster one, the most blocks recomputed.
// No libtorch, no device, no communicator: sizes only. Pure functions of their arguments and
// `agree`'s answers; thread-safe. Errors: as place_state's, and std::runtime_error when the
// agreed placement overruns this rank's budgets (naming both).
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "strata/engine/config.h"
#include "strata/engine/placement.h"
#include "strata/engine/layout/memory_model.h"
#include "strata/engine/layout/schedule.h"
#include "strata/models/model_config.h"
#include "strata/models/model_shapes.h"

namespace strata::engine {

using Agree = std::function<std::vector<int64_t>(const std::vector<int64_t>&)>;

// This rank's bytes of each kind (StateBytes) from the units' shard sizes, with `transient_buffers`
// gradient buffers of the largest shard for gradients that are not stored.
// `frozen[u]` (empty: none): unit u has only its compute copy (model.trainable).
StateBytes state_bytes(const std::vector<uint64_t>& shard_numel, uint64_t compute_bytes, size_t transient_buffers,
                       const std::vector<char>& frozen = {});

// The state the configuration places on the device explicitly (params, grads, master and moments
// set to "device"): what every automatic decision plans beside.
uint64_t explicit_device_bytes(const EngineConfig& cfg, const StateBytes& need);

// This rank's state bytes in each tier under `p`, as StateStore::placement will place them:
// gradients not stored count as their host buffers (or, for the device share's units, on the
// device).
struct TierBytes {
  uint64_t device = 0, host = 0, nvme = 0;
};
TierBytes bytes_by_tier(const StatePlacement& p, const StateBytes& need, uint64_t compute_bytes);

// The blocks' and the vocabulary's tiles: the configured counts, or for "auto" counts whole
// blocks and vocabulary when `fits` (tiles_fit, predict.h) says so, else the fewest tiles that
// fit, for k = 1, 2, ...: attention and MLP cut into about k x their share of the block's
// parameters (an explicit count kept), and at each k the vocabulary whole, then in 2, 4, ...
// tiles. "auto" cuts no MLP tile narrower than 64 features and no vocabulary tile narrower than
// layout::kMinTileVocab rows. When none fits, whole (construction's budget check then names what is
// left, with the tiles among the remedies). The search runs with the head's logits in the
// smallest tiles "auto" cuts (`fits(t, false)`); then, when the vocabulary and the head's tiles
// are both "auto", again at no larger block cut with the logits in tiles of about
// layout::kEfficientTileElements (`fits(t, true)`), whose answer is taken when it finds one: more
// vocabulary tiles rather than tiny logits tiles, never more block tiles for it. Agreed: each count the most any rank needs. Throws std::invalid_argument for counts that do not
// cut the model.
models::LayerTiles resolve_tiles(const EngineConfig& cfg, const models::ModelConfig& mc,
                                  const std::function<bool(const models::LayerTiles&, bool efficient_logits)>& fits,
                                  const Agree& agree);

// The most tiles placement.tiling "auto" would cut (each kind that is "auto" at its most: every
// key/value head, MLP slices of 64 features, vocabulary ranges of layout::kMinTileVocab rows; the
// configured count otherwise): the leanest cut resolve_tiles searches towards.
models::LayerTiles leanest_tiling(const EngineConfig& cfg, const models::ModelConfig& mc);

// The MLPs' token chunk (EngineConfig::mlp_token_chunk): the configured one, or for "auto"
// none where the leanest tiles fit without chunks (`fits(tiles, 0)`: tiles_fit) and
// layout::auto_mlp_token_chunk(tokens) where it does not. Agreed: the largest any rank needs.
int64_t resolve_mlp_token_chunk(const EngineConfig& cfg, const models::ModelConfig& mc,
                                const std::function<bool(const models::LayerTiles&, int64_t chunk)>& fits,
                                const Agree& agree);

// "; blocks in A attention x M MLP tiles; embedding and LM head in V vocabulary tiles (largest
// unit B); MLP over chunks of N tokens" for the placement line, each part only when cut.
std::string describe_tiles(const models::LayerTiles& t, int64_t mlp_token_chunk, const layout::MemoryModel& mm);

// The head's logits cut: the configured count, or for "auto" the fewest for which `base` (the
// state the configuration puts on the device explicitly) plus the working set under `choice` (the
// configuration's explicit choices, the leanest automatic ones) fits `usable` (every count up to
// 4096 tried in order, beyond that about the fewest), up to layout::max_auto_logits_tiles; when none
// fits, that most (construction's budget check then names what still does not fit). A count is
// cut in two passes (layout::logits_tiles); with head_pass "one" in one pass
// (layout::one_pass_tiles: token chunks over the whole vocabulary, no logits recomputed) where
// that fits too and the head is not in vocabulary tiles. "auto" takes the fewest count that
// fits either way, so one pass only where it fits at that count (its fp32 weight gradient
// rarely leaves room at the fewest). Agreed in two steps, every rank alike: one pass only if
// every rank's cut is one pass; then the count under the agreed passes, the most any rank needs.
struct HeadCut {
  uint64_t count = 1;          // tiles asked for
  layout::LogitsTiles logits;   // the cut
};
HeadCut resolve_head_tiles(const EngineConfig& cfg, const layout::Schedule& schedule, const layout::ModelSizes& sizes,
                           const layout::Choices& choice, uint64_t base, uint64_t usable, const Agree& agree);

// The kinds' tiers and the split: the configuration's explicit ones kept, "auto" ones planned
// within `budgets(device_bytes_for_state)` (machine_budgets), where the device keeps room for
// `mm.working_set(choice)` out of `usable_device`. Writes the placement line to `report`.
StatePlacement resolve_placement(const EngineConfig& cfg, const layout::MemoryModel& mm, const layout::Choices& choice,
                                const StateBytes& need, uint64_t usable_device,
                                const std::function<TierBudgets(uint64_t)>& budgets, const Agree& agree,
                                std::string& report);

// The choices every decision before the state's allocation plans with: the configured
// checkpoints' tier and prefetch, and recompute "auto" as every block (the leanest).
layout::Choices initial_choices(const EngineConfig& cfg, size_t block_stages, const models::LayerTiles& tiles);

// placement.recompute counts whole blocks; the memory model and the engine count block stages
// (Choices::recomputed), `tiles.block_stages()` a block. The stages of the first
// `recompute_blocks` blocks, at most `block_stages` (every block stage): kRecomputeAll gives all,
// and so does kRecomputeAuto (the leanest, until resolve_recompute decides).
size_t recomputed_stages(int recompute_blocks, size_t block_stages, const models::LayerTiles& tiles);

// Block stages recomputed for "auto": those of the fewest whole blocks (`stages_per_block`
// stages each) for which `base` + the working set fits in `usable`, agreed.
size_t resolve_recompute(const layout::MemoryModel& mm, const layout::Choices& choice, uint64_t base, uint64_t usable,
                         const Agree& agree, size_t stages_per_block);

// Activation checkpoints' tier for placement.activations "auto": the device if the working set
// with them there fits `usable` beside `base`; else host RAM if they fit its budget (a configured
// host budget also holds `host_state` bytes of state) or no swap directory is given; else NVMe.
// An explicit placement is returned as it is.
Placement resolve_activations(const EngineConfig& cfg, const layout::MemoryModel& mm, const layout::Choices& choice,
                              uint64_t base, uint64_t usable, uint64_t host_state, const TierBudgets& budgets,
                              const Agree& agree);

// prefetch "auto": the deepest gather window, in uses, that the room beside `base` holds of the
// largest unit with nothing gathered ahead (MemoryModel::prefetch_room), at least 1, at most
// kMaxAutoPrefetch and the schedule's uses less one. PrefetchTuner moves the depth within it.
constexpr int kMaxAutoPrefetch = 8;
int resolve_prefetch(const layout::MemoryModel& mm, const layout::Choices& choice, uint64_t base, uint64_t usable);


// The one test that the budget runs every use of the schedule beside `base` bytes of
// device-placed state (the run and `--plan` alike). Throws BudgetExceeded naming the first unit
// that does not fit, its need by part, and only the remedies that apply here (fewer tokens a
// micro-batch, activation checkpoints off the device, more blocks recomputed, state off the
// device, the blocks or the vocabulary in more tiles). `stage_name(s)` names stage s (and the
// unit it owns).
void check_working_set(const EngineConfig& cfg, const layout::MemoryModel& mm, const layout::Choices& choice,
                       uint64_t base, uint64_t budget, const std::function<std::string(size_t)>& stage_name);

// --- the units --------------------------------------------------------------------------------

// The units the engine builds for `mc` cut by `tiles`, partitioned at `world_size` as
// Partition does: a stage owning parameters makes a unit of its trainable tensors and one of its
// frozen ones (model.trainable), a tied head (tile) also using the unit of its embedding
// (tile)'s rows (models::unit_shapes); and each stage's input width
// (models::stage_input_widths). The engine checks that the model it built has these units.
struct UnitTable {
  models::LayerTiles tiles;
  std::vector<uint64_t> unit_numel, padded_numel, shard_numel;
  std::vector<char> frozen;  // by unit
  std::vector<uint64_t> dequantized;  // by unit: its 4-bit tensors' elements (models::UnitShapes)
  std::vector<std::vector<size_t>> stage_units;
  std::vector<uint64_t> input_widths;
  size_t vocab_tiles = 1;  // embedding and head stages
  layout::Schedule schedule() const;
};
// Bytes of an element of the compute copies (precision.compute).
uint64_t compute_bytes(const EngineConfig& cfg);
// `compute_bytes`: the flat buffers' element (a 4-bit record's elements depend on it).
UnitTable unit_table(const models::ModelConfig& mc, const models::LayerTiles& tiles, int world_size,
                    const models::TrainableTensors& trainable = {}, uint64_t compute_bytes = 4);

// Whether `tiles` lets the device run a step within `usable` bytes: the state `cfg` places on
// the device explicitly plus the largest use's need (construction's budget check: nothing
// gathered ahead) at the leanest automatic choices (every block recomputed unless configured,
// the head's logits, unless configured, in the most tiles "auto" cuts). With `efficient_logits`,
// the logits in no more than layout::max_efficient_logits_tiles, and the configured prefetch window
// counted (resolve_head_tiles' test), unless that cap is max_auto_logits_tiles itself (then the
// same test as without). The test placement.tiling "auto" makes for the blocks and the
// vocabulary (resolve_tiles).
bool tiles_fit(const EngineConfig& cfg, const models::ModelConfig& mc, const models::LayerTiles& tiles,
                 int world_size, uint64_t usable, bool efficient_logits);
// The bytes tiles_fit weighs against `usable`. With `few_layers` (what tiles_fit uses), when
// every block is recomputed (no graph is held across blocks) a model of many layers is weighed
// through one of a few: its blocks are alike, so the largest need is met among the first and last
// few blocks, which the prefetch window reaches from the ends, or in any block between; what grows
// with the layers (the explicitly placed state, the device checkpoints) is added for the rest.
// The same bytes as the whole model's (the tests compare), in time independent of the layers:
// `strata plan --max-model` weighs models of 600 layers cut into thousands of tiles each.
uint64_t tiles_device_bytes(const EngineConfig& cfg, const models::ModelConfig& mc, const models::LayerTiles& tiles,
                             int world_size, bool efficient_logits, bool few_layers = true);

// The sizes the memory model works with for `units` under `cfg` (the head's logits uncut: the
// head's cut is resolved on them).
layout::ModelSizes model_sizes(const EngineConfig& cfg, const models::ModelConfig& mc, const UnitTable& units);

// The gradient buffers held for gradients that are not stored: the multi-use units' held ones (a
// tied embedding) plus two.
size_t transient_gradient_buffers(const layout::Schedule& schedule);

// What a cut makes of the model before anything is decided about it: the units, the sizes the
// memory model works with (with the cut's MLP token chunk; the head's logits uncut), the
// schedule, this rank's state bytes and the leanest starting choices (initial_choices). The one
// start of every resolution and prediction: resolve_layout, predict_state (and through it the
// planner's time model), and tiles_fit's weighing.
struct CutModel {
  UnitTable units;
  layout::ModelSizes sizes;
  layout::Schedule schedule;
  size_t transient_buffers = 2;  // transient_gradient_buffers(schedule)
  StateBytes need;
  layout::Choices choice;
};
CutModel cut_model(const EngineConfig& cfg, const models::ModelConfig& mc, const models::LayerTiles& tiles,
                   int64_t mlp_token_chunk, int world_size);

// --- the two phases ---------------------------------------------------------------------------

// What a rank's machine offers before any state is allocated.
struct MachineView {
  int world_size = 1;
  uint64_t usable_device = UINT64_MAX;  // device bytes decisions may count on (MemoryModel::usable_device)
  // The tiers' budgets for state, given the device bytes left for it (machine_budgets on a run,
  // budgets_from on the planner's cluster).
  std::function<TierBudgets(uint64_t device_for_state)> budgets;
  Agree agree;  // the ranks' agreement; the identity where every rank decides alike
};

// Phase one. Immutable; not copyable or movable (the memory model refers to the schedule).
struct Layout {
  Layout(UnitTable units, layout::ModelSizes sizes);
  Layout(const Layout&) = delete;
  Layout& operator=(const Layout&) = delete;

  int64_t mlp_token_chunk = 0;  // resolve_mlp_token_chunk (0: whole MLPs)
  models::LayerTiles tiles;    // resolve_tiles
  UnitTable units;               // the units, their partition and the stages' units
  layout::Schedule schedule;      // of one micro-batch
  size_t transient_buffers = 2; // transient_gradient_buffers
  StateBytes need;              // this rank's state bytes by kind
  HeadCut head;                 // resolve_head_tiles
  layout::MemoryModel memory;     // with the head's cut
  StatePlacement placement{Placement::kAuto, Placement::kAuto, Placement::kAuto, Placement::kAuto};
  std::string report;           // "placement ...[; blocks in ...]": the placement line's start (describe_tiles)
  std::string head_report;      // "; head logits ... (... for the loss)": the line goes on with it
};

// The layout's first steps: how the model is cut (resolve_mlp_token_chunk, then resolve_tiles).
// Throws std::invalid_argument for tile counts that do not cut the model.
struct Cut {
  int64_t mlp_token_chunk = 0;
  models::LayerTiles tiles;
};
Cut resolve_cut(const EngineConfig& cfg, const models::ModelConfig& mc, const MachineView& machine);

// The layout of a cut: throws what resolve_head_tiles and resolve_placement throw.
// resolve_layout(cfg, mc, m) is resolve_layout(cfg, mc, resolve_cut(cfg, mc, m), m).
std::unique_ptr<const Layout> resolve_layout(const EngineConfig& cfg, const models::ModelConfig& mc, const Cut& cut,
                                             const MachineView& machine);
std::unique_ptr<const Layout> resolve_layout(const EngineConfig& cfg, const models::ModelConfig& mc,
                                             const MachineView& machine);

// What a rank holds once the layout's state is allocated (or, for a prediction, would hold).
struct Allocated {
  uint64_t device_state = 0;           // the device-placed state's bytes ("base")
  uint64_t usable_device = UINT64_MAX; // the device bytes decisions may count on beside it
  uint64_t budget = UINT64_MAX;        // the device budget every use is checked against
  uint64_t host_state = 0;             // this rank's state in host RAM
  TierBudgets budgets;                 // the tiers' budgets measured now (activation checkpoints)
};

// What a run would hold once the layout's state is allocated, from what the machine offers before
// (a prediction: the planner, `--plan`): the device-placed state beside the device `budget` and
// its `physical_free` memory (UINT64_MAX: unknown), and the tiers' budgets from `host_available`
// less every local rank's host state, and `nvme_free`.
Allocated predicted_allocation(const EngineConfig& cfg, const Layout& layout, uint64_t compute_bytes, uint64_t budget,
                               uint64_t physical_free, uint64_t host_available, uint64_t nvme_free, int local_ranks);

// Phase two. Immutable.
struct WorkingSet {
  layout::Choices choice;       // recomputed block stages, checkpoints' tier, prefetch (auto: its start, 1)
  bool prefetch_auto = false;
  int prefetch_deepest = 1;   // prefetch "auto": the deepest window the budget holds; else the configured depth
  std::string report;         // "; recompute ...; activation checkpoints ...[; prefetch auto ...]"
};

// Throws BudgetExceeded (check_working_set) when a use does not fit beside the state.
// `stage_name(s)` names stage s in that message.
WorkingSet resolve_working_set(const EngineConfig& cfg, const Layout& layout, const Allocated& held,
                                   const Agree& agree, const std::function<std::string(size_t)>& stage_name);

// Phase two from a prediction of the allocation (predicted_allocation with these arguments): what
// `--plan` and the planner's prediction resolve without allocating anything.
WorkingSet predicted_working_set(const EngineConfig& cfg, const Layout& layout, uint64_t compute_bytes, uint64_t budget,
                                 uint64_t physical_free, uint64_t host_available, uint64_t nvme_free, int local_ranks,
                                 const Agree& agree, const std::function<std::string(size_t)>& stage_name);

// `cfg` with the resolved choices in place of "auto" (Engine::config(), the planner's view).
EngineConfig effective_config(const EngineConfig& cfg, const Layout& layout, const layout::Choices& choice);

}  // namespace strata::engine
