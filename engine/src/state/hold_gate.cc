// The checkpoint snapshot's gate on updates (hold_gate.h).
#include "state/hold_gate.h"

#include "strata/engine/engine.h"

namespace strata::engine::state {

void HoldGate::wait_all() const {
  if (hold_) hold_->wait_all();
}

HoldGate::Waiter HoldGate::waiter(double* waited) const {
  return [this, h = hold_, waited](size_t u) {
    if (!h || h->released(u)) return;
    const auto b = Profiler::Clock::now();
    h->wait(u);
    const auto e = Profiler::Clock::now();
    const double seconds = std::chrono::duration<double>(e - b).count();
    prof_.checkpoint_wait_ns += uint64_t(seconds * 1e9);
    if (waited) *waited += seconds;
    prof_.span(Profiler::on_updater ? "optimizer" : "host", "wait checkpoint snapshot " + names_.at(u), b, e);
  };
}

}  // namespace strata::engine::state
