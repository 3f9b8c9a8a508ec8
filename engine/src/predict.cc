#include "strata/engine/predict.h"

#include <algorithm>
#include <stdexcept>

#include "resolve.h"
#include "strata/engine/partition.h"
#include "strata/models/model_shapes.h"

namespace strata::engine {

namespace {

uint64_t element_bytes(Precision p) { return p == Precision::kFp32 ? 4 : 2; }

}  // namespace

UnitPlan plan_units(const models::ModelConfig& mc, const models::LayerTiling& tiling, int world_size) {
  const std::vector<uint64_t> stage_numel = models::stage_parameters(mc, tiling);
  UnitPlan out;
  out.tiling = tiling;
  out.stage_units = models::stage_units(mc, tiling);
  std::vector<std::pair<std::string, std::vector<TensorSpec>>> specs;
  for (size_t s = 0; s < stage_numel.size(); ++s) {
    if (stage_numel[s] == 0) continue;  // a tied head tile: its embedding tile's unit
    const std::string name = "unit" + std::to_string(specs.size());
    specs.push_back({name, {TensorSpec{name, {int64_t(stage_numel[s])}, {}}}});
  }
  const Partition partition(specs, world_size);
  for (const UnitLayout& L : partition.units()) {
    out.unit_numel.push_back(L.numel);
    out.padded_numel.push_back(L.padded_numel());
    out.shard_numel.push_back(L.shard_numel);
  }
  out.input_widths = models::stage_input_widths(mc, tiling);
  out.vocab_tiles = size_t(tiling.vocab);
  return out;
}

plan::Schedule UnitPlan::schedule() const { return plan::Schedule(stage_units, unit_numel.size(), vocab_tiles, vocab_tiles); }

namespace {

plan::ModelSizes sizes_of(const EngineConfig& cfg, const models::ModelConfig& mc, const UnitPlan& units) {
  plan::ModelSizes sizes;
  sizes.padded_numel = units.padded_numel;
  sizes.shard_numel = units.shard_numel;
  sizes.input_widths = units.input_widths;
  sizes.mlp_chunked = cfg.mlp_token_chunk > 0;
  sizes.compute_bytes = element_bytes(cfg.compute);
  sizes.reduce_bf16 = cfg.reduce == Precision::kBf16;
  sizes.tokens = uint64_t(cfg.micro_batch * cfg.seq_len);
  sizes.hidden = uint64_t(mc.hidden);
  sizes.vocab = uint64_t(mc.vocab_size);
  for (uint64_t per_token : models::stage_graph_bytes_per_token(mc, units.tiling, sizes.compute_bytes, sizes.mlp_chunked))
    sizes.graph_bytes.push_back(sizes.tokens * per_token);
  sizes.vocab_tiles = units.vocab_tiles;
  return sizes;
}

}  // namespace

bool tiling_fits(const EngineConfig& cfg, const models::ModelConfig& mc, const models::LayerTiling& tiling,
                 int world_size, uint64_t usable, bool efficient_logits) {
  if (usable == UINT64_MAX) return true;
  const UnitPlan units = plan_units(mc, tiling, world_size);
  const plan::Schedule schedule = units.schedule();
  plan::ModelSizes sizes = sizes_of(cfg, mc, units);
  const uint64_t most_auto = plan::max_auto_logits_tiles(sizes.tokens, sizes.vocab),
                 most_efficient = plan::max_efficient_logits_tiles(sizes.tokens, sizes.vocab);
  // Where the efficient cap is no cap (small logits), the two tests are one.
  if (most_efficient >= most_auto) efficient_logits = false;
  const uint64_t most_logits_tiles = efficient_logits ? most_efficient : most_auto;
  sizes.logits = plan::logits_tiling(sizes.tokens, sizes.vocab,
                                     cfg.head_tiles != EngineConfig::kTilesAuto ? cfg.head_tiles
                                                                                : std::max<uint64_t>(1, most_logits_tiles));
  plan::Choices choice;
  const size_t blocks = schedule.blocks();
  choice.recomputed = recomputed_stages(cfg.recompute_blocks, blocks, tiling);
  choice.activations = cfg.activations;
  // Gathering ahead is opportunistic: construction checks each use's need alone. The efficient
  // test makes resolve_head_tiles' own test (the configured prefetch window), so that a cut it
  // accepts leaves the head a count within max_efficient_logits_tiles.
  choice.prefetch = efficient_logits ? cfg.prefetch : 0;
  const StateBytes need = state_bytes(units.shard_numel, sizes.compute_bytes, 2 + schedule.shared_units());
  return explicit_device_bytes(cfg, need) + plan::MemoryModel(schedule, sizes).working_set(choice) <= usable;
}

StatePrediction predict_state(const EngineConfig& given, const models::ModelConfig& mc, int world_size,
                              const MachineShare& machine) {
  given.validate();
  mc.validate();
  StatePrediction out;
  const Agree same = [](const std::vector<int64_t>& v) { return v; };
  const uint64_t usable = machine.device;
  // The MLPs' token chunks, then the blocks' tiles: the units depend on them. Counts that do not
  // cut this model are a configuration that does not fit, not an error of the prediction. From
  // here on `cfg` is the configuration with the chunks resolved.
  EngineConfig cfg = given;
  try {
    cfg.mlp_token_chunk = resolve_mlp_token_chunk(
        given, mc,
        [&](const models::LayerTiling& t, int64_t chunk) {
          EngineConfig c = given;
          c.mlp_token_chunk = chunk;
          return tiling_fits(c, mc, t, world_size, usable, false);
        },
        same);
    out.mlp_token_chunk = cfg.mlp_token_chunk;
    out.tiles = resolve_tiles(
        cfg, mc,
        [&](const models::LayerTiling& t, bool efficient_logits) {
          return tiling_fits(cfg, mc, t, world_size, usable, efficient_logits);
        },
        same);
  } catch (const std::invalid_argument& e) {
    out.fits = false;
    out.error = e.what();
    return out;
  }
  const UnitPlan units = plan_units(mc, out.tiles, world_size);
  out.stage_units = units.stage_units;
  out.unit_numel = units.unit_numel;
  out.padded_numel = units.padded_numel;
  out.shard_numel = units.shard_numel;
  const plan::Schedule schedule = units.schedule();
  out.compute_bytes = element_bytes(cfg.compute);
  plan::ModelSizes sizes = sizes_of(cfg, mc, units);
  out.graph_bytes = plan::MemoryModel(schedule, sizes).block_graph_bytes(size_t(out.tiles.block_stages()));
  const size_t blocks = schedule.blocks();

  // From here on, construction's order (construct.cc).
  plan::Choices& choice = out.choice;
  choice.recomputed = recomputed_stages(cfg.recompute_blocks, blocks, out.tiles);
  choice.activations = cfg.activations;
  choice.prefetch = cfg.prefetch;
  const size_t transient_limit = 2 + schedule.shared_units();
  const StateBytes need = state_bytes(out.shard_numel, out.compute_bytes, transient_limit);
  const auto budgets = [&](uint64_t device) {
    return budgets_from(cfg, device, machine.host_available, machine.nvme_free, machine.local_ranks);
  };
  out.budgets = budgets(usable);
  try {
    const uint64_t explicit_on_device = explicit_device_bytes(cfg, need);
    const HeadCut head_cut = resolve_head_tiles(cfg, schedule, sizes, choice, explicit_on_device, usable, same);
    out.head_tiles = head_cut.count;
    out.head_one_pass = head_cut.logits.one_pass;
    sizes.logits = head_cut.logits;
    const plan::MemoryModel memory(schedule, sizes);
    out.head_logits = memory.head_logits();
    out.placement = resolve_placement(cfg, memory, choice, need, usable, budgets, same, out.report);
    out.report += describe_tiles(out.tiles, cfg.mlp_token_chunk, memory);
    const TierBytes tiers = bytes_by_tier(out.placement, need, out.compute_bytes);
    out.device_state = tiers.device;
    out.host_state = tiers.host;
    out.nvme_state = tiers.swap;
    const uint64_t base = tiers.device;
    const uint64_t room = plan::MemoryModel::usable_device(usable, base, UINT64_MAX);
    if (cfg.recompute_blocks == EngineConfig::kRecomputeAuto)
      choice.recomputed = resolve_recompute(memory, choice, base, room, same, size_t(out.tiles.block_stages()));
    // A run measures the machine's budgets for checkpoints once its state is allocated: a derived
    // host budget has the host state taken out already.
    const uint64_t allocated = uint64_t(std::max(1, machine.local_ranks)) * tiers.host;
    const TierBudgets after_state = budgets_from(cfg, 0, machine.host_available - std::min(machine.host_available, allocated),
                                                 machine.nvme_free, machine.local_ranks);
    choice.activations = resolve_activations(cfg, memory, choice, base, room, tiers.host, after_state, same);
    out.checkpoint_bytes = memory.checkpoint_bytes(choice);
    if (cfg.prefetch_auto) {
      plan::Choices none_ahead = choice;
      none_ahead.prefetch = 0;
      const uint64_t fit = std::min<uint64_t>({memory.prefetch_room(none_ahead, base, room), 8,
                                               schedule.uses().size() - 1});
      out.prefetch_deepest = int(std::max<uint64_t>(fit, 1));
      choice.prefetch = 1;
    } else {
      out.prefetch_deepest = cfg.prefetch;
    }
    out.working_set = memory.working_set(choice);
    check_working_set(cfg, memory, choice, base, usable,
                      [&](size_t s) { return models::stage_name(mc, out.tiles, s); });
    out.fits = true;
  } catch (const std::exception& e) {
    out.fits = false;
    out.error = e.what();
  }
  return out;
}

}  // namespace strata::engine
