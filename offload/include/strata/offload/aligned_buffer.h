// A page-aligned, zeroed host buffer for direct I/O (O_DIRECT needs 4 KiB alignment), not pinned:
// what the I/O benchmark and tests hand the I/O engines. The engine's buffers, pinned on GPU
// machines, come from state::HostMemory through the Device.
// Ownership: move-only, freed on destruction. Errors: std::bad_alloc.
#pragma once

#include <cstddef>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <new>
#include <span>

namespace strata::offload {

class AlignedBuffer {
 public:
  static constexpr size_t kAlignment = 4096;
  AlignedBuffer() = default;
  explicit AlignedBuffer(size_t bytes) : size_(bytes) {
    const size_t capacity = (bytes + kAlignment - 1) / kAlignment * kAlignment;
    void* p = std::aligned_alloc(kAlignment, capacity ? capacity : kAlignment);
    if (!p) throw std::bad_alloc();
    std::memset(p, 0, capacity ? capacity : kAlignment);
    data_.reset(static_cast<std::byte*>(p));
  }
  std::byte* data() const { return data_.get(); }
  size_t size() const { return size_; }
  std::span<std::byte> span() const { return {data_.get(), size_}; }

 private:
  struct Free {
    void operator()(std::byte* p) const { std::free(p); }
  };
  std::unique_ptr<std::byte, Free> data_;
  size_t size_ = 0;
};

// Hands out AlignedBuffers: a stand-in where code wants something to allocate from.
struct AlignedBuffers {
  AlignedBuffer allocate(size_t bytes) const { return AlignedBuffer(bytes); }
};

}  // namespace strata::offload
