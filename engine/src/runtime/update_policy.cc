// When and where the update runs (update_policy.h).
#include "runtime/update_policy.h"

namespace strata::engine::runtime {

double UpdatePolicy::local_sum_squares() {
  if (!in_backward()) return optimizer_.local_sum_squares();
  double sumsq = 0;
  for (double v : updater_.unit_sumsq()) sumsq += v;
  return sumsq;
}

void UpdatePolicy::run(const kernels::AdamConfig& ac) {
  if (overlaps()) {  // "forward": the device's units now, the CPU's behind the next forward
    update_device_units(ac);
    updater_.launch_after_step(ac, holds_.waiter());
    return;
  }
  timed_on_training_thread("optimizer", [&](const state::HoldGate::Waiter& before_write) {
    optimizer_.update_on_device(ac, optimizer_.units_where(true), nullptr, before_write);
    const std::vector<size_t> rest = optimizer_.units_where(false);
    if (!rest.empty()) optimizer_.update_on_cpu(ac, rest, {}, nullptr, before_write);
  });
}

void UpdatePolicy::update_device_units(const kernels::AdamConfig& ac, std::vector<double>* sumsq) {
  const std::vector<size_t> which = optimizer_.units_where(true);
  if (which.empty()) return;
  timed_on_training_thread("optimizer (device)", [&](const state::HoldGate::Waiter& before_write) {
    optimizer_.update_on_device(ac, which, sumsq, before_write);
    if (profile_) dev_.synchronize(dev_.compute_stream());  // the kernel's time, not its launch's
  });
}

void UpdatePolicy::timed_on_training_thread(const char* what,
                                            const std::function<void(const state::HoldGate::Waiter&)>& update) {
  const double before = prof_.step.optimizer;
  double waited = 0;  // for a checkpoint's snapshot: not optimizer work
  {
    auto t = prof_.time(prof_.step.optimizer, what);
    update(holds_.waiter(&waited));
  }
  prof_.step.optimizer -= waited;
  prof_.step.optimizer_exposed += prof_.step.optimizer - before;
}

}  // namespace strata::engine::runtime
