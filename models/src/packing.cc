// Supervised examples packed into windows (PackedExamples, best_fit_decreasing: token_data.h).
#include <algorithm>
#include <cstring>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include "strata/models/token_data.h"

namespace strata::models {

namespace {

constexpr uint64_t kNone = UINT64_MAX;

// The open bins by free room: for each room a FIFO of bins in the order they came to have it (the
// multimap order the rule is stated in: among equal rooms the first there), and a two-level
// bitset of the rooms some bin has, so that the least room >= a length is a few word scans:
// O(capacity / 4096) at worst, whatever the number of bins.
class RoomIndex {
 public:
  explicit RoomIndex(uint64_t capacity)
      : head_(capacity + 1, kNone), tail_(capacity + 1, kNone), words_(capacity / 64 + 1, 0),
        summary_(words_.size() / 64 + 1, 0) {}

  void push(uint64_t room, uint64_t bin) {
    if (bin >= next_.size()) next_.resize(bin + 1, kNone);
    next_[bin] = kNone;
    if (tail_[room] == kNone) {
      head_[room] = bin;
      mark(room, true);
    } else {
      next_[tail_[room]] = bin;
    }
    tail_[room] = bin;
  }

  // The first bin of the least room >= need (kNone: none), taken out of the index.
  uint64_t pop_at_least(uint64_t need, uint64_t* room) {
    const uint64_t r = least_at_least(need);
    if (r == kNone) return kNone;
    const uint64_t bin = head_[r];
    head_[r] = next_[bin];
    if (head_[r] == kNone) {
      tail_[r] = kNone;
      mark(r, false);
    }
    *room = r;
    return bin;
  }

 private:
  void mark(uint64_t r, bool set) {
    const uint64_t w = r / 64, bit = 1ull << (r % 64);
    words_[w] = set ? (words_[w] | bit) : (words_[w] & ~bit);
    const uint64_t sbit = 1ull << (w % 64);
    summary_[w / 64] = words_[w] ? (summary_[w / 64] | sbit) : (summary_[w / 64] & ~sbit);
  }

  uint64_t least_at_least(uint64_t need) const {
    if (need >= head_.size()) return kNone;
    uint64_t w = need / 64;
    if (const uint64_t bits = words_[w] & (~0ull << (need % 64))) return w * 64 + uint64_t(__builtin_ctzll(bits));
    for (uint64_t from = w + 1, s = from / 64; s < summary_.size(); ++s, from = s * 64) {
      const uint64_t sbits = summary_[s] & (~0ull << (from % 64));
      if (!sbits) continue;
      w = s * 64 + uint64_t(__builtin_ctzll(sbits));
      return w * 64 + uint64_t(__builtin_ctzll(words_[w]));
    }
    return kNone;
  }

  std::vector<uint64_t> head_, tail_, next_, words_, summary_;
};

}  // namespace

Bins best_fit_decreasing(const std::vector<uint64_t>& lengths, uint64_t capacity, uint64_t seed) {
  const uint64_t n = lengths.size();
  std::vector<uint64_t> items(n), count(capacity + 2, 0);
  for (uint64_t i = 0; i < n; ++i) {
    if (lengths[i] == 0 || lengths[i] > capacity)
      throw std::invalid_argument("best_fit_decreasing: item " + std::to_string(i) + " of length " +
                                  std::to_string(lengths[i]) + " does not fit a bin of " + std::to_string(capacity));
    items[i] = i;
    ++count[capacity - lengths[i] + 1];  // longest first: slot capacity - length
  }
  // Ties in a seeded order: our own Fisher-Yates over a fixed generator (std::shuffle's algorithm
  // is not specified), then a stable counting sort by decreasing length.
  std::mt19937_64 rng(seed * 0x9E3779B97F4A7C15ull + 0x7061636bull);
  for (uint64_t i = n; i > 1; --i) std::swap(items[i - 1], items[rng() % i]);
  for (uint64_t k = 1; k < count.size(); ++k) count[k] += count[k - 1];
  std::vector<uint64_t> sorted(n);
  for (uint64_t i : items) sorted[count[capacity - lengths[i]]++] = i;
  // Place each into the bin it leaves least room in; bin_of[k]: the bin of the k-th placed item.
  std::vector<uint64_t>& bin_of = items;  // reused: the shuffled order is no longer needed
  RoomIndex room(capacity);
  uint64_t bins = 0;
  for (uint64_t k = 0; k < n; ++k) {
    const uint64_t len = lengths[sorted[k]];
    uint64_t free = 0, bin = room.pop_at_least(len, &free);
    if (bin == kNone) bin = bins++, free = capacity;
    bin_of[k] = bin;
    if (free > len) room.push(free - len, bin);
  }
  // The items bin by bin, each bin's in the order placed (a stable counting sort by bin).
  Bins out;
  out.begin.assign(bins + 1, 0);
  for (uint64_t k = 0; k < n; ++k) ++out.begin[bin_of[k] + 1];
  for (uint64_t b = 0; b < bins; ++b) out.begin[b + 1] += out.begin[b];
  out.order.resize(n);
  std::vector<uint64_t> at(out.begin.begin(), out.begin.end() - 1);
  for (uint64_t k = 0; k < n; ++k) out.order[at[bin_of[k]]++] = sorted[k];
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
