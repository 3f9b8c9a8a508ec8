// Timing shared by the benchmarks.
#pragma once

#include <algorithm>
#include <chrono>
#include <functional>
#include <vector>

namespace strata::bench {

// Median seconds per call of each function, timed round-robin (a, b, c, a, b, c, ...) after one
// warm-up call each, so that drift in the machine's speed hits every side alike.
inline std::vector<double> median_seconds(unsigned steps,
                                          const std::vector<std::function<void()>>& fns) {
  using Clock = std::chrono::steady_clock;
  for (auto& fn : fns) fn();
  std::vector<std::vector<double>> t(fns.size());
  for (unsigned s = 0; s < steps; ++s) {
    for (size_t i = 0; i < fns.size(); ++i) {
      const auto t0 = Clock::now();
      fns[i]();
      t[i].push_back(std::chrono::duration<double>(Clock::now() - t0).count());
    }
  }
  std::vector<double> out;
  for (auto& ti : t) {
    std::sort(ti.begin(), ti.end());
    out.push_back(ti[ti.size() / 2]);
  }
  return out;
}

// The median of `v` (the mean of the middle two for an even count); 0 for none.
inline double median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  return v.size() % 2 ? v[v.size() / 2] : (v[v.size() / 2 - 1] + v[v.size() / 2]) / 2;
}

}  // namespace strata::bench
