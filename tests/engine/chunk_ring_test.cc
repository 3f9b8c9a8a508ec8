// The optimizer's chunk ring on its own, against a temporary swap directory: units of awkward
// sizes, some kinds in swap, some resident, one streamed to a non-swap home (a device compute
// copy's path), results checked element by element against the same arithmetic done directly.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <cerrno>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "state/chunk_ring.h"
#include "strata/engine/device.h"
#include "strata/offload/fault_injection.h"
#include "strata/offload/io_engine.h"
#include "strata/offload/io_status.h"
#include "strata/offload/swap_space.h"
#include "test_util.h"

namespace strata::engine::state {
namespace {

constexpr int kA = 0, kB = 1, kOut = 4;  // two fp32 kinds and a bf16 output kind

std::span<std::byte> bytes_of(const at::Tensor& t) { return {static_cast<std::byte*>(t.data_ptr()), size_t(t.nbytes())}; }

// Kind kA lives in swap for even units and resident for odd ones; kB is resident everywhere;
// kOut is in swap for unit 0, streamed to a resident tensor (store) for the others.
struct TestSource final : ChunkRing::Source {
  offload::SwapSpace& swap;
  std::vector<uint64_t> numel;
  std::vector<at::Tensor> a, b, out;  // resident tensors (a: odd units only; out: units > 0)
  TestSource(offload::SwapSpace& s, std::vector<uint64_t> n) : swap(s), numel(std::move(n)) {}
  std::string name(size_t u, int k) const { return std::to_string(u) + "." + std::to_string(k); }
  uint64_t shard_numel(size_t u) const override { return numel.at(u); }
  at::ScalarType dtype(int k) const override { return k == kOut ? at::kBFloat16 : at::kFloat; }
  bool on_nvme(size_t u, int k) const override { return (k == kA && u % 2 == 0) || (k == kOut && u == 0); }
  bool streamed(size_t u, int k) const override { return on_nvme(u, k) || k == kOut; }
  void* resident(size_t u, int k, uint64_t begin) override {
    const at::Tensor& t = k == kA ? a.at(u) : k == kB ? b.at(u) : out.at(u);
    return t.defined() ? static_cast<char*>(t.data_ptr()) + begin * t.element_size() : nullptr;
  }
  offload::IoFuture read(size_t u, int k, uint64_t begin, const at::Tensor& dst) override {
    return swap.read(name(u, k), begin * dst.element_size(), bytes_of(dst));
  }
  offload::IoFuture write(size_t u, int k, uint64_t begin, const at::Tensor& src) override {
    return swap.write(name(u, k), begin * src.element_size(), bytes_of(src));
  }
  void store(size_t u, int k, uint64_t begin, const at::Tensor& src) override {
    ASSERT_EQ(k, kOut);
    out.at(u).narrow(0, int64_t(begin), src.numel()).copy_(src);
  }
};

struct Fixture {
  test::TempDir dir;
  std::unique_ptr<offload::IoEngine> io;
  std::unique_ptr<offload::SwapSpace> swap;
  std::unique_ptr<TestSource> src;
  std::vector<at::Tensor> a0, b0;  // initial values by unit
  explicit Fixture(std::vector<uint64_t> numel, std::shared_ptr<offload::FaultInjector> faults = nullptr) {
    offload::IoEngineConfig ic;
    ic.fault_injector = std::move(faults);
    io = offload::IoEngine::create(ic);
    offload::SwapConfig sc;
    sc.dirs = {dir.path()};
    swap = std::make_unique<offload::SwapSpace>(*io, sc);
    src = std::make_unique<TestSource>(*swap, numel);
    at::manual_seed(11);
    for (size_t u = 0; u < numel.size(); ++u) {
      const int64_t n = int64_t(numel[u]);
      a0.push_back(at::randn({n}));
      b0.push_back(at::randn({n}));
      src->b.push_back(b0[u].clone());
      if (src->on_nvme(u, kA)) {
        swap->allocate(src->name(u, kA), numel[u] * 4);
        at::Tensor init = HostMemory::unpinned(numel[u], at::kFloat);
        init.copy_(a0[u]);
        src->write(u, kA, 0, init).get();
        src->a.emplace_back();
      } else {
        src->a.push_back(a0[u].clone());
      }
      if (src->on_nvme(u, kOut)) {
        swap->allocate(src->name(u, kOut), numel[u] * 2);
        src->out.emplace_back();
      } else {
        src->out.push_back(at::zeros({n}, at::kBFloat16));
      }
    }
  }
  at::Tensor read_back(size_t u, int k) {
    at::Tensor t = HostMemory::unpinned(src->numel[u], src->dtype(k));
    src->read(u, k, 0, t).get();
    return t;
  }
};

TEST(ChunkRing, UpdatesSwapAndResidentStateChunkByChunkInThePassOrder) {
  // 16 KiB chunks are 4096 fp32 elements: units of 3 chunks and a ragged end, one element, and
  // one exact chunk.
  Fixture f({3 * 4096 + 17, 1, 4096, 9000});
  const auto device = Device::create_host(UINT64_MAX);  // outlives the host memory
  HostMemory host(*device);
  ChunkRing ring(*f.src, host, 16 << 10);
  ASSERT_EQ(ring.chunk_numel(), 4096u);
  const std::vector<size_t> order{2, 0, 3, 1};
  std::vector<std::string> events;
  std::vector<uint64_t> seen(4, 0);
  ring.run((1u << kA) | (1u << kB), (1u << kA) | (1u << kOut), order,
           [&](const ChunkRing::Chunk& c, const ChunkRing::Pointers& p) {
             ASSERT_NE(p[kA], nullptr);
             ASSERT_NE(p[kB], nullptr);
             ASSERT_NE(p[kOut], nullptr);
             EXPECT_EQ(c.begin, seen[c.unit]) << "chunks of a unit in order, none skipped";
             seen[c.unit] += c.numel;
             at::Tensor a = at::from_blob(p[kA], {int64_t(c.numel)}, at::kFloat);
             at::Tensor b = at::from_blob(p[kB], {int64_t(c.numel)}, at::kFloat);
             a.add_(b);
             at::from_blob(p[kOut], {int64_t(c.numel)}, at::kBFloat16).copy_(a * 2);
             events.push_back("chunk " + std::to_string(c.unit));
           },
           [&](size_t u) { events.push_back("done " + std::to_string(u)); },
           [&](size_t u) { events.push_back("before " + std::to_string(u)); });
  for (size_t u = 0; u < 4; ++u) EXPECT_EQ(seen[u], f.src->numel[u]) << "unit " << u;
  // before u, its chunks, done u; unit after unit in the pass order.
  std::vector<std::string> want;
  for (size_t u : order) {
    want.push_back("before " + std::to_string(u));
    for (uint64_t b = 0; b < f.src->numel[u]; b += 4096) want.push_back("chunk " + std::to_string(u));
    want.push_back("done " + std::to_string(u));
  }
  EXPECT_EQ(events, want);
  for (size_t u = 0; u < 4; ++u) {
    const at::Tensor a_want = f.a0[u] + f.b0[u];
    const at::Tensor a_got = f.src->on_nvme(u, kA) ? f.read_back(u, kA) : f.src->a[u];
    EXPECT_TRUE(at::equal(a_got, a_want)) << "unit " << u;
    const at::Tensor out_got = f.src->on_nvme(u, kOut) ? f.read_back(u, kOut) : f.src->out[u];
    EXPECT_TRUE(at::equal(out_got, (a_want * 2).to(at::kBFloat16))) << "unit " << u;
    EXPECT_TRUE(at::equal(f.src->b[u], f.b0[u])) << "an input-only kind is not written";
  }
}

TEST(ChunkRing, AFailedSwapReadFailsThePassNamingTheFileAndLosesNoBuffer) {
  auto faults = std::make_shared<offload::RuleFaultInjector>();
  offload::RuleFaultInjector::Rule rule;
  rule.kind = offload::IoRequest::Kind::kRead;
  rule.error = EIO;
  rule.offset_begin = 4096 * 4;  // the second chunk of unit 0
  rule.offset_end = 4096 * 4 + 1;
  faults->add(rule);
  Fixture f({3 * 4096, 8}, faults);
  const auto device = Device::create_host(UINT64_MAX);  // outlives the host memory
  HostMemory host(*device);
  ChunkRing ring(*f.src, host, 16 << 10);
  size_t chunks = 0;
  try {
    ring.run(1u << kA, 1u << kA, {0, 1}, [&](const ChunkRing::Chunk&, const ChunkRing::Pointers&) { ++chunks; });
    FAIL() << "the injected read error was not reported";
  } catch (const offload::IoError& e) {
    EXPECT_NE(std::string(e.what()).find("strata-swap"), std::string::npos) << e.what();
  }
  EXPECT_EQ(chunks, 1u) << "the chunk whose read failed was not processed";
}

}  // namespace
}  // namespace strata::engine::state
