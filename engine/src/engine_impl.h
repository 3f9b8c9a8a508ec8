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
#include "runtime/step_driver.h"
#include "runtime/updater.h"
#include "profiler.h"
#include "state/chunk_ring.h"
#include "state/hold_gate.h"
#include "state/host_memory.h"
#include "state/state_store.h"

namespace strata::engine {



inline at::ScalarType scalar_type(Precision p) {
  switch (p) {
    case Precision::kFp32: return at::kFloat;
    case Precision::kBf16: return at::kBFloat16;
    case Precision::kFp16: return at::kHalf;
  }
  return at::kFloat;
}

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
  std::unique_ptr<const WorkingSetPlan> working;
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
  // Profiling: device-timed compute spans of the step in progress, against a reference event
  // recorded at its start.
  std::shared_ptr<Event> step_ref;
  Profiler::Clock::time_point step_ref_host;
  std::vector<std::tuple<std::string, std::shared_ptr<Event>, std::shared_ptr<Event>>> compute_spans;

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

  // --- blocks kept without recompute (cfg.recompute_blocks) ---------------------------------
  // The first choice.recomputed block stages run without autograd and are recomputed from
  // checkpoints; the later blocks run with autograd and keep their graph and their gathered
  // parameters on the device from their forward to their backward (MemoryModel::held_at).
  struct KeptGraph {
    at::Tensor input, output;  // input.grad() is the backward's result
    Device::Reservation res;
  };
  std::vector<KeptGraph> kept_graphs;  // by stage, for the micro-batch in flight
  bool kept(size_t s) const { return memory->keeps_graph(s, choice()); }
  bool checkpointed(size_t s) const { return memory->checkpointed(s, choice()); }

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

  // The largest trainable shard: a transient gradient buffer's size (frozen units have no
  // gradient), as layout::state_bytes counts it.
  uint64_t largest_shard() const {
    uint64_t n = 0;
    for (size_t u : partition->trainable_units()) n = std::max(n, partition->unit(u).shard_numel);
    return n;
  }

  std::string placement_report;

  // --- gathering (runtime/coordinator.h) ------------------------------------------------------
  std::unique_ptr<runtime::ParameterCoordinator> params;
  PrefetchTuner prefetch_tuner;

  // --- gradients (runtime/gradient_reducer.h) -------------------------------------------------
  std::unique_ptr<runtime::GradientReducer> reducer;

  // --- the step ------------------------------------------------------------------------------

  // Profiling: a stage's compute bracketed by timed events on the compute stream.
  std::shared_ptr<Event> compute_mark() { return cfg.profile ? dev.record_timed(dev.compute_stream()) : nullptr; }
  void compute_span(std::string name, const std::shared_ptr<Event>& begin) {
    if (begin) compute_spans.emplace_back(std::move(name), begin, dev.record_timed(dev.compute_stream()));
  }
  // The step's timeline; profiling, also the device compute time and spans (waits for the
  // compute stream).
  StepTimeline finish_timeline();

  void check_ids(const at::Tensor& ids, const at::Tensor& loss_mask, const at::Tensor& segments, int64_t rows) const {
    const int64_t T = cfg.seq_len;
    if (ids.dim() != 2 || ids.size(0) != rows || ids.size(1) != T + 1 || ids.scalar_type() != at::kLong)
      throw std::invalid_argument("train_step: ids must be int64 [" + std::to_string(rows) +
                                  " (grad_accum * micro_batch for a step), seq_len + 1 = " + std::to_string(T + 1) + "]");
    if (loss_mask.defined() &&
        (loss_mask.dim() != 2 || loss_mask.size(0) != rows || loss_mask.size(1) != T ||
         (loss_mask.scalar_type() != at::kByte && loss_mask.scalar_type() != at::kBool)))
      throw std::invalid_argument("train_step: loss_mask must be uint8 or bool [" + std::to_string(rows) +
                                  ", seq_len = " + std::to_string(T) + "]");
    if (segments.defined() && (segments.dim() != 2 || segments.size(0) != rows || segments.size(1) != T ||
                               segments.scalar_type() != at::kLong))
      throw std::invalid_argument("train_step: segments must be int64 [" + std::to_string(rows) +
                                  ", seq_len = " + std::to_string(T) + "]");
  }
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
  // The step's walk over the schedule: its position and what every use adds to.
  struct Pass {
    size_t total = 0;      // uses in the step
    double denom = 1;      // loss scale x micro-batches x ranks (masked: the loss scale, the
                           // count is in head_scale): the gradients' divisor
    bool masked = false;   // a loss mask: the head sums its losses (the mean is over the step)
    double loss_tokens = 0;  // global targets in the loss (masked)
    double head_scale = 1;   // the head's backward seed: the loss scale (masked: / loss_tokens)
    bool in_backward = false;  // optimizer.overlap "backward"
    at::Tensor loss_sum;   // double on the device, summed in micro-batch order
  };
  struct MicroBatch {
    at::Tensor inputs, targets;   // targets out of the loss are kIgnored
    models::TokenLayout layout;   // packed examples, or one sequence a row
    at::Tensor x;                 // the boundary activation going forward
    Device::Reservation x_res;    // its device bytes
    at::Tensor dy;                // the gradient going backward
    bool last = false;            // the step's last micro-batch
    runtime::HeadLoss::VocabPass head;  // vocabulary tiles only
  };
  static constexpr int64_t kIgnored = runtime::HeadLoss::kIgnored;
  // The head's loss, whole, in logits tiles or in vocabulary tiles (runtime/head_loss.h).
  std::unique_ptr<runtime::HeadLoss> head_loss;
  MicroBatch begin_micro_batch(const at::Tensor& ids_on_device, const at::Tensor& mask_on_device,
                               const at::Tensor& segments_on_device, int64_t m);
  // The host's token ids (and mask) on the device, asynchronously from pinned memory on a GPU.
  at::Tensor to_device(const at::Tensor& t);
  void vocab_head_backward(MicroBatch& mb, size_t stage);
  // The uses of a step, in the schedule's order as the step driver hands them (use k of the
  // step), run on this engine; the micro-batch in flight lives here.
  struct StepRunner final : runtime::UseRunner {
    Impl& I;
    Pass& pass;
    const at::Tensor& ids;   // the step's token ids on the device
    const at::Tensor& mask;  // and its loss mask (undefined: none)
    const at::Tensor& segments;  // and its examples' segments (undefined: one sequence a row)
    MicroBatch mb;
    StepRunner(Impl& impl, Pass& p, const at::Tensor& i, const at::Tensor& m, const at::Tensor& seg)
        : I(impl), pass(p), ids(i), mask(m), segments(seg) {}
    void begin_micro_batch(int64_t m, bool last) override;
    void end_micro_batch() override { mb = MicroBatch{}; }
    void forward(size_t s, size_t k) override { I.forward_use(pass, mb, s, k); }
    void head(size_t s, size_t k) override;
    void backward(size_t s, size_t k) override { I.backward_use(pass, mb, s, k); }
  };
  void forward_use(Pass& pass, MicroBatch& mb, size_t stage, size_t k);
  void head_use(Pass& pass, MicroBatch& mb, size_t stage, size_t k);
  void backward_use(Pass& pass, MicroBatch& mb, size_t stage, size_t k);
  void finish_backward();
  StepResult reduce_norm_and_loss(const Pass& pass, std::chrono::steady_clock::time_point t0);
  StepResult skipped_step(std::chrono::steady_clock::time_point t0);
  void apply_update(const Pass& pass, const StepResult& r);

  // --- streaming through host buffers (NVMe placement) ----------------------------------------

  // Adam on every local slice where the master weights live, writing the next compute copies:
  // the device's units first, then the CPU's, each waiting for a checkpoint's hold first.
  // The update on the training thread; `before_write(u)` before u's saved state changes.
  void optimizer_step(const kernels::AdamConfig& ac, const state::HoldGate::Waiter& before_write);

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

  // --- the update on its own thread (optimizer.overlap; runtime/updater.h) ---------------------
  std::unique_ptr<runtime::Updater> updater;

  bool overlaps_update() const {
    // Not with device-resident master weights: the CUDA step is already asynchronous.
    return cfg.update_overlap != UpdateOverlap::kOff && state->plan().master != Placement::kDevice;
  }
  bool updates_in_backward() const { return overlaps_update() && cfg.update_overlap == UpdateOverlap::kBackward; }
  // "forward": the whole update, in forward order: the device's units here, the CPU's on the
  // updater.
  void launch_update(const kernels::AdamConfig& ac) {
    update_device_units(ac);
    updater->launch_after_step(ac, holds->waiter());
  }
  // The overlapped update's part on the device (a split optimizer group's first units), on the
  // training thread: one launch on the compute stream, counted as exposed optimizer time.
  void update_device_units(const kernels::AdamConfig& ac, std::vector<double>* sumsq = nullptr);
  void finish_update() {
    if (updater) updater->finish();
  }
  void abort_update() {
    if (updater) updater->abort();
  }

  // Model FLOPs (models::model_flops_per_token): frozen units' parameters cost no weight gradient.
  double flops_per_token() const {
    int64_t frozen = 0;
    for (size_t u = 0; u < partition->num_units(); ++u)
      if (partition->unit(u).frozen) frozen += int64_t(partition->unit(u).numel);
    return models::model_flops_per_token(model->config(), cfg.seq_len, frozen);
  }
};


}  // namespace strata::engine
