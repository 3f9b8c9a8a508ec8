// The bodies of a step's uses: what each use of the schedule does on this rank (gather its units,
// run its stage forward, the loss, backward from a kept graph or a recompute, hand its gradients
// to the reducer), run in the schedule's order by the step driver (runtime/step_driver.h). A
// training step runs every use; an evaluation the forward uses and the loss alone, through the
// same bodies (Pass::training false: no graph, no checkpoint, no backward, no reduction).
//
// Blocks kept without recompute (the stages after Choices::recomputed) run with autograd and keep
// their graph and their gathered units on the device from their forward to their backward
// (MemoryModel::held_at); the recomputed ones run without autograd, their inputs kept as
// activation checkpoints (runtime/activation_store.h) and brought back ahead of their backward in
// the schedule's order (Schedule::backward_stage_after).
//
// Ownership: borrows every part (the engine's, which outlive it); owns the kept graphs of the
// micro-batch in flight and the profiling's compute spans.
// Threads: the training thread. Errors: the parts' (BudgetExceeded, collectives, I/O, libtorch)
// propagate at once; after one the caller drops the kept graphs (drop_graphs) and the state is
// undefined.
#pragma once

#include <ATen/core/Tensor.h>

#include <map>
#include <memory>
#include <string>
#include <tuple>
#include <vector>

#include "profiler.h"
#include "runtime/activation_store.h"
#include "runtime/coordinator.h"
#include "runtime/gradient_reducer.h"
#include "runtime/head_loss.h"
#include "runtime/update_policy.h"
#include "runtime/updater.h"
#include "strata/engine/config.h"
#include "strata/engine/device.h"
#include "strata/engine/layout/memory_model.h"
#include "strata/engine/layout/schedule.h"
#include "strata/kernels/cpu_optim.h"
#include "strata/models/decoder.h"

namespace strata::engine::runtime {

class StepUses {
 public:
  // What the bodies work with (all borrowed).
  struct Parts {
    const EngineConfig& cfg;  // micro_batch, seq_len, profile
    Device& dev;
    const std::vector<models::Stage*>& stages;
    const std::vector<std::string>& stage_names;
    const layout::Schedule& schedule;
    const layout::MemoryModel& memory;
    const layout::Choices& choice;
    ParameterCoordinator& params;
    ActivationStore& activations;
    HeadLoss& head_loss;
    GradientReducer& reducer;
    Updater& updater;  // where final gradients go in "backward" overlap
    UpdatePolicy& update;
    Profiler& prof;
  };

  // A step's (or an evaluation's) walk over the schedule: its position and what every use adds to.
  struct Pass {
    bool training = true;  // false: evaluation
    size_t total = 0;      // uses in the step (evaluation: in a micro-batch's forward, run_forward_uses)
    double denom = 1;      // loss scale x micro-batches x ranks (masked: the loss scale, the
                           // count is in head_scale): the gradients' divisor
    bool masked = false;   // a loss mask: the head sums its losses (the mean is over the step)
    double loss_tokens = 0;  // global targets in the loss (masked)
    double head_scale = 1;   // the head's backward seed: the loss scale (masked: / loss_tokens)
    bool in_backward = false;  // optimizer.overlap "backward"
    kernels::AdamConfig backward_update;  // in_backward: the update the last micro-batch's head launches
    at::Tensor loss_sum;   // double on the device, summed in micro-batch order
    // Mixtures of experts: the load-balancing loss's backward seed (its coefficient x the loss
    // scale, masked: / (micro-batches x ranks); 0: the loss is not added), its value per
    // micro-batch summed (double on the device), and each sparse stage's expert choices summed
    // over the micro-batches (fp32 [experts] on the device, by stage).
    double aux_seed = 0;
    at::Tensor aux_sum;
    std::map<size_t, at::Tensor> expert_choices;
  };

  explicit StepUses(Parts parts);

  // Every use of a step of `micro_batches` micro-batches (ids, mask, segments: the step's, on the
  // device; mask and segments may be undefined).
  void run_step(Pass& pass, const at::Tensor& ids, const at::Tensor& mask, const at::Tensor& segments,
                int64_t micro_batches);
  // Each micro-batch's forward uses and its loss (evaluation).
  void run_forward(Pass& pass, const at::Tensor& ids, const at::Tensor& mask, const at::Tensor& segments,
                   int64_t micro_batches);
  // After the step's last use: every checkpoint back, every gradient accumulated and written.
  void finish_backward();
  // After a failure: the kept graphs' device memory and reservations go now.
  void drop_graphs() { kept_graphs_.clear(); }

  // Profiling: a step's compute spans, timed on the compute stream against an event recorded at
  // its start; take_compute waits for the compute stream, adds the spans to the trace and
  // returns their total seconds.
  void begin_profile();
  double take_compute();

 private:
  struct KeptGraph {
    at::Tensor input, output;  // input.grad() is the backward's result
    at::Tensor probability_sum;  // a sparse block's router probabilities (RouterStats), in the graph
    Device::Reservation res;
  };
  struct MicroBatch {
    at::Tensor inputs, targets;   // targets out of the loss are HeadLoss::kIgnored
    models::TokenLayout layout;   // packed examples, or one sequence a row
    at::Tensor x;                 // the boundary activation going forward
    Device::Reservation x_res;    // its device bytes
    at::Tensor dy;                // the gradient going backward
    bool last = false;            // the step's last micro-batch
    HeadLoss::VocabPass head;     // vocabulary tiles only
    // Its sparse blocks' routing, summed over them as their forwards run: choices and router
    // probabilities per expert, tokens routed; after the last, the gradient of the
    // load-balancing loss (times its seed) with respect to each block's probability sums.
    at::Tensor choices, probabilities, aux_grad;
    int64_t routed = 0;
    bool routing_done = false;
  };
  class Runner;  // the step driver's UseRunner over these bodies

  MicroBatch begin_micro_batch(const at::Tensor& ids, const at::Tensor& mask, const at::Tensor& segments, int64_t m);
  void forward_use(Pass& pass, MicroBatch& mb, size_t stage, size_t k);
  void head_use(Pass& pass, MicroBatch& mb, size_t stage, size_t k);
  void backward_use(Pass& pass, MicroBatch& mb, size_t stage, size_t k);
  void vocab_head_backward(MicroBatch& mb, size_t stage);
  // A sparse block's routing after its forward; the micro-batch's load-balancing loss once every
  // block ran (before the head's backward).
  void note_routing(Pass& pass, MicroBatch& mb, size_t stage);
  void finish_routing(Pass& pass, MicroBatch& mb);
  // A stage's backward from its kept graph, or recomputed from its input `xin`.
  void backward_through(MicroBatch& mb, size_t s, const at::Tensor& xin);
  // The next backward uses' checkpoints, brought back while use k runs.
  void bring_back_checkpoints(size_t k);

  bool kept(size_t s) const { return p_.memory.keeps_graph(s, p_.choice); }
  bool checkpointed(size_t s) const { return p_.memory.checkpointed(s, p_.choice); }
  std::shared_ptr<Event> compute_mark() {
    return p_.cfg.profile ? p_.dev.record_timed(p_.dev.compute_stream()) : nullptr;
  }
  void compute_span(std::string name, const std::shared_ptr<Event>& begin) {
    if (begin) compute_spans_.emplace_back(std::move(name), begin, p_.dev.record_timed(p_.dev.compute_stream()));
  }

  Parts p_;
  std::vector<KeptGraph> kept_graphs_;  // by stage, for the micro-batch in flight
  std::shared_ptr<Event> step_ref_;
  Profiler::Clock::time_point step_ref_host_;
  std::vector<std::tuple<std::string, std::shared_ptr<Event>, std::shared_ptr<Event>>> compute_spans_;
};

}  // namespace strata::engine::runtime
