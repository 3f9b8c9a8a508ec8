#include "state/host_memory.h"

#include <ATen/ops/empty.h>

namespace strata::engine::state {

at::TensorOptions HostMemory::options(at::ScalarType t) const {
  return at::TensorOptions().dtype(t).pinned_memory(device_.pins_host());
}

at::Tensor HostMemory::state(uint64_t numel, at::ScalarType t, const std::string& what) {
  at::Tensor out = device_.host_state(numel, t, what);
  state_bytes_ += numel * c10::elementSize(t);
  return out;
}

at::Tensor HostMemory::buffer(uint64_t numel, at::ScalarType t) const {
  if (device_.pins_host()) return at::empty({int64_t(numel)}, options(t));
  return unpinned(numel, t);
}

at::Tensor HostMemory::unpinned(uint64_t numel, at::ScalarType t) { return Device::unpinned_host(numel, t); }

}  // namespace strata::engine::state
