// cudaHostAlloc-backed HostAllocator, compiled only when the build has the CUDA runtime.
// Pinned memory from the driver lets cudaMemcpyAsync run at full PCIe speed without staging.
#include <cuda_runtime_api.h>

#include <new>

#include "strata/offload/pinned_pool.h"

namespace strata::offload {
namespace {

class CudaHostAllocator final : public HostAllocator {
 public:
  void* allocate(size_t bytes, bool* pinned) override {
    void* p = nullptr;
    // Portable: usable from every device context; the driver page-locks it.
    if (cudaHostAlloc(&p, bytes, cudaHostAllocPortable) != cudaSuccess) {
      cudaGetLastError();
      throw std::bad_alloc();
    }
    *pinned = true;
    return p;
  }
  void deallocate(void* ptr, size_t) noexcept override { cudaFreeHost(ptr); }
  const char* name() const override { return "cudaHostAlloc"; }
};

}  // namespace

std::unique_ptr<HostAllocator> make_default_host_allocator() {
  int devices = 0;
  if (cudaGetDeviceCount(&devices) == cudaSuccess && devices > 0) {
    return std::make_unique<CudaHostAllocator>();
  }
  cudaGetLastError();  // clear the "no device" error
  return make_mlock_allocator();
}

}  // namespace strata::offload
