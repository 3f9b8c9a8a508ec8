// The optimizer's CPU work on a thread of its own (optimizer.overlap), as one state machine:
//
//   idle --launch_after_step--> running "forward" --finish--> idle
//   idle --launch_in_backward--> running "backward" --finish--> idle
//   running --abort--> (stops waiting for gradients) --finish--> idle
//
// "forward": the step's update is final once the global norm is known; it runs unit by unit in
// forward order while the next step's forward starts. A gather of unit u waits for u's update
// (wait_updated), so every forward sees exactly the updated weights: the serial numbers, earlier.
// "backward": without clipping and loss scaling the update needs no global norm, so it starts
// during the step's last micro-batch: once a unit's gradient is final (mark_final, from the
// d2h stream's host function after its last accumulation or swap write) the updater takes it,
// in the order units become final (Schedule::in_final_gradient_order), their swap-resident state
// read ahead while the gradient is on its way; with gradients in swap (read only once final),
// the ready units in batches. The step's end joins it (finish), so the next forward sees the
// updated weights.
// The updater never issues collectives; the device's units (master on the device) are not its:
// the engine updates them on the training thread.
//
// Transient gradients (gradients_transient): a unit's gradient lives in one of the gradient
// reducer's buffers (runtime/gradient_buffers.h) from its first reduce until its update has read
// it; the updater gives the buffer back then, and tells the pool when it fails.
//
// Threads and ownership: the training thread calls every member except mark_final (the d2h
// stream's host functions). Under `mu_`: the per-unit flags (updated, final, their writes),
// the error and the abort flag. The updater thread owns update_seconds_ and
// the CPU units' entries of unit_sumsq_ while it runs; the training thread reads them only after
// finish().
// Errors: the updater's exception is rethrown by finish() (and by wait_updated, which finishes);
// the future over() carries it too. A wait for gradients fails, naming the stream's error, if the
// d2h stream can no longer run its host functions.
#pragma once

#include <ATen/core/Tensor.h>

#include <condition_variable>
#include <exception>
#include <functional>
#include <future>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "runtime/gradient_buffers.h"
#include "runtime/gradient_reducer.h"
#include "runtime/optimizer.h"
#include "runtime/update_fence.h"
#include "profiler.h"
#include "state/state_store.h"
#include "strata/engine/partition.h"
#include "strata/engine/layout/schedule.h"

namespace strata::engine::runtime {

class Updater final : public FinalGradientSink, public UpdateFence {
 public:
  using UnitFn = std::function<void(size_t)>;
  // `buffers`: with transient gradients, the pool each unit's gradient goes back to once its
  // update has read it (borrowed; it must outlive the updater); null otherwise.
  Updater(Optimizer& optimizer, state::StateStore& store, const layout::Schedule& schedule, const Partition& partition,
          Device& device, Profiler& prof, GradientBuffers* buffers);
  ~Updater() override;  // aborts and joins a running update

  // "forward": the CPU's units, in forward order. `before_write(u)` on the updater before u's
  // first write (a checkpoint's hold).
  void launch_after_step(const kernels::AdamConfig& ac, UnitFn before_write);
  // "backward": each of the CPU's units once mark_final(u) says its gradient is final.
  void launch_in_backward(const kernels::AdamConfig& ac, UnitFn before_write);
  // From the d2h stream's host function: unit u's gradient is final (`written`: its last swap
  // write, or an invalid future).
  void mark_final(size_t u, offload::IoFuture written) override;

  // "forward": blocks until u's update is done (no-op otherwise); rethrows the updater's error.
  void wait_updated(size_t u) override;
  // Joins the updater: its time goes into the step's timeline (optimizer, swap traffic); rethrows
  // its error once.
  void finish();
  // A failed step: stops an updater waiting for gradients that will not come, joins it and drops
  // its error (the step's own is the one reported).
  void abort();
  // Ready when the current (or last) update's work is over; carries its error.
  std::shared_future<void> over() const;
  // "backward": each unit's sum of squared gradients (for the norm), complete after finish().
  // The training thread adds the device's units' entries while the updater fills the others'.
  std::vector<double>& unit_sumsq() { return unit_sumsq_; }

 private:
  void start(std::function<void(const UnitFn&)> work);
  // Waits on cv_ (holding `lock`) until `ready`, checking the d2h stream every second.
  template <class Ready>
  void wait_while_d2h_runs(std::unique_lock<std::mutex>& lock, Ready ready);
  void backward_work(const kernels::AdamConfig& ac, const UnitFn& before_write, const UnitFn& unit_done);

  Optimizer& opt_;
  state::StateStore& store_;
  const layout::Schedule& schedule_;
  const Partition& partition_;
  Device& dev_;
  Profiler& prof_;
  const size_t units_;

  std::thread thread_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::vector<char> updated_;                  // by unit, under mu_
  std::vector<char> final_;                    // "backward": gradient final, under mu_
  std::vector<offload::IoFuture> final_write_;  // its last swap write, under mu_
  std::exception_ptr error_;                   // under mu_
  bool abort_ = false;                         // under mu_
  bool gathers_wait_ = false;                  // training thread: "forward" runs behind gathers
  std::shared_future<void> over_;
  double update_seconds_ = 0;                  // updater's work, folded in by finish()
  Profiler::Clock::time_point update_begin_;   // updater: when its current unit's work began
  std::vector<double> unit_sumsq_;

  GradientBuffers* const buffers_;  // transient gradients' pool (borrowed), or null
};

}  // namespace strata::engine::runtime
