// The host buffers of gradients that are not stored (gradients_transient): a fixed pool of
// `count` fp32 buffers, each as large as the largest shard. A unit's reduced gradient lives in one
// from its step's first reduce (take: the gradient reducer lends it as StateStore::tensor(u,
// kGrad)) until its update has read it (release: the updater). A backward faster than the
// updater waits in take for a free buffer.
//
// Ownership: owns the buffers (allocated from `host` at construction); the store, the partition,
// the device and the profiler must outlive it. The gradient reducer owns the pool; the updater
// borrows it to give buffers back.
// Threads: take on the training thread; release and fail on the updater thread; reset on the
// training thread between updates. The slots, the units' slots and the failure are under `mu_`;
// the store's tensor(u, kGrad) is written by whichever thread holds unit u (the reducer before
// the update, the updater during it).
// Errors: take waits while the d2h stream runs (what frees a buffer is the updater, which waits
// for that stream's host functions): once the stream has failed, take throws naming its error
// instead of hanging; once the updater has failed (fail), take throws its error.
#pragma once

#include <ATen/core/Tensor.h>

#include <condition_variable>
#include <cstdint>
#include <exception>
#include <mutex>
#include <vector>

#include "profiler.h"
#include "state/host_memory.h"
#include "state/state_store.h"
#include "strata/engine/device.h"
#include "strata/engine/partition.h"

namespace strata::engine::runtime {

class GradientBuffers {
 public:
  GradientBuffers(state::StateStore& store, const Partition& partition, Device& device, Profiler& prof,
                  state::HostMemory& host, size_t count, uint64_t numel);

  size_t size() const { return pool_.size(); }
  // Lends unit u a free buffer as its gradient, waiting (counted as StepTimeline::wait_update)
  // while none is.
  void take(size_t u);
  // Unit u's update has read its gradient: its buffer is free again and u has none.
  void release(size_t u);
  // The update failed: it frees nothing more, so a take that would wait throws `error` instead.
  void fail(std::exception_ptr error);
  // A new update starts: takes wait again.
  void reset();

 private:
  state::StateStore& store_;
  const Partition& partition_;
  Device& dev_;
  Profiler& prof_;
  std::vector<at::Tensor> pool_;

  std::mutex mu_;
  std::condition_variable cv_;
  std::vector<char> used_;     // by slot, under mu_
  std::vector<size_t> slot_;   // by unit: its slot while it holds one, under mu_
  std::exception_ptr error_;   // under mu_
};

}  // namespace strata::engine::runtime
