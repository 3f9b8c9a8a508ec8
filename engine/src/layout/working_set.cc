// The working set's steps of the resolution (layout/resolve.h, phase two): the choices a run
// starts from, recompute, the activation checkpoints' tier, what a prediction counts as
// allocated, and the budget check of every use.
#include "strata/engine/layout/resolve.h"

#include <algorithm>
#include <stdexcept>

#include "strata/engine/bytes.h"

namespace strata::engine {

layout::Choices initial_choices(const EngineConfig& cfg, size_t block_stages, const models::LayerTiles& tiles) {
  layout::Choices choice;
  choice.recomputed = recomputed_stages(cfg.recompute_blocks, block_stages, tiles);
  choice.activations = cfg.activations;
  choice.prefetch = cfg.prefetch;
  return choice;
}

size_t recomputed_stages(int recompute_blocks, size_t block_stages, const models::LayerTiles& tiles) {
  if (recompute_blocks == EngineConfig::kRecomputeAuto) return block_stages;
  const size_t per_block = size_t(std::max<int64_t>(1, tiles.block_stages()));
  return std::min(block_stages, size_t(std::max(0, recompute_blocks)) * per_block);
}

size_t resolve_recompute(const layout::MemoryModel& mm, const layout::Choices& choice, uint64_t base, uint64_t usable,
                         const Agree& agree, size_t stages_per_block) {
  const size_t stages = mm.schedule().blocks(), step = std::max<size_t>(1, stages_per_block);
  size_t keep = 0;  // block stages that keep their graphs: the last ones, whole blocks at a time
  for (size_t k = step; k <= stages; k += step) {
    layout::Choices c = choice;
    c.recomputed = stages - k;
    if (base + mm.working_set(c) > usable) break;
    keep = k;
  }
  // Every rank recomputes as many as any rank must: their gathers must stay in step.
  return size_t(agree({int64_t(stages - keep)})[0]);
}

Placement resolve_activations(const EngineConfig& cfg, const layout::MemoryModel& mm, const layout::Choices& choice,
                              uint64_t base, uint64_t usable, uint64_t host_state, const TierBudgets& budgets,
                              const Agree& agree) {
  if (cfg.activations != Placement::kAuto) return cfg.activations;
  layout::Choices on_device = choice;
  on_device.activations = Placement::kDevice;
  Placement p = Placement::kHost;
  const uint64_t all = mm.checkpoint_bytes(choice);
  if (base + mm.working_set(on_device) <= usable) p = Placement::kDevice;
  // A configured host budget covers the host state too; a derived one is what is free now.
  else if ((cfg.host_budget ? host_state + all : all) <= budgets.host || cfg.nvme_dirs.empty()) p = Placement::kHost;
  else p = Placement::kNvme;
  // Every rank takes the slowest tier any rank chose.
  return Placement(agree({int64_t(p)})[0]);
}

Allocated predicted_allocation(const EngineConfig& cfg, const Layout& layout, uint64_t compute_bytes, uint64_t budget,
                               uint64_t physical_free, uint64_t host_available, uint64_t nvme_free, int local_ranks) {
  const TierBytes tiers = bytes_by_tier(layout.placement, layout.need, compute_bytes);
  Allocated held;
  held.device_state = tiers.device;
  const uint64_t free_after = physical_free == UINT64_MAX ? UINT64_MAX : physical_free - std::min(physical_free, tiers.device);
  held.usable_device = layout::MemoryModel::usable_device(budget, tiers.device, free_after);
  held.budget = budget;
  held.host_state = tiers.host;
  const uint64_t allocated = uint64_t(std::max(1, local_ranks)) * tiers.host;
  held.budgets = budgets_from(cfg, 0, host_available - std::min(host_available, allocated), nvme_free, local_ranks);
  return held;
}

void check_working_set(const EngineConfig& cfg, const layout::MemoryModel& mm, const layout::Choices& choice,
                       uint64_t base, uint64_t budget, const std::function<std::string(size_t)>& stage_name) {
  for (const layout::Use& use : mm.schedule().uses()) {
    const uint64_t need = mm.need(use, choice);
    if (base + need <= budget) continue;
    // What the use holds beside its parameters: the scratch every use counts, or its own with its
    // graph, the larger (MemoryModel::need).
    const uint64_t graph = mm.running_graph(use, choice),
                   scratch = std::max(mm.scratch(choice), mm.running_scratch(use, choice)),
                   checkpoints = mm.device_checkpoints(choice), held = mm.held_at(use, choice);
    std::string remedies = "raise device.budget";
    const auto add = [&](const std::string& r) { remedies += ", " + r; };
    if (scratch > 0)
      add("lower batch.micro_batch or data.seq_len (the activations of " + std::to_string(cfg.micro_batch) + " x " +
          std::to_string(cfg.seq_len) + " = " + std::to_string(cfg.micro_batch * cfg.seq_len) +
          " tokens a micro-batch are part of the " + format_bytes(scratch) + ")");
    const layout::ModelSizes& sz = mm.sizes();
    const layout::LogitsTiles logits = mm.head_logits();
    const uint64_t head_loss = mm.head_loss_bytes();
    // (Without vocabulary tiles the head holds its loss or its gradient buffers, the larger: a
    // finer cut helps only while the loss is the larger.)
    const bool loss_binds = mm.schedule().vocab_tiled() || head_loss > mm.head_gradient_bytes();
    if (loss_binds && 2 * head_loss > scratch && logits.tiles(sz.tokens, sz.vocab) < sz.tokens * sz.vocab)
      // No ", " inside a remedy: the last one before the final remedy becomes " or ".
      add("cut the head's logits into more tiles (placement.tiling; the head's loss takes " + format_bytes(head_loss) +
          " of the " + format_bytes(scratch) + " " +
          (logits.tiled(sz.tokens, sz.vocab) ? "in " + layout::describe(logits, sz.tokens, sz.vocab) : "untiled") +
          ")");
    const layout::Schedule& schedule = mm.schedule();
    // Where the scratch's largest part comes from: this use when its own (with its graph) wins.
    const layout::Use& source = mm.running_scratch(use, choice) >= mm.scratch(choice) ? use : mm.largest_scratch_use();
    const char* kinds[] = {"forward", "head", "backward"};
    const std::string scratch_source =
        source.stage == use.stage && source.kind == use.kind
            ? ""
            : " (the largest, of unit " + stage_name(source.stage) + "'s " + kinds[source.kind] + ")";
    // (Only while the vocabulary can be cut further: a tile is at least one row.)
    const bool can_cut_vocabulary = schedule.first_block() < sz.vocab;
    const bool vocabulary = can_cut_vocabulary && !schedule.is_block(use.stage),
               source_vocabulary = can_cut_vocabulary && !schedule.is_block(source.stage);
    if (vocabulary && 4 * mm.use_bytes(use) > need)
      add("cut the vocabulary into more tiles (placement.tiling \"vocab\"; this unit's parameters take " +
          format_bytes(mm.use_bytes(use)) + ")");
    else if (source_vocabulary && source.kind != layout::Use::kForward && 4 * scratch > need &&
             mm.use_bytes(source) > head_loss)
      add("cut the vocabulary into more tiles (placement.tiling \"vocab\"; the gradient buffers of unit " +
          stage_name(source.stage) + "'s backward are part of the " + format_bytes(scratch) + ")");
    if (schedule.is_block(use.stage) && 4 * mm.use_bytes(use) > need)
      add("cut the blocks into more tiles (placement.tiling \"attention\" and \"mlp\"; this unit's parameters take " +
          format_bytes(mm.use_bytes(use)) + ")");
    else if (schedule.is_block(source.stage) && source.kind == layout::Use::kBackward && 4 * scratch > need)
      // A block's gradient buffers (its units' full size in fp32) make the scratch every use counts.
      add("cut the blocks into more tiles (placement.tiling \"attention\" and \"mlp\"; the gradient buffers of unit " +
          stage_name(source.stage) + "'s backward are part of the " + format_bytes(scratch) + ")");
    if (4 * graph > need)
      add("cut the blocks into more tiles or run the MLPs over token chunks (placement.tiling \"attention\"/\"mlp\"/"
          "\"mlp_tokens\"; this unit's autograd graph takes " + format_bytes(graph) + ")");
    if (checkpoints > 0) add("place activation checkpoints on the host (placement.activations)");
    if (held > 0) add("recompute more blocks (placement.recompute)");
    if (base > 0) add("place state on the host (the placement of params, grads, master and moments)");
    const size_t comma = remedies.rfind(", ");
    if (comma != std::string::npos) remedies.replace(comma, 2, " or ");
    throw BudgetExceeded("device budget " + format_bytes(budget) + " cannot run unit " + stage_name(use.stage) +
                         ": it needs " + format_bytes(need) + " (parameters " + format_bytes(mm.use_bytes(use)) +
                         ", activations and gradient buffers " + format_bytes(scratch) + scratch_source +
                         (graph > 0 ? " with its autograd graph " + format_bytes(graph) : std::string()) +
                         ", activation checkpoints on the device " + format_bytes(checkpoints) +
                         ", blocks kept without recompute " + format_bytes(held) + ") beside " + format_bytes(base) +
                         " of device-placed state; " + remedies);
  }
}

}  // namespace strata::engine
