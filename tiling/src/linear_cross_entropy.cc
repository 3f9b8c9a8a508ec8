#include "strata/tiling/linear_cross_entropy.h"

#include <ATen/ATen.h>
#include <torch/csrc/autograd/custom_function.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <stdexcept>
#include <string>

namespace strata::tiling {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

struct Tiles {
  int64_t tokens, vocab, chunk, tile;
  template <typename F>
  void each(F&& f) const {  // vocabulary tiles outside: each weight tile is read once a pass
    for (int64_t v0 = 0; v0 < vocab; v0 += tile)
      for (int64_t n0 = 0; n0 < tokens; n0 += chunk) f(v0, std::min(tile, vocab - v0), n0, std::min(chunk, tokens - n0));
  }
};

// One tile's logits in the inputs' dtype (as the untiled head computes them); minus_in_fp32
// widens them. Soft-capped (softcap > 0), they are capped in fp32.
at::Tensor tile_logits(const at::Tensor& h, const at::Tensor& w, int64_t v0, int64_t vt, int64_t n0, int64_t nt,
                       double softcap) {
  at::Tensor l = at::matmul(h.narrow(0, n0, nt), w.narrow(0, v0, vt).t());
  return softcap > 0 ? soft_cap(l.to(at::kFloat), softcap) : l;
}

// d loss / d logit from d loss / d capped logit `g` (fp32, in place), given the capped logits'
// tile: times 1 - tanh^2 = 1 - (capped / cap)^2.
void through_cap(at::Tensor& g, const at::Tensor& capped, double softcap) {
  if (softcap > 0) g.mul_(1.0 - (capped / softcap).square());
}

// l - v in fp32 (v: fp32 [rows, 1]), the same numbers either way. A GPU kernel widens a bf16/fp16
// tile as it reads it, so the promoting subtraction saves a separate widening pass; on the CPU a
// mixed-dtype operation first copies its input to fp32, so widening once and subtracting in place
// holds less (and an fp32 tile is reused).
at::Tensor minus_in_fp32(const at::Tensor& l, const at::Tensor& v) {
  const bool narrow = l.scalar_type() == at::kBFloat16 || l.scalar_type() == at::kHalf;
  if (narrow && !l.is_cpu()) return at::sub(l, v);
  return l.to(at::kFloat).sub_(v);
}

class LinearCrossEntropy : public torch::autograd::Function<LinearCrossEntropy> {
 public:
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& hidden, const at::Tensor& weight,
                            const at::Tensor& targets, int64_t chunk, int64_t tile, int64_t ignore_index,
                            double softcap) {
    LogSumExp acc(hidden);
    accumulate_log_sum_exp(hidden, weight, 0, targets, chunk, tile, acc, softcap);
    at::Tensor lse = finish_log_sum_exp(acc);
    at::Tensor loss = loss_sum(lse, acc, targets, ignore_index);
    ctx->save_for_backward({hidden, weight, targets, lse});
    ctx->saved_data["chunk"] = chunk;
    ctx->saved_data["tile"] = tile;
    ctx->saved_data["ignore"] = ignore_index;
    ctx->saved_data["softcap"] = softcap;
    return loss;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad_out) {
    const variable_list saved = ctx->get_saved_variables();
    const at::Tensor &hidden = saved[0], &weight = saved[1], &targets = saved[2], &lse = saved[3];
    const int64_t ignore_index = ctx->saved_data["ignore"].toInt();
    const at::Tensor row_scale = targets.ne(ignore_index).to(at::kFloat) * grad_out[0].to(at::kFloat);
    const bool need_h = ctx->needs_input_grad(0), need_w = ctx->needs_input_grad(1);
    at::Tensor grad_h =
        need_h ? at::zeros({hidden.size(0), hidden.size(1)}, hidden.options().dtype(at::kFloat)) : at::Tensor();
    at::Tensor grad_w = backward_rows(hidden, weight, 0, targets, lse, row_scale, ctx->saved_data["chunk"].toInt(),
                                      ctx->saved_data["tile"].toInt(), grad_h, need_w,
                                      ctx->saved_data["softcap"].toDouble());
    return {need_h ? grad_h.to(hidden.scalar_type()) : at::Tensor(), grad_w, at::Tensor(), at::Tensor(), at::Tensor(),
            at::Tensor(), at::Tensor()};
  }
};

// Token chunks over the whole vocabulary: each chunk's softmax is exact at once, so its
// gradients are computed in the forward with the loss's upstream gradient left out (the loss is
// a sum, so its gradients are linear in it) and scaled by it in the backward. The logits are
// never recomputed; the fp32 weight gradient lives from the forward to the backward.
class OnePassCrossEntropy : public torch::autograd::Function<OnePassCrossEntropy> {
 public:
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& hidden, const at::Tensor& weight,
                            const at::Tensor& targets, int64_t chunk, int64_t ignore_index, double upstream,
                            bool want_h, bool want_w, double softcap) {
    const int64_t tokens = hidden.size(0), vocab = weight.size(0);
    const auto f32 = hidden.options().dtype(at::kFloat);
    at::Tensor grad_h = want_h ? at::empty({tokens, hidden.size(1)}, f32) : at::Tensor();
    at::Tensor grad_w = want_w ? at::zeros({vocab, weight.size(1)}, f32) : at::Tensor();
    at::Tensor loss = at::zeros({}, f32);
    for (int64_t n0 = 0; n0 < tokens; n0 += chunk) {
      const int64_t nt = std::min(chunk, tokens - n0);
      const at::Tensor h = hidden.narrow(0, n0, nt), tg = targets.narrow(0, n0, nt);
      const at::Tensor valid = tg.ne(ignore_index);
      const at::Tensor col = at::where(valid, tg, 0).unsqueeze(1);
      at::Tensor p, l;
      {
        l = tile_logits(hidden, weight, 0, vocab, n0, nt, softcap);  // inputs' dtype (capped: fp32)
        const at::Tensor picked = l.gather(1, col).squeeze(1).to(at::kFloat);
        const at::Tensor m = at::amax(l, 1).to(at::kFloat);
        // l - m in a new fp32 tensor (minus_in_fp32 would overwrite an fp32 l, which the softmax
        // below reads again), freed before the softmax's.
        at::Tensor shifted = l.scalar_type() == at::kFloat ? at::sub(l, m.unsqueeze(1)) : minus_in_fp32(l, m.unsqueeze(1));
        const at::Tensor lse = m + at::log(shifted.exp_().sum(1));
        shifted = at::Tensor();
        loss.add_(at::where(valid, lse - picked, 0.0).sum());
        // The softmax as the untiled loss's backward computes it, exp(logit - lse): the same
        // numbers, not exp(logit - max) / sum's.
        // (Capped logits are kept for the cap's derivative: not overwritten.)
        p = softcap > 0 ? (l - lse.unsqueeze(1)).exp_() : minus_in_fp32(l, lse.unsqueeze(1)).exp_();
        if (softcap <= 0) l = at::Tensor();
      }
      // d loss / d logit = (softmax - onehot(target)) x the expected upstream gradient, 0 on
      // ignored tokens: scaled before the narrowing and the products, as the two-pass loss and
      // autograd scale.
      p.scatter_(1, col, p.gather(1, col) - valid.to(at::kFloat).unsqueeze(1));
      p.mul_((valid.to(at::kFloat) * upstream).unsqueeze(1));
      through_cap(p, l, softcap);
      l = at::Tensor();
      const at::Tensor g = p.to(hidden.scalar_type());  // as autograd narrows through the cast
      p = at::Tensor();
      if (want_h) grad_h.narrow(0, n0, nt).copy_(at::matmul(g, weight));
      if (want_w) grad_w.add_(at::matmul(g.t(), h));
    }
    ctx->saved_data["grad_h"] = grad_h;
    ctx->saved_data["grad_w"] = grad_w;
    ctx->saved_data["dtype"] = int64_t(hidden.scalar_type());
    ctx->saved_data["upstream"] = upstream;
    return loss;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad_out) {
    // The upstream gradient over the one the forward assumed: exactly 1 when it was right.
    const at::Tensor scale = grad_out[0].to(at::kFloat) / float(ctx->saved_data["upstream"].toDouble());
    const auto dtype = at::ScalarType(ctx->saved_data["dtype"].toInt());
    at::Tensor grad_h = ctx->saved_data["grad_h"].toTensor(), grad_w = ctx->saved_data["grad_w"].toTensor();
    ctx->saved_data.clear();  // the fp32 buffers go with the last reference below
    at::Tensor out_h, out_w;
    if (grad_h.defined() && ctx->needs_input_grad(0)) out_h = grad_h.mul_(scale).to(dtype);
    grad_h = at::Tensor();
    if (grad_w.defined() && ctx->needs_input_grad(1)) out_w = grad_w.mul_(scale).to(dtype);
    return {out_h, out_w, at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(),
            at::Tensor()};
  }
};

}  // namespace

LogSumExp::LogSumExp(const at::Tensor& hidden) {
  const auto f32 = hidden.options().dtype(at::kFloat);
  running_max = at::full({hidden.size(0)}, -std::numeric_limits<float>::infinity(), f32);
  sum_exp = at::zeros({hidden.size(0)}, f32);
  target_logit = at::zeros({hidden.size(0)}, f32);
}

void accumulate_log_sum_exp(const at::Tensor& hidden, const at::Tensor& rows, int64_t row_begin,
                            const at::Tensor& targets, int64_t chunk, int64_t tile, LogSumExp& acc, double softcap) {
  const Tiles t{hidden.size(0), rows.size(0), chunk, tile};
  t.each([&](int64_t v0, int64_t vt, int64_t n0, int64_t nt) {
    const at::Tensor l = tile_logits(hidden, rows, v0, vt, n0, nt, softcap);  // inputs' dtype: widening is exact
    at::Tensor m = acc.running_max.narrow(0, n0, nt), s = acc.sum_exp.narrow(0, n0, nt);
    const at::Tensor tg = targets.narrow(0, n0, nt) - (row_begin + v0);  // the target's column in this tile
    const at::Tensor here = tg.ge(0).logical_and(tg.lt(vt));
    const at::Tensor picked = l.gather(1, tg.clamp(0, vt - 1).unsqueeze(1)).squeeze(1).to(at::kFloat);
    acc.target_logit.narrow(0, n0, nt).add_(at::where(here, picked, 0.0));
    const at::Tensor m_new = at::maximum(m, at::amax(l, 1).to(at::kFloat));  // values only, no indices
    s.mul_(at::exp(m - m_new)).add_(minus_in_fp32(l, m_new.unsqueeze(1)).exp_().sum(1));
    m.copy_(m_new);
  });
}

at::Tensor finish_log_sum_exp(LogSumExp& acc) { return acc.running_max.add_(acc.sum_exp.log_()); }

at::Tensor loss_sum(const at::Tensor& lse, const LogSumExp& acc, const at::Tensor& targets, int64_t ignore_index) {
  return at::where(targets.ne(ignore_index), lse - acc.target_logit, 0.0).sum();
}

at::Tensor backward_rows(const at::Tensor& hidden, const at::Tensor& rows, int64_t row_begin, const at::Tensor& targets,
                         const at::Tensor& lse, const at::Tensor& row_scale, int64_t chunk, int64_t tile,
                         at::Tensor& grad_h, bool want_rows, double softcap) {
  const Tiles t{hidden.size(0), rows.size(0), chunk, tile};
  const auto f32 = hidden.options().dtype(at::kFloat);
  // Summed over the token chunks in an fp32 tile, written in the rows' dtype tile by tile (every
  // row, unless there are no tokens at all): no whole fp32 copy of the rows.
  at::Tensor grad_w = !want_rows ? at::Tensor() : t.tokens ? at::empty_like(rows) : at::zeros_like(rows);
  at::Tensor grad_w_tile;
  int64_t tile_begin = -1;
  const auto flush = [&] {
    if (want_rows && tile_begin >= 0) grad_w.narrow(0, tile_begin, grad_w_tile.size(0)).copy_(grad_w_tile);
  };
  // d loss / d logit = (softmax - onehot(target)) * row_scale.
  t.each([&](int64_t v0, int64_t vt, int64_t n0, int64_t nt) {
    if (v0 != tile_begin) {
      flush();
      tile_begin = v0;
      if (want_rows) grad_w_tile = at::zeros({vt, hidden.size(1)}, f32);
    }
    // softmax over the whole vocabulary, in fp32
    at::Tensor l = tile_logits(hidden, rows, v0, vt, n0, nt, softcap);
    at::Tensor p = softcap > 0 ? (l - lse.narrow(0, n0, nt).unsqueeze(1)).exp_()
                               : minus_in_fp32(l, lse.narrow(0, n0, nt).unsqueeze(1)).exp_();
    const at::Tensor tg = targets.narrow(0, n0, nt) - (row_begin + v0);
    const at::Tensor here = tg.ge(0).logical_and(tg.lt(vt));
    const at::Tensor col = tg.clamp(0, vt - 1).unsqueeze(1);
    p.scatter_(1, col, p.gather(1, col) - here.to(at::kFloat).unsqueeze(1));
    p.mul_(row_scale.narrow(0, n0, nt).unsqueeze(1));
    through_cap(p, l, softcap);
    l = at::Tensor();
    const at::Tensor g = p.to(hidden.scalar_type());  // as autograd narrows through the cast
    p = at::Tensor();
    if (grad_h.defined()) grad_h.narrow(0, n0, nt).add_(at::matmul(g, rows.narrow(0, v0, vt)));
    if (want_rows) grad_w_tile.add_(at::matmul(g.t(), hidden.narrow(0, n0, nt)));
  });
  flush();
  return grad_w;
}

at::Tensor linear_cross_entropy_sum(const at::Tensor& hidden, const at::Tensor& weight, const at::Tensor& targets,
                                    int64_t token_chunk, int64_t vocab_tile, int64_t ignore_index, bool one_pass,
                                    double upstream, double softcap) {
  const auto bad = [](const std::string& m) { throw std::invalid_argument("linear_cross_entropy_sum: " + m); };
  if (hidden.dim() != 2 || weight.dim() != 2 || targets.dim() != 1) bad("hidden [tokens, hidden], weight [vocab, hidden] and targets [tokens] expected");
  if (hidden.size(1) != weight.size(1)) bad("hidden has " + std::to_string(hidden.size(1)) + " features, the weight " + std::to_string(weight.size(1)));
  if (targets.size(0) != hidden.size(0)) bad(std::to_string(targets.size(0)) + " targets for " + std::to_string(hidden.size(0)) + " tokens");
  if (hidden.scalar_type() != weight.scalar_type()) bad("hidden and weight must have one dtype");
  if (targets.scalar_type() != at::kLong) bad("targets must be int64");
  if (token_chunk < 1 || vocab_tile < 1) bad("token_chunk and vocab_tile must be at least 1");
  // On a GPU, reading the check on the host would block it once a micro-batch: the device asserts
  // instead (a fatal device error, as the untiled loss's own target check is there).
  const at::Tensor out_of_range =
      targets.ne(ignore_index).logical_and(targets.lt(0).logical_or(targets.ge(weight.size(0))));
  const std::string range = "a target is outside [0, " + std::to_string(weight.size(0)) + ")";
  if (targets.is_cpu()) {
    if (out_of_range.any().item<bool>()) bad(range);
  } else {
    at::_assert_async(out_of_range.any().logical_not(), "linear_cross_entropy_sum: " + range);
  }
  if (one_pass) {
    if (vocab_tile < weight.size(0)) bad("one pass needs tiles over the whole vocabulary");
    if (!(upstream > 0) || !std::isfinite(upstream)) bad("the expected upstream gradient must be positive and finite");
    // Gradients only where autograd will ask for them: none under no_grad (evaluation), where a
    // registered parameter still says requires_grad.
    const bool grad = at::GradMode::is_enabled();
    return OnePassCrossEntropy::apply(hidden, weight, targets, token_chunk, ignore_index, upstream,
                                      grad && hidden.requires_grad(), grad && weight.requires_grad(), softcap);
  }
  return LinearCrossEntropy::apply(hidden, weight, targets, token_chunk, vocab_tile, ignore_index, softcap);
}

at::Tensor soft_cap(const at::Tensor& logits, double cap) {
  if (cap <= 0) return logits;
  return at::tanh(logits / cap) * cap;
}

}  // namespace strata::tiling
