// The schedule of one micro-batch: which units each stage uses, and the order in which stages
// run (forward over the embedding and the blocks, the head's forward and backward, then the
// backward in reverse). Known before the first step, the same on every rank: prefetch reads it
// ahead exactly and never has to trace anything.
//
// Stages and units are separate: a stage runs a module; a unit is what is partitioned, gathered
// and updated. A stage may use several units (its own, a tied embedding, later its tiles), and
// a unit may be used by several stages (a tied embedding: the embedding and the head).
//
// No libtorch, no device. Thread safety: immutable after construction.
// Errors: std::invalid_argument for a stage without units or a unit index out of range.
#pragma once

#include <cstddef>
#include <vector>

namespace strata::engine::plan {

// One use of a stage by the schedule.
struct Use {
  size_t stage;
  enum Kind { kForward, kHead, kBackward } kind;
};

class Schedule {
 public:
  // stage_units[s]: the units stage s uses (its own first); the last stage is the head.
  Schedule(std::vector<std::vector<size_t>> stage_units, size_t num_units);

  size_t num_stages() const { return stage_units_.size(); }
  size_t num_units() const { return last_use_stage_.size(); }
  // One micro-batch's uses, in order: 2 * num_stages() - 1 of them.
  const std::vector<Use>& uses() const { return uses_; }
  // Uses numbered over a whole step: index k is micro-batch k / uses().size().
  const Use& use_at(size_t k) const { return uses_[k % uses_.size()]; }
  const std::vector<size_t>& units_of(size_t stage) const { return stage_units_.at(stage); }
  bool uses_unit(size_t stage, size_t unit) const;
  // The lowest stage using `unit`: its last backward, after which its gradient is final.
  size_t last_use_stage(size_t unit) const { return last_use_stage_.at(unit); }
  // Units used by more than one stage (a tied embedding).
  size_t shared_units() const { return shared_units_; }
  size_t blocks() const { return num_stages() - 2; }  // stages between the embedding and the head
  bool is_block(size_t stage) const { return stage >= 1 && stage + 1 < num_stages(); }
  // The order the units' gradients become final in the last micro-batch's backward (highest
  // last-use stage first; ties in forward order), restricted to `units` (kept in that order
  // otherwise).
  std::vector<size_t> in_final_gradient_order(std::vector<size_t> units) const;

 private:
  std::vector<std::vector<size_t>> stage_units_;
  std::vector<size_t> last_use_stage_;
  std::vector<Use> uses_;
  size_t shared_units_ = 0;
};

}  // namespace strata::engine::plan
