// The updater on its own (engine/src/runtime/updater.h), over a state store and the optimizer on
// the host device: each overlap mode gives the serial update's numbers; "forward" lets a gather
// wait for exactly its unit; "backward" takes units as they are marked final, in the order
// gradients become final, and an abort stops it waiting; the transient gradient pool makes a
// borrower wait until the updater frees a buffer.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "runtime/optimizer.h"
#include "profiler.h"
#include "runtime/updater.h"
#include "state/host_memory.h"
#include "state/state_store.h"
#include "strata/engine/device.h"
#include "strata/offload/io_engine.h"
#include "strata/offload/swap_space.h"
#include "state_fixture.h"

namespace strata::engine::runtime {
namespace {

using state::kCompute;
using state::kExpAvg;
using state::kGrad;
using state::kMaster;

kernels::AdamConfig adam() {
  kernels::AdamConfig ac;
  ac.lr = 1e-2;
  ac.step = 1;
  return ac;
}

// Embedding, two blocks, a head tied to the embedding; a shard per unit of awkward size.
struct Bench : test::StateFixture {
  layout::Schedule schedule{{{0}, {1}, {2}, {3, 0}}, 4};
  std::unique_ptr<Optimizer> opt;
  std::unique_ptr<GradientBuffers> buffers;  // transient gradients: the reducer's pool
  std::unique_ptr<Updater> updater;
  std::vector<at::Tensor> grads;
  explicit Bench(const StatePlacement& plan, size_t pool = 0)
      : StateFixture(Partition({{"embedding", {{"e", {301, 7}}}}, {"block.0", {{"b0", {5003}}}},
                                {"block.1", {{"b1", {777}}}}, {"head", {{"h", {9}}}}},
                               2, /*align_numel=*/1),
                     plan) {
    opt = std::make_unique<Optimizer>(*store, host, *device, kernels::CpuExec{}, 16 << 10);
    uint64_t largest = 0;
    for (const UnitLayout& L : partition.units()) largest = std::max(largest, L.shard_numel);
    if (pool) buffers = std::make_unique<GradientBuffers>(*store, partition, *device, prof, host, pool, largest);
    updater = std::make_unique<Updater>(*opt, *store, schedule, partition, *device, prof, buffers.get());
    at::manual_seed(31);
    for (size_t u = 0; u < 4; ++u) {
      const int64_t n = int64_t(partition.unit(u).shard_numel);
      store->allocate(u, at::randn({n}), plan.grads_transient);
      grads.push_back(at::randn({n}));
      if (!plan.grads_transient) put(u, kGrad, grads[u]);
    }
  }
  std::vector<at::Tensor> all(int k) {
    std::vector<at::Tensor> out;
    for (size_t u = 0; u < 4; ++u) out.push_back(get(u, k));
    return out;
  }
};

const StatePlacement kHostPlan{Placement::kHost, Placement::kHost, Placement::kHost, Placement::kHost};
const StatePlacement kSwapPlan{Placement::kHost, Placement::kNvme, Placement::kNvme, Placement::kNvme};

// The serial update's results: the optimizer run directly.
std::vector<at::Tensor> serial(const StatePlacement& plan, int kind) {
  Bench b(plan);
  b.opt->update_on_cpu(adam(), {0, 1, 2, 3}, {});
  return b.all(kind);
}

void expect_same(const std::vector<at::Tensor>& got, const std::vector<at::Tensor>& want, const std::string& what) {
  for (size_t u = 0; u < want.size(); ++u) EXPECT_TRUE(at::equal(got[u], want[u])) << what << ", unit " << u;
}

TEST(Updater, ForwardModeGivesTheSerialNumbersAndAGatherWaitsForItsUnit) {
  for (const StatePlacement& plan : {kHostPlan, kSwapPlan}) {
    Bench b(plan);
    std::vector<size_t> written;
    std::mutex mu;
    b.updater->launch_after_step(adam(), [&](size_t u) {
      std::lock_guard<std::mutex> lock(mu);
      written.push_back(u);
    });
    b.updater->wait_updated(2);  // returns once unit 2 is done: its master is the serial one
    const std::vector<at::Tensor> want = serial(plan, kMaster);
    EXPECT_TRUE(at::equal(b.get(2, kMaster), want[2]));
    b.updater->finish();
    expect_same(b.all(kMaster), want, "master");
    expect_same(b.all(kCompute), serial(plan, kCompute), "compute copy");
    EXPECT_EQ(written, (std::vector<size_t>{0, 1, 2, 3})) << "forward order, each unit's hold first";
    EXPECT_GT(b.prof.step.optimizer, 0.0) << "the updater's time joins the step's timeline";
  }
}

TEST(Updater, BackwardModeTakesUnitsAsTheyBecomeFinalInTheScheduleOrder) {
  for (const StatePlacement& plan : {kHostPlan, kSwapPlan}) {
    Bench b(plan);
    std::vector<size_t> order;
    std::mutex mu;
    b.updater->launch_in_backward(adam(), [&](size_t u) {
      std::lock_guard<std::mutex> lock(mu);
      order.push_back(u);
    });
    // Nothing is final yet: the updater must not touch any unit.
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    {
      std::lock_guard<std::mutex> lock(mu);
      EXPECT_TRUE(order.empty()) << "no unit updated before its gradient is final";
    }
    // The backward's order: the head (stage 3), block 1, block 0, then the embedding, whose last
    // use is its own backward (stage 0), not the tied head's.
    for (size_t u : {3u, 2u, 1u, 0u}) b.updater->mark_final(u, offload::IoFuture());
    b.updater->finish();
    if (plan.grads == Placement::kNvme) {
      // Gradients in swap: the ready units in batches, as they were seen; each unit once.
      std::vector<size_t> sorted = order;
      std::sort(sorted.begin(), sorted.end());
      EXPECT_EQ(sorted, (std::vector<size_t>{0, 1, 2, 3}));
    } else {
      EXPECT_EQ(order, (std::vector<size_t>{3, 2, 1, 0})) << "one pass in the order gradients become final";
    }
    expect_same(b.all(kMaster), serial(plan, kMaster), "master");
    expect_same(b.all(kExpAvg), serial(plan, kExpAvg), "exp_avg");
    for (size_t u = 0; u < 4; ++u) {
      const double want = kernels::sum_squares(b.grads[u].data_ptr<float>(), kernels::DType::kF32, b.grads[u].numel());
      EXPECT_NEAR(b.updater->unit_sumsq()[u], want, 1e-12 * want) << "unit " << u;
    }
  }
}

TEST(Updater, AnAbortStopsAnUpdaterWaitingForGradientsThatWillNotCome) {
  Bench b(kHostPlan);
  b.updater->launch_in_backward(adam(), [](size_t) {});
  b.updater->mark_final(3, offload::IoFuture());
  const auto t0 = std::chrono::steady_clock::now();
  b.updater->abort();  // joins; the updater's "step failed" error is dropped
  EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(5));
  EXPECT_NO_THROW(b.updater->finish()) << "the error was dropped by abort";
  // The updater is reusable: a later update runs to the end.
  b.updater->launch_after_step(adam(), [](size_t) {});
  EXPECT_NO_THROW(b.updater->finish());
}

TEST(Updater, ABorrowerOfATransientGradientBufferWaitsUntilTheUpdaterFreesOne) {
  StatePlacement plan = kHostPlan;
  plan.grads_transient = true;
  Bench b(plan, /*pool=*/2);
  b.updater->launch_in_backward(adam(), [](size_t) {});
  // The reducer's part: borrow a buffer, accumulate the gradient into it.
  const auto reduce = [&](size_t u) {
    b.buffers->take(u);
    b.store->tensor(u, kGrad).copy_(b.grads[u]);
  };
  // The backward's order: head, block 1, block 0, embedding.
  reduce(3);
  reduce(2);
  std::atomic<bool> got{false};
  std::thread borrower([&] {
    reduce(1);  // both buffers lent: waits
    got = true;
  });
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  EXPECT_FALSE(got.load()) << "a third buffer out of a pool of two";
  b.updater->mark_final(3, offload::IoFuture());  // its update reads the gradient, then frees it
  borrower.join();
  EXPECT_TRUE(got.load());
  b.updater->mark_final(2, offload::IoFuture());
  reduce(0);  // waits for unit 2's buffer
  b.updater->mark_final(1, offload::IoFuture());
  b.updater->mark_final(0, offload::IoFuture());
  b.updater->finish();
  for (size_t u = 0; u < 4; ++u) EXPECT_FALSE(b.store->tensor(u, kGrad).defined()) << "unit " << u << "'s buffer went back";
  // Every unit updated with its own gradient: the serial numbers.
  expect_same(b.all(kMaster), serial(kHostPlan, kMaster), "master");
}

// An update that fails frees no more buffers: a borrower waiting for one gets its error instead of
// hanging, and the next update lends again.
TEST(Updater, AFailedUpdateStopsABorrowerWaitingForATransientGradientBuffer) {
  StatePlacement plan = kHostPlan;
  plan.grads_transient = true;
  Bench b(plan, /*pool=*/1);
  b.updater->launch_in_backward(adam(), [](size_t) {});
  b.buffers->take(3);
  std::atomic<int> outcome{0};  // 1: got a buffer, 2: threw
  std::thread borrower([&] {
    try {
      b.buffers->take(2);
      outcome = 1;
    } catch (const std::runtime_error&) {
      outcome = 2;
    }
  });
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  EXPECT_EQ(outcome.load(), 0) << "a second buffer out of a pool of one";
  b.updater->abort();  // the updater, waiting for gradients, stops with an error
  borrower.join();
  EXPECT_EQ(outcome.load(), 2) << "the waiting borrower was not told the update failed";
  b.buffers->release(3);
  b.updater->launch_in_backward(adam(), [](size_t) {});
  b.buffers->take(3);  // lends again
  EXPECT_TRUE(b.store->tensor(3, kGrad).defined());
  b.updater->abort();
}

}  // namespace
}  // namespace strata::engine::runtime
