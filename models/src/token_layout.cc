// Positions and attention masks of packed rows (strata/models/token_layout.h).
#include "strata/models/token_layout.h"

#include <stdexcept>
#include <string>

namespace strata::models {

TokenLayout::TokenLayout(const at::Tensor& segments) {
  if (!segments.defined()) return;
  if (segments.dim() != 2 || at::isFloatingType(segments.scalar_type()) || segments.scalar_type() == at::kBool)
    throw std::invalid_argument("TokenLayout: segments must be a 2-d integer tensor [rows, tokens]");
  segments_ = segments.to(at::kLong);
  if (const at::Tensor pad = segments_.lt(0); (padded_ = pad.sum().item<int64_t>()) > 0) padding_ = pad;
  if (segments_.max().item<int64_t>() <= 0) {  // one example a row: plain causal attention
    segments_ = at::Tensor();
    return;
  }
  // A token's position is its index minus its example's first index: the running maximum of the
  // indices where a new example starts.
  const int64_t T = segments_.size(1);
  const at::Tensor index = at::arange(T, segments_.options()).unsqueeze(0).expand_as(segments_);
  at::Tensor starts = at::ones_like(segments_, segments_.options().dtype(at::kBool));
  if (T > 1) starts.narrow(1, 1, T - 1).copy_(segments_.narrow(1, 1, T - 1).ne(segments_.narrow(1, 0, T - 1)));
  positions_ = index - std::get<0>(at::where(starts, index, at::zeros_like(index)).cummax(1));
}

at::Tensor TokenLayout::positions(int64_t tokens, const at::Device& device) const {
  if (!packed()) return at::arange(tokens, at::TensorOptions().dtype(at::kLong).device(device)).unsqueeze(0);
  if (tokens != positions_.size(1))
    throw std::invalid_argument("TokenLayout: " + std::to_string(tokens) + " tokens where the layout has " +
                                std::to_string(positions_.size(1)));
  if (positions_.device() == device) return positions_;
  if (!device_positions_.defined() || device_positions_.device() != device) device_positions_ = positions_.to(device);
  return device_positions_;
}

at::Tensor TokenLayout::attention_mask(int64_t tokens, int64_t window, const at::Device& device) const {
  if (!packed() && (window <= 0 || window >= tokens)) return {};
  for (auto& [w, m] : masks_)
    if (w == window && m.size(-1) == tokens && m.device() == device) return m;
  const auto opts = at::TensorOptions().dtype(at::kLong).device(device);
  const at::Tensor q = at::arange(tokens, opts).unsqueeze(1), k = at::arange(tokens, opts).unsqueeze(0);
  at::Tensor allowed = k.le(q);
  if (window > 0) allowed = allowed.logical_and((q - k).lt(window));
  allowed = allowed.unsqueeze(0);  // [1, T, T]
  if (packed()) {
    if (tokens != segments_.size(1))
      throw std::invalid_argument("TokenLayout: " + std::to_string(tokens) + " tokens where the layout has " +
                                  std::to_string(segments_.size(1)));
    const at::Tensor s = segments_.to(device);
    allowed = allowed.logical_and(s.unsqueeze(2).eq(s.unsqueeze(1)));  // [B, T, T]
  }
  at::Tensor mask = allowed.unsqueeze(1).contiguous();
  masks_.emplace_back(window, mask);
  return mask;
}

TokenLayout TokenLayout::rows(int64_t begin, int64_t n) const {
  if (packed()) return TokenLayout(segments_.narrow(0, begin, n));
  TokenLayout part;
  if (padding_.defined() && (part.padded_ = padding_.narrow(0, begin, n).sum().item<int64_t>()) > 0)
    part.padding_ = padding_.narrow(0, begin, n);
  return part;
}

at::Tensor segments_from_lengths(const std::vector<std::vector<int64_t>>& lengths, int64_t tokens) {
  at::Tensor s = at::empty({int64_t(lengths.size()), tokens}, at::kLong);
  auto a = s.accessor<int64_t, 2>();
  for (size_t b = 0; b < lengths.size(); ++b) {
    int64_t j = 0, seg = 0;
    for (int64_t len : lengths[b]) {
      if (len <= 0 || j + len > tokens) throw std::invalid_argument("segments_from_lengths: examples overflow the row");
      for (int64_t e = j + len; j < e; ++j) a[int64_t(b)][j] = seg;
      ++seg;
    }
    for (; j < tokens; ++j) a[int64_t(b)][j] = seg;
  }
  return s;
}

}  // namespace strata::models
