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

StatePrediction predict_state(const EngineConfig& cfg, const models::ModelConfig& mc, int world_size,
                              const MachineShare& machine) {
  cfg.validate();
  mc.validate();
  StatePrediction out;
  // The units the engine builds: one per stage, each owning its stage's parameters; the head
  // also uses the embedding's unit when the embeddings are tied.
  const std::vector<uint64_t> stage_numel = models::stage_parameters(mc);
  std::vector<std::pair<std::string, std::vector<TensorSpec>>> specs;
  for (size_t s = 0; s < stage_numel.size(); ++s)
    specs.push_back({"unit" + std::to_string(s), {TensorSpec{"unit" + std::to_string(s), {int64_t(stage_numel[s])}}}});
  const Partition partition(specs, world_size);
  out.stage_units.resize(stage_numel.size());
  for (size_t s = 0; s < stage_numel.size(); ++s) out.stage_units[s].push_back(s);
  if (mc.tie_embeddings) out.stage_units.back().push_back(0);
  const plan::Schedule schedule(out.stage_units, partition.num_units());

  out.compute_bytes = element_bytes(cfg.compute);
  plan::ModelSizes sizes;
  for (const UnitLayout& L : partition.units()) {
    out.unit_numel.push_back(L.numel);
    out.padded_numel.push_back(L.padded_numel());
    out.shard_numel.push_back(L.shard_numel);
  }
  sizes.padded_numel = out.padded_numel;
  sizes.shard_numel = out.shard_numel;
  sizes.compute_bytes = out.compute_bytes;
  sizes.reduce_bf16 = cfg.reduce == Precision::kBf16;
  sizes.tokens = uint64_t(cfg.micro_batch * cfg.seq_len);
  sizes.hidden = uint64_t(mc.hidden);
  sizes.vocab = uint64_t(mc.vocab_size);
  sizes.graph_bytes = out.graph_bytes = sizes.tokens * models::block_graph_bytes_per_token(mc, out.compute_bytes);
  const size_t blocks = schedule.blocks();

  // From here on, construction's order (construct.cc).
  plan::Choices& choice = out.choice;
  choice.recomputed = cfg.recompute_blocks == EngineConfig::kRecomputeAuto
                          ? blocks
                          : std::min(blocks, size_t(cfg.recompute_blocks));
  choice.params_staged = cfg.params != Placement::kDevice;
  choice.activations = cfg.activations;
  choice.prefetch = cfg.prefetch;
  const size_t transient_limit = 2 + schedule.shared_units();
  const StateBytes need = state_bytes(out.shard_numel, out.compute_bytes, transient_limit);
  const Agree same = [](const std::vector<int64_t>& v) { return v; };
  const uint64_t usable = machine.device;
  const auto budgets = [&](uint64_t device) {
    return budgets_from(cfg, device, machine.host_available, machine.nvme_free, machine.local_ranks);
  };
  out.budgets = budgets(usable);
  try {
    const uint64_t explicit_on_device =
        (cfg.params == Placement::kDevice ? need.params : 0) + (cfg.grads == Placement::kDevice ? need.grads : 0) +
        (cfg.master == Placement::kDevice ? need.master + need.moments : 0);
    out.head_tiles = resolve_head_tiles(cfg, schedule, sizes, choice, explicit_on_device, usable, same);
    sizes.logits = plan::logits_tiling(sizes.tokens, sizes.vocab, out.head_tiles);
    const plan::MemoryModel memory(schedule, sizes);
    out.placement = resolve_placement(cfg, memory, choice, need, usable, budgets, same, out.report);
    choice.params_staged = out.placement.params != Placement::kDevice;
    const TierBytes tiers = bytes_by_tier(out.placement, need, out.compute_bytes);
    out.device_state = tiers.device;
    out.host_state = tiers.host;
    out.nvme_state = tiers.swap;
    const uint64_t base = tiers.device;
    const uint64_t room = plan::MemoryModel::usable_device(usable, base, UINT64_MAX);
    if (cfg.recompute_blocks == EngineConfig::kRecomputeAuto)
      choice.recomputed = resolve_recompute(memory, choice, base, room, same);
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
    const size_t units = out.shard_numel.size();
    check_working_set(cfg, memory, choice, base, usable, [units](size_t u) {
      return u == 0 ? std::string("embedding") : u + 1 == units ? std::string("head") : "block." + std::to_string(u - 1);
    });
    out.fits = true;
  } catch (const std::exception& e) {
    out.fits = false;
    out.error = e.what();
  }
  return out;
}

}  // namespace strata::engine
