// Activation checkpoints: each recomputed block's input, kept from its forward to its recompute
// where placement.activations says (resolved before the store is built):
//   device  kept where it is (no copies); its reservation moves with it;
//   host    copied down on the d2h stream during the forward, up on the h2d stream one stage
//           ahead of the backward;
//   nvme    copied down into a staging buffer, then written to the swap slot
//           "activation.<unit>" by a host function on the d2h stream (which submits the write
//           and returns); read back into a host buffer two stages ahead of the backward and
//           copied up one stage ahead. At most kStaging buffers wait for their writes: a disk
//           slower than the forward holds the forward back instead of growing host memory.
//           The first read waits for every write still pending, so the backward's read
//           buffers never add to the forward's staging buffers (kStaging bounds both).
// Slot s holds stage s's input (a block stage's; the embedding's input is the token ids).
//
// Threads and ownership: the training thread owns the store and every slot; host functions on
// the d2h stream only submit writes and complete their promises. Staging buffers are dropped on
// the training thread, never on an I/O or CUDA callback thread (freeing pinned memory may call
// CUDA). Errors: swap I/O errors surface as IoError from the waits (put, read_ahead, fetch) or
// from the stream's synchronize.
#pragma once

#include <ATen/core/Tensor.h>

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "profiler.h"
#include "state/host_memory.h"
#include "strata/engine/config.h"
#include "strata/engine/device.h"
#include "strata/offload/swap_space.h"

namespace strata::engine::runtime {

class ActivationStore {
 public:
  // `shapes` by stage: its checkpoint's ([micro_batch, seq_len, hidden], or [2, ...] for a block
  // tile's stacked input) in `dtype`; `unit_names` by stage
  // (swap slots and messages). `swap` must be set for nvme placement, and outlive the store;
  // the slots of the `checkpointed` stages are allocated in it here.
  ActivationStore(Placement where, std::vector<std::vector<int64_t>> shapes, at::ScalarType dtype,
                  std::vector<std::string> unit_names, const std::vector<size_t>& checkpointed, Device& dev,
                  const state::HostMemory& host, Profiler& prof, offload::SwapSpace* swap);
  ~ActivationStore();  // waits for the writes whose host function ran (a step that failed)
  ActivationStore(const ActivationStore&) = delete;
  ActivationStore& operator=(const ActivationStore&) = delete;

  Placement placement() const { return where_; }
  // A new micro-batch: drops the slots, waiting for reads still filling their buffers.
  void begin_micro_batch();
  // Keeps stage s's input `x` (computed on the compute stream); device placement takes `res`.
  void put(size_t s, const at::Tensor& x, Device::Reservation& res);
  // NVMe: starts reading stage s's checkpoint into a host buffer (nothing otherwise, or if it is
  // being read or fetched).
  void read_ahead(size_t s);
  // Starts bringing stage s's input back to the device (nothing if it is there or on its way).
  void fetch(size_t s);
  // Stage s's input on the device, the compute stream ordered after its copy back.
  at::Tensor take(size_t s, Device::Reservation& res);
  // Drops staging buffers whose writes are done (every checkpoint came back: all of them).
  void prune();
  // Host memory the checkpoints held at most (MemoryReport::host_activations).
  uint64_t host_peak() const { return host_peak_; }

 private:
  struct Slot {
    at::Tensor device;             // device placement, or on its way back for the backward
    Device::Reservation res;       // device placement: the forward's reservation of the input
    at::Tensor host;               // host placement
    offload::IoFuture written;     // NVMe placement: the slot's write
    at::Tensor staged;             // NVMe placement: read back into this host buffer by `read`
    offload::IoFuture read;
    std::shared_ptr<Event> ready;  // the copy back to the device is done
  };
  struct Write {
    offload::IoFuture written;
    at::Tensor buffer;
    std::shared_ptr<std::atomic<bool>> submitted;  // the host function ran (the write exists)
  };
  static constexpr size_t kStaging = 3;
  std::string swap_name(size_t s) const { return "activation." + unit_names_.at(s); }

  const Placement where_;
  uint64_t numel(size_t stage) const;
  const std::vector<std::vector<int64_t>> shapes_;
  const at::ScalarType dtype_;
  const std::vector<std::string> unit_names_;
  Device& dev_;
  const state::HostMemory& host_;
  Profiler& prof_;
  offload::SwapSpace* swap_;
  std::vector<Slot> slots_;
  std::vector<Write> writes_;
  uint64_t host_bytes_ = 0;  // host-placed checkpoints of the micro-batch in flight
  uint64_t host_peak_ = 0;
};

}  // namespace strata::engine::runtime
