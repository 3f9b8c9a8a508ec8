// Runs a body over indices on a few threads: how the object-store transfers and the checkpoint
// reader keep several requests in flight from synchronous calls.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <exception>
#include <mutex>
#include <thread>
#include <type_traits>
#include <vector>

namespace strata::offload {

// Runs body(i) for i in [0, count) on up to `concurrency` threads (the caller's among them);
// the first exception stops the others from taking new work and is rethrown. A body taking
// (i, worker) also gets its thread's number in [0, parallel_workers(count, concurrency)), for
// per-thread scratch that lives across its items.
inline size_t parallel_workers(size_t count, int concurrency) {
  return std::min<size_t>(count, static_cast<size_t>(std::max(1, concurrency)));
}
template <class Body>
void run_parallel(size_t count, int concurrency, Body body) {
  std::atomic<size_t> next{0};
  std::atomic<bool> failed{false};
  std::exception_ptr error;
  std::mutex error_mu;
  auto worker = [&](size_t w) {
    for (;;) {
      const size_t i = next.fetch_add(1);
      if (i >= count || failed.load()) return;
      try {
        if constexpr (std::is_invocable_v<Body&, size_t, size_t>) body(i, w);
        else body(i);
      } catch (...) {
        std::lock_guard lock(error_mu);
        if (!error) error = std::current_exception();
        failed = true;
        return;
      }
    }
  };
  const size_t threads = parallel_workers(count, concurrency);
  std::vector<std::thread> pool;
  for (size_t t = 1; t < threads; ++t) pool.emplace_back(worker, t);
  worker(0);
  for (auto& t : pool) t.join();
  if (error) std::rethrow_exception(error);
}

}  // namespace strata::offload
