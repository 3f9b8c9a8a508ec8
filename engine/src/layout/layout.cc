// The resolution's two phases (resolve_layout, resolve_working_set) and the units they plan with;
// the steps they run are in resolve.cc (the layout's) and working_set.cc (the working set's).
#include <algorithm>
#include <memory>
#include <string>

#include "strata/engine/bytes.h"
#include "strata/engine/partition.h"
#include "strata/engine/shard.h"
#include "strata/engine/layout/resolve.h"

namespace strata::engine {

uint64_t compute_bytes(const EngineConfig& cfg) { return cfg.compute == Precision::kFp32 ? 4 : 2; }

UnitTable unit_table(const models::ModelConfig& mc, const models::LayerTiles& tiles, int world_size,
                    const models::TrainableTensors& trainable, uint64_t compute_bytes) {
  models::UnitShapes shapes = models::unit_shapes(mc, tiles, trainable, compute_bytes);
  UnitTable out;
  out.tiles = tiles;
  out.stage_units = std::move(shapes.stage_units);
  out.frozen = std::move(shapes.frozen);
  out.dequantized = std::move(shapes.dequantized);
  // The partition's sizes without building one (no names): this runs for every cut weighed.
  for (const uint64_t numel : shapes.numel) {
    const uint64_t shard = shard_numel_of(numel, world_size, Partition::kDefaultAlignNumel);
    out.unit_numel.push_back(numel);
    out.padded_numel.push_back(shard * uint64_t(world_size));
    out.shard_numel.push_back(shard);
  }
  out.input_widths = models::stage_input_widths(mc, tiles);
  out.vocab_tiles = size_t(tiles.vocab);
  return out;
}

layout::Schedule UnitTable::schedule() const {
  return layout::Schedule(stage_units, unit_numel.size(), vocab_tiles, vocab_tiles, frozen);
}

layout::ModelSizes model_sizes(const EngineConfig& cfg, const models::ModelConfig& mc, const UnitTable& units) {
  layout::ModelSizes sizes;
  sizes.padded_numel = units.padded_numel;
  sizes.shard_numel = units.shard_numel;
  sizes.frozen = units.frozen;
  sizes.dequantized = units.dequantized;
  sizes.input_widths = units.input_widths;
  sizes.mlp_chunked = cfg.mlp_token_chunk > 0;
  sizes.compute_bytes = compute_bytes(cfg);
  sizes.reduce_bf16 = cfg.reduce == Precision::kBf16;
  sizes.tokens = uint64_t(cfg.micro_batch * cfg.seq_len);
  sizes.hidden = uint64_t(mc.hidden);
  sizes.vocab = uint64_t(mc.vocab_size);
  for (uint64_t per_token : models::stage_graph_bytes_per_token(mc, units.tiles, sizes.compute_bytes, sizes.mlp_chunked))
    sizes.graph_bytes.push_back(sizes.tokens * per_token);
  sizes.vocab_tiles = units.vocab_tiles;
  return sizes;
}

CutModel cut_model(const EngineConfig& given, const models::ModelConfig& mc, const models::LayerTiles& tiles,
                   int64_t mlp_token_chunk, int world_size) {
  EngineConfig cfg = given;
  cfg.mlp_token_chunk = mlp_token_chunk;
  UnitTable units = unit_table(mc, tiles, world_size, models::TrainableTensors(cfg.trainable), compute_bytes(cfg));
  layout::ModelSizes sizes = model_sizes(cfg, mc, units);
  layout::Schedule schedule = units.schedule();
  const size_t transient = transient_gradient_buffers(schedule);
  StateBytes need = state_bytes(units.shard_numel, sizes.compute_bytes, transient, units.frozen);
  const layout::Choices choice = initial_choices(cfg, schedule.blocks(), tiles);
  return {std::move(units), std::move(sizes), std::move(schedule), transient, std::move(need), choice};
}

namespace {

// tiles_device_bytes' terms for the whole of `mc`.
struct FitTerms {
  uint64_t explicit_state = 0;  // the state `cfg` places on the device
  uint64_t working_set = 0;
  uint64_t device_checkpoints = 0;  // the working set's part that grows with the layers
};

FitTerms fit_terms(const EngineConfig& cfg, const models::ModelConfig& mc, const models::LayerTiles& tiles,
                   int world_size, bool efficient_logits) {
  CutModel c = cut_model(cfg, mc, tiles, cfg.mlp_token_chunk, world_size);
  layout::ModelSizes& sizes = c.sizes;
  const uint64_t most_auto = layout::max_auto_logits_tiles(sizes.tokens, sizes.vocab),
                 most_efficient = layout::max_efficient_logits_tiles(sizes.tokens, sizes.vocab);
  // Where the efficient cap is no cap (small logits), the two tests are one.
  if (most_efficient >= most_auto) efficient_logits = false;
  const uint64_t most_logits_tiles = efficient_logits ? most_efficient : most_auto;
  sizes.logits = layout::logits_tiles(sizes.tokens, sizes.vocab,
                                     cfg.head_tiles != EngineConfig::kTilesAuto ? cfg.head_tiles
                                                                                : std::max<uint64_t>(1, most_logits_tiles));
  // The leanest choices, the checkpoints where configured. Gathering ahead is opportunistic:
  // construction checks each use's need alone. The efficient test makes resolve_head_tiles' own
  // test (the configured prefetch window), so that a cut it accepts leaves the head a count
  // within max_efficient_logits_tiles.
  layout::Choices choice = c.choice;
  choice.prefetch = efficient_logits ? cfg.prefetch : 0;
  const layout::MemoryModel mm(c.schedule, std::move(sizes));
  return {explicit_device_bytes(cfg, c.need), mm.working_set(choice), mm.device_checkpoints(choice)};
}

}  // namespace

uint64_t tiles_device_bytes(const EngineConfig& cfg, const models::ModelConfig& mc, const models::LayerTiles& tiles,
                             int world_size, bool efficient_logits, bool few_layers) {
  // Blocks farther than the prefetch window (at most cfg.prefetch uses) plus one from either end
  // of the model see alike neighbours, alike units ahead and alike scratch; with every block
  // recomputed nothing they hold depends on how many came before, so one of them stands for all.
  // This rests on every layer of a family having the same shapes (models::stage_* repeat a block
  // at a time); a family whose layers differ (alternating attention kinds with other graph sizes)
  // must be weighed whole here. TilingFits.AFewLayersStandForAllOfThemExactly compares.
  const int64_t per_block = std::max<int64_t>(1, tiles.block_stages());
  const int64_t margin = (std::max(0, cfg.prefetch) + per_block - 1) / per_block + 1, fewest = 2 * margin + 1;
  const size_t all_block_stages = size_t(mc.layers) * size_t(per_block);
  const bool all_recomputed = recomputed_stages(cfg.recompute_blocks, all_block_stages, tiles) == all_block_stages;
  if (!few_layers || !all_recomputed || mc.layers <= fewest) {
    const FitTerms t = fit_terms(cfg, mc, tiles, world_size, efficient_logits);
    return t.explicit_state + t.working_set;
  }
  models::ModelConfig few = mc, fewer = mc;
  few.layers = fewest;
  fewer.layers = fewest - 1;
  const FitTerms a = fit_terms(cfg, few, tiles, world_size, efficient_logits);
  const uint64_t block_state = a.explicit_state - fit_terms(cfg, fewer, tiles, world_size, efficient_logits).explicit_state;
  const uint64_t more = uint64_t(mc.layers - fewest);
  // Every need counts the device checkpoints: one recomputed block's input per block.
  const uint64_t checkpoints = a.device_checkpoints / uint64_t(fewest) * uint64_t(mc.layers);
  return a.explicit_state + more * block_state + a.working_set - a.device_checkpoints + checkpoints;
}

bool tiles_fit(const EngineConfig& cfg, const models::ModelConfig& mc, const models::LayerTiles& tiles,
                 int world_size, uint64_t usable, bool efficient_logits) {
  return usable == UINT64_MAX || tiles_device_bytes(cfg, mc, tiles, world_size, efficient_logits) <= usable;
}

size_t transient_gradient_buffers(const layout::Schedule& schedule) { return 2 + schedule.shared_units(); }

int resolve_prefetch(const layout::MemoryModel& mm, const layout::Choices& choice, uint64_t base, uint64_t usable) {
  layout::Choices none_ahead = choice;
  none_ahead.prefetch = 0;
  const uint64_t fit = std::min<uint64_t>(
      {mm.prefetch_room(none_ahead, base, usable), uint64_t(kMaxAutoPrefetch), mm.schedule().uses().size() - 1});
  return int(std::max<uint64_t>(fit, 1));
}

Layout::Layout(UnitTable u, layout::ModelSizes sizes)
    : units(std::move(u)), schedule(units.schedule()), memory(schedule, std::move(sizes)) {}

Cut resolve_cut(const EngineConfig& cfg, const models::ModelConfig& mc, const MachineView& m) {
  const auto fits_with = [&](const models::LayerTiles& t, int64_t chunk, bool efficient_logits) {
    EngineConfig c = cfg;
    c.mlp_token_chunk = chunk;
    return tiles_fit(c, mc, t, m.world_size, m.usable_device, efficient_logits);
  };
  // The MLPs' token chunks first: the blocks' graphs, which every later test counts, depend on them.
  Cut cut;
  cut.mlp_token_chunk = resolve_mlp_token_chunk(
      cfg, mc, [&](const models::LayerTiles& t, int64_t chunk) { return fits_with(t, chunk, false); }, m.agree);
  cut.tiles = resolve_tiles(
      cfg, mc,
      [&](const models::LayerTiles& t, bool efficient_logits) {
        return fits_with(t, cut.mlp_token_chunk, efficient_logits);
      },
      m.agree);
  return cut;
}

std::unique_ptr<const Layout> resolve_layout(const EngineConfig& given, const models::ModelConfig& mc, const Cut& cut,
                                             const MachineView& m) {
  EngineConfig cfg = given;
  cfg.mlp_token_chunk = cut.mlp_token_chunk;
  CutModel c = cut_model(cfg, mc, cut.tiles, cut.mlp_token_chunk, m.world_size);
  // The head's tiles before the placement: the working set every later decision plans with
  // depends on them.
  const HeadCut head = resolve_head_tiles(cfg, c.schedule, c.sizes, c.choice, explicit_device_bytes(cfg, c.need),
                                          m.usable_device, m.agree);
  c.sizes.logits = head.logits;
  auto layout = std::make_unique<Layout>(std::move(c.units), std::move(c.sizes));
  layout->mlp_token_chunk = cut.mlp_token_chunk;
  layout->tiles = cut.tiles;
  layout->transient_buffers = c.transient_buffers;
  layout->need = std::move(c.need);
  layout->head = head;
  const layout::MemoryModel& memory = layout->memory;
  layout->placement =
      resolve_placement(cfg, memory, c.choice, layout->need, m.usable_device, m.budgets, m.agree, layout->report);
  layout->report += describe_tiles(cut.tiles, cut.mlp_token_chunk, memory);
  layout->head_report = "; head logits " + layout::describe(memory.head_logits(), memory.sizes().tokens, memory.sizes().vocab) +
                    " (" + format_bytes(memory.head_loss_bytes()) + " for the loss)";
  return layout;
}

std::unique_ptr<const Layout> resolve_layout(const EngineConfig& cfg, const models::ModelConfig& mc,
                                             const MachineView& machine) {
  return resolve_layout(cfg, mc, resolve_cut(cfg, mc, machine), machine);
}

WorkingSet resolve_working_set(const EngineConfig& cfg, const Layout& layout, const Allocated& held,
                                   const Agree& agree, const std::function<std::string(size_t)>& stage_name) {
  const layout::MemoryModel& memory = layout.memory;
  const models::LayerTiles& tiles = layout.tiles;
  const size_t blocks = layout.schedule.blocks();
  WorkingSet w;
  layout::Choices& choice = w.choice;
  choice = initial_choices(cfg, blocks, tiles);
  const uint64_t base = held.device_state, usable = held.usable_device;
  if (cfg.recompute_blocks == EngineConfig::kRecomputeAuto)
    choice.recomputed = resolve_recompute(memory, choice, base, usable, agree, size_t(tiles.block_stages()));
  // Reported in whole blocks, as placement.recompute counts them.
  const size_t recomputed = tiles.whole_blocks(choice.recomputed), whole_blocks = tiles.whole_blocks(blocks);
  w.report += "; recompute " + std::to_string(recomputed) + " of " + std::to_string(whole_blocks) + " blocks";
  if (recomputed < whole_blocks)
    w.report += " (the last " + std::to_string(whole_blocks - recomputed) + " keep their autograd graphs on the device, " +
                format_bytes(memory.block_graph_bytes(size_t(tiles.block_stages()))) + " each)";
  choice.activations = resolve_activations(cfg, memory, choice, base, usable, held.host_state, held.budgets, agree);
  w.report += std::string("; activation checkpoints ") + to_string(choice.activations) + " " +
              format_bytes(memory.checkpoint_bytes(choice)) + " a micro-batch";
  w.prefetch_auto = cfg.prefetch_auto;
  w.prefetch_deepest = cfg.prefetch;
  if (cfg.prefetch_auto) {
    // As many of the largest unit as fit beside the largest need; the tuner starts at one.
    w.prefetch_deepest = resolve_prefetch(memory, choice, base, usable);
    choice.prefetch = 1;
    w.report += "; prefetch auto (1 to " + std::to_string(w.prefetch_deepest) + " units ahead)";
  }
  check_working_set(cfg, memory, choice, base, held.budget, stage_name);
  return w;
}

WorkingSet predicted_working_set(const EngineConfig& cfg, const Layout& layout, uint64_t compute_bytes, uint64_t budget,
                                 uint64_t physical_free, uint64_t host_available, uint64_t nvme_free, int local_ranks,
                                 const Agree& agree, const std::function<std::string(size_t)>& stage_name) {
  const Allocated held = predicted_allocation(cfg, layout, compute_bytes, budget, physical_free, host_available,
                                              nvme_free, local_ranks);
  return resolve_working_set(cfg, layout, held, agree, stage_name);
}

}  // namespace strata::engine
