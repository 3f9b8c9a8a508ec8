// A CPU allocator for tests that counts the bytes libtorch holds: installed with install(), it
// wraps the default allocator and tracks the bytes alive and their peak. A DataPtr's context is
// its data pointer itself (the size is looked up), as Allocator::raw_allocate requires: oneDNN's
// bf16 kernels take their scratch memory through it on CPUs with AVX-512 BF16.
// Thread safety: allocate/release may run on any thread (a mutex and atomics).
#pragma once

#include <c10/core/CPUAllocator.h>

#include <atomic>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <mutex>
#include <unordered_map>

namespace strata::test {

class CountingAllocator final : public c10::Allocator {
 public:
  // The one instance; the first call installs it as the CPU allocator (for the process: libtorch
  // keeps a pointer to it, so it is never destroyed).
  static CountingAllocator& install() {
    static CountingAllocator* a = [] {
      auto* p = new CountingAllocator();
      c10::SetCPUAllocator(p, /*priority=*/100);
      return p;
    }();
    return *a;
  }
  c10::DataPtr allocate(size_t n) override {
    c10::DataPtr inner = inner_->allocate(n);
    void* data = inner.get();
    if (!data) return inner;  // zero bytes: nothing to count
    {
      std::lock_guard<std::mutex> lock(mu_);
      blocks_.emplace(data, Block{std::move(inner), n});
    }
    const int64_t now = live_ += int64_t(n);
    int64_t p = peak_.load();
    while (now > p && !peak_.compare_exchange_weak(p, now)) {
    }
    return {data, data, &release, c10::Device(c10::kCPU)};
  }
  c10::DeleterFnPtr raw_deleter() const override { return &release; }
  void copy_data(void* dst, const void* src, size_t n) const override { default_copy_data(dst, src, n); }
  int64_t live() const { return live_.load(); }
  // The most bytes alive at once since the last reset_peak().
  int64_t peak() const { return peak_.load(); }
  void reset_peak() { peak_ = live_.load(); }

 private:
  CountingAllocator() { instance = this; }
  struct Block {
    c10::DataPtr inner;
    size_t bytes;
  };
  static void release(void* p) {
    // oneDNN frees through raw_deleter() as free() does: a null pointer is nothing to release.
    if (!p) return;
    Block b;
    {
      std::lock_guard<std::mutex> lock(instance->mu_);
      auto it = instance->blocks_.find(p);
      if (it == instance->blocks_.end()) {  // a deleter cannot throw: say what went wrong and stop
        std::fprintf(stderr, "CountingAllocator: releasing %p, which it never gave\n", p);
        std::abort();
      }
      b = std::move(it->second);
      instance->blocks_.erase(it);
    }
    instance->live_ -= int64_t(b.bytes);
  }  // b.inner frees the memory
  static inline CountingAllocator* instance = nullptr;
  c10::Allocator* inner_ = c10::GetDefaultCPUAllocator();
  std::mutex mu_;
  std::unordered_map<void*, Block> blocks_;
  std::atomic<int64_t> live_{0}, peak_{0};
};

}  // namespace strata::test
