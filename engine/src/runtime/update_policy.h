// When and where a step's Adam update runs (optimizer.overlap), over the optimizer and the
// updater, each update waiting unit by unit for a checkpoint snapshot's hold (state/hold_gate.h):
//
//   off (or master weights on the device): the whole update on the training thread, at the step's
//     end (run_now);
//   "forward": the device's units at the step's end, the CPU's on the updater while the next
//     step's forward runs (launch_after_step);
//   "backward": the CPU's units on the updater from the last micro-batch's head on
//     (launch_in_backward), the device's at the step's end (finish_in_backward).
//
// Every wait for a snapshot's hold is the gate's waiter, made here: an update's timers leave the
// seconds it waited out (a checkpoint's wait is not optimizer work).
//
// Ownership: borrows every part (the engine's, which outlive it). Threads: the training thread.
// Errors: the optimizer's and the updater's, as they throw them (finish rethrows the updater's).
#pragma once

#include <functional>
#include <vector>

#include "profiler.h"
#include "runtime/optimizer.h"
#include "runtime/updater.h"
#include "state/hold_gate.h"
#include "strata/engine/config.h"
#include "strata/engine/device.h"
#include "strata/kernels/cpu_optim.h"

namespace strata::engine::runtime {

class UpdatePolicy {
 public:
  // `master_on_device`: the state store's master weights are on the device (the CUDA step is
  // already asynchronous: nothing overlaps).
  UpdatePolicy(UpdateOverlap overlap, bool profile, bool master_on_device, Optimizer& optimizer, Updater& updater,
               const state::HoldGate& holds, Device& dev, Profiler& prof)
      : overlap_(overlap), profile_(profile), master_on_device_(master_on_device), optimizer_(optimizer),
        updater_(updater), holds_(holds), dev_(dev), prof_(prof) {}

  // The update runs beside the training thread's work ("forward" or "backward").
  bool overlaps() const { return overlap_ != UpdateOverlap::kOff && !master_on_device_; }
  bool in_backward() const { return overlaps() && overlap_ == UpdateOverlap::kBackward; }

  // "backward": the CPU's units on the updater as their gradients become final.
  void launch_in_backward(const kernels::AdamConfig& ac) { updater_.launch_in_backward(ac, holds_.waiter()); }
  // "backward", at the step's end: the device's units, on the compute stream, their squared
  // gradient sums beside the updater's.
  void finish_in_backward(const kernels::AdamConfig& ac) { update_device_units(ac, &updater_.unit_sumsq()); }
  // The local sum of squared gradients the global norm is made of: "backward"'s, summed by unit as
  // the updates took them; otherwise the optimizer's over the stored gradients.
  double local_sum_squares();
  // A finished step's update (not "backward"): launched ("forward") or run here.
  void run(const kernels::AdamConfig& ac);

  void finish() { updater_.finish(); }
  void abort() { updater_.abort(); }

 private:
  // The device's units (a split optimizer group's first ones), on the training thread: one launch
  // on the compute stream, counted as exposed optimizer time.
  void update_device_units(const kernels::AdamConfig& ac, std::vector<double>* sumsq = nullptr);
  // Runs `update` on the training thread under the optimizer's timer (`what`), handing it the
  // gate's waiter; the seconds it waited for a snapshot come out of the optimizer's time, the rest
  // counts as exposed optimizer time.
  void timed_on_training_thread(const char* what, const std::function<void(const state::HoldGate::Waiter&)>& update);

  const UpdateOverlap overlap_;
  const bool profile_, master_on_device_;
  Optimizer& optimizer_;
  Updater& updater_;
  const state::HoldGate& holds_;
  Device& dev_;
  Profiler& prof_;
};

}  // namespace strata::engine::runtime
