#include "strata/engine/layout/memory_model.h"

#include <algorithm>
#include <stdexcept>

namespace strata::engine::layout {

MemoryModel::MemoryModel(const Schedule& schedule, ModelSizes sizes) : schedule_(schedule), sizes_(std::move(sizes)) {
  if (sizes_.padded_numel.size() != schedule_.num_units() || sizes_.shard_numel.size() != schedule_.num_units())
    throw std::invalid_argument("MemoryModel: sizes for " + std::to_string(sizes_.padded_numel.size()) +
                                " units, the schedule has " + std::to_string(schedule_.num_units()));
  if (!sizes_.graph_bytes.empty() && sizes_.graph_bytes.size() != schedule_.num_stages())
    throw std::invalid_argument("MemoryModel: graph sizes for " + std::to_string(sizes_.graph_bytes.size()) +
                                " stages, the schedule has " + std::to_string(schedule_.num_stages()));
  if (!sizes_.input_widths.empty() && sizes_.input_widths.size() != schedule_.num_stages())
    throw std::invalid_argument("MemoryModel: input widths for " + std::to_string(sizes_.input_widths.size()) +
                                " stages, the schedule has " + std::to_string(schedule_.num_stages()));
  // Every working_set() walks every use and asks for its parameters and what the kept blocks
  // before it hold: sums computed once here, so that a walk is O(uses), not O(uses x blocks)
  // (strata plan --max-model builds thousands of models).
  stage_bytes_.assign(schedule_.num_stages(), 0);
  held_before_.assign(schedule_.num_stages() + 1, 0);
  for (size_t s = 0; s < schedule_.num_stages(); ++s) {
    for (size_t u : schedule_.units_of(s)) stage_bytes_[s] += unit_bytes(u);
    held_before_[s + 1] = held_before_[s] + sizes_.graph(s) + stage_bytes_[s];
  }
  use_scratch_.assign(schedule_.num_stages(), {0, 0, 0});
  boundary_.assign(schedule_.num_stages(), 0);
  // Per use: its boundary activations (input and output, each with its gradient), the gradient
  // buffers of the units a backward use touches (fp32 full, a bf16 copy when reducing in bf16,
  // the reduced fp32 shard: with other ranks only; alone, the buffer is the shard), the head's
  // loss.
  const uint64_t logits = head_loss_bytes();
  inputs_before_.assign(schedule_.num_stages() + 1, 0);
  for (size_t s = 0; s < schedule_.num_stages(); ++s) {
    largest_input_ = std::max(largest_input_, input_bytes(s));
    inputs_before_[s + 1] = inputs_before_[s] + (schedule_.is_block(s) ? input_bytes(s) : 0);
  }
  for (const Use& use : schedule_.uses()) {
    uint64_t grads = 0;
    const size_t s = use.stage;
    const bool block = schedule_.is_block(s);
    if (use.kind != Use::kForward)
      for (size_t u : schedule_.units_of(s)) {
        if (!sizes_.frozen.empty() && sizes_.frozen[u]) continue;  // no gradient
        grads += sizes_.padded_numel[u] * (4 + (sizes_.reduce_bf16 ? 2 : 0) +
                                           (block && sizes_.mlp_chunked && sizes_.compute_bytes < 4 ? 4 : 0)) +
                 (sizes_.shard_numel[u] < sizes_.padded_numel[u] ? sizes_.shard_numel[u] * 4 : 0);  // other ranks
      }
    if (use.kind == Use::kHead) head_gradients_ = grads;
    const uint64_t boundary =
        2 * (input_bytes(s) + (s + 1 < schedule_.num_stages() ? input_bytes(s + 1) : activation_bytes()));
    // The whole head's loss is gone before its use reduces its gradients (one or the other);
    // with vocabulary tiles, the loss's running state lives beside every head stage's reduce.
    const uint64_t scratch = boundary + (schedule_.vocab_tiled() && schedule_.is_head(s) ? grads + logits
                                         : use.kind == Use::kHead                        ? std::max(grads, logits)
                                                                                         : grads);
    use_scratch_[s][use.kind] = scratch;
    boundary_[s] = boundary;
    if (block) largest_graph_scratch_ = std::max(largest_graph_scratch_, boundary + sizes_.graph(s));
    if (scratch > largest_use_scratch_) {
      largest_use_scratch_ = scratch;
      largest_scratch_use_ = use;
    }
  }
  // scratch() adds one checkpoint on its way back when checkpoints live off the device.
}

uint64_t head_loss_bytes(const ModelSizes& s) {
  return head_scratch_bytes(s.tokens, s.vocab, s.hidden, s.compute_bytes,
                            within_vocab_tiles(s.logits, s.tokens, s.vocab, s.vocab_tiles));
}

uint64_t MemoryModel::head_loss_bytes() const { return layout::head_loss_bytes(sizes_); }

uint64_t MemoryModel::unit_bytes(size_t u) const {
  return (sizes_.padded_numel.at(u) + (sizes_.dequantized.empty() ? 0 : sizes_.dequantized.at(u))) * sizes_.compute_bytes;
}

uint64_t MemoryModel::use_bytes(const Use& use) const { return stage_bytes_.at(use.stage); }

uint64_t MemoryModel::largest_unit() const {
  uint64_t b = 0;
  for (size_t u = 0; u < schedule_.num_units(); ++u) b = std::max(b, unit_bytes(u));
  return b;
}

uint64_t MemoryModel::activation_bytes() const { return sizes_.tokens * sizes_.hidden * sizes_.compute_bytes; }

uint64_t MemoryModel::input_bytes(size_t stage) const {
  return (sizes_.input_widths.empty() ? 1 : sizes_.input_widths.at(stage)) * activation_bytes();
}

uint64_t MemoryModel::checkpoint_bytes(const Choices& c) const {
  return inputs_before_.at(std::min(schedule_.first_block() + c.recomputed, schedule_.first_head()));
}

uint64_t MemoryModel::block_graph_bytes(size_t stages_per_block) const {
  uint64_t b = 0;
  const size_t end = std::min(schedule_.first_block() + stages_per_block, schedule_.first_head());
  for (size_t s = schedule_.first_block(); s < end; ++s) b += sizes_.graph(s);
  return b;
}

uint64_t MemoryModel::held_at(const Use& use, const Choices& c) const {
  // The kept block stages [first_block + recomputed, first_head) before the use (all of them at
  // the head) hold their graphs and compute copies.
  const size_t from = schedule_.first_block() + c.recomputed;
  const size_t to = use.kind == Use::kHead ? schedule_.first_head() : std::min(use.stage, schedule_.first_head());
  return to > from ? held_before_[to] - held_before_[from] : 0;
}

uint64_t MemoryModel::peak_held(const Choices& c) const {
  uint64_t b = 0;
  for (const Use& use : schedule_.uses()) b = std::max(b, held_at(use, c));
  return b;
}

uint64_t MemoryModel::largest_need(const Choices& c) const {
  uint64_t b = 0;
  for (const Use& use : schedule_.uses()) b = std::max(b, need(use, c));
  return b;
}

uint64_t MemoryModel::working_set(const Choices& c) const {
  const std::vector<Use>& uses = schedule_.uses();
  const size_t n = uses.size(), depth = size_t(std::max(0, c.prefetch));
  uint64_t b = 0;
  std::vector<size_t> live;  // reused: no allocation a use
  for (size_t k = 0; k < n; ++k) {
    const std::vector<size_t>& own = schedule_.units_of(uses[k].stage);
    live.assign(own.begin(), own.end());
    uint64_t ahead = 0;
    for (size_t j = k + 1; j <= k + depth && j < k + n; ++j)
      for (size_t u : schedule_.units_of(uses[j % n].stage))
        if (std::find(live.begin(), live.end(), u) == live.end()) {
          live.push_back(u);
          ahead += unit_bytes(u);
        }
    b = std::max(b, need(uses[k], c) + ahead);
  }
  return b;
}

uint64_t MemoryModel::prefetch_room(const Choices& c, uint64_t base, uint64_t usable) const {
  const uint64_t used = base + largest_need(c);
  const uint64_t unit = largest_unit();
  return usable > used && unit > 0 ? (usable - used) / unit : 0;
}

uint64_t MemoryModel::usable_device(uint64_t budget, uint64_t base, uint64_t physical_free) {
  if (physical_free == UINT64_MAX) return budget;
  return std::min(budget, base + physical_free);
}

}  // namespace strata::engine::layout
