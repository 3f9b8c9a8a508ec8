#include "state/host_memory.h"

#include <ATen/ops/empty.h>
#include <ATen/ops/from_blob.h>

#include <algorithm>
#include <cstdlib>
#include <new>
#include <stdexcept>
#ifdef STRATA_HAVE_CUDA
#include <cuda_runtime.h>
#endif

namespace strata::engine::state {

at::TensorOptions HostMemory::options(at::ScalarType t) const {
  return at::TensorOptions().dtype(t).pinned_memory(cuda_);
}

at::Tensor HostMemory::state(uint64_t numel, at::ScalarType t, const std::string& what) {
  const uint64_t bytes = numel * c10::elementSize(t);
  state_bytes_ += bytes;
#ifdef STRATA_HAVE_CUDA
  if (cuda_) {
    void* p = nullptr;
    if (cudaHostAlloc(&p, std::max<uint64_t>(1, bytes), cudaHostAllocDefault) != cudaSuccess)
      throw std::runtime_error("cannot pin " + format_bytes(bytes) + " of host memory for " + what + ": " +
                               cudaGetErrorString(cudaGetLastError()));
    return at::from_blob(p, {int64_t(numel)}, [](void* q) { cudaFreeHost(q); },
                         at::TensorOptions().dtype(t).pinned_memory(true));
  }
#endif
  (void)what;
  return unpinned(numel, t);
}

at::Tensor HostMemory::buffer(uint64_t numel, at::ScalarType t) const {
  if (cuda_) return at::empty({int64_t(numel)}, options(t));
  return unpinned(numel, t);
}

at::Tensor HostMemory::unpinned(uint64_t numel, at::ScalarType t) {
  const uint64_t bytes = numel * c10::elementSize(t);
  void* p = std::aligned_alloc(4096, std::max<uint64_t>(4096, (bytes + 4095) / 4096 * 4096));
  if (!p) throw std::bad_alloc();
  return at::from_blob(p, {int64_t(numel)}, [](void* q) { std::free(q); }, at::TensorOptions().dtype(t));
}

}  // namespace strata::engine::state
