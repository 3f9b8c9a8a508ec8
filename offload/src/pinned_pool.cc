#include "strata/offload/pinned_pool.h"

#include <sys/mman.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <utility>

#include "extent_list.h"

namespace strata::offload {

struct PinnedPool::Slab {
  std::byte* base;
  size_t bytes;
  bool pinned;
  detail::ExtentList free;
  size_t used = 0;
};

namespace {

std::string mib(uint64_t bytes) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.1f MiB", static_cast<double>(bytes) / (1 << 20));
  return buf;
}

class MlockAllocator final : public HostAllocator {
 public:
  void* allocate(size_t bytes, bool* pinned) override {
    void* p = std::aligned_alloc(PinnedPool::kAlignment, bytes);
    if (p == nullptr) throw std::bad_alloc();
    // Touch every page so the budget is real memory now, not a promise the OOM killer breaks.
    std::memset(p, 0, bytes);
    *pinned = mlock(p, bytes) == 0;
    return p;
  }
  void deallocate(void* ptr, size_t bytes) noexcept override {
    munlock(ptr, bytes);
    std::free(ptr);
  }
  const char* name() const override { return "mlock"; }
};

}  // namespace

std::unique_ptr<HostAllocator> make_mlock_allocator() { return std::make_unique<MlockAllocator>(); }

#if !defined(STRATA_HAVE_CUDA)
std::unique_ptr<HostAllocator> make_default_host_allocator() { return make_mlock_allocator(); }
#endif

PinnedBuffer& PinnedBuffer::operator=(PinnedBuffer&& other) noexcept {
  if (this != &other) {
    release();
    pool_ = std::exchange(other.pool_, nullptr);
    data_ = std::exchange(other.data_, nullptr);
    size_ = std::exchange(other.size_, 0);
    capacity_ = std::exchange(other.capacity_, 0);
  }
  return *this;
}

void PinnedBuffer::release() noexcept {
  if (pool_ != nullptr && data_ != nullptr) pool_->give_back(data_, capacity_);
  pool_ = nullptr;
  data_ = nullptr;
  size_ = capacity_ = 0;
}

PinnedPool::PinnedPool(uint64_t budget_bytes, std::unique_ptr<HostAllocator> allocator,
                       uint64_t slab_bytes)
    : budget_(budget_bytes),
      slab_bytes_((slab_bytes + kAlignment - 1) / kAlignment * kAlignment),
      allocator_(allocator ? std::move(allocator) : make_default_host_allocator()) {
  usage_.budget_bytes = budget_bytes;
}

PinnedPool::~PinnedPool() {
  if (usage_.live_buffers != 0) {
    std::fprintf(stderr, "strata: PinnedPool destroyed with %llu buffers still in use\n",
                 static_cast<unsigned long long>(usage_.live_buffers));
    std::abort();
  }
  for (auto& s : slabs_) allocator_->deallocate(s->base, s->bytes);
}

PinnedBuffer PinnedPool::allocate(size_t bytes) {
  const size_t capacity = std::max<size_t>(kAlignment, (bytes + kAlignment - 1) / kAlignment *
                                                           kAlignment);
  std::lock_guard lock(mu_);
  Slab* home = nullptr;
  size_t offset = 0;
  for (auto& s : slabs_) {
    if (auto o = s->free.take(capacity)) {
      offset = *o;
      home = s.get();
      break;
    }
  }
  if (home == nullptr) {
    const size_t slab = std::max<size_t>(slab_bytes_, capacity);
    // Grow by a full slab if the budget allows, else by exactly what is needed.
    size_t grow = slab;
    if (usage_.reserved_bytes + grow > budget_) grow = capacity;
    if (usage_.reserved_bytes + grow > budget_) {
      size_t largest = 0;
      for (auto& s : slabs_) largest = std::max<size_t>(largest, s->free.largest());
      throw PinnedPoolExhausted(
          "pinned pool: cannot allocate " + mib(capacity) + ": budget " + mib(budget_) +
          ", reserved " + mib(usage_.reserved_bytes) + ", in use " + mib(usage_.in_use_bytes) +
          " by " + std::to_string(usage_.live_buffers) + " buffers, largest free block " +
          mib(largest) + " (raise the pinned-memory budget or release buffers)");
    }
    auto s = std::make_unique<Slab>();
    s->base = static_cast<std::byte*>(allocator_->allocate(grow, &s->pinned));
    s->bytes = grow;
    s->free.give(0, grow);
    usage_.reserved_bytes += grow;
    usage_.slabs += 1;
    if (!s->pinned) usage_.pinned = false;
    slabs_.push_back(std::move(s));
    home = slabs_.back().get();
    offset = *home->free.take(capacity);
  }
  home->used += capacity;
  usage_.in_use_bytes += capacity;
  usage_.peak_in_use_bytes = std::max(usage_.peak_in_use_bytes, usage_.in_use_bytes);
  usage_.live_buffers += 1;
  usage_.allocations += 1;
  PinnedBuffer b;
  b.pool_ = this;
  b.data_ = home->base + offset;
  b.size_ = bytes;
  b.capacity_ = capacity;
  return b;
}

void PinnedPool::give_back(std::byte* data, size_t capacity) noexcept {
  std::lock_guard lock(mu_);
  for (auto& s : slabs_) {
    if (data < s->base || data >= s->base + s->bytes) continue;
    s->free.give(static_cast<size_t>(data - s->base), capacity);
    s->used -= capacity;
    usage_.in_use_bytes -= capacity;
    usage_.live_buffers -= 1;
    return;
  }
  std::fprintf(stderr, "strata: PinnedBuffer returned to a pool that does not own it\n");
  std::abort();
}

PinnedPoolUsage PinnedPool::usage() const {
  std::lock_guard lock(mu_);
  return usage_;
}

uint64_t PinnedPool::trim() {
  std::lock_guard lock(mu_);
  uint64_t released = 0;
  std::erase_if(slabs_, [&](std::unique_ptr<Slab>& s) {
    if (s->used != 0) return false;
    allocator_->deallocate(s->base, s->bytes);
    released += s->bytes;
    return true;
  });
  usage_.reserved_bytes -= released;
  usage_.slabs = slabs_.size();
  usage_.pinned = true;
  for (auto& s : slabs_) usage_.pinned = usage_.pinned && s->pinned;
  return released;
}

std::vector<std::span<std::byte>> PinnedPool::slabs() const {
  std::lock_guard lock(mu_);
  std::vector<std::span<std::byte>> out;
  for (auto& s : slabs_) out.emplace_back(s->base, s->bytes);
  return out;
}

}  // namespace strata::offload
