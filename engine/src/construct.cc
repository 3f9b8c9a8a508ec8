// Building the engine: the resolution's layout (layout/resolve.h; ranks agreeing through
// agreement()), the model's units checked against it, the state placed unit by unit, the
// working set resolved beside the allocated state, and the runtime parts built over both. The
// configuration is never changed: `effective` shows what was resolved.
#include "engine_impl.h"
#include "strata/engine/cpu_share.h"
#include "strata/models/quant4_checkpoint.h"
#include "strata/models/trainable.h"

#include <ATen/ops/empty.h>

#include <cstring>
#include <span>
#include <optional>

namespace strata::engine {

Engine::Impl::Impl(std::unique_ptr<models::Decoder> m, const EngineConfig& c, Communicator& cm, Device& d)
    : cfg(c), comm(cm), dev(d), model(std::move(m)), host(d) {
  cfg.validate();
  cdt = scalar_type(cfg.compute);
  exec.threads = cfg.cpu_threads ? cfg.cpu_threads : cpu_threads_per_rank(local_ranks());
  // Phase one, before any state exists: the cut, the units, the schedule, the memory model and
  // the placement. The model is cut as resolved: its stages make the units.
  const MachineView machine{comm.world_size(), usable_device(),
                            [this](uint64_t device) { return machine_budgets(cfg, device, local_ranks()); },
                            agreement()};
  layout = resolve_layout(cfg, model->config(), machine);
  schedule = &layout->schedule;
  memory = &layout->memory;
  model->set_tiles(layout->tiles);
  model->set_mlp_token_chunk(layout->mlp_token_chunk);
  stages = model->stages();
  head_loss = std::make_unique<runtime::HeadLoss>(*model, *memory, dev);
  ModelUnits units = build_units();
  placement_report = layout->report + layout->head_report;
  const StatePlacement& resolved = layout->placement;
  const auto stage_name = [this](size_t s) { return stage_names.at(s); };

  if (cfg.plan_only) {
    // Nothing is allocated: phase two as the run would make it, with the state the layout places
    // counted as allocated (what the planner's prediction does).
    state = std::make_unique<state::StateStore>(*partition, cdt, resolved, dev, host, nullptr, prof);
    optimizer = std::make_unique<runtime::Optimizer>(*state, host, dev, exec, cfg.nvme_chunk_bytes);
    const MachineFree offered = machine_free(cfg);
    working = std::make_unique<const WorkingSet>(
        predicted_working_set(cfg, *layout, c10::elementSize(cdt), dev.budget(), dev.physical_free(),
                              offered.host_available, offered.nvme_free, local_ranks(), agreement(), stage_name));
    placement_report += working->report + "; plan only (nothing allocated: predicted from the state the layout places)";
    effective = effective_config(cfg, *layout, choice());
    return;
  }

  if (resolved.master == Placement::kNvme || resolved.grads == Placement::kNvme ||
      resolved.params == Placement::kNvme || cfg.activations == Placement::kNvme)
    open_swap();
  allocate_state(units.owned, resolved.grads_transient);
  build_update_parts(std::move(units.stage_params), resolved.grads_transient);

  // Phase two, beside the allocated state: recompute, the checkpoints' tier, the prefetch window.
  base_bytes = dev.used();
  Allocated held;
  held.device_state = base_bytes;
  held.usable_device = usable_device();
  held.budget = dev.budget();
  held.host_state = host.state_bytes();
  held.budgets = machine_budgets(cfg, 0, local_ranks());
  working = std::make_unique<const WorkingSet>(resolve_working_set(cfg, *layout, held, agreement(), stage_name));
  placement_report += working->report;
  build_gathering(std::move(units.owned));
  place_activations();
  uses_run = std::make_unique<runtime::StepUses>(runtime::StepUses::Parts{
      cfg, dev, stages, stage_names, *schedule, *memory, choice(), *params, *activations, *head_loss, *reducer, *updater,
      *update, prof});
  effective = effective_config(cfg, *layout, choice());
}

// For each stage that owns parameters (a tied head tile after the first owns none) a unit of its
// trainable tensors, then one of its frozen tensors (model.trainable), each where it has any; a
// unit's tensors are the ones its stage owns (tied weights once), a tile's as parts of the
// model's tensors. Frozen tensors need no gradient: autograd computes none for them.
Engine::Impl::ModelUnits Engine::Impl::build_units() {
  ModelUnits out;
  const models::TrainableTensors trainable(cfg.trainable);
  std::vector<std::pair<std::string, std::vector<TensorSpec>>> specs;
  std::vector<char> frozen_units;
  std::unordered_map<const void*, std::pair<size_t, size_t>> owner;  // impl -> (unit, slot)
  std::vector<std::vector<size_t>> own_units(stages.size());
  for (size_t s = 0; s < stages.size(); ++s) {
    stage_names.push_back(model->stage_name(s));
    const auto named = stages[s]->hf_parameters();
    for (const bool frozen : {false, true}) {
      std::vector<TensorSpec> ts;
      std::vector<at::Tensor> tensors;
      const size_t u = specs.size();
      for (size_t k = 0; k < named.size(); ++k) {
        const auto& [name, t] = named[k];
        const models::TensorPart& part = stages[s]->parts().at(k);
        if (trainable.trainable(part.tensor) == frozen) continue;
        if (t.scalar_type() != at::kFloat || !t.device().is_cpu())
          throw std::invalid_argument("Engine: parameter " + name + " must be fp32 on the CPU");
        owner[t.unsafeGetTensorImpl()] = {u, ts.size()};
        TensorOrigin origin;
        if (!part.whole()) origin = {part.tensor, part.shape, part.dim, part.begin};
        ts.push_back({name, t.sizes().vec(), std::move(origin)});
        if (frozen)  // a 4-bit record where model.quantize stores one
          ts.back().stored = models::stored_tensor(model->config(), part.tensor, uint64_t(t.numel()), true,
                                                   c10::elementSize(cdt));
        tensors.push_back(t);
        if (frozen) tensors.back().requires_grad_(false);
      }
      if (ts.empty()) continue;
      own_units[s].push_back(u);
      unit_stage.push_back(s);
      frozen_units.push_back(frozen);
      out.owned.push_back(std::move(tensors));
      specs.emplace_back(models::unit_name(stage_names[s], frozen), std::move(ts));
    }
  }
  partition = std::make_unique<Partition>(specs, comm.world_size(), Partition::kDefaultAlignNumel, frozen_units);
  saved_units = partition->trainable_units();
  if (saved_units.size() < specs.size()) {
    std::vector<std::pair<std::string, std::vector<TensorSpec>>> saved;
    for (size_t u : saved_units) saved.push_back(specs[u]);
    saved_partition = std::make_unique<Partition>(saved, comm.world_size());
  }
  std::vector<std::string> unit_names;
  for (size_t u = 0; u < partition->num_units(); ++u) unit_names.push_back(partition->unit(u).name);
  holds = std::make_unique<state::HoldGate>(prof, std::move(unit_names));
  out.stage_params.resize(stages.size());
  std::vector<std::vector<size_t>> units_of(stages.size());
  for (size_t s = 0; s < stages.size(); ++s) {
    units_of[s] = own_units[s];
    for (const at::Tensor& p : stages[s]->parameters()) {
      auto it = owner.find(p.unsafeGetTensorImpl());
      if (it == owner.end())
        throw std::invalid_argument("Engine: stage " + stage_names[s] + " uses a parameter no stage owns");
      if (!frozen_units[it->second.first]) out.stage_params[s].push_back({p, it->second.first, it->second.second});
      if (std::find(units_of[s].begin(), units_of[s].end(), it->second.first) == units_of[s].end())
        units_of[s].push_back(it->second.first);
    }
  }
  // The resolution planned with the units the model's shapes give (unit_table): the model must
  // have built exactly those, or every decision was made for another model.
  const UnitTable& planned = layout->units;
  bool same = units_of == planned.stage_units && partition->num_units() == planned.unit_numel.size() &&
              frozen_units == planned.frozen;
  for (size_t u = 0; same && u < partition->num_units(); ++u) {
    const UnitLayout& L = partition->unit(u);
    same = L.numel == planned.unit_numel[u] && L.padded_numel() == planned.padded_numel[u] &&
           L.shard_numel == planned.shard_numel[u];
  }
  if (!same)
    throw std::logic_error("Engine: the decoder's stages make other units than the model's shapes "
                           "(models::unit_shapes) that the resolution planned with");
  return out;
}

void Engine::Impl::allocate_state(std::vector<std::vector<at::Tensor>>& owned, bool grads_transient) {
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
  state = std::make_unique<state::StateStore>(*partition, cdt, layout->placement, dev, host, swap.get(), prof);
  optimizer = std::make_unique<runtime::Optimizer>(*state, host, dev, exec, cfg.nvme_chunk_bytes, std::move(no_decay));
  // This rank's slices of the initial weights.
  const int rank = comm.rank();
  for (size_t u = 0; u < partition->num_units(); ++u) {
    const UnitLayout& L = partition->unit(u);
    model->initialize_through(unit_stage[u]);  // a deferred-init model materializes one unit at a time
    at::Tensor flat = initial_flat(L, owned[u]);
    state->allocate(u, flat.narrow(0, int64_t(L.shard_begin(rank)), int64_t(L.shard_numel)), grads_transient);
    // The model's copy of the unit goes now, not after the last unit.
    runtime::ParameterCoordinator::drop_storage(owned[u], cdt, dev);
    if (cfg.on_unit_placed) cfg.on_unit_placed(u + 1, partition->num_units());
  }
  model->set_record_source({});  // every record read: the files unmapped
}

// A unit's initial flat buffer: its tensors back to back, fp32 (a trainable unit's master), or
// for a frozen unit with 4-bit tensors (model.quantize) in the compute dtype with each 4-bit
// tensor's record (quantized_base.h) in its slot: the weight as the compute dtype holds it,
// quantized by bitsandbytes' rule (models::quantize_record), or copied from a checkpoint saved in 4
// bits (Decoder::read_record). Double quantization's offsets (torch's fp32 mean, whose rounding can
// follow the thread count) are agreed across the ranks first: each rank keeps only its shard of a
// record, so all must quantize around the same offset.
// A tensor of `numel` elements that the model reads as a 4-bit record (a checkpoint saved in 4
// bits; Decoder::RecordSource), dequantized in fp32: the model left its own storage untouched.
at::Tensor Engine::Impl::saved_dequantized(const std::string& name, uint64_t numel) {
  const models::QuantizedBase& q = model->config().quantize;
  at::Tensor record = at::zeros({int64_t(models::quant4_record(numel, q).bytes())}, at::kByte);
  const std::span<std::byte> bytes{static_cast<std::byte*>(record.data_ptr()), size_t(record.numel())};
  model->read_record(name, bytes);
  at::Tensor out = at::empty({int64_t(numel)}, at::kFloat);
  models::dequantize_record(bytes, q, out);
  return out;
}

at::Tensor Engine::Impl::initial_flat(const UnitLayout& L, const std::vector<at::Tensor>& tensors) {
  const bool records = std::any_of(L.tensors.begin(), L.tensors.end(), [](const TensorSlot& t) { return t.quantized; });
  at::Tensor flat = at::zeros({int64_t(L.padded_numel())}, at::TensorOptions().dtype(records ? cdt : at::kFloat));
  const models::QuantizedBase& q = model->config().quantize;
  const auto record_of = [&](const TensorSlot& s) {
    const at::Tensor bytes = flat.narrow(0, int64_t(s.offset), int64_t(s.numel)).view(at::kByte);
    return std::span<std::byte>{static_cast<std::byte*>(bytes.data_ptr()), size_t(bytes.numel())};
  };
  std::vector<at::Tensor> weights(L.tensors.size());  // those to quantize, in the compute dtype
  std::vector<int64_t> offsets;  // each one's offset's bits, slot order (>= 0: the bits order as the values)
  for (size_t i = 0; i < L.tensors.size(); ++i) {
    const TensorSlot& s = L.tensors[i];
    if (!s.quantized && model->reads_record(s.whole_name())) {
      // Saved in 4 bits, but this run trains it (or keeps it in 16 bits): its dequantization.
      flat.narrow(0, int64_t(s.offset), int64_t(s.numel)).copy_(saved_dequantized(s.whole_name(), s.numel));
    } else if (!s.quantized) {
      flat.narrow(0, int64_t(s.offset), int64_t(s.numel)).copy_(tensors[i].detach().reshape(-1));
    } else if (model->reads_record(s.whole_name())) {  // saved in 4 bits: the record as the files hold it
      model->read_record(s.whole_name(), record_of(s));
    } else {
      weights[i] = tensors[i].detach().to(cdt).contiguous();
      const float offset = models::quant4_offset(weights[i], q);
      uint32_t bits = 0;
      std::memcpy(&bits, &offset, 4);
      offsets.push_back(int64_t(bits));
    }
  }
  if (q.double_quant && comm.world_size() > 1 && !offsets.empty()) offsets = agreement()(offsets);
  size_t k = 0;
  for (size_t i = 0; i < L.tensors.size(); ++i) {
    if (!weights[i].defined()) continue;
    const uint32_t bits = uint32_t(offsets[k++]);
    float offset = 0;
    std::memcpy(&offset, &bits, 4);
    models::quantize_record(weights[i], q, offset, record_of(L.tensors[i]));
  }
  return flat;
}

void Engine::Impl::build_update_parts(std::vector<std::vector<runtime::GradientReducer::ParamRef>> stage_params,
                                      bool grads_transient) {
  // The reducer owns the transient gradients' buffers; the updater gives them back.
  reducer = std::make_unique<runtime::GradientReducer>(
      *schedule, *partition, *state, host, dev, comm, prof, cfg.reduce == Precision::kBf16, std::move(stage_params),
      grads_transient ? layout->transient_buffers : 0, layout->need.largest_trainable_shard());
  updater = std::make_unique<runtime::Updater>(*optimizer, *state, *schedule, *partition, dev, prof,
                                               reducer->gradient_buffers());
  update = std::make_unique<runtime::UpdatePolicy>(cfg.update_overlap, cfg.profile,
                                                   state->plan().master == Placement::kDevice, *optimizer, *updater,
                                                   *holds, dev, prof);
}

void Engine::Impl::build_gathering(std::vector<std::vector<at::Tensor>> owned) {
  params = std::make_unique<runtime::ParameterCoordinator>(*schedule, *memory, choice(), *partition, *state, host, dev,
                                                           comm, prof, updater.get());
  for (size_t u = 0; u < partition->num_units(); ++u) params->adopt(u, std::move(owned[u]));
  params->set_device_state_bytes(base_bytes);
  params->set_depth(choice().prefetch);
  params->set_4bit(model->config().quantize);
  if (working->prefetch_auto) {
    prefetch_tuner.deepest = working->prefetch_deepest;
    prefetch_tuner.depth = choice().prefetch;
  }
}

void Engine::Impl::place_activations() {
  if (choice().activations == Placement::kNvme) open_swap();
  std::vector<std::vector<int64_t>> shapes;  // a stage's input: one activation, or two stacked (a block tile's)
  for (uint64_t w : memory->sizes().input_widths) {
    shapes.push_back({cfg.micro_batch, cfg.seq_len, model->config().hidden});
    if (w > 1) shapes.back().insert(shapes.back().begin(), int64_t(w));
  }
  std::vector<size_t> checkpointed_stages;
  for (size_t s = 0; s < stages.size(); ++s)
    if (memory->checkpointed(s, choice())) checkpointed_stages.push_back(s);
  activations = std::make_unique<runtime::ActivationStore>(choice().activations, std::move(shapes), cdt, stage_names,
                                                           checkpointed_stages, dev, host, prof, swap.get());
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
