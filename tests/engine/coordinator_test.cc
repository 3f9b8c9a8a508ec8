// The parameter coordinator on its own (engine/src/runtime/coordinator.h), on the host device
// with a state store and a two-rank communicator simulated in process (the peer's shard is a
// known function of ours): what a gather binds, in which order units are gathered ahead and
// dropped over a micro-batch, and what a tight budget does, for compute copies on the device, in
// host RAM and in swap.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "runtime/coordinator.h"
#include "profiler.h"
#include "state/host_memory.h"
#include "state/state_store.h"
#include "strata/engine/comm.h"
#include "strata/engine/device.h"
#include "strata/offload/io_engine.h"
#include "strata/offload/swap_space.h"
#include "test_util.h"

namespace strata::engine::runtime {
namespace {

// Rank 0 of two: the peer's shard is ours + 1000.
class PeerComm final : public Communicator {
 public:
  PeerComm() : Communicator(0, 2) {}
  struct Done final : Work {
    void wait() override {}
  };
  std::unique_ptr<Work> all_gather(const at::Tensor& out, const at::Tensor& in) override {
    const int64_t n = in.numel();
    out.narrow(0, 0, n).copy_(in);
    out.narrow(0, n, n).copy_(in.to(at::kFloat).add(1000).to(in.scalar_type()));
    return std::make_unique<Done>();
  }
  std::unique_ptr<Work> reduce_scatter(const at::Tensor&, const at::Tensor&) override { throw std::logic_error("unused"); }
  std::unique_ptr<Work> all_to_all(const at::Tensor&, const std::vector<int64_t>&, const at::Tensor&,
                                   const std::vector<int64_t>&) override {
    throw std::logic_error("unused");
  }
  void all_reduce(const at::Tensor&, ReduceOp) override { throw std::logic_error("unused"); }
  void broadcast(const at::Tensor&, int) override { throw std::logic_error("unused"); }
  void barrier() override {}
};

// Embedding, two blocks and a head that also uses the embedding (tied weights).
struct Bench {
  test::TempDir dir;
  std::unique_ptr<Device> device;
  state::HostMemory host;
  std::unique_ptr<offload::IoEngine> io = offload::IoEngine::create({});
  std::unique_ptr<offload::SwapSpace> swap;
  Profiler prof;
  PeerComm comm;
  Partition partition{{{"embedding", {{"embed.w", {301, 7}}}},
                       {"block.0", {{"b0.a", {1001}}, {"b0.b", {33, 3}}}},
                       {"block.1", {{"b1.a", {1001}}, {"b1.b", {33, 3}}}},
                       {"head", {{"head.norm", {7}}}}},
                      2, /*align_numel=*/1};
  layout::Schedule schedule{{{0}, {1}, {2}, {3, 0}}, 4};
  std::unique_ptr<layout::MemoryModel> memory;
  layout::Choices choice;
  std::unique_ptr<state::StateStore> store;
  std::unique_ptr<ParameterCoordinator> coord;
  std::vector<std::vector<at::Tensor>> modules;  // the module tensors the coordinator binds
  std::vector<size_t> gathered;                  // units, in the order their gathers started
  // Stands in for the updater: records each gather's wait for its unit's update.
  struct RecordingFence : UpdateFence {
    std::vector<size_t>& seen;
    explicit RecordingFence(std::vector<size_t>& s) : seen(s) {}
    void wait_updated(size_t u) override { seen.push_back(u); }
  } fence{gathered};

  Bench(Placement params, uint64_t budget) : device(Device::create_host(budget)), host(*device) {
    offload::SwapConfig sc;
    sc.dirs = {dir.path()};
    swap = std::make_unique<offload::SwapSpace>(*io, sc);
    layout::ModelSizes sizes;
    for (const UnitLayout& L : partition.units()) {
      sizes.padded_numel.push_back(L.padded_numel());
      sizes.shard_numel.push_back(L.shard_numel);
    }
    sizes.compute_bytes = 2;
    sizes.tokens = 4;
    sizes.hidden = 7;
    sizes.vocab = 301;
    memory = std::make_unique<layout::MemoryModel>(schedule, sizes);
    choice.recomputed = 2;
    StatePlacement plan{params, Placement::kHost, Placement::kHost, Placement::kHost};
    store = std::make_unique<state::StateStore>(partition, at::kBFloat16, plan, *device, host, swap.get(), prof);
    coord = std::make_unique<ParameterCoordinator>(schedule, *memory, choice, partition, *store, host, *device, comm,
                                                   prof, &fence);
    for (size_t u = 0; u < 4; ++u) {
      store->allocate(u, master(u), false);
      std::vector<at::Tensor> ts;
      for (const TensorSlot& s : partition.unit(u).tensors) ts.push_back(at::zeros(s.shape, at::kBFloat16));
      modules.push_back(ts);
      coord->adopt(u, ts);
    }
    coord->set_device_state_bytes(device->used());
  }
  at::Tensor master(size_t u) const {
    return at::arange(int64_t(partition.unit(u).shard_numel), at::kFloat).mul_(0.5).add_(double(u) * 100);
  }
  // What unit u's module tensors must hold once gathered: our shard, then the peer's.
  at::Tensor full(size_t u) const {
    const at::Tensor ours = master(u).to(at::kBFloat16);
    return at::cat({ours, ours.to(at::kFloat).add(1000).to(at::kBFloat16)});
  }
  // The engine's walk over one micro-batch; `after_prefetch(k)` once use k's gathers are issued.
  void walk(const std::function<void(size_t)>& after_prefetch = {}) {
    const size_t total = schedule.uses().size();
    coord->begin_micro_batch();
    for (size_t k = 0; k < total; ++k) {
      coord->acquire(k);
      for (size_t u : schedule.units_of(schedule.use_at(k).stage)) check_bound(u);
      coord->prefetch(k, total);
      if (after_prefetch) after_prefetch(k);
      coord->release_after(k, total);
    }
  }
  void check_bound(size_t u) {
    const at::Tensor want = full(u);
    for (size_t i = 0; i < modules[u].size(); ++i) {
      const TensorSlot& s = partition.unit(u).tensors[i];
      ASSERT_TRUE(at::equal(modules[u][i].reshape(-1), want.narrow(0, int64_t(s.offset), int64_t(s.numel))))
          << "unit " << u << " tensor " << s.name;
    }
  }
};

const Placement kTiers[] = {Placement::kDevice, Placement::kHost, Placement::kNvme};

TEST(ParameterCoordinator, AcquireBindsEveryTensorToItsSlotAndReleaseFreesIt) {
  for (Placement p : kTiers) {
    SCOPED_TRACE(to_string(p));
    Bench b(p, UINT64_MAX);
    for (size_t u = 0; u < 4; ++u) EXPECT_EQ(b.modules[u][0].numel(), 0) << "adopted tensors hold nothing";
    b.coord->acquire(3);  // the head: its unit and the tied embedding
    EXPECT_TRUE(b.coord->gathered(3));
    EXPECT_TRUE(b.coord->gathered(0));
    b.check_bound(3);
    b.check_bound(0);
    const uint64_t before = b.device->used();
    b.coord->release(0);
    EXPECT_EQ(b.modules[0][0].numel(), 0);
    EXPECT_FALSE(b.coord->gathered(0));
    EXPECT_LT(b.device->used(), before) << "the gathered buffer went";
  }
}

TEST(ParameterCoordinator, GathersAheadAndDropsInTheScheduleOrder) {
  for (Placement p : kTiers) {
    SCOPED_TRACE(to_string(p));
    Bench b(p, UINT64_MAX);
    b.walk();
    // Depth 1 over F0 F1 F2 H(3,0) B2 B1 B0: each use's units are started one use ahead, and
    // units no use within the next two needs are dropped (worked out by hand).
    EXPECT_EQ(b.gathered, (std::vector<size_t>{0, 1, 2, 3, 0, 1, 0}));
    for (size_t u = 0; u < 4; ++u) EXPECT_FALSE(b.coord->gathered(u)) << "nothing is left after the last use";
    b.gathered.clear();
    b.coord->set_depth(3);
    b.walk();
    // Three ahead: every unit is gathered once, by the first use's prefetch, and stays until no
    // use within the next four needs it.
    EXPECT_EQ(b.gathered, (std::vector<size_t>{0, 1, 2, 3}));
  }
}

TEST(ParameterCoordinator, ATightBudgetGathersNothingAheadAndEvictsWhatTheUseNeeds) {
  for (Placement p : kTiers) {
    SCOPED_TRACE(to_string(p));
    // Exactly the largest need of one use beside the state: nothing fits ahead.
    Bench probe(p, UINT64_MAX);
    layout::Choices none = probe.choice;
    none.prefetch = 0;
    const uint64_t budget = probe.device->used() + probe.memory->largest_need(none);
    Bench b(p, budget);
    const uint64_t base = b.device->used();
    bool evicted_or_refused = false;
    b.walk([&](size_t k) {
      // Beyond the use's own units, nothing is gathered unless the model's working set fits.
      const std::vector<size_t>& use = b.schedule.units_of(b.schedule.use_at(k).stage);
      uint64_t held = 0;
      bool only_the_use = true;
      for (size_t u = 0; u < 4; ++u) {
        if (!b.coord->gathered(u)) continue;
        held += b.memory->unit_bytes(u);
        only_the_use &= std::find(use.begin(), use.end(), u) != use.end();
      }
      EXPECT_TRUE(only_the_use || base + held + b.memory->scratch(b.choice) + b.memory->device_checkpoints(b.choice) <= budget)
          << "use " << k << ": " << held << " bytes gathered";
      evicted_or_refused |= only_the_use && k + 1 < b.schedule.uses().size();
    });
    EXPECT_TRUE(evicted_or_refused) << "the budget never held the coordinator back";
    EXPECT_GT(b.gathered.size(), 4u) << "some unit was gathered twice";
  }
}

}  // namespace
}  // namespace strata::engine::runtime
