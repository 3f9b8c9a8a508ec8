#include "strata/engine/engine.h"

#include <ATen/ops/cat.h>
#include <ATen/ops/cross_entropy_loss.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/from_blob.h>
#include <ATen/ops/tensor.h>
#include <ATen/ops/zeros.h>
#include <c10/core/GradMode.h>
#include <torch/csrc/autograd/autograd.h>

#include <algorithm>
#include <array>
#include <functional>
#include <chrono>
#include <condition_variable>
#include <exception>
#include <future>
#include <mutex>
#include <cstring>
#include <optional>
#include <tuple>
#include <utility>
#include <cerrno>
#include <cmath>
#include <cstdlib>
#include <map>
#include <set>
#include <stdexcept>
#include <thread>
#include <unordered_map>

#include "strata/engine/placement.h"
#include "strata/engine/plan/memory_model.h"
#include "strata/engine/plan/schedule.h"
#include "strata/kernels/cpu_optim.h"
#include "strata/offload/io_engine.h"
#include "strata/offload/swap_space.h"
#include "runtime/activation_store.h"
#include "runtime/optimizer.h"
#include "runtime/updater.h"
#include "runtime/profiler.h"
#include "state/chunk_ring.h"
#include "state/host_memory.h"
#include "state/state_store.h"

namespace strata::engine {
namespace {

using runtime::Profiler;

at::ScalarType scalar_type(Precision p) {
  switch (p) {
    case Precision::kFp32: return at::kFloat;
    case Precision::kBf16: return at::kBFloat16;
    case Precision::kFp16: return at::kHalf;
  }
  return at::kFloat;
}

// A stage's parameter tensor and where it lives in the partition.
struct ParamRef {
  at::Tensor tensor;
  size_t unit = 0;
  size_t slot = 0;
};

// The state kinds of a unit's shard (state/state_store.h).
using state::kMaster;
using state::kExpAvg;
using state::kExpAvgSq;
using state::kGrad;
using state::kCompute;
using state::kKinds;

// What the engine keeps of a unit beside its state (the StateStore's).
struct UnitState {
  std::vector<at::Tensor> tensors;  // the module tensors, in slot order
  bool grad_fresh = true;           // host/NVMe gradients: the next reduce writes, not adds
};

struct Gathered {
  at::Tensor flat;                              // compute dtype [padded], on the device
  at::Tensor staging;                           // host-placed shard copied to the device
  std::unique_ptr<Communicator::Work> work;     // the all-gather in flight
  bool bound = false;
};

using plan::Use;

}  // namespace

struct Engine::Impl {
  EngineConfig cfg;
  Communicator& comm;
  Device& dev;
  std::unique_ptr<models::Decoder> model;
  std::vector<models::Stage*> stages;
  std::unique_ptr<Partition> partition;
  std::vector<UnitState> units;
  std::vector<std::vector<ParamRef>> stage_params;  // all tensors a stage's module uses
  at::ScalarType cdt;
  std::map<size_t, Gathered> live;
  // The schedule, the one memory model of the working set, and the choices it was evaluated
  // with (resolved at construction, fixed afterwards).
  std::unique_ptr<plan::Schedule> schedule;
  std::unique_ptr<plan::MemoryModel> memory;
  plan::Choices choice;
  const std::vector<size_t>& stage_units(size_t s) const { return schedule->units_of(s); }
  const std::vector<Use>& uses() const { return schedule->uses(); }
  uint64_t base_bytes = 0;  // device-placed state, allocated at construction
  bool broken = false;      // a step failed half way: the state is undefined
  int64_t step = 0;
  double loss_scale = 1.0;
  int64_t good_steps = 0;
  kernels::CpuExec exec;
  // NVMe tier (when any kind is placed there): this rank's swap files through the I/O engine.
  std::unique_ptr<offload::IoEngine> io;
  std::unique_ptr<offload::SwapSpace> swap;
  Profiler prof;
  std::unique_ptr<runtime::ActivationStore> activations;  // built once its placement is resolved
  // The latest snapshot's hold (hold_state). An update captures the hold current at its launch
  // and waits on it unit by unit before changing a unit's saved state.
  std::shared_ptr<StateHold> hold;
  void wait_released(const std::shared_ptr<StateHold>& h, size_t u) {
    if (!h || h->released(u)) return;
    const auto b = Profiler::Clock::now();
    h->wait(u);
    const auto e = Profiler::Clock::now();
    const double waited = std::chrono::duration<double>(e - b).count();
    prof.checkpoint_wait_ns += uint64_t(waited * 1e9);
    checkpoint_waited_here += waited;
    prof.span(Profiler::on_updater ? "optimizer" : "host", "wait checkpoint snapshot " + partition->unit(u).name, b, e);
  }
  // Seconds this thread has waited in wait_released: the training thread's optimizer timers
  // take them out (they are StepTimeline::wait_checkpoint, not optimizer work).
  static inline thread_local double checkpoint_waited_here = 0;
  void wait_hold_all() {
    if (hold) hold->wait_all();
  }
  // Profiling: device-timed compute spans of the step in progress, against a reference event
  // recorded at its start.
  std::shared_ptr<Event> step_ref;
  Profiler::Clock::time_point step_ref_host;
  std::vector<std::tuple<std::string, std::shared_ptr<Event>, std::shared_ptr<Event>>> compute_spans;

  // The optimizer group's split by unit, as automatic placement resolved it (PlacementPlan's
  // device_units and host_units; the kinds' tiers are cfg's until the store holds the plan).
  PlacementPlan split;
  // The units' state, placed by the resolved plan (built once placement is resolved).
  std::unique_ptr<state::StateStore> state;
  std::unique_ptr<runtime::Optimizer> optimizer;  // Adam and the gradient norm over the store
  Placement placement(size_t u, int k) const { return state->placement(u, k); }
  at::Tensor& tensor(size_t u, int k) { return state->tensor(u, k); }
  // The units whose update runs where their master weights are on the device, and the others
  // (the CPU's: host or swap), each in forward order.
  std::vector<size_t> units_where(bool on_device) const { return optimizer->units_where(on_device); }
  at::ScalarType kind_dtype(int k) const { return k == kCompute ? cdt : at::kFloat; }

  // Host memory: the one provider (state/host_memory.h).
  state::HostMemory host;
  at::Tensor host_buffer(uint64_t numel, at::ScalarType t) const { return host.buffer(numel, t); }
  static at::Tensor aligned_host_buffer(uint64_t numel, at::ScalarType t) { return state::HostMemory::unpinned(numel, t); }
  // Device bytes a gathered unit holds: the full buffer, plus the staged shard while host-placed
  // compute copies are on their way.
  uint64_t unit_param_bytes(size_t u) const { return memory->unit_bytes(u, choice); }
  // Gather decisions use only this bookkeeping (sizes and the schedule, the same on every rank),
  // never the device's momentary use, so that every rank issues its collectives in the same
  // order.
  uint64_t live_bytes() const {
    uint64_t b = 0;
    for (auto& [u, g] : live) b += unit_param_bytes(u);
    return b;
  }
  bool plan_fits(uint64_t extra) const {
    return base_bytes + live_bytes() + extra + memory->scratch(choice) + memory->device_checkpoints(choice) +
               graphs_held <=
           dev.budget();
  }
  // Ranks must agree on every decision that changes their collectives: each value becomes the
  // largest any rank chose (the slowest tier, the fewest units kept, ...).
  std::vector<int64_t> agree_max(const std::vector<int64_t>& values) {
    at::Tensor codes = at::tensor(values, at::TensorOptions().dtype(at::kLong));
    comm.all_reduce(codes, ReduceOp::kMax);
    std::vector<int64_t> out(values.size());
    for (size_t i = 0; i < out.size(); ++i) out[i] = codes[int64_t(i)].item<int64_t>();
    return out;
  }
  // The device bytes decisions may count on, beside the device-placed state.
  uint64_t usable_device() const { return plan::MemoryModel::usable_device(dev.budget(), base_bytes, dev.physical_free()); }

  Impl(std::unique_ptr<models::Decoder> m, const EngineConfig& c, Communicator& cm, Device& d)
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
    stage_params.resize(stages.size());
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

    // This rank's slices of the initial weights.
    const int rank = comm.rank();
    for (size_t u = 0; u < stages.size(); ++u) {
      const UnitLayout& L = partition->unit(u);
      model->initialize_through(u);  // a deferred-init model materializes one unit at a time
      std::vector<at::Tensor> parts;
      for (const at::Tensor& t : owned[u]) parts.push_back(t.detach().reshape(-1));
      if (L.padded_numel() > L.numel) parts.push_back(at::zeros({int64_t(L.padded_numel() - L.numel)}));
      at::Tensor flat = at::cat(parts);
      UnitState st;
      state->allocate(u, flat.narrow(0, int64_t(L.shard_begin(rank)), int64_t(L.shard_numel)), grads_transient);
      st.tensors = owned[u];
      units.push_back(std::move(st));
      last_grad_write.emplace_back();
      release(u);  // the model's copy of the unit goes now, not after the last unit
      if (cfg.on_unit_placed) cfg.on_unit_placed(u + 1, stages.size());
    }

    updater = std::make_unique<runtime::Updater>(*optimizer, *state, *schedule, *partition, dev, prof, host,
                                                 grads_transient ? transient_limit : 0, largest_shard());

    base_bytes = dev.used();
    if (cfg.recompute_blocks == EngineConfig::kRecomputeAuto) resolve_recompute();
    const size_t recomputed = choice.recomputed;
    cfg.recompute_blocks = int(recomputed);
    placement_report += "; recompute " + std::to_string(recomputed) + " of " + std::to_string(blocks) + " blocks";
    if (recomputed < blocks)
      placement_report += " (the last " + std::to_string(blocks - recomputed) + " keep their autograd graphs on the device, " +
                          format_bytes(memory->sizes().graph_bytes) + " each)";
    place_activations();
    prefetch_depth = cfg.prefetch;
    if (cfg.prefetch_auto) {
      // As many of the largest unit as fit beside the largest need, up to 8 and the schedule.
      plan::Choices none_ahead = choice;
      none_ahead.prefetch = 0;
      const uint64_t fit = std::min<uint64_t>({memory->prefetch_room(none_ahead, base_bytes, usable_device()), 8,
                                               uses().size() - 1});
      prefetch_tuner.deepest = int(std::max<uint64_t>(fit, 1));
      prefetch_depth = prefetch_tuner.depth = 1;
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

  // --- blocks kept without recompute (cfg.recompute_blocks) ---------------------------------
  // Blocks 1..choice.recomputed (stages) run without autograd and are recomputed from
  // checkpoints; the later blocks run with autograd and keep their graph and their gathered
  // parameters on the device from their forward to their backward (MemoryModel::held_at).
  uint64_t graphs_held = 0;  // graphs alive now (reserved on the device)
  struct KeptGraph {
    at::Tensor input, output;  // input.grad() is the backward's result
    Device::Reservation res;
  };
  std::vector<KeptGraph> kept_graphs;  // by stage, for the micro-batch in flight
  std::set<size_t> held_units;         // units of kept stages between their forward and backward
  bool kept(size_t s) const { return memory->keeps_graph(s, choice); }
  bool checkpointed(size_t s) const { return memory->checkpointed(s, choice); }
  // recompute "auto": keeps as many of the last blocks' graphs as fit beside the device-placed
  // state and the working set (checkpoints counted where placed on the device explicitly).
  void resolve_recompute() {
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

  // Resolves placement.activations "auto" (device, else host, else swap; see config.h), opens
  // the swap slots of NVMe-placed checkpoints, and adds the placement to the report.
  void place_activations() {
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

  void open_swap() {
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

  // --- automatic placement (placement.h) ------------------------------------------------------

  // Ranks sharing this machine's RAM and disks, among which its budgets are divided.
  int local_ranks() const {
    if (cfg.local_ranks > 0) return cfg.local_ranks;
    if (const char* l = std::getenv("LOCAL_WORLD_SIZE")) return std::max(1, std::atoi(l));
    return comm.world_size();
  }

  uint64_t largest_shard() const {
    uint64_t n = 0;
    for (const UnitLayout& L : partition->units()) n = std::max(n, L.shard_numel);
    return n;
  }

  std::string placement_report;

  void resolve_auto_placement() {
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
          const Placement kind = p.unit_tier(k == kMaster ? p.master : k == kExpAvg || k == kExpAvgSq ? p.moments
                                             : k == kGrad ? p.grads : p.params, k != kCompute, u);
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

  // --- gathering -----------------------------------------------------------------------------

  void start_gather(size_t u) {
    wait_updated(u);
    const UnitLayout& L = partition->unit(u);
    Gathered g;
    g.flat = dev.empty({int64_t(L.padded_numel())}, cdt, "parameters of unit " + L.name);
    at::Tensor src = tensor(u, kCompute);
    if (cfg.params != Placement::kDevice) {
      g.staging = dev.empty({int64_t(L.shard_numel)}, cdt, "staged shard of unit " + L.name);
      // The upload stream must not write memory the compute stream may still be using.
      dev.wait(dev.h2d_stream(), dev.record(dev.compute_stream()));
      if (cfg.params == Placement::kNvme) {
        // NVMe -> host buffer now; the upload stream waits for the read before copying it up.
        src = host_buffer(L.shard_numel, cdt);
        offload::IoFuture read = state->read(u, kCompute, 0, src);
        dev.launch_host(dev.h2d_stream(), [read] { read.get(); });
      }
      dev.copy_async(g.staging, src, dev.h2d_stream());
      prof.step.h2d_bytes += uint64_t(src.nbytes());
      {
        auto t = prof.time(prof.step.wait_params, "wait params", &L.name);  // blocks on the host device only
        dev.wait(dev.compute_stream(), dev.record(dev.h2d_stream()));
      }
      src = g.staging;
    }
    g.work = comm.all_gather(g.flat, src);
    live.emplace(u, std::move(g));
  }

  void bind(size_t u) {
    Gathered& g = live.at(u);
    if (g.bound) return;
    {
      auto t = prof.time(prof.step.wait_params, "wait params", &partition->unit(u).name);
      g.work->wait();
    }
    g.staging = at::Tensor();
    const UnitLayout& L = partition->unit(u);
    for (size_t i = 0; i < L.tensors.size(); ++i) {
      const TensorSlot& s = L.tensors[i];
      units[u].tensors[i].set_data(g.flat.narrow(0, int64_t(s.offset), int64_t(s.numel)).view(s.shape));
    }
    g.bound = true;
  }

  void release(size_t u) {
    auto it = live.find(u);
    if (it != live.end() && !it->second.bound && it->second.work) it->second.work->wait();
    for (at::Tensor& t : units[u].tensors)
      t.set_data(at::empty({0}, at::TensorOptions().dtype(cdt).device(dev.torch_device())));
    if (it != live.end()) live.erase(it);
  }

  const Use& use_at(size_t k) const { return schedule->use_at(k); }

  void ensure(size_t k) {
    const std::vector<size_t>& need = stage_units(use_at(k).stage);
    for (size_t u : need) {
      if (live.count(u)) continue;
      if (!plan_fits(unit_param_bytes(u))) {
        // Units kept for later uses make room for the one needed now.
        std::vector<size_t> drop;
        for (auto& [v, g] : live)
          if (std::find(need.begin(), need.end(), v) == need.end() && !held_units.count(v)) drop.push_back(v);
        for (size_t v : drop) release(v);
      }
      start_gather(u);
    }
    for (size_t u : need) bind(u);
  }

  int prefetch_depth = 1;   // units gathered ahead (device.prefetch; adapts with "auto")
  PrefetchTuner prefetch_tuner;

  void prefetch(size_t k, size_t total) {
    uint64_t graphs_ahead = 0;  // graphs of kept blocks whose forward comes before use j
    for (size_t j = k + 1; j <= k + size_t(prefetch_depth) && j < total; ++j) {
      const Use& use = use_at(j);
      if (use.kind == Use::kForward && kept(use.stage)) graphs_ahead += memory->sizes().graph_bytes;
      for (size_t u : stage_units(use.stage)) {
        if (live.count(u)) continue;
        if (!plan_fits(unit_param_bytes(u) + graphs_ahead)) return;
        start_gather(u);
      }
    }
  }

  void release_unneeded(size_t k, size_t total) {
    std::vector<size_t> drop;
    for (auto& [u, g] : live) {
      bool needed = held_units.count(u) > 0;
      for (size_t j = k + 1; j <= k + 1 + size_t(prefetch_depth) && j < total && !needed; ++j)
        for (size_t v : stage_units(use_at(j).stage)) needed |= v == u;
      if (!needed) drop.push_back(u);
    }
    for (size_t u : drop) release(u);
  }

  // --- gradients -----------------------------------------------------------------------------

  // NVMe-placed gradients: writes submitted by the d2h stream's host functions, with their
  // buffers; waited for (and the buffers freed) on the training thread at the step's end.
  std::mutex grad_write_mu;
  std::vector<offload::IoFuture> last_grad_write;  // by unit
  std::vector<std::pair<offload::IoFuture, std::array<at::Tensor, 2>>> grad_writes;  // write, its buffers
  // At most kGradWrites buffers wait for their writes (each a unit's fp32 shard): the training
  // thread drops finished ones and, over the bound, waits for the oldest (counted as waiting for
  // gradients), so a disk slower than the backward holds the backward back, not host memory.
  static constexpr size_t kGradWrites = 2;
  void prune_grad_writes() {
    const auto done = [](const std::pair<offload::IoFuture, std::array<at::Tensor, 2>>& w) {
      return w.first.ready() && w.first.wait().ok();  // failures stay, for the step's end to report
    };
    std::unique_lock<std::mutex> lock(grad_write_mu);
    std::erase_if(grad_writes, done);
    while (grad_writes.size() > kGradWrites) {
      const offload::IoFuture oldest = grad_writes.front().first;
      lock.unlock();
      {
        auto t = prof.time(prof.step.wait_grads, "wait gradient write");
        oldest.get();  // a failure fails the step now
      }
      lock.lock();
      std::erase_if(grad_writes, done);
    }
  }
  // Waits for every gradient write; rethrows the first failure (after waiting for all).
  void finish_grad_writes() {
    std::vector<std::pair<offload::IoFuture, std::array<at::Tensor, 2>>> pending;
    {
      std::lock_guard<std::mutex> lock(grad_write_mu);
      pending.swap(grad_writes);
      for (auto& w : last_grad_write) w = {};
    }
    for (auto& [w, buffer] : pending) w.wait();
    for (auto& [w, buffer] : pending) w.get();
  }

  // Reduce-scatters the gradients a stage's backward produced into the owners' accumulators.
  void reduce_gradients(size_t stage) {
    // Every unit the stage uses is reduced, gradient or not, so that the collectives are the
    // same on every rank whatever autograd produced locally.
    std::map<size_t, at::Tensor> flats;
    for (size_t u : stage_units(stage)) {
      const UnitLayout& L = partition->unit(u);
      flats[u] = dev.empty({int64_t(L.padded_numel())}, at::kFloat, "gradient of unit " + L.name).zero_();
    }
    for (ParamRef& p : stage_params[stage]) {
      at::Tensor g = p.tensor.grad();
      if (!g.defined()) continue;
      const TensorSlot& s = partition->unit(p.unit).tensors[p.slot];
      flats.at(p.unit).narrow(0, int64_t(s.offset), int64_t(s.numel)).copy_(g.reshape(-1));
      p.tensor.mutable_grad() = at::Tensor();
    }
    for (auto& [u, flat] : flats) {
      const UnitLayout& L = partition->unit(u);
      at::Tensor send = flat;
      if (cfg.reduce == Precision::kBf16) {
        send = dev.empty({int64_t(L.padded_numel())}, at::kBFloat16, "bf16 gradient of unit " + L.name);
        send.copy_(flat);
        flat = at::Tensor();
      }
      at::Tensor shard = dev.empty({int64_t(L.shard_numel)}, send.scalar_type(), "reduced gradient of unit " + L.name);
      comm.reduce_scatter(shard, send)->wait();
      send = at::Tensor();
      flat = at::Tensor();
      if (grads_transient && !tensor(u, kGrad).defined()) take_gradient_buffer(u);
      at::Tensor acc = tensor(u, kGrad);
      if (placement(u, kGrad) == Placement::kDevice) {
        acc.add_(shard);
      } else if (placement(u, kGrad) == Placement::kHost && units[u].grad_fresh && shard.scalar_type() == at::kFloat) {
        // The step's first contribution: copied down straight into the accumulator (no add, and
        // no zeroing after the step).
        dev.wait(dev.d2h_stream(), dev.record(dev.compute_stream()));
        dev.copy_async(acc, shard, dev.d2h_stream());
        prof.step.d2h_bytes += uint64_t(shard.nbytes());
        units[u].grad_fresh = false;
      } else {
        // Device -> host on the download stream, then accumulated there in fp32.
        at::Tensor host = host_buffer(L.shard_numel, shard.scalar_type());
        dev.wait(dev.d2h_stream(), dev.record(dev.compute_stream()));  // shard is filled there
        dev.copy_async(host, shard, dev.d2h_stream());
        prof.step.d2h_bytes += uint64_t(shard.nbytes());
        if (placement(u, kGrad) == Placement::kHost) {
          const bool fresh = units[u].grad_fresh;
          units[u].grad_fresh = false;
          dev.launch_host(dev.d2h_stream(), [acc, host, fresh]() mutable {
            if (fresh) acc.copy_(host);
            else acc.add_(host);
          });
        } else {
          // NVMe: the first micro-batch writes the shard, later ones read, add and write back.
          prune_grad_writes();
          // The write is submitted, not waited for: the stream goes on to the next unit, the next
          // micro-batch's read of this unit waits for it, and the step's end waits for them all.
          dev.launch_host(dev.d2h_stream(), [this, u, host]() mutable {
            // On the d2h stream's host function: no pinned (CUDA) allocation here, and the
            // conversion copy below is pageable too (at::Tensor::to allocates plain CPU memory).
            at::Tensor h = host.scalar_type() == at::kFloat ? host : host.to(at::kFloat);
            if (!units[u].grad_fresh) {
              at::Tensor sum = aligned_host_buffer(uint64_t(h.numel()), at::kFloat);
              offload::IoFuture before;
              {
                std::lock_guard<std::mutex> lock(grad_write_mu);
                before = last_grad_write.at(u);
              }
              if (before.valid()) before.get();
              state->read(u, kGrad, 0, sum).get();
              sum.add_(h);
              h = sum;
            } else if (!h.is_same(host)) {
              at::Tensor aligned = aligned_host_buffer(uint64_t(h.numel()), at::kFloat);
              aligned.copy_(h);
              h = aligned;
            }
            offload::IoFuture written = state->write(u, kGrad, 0, h);
            units[u].grad_fresh = false;
            // The entry takes this function's last references (h, and host, which the capture
            // would otherwise free here), so the training thread frees them.
            std::lock_guard<std::mutex> lock(grad_write_mu);
            last_grad_write.at(u) = written;
            grad_writes.push_back({written, {std::move(h), std::move(host)}});
          });
        }
      }
    }
  }

  // --- the step ------------------------------------------------------------------------------

  // Profiling: a stage's compute bracketed by timed events on the compute stream.
  std::shared_ptr<Event> compute_mark() { return cfg.profile ? dev.record_timed(dev.compute_stream()) : nullptr; }
  void compute_span(std::string name, const std::shared_ptr<Event>& begin) {
    if (begin) compute_spans.emplace_back(std::move(name), begin, dev.record_timed(dev.compute_stream()));
  }
  // The step's timeline; profiling, also the device compute time and spans (waits for the
  // compute stream).
  StepTimeline finish_timeline() {
    StepTimeline t = prof.take_step();
    if (overlaps_update()) t.optimizer_exposed += t.wait_update;
    if (!cfg.profile) return t;
    dev.synchronize(dev.compute_stream());
    t.compute_busy = 0;
    for (auto& [name, b, e] : compute_spans) {
      const double from = dev.seconds_between(step_ref, b), to = dev.seconds_between(step_ref, e);
      t.compute_busy += to - from;
      const auto host = [&](double x) {
        return step_ref_host + std::chrono::duration_cast<Profiler::Clock::duration>(std::chrono::duration<double>(x));
      };
      prof.span("device compute", name, host(from), host(to));
    }
    compute_spans.clear();
    return t;
  }

  void check_ids(const at::Tensor& ids) const {
    const int64_t b = cfg.micro_batch, T = cfg.seq_len, A = cfg.grad_accum;
    if (ids.dim() != 2 || ids.size(0) != A * b || ids.size(1) != T + 1 || ids.scalar_type() != at::kLong)
      throw std::invalid_argument("train_step: ids must be int64 [grad_accum * micro_batch = " +
                                  std::to_string(A * b) + ", seq_len + 1 = " + std::to_string(T + 1) + "]");
  }

  // Every exception out of here leaves the state undefined (Engine::train_step marks it broken).
  StepResult train_step(const at::Tensor& ids) {
    const auto t0 = std::chrono::steady_clock::now();
    const int64_t b = cfg.micro_batch, T = cfg.seq_len, A = cfg.grad_accum;
    const size_t n = stages.size();
    const size_t total = uses().size() * size_t(A);
    const double W = comm.world_size();
    const double denom = loss_scale * double(A) * W;  // the gradients' sum over the global batch
    const bool in_backward = updates_in_backward();
    // The step's token ids go up once, asynchronously from pinned memory, and the loss is summed
    // where it is computed and read once, after the backward: on a GPU, a pageable upload or a
    // loss read per micro-batch would each block the host until the device caught up.
    const at::Tensor ids_on_device =
        dev.torch_device().is_cuda() && ids.is_cpu()
            ? ids.pin_memory().to(dev.torch_device(), /*non_blocking=*/true)
            : ids.to(dev.torch_device());
    at::Tensor loss_sum_on_device;  // double, summed in micro-batch order as the host would
    size_t k = 0;
    if (cfg.profile) {
      compute_spans.clear();
      step_ref = dev.record_timed(dev.compute_stream());
      step_ref_host = Profiler::Clock::now();
    }
    for (int64_t m = 0; m < A; ++m) {
      at::Tensor rows = ids_on_device.narrow(0, m * b, b);
      at::Tensor inputs = rows.narrow(1, 0, T).contiguous();
      at::Tensor targets = rows.narrow(1, 1, T).reshape(-1);
      activations->begin_micro_batch();
      kept_graphs.clear();
      kept_graphs.resize(n);
      graphs_held = 0;
      held_units.clear();
      at::Tensor x = inputs;
      Device::Reservation x_res;
      // Forward through the embedding and the blocks, without autograd.
      for (size_t s = 0; s + 1 < n; ++s, ++k) {
        if (kept(s)) {  // before the gathers, which must leave room for it
          kept_graphs.at(s).res = dev.reserve(memory->sizes().graph_bytes, "autograd graph of unit " + partition->unit(s).name);
          graphs_held += memory->sizes().graph_bytes;
        }
        ensure(k);
        prefetch(k, total);
        at::Tensor y;
        if (kept(s)) {
          // With autograd, from a leaf input: the graph ends here, so the backward of each
          // block runs (and its gradients are reduced) on its own.
          KeptGraph& g = kept_graphs.at(s);
          g.input = x.detach().requires_grad_(true);
          const auto mark = compute_mark();
          g.output = stages[s]->forward(g.input);
          compute_span("forward " + partition->unit(s).name, mark);
          y = g.output.detach();
          for (size_t u : stage_units(s)) held_units.insert(u);
        } else {
          at::NoGradGuard no_grad;
          const auto mark = compute_mark();
          y = stages[s]->forward(x);
          compute_span("forward " + partition->unit(s).name, mark);
        }
        Device::Reservation y_res = dev.reserve(uint64_t(y.nbytes()), "activation of unit " + partition->unit(s).name);
        if (checkpointed(s)) activations->put(s, x, x_res);  // stage 0 recomputes from the token ids
        x = y;
        x_res = std::move(y_res);  // a kept stage's input: in its graph (graph_bytes) from here
        release_unneeded(k, total);
      }
      // "backward" overlap: the update starts with the last micro-batch's backward.
      if (in_backward && m == A - 1) updater->launch_in_backward(adam_config(1.0 / denom), hold_wait());
      // The head: forward and backward.
      at::Tensor dy;
      {
        ensure(k);
        prefetch(k, total);
        const auto mark = compute_mark();
        at::Tensor xh = x.detach().requires_grad_(true);
        at::Tensor logits = stages[n - 1]->forward(xh);
        at::Tensor loss = at::cross_entropy_loss(logits.reshape({-1, logits.size(-1)}).to(at::kFloat), targets);
        torch::autograd::backward({loss * loss_scale});
        compute_span("forward+backward " + partition->unit(n - 1).name, mark);
        const at::Tensor loss_d = loss.detach().to(at::kDouble);
        loss_sum_on_device = loss_sum_on_device.defined() ? loss_sum_on_device + loss_d : loss_d;
        dy = xh.grad();
        x = at::Tensor();
        reduce_gradients(n - 1);
        if (in_backward && m == A - 1) signal_final_gradients(n - 1);
        release_unneeded(k, total);
        ++k;
      }
      if (cfg.activations != Placement::kDevice) {
        // The forward's inputs stay alive in the copy queue beyond their reservations until
        // copied down: that ends here.
        auto t = prof.time(prof.step.wait_activations, "wait activations");
        dev.synchronize(dev.d2h_stream());
      }
      // Backward through the blocks and the embedding: kept blocks through their graphs, the
      // others recomputed from their checkpoints.
      for (size_t s = n - 1; s-- > 0; ++k) {
        ensure(k);
        prefetch(k, total);
        at::Tensor xin;
        Device::Reservation in_res;
        if (s == 0) {
          xin = inputs;
        } else if (checkpointed(s)) {
          xin = activations->take(s, in_res);
          xin.requires_grad_(true);
        }
        if (s > 1 && checkpointed(s - 1)) activations->fetch(s - 1);  // copied back while this stage runs
        if (s > 2 && checkpointed(s - 2)) activations->read_ahead(s - 2);  // NVMe: read a stage earlier still
        if (kept(s)) {
          KeptGraph g = std::move(kept_graphs.at(s));
          const auto mark = compute_mark();
          torch::autograd::backward({g.output}, {dy});
          compute_span("backward " + partition->unit(s).name, mark);
          dy = g.input.grad();
          g = KeptGraph{};  // the graph's memory, then its reservation
          graphs_held -= memory->sizes().graph_bytes;
          for (size_t u : stage_units(s)) held_units.erase(u);
        } else {
          const auto mark = compute_mark();
          at::Tensor y = stages[s]->forward(xin);
          torch::autograd::backward({y}, {dy});
          compute_span("recompute+backward " + partition->unit(s).name, mark);
          y = at::Tensor();
          dy = s > 0 ? xin.grad() : at::Tensor();
        }
        reduce_gradients(s);
        if (in_backward && m == A - 1) signal_final_gradients(s);
        release_unneeded(k, total);
      }
    }
    activations->prune();  // every checkpoint came back, so every staging buffer can go
    {
      auto t = prof.time(prof.step.wait_grads, "wait gradients");
      dev.synchronize(dev.d2h_stream());  // host gradient accumulation done
      finish_grad_writes();               // NVMe: and written
      // Every upload is done by now (the compute stream waited for each); this rethrows a failed
      // swap read of a gather or a checkpoint, which would otherwise go unnoticed.
      dev.synchronize(dev.h2d_stream());
    }

    // "backward": the device's units (a split optimizer group's first ones, final last) are
    // updated now, on the compute stream, while the updater may still run.
    if (in_backward) update_device_units(adam_config(1.0 / denom), &updater->unit_sumsq());
    // Global norm and overflow in one all-reduce: [local sum of squares, local loss sum].
    // "forward": the last update was done long ago (the forward gathered every unit); "backward":
    // this step's update, whose last units may still be running.
    finish_update();
    StepResult r;
    const int depth_used = prefetch_depth;
    {
      auto t = prof.time(prof.step.norm, "gradient norm");
      double sumsq = 0;
      if (in_backward)
        for (double v : updater->unit_sumsq()) sumsq += v;
      else
        sumsq = optimizer->local_sum_squares();
      // With the norm and the loss, every rank's wait for parameters and time so far: the
      // prefetch decision is then the same on every rank (their gathers must stay in step).
      const double elapsed = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      const double loss_sum = loss_sum_on_device.item<double>();
      at::Tensor red = at::tensor({sumsq, loss_sum, prof.step.wait_params, elapsed}, at::TensorOptions().dtype(at::kDouble));
      comm.all_reduce(red, ReduceOp::kSum);
      r.loss = red[1].item<double>() / (double(A) * W);
      r.grad_norm = std::sqrt(red[0].item<double>()) / denom;
      if (cfg.prefetch_auto)
        prefetch_depth = prefetch_tuner.next(red[2].item<double>() / std::max(red[3].item<double>(), 1e-9));
    }
    r.loss_scale = loss_scale;
    r.skipped = !std::isfinite(r.grad_norm);
    if (in_backward) {
      // Already applied: no skipping a step with a non-finite gradient.
      if (r.skipped)
        throw std::runtime_error("step " + std::to_string(step + 1) + ": the gradient norm is " +
                                 std::to_string(r.grad_norm) + " and optimizer.overlap \"backward\" "
                                 "has already applied the update, so the weights are no longer usable: "
                                 "restart from a checkpoint (overlap true or false skips such steps)");
      ++step;
    } else if (!r.skipped) {
      double coef = 1.0;
      if (cfg.clip_grad_norm > 0) coef = std::min(1.0, cfg.clip_grad_norm / (r.grad_norm + 1e-6));
      const kernels::AdamConfig ac = adam_config(coef / denom);
      if (overlaps_update()) {
        launch_update(ac);
      } else {
        const double before = prof.step.optimizer, waited_before = checkpoint_waited_here;
        {
          auto t = prof.time(prof.step.optimizer, "optimizer");
          optimizer_step(ac);
        }
        prof.step.optimizer -= checkpoint_waited_here - waited_before;
        prof.step.optimizer_exposed += prof.step.optimizer - before;
      }
      ++step;
    }
    for (size_t u = 0; u < units.size(); ++u) {
      if (placement(u, kGrad) == Placement::kDevice) tensor(u, kGrad).zero_();
      else units[u].grad_fresh = true;  // the next step's first reduce overwrites
    }
    if (cfg.compute == Precision::kFp16) {
      if (r.skipped) {
        loss_scale = std::max(1.0, loss_scale / 2);
        good_steps = 0;
      } else if (++good_steps >= cfg.loss_scale_window) {
        loss_scale *= 2;
        good_steps = 0;
      }
    }
    r.step = step;
    r.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    r.tokens = uint64_t(A * b * T) * uint64_t(comm.world_size());
    r.model_tflops = flops_per_token() * double(r.tokens) / r.seconds / 1e12;
    r.timeline = finish_timeline();
    r.timeline.prefetch = depth_used;
    return r;
  }

  // --- streaming through host buffers (NVMe placement) ----------------------------------------

  // Adam on every local slice where the master weights live, writing the next compute copies:
  // the device's units first, then the CPU's, each waiting for a checkpoint's hold first.
  void optimizer_step(const kernels::AdamConfig& ac) {
    optimizer->update_on_device(ac, units_where(true), nullptr, [this](size_t u) { wait_released(hold, u); });
    const std::vector<size_t> rest = units_where(false);
    if (!rest.empty()) optimizer->update_on_cpu(ac, rest, {}, nullptr, [this](size_t u) { wait_released(hold, u); });
  }

  kernels::AdamConfig adam_config(double grad_scale) const {
    kernels::AdamConfig ac;
    ac.lr = cfg.lr;
    ac.beta1 = cfg.beta1;
    ac.beta2 = cfg.beta2;
    ac.eps = cfg.eps;
    ac.weight_decay = cfg.weight_decay;
    ac.decoupled_weight_decay = cfg.decoupled_weight_decay;
    ac.step = step + 1;
    ac.grad_scale = grad_scale;
    return ac;
  }

  // --- the update on its own thread (optimizer.overlap; runtime/updater.h) ---------------------
  std::unique_ptr<runtime::Updater> updater;
  bool grads_transient = false;  // gradients_transient: the updater lends gradient buffers
  size_t transient_limit = 2;    // their number: the multi-use units' held ones plus two

  bool overlaps_update() const {
    // Not with device-resident master weights: the CUDA step is already asynchronous.
    return cfg.update_overlap != UpdateOverlap::kOff && cfg.master != Placement::kDevice;
  }
  bool updates_in_backward() const { return overlaps_update() && cfg.update_overlap == UpdateOverlap::kBackward; }
  std::function<void(size_t)> hold_wait() {
    return [this, h = hold](size_t u) { wait_released(h, u); };
  }
  // "forward": the whole update, in forward order: the device's units here, the CPU's on the
  // updater.
  void launch_update(const kernels::AdamConfig& ac) {
    update_device_units(ac);
    updater->launch_after_step(ac, hold_wait());
  }
  // The overlapped update's part on the device (a split optimizer group's first units), on the
  // training thread: one launch on the compute stream, counted as exposed optimizer time.
  void update_device_units(const kernels::AdamConfig& ac, std::vector<double>* sumsq = nullptr) {
    const std::vector<size_t> which = units_where(true);
    if (which.empty()) return;
    const double before = prof.step.optimizer, waited_before = checkpoint_waited_here;
    {
      auto t = prof.time(prof.step.optimizer, "optimizer (device)");
      optimizer->update_on_device(ac, which, sumsq, [this](size_t u) { wait_released(hold, u); });
      if (cfg.profile) dev.synchronize(dev.compute_stream());  // the kernel's time, not its launch's
    }
    prof.step.optimizer -= checkpoint_waited_here - waited_before;
    prof.step.optimizer_exposed += prof.step.optimizer - before;
  }
  void take_gradient_buffer(size_t u) {
    updater->take_gradient_buffer(u);
    units[u].grad_fresh = true;
  }
  // "backward", after the last micro-batch reduced `stage`'s gradients: the units whose last use
  // that was are final once the d2h stream gets past their accumulation (or swap write).
  void signal_final_gradients(size_t stage) {
    for (size_t u : stage_units(stage)) {
      if (schedule->last_use_stage(u) != stage) continue;
      dev.launch_host(dev.d2h_stream(), [this, u] {
        offload::IoFuture written;
        if (placement(u, kGrad) == Placement::kNvme) {
          std::lock_guard<std::mutex> lock(grad_write_mu);
          written = last_grad_write.at(u);
        }
        updater->mark_final(u, written);
      });
    }
  }
  void wait_updated(size_t u) { updater->wait_updated(u); }
  void finish_update() {
    if (updater) updater->finish();
  }
  void abort_update() {
    if (updater) updater->abort();
  }

  double flops_per_token() const {
    const models::ModelConfig& c = model->config();
    return 6.0 * double(c.parameters()) + 12.0 * double(c.layers) * double(c.hidden) * double(cfg.seq_len);
  }
};

Engine::Engine(std::unique_ptr<models::Decoder> model, const EngineConfig& config,
               Communicator& comm, Device& device)
    : impl_(std::make_unique<Impl>(std::move(model), config, comm, device)) {
  impl_->prof.tracing = config.profile;
}

const EngineConfig& Engine::config() const { return impl_->cfg; }
const std::string& Engine::placement_report() const { return impl_->placement_report; }
size_t Engine::optimizer_device_units() const { return impl_->split.device_units; }
size_t Engine::optimizer_host_units() const { return impl_->split.host_units; }
bool Engine::gradients_stored() const { return !impl_->grads_transient; }

std::vector<TraceSpan> Engine::take_trace() {
  std::lock_guard<std::mutex> lock(impl_->prof.mu);
  return std::exchange(impl_->prof.spans, {});
}

Engine::~Engine() {
  if (!impl_) return;
  impl_->abort_update();
  impl_->wait_hold_all();  // a snapshot still copying the state out (from swap files that go with us)
  // Activation checkpoint writes (a step that failed half way) must finish before their buffers go.
  // (Only those whose host function ran: a failed CUDA stream may never run the others.)
  for (Stream* st : {&impl_->dev.h2d_stream(), &impl_->dev.d2h_stream()}) try {
      impl_->dev.synchronize(*st);
    } catch (...) {
    }
  impl_->activations.reset();
  try {
    impl_->finish_grad_writes();
  } catch (...) {
  }
  // Gathers in flight must finish before their buffers go.
  for (auto& [u, g] : impl_->live)
    if (!g.bound && g.work) try {
        g.work->wait();
      } catch (...) {
      }
}

StepResult Engine::train_step(const at::Tensor& ids) {
  if (impl_->cfg.plan_only) throw std::logic_error("Engine: constructed with plan_only: it holds no state to train");
  if (impl_->broken)
    throw std::runtime_error("Engine: an earlier train_step failed half way; the partitioned state "
                             "is undefined (restart from a checkpoint)");
  impl_->check_ids(ids);  // rejected before anything changes
  try {
    return impl_->train_step(ids);
  } catch (...) {
    impl_->broken = true;
    impl_->abort_update();  // "backward": it may wait for gradients that will not come
    impl_->kept_graphs.clear();  // their device memory and reservations go now
    impl_->held_units.clear();
    impl_->graphs_held = 0;
    throw;
  }
}

std::vector<std::pair<std::string, at::Tensor>> Engine::gather_parameters() {
  std::vector<std::pair<std::string, at::Tensor>> out;
  Impl& I = *impl_;
  I.finish_update();
  // Read, not written: a checkpoint's hold need not be waited for (read_state), only the device
  // update queued on the compute stream.
  if (!I.units_where(true).empty()) I.dev.synchronize(I.dev.compute_stream());
  for (size_t u = 0; u < I.units.size(); ++u) {
    const UnitLayout& L = I.partition->unit(u);
    at::Tensor full = at::empty({int64_t(L.padded_numel())}, at::TensorOptions().dtype(at::kFloat));
    at::Tensor master = I.host_buffer(L.shard_numel, at::kFloat);  // aligned: swap reads go direct
    read_state(u, StateKind::kMaster, 0, L.shard_numel, master.data_ptr<float>());
    I.comm.all_gather(full, master)->wait();
    for (const TensorSlot& s : L.tensors)
      out.emplace_back(s.name, full.narrow(0, int64_t(s.offset), int64_t(s.numel)).view(s.shape).clone());
  }
  return out;
}

Engine::Counters Engine::counters() const {
  return {impl_->step, impl_->loss_scale, impl_->good_steps};
}

void Engine::set_counters(const Counters& c) {
  impl_->step = c.step;
  impl_->loss_scale = c.loss_scale;
  impl_->good_steps = c.good_steps;
}

at::Tensor Engine::state_slice(size_t unit, StateKind kind) {
  Impl& I = *impl_;
  I.finish_update();
  I.wait_hold_all();  // the caller may write into it
  const int k = int(kind);
  if (k < 0 || k > kExpAvgSq) throw std::invalid_argument("unknown state kind");
  if (I.placement(unit, k) != Placement::kNvme) return I.tensor(unit, k);
  at::Tensor copy = I.host_buffer(I.partition->unit(unit).shard_numel, at::kFloat);
  I.state->read(unit, k, 0, copy).get();
  return copy;
}

std::shared_future<void> Engine::update_finished() const {
  if (impl_->updater) {
    std::shared_future<void> over = impl_->updater->over();
    if (over.valid()) return over;
  }
  std::promise<void> done;
  done.set_value();
  return done.get_future().share();
}

Engine::NvmeSlice Engine::nvme_slice(size_t unit, StateKind kind) const {
  const Impl& I = *impl_;
  const int k = int(kind);
  if (k < 0 || k > kExpAvgSq) throw std::invalid_argument("unknown state kind");
  if (I.placement(unit, k) != Placement::kNvme) return {};
  return {I.swap.get(), I.state->swap_name(unit, k)};
}

void Engine::hold_state(std::shared_ptr<StateHold> hold) {
  Impl& I = *impl_;
  I.wait_hold_all();  // one snapshot at a time
  // read_state copies device-resident state on a stream of its caller's own: whatever updates
  // the compute stream has queued (the device's share of the optimizer) must be done first.
  if (!I.units_where(true).empty()) I.dev.synchronize(I.dev.compute_stream());
  I.hold = std::move(hold);
}

std::vector<size_t> Engine::update_order() const {
  const Impl& I = *impl_;
  std::vector<size_t> device = I.units_where(true), rest = I.units_where(false);
  if (I.updates_in_backward()) {
    // The CPU's units as their gradients become final, then the device's at the step's end.
    rest = I.schedule->in_final_gradient_order(std::move(rest));
    rest.insert(rest.end(), device.begin(), device.end());
    return rest;
  }
  device.insert(device.end(), rest.begin(), rest.end());  // one launch on the device, then forward order
  return device;
}

void Engine::read_state(size_t unit, StateKind kind, uint64_t begin, uint64_t numel, float* dst) {
  Impl& I = *impl_;
  const int k = int(kind);
  if (k < 0 || k > kExpAvgSq) throw std::invalid_argument("unknown state kind");
  const uint64_t n = I.partition->unit(unit).shard_numel;
  if (begin > n || numel > n - begin)
    throw std::out_of_range("read_state: elements " + std::to_string(begin) + "+" + std::to_string(numel) +
                            " outside unit " + I.partition->unit(unit).name + "'s slice of " + std::to_string(n));
  // Swap: a read through the I/O engine; device: a blocking copy on a stream of this thread's
  // own (ordered after the training's work by hold_state's synchronize); host: one memcpy here.
  I.state->read(unit, k, begin, at::from_blob(dst, {int64_t(numel)}, at::TensorOptions().dtype(at::kFloat))).get();
}

void Engine::store_state_slice(size_t unit, StateKind kind, const at::Tensor& data) {
  Impl& I = *impl_;
  I.finish_update();
  I.wait_hold_all();
  const int k = int(kind);
  if (k < 0 || k > kExpAvgSq) throw std::invalid_argument("unknown state kind");
  if (I.placement(unit, k) == Placement::kNvme) {
    TORCH_CHECK(data.is_cpu() && data.is_contiguous() && data.scalar_type() == at::kFloat &&
                    uint64_t(data.numel()) == I.partition->unit(unit).shard_numel,
                "store_state_slice: expects the fp32 host slice state_slice returned");
    I.state->write(unit, k, 0, data).get();
    return;
  }
  at::Tensor& slot = I.tensor(unit, k);
  if (!data.is_same(slot)) slot.copy_(data);
}

void Engine::refresh_compute_copies() {
  impl_->finish_update();
  impl_->optimizer->refresh_compute_copies();
}

const plan::MemoryModel& Engine::memory_model() const { return *impl_->memory; }
const plan::Choices& Engine::working_set_choices() const { return impl_->choice; }
uint64_t Engine::device_state_bytes() const { return impl_->base_bytes; }
const Partition& Engine::partition() const { return *impl_->partition; }
const models::ModelConfig& Engine::model_config() const { return impl_->model->config(); }
double Engine::flops_per_token() const { return impl_->flops_per_token(); }

MemoryReport Engine::memory() const {
  MemoryReport r;
  r.device_used = impl_->dev.used();
  r.device_peak = impl_->dev.peak();
  r.device_budget = impl_->dev.budget();
  r.host_state = impl_->host.state_bytes();
  r.nvme_state = impl_->state ? impl_->state->swap_bytes() : 0;
  r.host_activations = impl_->activations ? impl_->activations->host_peak() : 0;
  return r;
}

}  // namespace strata::engine

namespace strata::engine {

void StateHold::release(size_t unit) {
  std::lock_guard<std::mutex> lock(mu_);
  if (released_.at(unit)) return;
  released_[unit] = 1;
  --left_;
  cv_.notify_all();
}

void StateHold::release_all() {
  std::lock_guard<std::mutex> lock(mu_);
  std::fill(released_.begin(), released_.end(), 1);
  left_ = 0;
  cv_.notify_all();
}

bool StateHold::released(size_t unit) const {
  std::lock_guard<std::mutex> lock(mu_);
  return released_.at(unit) != 0;
}

void StateHold::wait(size_t unit) const {
  std::unique_lock<std::mutex> lock(mu_);
  ++waiters_.at(unit);
  cv_.wait(lock, [&] { return released_[unit] != 0; });
  --waiters_[unit];
}

void StateHold::wait_all() const {
  std::unique_lock<std::mutex> lock(mu_);
  cv_.wait(lock, [&] { return left_ == 0; });
}

bool StateHold::waited_for(size_t unit) const {
  std::lock_guard<std::mutex> lock(mu_);
  return waiters_.at(unit) > 0;
}

}  // namespace strata::engine
