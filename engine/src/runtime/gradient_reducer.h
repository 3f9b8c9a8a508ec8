// The gradient reducer: after a stage's backward, every trainable unit the stage uses is
// reduce-scattered (gradient or not, so that every rank issues the same collectives; a frozen
// unit has none) and this rank's shard is
// accumulated in fp32 where its gradient lives. The collectives are issued on the training thread
// in schedule order; with other ranks, a CPU (Gloo) collective whose shard goes off the device is
// waited for by a host function on the d2h stream, ahead of that shard's copy, so the training
// thread goes on with the next stage's backward while the ranks exchange (its buffers stay counted
// on the device until it is done; a budget that needs their room waits for the d2h stream; at
// most kMaxReducesInFlight at a time). CUDA collectives and device-accumulated shards are waited for
// on the training thread (on CUDA that orders streams).
//
//   device  added in place on the compute stream;
//   host    copied down on the d2h stream, then (a host function on it) copied into the
//           accumulator on the step's first contribution or added to it on later ones (a first
//           fp32 contribution is copied straight into the accumulator);
//   nvme    copied down, then a host function (after the unit's previous write) reads the
//           unit's partition, adds, and submits the write without waiting; the step's first
//           contribution is written without a read. Before each NVMe reduce, the training
//           thread waits for the oldest write while more than kMaxPendingWrites are in flight
//           (counted as waiting for gradients): at most kMaxPendingWrites + 1 buffers wait for
//           their writes, plus those of host functions still queued on the d2h stream, so a disk
//           slower than the backward holds the backward back, not host memory.
//
// Transient gradients (the store's plan says so): the reducer owns their pool of host buffers
// (runtime/gradient_buffers.h); a unit without an accumulator takes one at its first reduce of
// the step, which overwrites it, and the updater gives it back once the update has read it.
//
// Threads and ownership: the training thread calls every member. Whether a unit's next
// contribution is its step's first (`fresh_`) is decided on the training thread when the
// contribution is enqueued (the d2h stream runs them in that order) and reset by end_step().
// The d2h stream's host functions touch only `mu_`'s members: each unit's last swap write and the
// writes in flight with their buffers.
// Errors: collective errors from the communicator; a failed swap write fails the step at the
// next bound wait or at finish_writes (which waits for all first, then rethrows the first).
#pragma once

#include <ATen/core/Tensor.h>

#include <array>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "profiler.h"
#include "runtime/gradient_buffers.h"
#include "state/host_memory.h"
#include "state/state_store.h"
#include "strata/engine/comm.h"
#include "strata/engine/device.h"
#include "strata/engine/partition.h"
#include "strata/engine/layout/schedule.h"

namespace strata::engine::runtime {

// Who takes a unit's final gradient as soon as it is final (the updater during backward).
// mark_final runs on the d2h stream's host functions.
class FinalGradientSink {
 public:
  virtual ~FinalGradientSink() = default;
  // Unit u's gradient is final: accumulated, and for swap-resident gradients submitted as
  // `written` (its last swap write; an invalid future otherwise).
  virtual void mark_final(size_t u, offload::IoFuture written) = 0;
};

class GradientReducer {
 public:
  // A stage's parameter tensor and where it lives in the partition.
  struct ParamRef {
    at::Tensor tensor;
    size_t unit = 0;
    size_t slot = 0;
  };
  static constexpr size_t kMaxPendingWrites = 2;
  // CPU reduce-scatters waited for on the d2h stream and not yet done: before issuing another,
  // the training thread waits for the oldest while this many are in flight (counted as waiting
  // for gradients), which bounds the device and host buffers they hold.
  static constexpr size_t kMaxReducesInFlight = 2;

  // `stage_params[s]`: every tensor stage s's module uses; `reduce_bf16`: reduce-scatter in bf16;
  // `transient_buffers`: with transient gradients, how many host buffers of `buffer_numel` fp32
  // elements the pool holds (allocated now from `host`; at least 1), else unused.
  GradientReducer(const layout::Schedule& schedule, const Partition& partition, state::StateStore& store,
                  state::HostMemory& host, Device& device, Communicator& comm, Profiler& prof, bool reduce_bf16,
                  std::vector<std::vector<ParamRef>> stage_params, size_t transient_buffers = 0,
                  uint64_t buffer_numel = 0);
  ~GradientReducer();  // waits for the swap writes in flight (their buffers go with it)

  void reduce(size_t stage);
  // The transient gradients' pool (the updater gives buffers back to it), or null without them.
  GradientBuffers* gradient_buffers() { return buffers_.get(); }
  // After the step's last reduce(stage): each unit whose last use is `stage` goes to `sink` once
  // its gradient is final (a host function on the d2h stream, after its accumulation or swap
  // write). `sink` must outlive the d2h stream's work of the step.
  void hand_final_gradients(size_t stage, FinalGradientSink& sink);
  // Unit u's last swap write submitted so far (invalid if none): from the d2h stream's host
  // functions, ordered after the unit's accumulation.
  offload::IoFuture last_write(size_t u);
  // Waits for every swap write submitted so far (the caller synchronizes the d2h stream first,
  // so that every queued host function has submitted its write); rethrows the first failure
  // after waiting for all.
  void finish_writes();
  // After the step's update: device accumulators zeroed, the others overwritten by the next
  // step's first contribution.
  void end_step();

 private:
  void bound_pending_writes();
  std::map<size_t, at::Tensor> flat_gradients(size_t stage);
  void wait_reduced(std::shared_ptr<Communicator::Work> work, Placement where, const at::Tensor& shard,
                    const std::string& name);
  void accumulate(size_t u, const at::Tensor& shard, Placement where);
  void accumulate_on_nvme(size_t u, at::Tensor host, bool fresh);

  const layout::Schedule& schedule_;
  const Partition& partition_;
  state::StateStore& store_;
  state::HostMemory& host_;
  Device& dev_;
  Communicator& comm_;
  Profiler& prof_;
  const bool reduce_bf16_;
  std::vector<std::vector<ParamRef>> stage_params_;
  std::unique_ptr<GradientBuffers> buffers_;  // transient gradients only
  std::vector<char> fresh_;  // training thread
  std::deque<std::shared_ptr<Event>> reduces_in_flight_;  // training thread: each one's d2h wait done

  std::mutex mu_;
  std::vector<offload::IoFuture> last_write_;  // by unit, under mu_
  std::vector<std::pair<offload::IoFuture, std::array<at::Tensor, 2>>> writes_;  // in flight, under mu_
};

}  // namespace strata::engine::runtime
