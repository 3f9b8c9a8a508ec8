// Adam over this rank's shards, where each unit's master weights live, and the local part of the
// gradient norm. The device's units (master on the device) go through Device::adam_step and
// Device::sum_squares (one launch on a GPU; the same CPU kernels on the host device); the CPU's
// units through the CPU kernels, unit by unit on resident host state, or chunk by chunk through
// the chunk ring when any kind of the optimizer group or the compute copy is in swap. Every
// update writes the unit's next compute copy wherever it lives (store_compute).
//
// Order: sums of squares are taken unit by unit in the order given (chunk by chunk where
// streamed) with the CPU kernel's fixed reduction tree, so the gradient norm and every updated
// number are bitwise independent of where a unit lives.
//
// Ownership: borrows the state store, host memory and device, which must outlive it; holds no
// state of its own between calls.
// Threads: update_on_device, local_sum_squares and refresh_compute_copies on the training thread;
// update_on_cpu on the training thread or the updater, for units the step has handed to it
// (their gradients final, nobody else touching them). Errors: I/O errors of streamed state
// rethrown (after the chunk ring has drained its buffers); Device errors as thrown.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <functional>
#include <vector>

#include "state/chunk_ring.h"
#include "state/host_memory.h"
#include "state/state_store.h"
#include "strata/engine/device.h"
#include "strata/kernels/cpu_optim.h"

namespace strata::engine::runtime {

class Optimizer {
 public:
  using UnitFn = std::function<void(size_t)>;
  // `chunk_bytes`: offload.optimizer_chunk (the chunk ring's chunk).
  // Element ranges [begin, end) of a unit's shard that get no weight decay (the second parameter
  // group; EngineConfig::no_decay_*), sorted and disjoint.
  using Ranges = std::vector<std::pair<uint64_t, uint64_t>>;
  // `no_decay[u]`: unit u's ranges (empty, or no entries at all: every element decays).
  Optimizer(state::StateStore& store, state::HostMemory& host, Device& device, kernels::CpuExec exec,
            uint64_t chunk_bytes, std::vector<Ranges> no_decay = {});

  // The trainable units whose update runs where their master weights are on the device (true),
  // or the CPU's (host RAM or NVMe), each in forward order; frozen units are nobody's.
  std::vector<size_t> units_where(bool on_device) const;

  // This rank's sum of squared gradients: the device's units first, then the CPU's, in forward
  // order.
  double local_sum_squares();
  // Adds each unit's sum of squared gradients (gradients on the device) to parts[u].
  void device_sum_squares(const std::vector<size_t>& which, std::vector<double>& parts);

  // Adam on the units in `which`, master, moments and gradients on the device: compute copies on
  // the device in one launch; the others unit by unit through one device buffer, each stored
  // before the next. `before_write(u)` for every unit first (a checkpoint's hold); with `sumsq`,
  // each unit's sum of squared gradients is added to (*sumsq)[u] before its update.
  void update_on_device(const kernels::AdamConfig& ac, const std::vector<size_t>& which,
                        std::vector<double>* sumsq = nullptr, const UnitFn& before_write = {});

  // The CPU Adam step of the units in `which`, in that order (master and moments in host RAM or
  // swap). `before_unit(u)` before u's first chunk is processed (it may block until u is ready);
  // `grad_consumed(u)` once u's gradient has been read for the last time; `unit_done(u)` once u
  // is updated and written back. With `sumsq`, as update_on_device.
  void update_on_cpu(const kernels::AdamConfig& ac, const std::vector<size_t>& which, const UnitFn& unit_done,
                     std::vector<double>* sumsq = nullptr, const UnitFn& before_unit = {},
                     const UnitFn& grad_consumed = {});

  // Unit u's compute copy := `values` (compute dtype, on the host or the device), wherever the
  // copy lives: in place, copied up or down, or written to its swap partition (waited for).
  void store_compute(size_t u, const at::Tensor& values);
  // Every trainable unit's compute copy := its master weights, converted (after a load).
  void refresh_compute_copies();

 private:
  // Any kind the CPU's update touches is in swap: the update streams through the chunk ring.
  bool streams() const;
  void stream(unsigned in, unsigned out, const std::vector<size_t>& which, const state::ChunkRing::Fn& fn,
              const UnitFn& unit_done = {}, const UnitFn& before_unit = {});
  void update_resident(const kernels::AdamConfig& ac, size_t u);
  // Calls fn(offset, count, config) over [begin, begin + numel) of unit u's shard in maximal
  // pieces of one parameter group: `ac`, or `ac` with weight_decay 0. Adam is elementwise, so the
  // pieces give bitwise what one call would.
  template <typename F>
  void by_group(const kernels::AdamConfig& ac, size_t u, uint64_t begin, uint64_t numel, F&& fn) const;

  state::StateStore& store_;
  state::HostMemory& host_;
  Device& dev_;
  const kernels::CpuExec exec_;
  const uint64_t chunk_bytes_;
  const kernels::DType compute_;
  const std::vector<Ranges> no_decay_;
  const uint64_t compute_bytes_;  // bytes of one compute-copy element
};

}  // namespace strata::engine::runtime
