// One training step over the schedule: forward (acquire, run, keep the activation, release), the
// head, backward (acquire, recompute or use the kept graph, backprop, reduce, release); then the
// norm, the update and the loss scale.
#include "engine_impl.h"

#include <ATen/core/Reduction.h>
#include <ATen/ops/full.h>
#include <ATen/ops/ones.h>
#include <ATen/ops/where.h>

#include "strata/tiling/linear_cross_entropy.h"

namespace strata::engine {

StepTimeline Engine::Impl::finish_timeline() {
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

// The step reads like the schedule: every micro-batch runs the forward uses, the head and the
// backward uses; then the norm, the update and the loss scale.
void Engine::Impl::fail_step() {
  broken = true;
  abort_update();       // "backward": it may wait for gradients that will not come
  kept_graphs.clear();  // their device memory and reservations go now
  if (params) params->begin_micro_batch();
}

// The step's token ids go up once, asynchronously from pinned memory, and the loss is summed
// where it is computed and read once, after the backward: on a GPU, a pageable upload or a
// loss read per micro-batch would each block the host until the device caught up.
at::Tensor Engine::Impl::to_device(const at::Tensor& t) {
  if (!t.defined()) return t;
  return dev.upload(t);
}

StepResult Engine::Impl::train_step(const at::Tensor& ids, const at::Tensor& loss_mask, const at::Tensor& segments) {
  const auto t0 = std::chrono::steady_clock::now();
  const int64_t A = cfg.grad_accum;
  Pass pass;
  pass.total = uses().size() * size_t(A);
  pass.denom = loss_scaler.scale() * double(A) * comm.world_size();  // the gradients' sum over the global batch
  pass.head_scale = loss_scaler.scale();
  pass.masked = loss_mask.defined();
  if (pass.masked) {
    // The mean is over the whole global batch's counted targets: their number first. The head
    // backpropagates its sum divided by it (times the loss scale), so that fp16 gradients have
    // the magnitude of a mean's.
    at::Tensor count = at::tensor({double(loss_mask.ne(0).sum().item<int64_t>())}, at::TensorOptions().dtype(at::kDouble));
    comm.all_reduce(count, ReduceOp::kSum);
    pass.loss_tokens = count.item<double>();
    if (pass.loss_tokens == 0) return skipped_step(t0);  // nothing to learn from: no update
    pass.head_scale = loss_scaler.scale() / pass.loss_tokens;
    pass.denom = loss_scaler.scale();
  }
  pass.in_backward = updates_in_backward();
  const at::Tensor ids_on_device = to_device(ids), mask_on_device = to_device(loss_mask),
                   segments_on_device = to_device(segments);
  if (cfg.profile) {
    compute_spans.clear();
    step_ref = dev.record_timed(dev.compute_stream());
    step_ref_host = Profiler::Clock::now();
  }
  StepRunner runner(*this, pass, ids_on_device, mask_on_device, segments_on_device);
  runtime::run_step_uses(*schedule, A, runner);
  finish_backward();
  // "backward": the device's units (a split optimizer group's first ones, final last) are
  // updated now, on the compute stream, while the updater may still run.
  if (pass.in_backward) update_device_units(adam_config(1.0 / pass.denom), &updater->unit_sumsq());
  // "forward": the last update was done long ago (the forward gathered every unit); "backward":
  // this step's update, whose last units may still be running.
  finish_update();
  const int depth_used = params->depth();
  StepResult r = reduce_norm_and_loss(pass, t0);
  apply_update(pass, r);
  reducer->end_step();
  loss_scaler.update(r.skipped);
  r.step = step;
  r.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  r.tokens = uint64_t(A * cfg.micro_batch * cfg.seq_len) * uint64_t(comm.world_size());
  r.loss_tokens = pass.masked ? uint64_t(pass.loss_tokens) : r.tokens;
  r.model_tflops = flops_per_token() * double(r.tokens) / r.seconds / 1e12;
  r.timeline = finish_timeline();
  r.timeline.prefetch = depth_used;
  return r;
}

// Head stage s's backward in vocabulary tiles; the first tile's gives the gradient going back.
void Engine::Impl::vocab_head_backward(MicroBatch& mb, size_t s) {
  const at::Tensor dy = head_loss->vocab_backward(mb.head, mb.targets, s - schedule->first_head());
  if (dy.defined()) mb.dy = dy;
}

// The step's uses (runtime/step_driver.h) on this engine: each micro-batch's activations and
// loss live in `mb`, from its begin to its end.
void Engine::Impl::StepRunner::begin_micro_batch(int64_t m, bool last) {
  mb = I.begin_micro_batch(ids, mask, segments, m);
  mb.last = last;
}

void Engine::Impl::StepRunner::head(size_t s, size_t k) {
  // "backward" overlap: the update starts with the last micro-batch's backward.
  if (pass.in_backward && mb.last) I.updater->launch_in_backward(I.adam_config(1.0 / pass.denom), I.holds->waiter());
  I.head_use(pass, mb, s, k);
  if (I.choice().activations != Placement::kDevice) {
    // The forward's inputs stay alive in the copy queue beyond their reservations until copied
    // down: that ends here.
    auto t = I.prof.time(I.prof.step.wait_activations, "wait activations");
    I.dev.synchronize(I.dev.d2h_stream());
  }
}

Engine::Impl::MicroBatch Engine::Impl::begin_micro_batch(const at::Tensor& ids_on_device,
                                                          const at::Tensor& mask_on_device,
                                                          const at::Tensor& segments_on_device, int64_t m) {
  const int64_t b = cfg.micro_batch, T = cfg.seq_len;
  MicroBatch mb;
  const at::Tensor rows = ids_on_device.narrow(0, m * b, b);
  mb.inputs = rows.narrow(1, 0, T).contiguous();
  mb.targets = rows.narrow(1, 1, T).reshape(-1);
  if (mask_on_device.defined())
    mb.targets = at::where(mask_on_device.narrow(0, m * b, b).reshape(-1).ne(0), mb.targets,
                           at::full({}, kIgnored, mb.targets.options()));
  if (segments_on_device.defined()) mb.layout = models::TokenLayout(segments_on_device.narrow(0, m * b, b));
  mb.x = mb.inputs;
  activations->begin_micro_batch();
  kept_graphs.clear();
  kept_graphs.resize(stages.size());
  params->begin_micro_batch();
  return mb;
}

// Stage s forward: without autograd (recomputed later from its checkpoint), or with it for a
// kept block, whose graph ends at its detached input so that its backward runs on its own.
void Engine::Impl::forward_use(Pass& pass, MicroBatch& mb, size_t s, size_t k) {
  if (kept(s)) {  // before the gathers, which must leave room for it
    kept_graphs.at(s).res = dev.reserve(memory->sizes().graph(s), "autograd graph of unit " + stage_names[s]);
    params->graph_reserved(s);
  }
  params->acquire(k);
  params->prefetch(k, pass.total);
  if (schedule->is_head(s)) {  // a vocabulary tile of the head: the activation stays as it is
    const auto mark = compute_mark();
    head_loss->vocab_forward(mb.head, mb.x, mb.targets, s - schedule->first_head(), /*grad=*/true);
    compute_span("forward " + stage_names[s], mark);
    params->release_after(k, pass.total);
    return;
  }
  at::Tensor y;
  const auto mark = compute_mark();
  if (kept(s)) {
    KeptGraph& g = kept_graphs.at(s);
    g.input = mb.x.detach().requires_grad_(true);
    g.output = stages[s]->forward(g.input, mb.layout);
    y = g.output.detach();
    params->hold(s);
  } else if (schedule->is_embedding(s) && s > 0) {  // a vocabulary tile adds its rows' lookup
    at::NoGradGuard no_grad;
    y = mb.x + stages[s]->forward(mb.inputs, mb.layout);
  } else {
    at::NoGradGuard no_grad;
    y = stages[s]->forward(mb.x, mb.layout);
  }
  compute_span("forward " + stage_names[s], mark);
  Device::Reservation y_res = dev.reserve(uint64_t(y.nbytes()), "activation of unit " + stage_names[s]);
  if (checkpointed(s)) activations->put(s, mb.x, mb.x_res);  // stage 0 recomputes from the token ids
  mb.x = y;
  mb.x_res = std::move(y_res);  // a kept stage's input: in its graph (graph_bytes) from here
  params->release_after(k, pass.total);
}

// The head: forward, token-mean cross entropy in fp32 (times the loss scale) and backward.
void Engine::Impl::head_use(Pass& pass, MicroBatch& mb, size_t head, size_t k) {
  params->acquire(k);
  params->prefetch(k, pass.total);
  const auto mark = compute_mark();
  at::Tensor loss;
  if (schedule->vocab_tiled()) {
    head_loss->vocab_forward(mb.head, mb.x, mb.targets, head - schedule->first_head(), /*grad=*/true);
    loss = head_loss->vocab_loss(mb.head, mb.targets, pass.masked, pass.head_scale);
    vocab_head_backward(mb, head);
  } else {
    const Device::Reservation loss_res = head_loss->reserve();
    at::Tensor xh = mb.x.detach().requires_grad_(true);
    loss = head_loss->whole(xh, mb.targets, pass.masked, pass.head_scale);
    torch::autograd::backward({loss * pass.head_scale});
    mb.dy = xh.grad();
  }
  compute_span("forward+backward " + stage_names[head], mark);
  const at::Tensor loss_d = loss.detach().to(at::kDouble);  // summed in micro-batch order as the host would
  pass.loss_sum = pass.loss_sum.defined() ? pass.loss_sum + loss_d : loss_d;
  mb.x = at::Tensor();
  reducer->reduce(head);
  if (pass.in_backward && mb.last) reducer->hand_final_gradients(head, *updater);
  params->release_after(k, pass.total);
}

// Stage s backward: through its kept graph, or recomputed from its checkpoint (stage 0 from the
// token ids); the next checkpoints are brought back while it runs.
void Engine::Impl::backward_use(Pass& pass, MicroBatch& mb, size_t s, size_t k) {
  params->acquire(k);
  params->prefetch(k, pass.total);
  if (schedule->is_head(s)) {  // a vocabulary tile of the head (the first also its norm)
    const auto mark = compute_mark();
    vocab_head_backward(mb, s);
    compute_span("backward " + stage_names[s], mark);
    reducer->reduce(s);
    if (pass.in_backward && mb.last) reducer->hand_final_gradients(s, *updater);
    params->release_after(k, pass.total);
    return;
  }
  at::Tensor xin;
  Device::Reservation in_res;
  if (schedule->is_embedding(s)) {
    xin = mb.inputs;
  } else if (checkpointed(s)) {
    xin = activations->take(s, in_res);
    xin.requires_grad_(true);
  }
  if (s > 1 && checkpointed(s - 1)) activations->fetch(s - 1);  // copied back while this stage runs
  if (s > 2 && checkpointed(s - 2)) activations->read_ahead(s - 2);  // NVMe: read a stage earlier still
  if (kept(s)) {
    KeptGraph g = std::move(kept_graphs.at(s));
    const auto mark = compute_mark();
    torch::autograd::backward({g.output}, {mb.dy});
    compute_span("backward " + stage_names[s], mark);
    mb.dy = g.input.grad();
    g = KeptGraph{};  // the graph's memory, then its reservation
    params->graph_freed(s);
    params->unhold(s);
  } else {
    // The recompute's graph: the use's running scratch counts it (MemoryModel::running_scratch).
    Device::Reservation graph_res;
    if (schedule->is_block(s))
      graph_res = dev.reserve(memory->sizes().graph(s), "autograd graph of unit " + stage_names[s] + " (recomputed)");
    const auto mark = compute_mark();
    at::Tensor y = stages[s]->forward(xin, mb.layout);
    torch::autograd::backward({y}, {mb.dy});
    compute_span("recompute+backward " + stage_names[s], mark);
    y = at::Tensor();
    // An embedding tile's gradient passes on as it came (the tiles' outputs are summed).
    if (!schedule->is_embedding(s)) mb.dy = xin.grad();
    else if (s == 0) mb.dy = at::Tensor();
  }
  reducer->reduce(s);
  if (pass.in_backward && mb.last) reducer->hand_final_gradients(s, *updater);
  params->release_after(k, pass.total);
}

void Engine::Impl::finish_backward() {
  activations->prune();  // every checkpoint came back, so every staging buffer can go
  auto t = prof.time(prof.step.wait_grads, "wait gradients");
  dev.synchronize(dev.d2h_stream());  // host gradient accumulation done
  reducer->finish_writes();           // NVMe: and written
  // Every upload is done by now (the compute stream waited for each); this rethrows a failed
  // swap read of a gather or a checkpoint, which would otherwise go unnoticed.
  dev.synchronize(dev.h2d_stream());
}

// A step whose global batch has no target in the loss: no forward, no update (the optimizer's
// step count and the loss scale stay); the loss is NaN, as a mean over nothing.
StepResult Engine::Impl::skipped_step(std::chrono::steady_clock::time_point t0) {
  StepResult r;
  r.step = step;
  r.loss = std::numeric_limits<double>::quiet_NaN();
  r.skipped = true;
  r.loss_scale = loss_scaler.scale();
  r.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  r.tokens = uint64_t(cfg.grad_accum * cfg.micro_batch * cfg.seq_len) * uint64_t(comm.world_size());
  r.loss_tokens = 0;
  r.timeline = prof.take_step();
  return r;
}

// Global norm and loss in one all-reduce: [local sum of squares, local loss sum], with every
// rank's wait for parameters and time so far, so that the prefetch decision is the same on
// every rank (their gathers must stay in step).
StepResult Engine::Impl::reduce_norm_and_loss(const Pass& pass, std::chrono::steady_clock::time_point t0) {
  auto t = prof.time(prof.step.norm, "gradient norm");
  StepResult r;
  double sumsq = 0;
  if (pass.in_backward)
    for (double v : updater->unit_sumsq()) sumsq += v;
  else
    sumsq = optimizer->local_sum_squares();
  const double elapsed = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  const double loss_sum = pass.loss_sum.item<double>();
  at::Tensor red = at::tensor({sumsq, loss_sum, prof.step.wait_params, elapsed}, at::TensorOptions().dtype(at::kDouble));
  comm.all_reduce(red, ReduceOp::kSum);
  r.loss = red[1].item<double>() / (pass.masked ? pass.loss_tokens : double(cfg.grad_accum) * comm.world_size());
  r.grad_norm = std::sqrt(red[0].item<double>()) / pass.denom;
  if (cfg.prefetch_auto)
    params->set_depth(prefetch_tuner.next(red[2].item<double>() / std::max(red[3].item<double>(), 1e-9)));
  r.loss_scale = loss_scaler.scale();
  r.skipped = !std::isfinite(r.grad_norm);
  return r;
}

// The update of a finished step: already applied ("backward"), launched on the updater
// ("forward"), or run here; a non-finite norm skips it (or, already applied, fails the step).
void Engine::Impl::apply_update(const Pass& pass, const StepResult& r) {
  if (pass.in_backward) {
    if (r.skipped)
      throw std::runtime_error("step " + std::to_string(step + 1) + ": the gradient norm is " +
                               std::to_string(r.grad_norm) + " and optimizer.overlap \"backward\" "
                               "has already applied the update, so the weights are no longer usable: "
                               "restart from a checkpoint (overlap true or false skips such steps)");
    ++step;
    return;
  }
  if (r.skipped) return;
  double coef = 1.0;
  if (cfg.clip_grad_norm > 0) coef = std::min(1.0, cfg.clip_grad_norm / (r.grad_norm + 1e-6));
  const kernels::AdamConfig ac = adam_config(coef / pass.denom);
  if (overlaps_update()) {
    launch_update(ac);
  } else {
    const double before = prof.step.optimizer;
    double waited = 0;  // for a checkpoint's snapshot: not optimizer work
    {
      auto t = prof.time(prof.step.optimizer, "optimizer");
      optimizer_step(ac, holds->waiter(&waited));
    }
    prof.step.optimizer -= waited;
    prof.step.optimizer_exposed += prof.step.optimizer - before;
  }
  ++step;
}

void Engine::Impl::optimizer_step(const kernels::AdamConfig& ac, const state::HoldGate::Waiter& before_write) {
  optimizer->update_on_device(ac, units_where(true), nullptr, before_write);
  const std::vector<size_t> rest = units_where(false);
  if (!rest.empty()) optimizer->update_on_cpu(ac, rest, {}, nullptr, before_write);
}

void Engine::Impl::update_device_units(const kernels::AdamConfig& ac, std::vector<double>* sumsq) {
  const std::vector<size_t> which = units_where(true);
  if (which.empty()) return;
  const double before = prof.step.optimizer;
  double waited = 0;  // for a checkpoint's snapshot: not optimizer work
  {
    auto t = prof.time(prof.step.optimizer, "optimizer (device)");
    optimizer->update_on_device(ac, which, sumsq, holds->waiter(&waited));
    if (cfg.profile) dev.synchronize(dev.compute_stream());  // the kernel's time, not its launch's
  }
  prof.step.optimizer -= waited;
  prof.step.optimizer_exposed += prof.step.optimizer - before;
}


}  // namespace strata::engine
