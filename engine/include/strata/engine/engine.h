// strata::Engine: ZeRO-3 data-parallel training of a models::Decoder with partitioned state.
//
// Every rank owns a slice (partition.h) of each unit's fp32 master parameters, Adam moments,
// fp32 gradient accumulator and compute copy (fp32/bf16/fp16). A unit's full parameters exist on
// the device only while the schedule needs them. One train_step, for each micro-batch:
//   forward  embedding, blocks: all-gather the unit (the next `prefetch` units' gathers already
//            in flight within the device budget), run it without autograd, keep its input in
//            host memory as an activation checkpoint, release the unit;
//   head     forward and backward with autograd (loss = token-mean cross entropy, times the fp16
//            loss scale);
//   backward blocks in reverse, then the embedding: gather, recompute from the checkpoint,
//            backward, and reduce-scatter the unit's gradient (fp32 or bf16) into the owners'
//            fp32 accumulators right away, release.
// then the step: global gradient norm (sum of squares all-reduced), fp16 overflow check (skip
// the step and halve the scale), clipping folded into the gradient scale, the CPU Adam kernel
// on this rank's slices writing the next compute copies in the same pass. optimizer.overlap
// (UpdateOverlap in config.h) moves that update onto a thread, behind the next forward or, with
// no clipping and no loss scaling, into this step's backward as each unit's gradient is final.
// Tied embeddings: the head uses the embedding unit's tensor; both units are gathered for the
// head, and the head's contribution to the tied gradient is reduce-scattered with the head.
//
// Numerics: with fp32 compute the result equals plain libtorch (full model, autograd, AdamW,
// clip_grad_norm_) up to the order of floating-point sums; gradients are averaged over the
// global batch (micro_batch * grad_accum * world_size sequences).
//
// Errors: BudgetExceeded if the device budget cannot hold the running unit's working set;
// CommError when a peer rank dies or times out; std::invalid_argument for bad input shapes.
// Thread safety: one thread drives an Engine; every rank calls the same methods in the same
// order (they contain collectives).
#pragma once

#include <future>

#include <ATen/core/Tensor.h>

#include <condition_variable>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "strata/engine/comm.h"
#include "strata/engine/config.h"
#include "strata/engine/device.h"
#include "strata/engine/timeline.h"
#include "strata/engine/partition.h"
#include "strata/engine/placement.h"
#include "strata/engine/state_hold.h"
#include "strata/engine/layout/memory_model.h"
#include "strata/models/decoder.h"

namespace strata::offload {
class File;
}

namespace strata::engine {

struct StepResult {
  int64_t step = 0;          // optimizer steps taken so far (skipped steps not counted)
  double loss = 0;           // mean over the global batch's targets (counted ones, with a mask)
  double grad_norm = 0;      // global 2-norm of the averaged gradient, before clipping
  bool skipped = false;      // overflow (fp16) or non-finite gradient: no update
  double loss_scale = 1;     // fp16 loss scale used for this step (1 otherwise)
  double seconds = 0;
  uint64_t tokens = 0;       // global tokens in the step
  uint64_t loss_tokens = 0;  // global targets in the loss (tokens without a mask)
  double model_tflops = 0;   // models::model_flops_per_token x tokens per second, all ranks
  // A mixture of experts (models::ModelConfig::Moe): the load-balancing loss, the mean over the
  // global batch's micro-batches of transformers' load_balancing_loss_func for each (in `loss`
  // times router_aux_loss_coef when the model's config adds it); and by sparse block, then
  // expert, the share of the block's top-k choices over the global batch the expert received
  // (1 / experts each when balanced). 0 and empty for a dense model.
  double aux_loss = 0;
  std::vector<std::vector<double>> expert_shares;
  StepTimeline timeline;
};

struct MemoryReport {
  uint64_t device_used = 0, device_peak = 0, device_budget = 0;
  uint64_t host_state = 0;        // this rank's host-placed shards
  uint64_t nvme_state = 0;        // this rank's NVMe-placed shards (swap space)
  uint64_t host_activations = 0;  // activation checkpoints, peak of the last step
};

class Engine {
 public:
  // Takes the model (fp32, on the CPU, identical on every rank: same seed or same checkpoint);
  // its weights move into this rank's shards and its modules keep only views of gathered units.
  Engine(std::unique_ptr<models::Decoder> model, const EngineConfig& config, Communicator& comm,
         Device& device);
  ~Engine();
  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;

  // One optimizer step on this rank's share of the global batch: `ids` is int64
  // [grad_accum * micro_batch, seq_len + 1] (inputs and next-token targets), micro-batch m being
  // rows [m * micro_batch, (m + 1) * micro_batch).
  StepResult train_step(const at::Tensor& ids);
  // The same with a loss mask (supervised fine-tuning): `loss_mask` is uint8 or bool
  // [grad_accum * micro_batch, seq_len], nonzero where the target ids[:, j + 1] counts. The loss
  // is then the cross entropy summed over the global batch's counted targets divided by their
  // number (all ranks, all micro-batches), which is what one forward of the whole global batch
  // with ignored labels gives; the gradients are those of that loss. Every rank passes a mask or
  // none (the count is a collective). A global batch without any counted target is skipped: no
  // forward and no update, StepResult::skipped with a NaN loss.
  StepResult train_step(const at::Tensor& ids, const at::Tensor& loss_mask);
  // Packed examples (data.pack): `segments` int64 [rows, seq_len] says which example each input
  // token belongs to (models::TokenLayout): a token attends only to the earlier tokens of its
  // example, and positions restart at each example. The mask must leave out every target that
  // crosses from one example to the next (the packed data does). Undefined: one sequence a row.
  // Segment -1 marks padding after a row's examples (supervised rows pass it packed or not): a
  // mixture of experts leaves it out of its load-balancing loss, as transformers' attention_mask
  // does; rows holding one example then padding keep plain causal attention.
  StepResult train_step(const at::Tensor& ids, const at::Tensor& loss_mask, const at::Tensor& segments);
  // The forward alone over `ids` (int64 [rows, seq_len + 1], rows a multiple of micro_batch,
  // the same on every rank: a collective) in micro-batches, without autograd and without
  // touching gradients, optimizer state or the step count; `loss_mask` as for train_step
  // (undefined: every target counts; a mask on every rank or none). Returns the cross entropy
  // summed over every rank's counted targets, and their number. Waits for the update running
  // behind before gathering a unit. Its transfers count in the next step's timeline, as anything
  // between steps does.
  struct EvalResult {
    double loss_sum = 0;
    uint64_t tokens = 0;
  };
  EvalResult evaluate(const at::Tensor& ids, const at::Tensor& loss_mask, const at::Tensor& segments = {});
  // The learning rate of the following steps' updates (optimizer.lr until called; a schedule sets
  // it before each step: lr_schedule.h). An update already launched keeps the rate it had.
  void set_learning_rate(double lr);

  // Every parameter in fp32 with its Hugging Face name, gathered from all ranks' master slices
  // (a collective); a tensor held in block tiles is assembled whole from its parts. Holds one
  // full copy of the model in host memory. Waits for the update
  // running behind, not for a checkpoint's hold (it only reads the state).
  std::vector<std::pair<std::string, at::Tensor>> gather_parameters();

  // --- checkpoint access (checkpoint.h) ---
  // The persistent per-rank state besides the slices: optimizer steps taken, fp16 loss scale and
  // its count of good steps.
  struct Counters {
    int64_t step = 0;
    double loss_scale = 1.0;
    int64_t good_steps = 0;
  };
  Counters counters() const;
  void set_counters(const Counters& c);
  // The state accessors below take one of the saved kinds (state::kMaster, kExpAvg, kExpAvgSq:
  // placement.h); any other kind throws std::invalid_argument.
  // This rank's fp32 slice (shard_numel elements) of one unit's state: the tensor where it is
  // placed, or for NVMe-placed state a host copy read from swap. After writing into it (a
  // checkpoint load), store_state_slice() it (a no-op unless on NVMe), then call
  // refresh_compute_copies() once. Training thread; waits for the update running behind and for
  // a checkpoint's hold on every unit (the caller may write into the result).
  at::Tensor state_slice(size_t unit, state::Kind kind);
  void store_state_slice(size_t unit, state::Kind kind, const at::Tensor& data);
  // --- snapshots (a checkpoint's writer copying the state out while training goes on) ---
  // State that lives in files (NVMe swap), for snapshots that copy it to a checkpoint file to
  // file: whether this rank's slice of (unit, kind) does, and the copy of its elements
  // [begin, begin + numel) into `dst` at byte `offset`, inside the kernel, never through this
  // process's memory. Same caller contract as read_state (any thread, state held); a slice that
  // is not in files throws std::logic_error (read_state it instead), a range outside the slice
  // std::out_of_range, the disk IoError.
  bool state_copies_to_file(size_t unit, state::Kind kind) const;
  void copy_state_to_file(size_t unit, state::Kind kind, uint64_t begin, uint64_t numel, const offload::File& dst,
                          uint64_t offset);
  // Ready when the last step's update (running behind with optimizer.overlap) is complete;
  // ready at once when none runs; holds the update's exception if it failed. Any thread may
  // wait on it. The state holds the last step's values only once it is ready.
  std::shared_future<void> update_finished() const;
  // Training thread: every change of the saved state from now on (updates launched after this
  // call, store_state_slice, state_slice) first waits for `hold` to release the unit; an update
  // already running behind is not held (wait for update_finished()). An earlier hold is waited
  // for in full first. Device-resident state read by read_state() afterwards includes every
  // update queued before this call (the compute stream is synchronized here).
  void hold_state(std::shared_ptr<StateHold> hold);
  // The units in the order the next update changes them: a snapshot that releases them in this
  // order lets the update start soonest.
  std::vector<size_t> update_order() const;
  // Any thread: copies elements [begin, begin + numel) of this rank's fp32 slice of (unit, kind)
  // into host memory at `dst`, from wherever it lives (the device: a blocking copy on a stream
  // of the calling thread's own; host RAM; swap: a read). The caller makes sure the engine does
  // not change it meanwhile: update_finished() ready and a StateHold not yet releasing the unit.
  // A frozen unit (partition().frozen(unit)) has only weights: kMaster reads its compute copy
  // (converted to fp32), any other kind throws std::logic_error.
  // Throws std::out_of_range for a range outside the slice, IoError from swap.
  void read_state(size_t unit, state::Kind kind, uint64_t begin, uint64_t numel, float* dst);
  // compute copy = master rounded to the compute dtype, exactly what the optimizer writes.
  void refresh_compute_copies();

  // The trace spans recorded since the last call (EngineConfig::profile; empty otherwise).
  std::vector<TraceSpan> take_trace();

  // The configuration in effect: "auto" placements resolved (placement.h). An optimizer group
  // split by unit names there the tier of its last units; its first optimizer_device_units()
  // units keep master, moments and gradients on the device (updated there), and with master on
  // NVMe, units up to optimizer_host_units() (counted from unit 0) keep master and moments (and
  // gradients where those are on NVMe) in host RAM.
  const EngineConfig& config() const;
  size_t optimizer_device_units() const;
  size_t optimizer_host_units() const;
  // False when gradients have no accumulators (gradients_transient in placement.h): each unit's
  // waits in a host buffer for its update during backward (except the optimizer group's device
  // units', stored on the device); config().grads then reads kHost.
  bool gradients_stored() const;
  // One line: each kind's tier and bytes on this rank, and for automatic placement the budgets.
  const std::string& placement_report() const;

  // The one memory model of the device working set (layout/memory_model.h), the choices this
  // engine resolved (placement, recompute, checkpoints, prefetch), and the device-placed state
  // beside which it runs: every use needs device_state_bytes() + memory_model().need(use, ...)
  // of the device budget, which construction checks.
  const layout::MemoryModel& memory_model() const;
  const layout::Choices& working_set_choices() const;
  uint64_t device_state_bytes() const;

  const Partition& partition() const;
  // The units a checkpoint holds: the trainable ones (a frozen unit's weights are the base
  // model's, not training state), as a partition of their own, in engine order; its unit i is
  // engine unit checkpoint_units()[i]. partition() and 0..n-1 when nothing is frozen.
  const Partition& checkpoint_partition() const;
  const std::vector<size_t>& checkpoint_units() const;
  const models::ModelConfig& model_config() const;
  MemoryReport memory() const;
  // Model FLOPs per token of one forward+backward (models::model_flops_per_token: 6 N + attention;
  // a frozen parameter counts 4).
  double flops_per_token() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace strata::engine
