// The loss scale of fp16 compute (dynamic loss scaling): the loss's gradient is multiplied by the
// scale so that small gradients survive fp16, and the update divides it out. A step whose
// gradients overflowed is skipped by the engine and halves the scale (never below 1);
// `window` good steps in a row double it. Without fp16 the scale is 1 and never moves.
//
// Plain value type, no libtorch. Threads: the training thread only (the step and the
// checkpoint's counters).
#pragma once

#include <algorithm>
#include <cstdint>

namespace strata::engine::runtime {

class LossScaler {
 public:
  // `dynamic`: fp16 compute; `initial` > 0 and `window` >= 1 (EngineConfig validates both).
  LossScaler(bool dynamic, double initial, int64_t window)
      : dynamic_(dynamic), scale_(dynamic ? initial : 1.0), window_(window) {}

  double scale() const { return scale_; }
  int64_t good_steps() const { return good_steps_; }

  // After a step: `skipped` when its gradients were not finite (or it had nothing to learn from).
  void update(bool skipped) {
    if (!dynamic_) return;
    if (skipped) {
      scale_ = std::max(1.0, scale_ / 2);
      good_steps_ = 0;
    } else if (++good_steps_ >= window_) {
      scale_ *= 2;
      good_steps_ = 0;
    }
  }

  // A checkpoint's counters (Engine::set_counters).
  void restore(double scale, int64_t good_steps) {
    scale_ = scale;
    good_steps_ = good_steps;
  }

 private:
  bool dynamic_;
  double scale_;
  int64_t window_;
  int64_t good_steps_ = 0;
};

}  // namespace strata::engine::runtime
