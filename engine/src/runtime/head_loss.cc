#include "runtime/head_loss.h"

#include <ATen/ops/cross_entropy_loss.h>
#include <ATen/ops/zeros.h>
#include <c10/core/GradMode.h>
#include <torch/csrc/autograd/autograd.h>

#include <algorithm>

namespace strata::engine::runtime {

at::Tensor HeadLoss::whole(const at::Tensor& x, const at::Tensor& targets, bool masked, double upstream) const {
  models::HeadStage& head = model_.head();
  const layout::ModelSizes& s = memory_.sizes();
  if (s.logits.tiled(s.tokens, s.vocab)) {
    const at::Tensor h = head.normed(x);
    // d(objective)/d(sum): `upstream` for a masked sum, upstream / tokens for a mean. One pass
    // computes its gradients for it in the forward.
    const double per_sum = masked ? upstream : upstream / double(std::max<int64_t>(1, targets.numel()));
    const at::Tensor sum = tiling::linear_cross_entropy_sum(
        h.reshape({-1, h.size(-1)}), head.lm_weight(), targets, int64_t(s.logits.token_chunk),
        int64_t(s.logits.vocab_tile ? s.logits.vocab_tile : s.vocab), kIgnored, s.logits.one_pass, per_sum,
        head.logit_softcap());
    return masked ? sum : sum / double(targets.numel());
  }
  const at::Tensor logits = head.forward(x);
  const at::Tensor flat = logits.reshape({-1, logits.size(-1)}).to(at::kFloat);
  if (!masked) return at::cross_entropy_loss(flat, targets);
  return at::cross_entropy_loss(flat, targets, {}, at::Reduction::Sum, kIgnored);
}

// libtorch allocates the loss's logits (or its tiles' buffers) itself; the ledger counts the bytes
// the memory model gives them, so that the budget holds what the plan assumed.
Device::Reservation HeadLoss::reserve() const {
  return dev_.reserve(memory_.head_loss_bytes(), "the head's loss (its logits; placement.tiling cuts them)");
}

void HeadLoss::vocab_forward(VocabPass& h, const at::Tensor& x, const at::Tensor& targets, size_t j,
                             bool grad) const {
  models::HeadStage& tile = model_.head_tile(j);
  if (j == 0) {
    h = VocabPass{};
    h.loss_res = reserve();
    at::AutoGradMode mode(grad);
    h.x = grad ? x.detach().requires_grad_(true) : x;
    h.normed = tile.normed(h.x);
    h.hidden = h.normed.detach().reshape({-1, h.normed.size(-1)});
    h.acc.emplace(h.hidden);
  }
  at::NoGradGuard no_grad;
  const layout::LogitsTiles t = memory_.head_logits();
  tiling::accumulate_log_sum_exp(h.hidden, tile.lm_weight(), tile.vocab_begin(), targets, int64_t(t.token_chunk),
                                 int64_t(t.vocab_tile), *h.acc, tile.logit_softcap());
}

at::Tensor HeadLoss::vocab_loss(VocabPass& h, const at::Tensor& targets, bool masked, double scale) const {
  at::NoGradGuard no_grad;
  h.lse = tiling::finish_log_sum_exp(*h.acc);
  const at::Tensor sum = tiling::loss_sum(h.lse, *h.acc, targets, kIgnored);
  h.acc.reset();
  // d loss / d (token's loss): 1 for a sum, 1 / tokens for the mean; 0 on ignored targets.
  const double per_token = masked ? scale : scale / double(targets.numel());
  h.row_scale = targets.ne(kIgnored).to(at::kFloat) * per_token;
  return masked ? sum : sum / double(targets.numel());
}

at::Tensor HeadLoss::vocab_backward(VocabPass& h, const at::Tensor& targets, size_t j) const {
  models::HeadStage& tile = model_.head_tile(j);
  {
    at::NoGradGuard no_grad;
    if (!h.grad_hidden.defined()) h.grad_hidden = at::zeros(h.hidden.sizes(), h.hidden.options().dtype(at::kFloat));
    const layout::LogitsTiles t = memory_.head_logits();
    // In the rows' dtype, as autograd gives every other parameter's.
    tile.lm_weight().mutable_grad() =
        tiling::backward_rows(h.hidden, tile.lm_weight(), tile.vocab_begin(), targets, h.lse, h.row_scale,
                              int64_t(t.token_chunk), int64_t(t.vocab_tile), h.grad_hidden, /*want_rows=*/true,
                              tile.logit_softcap());
  }
  if (j > 0) return at::Tensor();
  torch::autograd::backward({h.normed}, {h.grad_hidden.view(h.normed.sizes()).to(h.normed.scalar_type())});
  at::Tensor dy = h.x.grad();
  h = VocabPass{};
  return dy;
}

}  // namespace strata::engine::runtime
