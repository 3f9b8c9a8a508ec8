// One training step: every use of the schedule (runtime/step_uses.h, in the step driver's order),
// then the norm, the update (runtime/update_policy.h) and the loss scale.
#include "engine_impl.h"

namespace strata::engine {

StepTimeline Engine::Impl::finish_timeline() {
  StepTimeline t = prof.take_step();
  if (overlaps_update()) t.optimizer_exposed += t.wait_update;
  if (cfg.profile) t.compute_busy = uses_run->take_compute();
  return t;
}

void Engine::Impl::fail_step() {
  broken = true;
  abort_update();       // "backward": it may wait for gradients that will not come
  if (uses_run) uses_run->drop_graphs();  // their device memory and reservations go now
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
  // The load-balancing loss of each micro-batch is averaged over the global batch's micro-batches.
  const models::ModelConfig::Moe& moe = model->config().moe;
  if (moe.enabled() && moe.add_aux_loss)
    pass.aux_seed = moe.aux_loss_coef * loss_scaler.scale() / (pass.masked ? double(A) * comm.world_size() : 1.0);
  pass.in_backward = updates_in_backward();
  if (pass.in_backward) pass.backward_update = adam_config(1.0 / pass.denom);
  // The segments stay on the host: the layout reads them there (models::TokenLayout), no sync.
  const at::Tensor ids_on_device = to_device(ids), mask_on_device = to_device(loss_mask);
  if (cfg.profile) uses_run->begin_profile();
  uses_run->run_step(pass, ids_on_device, mask_on_device, segments.defined() ? segments.cpu() : segments, A);
  uses_run->finish_backward();
  // "backward": the device's units (a split optimizer group's first ones, final last) are
  // updated now, on the compute stream, while the updater may still run.
  if (pass.in_backward) update->finish_in_backward(pass.backward_update);
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
  const double sumsq = update->local_sum_squares();
  const double elapsed = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  const double loss_sum = pass.loss_sum.item<double>();
  std::vector<double> sums = {sumsq, loss_sum, prof.step.wait_params, elapsed};
  // A mixture of experts: its load-balancing loss and each sparse block's choices per expert.
  if (pass.aux_sum.defined()) sums.push_back(pass.aux_sum.item<double>());
  for (const auto& [stage, choices] : pass.expert_choices) {
    const at::Tensor c = choices.to(at::kCPU, at::kDouble).contiguous();
    sums.insert(sums.end(), c.data_ptr<double>(), c.data_ptr<double>() + c.numel());
  }
  at::Tensor red = at::tensor(sums, at::TensorOptions().dtype(at::kDouble));
  comm.all_reduce(red, ReduceOp::kSum);
  const double micro_batches = double(cfg.grad_accum) * comm.world_size();
  r.loss = red[1].item<double>() / (pass.masked ? pass.loss_tokens : micro_batches);
  if (pass.aux_sum.defined()) {
    const double* x = red.data_ptr<double>() + 5;
    r.aux_loss = red[4].item<double>() / micro_batches;
    if (pass.aux_seed != 0) r.loss += model->config().moe.aux_loss_coef * r.aux_loss;
    for (const auto& [stage, choices] : pass.expert_choices) {
      const int64_t experts = choices.size(0);
      double total = 0;
      for (int64_t e = 0; e < experts; ++e) total += x[e];
      std::vector<double> shares(size_t(experts), 0.0);
      for (int64_t e = 0; e < experts; ++e) shares[size_t(e)] = total > 0 ? x[e] / total : 0;
      r.expert_shares.push_back(std::move(shares));
      x += experts;
    }
  }
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
  update->run(adam_config(coef / pass.denom));
  ++step;
}

}  // namespace strata::engine
