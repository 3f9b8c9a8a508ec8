// The bodies of a step's uses (step_uses.h).
#include "runtime/step_uses.h"

#include <ATen/ops/full.h>
#include <ATen/ops/where.h>
#include <c10/core/GradMode.h>
#include <torch/csrc/autograd/autograd.h>

#include <chrono>
#include <stdexcept>

#include "runtime/step_driver.h"

namespace strata::engine::runtime {

// The step driver's runner: each micro-batch's activations and loss live in `mb`, from its begin
// to its end.
class StepUses::Runner final : public UseRunner {
 public:
  Runner(StepUses& uses, Pass& pass, const at::Tensor& ids, const at::Tensor& mask, const at::Tensor& segments)
      : u_(uses), pass_(pass), ids_(ids), mask_(mask), segments_(segments) {}
  void begin_micro_batch(int64_t m, bool last) override {
    mb_ = u_.begin_micro_batch(ids_, mask_, segments_, m);
    mb_.last = last;
  }
  void end_micro_batch() override { mb_ = MicroBatch{}; }
  void forward(size_t s, size_t k) override { u_.forward_use(pass_, mb_, s, k); }
  void head(size_t s, size_t k) override {
    // "backward" overlap: the update starts with the last micro-batch's backward.
    if (pass_.in_backward && mb_.last) u_.p_.update.launch_in_backward(pass_.backward_update);
    u_.head_use(pass_, mb_, s, k);
    if (pass_.training && u_.p_.choice.activations != Placement::kDevice) {
      // The forward's inputs stay alive in the copy queue beyond their reservations until copied
      // down: that ends here.
      auto t = u_.p_.prof.time(u_.p_.prof.step.wait_activations, "wait activations");
      u_.p_.dev.synchronize(u_.p_.dev.d2h_stream());
    }
  }
  void backward(size_t s, size_t k) override {
    if (!pass_.training) throw std::logic_error("evaluation runs no backward use");
    u_.backward_use(pass_, mb_, s, k);
  }

 private:
  StepUses& u_;
  Pass& pass_;
  const at::Tensor& ids_;       // the step's token ids on the device
  const at::Tensor& mask_;      // and its loss mask (undefined: none)
  const at::Tensor& segments_;  // and its examples' segments (undefined: one sequence a row)
  MicroBatch mb_;
};

StepUses::StepUses(Parts parts) : p_(parts) {}

void StepUses::run_step(Pass& pass, const at::Tensor& ids, const at::Tensor& mask, const at::Tensor& segments,
                        int64_t micro_batches) {
  Runner runner(*this, pass, ids, mask, segments);
  run_step_uses(p_.schedule, micro_batches, runner);
}

void StepUses::run_forward(Pass& pass, const at::Tensor& ids, const at::Tensor& mask, const at::Tensor& segments,
                           int64_t micro_batches) {
  Runner runner(*this, pass, ids, mask, segments);
  run_forward_uses(p_.schedule, micro_batches, runner);
}

StepUses::MicroBatch StepUses::begin_micro_batch(const at::Tensor& ids, const at::Tensor& mask,
                                                 const at::Tensor& segments, int64_t m) {
  const int64_t b = p_.cfg.micro_batch, T = p_.cfg.seq_len;
  MicroBatch mb;
  const at::Tensor rows = ids.narrow(0, m * b, b);
  mb.inputs = rows.narrow(1, 0, T).contiguous();
  mb.targets = rows.narrow(1, 1, T).reshape(-1);
  if (mask.defined())
    mb.targets = at::where(mask.narrow(0, m * b, b).reshape(-1).ne(0), mb.targets,
                           at::full({}, HeadLoss::kIgnored, mb.targets.options()));
  if (segments.defined()) mb.layout = models::TokenLayout(segments.narrow(0, m * b, b));
  mb.x = mb.inputs;
  p_.activations.begin_micro_batch();
  kept_graphs_.clear();
  kept_graphs_.resize(p_.stages.size());
  p_.params.begin_micro_batch();
  return mb;
}

// Stage s forward: without autograd (recomputed later from its checkpoint), or with it for a
// kept block, whose graph ends at its detached input so that its backward runs on its own.
void StepUses::forward_use(Pass& pass, MicroBatch& mb, size_t s, size_t k) {
  const bool keep = pass.training && kept(s);  // evaluation keeps no graph and no checkpoint
  if (keep) {  // before the gathers, which must leave room for it
    kept_graphs_.at(s).res = p_.dev.reserve(p_.memory.sizes().graph(s), "autograd graph of unit " + p_.stage_names[s]);
    p_.params.graph_reserved(s);
  }
  p_.params.acquire(k);
  p_.params.prefetch(k, pass.total);
  if (p_.schedule.is_head(s)) {  // a vocabulary tile of the head: the activation stays as it is
    if (pass.training) finish_routing(pass, mb);
    const auto mark = compute_mark();
    p_.head_loss.vocab_forward(mb.head, mb.x, mb.targets, s - p_.schedule.first_head(), /*grad=*/pass.training);
    compute_span("forward " + p_.stage_names[s], mark);
    p_.params.release_after(k, pass.total);
    return;
  }
  at::Tensor y;
  const auto mark = compute_mark();
  if (keep) {
    KeptGraph& g = kept_graphs_.at(s);
    g.input = mb.x.detach().requires_grad_(true);
    g.output = p_.stages[s]->forward(g.input, mb.layout);
    if (const models::RouterStats* r = p_.stages[s]->router_stats()) g.probability_sum = r->probability_sum;
    y = g.output.detach();
    p_.params.hold(s);
  } else if (p_.schedule.is_embedding(s) && s > 0) {  // a vocabulary tile adds its rows' lookup
    at::NoGradGuard no_grad;
    y = mb.x + p_.stages[s]->forward(mb.inputs, mb.layout);
  } else {
    at::NoGradGuard no_grad;
    y = p_.stages[s]->forward(mb.x, mb.layout);
  }
  compute_span("forward " + p_.stage_names[s], mark);
  if (pass.training) note_routing(pass, mb, s);
  Device::Reservation y_res = p_.dev.reserve(uint64_t(y.nbytes()), "activation of unit " + p_.stage_names[s]);
  if (pass.training && checkpointed(s)) p_.activations.put(s, mb.x, mb.x_res);  // stage 0 recomputes from the token ids
  mb.x = y;
  mb.x_res = std::move(y_res);  // a kept stage's input: in its graph (graph_bytes) from here
  p_.params.release_after(k, pass.total);
}

// The head: forward, token-mean cross entropy in fp32 (times the loss scale) and, training, its
// backward.
void StepUses::head_use(Pass& pass, MicroBatch& mb, size_t head, size_t k) {
  p_.params.acquire(k);
  p_.params.prefetch(k, pass.total);
  if (pass.training) finish_routing(pass, mb);
  const auto mark = compute_mark();
  at::Tensor loss;
  if (p_.schedule.vocab_tiled()) {
    p_.head_loss.vocab_forward(mb.head, mb.x, mb.targets, head - p_.schedule.first_head(), /*grad=*/pass.training);
    loss = p_.head_loss.vocab_loss(mb.head, mb.targets, pass.masked, pass.head_scale);
    if (pass.training) vocab_head_backward(mb, head);
    else mb.head = HeadLoss::VocabPass{};
  } else if (pass.training) {
    const Device::Reservation loss_res = p_.head_loss.reserve();
    at::Tensor xh = mb.x.detach().requires_grad_(true);
    loss = p_.head_loss.whole(xh, mb.targets, pass.masked, pass.head_scale);
    torch::autograd::backward({loss * pass.head_scale});
    mb.dy = xh.grad();
  } else {
    const Device::Reservation loss_res = p_.head_loss.reserve();
    loss = p_.head_loss.whole(mb.x, mb.targets, pass.masked, pass.head_scale);
  }
  compute_span((pass.training ? "forward+backward " : "forward ") + p_.stage_names[head], mark);
  const at::Tensor loss_d = loss.detach().to(at::kDouble);  // summed in micro-batch order as the host would
  pass.loss_sum = pass.loss_sum.defined() ? pass.loss_sum + loss_d : loss_d;
  mb.x = at::Tensor();
  if (pass.training) {
    p_.reducer.reduce(head);
    if (pass.in_backward && mb.last) p_.reducer.hand_final_gradients(head, p_.updater);
  }
  p_.params.release_after(k, pass.total);
}

// Sums a sparse block's routing into the micro-batch's (its values only: a kept block's
// probabilities keep their graph in its KeptGraph, a recomputed one's come again in its backward).
void StepUses::note_routing(Pass& pass, MicroBatch& mb, size_t s) {
  const models::RouterStats* r = p_.stages[s]->router_stats();
  if (!r) return;
  const at::Tensor choices = r->selections, probs = r->probability_sum.detach();
  mb.choices = mb.choices.defined() ? mb.choices + choices : choices;
  mb.probabilities = mb.probabilities.defined() ? mb.probabilities + probs : probs;
  mb.routed += r->tokens;
  at::Tensor& step_choices = pass.expert_choices[s];
  step_choices = step_choices.defined() ? step_choices + choices : choices;
}

// transformers' load_balancing_loss_func over the micro-batch's sparse blocks: with C_e the
// top-k choices of expert e and P_e its router probabilities summed over every block and token,
// and R the tokens routed summed over the blocks, loss = experts x sum_e C_e P_e / R^2. The
// counts carry no gradient, so the gradient of each block's probability sums is
// experts x C / R^2 (times the seed), which its backward adds to its output's.
void StepUses::finish_routing(Pass& pass, MicroBatch& mb) {
  if (mb.routing_done || !mb.choices.defined()) return;
  mb.routing_done = true;
  const double experts = double(mb.choices.size(0)), rows = double(mb.routed);
  const at::Tensor scaled = mb.choices * (experts / (rows * rows));
  const at::Tensor aux = (scaled * mb.probabilities).sum().to(at::kDouble);
  pass.aux_sum = pass.aux_sum.defined() ? pass.aux_sum + aux : aux;
  if (pass.aux_seed != 0) mb.aux_grad = scaled * pass.aux_seed;
}

// Head stage s's backward in vocabulary tiles; the first tile's gives the gradient going back.
void StepUses::vocab_head_backward(MicroBatch& mb, size_t s) {
  const at::Tensor dy = p_.head_loss.vocab_backward(mb.head, mb.targets, s - p_.schedule.first_head());
  if (dy.defined()) mb.dy = dy;
}

// Stage s backward: through its kept graph, or recomputed from its checkpoint (stage 0 from the
// token ids); the next checkpoints are brought back while it runs.
void StepUses::backward_use(Pass& pass, MicroBatch& mb, size_t s, size_t k) {
  p_.params.acquire(k);
  p_.params.prefetch(k, pass.total);
  if (p_.schedule.is_head(s)) {  // a vocabulary tile of the head (the first also its norm)
    const auto mark = compute_mark();
    vocab_head_backward(mb, s);
    compute_span("backward " + p_.stage_names[s], mark);
  } else {
    at::Tensor xin;
    Device::Reservation in_res;
    if (p_.schedule.is_embedding(s)) {
      xin = mb.inputs;
    } else if (checkpointed(s)) {
      xin = p_.activations.take(s, in_res);
      xin.requires_grad_(true);
    }
    bring_back_checkpoints(k);
    backward_through(mb, s, xin);
  }
  p_.reducer.reduce(s);
  if (pass.in_backward && mb.last) p_.reducer.hand_final_gradients(s, p_.updater);
  p_.params.release_after(k, pass.total);
}

// The next backward uses' checkpoints (the schedule's): the next one copied back while this stage
// runs, the one after it read from NVMe a stage earlier still.
void StepUses::bring_back_checkpoints(size_t k) {
  const auto checkpointed_ahead = [&](size_t ahead) {
    const size_t t = p_.schedule.backward_stage_after(k, ahead);
    return t != layout::Schedule::kNoStage && checkpointed(t) ? t : layout::Schedule::kNoStage;
  };
  if (const size_t t = checkpointed_ahead(1); t != layout::Schedule::kNoStage) p_.activations.fetch(t);
  if (const size_t t = checkpointed_ahead(2); t != layout::Schedule::kNoStage) p_.activations.read_ahead(t);
}

void StepUses::backward_through(MicroBatch& mb, size_t s, const at::Tensor& xin) {
  if (kept(s)) {
    KeptGraph g = std::move(kept_graphs_.at(s));
    const auto mark = compute_mark();
    if (g.probability_sum.defined() && mb.aux_grad.defined())
      torch::autograd::backward({g.output, g.probability_sum}, {mb.dy, mb.aux_grad});
    else
      torch::autograd::backward({g.output}, {mb.dy});
    compute_span("backward " + p_.stage_names[s], mark);
    mb.dy = g.input.grad();
    g = KeptGraph{};  // the graph's memory, then its reservation
    p_.params.graph_freed(s);
    p_.params.unhold(s);
    return;
  }
  // The recompute's graph: the use's running scratch counts it (MemoryModel::running_scratch).
  Device::Reservation graph_res;
  if (p_.schedule.is_block(s))
    graph_res = p_.dev.reserve(p_.memory.sizes().graph(s), "autograd graph of unit " + p_.stage_names[s] + " (recomputed)");
  const auto mark = compute_mark();
  at::Tensor y = p_.stages[s]->forward(xin, mb.layout);
  const models::RouterStats* routing = p_.stages[s]->router_stats();
  if (routing && mb.aux_grad.defined())
    torch::autograd::backward({y, routing->probability_sum}, {mb.dy, mb.aux_grad});
  else
    torch::autograd::backward({y}, {mb.dy});
  compute_span("recompute+backward " + p_.stage_names[s], mark);
  y = at::Tensor();
  // An embedding tile's gradient passes on as it came (the tiles' outputs are summed).
  if (!p_.schedule.is_embedding(s)) mb.dy = xin.grad();
  else if (s == 0) mb.dy = at::Tensor();
}

void StepUses::finish_backward() {
  p_.activations.prune();  // every checkpoint came back, so every staging buffer can go
  auto t = p_.prof.time(p_.prof.step.wait_grads, "wait gradients");
  p_.dev.synchronize(p_.dev.d2h_stream());  // host gradient accumulation done
  p_.reducer.finish_writes();               // NVMe: and written
  // Every upload is done by now (the compute stream waited for each); this rethrows a failed
  // swap read of a gather or a checkpoint, which would otherwise go unnoticed.
  p_.dev.synchronize(p_.dev.h2d_stream());
}

void StepUses::begin_profile() {
  compute_spans_.clear();
  step_ref_ = p_.dev.record_timed(p_.dev.compute_stream());
  step_ref_host_ = Profiler::Clock::now();
}

double StepUses::take_compute() {
  p_.dev.synchronize(p_.dev.compute_stream());
  double busy = 0;
  for (auto& [name, b, e] : compute_spans_) {
    const double from = p_.dev.seconds_between(step_ref_, b), to = p_.dev.seconds_between(step_ref_, e);
    busy += to - from;
    const auto host = [&](double x) {
      return step_ref_host_ + std::chrono::duration_cast<Profiler::Clock::duration>(std::chrono::duration<double>(x));
    };
    p_.prof.span("device compute", name, host(from), host(to));
  }
  compute_spans_.clear();
  return busy;
}

}  // namespace strata::engine::runtime
