// The checkpoint snapshot's gate on updates (hold_gate.h), and the hold itself (state_hold.h).
#include "state/hold_gate.h"

#include <algorithm>

#include "strata/engine/state_hold.h"

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

namespace strata::engine {

void StateHold::release(size_t unit) {
  std::lock_guard<std::mutex> lock(mu_);
  if (released_.at(unit)) return;
  released_[unit] = 1;
  --left_;
  cv_.notify_all();
}

void StateHold::release_all() {
  std::lock_guard<std::mutex> lock(mu_);
  std::fill(released_.begin(), released_.end(), 1);
  left_ = 0;
  cv_.notify_all();
}

bool StateHold::released(size_t unit) const {
  std::lock_guard<std::mutex> lock(mu_);
  return released_.at(unit) != 0;
}

void StateHold::wait(size_t unit) const {
  std::unique_lock<std::mutex> lock(mu_);
  ++waiters_.at(unit);
  cv_.wait(lock, [&] { return released_[unit] != 0; });
  --waiters_[unit];
}

void StateHold::wait_all() const {
  std::unique_lock<std::mutex> lock(mu_);
  cv_.wait(lock, [&] { return left_ == 0; });
}

bool StateHold::waited_for(size_t unit) const {
  std::lock_guard<std::mutex> lock(mu_);
  return waiters_.at(unit) > 0;
}

}  // namespace strata::engine
