#include "strata/engine/lr_schedule.h"

#include <algorithm>
#include <cmath>

namespace strata::engine {

double scheduled_lr(const LrSchedule& s, double peak_lr, int64_t step) {
  // transformers' operations in their order, so that the values agree to the last bit.
  if (step < s.warmup_steps) return peak_lr * (double(step) / double(std::max<int64_t>(1, s.warmup_steps)));
  if (s.decay == LrSchedule::Decay::kConstant) return peak_lr;
  const double span = double(std::max<int64_t>(1, s.total_steps - s.warmup_steps));
  double f = 0;
  if (s.decay == LrSchedule::Decay::kLinear) {
    f = std::max(0.0, double(s.total_steps - step) / span);
  } else {
    const double progress = std::min(1.0, double(step - s.warmup_steps) / span);
    f = 0.5 * (1.0 + std::cos(M_PI * progress));
  }
  if (s.min_lr_ratio != 0) f = f * (1.0 - s.min_lr_ratio) + s.min_lr_ratio;
  return peak_lr * std::max(0.0, f);
}

std::string to_string(LrSchedule::Decay decay) {
  switch (decay) {
    case LrSchedule::Decay::kConstant: return "constant";
    case LrSchedule::Decay::kLinear: return "linear";
    case LrSchedule::Decay::kCosine: return "cosine";
  }
  return "?";
}

}  // namespace strata::engine
