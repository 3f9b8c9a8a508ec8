// How the tokens of a batch of rows [B, T] are laid out in sequences: one sequence per row (the
// default), or several examples packed in a row (data.pack), each token attending only to the
// earlier tokens of its own example, with positions restarting at 0 at every example. It is the
// one place the stages learn positions and attention masks from (rotary angles, GPT-2's learned
// positions, the attention of whole blocks and attention tiles alike).
//
// Ownership: holds its tensors on the segments' device (the host, as the engine passes them),
// with copies on the device that asks for them, kept (shared, not copied, by copies of it).
// Thread safety: one thread at a time: the attention masks are built on first use and kept for
// the other blocks of the micro-batch and their recompute.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <utility>
#include <vector>

namespace strata::models {

class TokenLayout {
 public:
  TokenLayout() = default;  // every row one sequence, positions 0 .. T-1
  // `segments` [B, T], integer: the example each token belongs to. An example's tokens are
  // contiguous within its row; ids need only differ between neighbouring examples. -1 marks
  // padding after a row's examples: it attends only to padding, and it is what transformers'
  // attention_mask leaves out of a mixture of experts' load-balancing loss. Segments no greater
  // than 0 (one example a row, maybe padded) lay the rows out as unpacked ones, their padding
  // marked. Throws std::invalid_argument for a tensor that is not 2-d and integer.
  explicit TokenLayout(const at::Tensor& segments);

  bool packed() const { return segments_.defined(); }
  // The padding (bool [B, T] on the segments' device, true at padding), undefined where none;
  // and the tokens that are not padding (B x T where none).
  const at::Tensor& padding() const { return padding_; }
  int64_t real_tokens(int64_t rows, int64_t tokens) const { return rows * tokens - padded_; }
  const at::Tensor& segments() const { return segments_; }
  // Each token's index within its example, int64 on `device`: [B, T] when packed, else [1, T].
  at::Tensor positions(int64_t tokens, const at::Device& device) const;
  // Which keys each query may attend to, as scaled_dot_product_attention's boolean mask
  // [B or 1, 1, T, T]: true where key k is of the query q's example, k <= q, and q - k < window
  // when window > 0. Undefined where plain causal attention is exactly that (unpacked, and no
  // window shorter than T): the caller then uses is_causal, which takes the fused kernels.
  at::Tensor attention_mask(int64_t tokens, int64_t window, const at::Device& device) const;
  // Rows [begin, begin + n) (a micro-batch of a step's rows); the unpacked layout stays as it is.
  TokenLayout rows(int64_t begin, int64_t n) const;

 private:
  at::Tensor segments_, positions_, padding_;
  int64_t padded_ = 0;
  mutable std::vector<std::pair<int64_t, at::Tensor>> masks_;  // by window, for this layout's T
  mutable at::Tensor device_positions_;
};

// The segments of rows of `tokens` ids whose examples start at the given offsets: a helper for
// callers that know example lengths (tests, benchmarks). `lengths[b]` lists row b's examples'
// token counts in order, summing to at most `tokens`; the rest of the row is one more segment.
at::Tensor segments_from_lengths(const std::vector<std::vector<int64_t>>& lengths, int64_t tokens);

}  // namespace strata::models
