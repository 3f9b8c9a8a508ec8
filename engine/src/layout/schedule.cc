#include "strata/engine/layout/schedule.h"

#include <algorithm>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

namespace strata::engine::layout {

Schedule::Schedule(std::vector<std::vector<size_t>> stage_units, size_t num_units, size_t embedding_stages,
                   size_t head_stages, const std::vector<char>& frozen)
    : stage_units_(std::move(stage_units)) {
  if (!frozen.empty() && frozen.size() != num_units)
    throw std::invalid_argument("Schedule: " + std::to_string(frozen.size()) + " frozen flags for " +
                                std::to_string(num_units) + " units");
  const size_t n = stage_units_.size();
  if (embedding_stages < 1 || head_stages != embedding_stages || embedding_stages + head_stages > n)
    throw std::invalid_argument("Schedule: " + std::to_string(n) + " stages cannot hold " +
                                std::to_string(embedding_stages) + " embedding and " + std::to_string(head_stages) +
                                " head stages (at least one each, as many of both)");
  first_block_ = embedding_stages;
  first_head_ = n - head_stages;
  last_use_stage_.assign(num_units, n);
  std::vector<int> stages_using(num_units, 0);
  for (size_t s = 0; s < n; ++s) {
    if (stage_units_[s].empty()) throw std::invalid_argument("Schedule: stage " + std::to_string(s) + " uses no unit");
    for (size_t u : stage_units_[s]) {
      if (u >= num_units)
        throw std::invalid_argument("Schedule: stage " + std::to_string(s) + " uses unit " + std::to_string(u) +
                                    " of " + std::to_string(num_units));
      last_use_stage_[u] = std::min(last_use_stage_[u], s);
      ++stages_using[u];
    }
  }
  // Trainable units used by several stages hold a gradient from the backward of their highest
  // stage to that of their lowest: the most of them open at once over the backward (a tied
  // embedding is open throughout; a block tile's adapters over their part's tiles only).
  // Each is open over the stages [last_use_stage_, first_use]: the most intervals over one stage,
  // by a sweep over their ends (O(stages + units): the planner builds thousands of schedules of
  // thousands of units).
  std::vector<size_t> first_use(num_units, 0);
  for (size_t s = 0; s < n; ++s)
    for (size_t u : stage_units_[s]) first_use[u] = std::max(first_use[u], s);
  std::vector<int64_t> opened(n + 1, 0);
  for (size_t u = 0; u < num_units; ++u)
    if (stages_using[u] > 1 && (frozen.empty() || !frozen[u])) ++opened[last_use_stage_[u]], --opened[first_use[u] + 1];
  int64_t open = 0;
  for (size_t s = 0; s < n; ++s) shared_units_ = std::max(shared_units_, size_t(open += opened[s]));
  for (size_t s = 0; s + 1 < n; ++s) uses_.push_back({s, Use::kForward});
  uses_.push_back({n - 1, Use::kHead});
  const auto learns = [&](size_t s) {
    return frozen.empty() || std::any_of(stage_units_[s].begin(), stage_units_[s].end(),
                                         [&](size_t u) { return !frozen[u]; });
  };
  // An embedding stage needs its backward when it learns (its input is token ids); a block stage
  // when it or anything below it learns (its backward carries the gradient down); the head's
  // stages always (they start the backward), the last one within its head use.
  backward_.assign(n, true);
  backward_[n - 1] = false;
  bool below = false;
  for (size_t s = 0; s < first_block_; ++s) below = (backward_[s] = learns(s)) || below;
  for (size_t s = first_block_; s < first_head_; ++s) below = (backward_[s] = below || learns(s));
  for (size_t s = n - 1; s-- > 0;)
    if (backward_[s]) uses_.push_back({s, Use::kBackward});
}

bool Schedule::uses_unit(size_t stage, size_t unit) const {
  const std::vector<size_t>& us = stage_units_.at(stage);
  return std::find(us.begin(), us.end(), unit) != us.end();
}

size_t Schedule::backward_stage_after(size_t k, size_t ahead) const {
  for (size_t j = k % uses_.size() + 1; j < uses_.size(); ++j)
    if (uses_[j].kind == Use::kBackward && --ahead == 0) return uses_[j].stage;
  return kNoStage;
}

std::vector<size_t> Schedule::in_final_gradient_order(std::vector<size_t> units) const {
  std::stable_sort(units.begin(), units.end(),
                   [&](size_t a, size_t b) { return last_use_stage_.at(a) > last_use_stage_.at(b); });
  return units;
}

}  // namespace strata::engine::layout
