// The schedule of one micro-batch: which units each stage uses, and the order in which stages
// run (forward over the embedding and the blocks, the head's forward and backward, then the
// backward in reverse). Known before the first step, the same on every rank: prefetch reads it
// ahead exactly and never has to trace anything.
//
// Stages and units are separate: a stage runs a module; a unit is what is partitioned, gathered
// and updated. A stage may use several units (its own, a tied embedding), and a unit may be used
// by several stages (a tied embedding: the embedding and the head, or their vocabulary tiles);
// a tied head tile owns no unit of its own. Stages come in three runs: the embedding's (one, or
// its vocabulary tiles), the blocks' (whole or tiles), the head's (one, or its vocabulary tiles);
// the last head stage runs the loss (kHead). An embedding stage whose units are all frozen
// (model.trainable) has no backward use: it has nothing to learn and no input to pass a gradient to.
//
// No libtorch, no device. Thread safety: immutable after construction.
// Errors: std::invalid_argument for a stage without units, a unit index out of range, or runs
// of embedding and head stages that do not fit (none, more than the stages, or unequal).
#pragma once

#include <cstddef>
#include <vector>

namespace strata::engine::layout {

// One use of a stage by the schedule.
struct Use {
  size_t stage;
  enum Kind { kForward, kHead, kBackward } kind;
};

class Schedule {
 public:
  // stage_units[s]: the units stage s uses (its own first); the first `embedding_stages` are
  // the embedding's, the last `head_stages` the head's.
  // `frozen[u]`: unit u is frozen (empty: none is).
  Schedule(std::vector<std::vector<size_t>> stage_units, size_t num_units, size_t embedding_stages = 1,
           size_t head_stages = 1, const std::vector<char>& frozen = {});

  size_t num_stages() const { return stage_units_.size(); }
  size_t num_units() const { return last_use_stage_.size(); }
  // One micro-batch's uses, in order: 2 * num_stages() - 1 of them, less the backward uses of
  // stages nothing below them learns through: a frozen embedding stage, and a frozen prefix of
  // block stages above a frozen embedding (no weight there and below has a gradient, so nothing
  // needs their input gradients).
  const std::vector<Use>& uses() const { return uses_; }
  // Uses numbered over a whole step: index k is micro-batch k / uses().size().
  const Use& use_at(size_t k) const { return uses_[k % uses_.size()]; }
  const std::vector<size_t>& units_of(size_t stage) const { return stage_units_.at(stage); }
  bool uses_unit(size_t stage, size_t unit) const;
  // The lowest stage using `unit`: its last backward, after which its gradient is final.
  size_t last_use_stage(size_t unit) const { return last_use_stage_.at(unit); }
  // Whether stage s has a backward use.
  bool has_backward(size_t stage) const { return backward_.at(stage); }
  // The stage of the `ahead`-th backward use after use k (k over a whole step, as use_at), within
  // k's micro-batch; kNoStage past its last. What a backward use brings back while it runs (the
  // activation checkpoints of the next backward uses) is read from here.
  static constexpr size_t kNoStage = size_t(-1);
  size_t backward_stage_after(size_t k, size_t ahead) const;
  // The most trainable units used by more than one stage whose gradients are held open at once
  // over the backward (from their highest stage's backward to their lowest's): a tied
  // embedding's throughout, a block tile's adapters over their part's tiles.
  size_t shared_units() const { return shared_units_; }
  // The block stages: [first_block(), first_head()).
  size_t first_block() const { return first_block_; }
  size_t first_head() const { return first_head_; }
  size_t blocks() const { return first_head_ - first_block_; }
  bool is_block(size_t stage) const { return stage >= first_block_ && stage < first_head_; }
  bool is_embedding(size_t stage) const { return stage < first_block_; }
  bool is_head(size_t stage) const { return stage >= first_head_ && stage < num_stages(); }
  // The embedding and the head are cut into vocabulary tiles.
  bool vocab_tiled() const { return first_block_ > 1; }
  // The order the units' gradients become final in the last micro-batch's backward (highest
  // last-use stage first; ties in forward order), restricted to `units` (kept in that order
  // otherwise).
  std::vector<size_t> in_final_gradient_order(std::vector<size_t> units) const;

 private:
  std::vector<std::vector<size_t>> stage_units_;
  std::vector<size_t> last_use_stage_;
  std::vector<Use> uses_;
  std::vector<bool> backward_;  // by stage: has a backward use
  size_t shared_units_ = 0;
  size_t first_block_ = 1, first_head_ = 1;
};

}  // namespace strata::engine::layout
