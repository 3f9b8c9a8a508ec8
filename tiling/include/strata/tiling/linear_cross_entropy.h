// The LM head's cross entropy without its logits: the loss of `hidden @ weight^T` against
// `targets`, computed tile by tile over token chunks x vocabulary tiles with an online
// log-sum-exp, so that no more than one chunk's tile of logits exists at a time (forward and
// backward). The backward recomputes each tile's logits from `hidden` and `weight` and
// accumulates the input's gradient (fp32, over the vocabulary tiles) and the tile's weight
// gradient (fp32, over the token chunks).
//
// Numbers: each tile's logits are computed in the inputs' dtype and widened to fp32, as the
// untiled head computes `at::linear(...).to(kFloat)`, and the softmax gradient is narrowed to the
// inputs' dtype before its matmuls, as autograd does through that cast. In fp32 only the order
// of sums differs from the untiled loss (tests/tiling/linear_cross_entropy_test.cc: loss 1e-7,
// gradients 6e-7 relative). In bf16/fp16 the input gradient also differs by rounding: each
// tile's product is rounded to the inputs' dtype before the tiles are summed in fp32, where the
// untiled head rounds one product over the whole vocabulary (tested within 2e-2).
//
// Memory beside the inputs and the gradients autograd returns: one tile of fp32 logits (reused as
// its softmax gradient) with its copy in the inputs' dtype, one matmul product of the backward
// ([token_chunk or vocab_tile, hidden]), the fp32 input gradient [tokens, hidden], one fp32
// weight-gradient tile [vocab_tile, hidden], and four fp32 numbers a token; layout::head_scratch_bytes
// bounds these (and the memory model counts it).
//
// Thread safety: a pure function of its arguments; autograd may run it on any thread.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>

namespace strata::tiling {

// Sum over the rows of `hidden` [tokens, hidden] whose target ([tokens], int64) is not
// `ignore_index` of -log softmax(hidden @ weight^T)[target]; weight is [vocab, hidden] in the same
// dtype. Differentiable in `hidden` and `weight` (autograd). `token_chunk` and `vocab_tile` (>= 1)
// are the tile's rows and columns; the last ones may be shorter. Throws std::invalid_argument on
// mismatched shapes or dtypes, and on a target outside [0, vocab) that is not ignore_index (on a
// GPU a device-side assert instead, so that the host is not blocked).
//
// `one_pass` (vocab_tile must then cover the whole vocabulary): each token chunk's softmax is
// exact at once, so the forward computes the loss and both gradients chunk by chunk and the
// logits are never recomputed: three products a chunk instead of four, for an fp32 weight
// gradient [vocab, hidden] held from the forward to the backward (layout::head_scratch_bytes
// counts it). The forward computes the gradients for the upstream gradient `upstream` (the
// caller's expected d(objective)/d(loss), > 0), scaled before the narrowing and the products as
// two passes and autograd scale; the backward multiplies them by the real upstream over it,
// exactly 1 when it was right (the numbers of two passes then, within summation order). Under
// no_grad it computes the loss alone.
//
// `softcap` > 0: the logits are soft-capped first, softcap * tanh(l / softcap) (Gemma 2's
// final_logit_softcapping), in fp32, in the forward and through its derivative in the backward.
at::Tensor linear_cross_entropy_sum(const at::Tensor& hidden, const at::Tensor& weight, const at::Tensor& targets,
                                    int64_t token_chunk, int64_t vocab_tile, int64_t ignore_index = -100,
                                    bool one_pass = false, double upstream = 1.0, double softcap = 0);
// cap * tanh(logits / cap), the one soft cap of logits and scores; `logits` as they are when
// cap <= 0.
at::Tensor soft_cap(const at::Tensor& logits, double cap);

// The same loss in pieces, for a weight held as row ranges that are never together (the engine's
// vocabulary tiles): the forward accumulates each range's part of every token's log-sum-exp and
// target logit, the backward runs range by range against the finished log-sum-exp. The one
// implementation: linear_cross_entropy_sum calls these with the whole weight as one range.
// No autograd; the caller checks shapes, dtypes and targets (as linear_cross_entropy_sum does).
struct LogSumExp {
  at::Tensor running_max, sum_exp, target_logit;  // fp32 [tokens]
  explicit LogSumExp(const at::Tensor& hidden);   // -inf, 0, 0 on hidden's device
};
// Adds rows [row_begin, row_begin + rows.size(0)) of the vocabulary (`rows`, [rows, hidden] in
// hidden's dtype) to `acc`, tile by tile (token_chunk x vocab_tile).
void accumulate_log_sum_exp(const at::Tensor& hidden, const at::Tensor& rows, int64_t row_begin,
                            const at::Tensor& targets, int64_t token_chunk, int64_t vocab_tile, LogSumExp& acc,
                            double softcap = 0);
// Once every row is in: the log-sum-exp [tokens] (fp32; consumes acc's running values), and the
// loss's sum over the tokens whose target is not ignore_index.
at::Tensor finish_log_sum_exp(LogSumExp& acc);
at::Tensor loss_sum(const at::Tensor& lse, const LogSumExp& acc, const at::Tensor& targets, int64_t ignore_index);
// The gradients of `row_scale` . loss-per-token through rows [row_begin, ...): adds the input's
// to `grad_hidden` (fp32 [tokens, hidden], undefined: not wanted) and returns the rows' ([rows,
// hidden] in their dtype, summed in fp32 one vocabulary tile at a time; undefined when
// `want_rows` is false). row_scale: fp32 [tokens], 0 on ignored tokens.
at::Tensor backward_rows(const at::Tensor& hidden, const at::Tensor& rows, int64_t row_begin, const at::Tensor& targets,
                         const at::Tensor& lse, const at::Tensor& row_scale, int64_t token_chunk, int64_t vocab_tile,
                         at::Tensor& grad_hidden, bool want_rows, double softcap = 0);

}  // namespace strata::tiling
