// The optimizer part on its own (engine/src/runtime/optimizer.h), over a state store on the host
// device with a temporary swap directory: for several placements (everything on the device, on
// the host, the optimizer group in swap, a split plan), one Adam step and the local gradient norm
// against the CPU kernels run directly on plain tensors. The updated numbers must be bitwise the
// oracle's whatever the tier.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <memory>
#include <string>
#include <vector>

#include "runtime/optimizer.h"
#include "profiler.h"
#include "state/host_memory.h"
#include "state/state_store.h"
#include "strata/engine/device.h"
#include "strata/kernels/cpu_optim.h"
#include "strata/offload/io_engine.h"
#include "strata/offload/swap_space.h"
#include "state_fixture.h"

namespace strata::engine::runtime {
namespace {

using state::kCompute;
using state::kExpAvg;
using state::kExpAvgSq;
using state::kGrad;
using state::kMaster;

struct Case {
  std::string name;
  StatePlacement plan;
};

std::vector<Case> cases() {
  std::vector<Case> out;
  out.push_back({"device", {Placement::kDevice, Placement::kDevice, Placement::kDevice, Placement::kDevice}});
  out.push_back({"host", {Placement::kHost, Placement::kHost, Placement::kHost, Placement::kHost}});
  out.push_back({"swap", {Placement::kHost, Placement::kNvme, Placement::kNvme, Placement::kNvme}});
  StatePlacement split{Placement::kDevice, Placement::kNvme, Placement::kNvme, Placement::kNvme};
  split.device_units = 1;
  split.host_units = 2;
  out.push_back({"split", split});
  StatePlacement compute_in_swap{Placement::kNvme, Placement::kDevice, Placement::kDevice, Placement::kDevice};
  out.push_back({"device master, compute in swap", compute_in_swap});
  return out;
}

kernels::AdamConfig adam() {
  kernels::AdamConfig ac;
  ac.lr = 1e-3;
  ac.weight_decay = 0.1;
  ac.step = 3;
  ac.grad_scale = 0.25;
  return ac;
}

// A store over three units (unaligned shards over two ranks; block.0's longer than two 16 KiB
// chunks), the optimizer over it, and the initial values every case starts from.
struct Bench : test::StateFixture {
  std::unique_ptr<Optimizer> opt;
  std::vector<at::Tensor> master0, grad0, m0, v0;
  explicit Bench(const StatePlacement& plan)
      : StateFixture(Partition({{"embedding", {{"embed.w", {37, 11}}}}, {"block.0", {{"a", {17001}}}},
                                {"head", {{"head.w", {5}}}}},
                               2, /*align_numel=*/1),
                     plan) {
    kernels::CpuExec exec;
    exec.threads = 2;
    opt = std::make_unique<Optimizer>(*store, host, *device, exec, 16 << 10);
    at::manual_seed(21);
    for (size_t u = 0; u < 3; ++u) {
      const int64_t n = int64_t(partition.unit(u).shard_numel);
      master0.push_back(at::randn({n}));
      grad0.push_back(at::randn({n}));
      m0.push_back(at::randn({n}) * 0.1);
      v0.push_back(at::rand({n}) * 0.01);
      store->allocate(u, master0[u], false);
      put(u, kGrad, grad0[u]);
      put(u, kExpAvg, m0[u]);
      put(u, kExpAvgSq, v0[u]);
    }
  }
};

TEST(Optimizer, OneStepInEveryPlacementEqualsTheKernelsBitForBit) {
  const kernels::AdamConfig ac = adam();
  for (const Case& c : cases()) {
    SCOPED_TRACE(c.name);
    Bench b(c.plan);
    // The oracle: the CPU kernel on plain tensors, unit by unit.
    double want_sumsq = 0;
    std::vector<at::Tensor> want_master, want_m, want_v, want_compute;
    for (size_t u = 0; u < 3; ++u) {
      at::Tensor p = b.master0[u].clone(), m = b.m0[u].clone(), v = b.v0[u].clone();
      at::Tensor out = at::empty({p.numel()}, at::kBFloat16);
      want_sumsq += kernels::sum_squares(b.grad0[u].data_ptr<float>(), kernels::DType::kF32, size_t(p.numel()));
      kernels::adam_step(ac, p.data_ptr<float>(), m.data_ptr<float>(), v.data_ptr<float>(), b.grad0[u].data_ptr<float>(),
                         kernels::DType::kF32, out.data_ptr(), kernels::DType::kBF16, size_t(p.numel()));
      want_master.push_back(p);
      want_m.push_back(m);
      want_v.push_back(v);
      want_compute.push_back(out);
    }
    const double sumsq = b.opt->local_sum_squares();
    EXPECT_NEAR(sumsq, want_sumsq, 1e-12 * want_sumsq) << "the same sums, chunk boundaries aside";
    const std::vector<size_t> on_device = b.opt->units_where(true), on_cpu = b.opt->units_where(false);
    EXPECT_EQ(on_device.size() + on_cpu.size(), 3u);
    std::vector<size_t> held, done;
    std::vector<double> per_unit(3, 0.0);
    b.opt->update_on_device(ac, on_device, &per_unit, [&](size_t u) { held.push_back(u); });
    EXPECT_EQ(held, on_device) << "before_write for every device unit";
    b.opt->update_on_cpu(ac, on_cpu, [&](size_t u) { done.push_back(u); }, &per_unit);
    EXPECT_EQ(done, on_cpu) << "units complete in pass order";
    for (size_t u = 0; u < 3; ++u) {
      SCOPED_TRACE("unit " + std::to_string(u));
      EXPECT_TRUE(at::equal(b.get(u, kMaster), want_master[u]));
      EXPECT_TRUE(at::equal(b.get(u, kExpAvg), want_m[u]));
      EXPECT_TRUE(at::equal(b.get(u, kExpAvgSq), want_v[u]));
      EXPECT_TRUE(at::equal(b.get(u, kCompute), want_compute[u]));
      const double unit_sumsq =
          kernels::sum_squares(b.grad0[u].data_ptr<float>(), kernels::DType::kF32, b.grad0[u].numel());
      EXPECT_NEAR(per_unit[u], unit_sumsq, 1e-12 * unit_sumsq);
    }
  }
}

TEST(Optimizer, TheCpuPassCallsBeforeUnitBeforeAnyWriteAndReportsConsumedGradients) {
  StatePlacement plan{Placement::kHost, Placement::kNvme, Placement::kNvme, Placement::kNvme};
  for (bool streamed : {false, true}) {
    SCOPED_TRACE(streamed ? "streamed" : "resident");
    Bench b(streamed ? plan : StatePlacement{Placement::kHost, Placement::kHost, Placement::kHost, Placement::kHost});
    std::vector<std::string> events;
    const std::vector<size_t> order{2, 0, 1};
    b.opt->update_on_cpu(
        adam(), order, [&](size_t u) { events.push_back("done " + std::to_string(u)); }, nullptr,
        [&](size_t u) {
          // Not written yet: its master weights are still the initial ones.
          events.push_back(std::string(at::equal(b.get(u, kMaster), b.master0[u]) ? "before " : "LATE ") + std::to_string(u));
        },
        [&](size_t u) { events.push_back("consumed " + std::to_string(u)); });
    std::vector<std::string> want;
    for (size_t u : order)
      for (const char* e : {"before ", "consumed ", "done "}) want.push_back(e + std::to_string(u));
    EXPECT_EQ(events, want);
  }
}

TEST(Optimizer, StoreComputeAndRefreshWriteTheCopyWhereverItLives) {
  for (const Case& c : cases()) {
    SCOPED_TRACE(c.name);
    Bench b(c.plan);
    at::manual_seed(8);
    std::vector<at::Tensor> master;
    for (size_t u = 0; u < 3; ++u) {
      master.push_back(at::randn({int64_t(b.partition.unit(u).shard_numel)}));
      b.put(u, kMaster, master[u]);
    }
    b.opt->refresh_compute_copies();
    for (size_t u = 0; u < 3; ++u) EXPECT_TRUE(at::equal(b.get(u, kCompute), master[u].to(at::kBFloat16))) << u;
    const at::Tensor values = at::randn({int64_t(b.partition.unit(1).shard_numel)}).to(at::kBFloat16);
    b.opt->store_compute(1, values);
    EXPECT_TRUE(at::equal(b.get(1, kCompute), values));
  }
}

}  // namespace
}  // namespace strata::engine::runtime
