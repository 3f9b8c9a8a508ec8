// A budgeted pool of page-locked host memory for transfers to NVMe and to the GPU.
//
// Memory is obtained from a HostAllocator in slabs (cudaHostAlloc when a GPU is present, aligned
// allocation + mlock otherwise) only as demand grows, never beyond the byte budget, and is then
// sub-allocated and reused: a transfer never allocates. Slabs are kept until trim() or
// destruction, so steady-state training performs no allocation at all.
//
// Errors: allocate() throws PinnedPoolExhausted, with the budget, the usage and the largest free
// block in the message, when the request cannot be satisfied within the budget.
// Ownership: PinnedBuffer returns its block to the pool when destroyed; the pool must outlive
// all its buffers (checked: the destructor aborts with a message if buffers are still out).
// Thread safety: allocate/usage/trim and PinnedBuffer destruction are safe from any thread.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <new>
#include <span>
#include <string>
#include <vector>

namespace strata::offload {

// Source of large page-locked regions. Implementations: mlock (always), CUDA (when built with
// CUDA and a device is visible).
class HostAllocator {
 public:
  virtual ~HostAllocator() = default;
  // Returns `bytes` of memory aligned to at least 4096; throws std::bad_alloc on failure.
  // `*pinned` tells whether the memory is actually page-locked (mlock can be refused).
  virtual void* allocate(size_t bytes, bool* pinned) = 0;
  virtual void deallocate(void* ptr, size_t bytes) noexcept = 0;
  virtual const char* name() const = 0;
};

std::unique_ptr<HostAllocator> make_mlock_allocator();
// cudaHostAlloc if this build has CUDA and a device is visible, else the mlock allocator.
std::unique_ptr<HostAllocator> make_default_host_allocator();

class PinnedPoolExhausted : public std::bad_alloc {
 public:
  explicit PinnedPoolExhausted(std::string message) : message_(std::move(message)) {}
  const char* what() const noexcept override { return message_.c_str(); }

 private:
  std::string message_;
};

class PinnedPool;

// A block of pinned memory; move-only, returned to its pool on destruction.
class PinnedBuffer {
 public:
  PinnedBuffer() = default;
  PinnedBuffer(PinnedBuffer&& other) noexcept { *this = std::move(other); }
  PinnedBuffer& operator=(PinnedBuffer&& other) noexcept;
  ~PinnedBuffer() { release(); }

  std::byte* data() const { return data_; }
  size_t size() const { return size_; }          // bytes requested
  size_t capacity() const { return capacity_; }  // bytes reserved (rounded to the alignment)
  std::span<std::byte> span() const { return {data_, size_}; }
  explicit operator bool() const { return data_ != nullptr; }
  void release() noexcept;

 private:
  friend class PinnedPool;
  PinnedPool* pool_ = nullptr;
  std::byte* data_ = nullptr;
  size_t size_ = 0;
  size_t capacity_ = 0;
};

struct PinnedPoolUsage {
  uint64_t budget_bytes = 0;
  uint64_t reserved_bytes = 0;  // held in slabs (counts against the budget)
  uint64_t in_use_bytes = 0;    // handed out to live buffers
  uint64_t peak_in_use_bytes = 0;
  uint64_t live_buffers = 0;
  uint64_t slabs = 0;
  uint64_t allocations = 0;     // allocate() calls served
  bool pinned = true;           // every slab is page-locked
};

class PinnedPool {
 public:
  static constexpr size_t kAlignment = 4096;  // satisfies O_DIRECT and cudaMemcpyAsync

  // `slab_bytes`: granularity of growth (requests larger than it get a slab of their own).
  PinnedPool(uint64_t budget_bytes, std::unique_ptr<HostAllocator> allocator = nullptr,
             uint64_t slab_bytes = 64ull << 20);
  ~PinnedPool();
  PinnedPool(const PinnedPool&) = delete;
  PinnedPool& operator=(const PinnedPool&) = delete;

  // Throws PinnedPoolExhausted if `bytes` (rounded up to kAlignment) does not fit the budget.
  PinnedBuffer allocate(size_t bytes);
  PinnedPoolUsage usage() const;
  // Gives back slabs that hold no live buffer; returns the bytes released.
  uint64_t trim();
  // The slabs, e.g. to register them with an I/O engine or the CUDA driver.
  std::vector<std::span<std::byte>> slabs() const;
  const char* allocator_name() const { return allocator_->name(); }

 private:
  friend class PinnedBuffer;
  struct Slab;
  void give_back(std::byte* data, size_t capacity) noexcept;

  mutable std::mutex mu_;
  uint64_t budget_;
  uint64_t slab_bytes_;
  std::unique_ptr<HostAllocator> allocator_;
  std::vector<std::unique_ptr<Slab>> slabs_;
  PinnedPoolUsage usage_;
};

}  // namespace strata::offload
