// The host device: its budget accounting (allocations, reservations, concurrency), its copy
// streams' ordering, events and waits, errors in host functions, and the GPU memory reserve.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <future>
#include <map>
#include <stdexcept>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include <sys/wait.h>
#include <unistd.h>

#include "strata/engine/comm.h"
#include "strata/engine/config.h"
#include "strata/engine/config_parse.h"
#include "strata/engine/cpu_share.h"
#include "strata/engine/device.h"
#include "strata/engine/partition.h"
#include "strata/models/model_config.h"
#include "test_util.h"
#include "thrown_message.h"

namespace strata::engine {
namespace {

using test::contains;
using test::thrown_message;

// ---------------------------------------------------------------------------------------------
// Host device

// Holds a stream's worker inside a host function until released, so a test decides what has
// run when it looks. Released at the latest when destroyed (declare it after the Device), and
// the blocked function gives up after 10 s, so a failing test never hangs.
class StreamGate {
 public:
  StreamGate() : released_future_(released_.get_future().share()) {}
  ~StreamGate() { release(); }
  std::function<void()> blocker() const {
    return [f = released_future_] { (void)f.wait_for(std::chrono::seconds(10)); };
  }
  void release() {
    if (!released_flag_) {
      released_flag_ = true;
      released_.set_value();
    }
  }

 private:
  std::promise<void> released_;
  std::shared_future<void> released_future_;
  bool released_flag_ = false;
};

TEST(DeviceMemoryReserve, KeepsFourGibOrEightPercentOfTheGpuOutOfAutomaticDecisions) {
  EXPECT_EQ(device_memory_reserve(uint64_t(80) << 30), (uint64_t(80) << 30) / 100 * 8);  // H100: 6.4 GiB
  EXPECT_EQ(device_memory_reserve(uint64_t(24) << 30), uint64_t(4) << 30);               // 8% < 4 GiB
  EXPECT_EQ(device_memory_reserve(uint64_t(3) << 30), uint64_t(3) << 30);                // never above total
  EXPECT_EQ(device_memory_reserve(0), 0u);
}

TEST(HostDevice, EmptyCountsBytesUntilTheStorageIsFreed) {
  auto dev = Device::create_host(1 << 20);
  EXPECT_EQ(dev->budget(), uint64_t(1) << 20);
  EXPECT_EQ(dev->used(), 0u);
  {
    at::Tensor a = dev->empty({16, 64}, at::kFloat, "a");  // 4096 bytes
    EXPECT_EQ(a.sizes().vec(), (std::vector<int64_t>{16, 64}));
    EXPECT_EQ(a.scalar_type(), at::kFloat);
    EXPECT_EQ(a.device(), dev->torch_device());
    EXPECT_TRUE(a.is_contiguous());
    EXPECT_EQ(dev->used(), 4096u);
    at::Tensor b = dev->empty({1000}, at::kBFloat16, "b");  // 2000 bytes
    EXPECT_EQ(dev->used(), 6096u);
    a.fill_(1.5);
    EXPECT_EQ(a.sum().item<float>(), 1.5f * 1024);
    at::Tensor view = a.narrow(0, 0, 2);
    a.reset();
    EXPECT_EQ(dev->used(), 6096u) << "a view keeps the storage alive";
    view.reset();
    EXPECT_EQ(dev->used(), 2000u);
    EXPECT_EQ(dev->peak(), 6096u);
  }
  EXPECT_EQ(dev->used(), 0u);
  EXPECT_EQ(dev->peak(), 6096u);
  dev->reset_peak();
  EXPECT_EQ(dev->peak(), 0u);
}

TEST(HostDevice, AllocationOverBudgetThrowsNamingItAndChangesNothing) {
  auto dev = Device::create_host(1 << 20);
  at::Tensor held = dev->empty({512 * 1024}, at::kByte, "held");
  const std::string msg = thrown_message<BudgetExceeded>(
      [&] { dev->empty({600 * 1024}, at::kByte, "block.3 gathered parameters"); });
  EXPECT_TRUE(contains(msg, "block.3 gathered parameters")) << msg;
  EXPECT_EQ(dev->used(), 512u * 1024);
  EXPECT_EQ(dev->peak(), 512u * 1024);
  EXPECT_TRUE(dev->fits(512 * 1024));
  EXPECT_FALSE(dev->fits(512 * 1024 + 1));
  // Filling the budget exactly is allowed; one byte more is not.
  at::Tensor rest = dev->empty({512 * 1024}, at::kByte, "rest");
  EXPECT_EQ(dev->used(), uint64_t(1) << 20);
  EXPECT_THROW(dev->empty({1}, at::kByte, "one byte"), BudgetExceeded);
  EXPECT_EQ(dev->used(), uint64_t(1) << 20);
  held.reset();
  rest.reset();
  EXPECT_EQ(dev->used(), 0u);
}

TEST(HostDevice, ReservationsCountUntilResetDestroyedOrReplaced) {
  auto dev = Device::create_host(10000);
  {
    Device::Reservation a = dev->reserve(3000, "a");
    EXPECT_EQ(dev->used(), 3000u);
    Device::Reservation b = dev->reserve(4000, "b");
    EXPECT_EQ(dev->used(), 7000u);
    a = std::move(b);  // a's 3000 bytes go back; a now holds b's 4000
    EXPECT_EQ(dev->used(), 4000u);
    Device::Reservation c(std::move(a));
    EXPECT_EQ(dev->used(), 4000u);
    a.reset();  // moved from: holds nothing
    b.reset();
    EXPECT_EQ(dev->used(), 4000u);
    const std::string msg =
        thrown_message<BudgetExceeded>([&] { dev->reserve(6001, "activations of block 7"); });
    EXPECT_TRUE(contains(msg, "activations of block 7")) << msg;
    EXPECT_EQ(dev->used(), 4000u);
    c.reset();
    EXPECT_EQ(dev->used(), 0u);
    Device::Reservation all = dev->reserve(10000, "all");
    EXPECT_EQ(dev->used(), 10000u);
    Device::Reservation target;
    target = std::move(all);  // into a default-constructed one
    EXPECT_EQ(dev->used(), 10000u);
  }
  EXPECT_EQ(dev->used(), 0u);
  EXPECT_EQ(dev->peak(), 10000u);
}

// A tensor from empty() and a reservation may go after their device: Gloo's worker thread can
// drop the last reference to a failed all-gather's output after the engine and the device are
// destroyed (a survivor of a killed peer died of SIGSEGV in CI so). The device's memory is
// overwritten before they go, so a deleter that still reached into the device would crash here.
TEST(HostDevice, TensorsAndReservationsMayOutliveTheirDevice) {
  auto dev = Device::create_host(1 << 20);
  at::Tensor t = dev->empty({1000}, at::kFloat, "output of an all-gather");
  t.fill_(2.0f);
  Device::Reservation r = dev->reserve(5000, "a graph");
  EXPECT_EQ(dev->used(), 9000u);
  dev.reset();
  std::vector<std::unique_ptr<char[]>> reuse;  // takes the freed device's memory back (malloc reuses it)
  for (size_t n = 16; n <= 8192; n += 16)
    for (int k = 0; k < 4; ++k) {
      reuse.emplace_back(new char[n]);
      std::memset(reuse.back().get(), 0xff, n);
    }
  EXPECT_EQ(t.sum().item<float>(), 2000.0f);
  t = at::Tensor();
  r.reset();
  SUCCEED();
}

TEST(HostDevice, ConcurrentAllocationsNeverExceedTheBudget) {
  const uint64_t budget = 64 * 1024;
  auto dev = Device::create_host(budget);
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] {
      for (int i = 0; i < 500; ++i) {
        try {
          at::Tensor x = dev->empty({int64_t(4096 + 512 * ((i + t) % 8))}, at::kFloat, "x");
          x.fill_(float(i));
        } catch (const BudgetExceeded&) {
          // Refused: the others hold too much right now.
        }
      }
    });
  }
  for (auto& th : threads) th.join();
  EXPECT_EQ(dev->used(), 0u);
  EXPECT_LE(dev->peak(), budget);
  EXPECT_GT(dev->peak(), 0u);
}

TEST(HostDevice, CopyStreamRunsCopiesAndHostFunctionsInOrder) {
  auto dev = Device::create_host(UINT64_MAX);
  Stream& copy = dev->h2d_stream();
  constexpr int kCopies = 200;
  std::vector<int> ran;  // appended only on the stream's thread, read after synchronize
  std::vector<at::Tensor> sources, targets;
  for (int i = 0; i < kCopies; ++i) {
    sources.push_back(at::full({257}, float(i), at::kFloat));
    targets.push_back(dev->empty({257}, at::kFloat, "target"));
    dev->copy_async(targets.back(), sources.back(), copy);
    dev->launch_host(copy, [&ran, i] { ran.push_back(i); });
    // Overwriting the source after the copy was enqueued must not reach the target.
    dev->launch_host(copy, [src = sources.back()]() mutable { src.fill_(-1.0); });
  }
  // A chain through buffers: each copy reads what the previous one wrote.
  std::vector<at::Tensor> chain;
  chain.push_back(at::arange(1000, at::kFloat));
  for (int k = 0; k < 20; ++k) chain.push_back(at::zeros({1000}, at::kFloat));
  for (int k = 0; k < 20; ++k) dev->copy_async(chain[k + 1], chain[k], copy);
  dev->synchronize(copy);

  ASSERT_EQ(ran.size(), size_t(kCopies));
  for (int i = 0; i < kCopies; ++i) {
    EXPECT_EQ(ran[i], i);
    EXPECT_TRUE(at::equal(targets[i], at::full({257}, float(i), at::kFloat))) << "copy " << i;
    EXPECT_TRUE(at::equal(sources[i], at::full({257}, -1.0f, at::kFloat)));
  }
  EXPECT_TRUE(at::equal(chain.back(), chain.front()));
}

// Uploads never queue behind downloads: with the d2h stream held by a slow host function (a
// gradient's swap read-add-write), a copy on the h2d stream runs and completes.
TEST(HostDevice, UploadsRunWhileTheDownloadStreamIsHeld) {
  auto dev = Device::create_host(UINT64_MAX);
  StreamGate gate;
  dev->launch_host(dev->d2h_stream(), gate.blocker());
  const std::shared_ptr<Event> down_done = dev->record(dev->d2h_stream());
  at::Tensor src = at::arange(4099, at::kFloat), dst = dev->empty({4099}, at::kFloat, "upload");
  dev->copy_async(dst, src, dev->h2d_stream());
  dev->synchronize(dev->h2d_stream());
  EXPECT_TRUE(at::equal(dst, src));
  EXPECT_FALSE(down_done->done()) << "the download stream was not held: the test shows nothing";
  gate.release();
  dev->synchronize(dev->d2h_stream());
  EXPECT_TRUE(down_done->done());
}

TEST(HostDevice, CopyStreamKeepsItsTensorsAliveUntilTheCopyHasRun) {
  auto dev = Device::create_host(UINT64_MAX);
  StreamGate gate;
  Stream& copy = dev->h2d_stream();
  dev->launch_host(copy, gate.blocker());
  at::Tensor src = at::arange(4096, at::kFloat);
  at::Tensor dst = dev->empty({4096}, at::kFloat, "dst");
  at::Tensor check = at::zeros({4096}, at::kFloat);
  dev->copy_async(dst, src, copy);
  dev->copy_async(check, dst, copy);
  dst.reset();
  src.reset();
  EXPECT_EQ(dev->used(), 4096u * 4) << "the queued copy holds the device tensor";
  gate.release();
  dev->synchronize(copy);
  EXPECT_EQ(dev->used(), 0u);
  EXPECT_TRUE(at::equal(check, at::arange(4096, at::kFloat)));
}

// A buffer the engine dropped is still held by a copy queued behind slow work: an allocation
// that fits only once that copy has run waits for it instead of failing (CUDA's reclaim does
// the same with its events), and one that never fits still fails once the streams are idle.
TEST(HostDevice, AllocationOverBudgetWaitsForQueuedCopiesToLetGo) {
  auto dev = Device::create_host(4096 * 4);
  at::Tensor held = dev->empty({4096}, at::kFloat, "held");
  at::Tensor out = at::empty({4096}, at::kFloat);
  dev->launch_host(dev->d2h_stream(), [] { std::this_thread::sleep_for(std::chrono::milliseconds(200)); });
  dev->copy_async(out, held.fill_(3), dev->d2h_stream());
  held.reset();
  EXPECT_EQ(dev->used(), 4096u * 4);
  at::Tensor next;
  ASSERT_NO_THROW(next = dev->empty({4096}, at::kFloat, "next"));
  EXPECT_TRUE(at::equal(out, at::full({4096}, 3.0f)));
  EXPECT_THROW(dev->empty({1}, at::kFloat, "one more"), BudgetExceeded);
  EXPECT_EQ(dev->used(), 4096u * 4);
}

TEST(HostDevice, CopyAsyncRejectsMismatchedTensors) {
  auto dev = Device::create_host(UINT64_MAX);
  Stream& copy = dev->h2d_stream();
  at::Tensor dst = at::zeros({4, 4}, at::kFloat);
  EXPECT_THROW(dev->copy_async(dst, at::ones({15}, at::kFloat), copy), c10::Error);
  EXPECT_THROW(dev->copy_async(dst, at::ones({16}, at::kDouble), copy), c10::Error);
  EXPECT_THROW(dev->copy_async(dst, at::ones({4, 4}, at::kFloat).t(), copy), c10::Error);
  dev->synchronize(copy);
  EXPECT_TRUE(at::equal(dst, at::zeros({4, 4}, at::kFloat))) << "nothing was enqueued";
}

TEST(HostDevice, EventIsDoneOnlyAfterTheWorkBeforeItHasRun) {
  auto dev = Device::create_host(UINT64_MAX);
  StreamGate gate;
  Stream& copy = dev->h2d_stream();
  std::atomic<bool> slept{false};
  dev->launch_host(copy, gate.blocker());
  dev->launch_host(copy, [&slept] {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    slept = true;
  });
  const std::shared_ptr<Event> event = dev->record(copy);
  EXPECT_FALSE(event->done());
  gate.release();
  dev->synchronize(copy);
  EXPECT_TRUE(slept.load());
  EXPECT_TRUE(event->done());

  // The compute stream is the caller's: work on it has run when the call returns.
  EXPECT_TRUE(dev->record(dev->compute_stream())->done());
}

TEST(HostDevice, WaitOrdersTheComputeStreamAfterAnEventOnTheCopyStream) {
  auto dev = Device::create_host(UINT64_MAX);
  Stream& copy = dev->h2d_stream();
  at::Tensor src = at::arange(10000, at::kFloat);
  at::Tensor dst = at::zeros({10000}, at::kFloat);
  dev->launch_host(copy, [] { std::this_thread::sleep_for(std::chrono::milliseconds(50)); });
  dev->copy_async(dst, src, copy);
  const std::shared_ptr<Event> copied = dev->record(copy);
  dev->wait(dev->compute_stream(), copied);  // blocks this thread until the copy has run
  EXPECT_TRUE(copied->done());
  EXPECT_TRUE(at::equal(dst, src));
  dev->synchronize(copy);
}

TEST(HostDevice, WaitHoldsAWorkerStreamBackUntilTheEvent) {
  // Two host devices: two copy streams on two worker threads, ordered by an event.
  auto producer = Device::create_host(UINT64_MAX);
  auto consumer = Device::create_host(UINT64_MAX);
  StreamGate gate;
  std::vector<std::string> order;  // each append is ordered by the event between the streams
  std::atomic<int> consumer_ran{0};
  producer->launch_host(producer->h2d_stream(), gate.blocker());
  producer->launch_host(producer->h2d_stream(), [&order] { order.push_back("produced"); });
  const std::shared_ptr<Event> produced = producer->record(producer->h2d_stream());
  consumer->wait(consumer->h2d_stream(), produced);
  consumer->launch_host(consumer->h2d_stream(), [&order, &consumer_ran] {
    order.push_back("consumed");
    ++consumer_ran;
  });
  std::this_thread::sleep_for(std::chrono::milliseconds(20));
  EXPECT_EQ(consumer_ran.load(), 0) << "ran before the event it waits for";
  EXPECT_FALSE(produced->done());
  gate.release();
  consumer->synchronize(consumer->h2d_stream());
  EXPECT_TRUE(produced->done());
  EXPECT_EQ(consumer_ran.load(), 1);
  EXPECT_EQ(order, (std::vector<std::string>{"produced", "consumed"}));
  producer->synchronize(producer->h2d_stream());
}

TEST(HostDevice, ErrorInAHostFunctionIsRethrownBySynchronizeAndTheStreamGoesOn) {
  auto dev = Device::create_host(UINT64_MAX);
  Stream& copy = dev->h2d_stream();
  std::vector<int> ran;
  dev->launch_host(copy, [&ran] { ran.push_back(1); });
  dev->launch_host(copy, [] { throw std::runtime_error("host fn failed: disk full"); });
  dev->launch_host(copy, [&ran] { ran.push_back(2); });
  const std::string msg = thrown_message<std::runtime_error>([&] { dev->synchronize(copy); });
  EXPECT_TRUE(contains(msg, "disk full")) << msg;
  EXPECT_EQ(ran, (std::vector<int>{1, 2}));
  EXPECT_NO_THROW(dev->synchronize(copy)) << "an error is reported once";

  // Of two failures, the first is reported.
  dev->launch_host(copy, [] { throw std::runtime_error("first failure"); });
  dev->launch_host(copy, [] { throw std::runtime_error("second failure"); });
  const std::string first = thrown_message<std::runtime_error>([&] { dev->synchronize(copy); });
  EXPECT_TRUE(contains(first, "first failure")) << first;
  EXPECT_NO_THROW(dev->synchronize(copy));
}

}  // namespace
}  // namespace strata::engine
