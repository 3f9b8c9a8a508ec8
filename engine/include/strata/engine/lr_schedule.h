// Learning-rate schedules: linear warmup, then constant, linear or cosine decay to a floor, with
// the values of transformers' schedulers (get_constant_schedule_with_warmup,
// get_linear_schedule_with_warmup, get_cosine_schedule_with_warmup and
// get_cosine_with_min_lr_schedule_with_warmup with min_lr_rate) step by step.
//
// A schedule is a pure function of the step, so a resumed run continues it exactly: the step
// count is in every checkpoint. Thread-safe (no state).
#pragma once

#include <cstdint>
#include <string>

namespace strata::engine {

struct LrSchedule {
  enum class Decay { kConstant, kLinear, kCosine };
  Decay decay = Decay::kConstant;
  int64_t warmup_steps = 0;  // lr rises linearly from 0 over these steps
  int64_t total_steps = 0;   // where the decay ends, warmup included (transformers' num_training_steps)
  double min_lr_ratio = 0;   // the decay ends at lr * this (linear and cosine)
};

// The learning rate of step `step` (0-based: the training steps done before it), `peak_lr` being
// optimizer.lr. Warmup: peak * step / warmup_steps (so the first step of a warmup has lr 0, as in
// transformers). Decay over progress p = (step - warmup) / (total - warmup), clamped to 1 once
// the total is reached: constant 1, linear 1 - p, cosine (1 + cos(pi p)) / 2, each scaled to end
// at min_lr_ratio: f * (1 - min_lr_ratio) + min_lr_ratio.
double scheduled_lr(const LrSchedule& schedule, double peak_lr, int64_t step);

std::string to_string(LrSchedule::Decay decay);

}  // namespace strata::engine
