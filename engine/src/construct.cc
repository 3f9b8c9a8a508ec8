// Building the engine: partition, schedule and memory model; placement, recompute, activation
// checkpoints and prefetch resolved (resolve.h; ranks agreeing through agreement()); the parts
// built and the state placed unit by unit. The configuration is never changed: `effective`
// shows what was resolved.
#include "engine_impl.h"
#include "strata/engine/cpu_share.h"
#include "strata/engine/predict.h"

#include <optional>

namespace strata::engine {

Engine::Impl::Impl(std::unique_ptr<models::Decoder> m, const EngineConfig& c, Communicator& cm, Device& d)
    : cfg(c), comm(cm), dev(d), model(std::move(m)), host(d) {
  cfg.validate();
  cdt = scalar_type(cfg.compute);
  loss_scale = cfg.compute == Precision::kFp16 ? cfg.initial_loss_scale : 1.0;
  exec.threads = cfg.cpu_threads ? cfg.cpu_threads : cpu_threads_per_rank(local_ranks());
  const models::ModelConfig& mc = model->config();
  // The MLPs' token chunks, then the blocks' tiles: the units are built from the stages they make.
  const auto tiling_fits_with = [&](const models::LayerTiling& t, int64_t chunk, bool efficient_logits) {
    EngineConfig c = cfg;
    c.mlp_token_chunk = chunk;
    return tiling_fits(c, mc, t, comm.world_size(), usable_device(), efficient_logits);
  };
  mlp_chunk = resolve_mlp_token_chunk(
      cfg, mc, [&](const models::LayerTiling& t, int64_t chunk) { return tiling_fits_with(t, chunk, false); },
      agreement());
  tiles = resolve_tiles(
      cfg, mc,
      [&](const models::LayerTiling& t, bool efficient_logits) { return tiling_fits_with(t, mlp_chunk, efficient_logits); },
      agreement());
  model->set_tiling(tiles);
  model->set_mlp_token_chunk(mlp_chunk);
  stages = model->stages();

  // A unit for each stage that owns parameters (a tied head tile after the first owns none);
  // each unit's tensors are the ones its stage owns (tied weights once), a tile's as parts of
  // the model's tensors.
  std::vector<std::pair<std::string, std::vector<TensorSpec>>> specs;
  std::unordered_map<const void*, std::pair<size_t, size_t>> owner;  // impl -> (unit, slot)
  std::vector<std::vector<at::Tensor>> owned;  // by unit
  std::vector<std::optional<size_t>> own_unit(stages.size());
  for (size_t s = 0; s < stages.size(); ++s) {
    stage_names.push_back(model->stage_name(s));
    const auto named = stages[s]->hf_parameters();
    if (named.empty()) continue;
    own_unit[s] = unit_stage.size();
    unit_stage.push_back(s);
    owned.emplace_back();
    std::vector<TensorSpec> ts;
    for (size_t k = 0; k < named.size(); ++k) {
      const auto& [name, t] = named[k];
      if (t.scalar_type() != at::kFloat || !t.device().is_cpu())
        throw std::invalid_argument("Engine: parameter " + name + " must be fp32 on the CPU");
      owner[t.unsafeGetTensorImpl()] = {*own_unit[s], ts.size()};
      const models::TensorPart& part = stages[s]->parts().at(k);
      TensorOrigin origin;
      if (!part.whole()) origin = {part.tensor, part.shape, part.dim, part.begin};
      ts.push_back({name, t.sizes().vec(), std::move(origin)});
      owned.back().push_back(t);
    }
    specs.emplace_back(stage_names[s], std::move(ts));
  }
  partition = std::make_unique<Partition>(specs, comm.world_size());
  std::vector<std::vector<runtime::GradientReducer::ParamRef>> stage_params(stages.size());
  std::vector<std::vector<size_t>> units_of(stages.size());
  for (size_t s = 0; s < stages.size(); ++s) {
    if (own_unit[s]) units_of[s].push_back(*own_unit[s]);
    for (const at::Tensor& p : stages[s]->parameters()) {
      auto it = owner.find(p.unsafeGetTensorImpl());
      if (it == owner.end())
        throw std::invalid_argument("Engine: stage " + stage_names[s] + " uses a parameter no stage owns");
      stage_params[s].push_back({p, it->second.first, it->second.second});
      if (std::find(units_of[s].begin(), units_of[s].end(), it->second.first) ==
          units_of[s].end())
        units_of[s].push_back(it->second.first);
    }
  }
  // The schedule of one micro-batch: forward over embedding and blocks, the head, backward.
  schedule = std::make_unique<plan::Schedule>(std::move(units_of), partition->num_units(), size_t(tiles.vocab),
                                              size_t(tiles.vocab));
  // Transient gradient buffers: the multi-use units' held ones (a tied embedding) plus two.
  transient_limit = 2 + schedule->shared_units();

  plan::ModelSizes sizes;
  for (const UnitLayout& L : partition->units()) {
    sizes.padded_numel.push_back(L.padded_numel());
    sizes.shard_numel.push_back(L.shard_numel);
  }
  sizes.compute_bytes = c10::elementSize(cdt);
  sizes.reduce_bf16 = cfg.reduce == Precision::kBf16;
  sizes.tokens = uint64_t(cfg.micro_batch * cfg.seq_len);
  sizes.hidden = uint64_t(mc.hidden);
  sizes.vocab = uint64_t(mc.vocab_size);
  for (uint64_t per_token : models::stage_graph_bytes_per_token(mc, tiles, sizes.compute_bytes, mlp_chunk > 0))
    sizes.graph_bytes.push_back(sizes.tokens * per_token);
  sizes.input_widths = models::stage_input_widths(mc, tiles);
  sizes.mlp_chunked = mlp_chunk > 0;
  sizes.vocab_tiles = uint64_t(tiles.vocab);
  const size_t blocks = schedule->blocks();
  // "auto" decides below, once the state is allocated; until then the working set assumes
  // every block is recomputed.
  choice.recomputed = recomputed_stages(cfg.recompute_blocks, blocks, tiles);
  choice.activations = cfg.activations;
  choice.prefetch = cfg.prefetch;

  std::vector<uint64_t> shard_numel;
  for (const UnitLayout& L : partition->units()) shard_numel.push_back(L.shard_numel);
  const StateBytes need = state_bytes(shard_numel, c10::elementSize(cdt), transient_limit);
  // The head's tiles first: the working set every later decision plans with depends on them.
  const uint64_t explicit_on_device = explicit_device_bytes(cfg, need);
  const HeadCut head_cut = resolve_head_tiles(cfg, *schedule, sizes, choice, explicit_on_device, usable_device(), agreement());
  head_tiles = head_cut.count;
  sizes.logits = head_cut.logits;
  memory = std::make_unique<plan::MemoryModel>(*schedule, std::move(sizes));
  const PlacementPlan resolved = resolve_placement(
      cfg, *memory, choice, need, usable_device(),
      [this](uint64_t device) { return machine_budgets(cfg, device, local_ranks()); }, agreement(), placement_report);
  placement_report += describe_tiles(tiles, mlp_chunk, *memory);
  placement_report += "; head logits " + plan::describe(memory->head_logits(), memory->sizes().tokens,
                                                        memory->sizes().vocab) +
                      " (" + format_bytes(memory->head_loss_bytes()) + " for the loss)";
  const bool grads_transient = resolved.grads_transient;
  // The second parameter group: each unit's shard ranges exempt from weight decay.
  std::vector<runtime::Optimizer::Ranges> no_decay(partition->num_units());
  for (size_t u = 0; u < partition->num_units(); ++u) {
    const UnitLayout& L = partition->unit(u);
    const uint64_t lo = L.shard_begin(comm.rank()), hi = lo + L.shard_numel;
    for (const TensorSlot& t : L.tensors) {
      const uint64_t b = std::max(lo, t.offset), e = std::min(hi, t.offset + t.numel);
      if (b < e && exempt_from_weight_decay(t, cfg)) no_decay[u].emplace_back(b - lo, e - lo);
    }
  }
  if (cfg.plan_only) {
    state = std::make_unique<state::StateStore>(*partition, cdt, resolved, dev, host, nullptr, prof);
    optimizer = std::make_unique<runtime::Optimizer>(*state, host, dev, exec, cfg.nvme_chunk_bytes);
    // The run's own test, with the device-placed state it would allocate.
    check_working_set(cfg, *memory, choice, planned_device_bytes(resolved, need, c10::elementSize(cdt)),
                      dev.budget(), [this](size_t s) { return stage_names.at(s); });
    placement_report += "; plan only (recompute and activation checkpoints are decided once the state is allocated)";
    effective = effective_config(cfg, {resolved, choice, head_tiles, tiles, placement_report,
                                       memory->sizes().logits.one_pass, mlp_chunk});
    return;
  }

  if (resolved.master == Placement::kNvme || resolved.grads == Placement::kNvme ||
      resolved.params == Placement::kNvme || cfg.activations == Placement::kNvme)
    open_swap();
  state = std::make_unique<state::StateStore>(*partition, cdt, resolved, dev, host, swap.get(), prof);
  optimizer = std::make_unique<runtime::Optimizer>(*state, host, dev, exec, cfg.nvme_chunk_bytes, std::move(no_decay));

  params = std::make_unique<runtime::ParameterCoordinator>(*schedule, *memory, choice, *partition, *state, host, dev,
                                                           comm, prof, [this](size_t u) { wait_updated(u); });
  // This rank's slices of the initial weights.
  const int rank = comm.rank();
  for (size_t u = 0; u < partition->num_units(); ++u) {
    const UnitLayout& L = partition->unit(u);
    model->initialize_through(unit_stage[u]);  // a deferred-init model materializes one unit at a time
    std::vector<at::Tensor> parts;
    for (const at::Tensor& t : owned[u]) parts.push_back(t.detach().reshape(-1));
    if (L.padded_numel() > L.numel) parts.push_back(at::zeros({int64_t(L.padded_numel() - L.numel)}));
    at::Tensor flat = at::cat(parts);
    state->allocate(u, flat.narrow(0, int64_t(L.shard_begin(rank)), int64_t(L.shard_numel)), grads_transient);
    params->adopt(u, owned[u]);  // the model's copy of the unit goes now, not after the last unit
    if (cfg.on_unit_placed) cfg.on_unit_placed(u + 1, partition->num_units());
  }

  updater = std::make_unique<runtime::Updater>(*optimizer, *state, *schedule, *partition, dev, prof, host,
                                               grads_transient ? transient_limit : 0, largest_shard());
  reducer = std::make_unique<runtime::GradientReducer>(*schedule, *partition, *state, host, dev, comm, prof,
                                                       cfg.reduce == Precision::kBf16, std::move(stage_params),
                                                       [this](size_t u) { updater->take_gradient_buffer(u); });

  base_bytes = dev.used();
  params->set_device_state_bytes(base_bytes);
  if (cfg.recompute_blocks == EngineConfig::kRecomputeAuto)
    choice.recomputed =
        resolve_recompute(*memory, choice, base_bytes, usable_device(), agreement(), size_t(tiles.block_stages()));
  // Reported in whole blocks, as placement.recompute counts them.
  const size_t recomputed = tiles.whole_blocks(choice.recomputed), whole_blocks = tiles.whole_blocks(blocks);
  placement_report += "; recompute " + std::to_string(recomputed) + " of " + std::to_string(whole_blocks) + " blocks";
  if (recomputed < whole_blocks)
    placement_report += " (the last " + std::to_string(whole_blocks - recomputed) +
                        " keep their autograd graphs on the device, " +
                        format_bytes(memory->block_graph_bytes(size_t(tiles.block_stages()))) + " each)";
  place_activations();
  params->set_depth(cfg.prefetch);
  if (cfg.prefetch_auto) {
    // As many of the largest unit as fit beside the largest need, up to 8 and the schedule.
    plan::Choices none_ahead = choice;
    none_ahead.prefetch = 0;
    const uint64_t fit = std::min<uint64_t>({memory->prefetch_room(none_ahead, base_bytes, usable_device()), 8,
                                             uses().size() - 1});
    prefetch_tuner.deepest = int(std::max<uint64_t>(fit, 1));
    params->set_depth(prefetch_tuner.depth = 1);
    choice.prefetch = 1;
    placement_report += "; prefetch auto (1 to " + std::to_string(prefetch_tuner.deepest) + " units ahead)";
  }
  check_working_set(cfg, *memory, choice, base_bytes, dev.budget(),
                    [this](size_t s) { return stage_names.at(s); });
  effective = effective_config(cfg, {state->plan(), choice, head_tiles, tiles, placement_report,
                                     memory->sizes().logits.one_pass, mlp_chunk});
}

void Engine::Impl::place_activations() {
  choice.activations = resolve_activations(cfg, *memory, choice, base_bytes, usable_device(), host.state_bytes(),
                                           machine_budgets(cfg, 0, local_ranks()), agreement());
  if (choice.activations == Placement::kNvme) open_swap();
  std::vector<std::vector<int64_t>> shapes;  // a stage's input: one activation, or two stacked (a block tile's)
  for (uint64_t w : memory->sizes().input_widths) {
    shapes.push_back({cfg.micro_batch, cfg.seq_len, model->config().hidden});
    if (w > 1) shapes.back().insert(shapes.back().begin(), int64_t(w));
  }
  std::vector<size_t> checkpointed_stages;
  for (size_t s = 0; s < stages.size(); ++s)
    if (checkpointed(s)) checkpointed_stages.push_back(s);
  activations = std::make_unique<runtime::ActivationStore>(choice.activations, std::move(shapes), cdt, stage_names,
                                                           checkpointed_stages, dev, host, prof, swap.get());
  placement_report += std::string("; activation checkpoints ") + to_string(choice.activations) + " " +
                      format_bytes(memory->checkpoint_bytes(choice)) + " a micro-batch";
}

void Engine::Impl::open_swap() {
  if (swap) return;
  offload::IoEngineConfig ic;
  ic.queue_depth = cfg.io_queue_depth;
  ic.fault_injector = cfg.io_fault_injector;
  io = offload::IoEngine::create(ic);
  offload::SwapConfig sc;
  for (const std::string& d : cfg.nvme_dirs) sc.dirs.emplace_back(d);
  sc.rank = comm.rank();
  swap = std::make_unique<offload::SwapSpace>(*io, sc);
}

}  // namespace strata::engine
