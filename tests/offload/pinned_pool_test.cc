#include <gtest/gtest.h>

#include <atomic>
#include <cstring>
#include <fstream>
#include <random>
#include <thread>

#include "strata/offload/pinned_pool.h"

namespace strata::offload {
namespace {

// Counts what the pool asks of its backing allocator.
class CountingAllocator final : public HostAllocator {
 public:
  explicit CountingAllocator(std::atomic<int>* allocs) : allocs_(allocs), inner_(make_mlock_allocator()) {}
  void* allocate(size_t bytes, bool* pinned) override {
    ++*allocs_;
    return inner_->allocate(bytes, pinned);
  }
  void deallocate(void* p, size_t bytes) noexcept override { inner_->deallocate(p, bytes); }
  const char* name() const override { return "counting"; }

 private:
  std::atomic<int>* allocs_;
  std::unique_ptr<HostAllocator> inner_;
};

TEST(PinnedPool, BuffersAreAlignedDisjointAndReusedWithoutNewAllocations) {
  std::atomic<int> allocs{0};
  PinnedPool pool(64 << 20, std::make_unique<CountingAllocator>(&allocs), 16 << 20);
  std::vector<PinnedBuffer> live;
  for (size_t n : {1ul, 4095ul, 4096ul, 4097ul, 1000003ul}) {
    live.push_back(pool.allocate(n));
    EXPECT_EQ(reinterpret_cast<uintptr_t>(live.back().data()) % PinnedPool::kAlignment, 0u);
    EXPECT_EQ(live.back().size(), n);
    EXPECT_EQ(live.back().capacity() % PinnedPool::kAlignment, 0u);
    std::memset(live.back().data(), static_cast<int>(live.size()), n);  // disjoint: no overwrite
  }
  for (size_t i = 0; i < live.size(); ++i) {
    EXPECT_EQ(static_cast<int>(live[i].data()[live[i].size() - 1]), static_cast<int>(i + 1));
  }
  EXPECT_EQ(allocs.load(), 1);
  live.clear();
  // A steady state of transfers allocates nothing.
  for (int step = 0; step < 1000; ++step) {
    PinnedBuffer a = pool.allocate(1 << 20), b = pool.allocate(3 << 20);
  }
  EXPECT_EQ(allocs.load(), 1);
  auto u = pool.usage();
  EXPECT_EQ(u.in_use_bytes, 0u);
  EXPECT_EQ(u.live_buffers, 0u);
  EXPECT_EQ(u.reserved_bytes, 16u << 20);
  EXPECT_EQ(u.allocations, 2005u);
  EXPECT_GE(u.peak_in_use_bytes, 4u << 20);
}

TEST(PinnedPool, FreedNeighboursCoalesceIntoOneBlock) {
  PinnedPool pool(8 << 20, nullptr, 8 << 20);
  {
    std::vector<PinnedBuffer> v;
    for (int i = 0; i < 8; ++i) v.push_back(pool.allocate(1 << 20));
    // Free in a scrambled order.
    for (int i : {3, 0, 7, 5, 1, 6, 2, 4}) v[i].release();
  }
  PinnedBuffer all = pool.allocate(8 << 20);  // only possible if all eight merged back
  EXPECT_EQ(pool.usage().slabs, 1u);
}

TEST(PinnedPool, ExceedingTheBudgetIsAClearError) {
  PinnedPool pool(4 << 20, nullptr, 1 << 20);
  PinnedBuffer a = pool.allocate(3 << 20);
  try {
    PinnedBuffer b = pool.allocate(2 << 20);
    FAIL() << "allocated beyond the budget";
  } catch (const PinnedPoolExhausted& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("cannot allocate 2.0 MiB"), std::string::npos) << msg;
    EXPECT_NE(msg.find("budget 4.0 MiB"), std::string::npos) << msg;
    EXPECT_NE(msg.find("in use 3.0 MiB by 1 buffers"), std::string::npos) << msg;
  }
  PinnedBuffer c = pool.allocate(1 << 20);  // what fits still works
  EXPECT_LE(pool.usage().reserved_bytes, 4u << 20);
}

TEST(PinnedPool, ConcurrentAllocateAndReleaseKeepTheBooksStraight) {
  PinnedPool pool(64 << 20, nullptr, 8 << 20);
  std::atomic<int> exhausted{0};
  auto worker = [&](int seed) {
    std::mt19937 rng(seed);
    std::vector<PinnedBuffer> mine;
    for (int i = 0; i < 2000; ++i) {
      if (mine.size() < 8 && rng() % 2) {
        try {
          mine.push_back(pool.allocate(1 + rng() % (512 << 10)));
          std::memset(mine.back().data(), seed, mine.back().size());
        } catch (const PinnedPoolExhausted&) {
          ++exhausted;
        }
      } else if (!mine.empty()) {
        const std::byte* p = mine.back().data();
        for (size_t k = 0; k < mine.back().size(); k += 4096) ASSERT_EQ(static_cast<int>(p[k]), seed);
        mine.pop_back();
      }
    }
  };
  std::vector<std::thread> threads;
  for (int t = 1; t <= 4; ++t) threads.emplace_back(worker, t);
  for (auto& t : threads) t.join();
  auto u = pool.usage();
  EXPECT_EQ(u.live_buffers, 0u);
  EXPECT_EQ(u.in_use_bytes, 0u);
  EXPECT_LE(u.reserved_bytes, 64u << 20);
  EXPECT_EQ(exhausted.load(), 0);  // 4 x 8 x 512 KiB fits easily
  EXPECT_EQ(pool.trim(), u.reserved_bytes);
  EXPECT_EQ(pool.usage().reserved_bytes, 0u);
}

uint64_t locked_kb() {
  std::ifstream status("/proc/self/status");
  std::string line;
  while (std::getline(status, line)) {
    if (line.rfind("VmLck:", 0) == 0) return std::stoull(line.substr(6));
  }
  return 0;
}

TEST(PinnedPool, ReportsWhetherMemoryIsPageLocked) {
  const uint64_t before = locked_kb();
  PinnedPool pool(2 << 20, nullptr, 2 << 20);
  PinnedBuffer a = pool.allocate(4096);
  // Root (CI) may always lock; otherwise RLIMIT_MEMLOCK decides. Either way the report must
  // match what the kernel did: VmLck in /proc/self/status counts locked memory.
  const uint64_t grew = locked_kb() - before;
  const std::string name = pool.allocator_name();
  if (name == "mlock") {
    EXPECT_EQ(pool.usage().reserved_bytes, 2u << 20);
    EXPECT_EQ(pool.usage().pinned, grew == 2048) << "VmLck grew by " << grew << " kB";
  } else {
    EXPECT_EQ(name, "cudaHostAlloc");  // a GPU is visible: the driver pins
    EXPECT_TRUE(pool.usage().pinned);
  }
}

}  // namespace
}  // namespace strata::offload
