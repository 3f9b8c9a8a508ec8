// Evaluation: the schedule's forward uses and the head per micro-batch, without autograd, through
// the step driver (run_forward_uses) and the step's own use bodies (runtime/step_uses.h, with a
// Pass that does not train), so the coordinator gathers, prefetches and releases as in a step's
// forward; then one all-reduce of the loss sum and the counted targets.
#include "engine_impl.h"

#include <ATen/ops/ones.h>

#include "runtime/step_driver.h"

namespace strata::engine {

Engine::EvalResult Engine::Impl::evaluate(const at::Tensor& ids, const at::Tensor& loss_mask, const at::Tensor& segments) {
  at::NoGradGuard no_grad;
  const int64_t micro_batches = ids.size(0) / cfg.micro_batch;
  const at::Tensor mask = loss_mask.defined() ? loss_mask : at::ones({ids.size(0), cfg.seq_len}, at::kByte);
  Pass pass;
  pass.training = false;
  pass.total = runtime::forward_uses(*schedule);
  pass.masked = true;  // a sum over the counted targets; the mean is taken over every rank's below
  pass.head_scale = 1;
  const at::Tensor ids_on_device = to_device(ids), mask_on_device = to_device(mask);
  // Waits here are not the next step's: its timeline and the prefetch tuner must not see them.
  const double waited_before = prof.step.wait_params;
  uses_run->run_forward(pass, ids_on_device, mask_on_device, segments.defined() ? segments.cpu() : segments,
                        micro_batches);
  prof.step.wait_params = waited_before;
  const double loss_sum = pass.loss_sum.defined() ? pass.loss_sum.item<double>() : 0.0;
  at::Tensor red = at::tensor({loss_sum, double(mask.ne(0).sum().item<int64_t>())}, at::TensorOptions().dtype(at::kDouble));
  comm.all_reduce(red, ReduceOp::kSum);
  return {red[0].item<double>(), uint64_t(red[1].item<double>())};
}

}  // namespace strata::engine
