// Supervised examples packed into windows (PackedExamples, best_fit_decreasing: token_data.h).
#include <algorithm>
#include <cstring>
#include <map>
#include <random>
#include <stdexcept>
#include <string>

#include "strata/models/token_data.h"

namespace strata::models {

Bins best_fit_decreasing(const std::vector<uint64_t>& lengths, uint64_t capacity, uint64_t seed) {
  const uint64_t n = lengths.size();
  std::vector<uint64_t> items(n);
  for (uint64_t i = 0; i < n; ++i) {
    if (lengths[i] == 0 || lengths[i] > capacity)
      throw std::invalid_argument("best_fit_decreasing: item " + std::to_string(i) + " of length " +
                                  std::to_string(lengths[i]) + " does not fit a bin of " + std::to_string(capacity));
    items[i] = i;
  }
  // Ties in a seeded order: our own Fisher-Yates over a fixed generator (std::shuffle's algorithm
  // is not specified), then a stable sort by decreasing length.
  std::mt19937_64 rng(seed * 0x9E3779B97F4A7C15ull + 0x7061636bull);
  for (uint64_t i = n; i > 1; --i) std::swap(items[i - 1], items[rng() % i]);
  std::stable_sort(items.begin(), items.end(), [&](uint64_t a, uint64_t b) { return lengths[a] > lengths[b]; });
  std::vector<std::vector<uint64_t>> bins;
  std::multimap<uint64_t, uint64_t> room;  // free room -> bin, equal rooms in opening order
  for (uint64_t i : items) {
    auto it = room.lower_bound(lengths[i]);
    uint64_t bin;
    if (it == room.end()) {
      bin = bins.size();
      bins.emplace_back();
      it = room.emplace(capacity, bin);
    } else {
      bin = it->second;
    }
    bins[bin].push_back(i);
    const uint64_t left = it->first - lengths[i];
    room.erase(it);
    if (left > 0) room.emplace(left, bin);
  }
  Bins out;
  out.begin.push_back(0);
  for (const auto& b : bins) {
    out.order.insert(out.order.end(), b.begin(), b.end());
    out.begin.push_back(out.order.size());
  }
  return out;
}

PackedExamples::PackedExamples(std::shared_ptr<const SftExamples> examples, uint64_t seed)
    : examples_(std::move(examples)) {
  std::vector<uint64_t> lengths(examples_->size());
  for (uint64_t e = 0; e < lengths.size(); ++e) lengths[e] = examples_->kept_length(e);
  Bins bins = best_fit_decreasing(lengths, examples_->seq_len() + 1, seed);
  order_ = std::move(bins.order);
  begin_ = std::move(bins.begin);
}

void PackedExamples::sample(uint64_t i, int64_t* ids, uint8_t* loss, int64_t* segments) const {
  if (i >= size()) throw std::out_of_range("PackedExamples: no window " + std::to_string(i));
  const uint64_t T = seq_len();
  std::vector<uint8_t> flags(T + 1, 0);  // flags[j]: target j of the window counts
  std::vector<int64_t> seg(T + 1);
  uint64_t j = 0;
  for (uint64_t k = begin_[i]; k < begin_[i + 1]; ++k) {
    const uint64_t e = order_[k], len = examples_->kept_length(e);
    examples_->copy(e, len, ids + j, flags.data() + j);  // flags[j + len - 1] stays 0: it crosses
    std::fill(seg.begin() + int64_t(j), seg.begin() + int64_t(j + len), int64_t(k - begin_[i]));
    j += len;
  }
  std::fill(ids + j, ids + T + 1, examples_->pad_id());
  std::fill(seg.begin() + int64_t(j), seg.end(), int64_t(-1));  // padding
  if (loss) std::memcpy(loss, flags.data(), T);
  if (segments) std::copy(seg.begin(), seg.begin() + int64_t(T), segments);
}

std::vector<uint64_t> PackedExamples::window_examples(uint64_t w) const {
  if (w >= size()) throw std::out_of_range("PackedExamples: no window " + std::to_string(w));
  return {order_.begin() + int64_t(begin_[w]), order_.begin() + int64_t(begin_[w + 1])};
}

std::string PackedExamples::description() const {
  return examples_->description() + ", packed into " + std::to_string(size()) + " windows";
}

}  // namespace strata::models
