#include "strata/engine/predict.h"

#include <algorithm>
#include <memory>
#include <stdexcept>

#include "strata/engine/layout/resolve.h"
#include "strata/models/model_shapes.h"

namespace strata::engine {

StatePrediction predict_state(const EngineConfig& cfg, const models::ModelConfig& mc, int world_size,
                              const MachineShare& machine) {
  cfg.validate();
  mc.validate();
  StatePrediction out;
  const Agree same = [](const std::vector<int64_t>& v) { return v; };
  const uint64_t usable = machine.device;
  const auto budgets = [&](uint64_t device) {
    return budgets_from(cfg, device, machine.host_available, machine.nvme_free, machine.local_ranks);
  };
  const MachineView view{world_size, usable, budgets, same};
  // Counts that do not cut this model are a configuration that does not fit, not an error of
  // the prediction.
  Cut cut;
  try {
    cut = resolve_cut(cfg, mc, view);
  } catch (const std::invalid_argument& e) {
    out.fits = false;
    out.error = e.what();
    return out;
  }
  out.mlp_token_chunk = cut.mlp_token_chunk;
  out.tiles = cut.tiles;
  // What the cut alone says, for a configuration that goes on not to fit.
  {
    const CutModel c = cut_model(cfg, mc, cut.tiles, cut.mlp_token_chunk, world_size);
    out.stage_units = c.units.stage_units;
    out.unit_numel = c.units.unit_numel;
    out.padded_numel = c.units.padded_numel;
    out.shard_numel = c.units.shard_numel;
    out.frozen = c.units.frozen;
    out.dequantized = c.units.dequantized;
    out.compute_bytes = c.sizes.compute_bytes;
    out.graph_bytes = layout::MemoryModel(c.schedule, c.sizes).block_graph_bytes(size_t(cut.tiles.block_stages()));
    out.choice = c.choice;
  }
  out.budgets = budgets(usable);
  try {
    const std::unique_ptr<const Layout> layout = resolve_layout(cfg, mc, cut, view);
    out.head_tiles = layout->head.count;
    out.head_one_pass = layout->head.logits.one_pass;
    out.head_logits = layout->memory.head_logits();
    out.placement = layout->placement;
    out.report = layout->report;
    const TierBytes tiers = bytes_by_tier(layout->placement, layout->need, out.compute_bytes);
    out.device_state = tiers.device;
    out.host_state = tiers.host;
    out.nvme_state = tiers.nvme;
    // What a run measures once its state is allocated: the device room beside it, and the RAM
    // left once every local rank's host state is allocated (a derived host budget has it taken out).
    const WorkingSet working =
        predicted_working_set(cfg, *layout, out.compute_bytes, usable, UINT64_MAX, machine.host_available,
                              machine.nvme_free, machine.local_ranks, same,
                              [&](size_t s) { return models::stage_name(mc, cut.tiles, s); });
    out.choice = working.choice;
    out.prefetch_deepest = working.prefetch_deepest;
    out.checkpoint_bytes = layout->memory.checkpoint_bytes(out.choice);
    out.working_set = layout->memory.working_set(out.choice);
    out.fits = true;
  } catch (const std::exception& e) {
    out.fits = false;
    out.error = e.what();
  }
  return out;
}

}  // namespace strata::engine
