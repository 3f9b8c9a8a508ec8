// Engine::Impl: the engine's parts and the state they share, for the files that implement it
// (construct.cc: the resolution and building the parts; step.cc: the step; evaluate.cc:
// evaluation; engine.cc: the public API). Private to engine/src.
//
// Ownership: Impl owns every part (state store, optimizer, updater, coordinator, reducer, head
// loss, loss scaler, activation store, hold gate, swap space) and the resolution (const once
// made); the parts borrow from it and are destroyed before what they borrow (declaration order).
// Threads: the training thread owns Impl; the parts' headers say what their own threads (updater,
// d2h stream functions) touch, and no other thread calls into Impl.
#pragma once

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
#include <limits>
#include <map>
#include <set>
#include <stdexcept>
#include <thread>
#include <unordered_map>

#include "strata/engine/placement.h"
#include "strata/models/model_shapes.h"
#include "strata/engine/layout/resolve.h"
#include "strata/engine/layout/memory_model.h"
#include "strata/tiling/linear_cross_entropy.h"
#include "strata/engine/layout/schedule.h"
#include "strata/kernels/cpu_optim.h"
#include "strata/offload/io_engine.h"
#include "strata/offload/swap_space.h"
#include "runtime/activation_store.h"
#include "runtime/coordinator.h"
#include "runtime/gradient_reducer.h"
#include "runtime/head_loss.h"
#include "runtime/loss_scaler.h"
#include "runtime/optimizer.h"
#include "runtime/step_uses.h"
#include "runtime/update_policy.h"
#include "runtime/updater.h"
#include "profiler.h"
#include "strata/engine/precision_dtype.h"
#include "state/chunk_ring.h"
#include "state/hold_gate.h"
#include "state/host_memory.h"
#include "state/state_store.h"

namespace strata::engine {


// The state kinds of a unit's shard (state/state_store.h).
using state::kMaster;
using state::kExpAvg;
using state::kExpAvgSq;
using state::kGrad;
using state::kCompute;
using state::kKinds;

using layout::Use;

struct Engine::Impl {
  // The configuration as given (validated, never changed) and as resolved: `effective` has every
  // "auto" replaced by what construction decided (resolve.h; Engine::config()).
  const EngineConfig cfg;
  EngineConfig effective;
  Communicator& comm;
  Device& dev;
  std::unique_ptr<models::Decoder> model;
  std::vector<models::Stage*> stages;
  std::unique_ptr<Partition> partition;
  // The trainable units alone (Engine::checkpoint_partition), when any unit is frozen; and
  // which engine unit each of its units is.
  std::unique_ptr<Partition> saved_partition;
  std::vector<size_t> saved_units;
  at::ScalarType cdt;
  // The resolution (layout/resolve.h), immutable once made: the layout (the cut, the units, the
  // schedule, the one memory model of the working set, the placement) before the state is
  // allocated, and the working set's choices after. `schedule` and `memory` point into the layout.
  std::unique_ptr<const Layout> layout;
  std::unique_ptr<const WorkingSet> working;
  const layout::Schedule* schedule = nullptr;
  const layout::MemoryModel* memory = nullptr;
  const layout::Choices& choice() const { return working->choice; }
  std::vector<std::string> stage_names;  // by stage (a unit is named after the stage owning it)
  std::vector<size_t> unit_stage;        // by unit: the stage that owns it
  const std::vector<size_t>& stage_units(size_t s) const { return schedule->units_of(s); }
  const std::vector<Use>& uses() const { return schedule->uses(); }
  uint64_t base_bytes = 0;  // device-placed state, allocated at construction
  bool broken = false;      // a step failed half way: the state is undefined
  int64_t step = 0;
  runtime::LossScaler loss_scaler{cfg.compute == Precision::kFp16, cfg.initial_loss_scale, cfg.loss_scale_window};
  double lr = cfg.lr;  // set_learning_rate
  kernels::CpuExec exec;
  // NVMe tier (when any kind is placed there): this rank's swap files through the I/O engine.
  std::unique_ptr<offload::IoEngine> io;
  std::unique_ptr<offload::SwapSpace> swap;
  Profiler prof;
  std::unique_ptr<runtime::ActivationStore> activations;  // built once its placement is resolved
  // The latest snapshot's hold (hold_state), which updates wait on unit by unit before changing
  // a unit's saved state (built with the partition).
  std::unique_ptr<state::HoldGate> holds;

  // The units' state, placed by the resolved plan (built once placement is resolved): the one
  // placement table, state->plan().
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
  // Ranks must agree on every decision that changes their collectives: each value becomes the
  // largest any rank chose (the slowest tier, the fewest units kept, ...).
  Agree agreement() {
    return [this](const std::vector<int64_t>& values) {
      at::Tensor codes = at::tensor(values, at::TensorOptions().dtype(at::kLong));
      comm.all_reduce(codes, ReduceOp::kMax);
      std::vector<int64_t> out(values.size());
      for (size_t i = 0; i < out.size(); ++i) out[i] = codes[int64_t(i)].item<int64_t>();
      return out;
    };
  }
  // The device bytes decisions may count on, beside the device-placed state.
  uint64_t usable_device() const { return layout::MemoryModel::usable_device(dev.budget(), base_bytes, dev.physical_free()); }

  Impl(std::unique_ptr<models::Decoder> m, const EngineConfig& c, Communicator& cm, Device& d);

  // --- construction (construct.cc) -------------------------------------------------------------
  // The model's units: the partition of the tensors each stage owns (checked against the
  // layout's units), each stage's parameters for the reducer, and each unit's module tensors.
  struct ModelUnits {
    std::vector<std::vector<runtime::GradientReducer::ParamRef>> stage_params;  // by stage
    std::vector<std::vector<at::Tensor>> owned;                                // by unit
  };
  ModelUnits build_units();
  // Each unit's shard of the initial weights into the state store, unit by unit; the model's
  // copy of each goes as soon as its unit is placed.
  void allocate_state(std::vector<std::vector<at::Tensor>>& owned, bool grads_transient);
  at::Tensor initial_flat(const UnitLayout& L, const std::vector<at::Tensor>& tensors);
  at::Tensor saved_dequantized(const std::string& name, uint64_t numel);
  // The updater and the gradient reducer over the allocated state.
  void build_update_parts(std::vector<std::vector<runtime::GradientReducer::ParamRef>> stage_params,
                          bool grads_transient);
  // The parameter coordinator over the resolved working set, holding the units' module tensors.
  void build_gathering(std::vector<std::vector<at::Tensor>> owned);
  // The activation store where the checkpoints were placed (opening the swap space for NVMe).
  void place_activations();

  void open_swap();

  // --- automatic placement (placement.h) ------------------------------------------------------

  // Ranks sharing this machine's RAM and disks, among which its budgets are divided.
  int local_ranks() const {
    if (cfg.local_ranks > 0) return cfg.local_ranks;
    if (const char* l = std::getenv("LOCAL_WORLD_SIZE")) return std::max(1, std::atoi(l));
    return comm.world_size();
  }

  std::string placement_report;

  // --- gathering (runtime/coordinator.h) ------------------------------------------------------
  std::unique_ptr<runtime::ParameterCoordinator> params;
  PrefetchTuner prefetch_tuner;

  // --- gradients (runtime/gradient_reducer.h) -------------------------------------------------
  std::unique_ptr<runtime::GradientReducer> reducer;

  // --- the step ------------------------------------------------------------------------------

  // The step's timeline; profiling, also the device compute time and spans (waits for the
  // compute stream).
  StepTimeline finish_timeline();

  void check_usable() const {
    if (broken)
      throw std::runtime_error("Engine: an earlier train_step failed half way; the partitioned state "
                               "is undefined (restart from a checkpoint)");
  }
  // After an exception out of train_step or evaluate: the state is undefined from now on.
  void fail_step();

  // Every exception out of here leaves the state undefined (Engine::train_step marks it broken).
  StepResult train_step(const at::Tensor& ids, const at::Tensor& loss_mask, const at::Tensor& segments);
  Engine::EvalResult evaluate(const at::Tensor& ids, const at::Tensor& loss_mask, const at::Tensor& segments);
  using Pass = runtime::StepUses::Pass;
  // The head's loss, whole, in logits tiles or in vocabulary tiles (runtime/head_loss.h).
  std::unique_ptr<runtime::HeadLoss> head_loss;
  // The host's token ids (and mask) on the device, asynchronously from pinned memory on a GPU.
  at::Tensor to_device(const at::Tensor& t);
  StepResult reduce_norm_and_loss(const Pass& pass, std::chrono::steady_clock::time_point t0);
  StepResult skipped_step(std::chrono::steady_clock::time_point t0);
  void apply_update(const Pass& pass, const StepResult& r);

  // --- the update (runtime/update_policy.h; its thread: runtime/updater.h) --------------------
  std::unique_ptr<runtime::Updater> updater;
  std::unique_ptr<runtime::UpdatePolicy> update;  // none with plan_only (nothing to update)

  // The update's arguments at this step: its rate and count, and the gradients' scale.
  kernels::AdamConfig adam_config(double grad_scale) const {
    kernels::AdamConfig ac;
    ac.lr = lr;
    ac.beta1 = cfg.beta1;
    ac.beta2 = cfg.beta2;
    ac.eps = cfg.eps;
    ac.weight_decay = cfg.weight_decay;
    ac.decoupled_weight_decay = cfg.decoupled_weight_decay;
    ac.step = step + 1;
    ac.grad_scale = grad_scale;
    return ac;
  }
  bool overlaps_update() const { return update && update->overlaps(); }
  bool updates_in_backward() const { return update && update->in_backward(); }
  void finish_update() {
    if (update) update->finish();
  }
  void abort_update() {
    if (update) update->abort();
  }

  // The uses' bodies over the parts above (runtime/step_uses.h; none with plan_only). Last: it
  // borrows them.
  std::unique_ptr<runtime::StepUses> uses_run;

  // Model FLOPs (models::model_flops_per_token): frozen units' parameters cost no weight gradient,
  // a frozen expert's in the share of tokens that use it.
  double flops_per_token() const {
    double frozen = 0;
    for (size_t u = 0; u < partition->num_units(); ++u)
      if (partition->unit(u).frozen)
        for (const TensorSlot& t : partition->unit(u).tensors)
          frozen += double(t.elements()) * models::active_share(model->config(), t.whole_name());
    return models::model_flops_per_token(model->config(), cfg.seq_len, int64_t(std::llround(frozen)));
  }
};


}  // namespace strata::engine
