// Evaluation: the schedule's forward uses and the head per micro-batch, without autograd, through
// the same coordinator as a step (gathers and releases by use), then one all-reduce of the loss
// sum and the counted targets.
#include "engine_impl.h"

namespace strata::engine {

// The forward uses and the head of each micro-batch, without autograd: a walk over the first
// stages.size() uses of the schedule, so that the coordinator gathers, prefetches and releases
// as in a step's forward; every unit is released after the head.
Engine::EvalResult Engine::Impl::evaluate(const at::Tensor& ids, const at::Tensor& loss_mask, const at::Tensor& segments) {
  at::NoGradGuard no_grad;
  const size_t n = stages.size(), head = n - 1;
  const int64_t b = cfg.micro_batch, micro_batches = ids.size(0) / b;
  const at::Tensor mask = loss_mask.defined() ? loss_mask : at::ones({ids.size(0), cfg.seq_len}, at::kByte);
  const at::Tensor ids_on_device = to_device(ids), mask_on_device = to_device(mask),
                   segments_on_device = to_device(segments);
  // Waits here are not the next step's: its timeline and the prefetch tuner must not see them.
  const double waited_before = prof.step.wait_params;
  at::Tensor loss_sum = at::zeros({}, at::TensorOptions().dtype(at::kDouble).device(dev.torch_device()));
  for (int64_t m = 0; m < micro_batches; ++m) {
    MicroBatch mb = begin_micro_batch(ids_on_device, mask_on_device, segments_on_device, m);
    // The schedule's forward uses, up to the head's (use k is stage k's: forward first).
    for (size_t s = 0; uses()[s].kind == Use::kForward; ++s) {
      params->acquire(s);
      params->prefetch(s, n);
      if (schedule->is_head(s)) {
        head_loss->vocab_forward(mb.head, mb.x, mb.targets, s - schedule->first_head(), /*grad=*/false);
        params->release_after(s, n);
        continue;
      }
      at::Tensor y = schedule->is_embedding(s) && s > 0 ? mb.x + stages[s]->forward(mb.inputs, mb.layout)
                                                        : stages[s]->forward(mb.x, mb.layout);
      Device::Reservation y_res = dev.reserve(uint64_t(y.nbytes()), "activation of unit " + stage_names[s]);
      mb.x = y;
      mb.x_res = std::move(y_res);
      params->release_after(s, n);
    }
    params->acquire(head);
    if (schedule->vocab_tiled()) {
      head_loss->vocab_forward(mb.head, mb.x, mb.targets, head - schedule->first_head(), /*grad=*/false);
      loss_sum += head_loss->vocab_loss(mb.head, mb.targets, /*masked=*/true, 1.0).to(at::kDouble);
      mb.head = runtime::HeadLoss::VocabPass{};
    } else {
      const Device::Reservation loss_res = head_loss->reserve();
      loss_sum += head_loss->whole(mb.x, mb.targets, /*masked=*/true).to(at::kDouble);
    }
    mb.x = at::Tensor();
    params->release_after(head, n);
  }
  prof.step.wait_params = waited_before;
  at::Tensor red = at::tensor({loss_sum.item<double>(), double(mask.ne(0).sum().item<int64_t>())},
                              at::TensorOptions().dtype(at::kDouble));
  comm.all_reduce(red, ReduceOp::kSum);
  return {red[0].item<double>(), uint64_t(red[1].item<double>())};
}

}  // namespace strata::engine
