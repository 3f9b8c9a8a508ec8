// The LM head's loss of a micro-batch, in each of its three forms: whole (fp32 logits, as the
// oracle computes them), with the logits cut into tiles (tiling::linear_cross_entropy_sum), and
// with the head cut into vocabulary tiles (each head stage adds its rows to every token's running
// log-sum-exp; the last one gives the loss and the backward's seed; each stage's backward gives
// its rows' weight gradient and adds its part of the input's).
//
// Targets out of the loss are kIgnored (torch's ignore_index). Without a mask the loss is the
// token mean; with one, the sum over the counted targets (the engine divides by the global count).
// The loss's device bytes are counted against the budget while it runs (reserve: the memory
// model's head_loss_bytes; libtorch allocates them itself).
//
// Ownership: borrows the model, the memory model and the device (they outlive it); a
// VocabPass belongs to its micro-batch. Threads: the training thread. Errors: libtorch's, and
// BudgetExceeded from reserve().
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <optional>

#include "strata/engine/device.h"
#include "strata/engine/layout/memory_model.h"
#include "strata/models/decoder.h"
#include "strata/tiling/linear_cross_entropy.h"

namespace strata::engine::runtime {

class HeadLoss {
 public:
  static constexpr int64_t kIgnored = -100;  // as torch's cross entropy's ignore_index

  HeadLoss(models::Decoder& model, const layout::MemoryModel& memory, Device& device)
      : model_(model), memory_(memory), dev_(device) {}

  // The whole head's loss from its input `x`: the token mean, or with `masked` the sum over the
  // counted targets; with the logits tiled (memory.sizes().logits), tile by tile. `upstream`: the
  // gradient the step's backward gives the loss (one pass computes its gradients for it in the
  // forward).
  at::Tensor whole(const at::Tensor& x, const at::Tensor& targets, bool masked, double upstream = 1.0) const;
  // The loss's device bytes counted until the reservation goes.
  Device::Reservation reserve() const;

  // The head in vocabulary tiles: what one micro-batch's head stages share, from the first
  // head stage's forward to its backward.
  struct VocabPass {
    at::Tensor x, normed;            // the head's input (a leaf) and the final norm's output, with its graph
    at::Tensor hidden;               // the normed input, detached, [tokens, hidden]
    std::optional<tiling::LogSumExp> acc;  // each token's running log-sum-exp and target logit
    at::Tensor lse, row_scale;       // once the last tile is in: the log-sum-exp, the seed per token
    at::Tensor grad_hidden;          // fp32 [tokens, hidden], summed over the tiles' backward
    Device::Reservation loss_res;    // the loss's device bytes until the backward
  };
  // Vocabulary tile j's forward over the head's input `x` (tile 0 first: it starts the pass and
  // runs the final norm, with autograd when `grad`).
  void vocab_forward(VocabPass& h, const at::Tensor& x, const at::Tensor& targets, size_t j, bool grad) const;
  // After the last tile's forward: whole()'s value, and the backward's seed (`scale` times the
  // loss's derivative per token).
  at::Tensor vocab_loss(VocabPass& h, const at::Tensor& targets, bool masked, double scale) const;
  // Tile j's backward (the last tile first): its rows' weight gradient, its part of the input's.
  // Tile 0's returns the gradient of the head's input (through the norm) and ends the pass;
  // the others return an undefined tensor.
  at::Tensor vocab_backward(VocabPass& h, const at::Tensor& targets, size_t j) const;

 private:
  models::Decoder& model_;
  const layout::MemoryModel& memory_;
  Device& dev_;
};

}  // namespace strata::engine::runtime
