// Building the engine: partition, schedule and memory model; placement, recompute, activation
// checkpoints and prefetch resolved (ranks agreeing through agree_max); the parts built and the
// state placed unit by unit.
#include "engine_impl.h"

namespace strata::engine {

Engine::Impl::Impl(std::unique_ptr<models::Decoder> m, const EngineConfig& c, Communicator& cm, Device& d)
    : cfg(c), comm(cm), dev(d), model(std::move(m)), host(d) {
  cfg.validate();
  cdt = scalar_type(cfg.compute);
  loss_scale = cfg.compute == Precision::kFp16 ? cfg.initial_loss_scale : 1.0;
  exec.threads = cfg.cpu_threads ? cfg.cpu_threads : std::max(1u, std::thread::hardware_concurrency());
  stages = model->stages();

  // Units = stages; each unit's tensors are the ones its stage owns (tied weights once).
  std::vector<std::pair<std::string, std::vector<TensorSpec>>> specs;
  std::unordered_map<const void*, std::pair<size_t, size_t>> owner;  // impl -> (unit, slot)
  std::vector<std::vector<at::Tensor>> owned(stages.size());
  for (size_t s = 0; s < stages.size(); ++s) {
    std::vector<TensorSpec> ts;
    for (auto& [name, t] : stages[s]->hf_parameters()) {
      if (t.scalar_type() != at::kFloat || !t.device().is_cpu())
        throw std::invalid_argument("Engine: parameter " + name + " must be fp32 on the CPU");
      owner[t.unsafeGetTensorImpl()] = {s, ts.size()};
      ts.push_back({name, t.sizes().vec()});
      owned[s].push_back(t);
    }
    std::string uname = s == 0 ? "embedding" : s + 1 == stages.size() ? "head" : "block." + std::to_string(s - 1);
    specs.emplace_back(uname, std::move(ts));
  }
  partition = std::make_unique<Partition>(specs, comm.world_size());
  std::vector<std::vector<runtime::GradientReducer::ParamRef>> stage_params(stages.size());
  std::vector<std::vector<size_t>> units_of(stages.size());
  for (size_t s = 0; s < stages.size(); ++s) {
    units_of[s].push_back(s);
    for (const at::Tensor& p : stages[s]->parameters()) {
      auto it = owner.find(p.unsafeGetTensorImpl());
      if (it == owner.end())
        throw std::invalid_argument("Engine: stage " + partition->unit(s).name +
                                    " uses a parameter no stage owns");
      stage_params[s].push_back({p, it->second.first, it->second.second});
      if (std::find(units_of[s].begin(), units_of[s].end(), it->second.first) ==
          units_of[s].end())
        units_of[s].push_back(it->second.first);
    }
  }
  // The schedule of one micro-batch: forward over embedding and blocks, the head, backward.
  schedule = std::make_unique<plan::Schedule>(std::move(units_of), partition->num_units());
  // Transient gradient buffers: the multi-use units' held ones (a tied embedding) plus two.
  transient_limit = 2 + schedule->shared_units();

  const models::ModelConfig& mc = model->config();
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
  sizes.graph_bytes = sizes.tokens * model->block_graph_bytes_per_token(c10::elementSize(cdt));
  memory = std::make_unique<plan::MemoryModel>(*schedule, std::move(sizes));
  const size_t blocks = schedule->blocks();
  // "auto" decides below, once the state is allocated; until then the working set assumes
  // every block is recomputed.
  choice.recomputed = cfg.recompute_blocks == EngineConfig::kRecomputeAuto
                          ? blocks
                          : std::min(blocks, size_t(cfg.recompute_blocks));
  choice.params_staged = cfg.params != Placement::kDevice;  // kAuto: not known yet, so counted
  choice.activations = cfg.activations;
  choice.prefetch = cfg.prefetch;

  resolve_auto_placement();
  choice.params_staged = cfg.params != Placement::kDevice;
  grads_transient = gradients_transient(cfg, cfg.master);
  if (grads_transient) cfg.grads = Placement::kHost;  // each unit's gradient waits there for its update
  PlacementPlan resolved{cfg.params, cfg.grads, cfg.master, cfg.moments};
  resolved.device_units = split.device_units;
  resolved.host_units = split.host_units;
  resolved.grads_transient = grads_transient;
  if (cfg.plan_only) {
    state = std::make_unique<state::StateStore>(*partition, cdt, resolved, dev, host, nullptr, prof);
    optimizer = std::make_unique<runtime::Optimizer>(*state, host, dev, exec, cfg.nvme_chunk_bytes);
    placement_report += "; plan only (recompute and activation checkpoints are decided once the state is allocated)";
    return;
  }

  if (cfg.master == Placement::kNvme || cfg.grads == Placement::kNvme || cfg.params == Placement::kNvme ||
      cfg.activations == Placement::kNvme)
    open_swap();
  state = std::make_unique<state::StateStore>(*partition, cdt, resolved, dev, host, swap.get(), prof);
  optimizer = std::make_unique<runtime::Optimizer>(*state, host, dev, exec, cfg.nvme_chunk_bytes);

  params = std::make_unique<runtime::ParameterCoordinator>(*schedule, *memory, choice, *partition, *state, host, dev,
                                                           comm, prof, [this](size_t u) { wait_updated(u); });
  // This rank's slices of the initial weights.
  const int rank = comm.rank();
  for (size_t u = 0; u < stages.size(); ++u) {
    const UnitLayout& L = partition->unit(u);
    model->initialize_through(u);  // a deferred-init model materializes one unit at a time
    std::vector<at::Tensor> parts;
    for (const at::Tensor& t : owned[u]) parts.push_back(t.detach().reshape(-1));
    if (L.padded_numel() > L.numel) parts.push_back(at::zeros({int64_t(L.padded_numel() - L.numel)}));
    at::Tensor flat = at::cat(parts);
    state->allocate(u, flat.narrow(0, int64_t(L.shard_begin(rank)), int64_t(L.shard_numel)), grads_transient);
    params->adopt(u, owned[u]);  // the model's copy of the unit goes now, not after the last unit
    if (cfg.on_unit_placed) cfg.on_unit_placed(u + 1, stages.size());
  }

  updater = std::make_unique<runtime::Updater>(*optimizer, *state, *schedule, *partition, dev, prof, host,
                                               grads_transient ? transient_limit : 0, largest_shard());
  reducer = std::make_unique<runtime::GradientReducer>(*schedule, *partition, *state, host, dev, comm, prof,
                                                       cfg.reduce == Precision::kBf16, std::move(stage_params),
                                                       [this](size_t u) { updater->take_gradient_buffer(u); });

  base_bytes = dev.used();
  params->set_device_state_bytes(base_bytes);
  if (cfg.recompute_blocks == EngineConfig::kRecomputeAuto) resolve_recompute();
  const size_t recomputed = choice.recomputed;
  cfg.recompute_blocks = int(recomputed);
  placement_report += "; recompute " + std::to_string(recomputed) + " of " + std::to_string(blocks) + " blocks";
  if (recomputed < blocks)
    placement_report += " (the last " + std::to_string(blocks - recomputed) + " keep their autograd graphs on the device, " +
                        format_bytes(memory->sizes().graph_bytes) + " each)";
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
  for (const Use& use : uses()) {
    const uint64_t need = memory->need(use, choice);
    if (base_bytes + need > dev.budget())
      throw BudgetExceeded(
          "device budget " + format_bytes(dev.budget()) + " cannot run unit " +
          partition->unit(use.stage).name + ": it needs " + format_bytes(need) +
          " (parameters " + format_bytes(memory->use_bytes(use, choice)) + ", activations and gradient "
          "buffers " + format_bytes(memory->scratch(choice)) + ", activation checkpoints on the device " +
          format_bytes(memory->device_checkpoints(choice)) + ", blocks kept without recompute " +
          format_bytes(memory->held_at(use, choice)) + ") beside " + format_bytes(dev.used()) +
          " of device-placed state; raise device.budget, recompute more blocks "
          "(placement.recompute) or place state on the host");
  }
}

void Engine::Impl::resolve_recompute() {
  const size_t blocks = schedule->blocks();
  const uint64_t usable = usable_device();
  size_t keep = 0;
  for (size_t k = 1; k <= blocks; ++k) {
    plan::Choices c = choice;
    c.recomputed = blocks - k;
    if (base_bytes + memory->working_set(c) > usable) break;
    keep = k;
  }
  // Every rank recomputes as many as any rank must: their gathers must stay in step.
  choice.recomputed = size_t(agree_max({int64_t(blocks - keep)})[0]);
}

void Engine::Impl::place_activations() {
  const uint64_t all = memory->checkpoint_bytes(choice);
  if (cfg.activations == Placement::kAuto) {
    plan::Choices on_device = choice;
    on_device.activations = Placement::kDevice;
    const bool fits = base_bytes + memory->working_set(on_device) <= usable_device();
    const TierBudgets b = machine_budgets(cfg, 0, local_ranks());
    Placement p = Placement::kHost;
    if (fits) p = Placement::kDevice;
    // A configured host budget covers the host state too; a derived one is what is free now.
    else if ((cfg.host_budget ? host.state_bytes() + all : all) <= b.host || cfg.nvme_dirs.empty()) p = Placement::kHost;
    else p = Placement::kNvme;
    // Every rank takes the slowest tier any rank chose.
    cfg.activations = Placement(agree_max({int64_t(p)})[0]);
  }
  choice.activations = cfg.activations;
  if (cfg.activations == Placement::kNvme) open_swap();
  std::vector<std::string> names;
  for (size_t s = 0; s < stages.size(); ++s) names.push_back(partition->unit(s).name);
  activations = std::make_unique<runtime::ActivationStore>(
      cfg.activations, std::vector<int64_t>{cfg.micro_batch, cfg.seq_len, model->config().hidden}, cdt,
      std::move(names), choice.recomputed, dev, host, prof, swap.get());
  placement_report += std::string("; activation checkpoints ") + to_string(cfg.activations) + " " +
                      format_bytes(all) + " a micro-batch";
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

void Engine::Impl::resolve_auto_placement() {
  StateBytes need;
  for (const UnitLayout& L : partition->units()) {
    need.params += L.shard_numel * c10::elementSize(cdt);
    need.grads += L.shard_numel * 4;
    need.master += L.shard_numel * 4;
    need.moments += L.shard_numel * 8;
    need.unit_numel.push_back(L.shard_numel);
  }
  need.grad_buffers = uint64_t(transient_limit) * largest_shard() * 4;
  const bool any_auto = cfg.params == Placement::kAuto || cfg.grads == Placement::kAuto ||
                        cfg.master == Placement::kAuto || cfg.moments == Placement::kAuto;
  if (!any_auto) {
    PlacementPlan plan{cfg.params, cfg.grads, cfg.master, cfg.moments};
    plan.grads_transient = gradients_transient(cfg, cfg.master);
    placement_report = "placement: " + describe_plan(plan, need);
    return;
  }
  // The device keeps room for the working set (prefetch "auto": its starting depth; blocks kept
  // without recompute: an explicit count; checkpoints: where placed explicitly).
  const uint64_t working = memory->working_set(choice);
  const uint64_t device = usable_device();  // nothing allocated yet
  const uint64_t device_state = device == UINT64_MAX ? device : device > working ? device - working : 0;
  TierBudgets budgets = machine_budgets(cfg, device_state, local_ranks());
  // Checkpoints placed on the host explicitly need their room beside the state.
  if (cfg.activations == Placement::kHost) budgets.host -= std::min(budgets.host, memory->checkpoint_bytes(choice));
  PlacementPlan plan = plan_placement(cfg, need, budgets);
  // This rank's bytes in host RAM and in swap under a plan (as placement(u, k) will say).
  const auto host_and_swap = [&](const PlacementPlan& p) {
    std::pair<uint64_t, uint64_t> b{p.grads_transient ? need.grad_buffers : 0, 0};
    for (size_t u = 0; u < partition->num_units(); ++u)
      for (int k = 0; k < kKinds; ++k) {
        const Placement kind = state::unit_kind_tier(p, u, k);
        if (k == kGrad && p.grads_transient && kind != Placement::kDevice) continue;  // counted as the buffers
        const uint64_t bytes = partition->unit(u).shard_numel * c10::elementSize(kind_dtype(k));
        if (kind == Placement::kHost) b.first += bytes;
        if (kind == Placement::kNvme) b.second += bytes;
      }
    return b;
  };
  const auto [planned_host, planned_swap] = host_and_swap(plan);
  // Every rank takes the slowest tier any rank chose for each kind, and of a split optimizer
  // group the fewest units on the device and in host RAM (a group wholly in a tier counts as
  // all units there), so that all agree.
  const int64_t n_units = int64_t(partition->num_units());
  const int64_t on_device = plan.master == Placement::kDevice ? n_units : int64_t(plan.device_units);
  const int64_t on_host = plan.master == Placement::kNvme ? int64_t(std::max(plan.host_units, plan.device_units)) : n_units;
  const std::vector<int64_t> codes = agree_max({int64_t(plan.params), int64_t(plan.grads), int64_t(plan.master),
                                                int64_t(plan.moments), n_units - on_host, n_units - on_device});
  plan = {Placement(codes[0]), Placement(codes[1]), Placement(codes[2]), Placement(codes[3])};
  plan.grads_transient = gradients_transient(cfg, plan.master);
  if (plan.master != Placement::kDevice) plan.device_units = size_t(n_units - codes[5]);
  if (plan.master == Placement::kNvme) plan.host_units = size_t(n_units - codes[4]);
  split.device_units = plan.device_units;
  split.host_units = plan.host_units;
  // A rank may now hold more in host RAM or swap than it planned (another rank chose a slower
  // tier, or fewer units on the device or in host RAM): check those budgets again, so that it
  // fails here, clearly, not on a full disk or out of memory.
  const auto [hosted, swapped] = host_and_swap(plan);
  if ((swapped > planned_swap && swapped > budgets.nvme) || (hosted > planned_host && hosted > budgets.host))
    throw std::runtime_error("automatic placement: the ranks agreed on placing " + format_bytes(hosted) +
                             " of this rank's state in host RAM and " + format_bytes(swapped) +
                             " in swap, over its budgets of " + format_bytes(budgets.host) + " and " +
                             format_bytes(budgets.nvme) + " (another rank had less room elsewhere); "
                             "raise offload.host_budget or offload.nvme_budget, or place kinds explicitly");
  cfg.params = plan.params;
  cfg.grads = plan.grads;
  cfg.master = plan.master;
  cfg.moments = plan.moments;
  cfg.validate();
  auto budget = [](uint64_t b) { return b == UINT64_MAX ? std::string("unlimited") : format_bytes(b); };
  placement_report = "placement (auto): " + describe_plan(plan, need) + "; budgets for state: device " +
                     budget(budgets.device) + " (after a " + format_bytes(working) +
                     " working set), host " + budget(budgets.host) + ", NVMe " + budget(budgets.nvme);
}

}  // namespace strata::engine
