// Host memory for state, copies and direct I/O: the one place the engine allocates it.
//
//   state(...)      a state shard or long-lived buffer: page aligned (O_DIRECT straight from
//                   where it lives), pinned at its exact size on a GPU (libtorch's pinned
//                   allocator rounds blocks up to a power of two, which for large shards wastes
//                   up to half the memory); counted in state_bytes().
//   buffer(...)     a transfer buffer: page aligned, pinned on a GPU (libtorch's caching pinned
//                   allocator, so steady-state reuse does not call CUDA).
//   unpinned(...)   page aligned, never pinned: the only kind a host function on a device
//                   stream may allocate (CUDA forbids CUDA calls there, and pinning is one).
//
// Ownership: borrows the Device (which says how host memory is allocated for it); the Device
// must outlive it. Thread safety: buffer() and unpinned() from any thread (unpinned() also from host functions);
// state() from the constructing thread. Errors: std::bad_alloc, or std::runtime_error naming
// `what` and the bytes when pinning fails.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <string>

#include "strata/engine/device.h"

namespace strata::engine::state {

class HostMemory {
 public:
  explicit HostMemory(const Device& device) : device_(device) {}

  at::TensorOptions options(at::ScalarType t) const;  // pinned on a GPU
  at::Tensor state(uint64_t numel, at::ScalarType t, const std::string& what);
  at::Tensor buffer(uint64_t numel, at::ScalarType t) const;
  static at::Tensor unpinned(uint64_t numel, at::ScalarType t);
  uint64_t state_bytes() const { return state_bytes_; }

 private:
  const Device& device_;  // how it allocates (pinned or not): Device::pins_host, host_state
  uint64_t state_bytes_ = 0;
};

}  // namespace strata::engine::state
