// One conformance suite that every tier driver (engine/src/state/tier.h) passes: the device tier
// (on the host device), the host tier and the swap tier (a temporary swap directory). Then the
// state store on top of them: placement by a split plan, initial values in every tier, reads and
// writes through any tier, the chunk ring's view. Oracles: the values written, element by element.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <array>
#include <filesystem>
#include <fstream>
#include <functional>
#include <memory>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "profiler.h"
#include "state/host_memory.h"
#include "state/state_store.h"
#include "state/tier.h"
#include "strata/engine/device.h"
#include "strata/offload/file.h"
#include "strata/offload/io_engine.h"
#include "strata/offload/swap_space.h"
#include "state_fixture.h"

namespace strata::engine::state {
namespace {

// Everything one driver needs, built by name.
struct Bench {
  test::TempDir dir;
  std::unique_ptr<Device> device = Device::create_host(64 << 20);
  HostMemory host{*device};
  std::unique_ptr<offload::IoEngine> io;
  std::unique_ptr<offload::SwapSpace> swap;
  std::unique_ptr<TierDriver> driver;
  explicit Bench(const std::string& tier) {
    if (tier == "device") driver = device_tier(*device);
    if (tier == "host") driver = host_tier(host);
    if (tier == "swap") {
      io = offload::IoEngine::create({});
      offload::SwapConfig sc;
      sc.dirs = {dir.path()};
      swap = std::make_unique<offload::SwapSpace>(*io, sc);
      driver = nvme_tier(*swap);
    }
  }
};

at::Tensor host_tensor(uint64_t numel, at::ScalarType t) { return HostMemory::unpinned(numel, t); }

at::Tensor random(uint64_t numel, at::ScalarType t) { return at::randn({int64_t(numel)}).to(t); }

at::Tensor read_all(TierDriver& d, TierDriver::Region r) {
  at::Tensor out = host_tensor(d.numel(r), d.dtype(r));
  d.read(r, 0, out).get();
  return out;
}

class TierConformance : public ::testing::TestWithParam<std::string> {};

TEST_P(TierConformance, AllocatesRegionsOfTheirSizeDtypeAndNameAndCountsTheirBytes) {
  Bench b(GetParam());
  TierDriver& d = *b.driver;
  EXPECT_EQ(d.tier(), GetParam() == "device" ? Placement::kDevice : GetParam() == "host" ? Placement::kHost : Placement::kNvme);
  const auto r0 = d.allocate("block.0.master", 4099, at::kFloat);
  const auto r1 = d.allocate("block.0.compute", 12289, at::kBFloat16);
  const auto r2 = d.allocate("head.exp_avg", 1, at::kFloat);
  EXPECT_EQ(r0, 0u);
  EXPECT_EQ(r1, 1u);
  EXPECT_EQ(r2, 2u);
  EXPECT_EQ(d.regions(), 3u);
  EXPECT_EQ(d.numel(r1), 12289u);
  EXPECT_EQ(d.dtype(r1), at::kBFloat16);
  EXPECT_EQ(d.name(r0), "block.0.master");
  EXPECT_EQ(d.bytes(), 4099u * 4 + 12289u * 2 + 4);
  if (GetParam() == "device") {
    EXPECT_EQ(b.device->used(), d.bytes()) << "device regions count against the budget";
  } else if (GetParam() == "host") {
    EXPECT_EQ(b.host.state_bytes(), d.bytes()) << "host regions are HostMemory state";
  } else {
    EXPECT_TRUE(b.swap->contains("block.0.compute")) << "a swap region is the partition of its name";
  }
}

TEST_P(TierConformance, ReadsBackWhatWasWrittenAtAwkwardOffsetsAndLengths) {
  Bench b(GetParam());
  TierDriver& d = *b.driver;
  at::manual_seed(3);
  for (at::ScalarType t : {at::kFloat, at::kBFloat16}) {
    const uint64_t n = 3 * 4096 + 1031;
    const auto r = d.allocate("r" + std::to_string(int(t)), n, t);
    at::Tensor want = random(n, t);
    at::Tensor src = host_tensor(n, t);
    src.copy_(want);
    d.write(r, 0, src).get();
    EXPECT_TRUE(at::equal(read_all(d, r), want)) << GetParam() << " whole region, dtype " << t;
    // Pieces: aligned and not, one element, up to the last element.
    for (auto [begin, len] : std::vector<std::pair<uint64_t, uint64_t>>{
             {0, 1}, {1, 4095}, {4095, 2}, {4096, 4096}, {5000, 3001}, {n - 1, 1}, {n - 777, 777}, {0, n}}) {
      at::Tensor piece = host_tensor(len, t);
      d.read(r, begin, piece).get();
      EXPECT_TRUE(at::equal(piece, want.narrow(0, int64_t(begin), int64_t(len)))) << "read " << begin << "+" << len;
    }
    // A partial write changes exactly its elements.
    at::Tensor patch = host_tensor(2049, t);
    patch.copy_(random(2049, t));
    d.write(r, 4093, patch).get();
    want.narrow(0, 4093, 2049).copy_(patch);
    EXPECT_TRUE(at::equal(read_all(d, r), want)) << GetParam() << " after a partial write";
  }
}

TEST_P(TierConformance, CopiesToAFileExactlyWhereTheTierCanElseRefusesBeforeAnythingMoves) {
  Bench b(GetParam());
  TierDriver& d = *b.driver;
  at::manual_seed(5);
  const uint64_t n = 2 * 4096 + 517;
  const auto r = d.allocate("block.3.exp_avg", n, at::kFloat);
  at::Tensor want = random(n, at::kFloat);
  at::Tensor src = host_tensor(n, at::kFloat);
  src.copy_(want);
  d.write(r, 0, src).get();
  const std::filesystem::path out = std::filesystem::path(b.dir.path()) / "sink.data";
  offload::File file = offload::File::open(out, offload::OpenMode::kTruncate);
  EXPECT_EQ(d.copies_to_file(), GetParam() == "swap") << "only the swap tier lives in files";
  if (!d.copies_to_file()) {
    EXPECT_THROW(d.copy_to_file(r, 0, n, file, 0), std::logic_error);
    EXPECT_EQ(std::filesystem::file_size(out), 0u) << "a refused copy writes nothing";
    return;
  }
  // Pieces at awkward source ranges into awkward file offsets, then read the file back.
  const std::vector<std::array<uint64_t, 3>> pieces = {{0, 1, 0}, {1, 4095, 4}, {4096, 4097, 16384}, {n - 3, 3, 40000}};
  for (auto [begin, len, offset] : pieces) d.copy_to_file(r, begin, len, file, offset);
  file.sync();
  std::ifstream in(out, std::ios::binary);
  for (auto [begin, len, offset] : pieces) {
    std::vector<float> got(len);
    in.seekg(std::streamoff(offset));
    in.read(reinterpret_cast<char*>(got.data()), std::streamsize(len * 4));
    ASSERT_TRUE(in.good()) << "piece at " << offset;
    at::Tensor g = at::from_blob(got.data(), {int64_t(len)}, at::kFloat);
    EXPECT_TRUE(at::equal(g, want.narrow(0, int64_t(begin), int64_t(len)))) << "elements " << begin << "+" << len;
  }
  EXPECT_THROW(d.copy_to_file(r, n - 2, 3, file, 0), std::out_of_range);
  EXPECT_THROW(d.copy_to_file(r + 1, 0, 1, file, 0), std::out_of_range);
}

TEST_P(TierConformance, RegionsAreIndependentAndLocateShowsResidentContents) {
  Bench b(GetParam());
  TierDriver& d = *b.driver;
  at::manual_seed(5);
  const auto r0 = d.allocate("a", 5000, at::kFloat);
  const auto r1 = d.allocate("b", 7, at::kFloat);
  at::Tensor a = host_tensor(5000, at::kFloat), c = host_tensor(7, at::kFloat);
  a.copy_(random(5000, at::kFloat));
  c.copy_(random(7, at::kFloat));
  d.write(r0, 0, a).get();
  d.write(r1, 0, c).get();
  at::Tensor c2 = host_tensor(7, at::kFloat);
  c2.copy_(random(7, at::kFloat));
  d.write(r1, 0, c2).get();
  EXPECT_TRUE(at::equal(read_all(d, r0), a)) << "writing one region left the other alone";
  EXPECT_TRUE(at::equal(read_all(d, r1), c2));
  const at::Tensor where = d.locate(r0);
  if (GetParam() == "swap") {
    EXPECT_FALSE(where.defined()) << "swap regions are reached through read and write only";
  } else {
    ASSERT_TRUE(where.defined());
    EXPECT_EQ(where.numel(), 5000);
    EXPECT_TRUE(at::equal(where.to(at::kCPU), a));
    where.narrow(0, 10, 1).fill_(42.0f);  // written in place: read sees it
    EXPECT_EQ(read_all(d, r0)[10].item<float>(), 42.0f);
  }
}

TEST_P(TierConformance, RejectsOutOfRangeAndMismatchedTransfersBeforeAnythingMoves) {
  Bench b(GetParam());
  TierDriver& d = *b.driver;
  const auto r = d.allocate("unit.master", 100, at::kFloat);
  at::Tensor before = host_tensor(100, at::kFloat);
  before.copy_(at::arange(100, at::kFloat));
  d.write(r, 0, before).get();
  at::Tensor ten = host_tensor(10, at::kFloat);
  ten.fill_(-1);
  EXPECT_THROW(d.write(r, 91, ten), std::out_of_range);
  EXPECT_THROW(d.read(r, 101, host_tensor(0, at::kFloat)), std::out_of_range);
  EXPECT_THROW(d.read(r + 1, 0, ten), std::out_of_range) << "no such region";
  EXPECT_THROW(d.write(r, 0, host_tensor(10, at::kBFloat16)), std::invalid_argument) << "wrong dtype";
  EXPECT_THROW(d.write(r, 0, before.narrow(0, 0, 20).view({10, 2}).t()), std::invalid_argument) << "not contiguous";
  try {
    d.write(r, 95, ten);
    FAIL();
  } catch (const std::out_of_range& e) {
    EXPECT_NE(std::string(e.what()).find("unit.master"), std::string::npos) << "names the region: " << e.what();
  }
  EXPECT_TRUE(at::equal(read_all(d, r), before)) << "a rejected write changed nothing";
  d.read(r, 100, host_tensor(0, at::kFloat)).get();  // an empty range at the end is fine
}

TEST_P(TierConformance, TransfersFromSeveralThreadsToDistinctRegions) {
  Bench b(GetParam());
  TierDriver& d = *b.driver;
  constexpr int kThreads = 4;
  std::vector<TierDriver::Region> regions;
  std::vector<at::Tensor> want;
  at::manual_seed(7);
  for (int i = 0; i < kThreads; ++i) {
    regions.push_back(d.allocate("t" + std::to_string(i), 4096 * (i + 1) + 3, at::kFloat));
    want.push_back(host_tensor(d.numel(regions.back()), at::kFloat));
    want.back().copy_(random(d.numel(regions.back()), at::kFloat));
  }
  std::vector<std::thread> threads;
  std::vector<int> ok(kThreads, 0);
  for (int i = 0; i < kThreads; ++i)
    threads.emplace_back([&, i] {
      for (int round = 0; round < 5; ++round) {
        d.write(regions[size_t(i)], 0, want[size_t(i)]).get();
        at::Tensor got = host_tensor(d.numel(regions[size_t(i)]), at::kFloat);
        d.read(regions[size_t(i)], 0, got).get();
        if (!at::equal(got, want[size_t(i)])) return;
      }
      ok[size_t(i)] = 1;
    });
  for (auto& t : threads) t.join();
  for (int i = 0; i < kThreads; ++i) EXPECT_EQ(ok[size_t(i)], 1) << "thread " << i;
}

INSTANTIATE_TEST_SUITE_P(AllTiers, TierConformance, ::testing::Values("device", "host", "swap"),
                         [](const auto& info) { return info.param; });

TEST(DeviceTier, AnAllocationOverTheBudgetThrowsBudgetExceededNamingTheRegion) {
  auto device = Device::create_host(1000);
  auto d = device_tier(*device);
  d->allocate("small", 200, at::kFloat);
  try {
    d->allocate("embedding.exp_avg", 100, at::kFloat);
    FAIL() << "800 + 400 bytes fit a budget of 1000";
  } catch (const BudgetExceeded& e) {
    EXPECT_NE(std::string(e.what()).find("embedding.exp_avg"), std::string::npos) << e.what();
  }
  EXPECT_EQ(d->regions(), 1u) << "a failed allocation leaves no region";
}

// --- the state store -------------------------------------------------------------------------

// Three units of awkward sizes over two ranks, unaligned shards (one longer than a 16 KiB chunk
// of the ring below).
struct StoreBench : test::StateFixture {
  explicit StoreBench(const StatePlacement& plan)
      : StateFixture(Partition({{"embedding", {{"embed.w", {37, 11}}}}, {"block.0", {{"a", {9001}}, {"b", {3, 7}}}},
                                {"head", {{"head.w", {5}}}}},
                               2, /*align_numel=*/1),
                     plan) {}
  at::Tensor initial(size_t u) const {
    return at::arange(int64_t(partition.unit(u).shard_numel), at::kFloat).mul_(0.001).add_(double(u));
  }
  at::Tensor read(size_t u, int k) { return get(u, k); }
};

TEST(StateStore, PlacesEachKindByTheSplitPlanAndInitializesItInEveryTier) {
  // Master and moments in swap except the first unit (device) and the second (host RAM); the
  // compute copy on the device; gradients in swap.
  StatePlacement plan{Placement::kDevice, Placement::kNvme, Placement::kNvme, Placement::kNvme};
  plan.device_units = 1;
  plan.host_units = 2;
  StoreBench b(plan);
  StateStore& s = *b.store;
  EXPECT_EQ(s.placement(0, kMaster), Placement::kDevice);
  EXPECT_EQ(s.placement(1, kExpAvg), Placement::kHost);
  EXPECT_EQ(s.placement(2, kExpAvgSq), Placement::kNvme);
  EXPECT_EQ(s.placement(2, kCompute), Placement::kDevice) << "the compute copy is not in the split group";
  EXPECT_EQ(s.placement(1, kGrad), Placement::kHost);
  for (size_t u = 0; u < 3; ++u) s.allocate(u, b.initial(u), /*transient_grads=*/false);
  for (size_t u = 0; u < 3; ++u) {
    EXPECT_TRUE(at::equal(b.read(u, kMaster), b.initial(u))) << "unit " << u;
    EXPECT_TRUE(at::equal(b.read(u, kCompute), b.initial(u).to(at::kBFloat16))) << "unit " << u;
    EXPECT_EQ(b.read(u, kExpAvg).abs().max().item<float>(), 0.0f) << "unit " << u;
    EXPECT_EQ(b.read(u, kExpAvgSq).abs().max().item<float>(), 0.0f) << "unit " << u;
    EXPECT_EQ(s.tensor(u, kMaster).defined(), u < 2) << "resident tensors exactly where not in swap";
    EXPECT_EQ(s.on_nvme(u, kMaster), u == 2);
    EXPECT_TRUE(s.streamed(u, kCompute)) << "a device compute copy passes through a host buffer";
    EXPECT_EQ(s.streamed(u, kMaster), u == 2);
  }
  EXPECT_TRUE(b.swap->contains("head.exp_avg"));
  EXPECT_TRUE(b.swap->contains("head.grad"));
  EXPECT_TRUE(s.copies_to_file(2, kExpAvg)) << "a swap-placed kind copies file to file";
  EXPECT_FALSE(s.copies_to_file(1, kExpAvg)) << "a host-placed one does not";
  EXPECT_FALSE(s.copies_to_file(0, kMaster)) << "nor a device-placed one";
  // Swap: master, moments and the gradient of the head; its shard of 5 over 2 ranks.
  EXPECT_EQ(s.nvme_bytes(), 4 * b.partition.unit(2).shard_numel * 4);
  EXPECT_EQ(b.host.state_bytes(), 4 * b.partition.unit(1).shard_numel * 4);
  EXPECT_EQ(b.device->used(), 4 * b.partition.unit(0).shard_numel * 4 +
                                  2 * (b.partition.unit(0).shard_numel + b.partition.unit(1).shard_numel +
                                       b.partition.unit(2).shard_numel));
}

TEST(StateStore, ReadsAndWritesAnyTierCountSwapTrafficAndServeTheChunkRing) {
  StatePlacement plan{Placement::kHost, Placement::kHost, Placement::kNvme, Placement::kNvme};
  plan.host_units = 1;
  StoreBench b(plan);
  StateStore& s = *b.store;
  for (size_t u = 0; u < 3; ++u) s.allocate(u, b.initial(u), false);
  const uint64_t read0 = b.prof.nvme_read.load(), write0 = b.prof.nvme_write.load();
  const uint64_t n = b.partition.unit(1).shard_numel;
  at::Tensor m = HostMemory::unpinned(n, at::kFloat);
  m.copy_(at::randn({int64_t(n)}));
  s.write(1, kExpAvg, 0, m).get();  // swap (unit 1 is beyond host_units)
  EXPECT_TRUE(at::equal(b.read(1, kExpAvg), m));
  EXPECT_EQ(b.prof.nvme_write.load() - write0, n * 4);
  EXPECT_EQ(b.prof.nvme_read.load() - read0, n * 4);
  at::Tensor g = HostMemory::unpinned(n - 3, at::kFloat);
  g.copy_(at::randn({int64_t(n - 3)}));
  s.write(1, kGrad, 3, g).get();  // host
  EXPECT_TRUE(at::equal(s.tensor(1, kGrad).narrow(0, 3, int64_t(n - 3)), g));
  EXPECT_EQ(b.prof.nvme_write.load() - write0, n * 4) << "host traffic is not swap traffic";
  // The chunk ring's view: resident pointers into host tensors, none for swap.
  EXPECT_EQ(s.resident(0, kMaster, 2), static_cast<char*>(s.tensor(0, kMaster).data_ptr()) + 8);
  EXPECT_EQ(s.resident(1, kMaster, 0), nullptr);
  // A pass of the ring over the store: master += 1 everywhere, compute := master.
  ChunkRing ring(s, b.host, 16 << 10);
  ring.run((1u << kMaster), (1u << kMaster) | (1u << kCompute), {0, 1, 2},
           [](const ChunkRing::Chunk& c, const ChunkRing::Pointers& p) {
             at::Tensor master = at::from_blob(p[kMaster], {int64_t(c.numel)}, at::kFloat);
             master.add_(1.0);
             at::from_blob(p[kCompute], {int64_t(c.numel)}, at::kBFloat16).copy_(master);
           });
  for (size_t u = 0; u < 3; ++u) {
    EXPECT_TRUE(at::equal(b.read(u, kMaster), b.initial(u) + 1)) << "unit " << u;
    EXPECT_TRUE(at::equal(b.read(u, kCompute), (b.initial(u) + 1).to(at::kBFloat16))) << "unit " << u;
  }
}

TEST(StateStore, TransientGradientsAreNotAllocatedOffTheDevice) {
  StatePlacement plan{Placement::kHost, Placement::kHost, Placement::kHost, Placement::kHost};
  plan.device_units = 1;
  plan.grads_transient = true;
  StoreBench b(plan);
  for (size_t u = 0; u < 3; ++u) b.store->allocate(u, b.initial(u), /*transient_grads=*/true);
  EXPECT_TRUE(b.store->tensor(0, kGrad).defined()) << "the device share keeps its accumulator";
  EXPECT_FALSE(b.store->tensor(1, kGrad).defined());
  EXPECT_THROW(b.store->write(1, kGrad, 0, HostMemory::unpinned(4, at::kFloat)), std::logic_error)
      << "a transient gradient has no storage of its own to write";
  EXPECT_FALSE(b.store->tensor(2, kGrad).defined());
  // Master and moments of units 1 and 2; every unit's compute copy (bf16, placed on the host).
  EXPECT_EQ(b.host.state_bytes(), (b.partition.unit(1).shard_numel + b.partition.unit(2).shard_numel) * 4 * 3 +
                                      (b.partition.unit(0).shard_numel + b.partition.unit(1).shard_numel +
                                       b.partition.unit(2).shard_numel) * 2);
}

}  // namespace
}  // namespace strata::engine::state
