// The packing rule's previous method (models::best_fit_decreasing before 2026-12-03): the open
// bins in a std::multimap keyed by free room, O(n log n) with a node per open bin and a vector per
// bin. Kept as the baseline of `strata bench pack` and the packing test's second opinion: the
// same rule (token_data.h), so it must give the same bins.
#pragma once

#include <algorithm>
#include <cstdint>
#include <map>
#include <random>
#include <vector>

#include "strata/models/token_data.h"

namespace strata::bench {

inline models::Bins best_fit_decreasing_multimap(const std::vector<uint64_t>& lengths, uint64_t capacity,
                                                 uint64_t seed) {
  const uint64_t n = lengths.size();
  std::vector<uint64_t> items(n);
  for (uint64_t i = 0; i < n; ++i) items[i] = i;
  std::mt19937_64 rng(seed * 0x9E3779B97F4A7C15ull + 0x7061636bull);
  for (uint64_t i = n; i > 1; --i) std::swap(items[i - 1], items[rng() % i]);
  std::stable_sort(items.begin(), items.end(), [&](uint64_t a, uint64_t b) { return lengths[a] > lengths[b]; });
  std::vector<std::vector<uint64_t>> bins;
  std::multimap<uint64_t, uint64_t> room;  // free room -> bin, equal rooms in the order they came
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
  models::Bins out;
  out.begin.push_back(0);
  for (const auto& b : bins) {
    out.order.insert(out.order.end(), b.begin(), b.end());
    out.begin.push_back(out.order.size());
  }
  return out;
}

}  // namespace strata::bench
