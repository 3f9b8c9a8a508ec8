// The parameter coordinator: which units are gathered on the device, and when.
//
// A use of the schedule needs its stage's units gathered (acquire): each unit's compute-copy
// shard is uploaded, when it lives off the device (from swap through a host buffer, then the h2d
// stream), straight into its slice of one flat device buffer, which the all-gather fills around
// it in place, and the module's tensors of the unit
// become views of it (bound; a 4-bit record is dequantized into a tensor of its own, set_4bit). Before running use k the engine asks for the units of the next
// `depth` uses (prefetch); after it, units no use within the next depth + 1 needs go (release_
// after). Every decision uses only sizes and the schedule (the memory model's working set beside
// the device-placed state, the gathered units, the kept graphs reserved), never the device's
// momentary use, so every rank issues the same all-gathers in the same order.
//
// Kept blocks (run with autograd, no recompute) hold their units from their forward to their
// backward: hold(stage) / unhold(stage), and their graphs' bytes count while reserved
// (graph_reserved / graph_freed); begin_micro_batch() clears both.
//
// Ownership: owns the gathered buffers and the module tensors it binds (their storage; the
// stages' modules share the tensor objects). Borrows everything else (all must outlive it).
// Threads: the training thread only. Every gather of unit u first waits for the update running
// behind to be done with u (`fence`, runtime/update_fence.h; none: nothing runs behind). Errors: BudgetExceeded from the device, collective errors from the
// communicator, I/O errors from a staged swap read surface at the h2d stream's synchronize.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <set>
#include <vector>

#include "profiler.h"
#include "runtime/update_fence.h"
#include "state/host_memory.h"
#include "state/state_store.h"
#include "strata/engine/comm.h"
#include "strata/engine/device.h"
#include "strata/engine/partition.h"
#include "strata/engine/layout/memory_model.h"
#include "strata/engine/layout/schedule.h"
#include "strata/models/quantized_base.h"

namespace strata::engine::runtime {

class ParameterCoordinator {
 public:
  ParameterCoordinator(const layout::Schedule& schedule, const layout::MemoryModel& memory, const layout::Choices& choice,
                       const Partition& partition, state::StateStore& store, state::HostMemory& host, Device& device,
                       Communicator& comm, Profiler& prof, UpdateFence* fence);
  ~ParameterCoordinator();  // waits for gathers in flight (their buffers go with it)

  // Takes unit u's module tensors (slot order) and frees their storage: they hold data only while
  // the unit is gathered.
  void adopt(size_t u, std::vector<at::Tensor> tensors);
  // Frees the storage of `tensors` (each becomes an empty tensor of `dtype` on `device`), as
  // adopt and release do: the model's copy of a unit can go before the coordinator exists.
  static void drop_storage(std::vector<at::Tensor>& tensors, at::ScalarType dtype, Device& device);
  // Device bytes of the state placed there (the rest of the budget is the working set's).
  void set_device_state_bytes(uint64_t bytes) { base_bytes_ = bytes; }

  // Use k of the step's sequence (the schedule's uses, repeated every micro-batch; `total` of
  // them): its units gathered and bound, units kept for later uses dropped if it must.
  void acquire(size_t k);
  void prefetch(size_t k, size_t total);
  void release_after(size_t k, size_t total);
  void release(size_t u);

  // The 4-bit records' settings (model.quantize), for the units whose slots hold records: binding
  // such a unit dequantizes each record into a tensor of the compute dtype of its own (device
  // memory the memory model counts with the unit), freed at release.
  void set_4bit(const models::QuantizedBase& q) { quant_ = q; }

  int depth() const { return depth_; }
  void set_depth(int depth) { depth_ = depth; }

  void begin_micro_batch();
  // A kept stage's graph, reserved from its forward to its backward.
  void graph_reserved(size_t stage) { graphs_held_ += memory_.sizes().graph(stage); }
  void graph_freed(size_t stage) { graphs_held_ -= memory_.sizes().graph(stage); }
  void hold(size_t stage);
  void unhold(size_t stage);

  bool gathered(size_t u) const { return live_.count(u) > 0; }

 private:
  struct Gathered {
    at::Tensor flat;                           // compute dtype [padded], on the device
    std::unique_ptr<Communicator::Work> work;  // the all-gather in flight (none at world size 1)
    std::shared_ptr<Event> uploaded;           // world size 1: the shard's upload into `flat`
    bool bound = false;
  };
  // Waits until `g.flat` holds the unit (the all-gather, or the upload at world size 1).
  void wait_gathered(Gathered& g);
  void start_gather(size_t u);
  void bind(size_t u);
  bool fits(uint64_t extra) const;
  uint64_t unit_bytes(size_t u) const { return memory_.unit_bytes(u); }

  const layout::Schedule& schedule_;
  const layout::MemoryModel& memory_;
  const layout::Choices& choice_;
  const Partition& partition_;
  state::StateStore& store_;
  state::HostMemory& host_;
  Device& dev_;
  Communicator& comm_;
  Profiler& prof_;
  UpdateFence* const fence_;  // borrowed; may be null
  const at::ScalarType cdt_;

  std::vector<std::vector<at::Tensor>> tensors_;  // by unit: the module tensors, slot order
  std::map<size_t, Gathered> live_;
  std::set<size_t> held_;       // units of kept stages between their forward and backward
  uint64_t graphs_held_ = 0;    // kept graphs alive now (reserved on the device)
  uint64_t base_bytes_ = 0;
  int depth_ = 1;               // uses gathered ahead (device.prefetch; adapts with "auto")
  models::QuantizedBase quant_;
};

}  // namespace strata::engine::runtime
