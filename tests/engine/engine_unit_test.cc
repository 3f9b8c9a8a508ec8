// The engine's building blocks on their own: the ZeRO-3 partition map, byte sizes, the host
// device (budget accounting, stream ordering, events, errors) and the training configuration.
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

namespace strata::engine {
namespace {

using UnitSpecs = std::vector<std::pair<std::string, std::vector<TensorSpec>>>;

bool contains(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

// The message of the E that `fn` throws; records a failure and returns "" if it throws nothing.
// Exceptions of other types propagate (gtest reports them).
template <typename E, typename Fn>
std::string thrown_message(Fn&& fn) {
  try {
    fn();
  } catch (const E& e) {
    return e.what();
  }
  ADD_FAILURE() << "expected an exception, none was thrown";
  return "";
}

// ---------------------------------------------------------------------------------------------
// Partition

uint64_t product(const std::vector<int64_t>& shape) {
  uint64_t n = 1;
  for (int64_t d : shape) n *= uint64_t(d);
  return n;
}

// Units whose tensors have awkward element counts, including a prime above one million.
UnitSpecs awkward_units() {
  return {
      {"embed", {{"wte", {7}}, {"wpe", {1}}}},
      {"block.0", {{"block.0.w", {1000003}}, {"block.0.b", {1}}, {"block.0.x", {3, 5, 7}}}},
      {"one", {{"one.scalar", {1}}}},
      {"seven", {{"seven.v", {7}}}},
      {"prime", {{"prime.v", {1000003}}}},
  };
}

// Every property the header promises, checked against the tensor lists the partition was built
// from.
void expect_valid_layout(const Partition& p, const UnitSpecs& units, int world, uint64_t align) {
  ASSERT_EQ(p.world_size(), world);
  ASSERT_EQ(p.num_units(), units.size());
  uint64_t total = 0, total_shard = 0;
  for (size_t u = 0; u < units.size(); ++u) {
    SCOPED_TRACE("unit " + units[u].first + ", world " + std::to_string(world) + ", align " +
                 std::to_string(align));
    const UnitLayout& layout = p.unit(u);
    EXPECT_EQ(layout.name, units[u].first);
    EXPECT_EQ(layout.world_size, uint64_t(world));
    ASSERT_EQ(layout.tensors.size(), units[u].second.size());
    uint64_t next_offset = 0;
    for (size_t t = 0; t < layout.tensors.size(); ++t) {
      const TensorSpec& spec = units[u].second[t];
      const TensorSlot& slot = layout.tensors[t];
      EXPECT_EQ(slot.name, spec.name);
      EXPECT_EQ(slot.shape, spec.shape);
      EXPECT_EQ(slot.numel, product(spec.shape));
      EXPECT_EQ(slot.offset, next_offset) << spec.name << " is not right after its predecessor";
      next_offset += slot.numel;
      const TensorLocation loc = p.locate(spec.name);
      EXPECT_EQ(loc.unit, u);
      EXPECT_EQ(loc.slot, &layout.tensors[t]);
    }
    EXPECT_EQ(layout.numel, next_offset);
    EXPECT_GT(layout.shard_numel, 0u);
    EXPECT_EQ(layout.shard_numel % align, 0u);
    EXPECT_EQ(layout.padded_numel(), layout.shard_numel * uint64_t(world));
    EXPECT_GE(layout.padded_numel(), layout.numel);
    // No more padding than alignment requires: under one alignment block per rank.
    EXPECT_LT(layout.padded_numel() - layout.numel, uint64_t(world) * align);
    uint64_t valid_sum = 0;
    for (int r = 0; r < world; ++r) {
      const uint64_t begin = layout.shard_begin(r);
      EXPECT_EQ(begin, uint64_t(r) * layout.shard_numel);
      const uint64_t expected_valid =
          begin >= layout.numel ? 0 : std::min(layout.shard_numel, layout.numel - begin);
      EXPECT_EQ(layout.shard_valid_numel(r), expected_valid) << "rank " << r;
      valid_sum += layout.shard_valid_numel(r);
    }
    EXPECT_EQ(valid_sum, layout.numel);
    total += layout.numel;
    total_shard += layout.shard_numel;
  }
  EXPECT_EQ(p.total_numel(), total);
  EXPECT_EQ(p.total_shard_numel(), total_shard);
}

TEST(Partition, LayoutHoldsForAwkwardSizesAtWorldSizesOneToFour) {
  const UnitSpecs units = awkward_units();
  for (uint64_t align : {Partition::kDefaultAlignNumel, uint64_t(1), uint64_t(3)}) {
    for (int world = 1; world <= 4; ++world) {
      const Partition p(units, world, align);
      expect_valid_layout(p, units, world, align);
    }
  }
  // The default alignment is 1024 elements (4 KiB of fp32).
  const Partition p(units, 2);
  expect_valid_layout(p, units, 2, 1024);
}

TEST(Partition, ShardSizesMatchHandComputedValues) {
  // 1000003 elements over 3 ranks: ceil(1000003 / 3) = 333335, rounded up to 1024s = 333824.
  const Partition p({{"u", {{"w", {1000003}}}}}, 3);
  const UnitLayout& u = p.unit(0);
  EXPECT_EQ(u.shard_numel, 333824u);
  EXPECT_EQ(u.padded_numel(), 1001472u);
  EXPECT_EQ(u.shard_valid_numel(0), 333824u);
  EXPECT_EQ(u.shard_valid_numel(1), 333824u);
  EXPECT_EQ(u.shard_valid_numel(2), 1000003u - 2 * 333824u);

  // One element over four ranks: one aligned block each, only rank 0 holds real data.
  const Partition q({{"u", {{"x", {1}}}}}, 4);
  EXPECT_EQ(q.unit(0).shard_numel, 1024u);
  EXPECT_EQ(q.unit(0).shard_valid_numel(0), 1u);
  for (int r = 1; r < 4; ++r) EXPECT_EQ(q.unit(0).shard_valid_numel(r), 0u);
}

TEST(Partition, SameTensorListsGiveTheSameMap) {
  const UnitSpecs units = awkward_units();
  const Partition a(units, 3), b(units, 3);
  for (const auto& [unit_name, specs] : units) {
    for (const TensorSpec& spec : specs) {
      const TensorLocation la = a.locate(spec.name), lb = b.locate(spec.name);
      EXPECT_EQ(la.unit, lb.unit);
      EXPECT_EQ(la.slot->offset, lb.slot->offset);
      EXPECT_EQ(a.unit(la.unit).shard_numel, b.unit(lb.unit).shard_numel);
    }
  }
}

TEST(Partition, UnknownNameThrowsOutOfRangeNamingIt) {
  const Partition p(awkward_units(), 2);
  const std::string msg =
      thrown_message<std::out_of_range>([&] { p.locate("block.0.missing_weight"); });
  EXPECT_TRUE(contains(msg, "block.0.missing_weight")) << msg;
  EXPECT_THROW(p.locate(""), std::out_of_range);
}

TEST(Partition, InvalidUnitListsAreRejected) {
  // The same name twice in one unit, and in two units.
  EXPECT_THROW(Partition({{"u", {{"w", {4}}, {"w", {4}}}}}, 1), std::invalid_argument);
  const std::string msg = thrown_message<std::invalid_argument>(
      [] { Partition({{"a", {{"shared", {4}}}}, {"b", {{"shared", {4}}}}}, 2); });
  EXPECT_TRUE(contains(msg, "shared")) << msg;
  // A unit without tensors.
  EXPECT_THROW(Partition({{"a", {{"w", {4}}}}, {"empty", {}}}, 2), std::invalid_argument);
  // World size and alignment below one; a negative dimension.
  EXPECT_THROW(Partition({{"a", {{"w", {4}}}}}, 0), std::invalid_argument);
  EXPECT_THROW(Partition({{"a", {{"w", {4}}}}}, 1, 0), std::invalid_argument);
  EXPECT_THROW(Partition({{"a", {{"w", {4, -1}}}}}, 1), std::invalid_argument);
}

// ---------------------------------------------------------------------------------------------
// Byte sizes

TEST(ByteSizes, ParseUnitsAndSpaces) {
  EXPECT_EQ(parse_bytes("512MiB"), 512ull << 20);
  EXPECT_EQ(parse_bytes("2GB"), 2000000000ull);
  EXPECT_EQ(parse_bytes("1.5GiB"), 3ull << 29);
  EXPECT_EQ(parse_bytes("4096"), 4096ull);
  EXPECT_EQ(parse_bytes("64 KiB"), 65536ull);
  EXPECT_EQ(parse_bytes("7B"), 7ull);
  EXPECT_EQ(parse_bytes("3kB"), 3000ull);
  EXPECT_EQ(parse_bytes("3KB"), 3000ull);
  EXPECT_EQ(parse_bytes("1TiB"), 1ull << 40);
  EXPECT_EQ(parse_bytes("0"), 0ull);
}

TEST(ByteSizes, JunkIsRejected) {
  for (const char* junk : {"12Q", "", "-1MiB", "abc", "MiB", "1.5.5GiB", "12 MiB extra", "nan",
                           "inf"}) {
    EXPECT_THROW(parse_bytes(junk), std::invalid_argument) << '"' << junk << '"';
  }
  const std::string msg = thrown_message<std::invalid_argument>([] { parse_bytes("12Q"); });
  EXPECT_TRUE(contains(msg, "12Q")) << msg;
}

TEST(ByteSizes, FormatUsesBinaryUnitsAndParsesBack) {
  EXPECT_EQ(format_bytes(0), "0 B");
  EXPECT_EQ(format_bytes(1023), "1023 B");
  EXPECT_EQ(format_bytes(1024), "1.00 KiB");
  EXPECT_EQ(format_bytes(1536), "1.50 KiB");
  EXPECT_EQ(format_bytes(512ull << 20), "512.00 MiB");
  EXPECT_EQ(format_bytes(3ull << 29), "1.50 GiB");
  for (uint64_t v : {0ull, 1023ull, 4096ull, 1536ull, 512ull << 20, 3ull << 29, 5ull << 40})
    EXPECT_EQ(parse_bytes(format_bytes(v)), v) << format_bytes(v);
}

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

// ---------------------------------------------------------------------------------------------
// Training configuration

// The example of docs/CONFIG.md.
constexpr const char* kTinyGpt2Config = R"({
  "model": {"preset": "gpt2", "layers": 6, "hidden": 64, "heads": 4,
            "vocab_size": 256, "max_positions": 64, "seed": 0},
  "data": {"path": "/usr/share/common-licenses", "format": "bytes", "seq_len": 32, "seed": 0},
  "batch": {"micro_batch": 2, "grad_accum": 2},
  "optimizer": {"type": "adamw", "lr": 0.001, "betas": [0.9, 0.999], "eps": 1e-8,
                "weight_decay": 0.0, "clip_grad_norm": 1.0},
  "precision": {"compute": "fp32", "reduce": "fp32"},
  "placement": {"params": "host", "grads": "host", "master": "host", "moments": "host"},
  "device": {"type": "cpu", "budget": "1MiB", "prefetch": 1, "cpu_threads": 0},
  "distributed": {"timeout_s": 300},
  "run": {"steps": 20, "log": "tiny.jsonl", "progress": true, "export": ""}
})";

// The message of the std::invalid_argument that parsing `json` as "test.json" throws.
std::string config_error(const std::string& json) {
  return thrown_message<std::invalid_argument>([&] { parse_train_config(json, "test.json"); });
}

// `text` as a JSON string literal.
std::string json_string(const std::string& text) {
  std::string out = "\"";
  for (char ch : text) {
    if (ch == '"' || ch == '\\') out += '\\';
    out += ch;
  }
  return out + "\"";
}

// A Hugging Face model directory holding only config.json, for model.init_from.
void write_hf_config(const std::filesystem::path& dir, const models::ModelConfig& mc) {
  std::ofstream out(dir / "config.json");
  out << mc.to_hf_json();
}

// --- Rendezvous from the launcher's environment ---------------------------------------------

DistEnv dist_env(const std::map<std::string, std::string>& vars) {
  return DistEnv::from_lookup([&](const char* name) -> const char* {
    auto it = vars.find(name);
    return it == vars.end() ? nullptr : it->second.c_str();
  });
}

// Ranks on one node share its cores: each gets an equal share, never none.
TEST(CpuShare, RanksOnANodeShareItsCores) {
  const unsigned cpus = usable_cpus();
  ASSERT_GE(cpus, 1u);
  EXPECT_LE(cpus, std::max(1u, std::thread::hardware_concurrency()));
  EXPECT_EQ(cpu_threads_per_rank(1), cpus);
  EXPECT_EQ(cpu_threads_per_rank(0), cpus);  // unknown: one rank
  EXPECT_EQ(cpu_threads_per_rank(2), std::max(1u, cpus / 2));
  EXPECT_EQ(cpu_threads_per_rank(1000), 1u);

  // The intra-op threads: one rank keeps libtorch's default; several divide it; OMP_NUM_THREADS,
  // where set, is left to libtorch.
  const int before = at::get_num_threads();
  const char* omp = std::getenv("OMP_NUM_THREADS");
  const std::string kept = omp ? omp : "";
  unsetenv("OMP_NUM_THREADS");
  EXPECT_EQ(apply_compute_threads(1), before);
  EXPECT_EQ(apply_compute_threads(1000), 1);
  at::set_num_threads(before);
  setenv("OMP_NUM_THREADS", "1", 1);
  EXPECT_EQ(apply_compute_threads(2), before);
  if (omp) setenv("OMP_NUM_THREADS", kept.c_str(), 1);
  else unsetenv("OMP_NUM_THREADS");
  at::set_num_threads(before);
}

TEST(DistEnv, NoLauncherVariablesMeanOneProcess) {
  const DistEnv e = dist_env({{"SLURM_JOB_ID", "77"}, {"SLURM_PROCID", "0"}, {"SLURM_NTASKS", "8"}});
  // A batch script's own shell has SLURM_PROCID and SLURM_NTASKS but no step task count:
  // `strata train` run there directly is one process, not rank 0 waiting for 7 that never come.
  EXPECT_EQ(e.launcher, "none");
  EXPECT_EQ(e.rank, 0);
  EXPECT_EQ(e.world_size, 1);
}

TEST(DistEnv, TorchrunVariablesAreTakenAsGiven) {
  const DistEnv e = dist_env({{"RANK", "5"}, {"WORLD_SIZE", "8"}, {"LOCAL_RANK", "1"},
                              {"MASTER_ADDR", "node7"}, {"MASTER_PORT", "31000"}});
  EXPECT_EQ(e.launcher, "torchrun");
  EXPECT_EQ(e.rank, 5);
  EXPECT_EQ(e.world_size, 8);
  EXPECT_EQ(e.local_rank, 1);
  EXPECT_EQ(e.master_addr, "node7");
  EXPECT_EQ(e.master_port, 31000);
  // LOCAL_RANK defaults to RANK, the address and port to torchrun's defaults.
  const DistEnv d = dist_env({{"RANK", "1"}, {"WORLD_SIZE", "2"}});
  EXPECT_EQ(d.local_rank, 1);
  EXPECT_EQ(d.master_addr, "127.0.0.1");
  EXPECT_EQ(d.master_port, 29500);
}

TEST(DistEnv, SrunTasksTakeRankWorldLocalRankAndRendezvousFromSlurm) {
  const std::map<std::string, std::string> task = {
      {"SLURM_JOB_ID", "123456"},  {"SLURM_PROCID", "13"},
      {"SLURM_STEP_NUM_TASKS", "16"}, {"SLURM_LOCALID", "5"},
      {"SLURM_STEP_NODELIST", "gpu-[07-08]"}, {"SLURM_JOB_NODELIST", "gpu-[01-08]"},
      {"SLURM_NTASKS", "64"}};
  const DistEnv e = dist_env(task);
  EXPECT_EQ(e.launcher, "slurm");
  EXPECT_EQ(e.rank, 13);
  EXPECT_EQ(e.world_size, 16);  // the step's tasks, not the allocation's
  EXPECT_EQ(e.local_rank, 5);
  EXPECT_EQ(e.master_addr, "gpu-07");  // the step's first node, where srun puts task 0
  EXPECT_EQ(e.master_port, 20000 + 123456 % 10000);  // below Linux's ephemeral ports (32768)
  EXPECT_EQ(e.local_world_size, 0);  // srun did not say
  // Every task of the job computes the same rendezvous.
  auto other = task;
  other["SLURM_PROCID"] = "0";
  other["SLURM_LOCALID"] = "0";
  EXPECT_EQ(dist_env(other).master_addr, e.master_addr);
  EXPECT_EQ(dist_env(other).master_port, e.master_port);
  // MASTER_ADDR and MASTER_PORT override what Slurm implies; the job's node list serves when
  // the step's is missing.
  other["MASTER_ADDR"] = "10.1.2.3";
  other["MASTER_PORT"] = "29999";
  EXPECT_EQ(dist_env(other).master_addr, "10.1.2.3");
  EXPECT_EQ(dist_env(other).master_port, 29999);
  auto job_list = task;
  job_list.erase("SLURM_STEP_NODELIST");
  EXPECT_EQ(dist_env(job_list).master_addr, "gpu-01");
  // A federated cluster's job ids go past 2^31; and with MASTER_PORT set, the id is not needed.
  auto federated = task;
  federated["SLURM_JOB_ID"] = "4026531841";
  EXPECT_EQ(dist_env(federated).master_port, 20000 + int(4026531841ull % 10000));
  federated["SLURM_JOB_ID"] = "n/a";
  federated["MASTER_PORT"] = "29400";
  EXPECT_EQ(dist_env(federated).master_port, 29400);
}

TEST(DistEnv, SrunTasksPerNodeGiveTheLocalWorldSize) {
  std::map<std::string, std::string> task = {{"SLURM_JOB_ID", "5"}, {"SLURM_PROCID", "9"},
                                             {"SLURM_STEP_NUM_TASKS", "16"}, {"SLURM_STEP_NODELIST", "n[1-2]"},
                                             {"SLURM_NODEID", "1"}, {"SLURM_STEP_TASKS_PER_NODE", "8(x2)"}};
  EXPECT_EQ(dist_env(task).local_world_size, 8);
  task["SLURM_STEP_TASKS_PER_NODE"] = "8";
  EXPECT_EQ(dist_env(task).local_world_size, 8);
  task["SLURM_STEP_NUM_TASKS"] = "7";
  task["SLURM_PROCID"] = "6";
  task["SLURM_STEP_TASKS_PER_NODE"] = "2(x3),1";  // node 1 of 4 runs 2 tasks, node 3 one
  EXPECT_EQ(dist_env(task).local_world_size, 2);
  task["SLURM_NODEID"] = "3";
  EXPECT_EQ(dist_env(task).local_world_size, 1);
  task["SLURM_NODEID"] = "9";  // not in the list: unknown, not a guess
  EXPECT_EQ(dist_env(task).local_world_size, 0);
  task["SLURM_STEP_TASKS_PER_NODE"] = "2(x";  // malformed: unknown
  EXPECT_EQ(dist_env(task).local_world_size, 0);
  // torchrun says it outright.
  EXPECT_EQ(dist_env({{"RANK", "0"}, {"WORLD_SIZE", "16"}, {"LOCAL_WORLD_SIZE", "8"}}).local_world_size, 8);
}

TEST(DistEnv, TorchrunUnderSrunWinsOverSlurm) {
  const DistEnv e = dist_env({{"RANK", "3"}, {"WORLD_SIZE", "4"}, {"MASTER_ADDR", "a"},
                              {"SLURM_JOB_ID", "9"}, {"SLURM_PROCID", "0"},
                              {"SLURM_STEP_NUM_TASKS", "1"}, {"SLURM_STEP_NODELIST", "b"}});
  EXPECT_EQ(e.launcher, "torchrun");
  EXPECT_EQ(e.rank, 3);
  EXPECT_EQ(e.world_size, 4);
  EXPECT_EQ(e.master_addr, "a");
}

TEST(DistEnv, SlurmHostListsGiveTheirFirstHost) {
  EXPECT_EQ(slurm_first_host("node1"), "node1");
  EXPECT_EQ(slurm_first_host("node1,node2"), "node1");
  EXPECT_EQ(slurm_first_host("gnode[10,20,25,37]"), "gnode10");
  EXPECT_EQ(slurm_first_host("gpu-[007-009,012],login1"), "gpu-007");
  EXPECT_EQ(slurm_first_host("rack[2-3]-n[01-04]"), "rack2-n01");
  EXPECT_EQ(slurm_first_host("n[5]x"), "n5x");
  EXPECT_EQ(slurm_first_host("dgx-a100.cluster.local"), "dgx-a100.cluster.local");
  for (const char* bad : {"", ",node1", "node[1-3", "node1]", "node[]", "node[a-b]", "[-3]"})
    EXPECT_THROW(slurm_first_host(bad), std::invalid_argument) << bad;
}

// The message DistEnv gives for `vars` (a failure is recorded if it accepts them).
std::string dist_env_error(const std::map<std::string, std::string>& vars) {
  return thrown_message<std::invalid_argument>([&] { dist_env(vars); });
}

TEST(DistEnv, BadOrInconsistentValuesNameTheVariable) {
  EXPECT_TRUE(contains(dist_env_error({{"RANK", "1"}}), "RANK and WORLD_SIZE"));
  EXPECT_TRUE(contains(dist_env_error({{"RANK", "2"}, {"WORLD_SIZE", "2"}}), "rank 2 is not below the world size 2"));
  EXPECT_TRUE(contains(dist_env_error({{"SLURM_PROCID", "x"}, {"SLURM_STEP_NUM_TASKS", "2"}}), "SLURM_PROCID=\"x\""));
  const std::map<std::string, std::string> task = {{"SLURM_PROCID", "0"}, {"SLURM_STEP_NUM_TASKS", "2"}};
  auto with = [&](std::map<std::string, std::string> more) {
    more.insert(task.begin(), task.end());
    return more;
  };
  EXPECT_TRUE(contains(dist_env_error(with({{"SLURM_JOB_ID", "1"}, {"SLURM_STEP_NODELIST", "n[1-2"}})),
                       "Slurm host list \"n[1-2\""));
  EXPECT_TRUE(contains(dist_env_error(with({{"SLURM_STEP_NODELIST", "n1"}})), "SLURM_JOB_ID"));
  EXPECT_TRUE(contains(dist_env_error(with({{"SLURM_STEP_NODELIST", "n1"}, {"SLURM_JOB_ID", "-3"}})),
                       "numeric SLURM_JOB_ID (\"-3\"): set MASTER_PORT"));
  EXPECT_TRUE(contains(dist_env_error(with({{"SLURM_JOB_ID", "1"}})), "MASTER_ADDR"));
}

TEST(TrainConfig, EmptyObjectGivesTheDocumentedDefaults) {
  const TrainConfig c = parse_train_config("{}", "test.json");
  EXPECT_EQ(c.model.name, "gpt2");
  EXPECT_EQ(c.model.arch, models::Arch::kGpt2);
  EXPECT_EQ(c.model.layers, 12);
  EXPECT_EQ(c.model.hidden, 768);
  EXPECT_EQ(c.model.heads, 12);
  EXPECT_EQ(c.model.kv_heads, 12);
  EXPECT_EQ(c.model.head_dim, 64);
  EXPECT_EQ(c.model.intermediate, 3072);
  EXPECT_EQ(c.model.vocab_size, 50257);
  EXPECT_EQ(c.model.max_positions, 1024);
  EXPECT_TRUE(c.model.tie_embeddings);
  EXPECT_EQ(c.init_from, "");
  EXPECT_EQ(c.init_seed, 0u);
  EXPECT_EQ(c.data_path, "/usr/share/common-licenses");
  EXPECT_EQ(c.data_format, "bytes");
  EXPECT_EQ(c.data_seed, 0u);
  EXPECT_EQ(c.steps, 20);
  EXPECT_EQ(c.log_path, "strata-train.jsonl");
  EXPECT_TRUE(c.progress);
  EXPECT_EQ(c.export_dir, "");

  const EngineConfig& e = c.engine;
  EXPECT_DOUBLE_EQ(e.lr, 1e-3);
  EXPECT_DOUBLE_EQ(e.beta1, 0.9);
  EXPECT_DOUBLE_EQ(e.beta2, 0.999);
  EXPECT_DOUBLE_EQ(e.eps, 1e-8);
  EXPECT_DOUBLE_EQ(e.weight_decay, 0.0);
  EXPECT_TRUE(e.decoupled_weight_decay);
  EXPECT_DOUBLE_EQ(e.clip_grad_norm, 0.0);
  EXPECT_EQ(e.update_overlap, UpdateOverlap::kForward);
  EXPECT_EQ(e.micro_batch, 1);
  EXPECT_EQ(e.grad_accum, 1);
  EXPECT_EQ(e.seq_len, 64);
  EXPECT_EQ(e.compute, Precision::kFp32);
  EXPECT_EQ(e.reduce, Precision::kFp32);
  EXPECT_DOUBLE_EQ(e.initial_loss_scale, 65536.0);
  EXPECT_EQ(e.loss_scale_window, 1000);
  EXPECT_EQ(e.params, Placement::kHost);
  EXPECT_EQ(e.grads, Placement::kHost);
  EXPECT_EQ(e.master, Placement::kHost);
  EXPECT_EQ(e.moments, Placement::kHost);
  EXPECT_EQ(e.device, "cpu");
  EXPECT_EQ(e.device_budget, UINT64_MAX);
  EXPECT_EQ(e.prefetch, 1);
  EXPECT_EQ(e.recompute_blocks, EngineConfig::kRecomputeAll);
  EXPECT_EQ(e.cpu_threads, 0u);
  EXPECT_DOUBLE_EQ(e.timeout_s, 300.0);

  // Empty sections change nothing.
  const TrainConfig s = parse_train_config(
      R"({"model": {}, "data": {}, "batch": {}, "optimizer": {}, "precision": {},
          "placement": {}, "device": {}, "distributed": {}, "run": {}})",
      "test.json");
  EXPECT_EQ(s.model.hidden, 768);
  EXPECT_EQ(s.steps, 20);
  EXPECT_EQ(s.engine.device_budget, UINT64_MAX);
}

TEST(TrainConfig, TinyGpt2ExampleParsesWithItsOverrides) {
  const TrainConfig c = parse_train_config(kTinyGpt2Config, "test.json");
  EXPECT_EQ(c.model.name, "gpt2");
  EXPECT_EQ(c.model.arch, models::Arch::kGpt2);
  EXPECT_EQ(c.model.layers, 6);
  EXPECT_EQ(c.model.hidden, 64);
  EXPECT_EQ(c.model.heads, 4);
  EXPECT_EQ(c.model.kv_heads, 4);
  EXPECT_EQ(c.model.head_dim, 16);
  EXPECT_EQ(c.model.intermediate, 256);
  EXPECT_EQ(c.model.vocab_size, 256);
  EXPECT_EQ(c.model.max_positions, 64);
  EXPECT_EQ(c.engine.seq_len, 32);
  EXPECT_EQ(c.engine.micro_batch, 2);
  EXPECT_EQ(c.engine.grad_accum, 2);
  EXPECT_DOUBLE_EQ(c.engine.clip_grad_norm, 1.0);
  EXPECT_EQ(c.engine.device_budget, uint64_t(1) << 20);
  EXPECT_EQ(c.log_path, "tiny.jsonl");
  EXPECT_EQ(c.steps, 20);
}

TEST(TrainConfig, EveryKeyReachesItsField) {
  const TrainConfig c = parse_train_config(R"({
    "model": {"preset": "gpt2", "seed": 7, "tie_embeddings": false},
    "data": {"path": "/data/tokens.bin", "format": "uint16", "seq_len": 128, "seed": 9},
    "batch": {"micro_batch": 3, "grad_accum": 5},
    "optimizer": {"type": "adam", "lr": 0.25, "betas": [0.5, 0.75], "eps": 1e-6,
                  "weight_decay": 0.125, "clip_grad_norm": 2},
    "precision": {"compute": "fp16", "reduce": "bf16", "initial_loss_scale": 1024,
                  "loss_scale_window": 50},
    "placement": {"params": "device", "grads": "host", "master": "host", "moments": "host",
                  "activations": "device", "recompute": 3},
    "device": {"budget": 1048576, "prefetch": 0, "cpu_threads": 6},
    "distributed": {"timeout_s": 12.5},
    "run": {"steps": 0, "log": "", "progress": false, "export": "out",
            "checkpoint_part_size": "32MiB", "checkpoint_concurrency": 3}
  })", "test.json");
  EXPECT_EQ(c.init_seed, 7u);
  EXPECT_EQ(c.checkpoint_transfer.part_bytes, 32ull << 20);
  EXPECT_EQ(c.checkpoint_transfer.concurrency, 3);
  EXPECT_FALSE(c.model.tie_embeddings);
  EXPECT_EQ(c.data_path, "/data/tokens.bin");
  EXPECT_EQ(c.data_format, "uint16");
  EXPECT_EQ(c.engine.seq_len, 128);
  EXPECT_EQ(c.data_seed, 9u);
  EXPECT_EQ(c.engine.micro_batch, 3);
  EXPECT_EQ(c.engine.grad_accum, 5);
  EXPECT_FALSE(c.engine.decoupled_weight_decay);
  EXPECT_DOUBLE_EQ(c.engine.lr, 0.25);
  EXPECT_DOUBLE_EQ(c.engine.beta1, 0.5);
  EXPECT_DOUBLE_EQ(c.engine.beta2, 0.75);
  EXPECT_DOUBLE_EQ(c.engine.eps, 1e-6);
  EXPECT_DOUBLE_EQ(c.engine.weight_decay, 0.125);
  EXPECT_DOUBLE_EQ(c.engine.clip_grad_norm, 2.0);
  EXPECT_EQ(c.engine.compute, Precision::kFp16);
  EXPECT_EQ(c.engine.reduce, Precision::kBf16);
  EXPECT_DOUBLE_EQ(c.engine.initial_loss_scale, 1024.0);
  EXPECT_EQ(c.engine.loss_scale_window, 50);
  EXPECT_EQ(c.engine.params, Placement::kDevice);
  EXPECT_EQ(c.engine.grads, Placement::kHost);
  EXPECT_EQ(c.engine.master, Placement::kHost);
  EXPECT_EQ(c.engine.activations, Placement::kDevice);
  EXPECT_EQ(c.engine.recompute_blocks, 3);
  EXPECT_FALSE(c.engine.prefetch_auto);
  EXPECT_EQ(c.engine.moments, Placement::kHost);
  EXPECT_EQ(c.engine.device_budget, 1048576u);
  EXPECT_EQ(c.engine.prefetch, 0);
  EXPECT_EQ(c.engine.cpu_threads, 6u);
  EXPECT_DOUBLE_EQ(c.engine.timeout_s, 12.5);
  EXPECT_EQ(c.steps, 0);
  EXPECT_EQ(c.log_path, "");
  EXPECT_FALSE(c.progress);
  EXPECT_EQ(c.export_dir, "out");
}

// placement.tiling.head_pass: "two" (the default) or "one"; anything else is refused by name.
TEST(TrainConfig, HeadPassIsOneOrTwo) {
  EXPECT_FALSE(parse_train_config("{}", "t.json").engine.head_one_pass);
  EXPECT_TRUE(parse_train_config(R"({"placement": {"tiling": {"head": 4, "head_pass": "one"}}})", "t.json")
                  .engine.head_one_pass);
  EXPECT_FALSE(parse_train_config(R"({"placement": {"tiling": {"head_pass": "two"}}})", "t.json").engine.head_one_pass);
  try {
    parse_train_config(R"({"placement": {"tiling": {"head_pass": 1}}})", "t.json");
    ADD_FAILURE() << "accepted head_pass 1";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("tiling.head_pass"), std::string::npos) << e.what();
  }
}

TEST(TrainConfig, RecomputeTakesAllNoneAutoOrABlockCount) {
  auto recompute_of = [](const std::string& value) {
    return parse_train_config(R"({"placement": {"recompute": )" + value + "}}", "test.json").engine.recompute_blocks;
  };
  EXPECT_EQ(recompute_of(R"("all")"), EngineConfig::kRecomputeAll);
  EXPECT_EQ(recompute_of(R"("none")"), 0);
  EXPECT_EQ(recompute_of(R"("auto")"), EngineConfig::kRecomputeAuto);
  EXPECT_EQ(recompute_of("0"), 0);
  EXPECT_EQ(recompute_of("7"), 7);
}

TEST(TrainConfig, DeviceBudgetTakesASizeStringOrAByteCount) {
  auto budget_of = [](const std::string& value) {
    return parse_train_config(R"({"device": {"budget": )" + value + "}}", "test.json")
        .engine.device_budget;
  };
  EXPECT_EQ(budget_of(R"("1MiB")"), 1048576u);
  EXPECT_EQ(budget_of("1048576"), 1048576u);
  EXPECT_EQ(budget_of(R"("1.5GiB")"), 3ull << 29);
  for (const char* bad : {R"("12Q")", "0", "-1", "1.5", R"("")", "true"}) {
    const std::string msg = config_error(std::string(R"({"device": {"budget": )") + bad + "}}");
    EXPECT_TRUE(contains(msg, "device.budget")) << bad << ": " << msg;
  }
}

TEST(TrainConfig, ReshapingDerivesHeadDimKvHeadsAndIntermediate) {
  // Llama: kv_heads is capped at the new head count, intermediate becomes 4 * hidden.
  const TrainConfig llama = parse_train_config(
      R"({"model": {"preset": "llama-1b", "hidden": 512, "heads": 4}})", "test.json");
  EXPECT_EQ(llama.model.arch, models::Arch::kLlama);
  EXPECT_EQ(llama.model.head_dim, 128);
  EXPECT_EQ(llama.model.kv_heads, 4);
  EXPECT_EQ(llama.model.intermediate, 2048);
  // Explicit values win.
  const TrainConfig gqa = parse_train_config(
      R"({"model": {"preset": "llama-1b", "hidden": 512, "heads": 8, "kv_heads": 2,
                    "intermediate": 1000}})",
      "test.json");
  EXPECT_EQ(gqa.model.head_dim, 64);
  EXPECT_EQ(gqa.model.kv_heads, 2);
  EXPECT_EQ(gqa.model.intermediate, 1000);
  // Only layers changed: head_dim, kv_heads and intermediate stay the preset's.
  const TrainConfig deeper = parse_train_config(R"({"model": {"layers": 2}})", "test.json");
  EXPECT_EQ(deeper.model.layers, 2);
  EXPECT_EQ(deeper.model.head_dim, 64);
  EXPECT_EQ(deeper.model.intermediate, 3072);
  // seq_len above max_positions is a GPT-2 limit only (Llama uses rotary embeddings).
  EXPECT_NO_THROW(parse_train_config(
      R"({"model": {"preset": "llama-1b"}, "data": {"seq_len": 100000}})", "test.json"));
}

TEST(TrainConfig, InvalidConfigurationsNameTheFileAndKey) {
  struct Bad {
    const char* json;
    const char* names;
  };
  const Bad cases[] = {
      {R"({"optimiser": {}})", "optimiser"},
      {R"({"run": {"checkpoint_part_size": 0}})", "run.checkpoint_part_size"},
      {R"({"run": {"checkpoint_part_size": "6GiB"}})", "run.checkpoint_part_size"},
      {R"({"run": {"checkpoint_concurrency": 0}})", "run.checkpoint_concurrency"},
      {R"({"run": {"checkpoint_concurrency": 65}})", "run.checkpoint_concurrency"},
      {R"({"run": {"checkpoint_part_size": "1GiB", "checkpoint_concurrency": 32}})", "run.checkpoint_part_size"},
      {R"({"optimizer": {"momentum": 0.9}})", "optimizer.momentum"},
      {R"({"model": {"layer": 6}})", "model.layer"},
      {R"({"batch": {"micro_batch": "2"}})", "batch.micro_batch"},
      {R"({"batch": {"micro_batch": 2.0}})", "batch.micro_batch"},
      {R"({"batch": {"micro_batch": 0}})", "batch.micro_batch"},
      {R"({"batch": {"grad_accum": -1}})", "batch.grad_accum"},
      {R"({"batch": 2})", "batch"},
      {R"({"precision": {"compute": "fp8"}})", "precision.compute"},
      {R"({"precision": {"reduce": "fp16"}})", "precision.reduce"},
      {R"({"precision": {"initial_loss_scale": 0}})", "precision.initial_loss_scale"},
      {R"({"precision": {"loss_scale_window": 0}})", "precision.loss_scale_window"},
      {R"({"optimizer": {"type": "sgd"}})", "optimizer.type"},
      {R"({"optimizer": {"betas": [0.9]}})", "optimizer.betas"},
      {R"({"optimizer": {"betas": [0.9, 0.99, 0.999]}})", "optimizer.betas"},
      {R"({"optimizer": {"betas": [0.9, "0.999"]}})", "optimizer.betas"},
      {R"({"optimizer": {"betas": 0.9}})", "optimizer.betas"},
      {R"({"optimizer": {"betas": [0.9, 1.0]}})", "optimizer.betas"},
      {R"({"optimizer": {"lr": "0.1"}})", "optimizer.lr"},
      {R"({"optimizer": {"lr": -0.1}})", "optimizer.lr"},
      {R"({"optimizer": {"eps": 0}})", "optimizer.eps"},
      {R"({"optimizer": {"weight_decay": -1}})", "optimizer.weight_decay"},
      {R"({"optimizer": {"clip_grad_norm": -1}})", "optimizer.clip_grad_norm"},
      {R"({"placement": {"params": "gpu"}})", "placement.params"},
      {R"({"device": {"type": "tpu"}})", "device.type"},
      {R"({"placement": {"master": "device"}})", "placement.master"},
      {R"({"device": {"prefetch": -1}})", "device.prefetch"},
      {R"({"placement": {"recompute": -1}})", "placement.recompute"},
      {R"({"placement": {"recompute": "some"}})", "placement.recompute"},
      {R"({"placement": {"recompute": true}})", "placement.recompute"},
      {R"({"placement": {"recompute": 1.5}})", "placement.recompute"},
      {R"({"device": {"prefetch": "deep"}})", "device.prefetch"},
      {R"({"device": {"cpu_threads": -1}})", "device.cpu_threads"},
      {R"({"distributed": {"timeout_s": 0}})", "distributed.timeout_s"},
      {R"({"data": {"seq_len": 0}})", "data.seq_len"},
      {R"({"data": {"seq_len": 2048}})", "data.seq_len"},
      {R"({"data": {"seed": -1}})", "data.seed"},
      {R"({"run": {"steps": -1}})", "run.steps"},
      {R"({"run": {"progress": 1}})", "run.progress"},
      {R"({"run": {"log": null}})", "run.log"},
      {R"({"model": {"preset": "gpt5"}})", "model.preset"},
      {R"({"model": {"hidden": 64}})", "head_dim"},  // 64 is not a multiple of gpt2's 12 heads
      {R"({"model": {"hf_config": "/nonexistent/config.json"}})", "/nonexistent/config.json"},
      {R"([1, 2])", "test.json"},
      {R"({"model": )", "not valid JSON"},
  };
  for (const Bad& bad : cases) {
    SCOPED_TRACE(bad.json);
    const std::string msg = config_error(bad.json);
    EXPECT_TRUE(contains(msg, bad.names)) << msg;
    EXPECT_EQ(msg.rfind("test.json", 0), 0u) << msg;
  }
}

TEST(TrainConfig, InitFromReadsTheDirectoryAndRejectsReshaping) {
  test::TempDir dir;
  models::ModelConfig mc = models::preset("gpt2");
  mc.layers = 3;
  mc.hidden = 96;
  mc.heads = mc.kv_heads = 6;
  mc.head_dim = 16;
  mc.intermediate = 384;
  mc.vocab_size = 300;
  mc.max_positions = 128;
  write_hf_config(dir.path(), mc);
  const std::string init = R"({"model": {"init_from": )" + json_string(dir.path().string());

  const TrainConfig c = parse_train_config(init + R"(}, "data": {"path": "tokens.bin", "format": "uint16"}})",
                                           "test.json");
  EXPECT_EQ(c.init_from, dir.path().string());
  EXPECT_EQ(c.data_path, "tokens.bin");
  EXPECT_EQ(c.model.layers, 3);
  EXPECT_EQ(c.model.hidden, 96);
  EXPECT_EQ(c.model.heads, 6);
  EXPECT_EQ(c.model.vocab_size, 300);

  const std::string msg = config_error(init + R"(, "hidden": 192, "heads": 12}})");
  EXPECT_TRUE(contains(msg, "model.init_from")) << msg;
  EXPECT_TRUE(contains(config_error(init + R"(, "heads": 3}})"), "model.init_from"));
  // A directory without config.json.
  test::TempDir empty;
  const std::string missing = config_error(R"({"model": {"init_from": )" +
                                           json_string(empty.path().string()) + "}}");
  EXPECT_TRUE(contains(missing, "config.json")) << missing;
}

// A pretrained model with the default data (raw bytes, valid ids of any vocabulary) would be
// fine-tuned on text its tokenizer never made, silently: data.path must be given.
TEST(TrainConfig, InitFromNeedsDataPathGivenExplicitly) {
  test::TempDir dir;
  write_hf_config(dir.path(), models::preset("gpt2"));
  const std::string init = R"({"model": {"init_from": )" + json_string(dir.path().string()) + "}";
  for (const std::string& data : {std::string(""), std::string(R"(, "data": {"seq_len": 32})")}) {
    const std::string msg = config_error(init + data + "}");
    EXPECT_TRUE(contains(msg, "model.init_from is set but data.path is not")) << msg;
    EXPECT_TRUE(contains(msg, "strata data prepare")) << msg;
  }
  EXPECT_EQ(parse_train_config(init + R"(, "data": {"path": "/usr/share/common-licenses"}})", "t.json").data_path,
            "/usr/share/common-licenses");  // the default, but asked for
}

TEST(TrainConfig, InitFromRejectsALayersOverride) {
  test::TempDir dir;
  write_hf_config(dir.path(), models::preset("gpt2"));
  const std::string msg = config_error(R"({"model": {"init_from": )" +
                                       json_string(dir.path().string()) + R"(, "layers": 2}})");
  EXPECT_TRUE(contains(msg, "model.init_from")) << msg;
}

TEST(TrainConfig, LoadNamesTheFileInItsErrors) {
  test::TempDir dir;
  const std::string path = (dir / "typo.json").string();
  {
    std::ofstream out(path);
    out << R"({"batch": {"micro_batch": 2, "grad_acum": 4}})";
  }
  const std::string msg = thrown_message<std::invalid_argument>([&] { load_train_config(path); });
  EXPECT_EQ(msg.rfind(path + ": ", 0), 0u) << msg;
  EXPECT_TRUE(contains(msg, "batch.grad_acum")) << msg;

  const std::string good = (dir / "tiny.json").string();
  {
    std::ofstream out(good);
    out << kTinyGpt2Config;
  }
  EXPECT_EQ(load_train_config(good).model.hidden, 64);

  const std::string absent = (dir / "absent.json").string();
  const std::string missing =
      thrown_message<std::invalid_argument>([&] { load_train_config(absent); });
  EXPECT_TRUE(contains(missing, absent)) << missing;
}

TEST(TrainConfig, EnumNamesRoundTrip) {
  EXPECT_STREQ(to_string(Precision::kFp32), "fp32");
  EXPECT_STREQ(to_string(Precision::kBf16), "bf16");
  EXPECT_STREQ(to_string(Precision::kFp16), "fp16");
  EXPECT_STREQ(to_string(Placement::kDevice), "device");
  EXPECT_STREQ(to_string(Placement::kHost), "host");
  EXPECT_STREQ(to_string(UpdateOverlap::kOff), "off");
  EXPECT_STREQ(to_string(UpdateOverlap::kForward), "forward");
  EXPECT_STREQ(to_string(UpdateOverlap::kBackward), "backward");
}

// The configurations shipped in the repository (the main job's, the GPU benchmarks') stay valid
// as the schema changes.
// A configuration that fine-tunes (model.init_from, a path relative to where it runs: the quick
// start's model is made by its first lines) parses here beside a model config.json written there.
TEST(TrainConfig, EveryShippedConfigurationParses) {
  test::TempDir cwd;
  const std::filesystem::path was = std::filesystem::current_path();
  std::filesystem::current_path(cwd.path());
  size_t parsed = 0;
  for (const char* dir : {"configs", "bench/configs"})
    for (const auto& f : std::filesystem::directory_iterator(std::filesystem::path(STRATA_SOURCE_DIR) / dir)) {
      if (f.path().extension() != ".json") continue;
      SCOPED_TRACE(f.path().string());
      std::ifstream in(f.path());
      const nlohmann::json j = nlohmann::json::parse(in);
      if (j.contains("model") && j["model"].contains("init_from")) {
        const std::filesystem::path model = j["model"]["init_from"].get<std::string>();
        ASSERT_TRUE(model.is_relative()) << "a shipped configuration must not name a machine's path";
        std::filesystem::create_directories(model);
        models::ModelConfig c = models::preset("llama-1b");
        c.layers = 2;
        std::ofstream(model / "config.json") << c.to_hf_json();
      }
      EXPECT_NO_THROW(load_train_config(f.path().string()));
      ++parsed;
    }
  std::filesystem::current_path(was);
  EXPECT_GE(parsed, 11u);
}

}  // namespace
}  // namespace strata::engine
