// StateHold: a checkpoint snapshot's claim on the saved state. A leaf: it names no other part of
// the engine, so the state tier (state/hold_gate.h) and the public API (engine.h) both use it.
#pragma once

#include <condition_variable>
#include <cstddef>
#include <mutex>
#include <vector>

namespace strata::engine {

// A snapshot's claim on the saved state (fp32 master and moments) of every unit: the engine
// changes unit u's saved state (its next update, store_state_slice, a state_slice handed out for
// writing) only once the holder has released u. A checkpoint writer releases units as it copies
// them out, in Engine::update_order(), so that training goes on while it writes.
// Thread safety: every member may be called from any thread. Releasing is idempotent.
class StateHold {
 public:
  explicit StateHold(size_t units) : released_(units, 0), left_(units), waiters_(units, 0) {}
  void release(size_t unit);
  void release_all();  // on every exit path of the holder, failure included
  bool released(size_t unit) const;
  void wait(size_t unit) const;
  void wait_all() const;
  // Whether a thread is blocked in wait(unit) right now (not wait_all()): an update waiting for
  // exactly this unit (observability, tests).
  bool waited_for(size_t unit) const;

 private:
  mutable std::mutex mu_;
  mutable std::condition_variable cv_;
  std::vector<char> released_;
  size_t left_;
  mutable std::vector<int> waiters_;  // by unit, in wait()
};

}  // namespace strata::engine
