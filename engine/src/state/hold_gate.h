// The gate between a checkpoint's snapshot and the updates that change the state it copies out
// (Engine::hold_state): an update waits here for the snapshot's hold to release a unit before it
// changes that unit's saved state. Each wait is measured where it happens: a trace span
// ("wait checkpoint snapshot <unit>", on the optimizer lane on the updater thread), the step's
// StepTimeline::wait_checkpoint (Profiler::checkpoint_wait_ns, from any thread), and the seconds
// handed to the waiter's caller, whose own timers take them out (an optimizer timer does not count
// a checkpoint's wait as optimizer work).
//
// Ownership: the engine owns the gate; the gate shares ownership of the current hold, and each
// waiter of the hold it was made under, so that an update launched before a newer snapshot waits
// only for the hold it was launched under.
// Threads: set() and wait_all() on the training thread. A waiter runs on the one thread that
// runs its update (the training thread's optimizer or the updater's); `waited` is that thread's.
// Errors: none of its own; StateHold's waits block until released (release_all on every exit path).
#pragma once

#include <cstddef>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "profiler.h"

namespace strata::engine {
class StateHold;  // strata/engine/state_hold.h
}

namespace strata::engine::state {

class HoldGate {
 public:
  // unit_names: by unit, for the spans.
  HoldGate(Profiler& prof, std::vector<std::string> unit_names) : prof_(prof), names_(std::move(unit_names)) {}
  // The snapshot's hold from now on (the caller waited for the previous one: wait_all()).
  void set(std::shared_ptr<StateHold> hold) { hold_ = std::move(hold); }
  // Until the current hold, if any, has released every unit.
  void wait_all() const;
  // Waits for unit u under the hold current now; adds the seconds waited to *waited if given.
  using Waiter = std::function<void(size_t)>;
  Waiter waiter(double* waited = nullptr) const;

 private:
  Profiler& prof_;
  const std::vector<std::string> names_;
  std::shared_ptr<StateHold> hold_;
};

}  // namespace strata::engine::state
