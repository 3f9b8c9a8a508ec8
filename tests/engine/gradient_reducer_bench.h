// What the gradient reducer tests share (gradient_reducer_accumulate_test.cc,
// gradient_reducer_swap_writes_test.cc): the Bench, a reducer on the host device with a state
// store, swap writes a test can hold or fail, and a two-rank communicator simulated in process.
//
// The oracle is computed here from the gradients the test gave: each unit's flat gradient is its
// tensors' gradients back to back in the unit's order (zeros for a tensor without one), padded
// with zeros to two shards; the simulated peer's contribution to our shard is a known function of
// what we send; contributions are added in fp32 in the order they were made. The reducer does
// the same fp32 (or bf16, then fp32) additions in the same order, so every comparison is bitwise.
#pragma once

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <chrono>
#include <condition_variable>
#include <functional>
#include <future>
#include <limits>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "runtime/gradient_reducer.h"
#include "profiler.h"
#include "state/host_memory.h"
#include "state/state_store.h"
#include "strata/engine/comm.h"
#include "strata/engine/device.h"
#include "strata/offload/fault_injection.h"
#include "strata/offload/io_engine.h"
#include "strata/offload/swap_space.h"
#include "test_util.h"

namespace strata::engine::runtime::reducer_testing {

using namespace std::chrono_literals;
using state::kGrad;

// What the peer (rank 1) contributes to our shard (rank 0's slice) given what we send: twice our
// rank-1 slice, plus one (so that a unit without local gradients still gets something). In the
// dtype sent, by the same ATen ops the oracle uses.
inline at::Tensor peer_contribution(const at::Tensor& ours_rank1_slice) { return ours_rank1_slice.mul(2).add(1); }

// Rank 0 of two. reduce_scatter: out = in[0, n) + peer_contribution(in[n, 2n)); every call is
// recorded (elements sent, dtype).
class PeerComm final : public Communicator {
 public:
  PeerComm() : Communicator(0, 2) {}
  struct Done final : Work {
    void wait() override {}
  };
  struct Call {
    int64_t numel;
    at::ScalarType dtype;
  };
  std::vector<Call> calls;

  std::unique_ptr<Work> all_to_all(const at::Tensor&, const std::vector<int64_t>&, const at::Tensor&,
                                   const std::vector<int64_t>&) override {
    throw std::logic_error("unused");
  }
  std::unique_ptr<Work> reduce_scatter(const at::Tensor& out, const at::Tensor& in) override {
    if (in.numel() != 2 * out.numel() || in.scalar_type() != out.scalar_type() || !in.is_contiguous() ||
        !out.is_contiguous())
      throw std::invalid_argument("reduce_scatter: mismatched tensors");
    const int64_t n = out.numel();
    calls.push_back({in.numel(), in.scalar_type()});
    out.copy_(in.narrow(0, 0, n).add(peer_contribution(in.narrow(0, n, n))));
    return std::make_unique<Done>();
  }
  std::unique_ptr<Work> all_gather(const at::Tensor&, const at::Tensor&) override { throw std::logic_error("unused"); }
  void all_reduce(const at::Tensor&, ReduceOp) override { throw std::logic_error("unused"); }
  void broadcast(const at::Tensor&, int) override { throw std::logic_error("unused"); }
  void barrier() override {}
};

// Swap writes as a test wants them: those overlapping a failing range complete with EIO; the
// others, while held, complete only once released (the write itself has run: only its
// completion waits, and the I/O engine thread that reports it). Reads pass.
class WriteGate final : public offload::FaultInjector {
 public:
  int64_t on_complete(const offload::IoOpView& op, int64_t result) override {
    if (op.kind != offload::IoRequest::Kind::kWrite) return result;
    std::unique_lock<std::mutex> lock(mu_);
    for (const auto& [b, e] : failing_)
      if (op.offset < e && op.offset + op.length > b) return -EIO;
    cv_.wait(lock, [&] { return !held_; });
    return result;
  }
  void hold() {
    std::lock_guard<std::mutex> lock(mu_);
    held_ = true;
  }
  void release() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      held_ = false;
    }
    cv_.notify_all();
  }
  void fail(uint64_t begin, uint64_t end) {
    std::lock_guard<std::mutex> lock(mu_);
    failing_.push_back({begin, end});
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  bool held_ = false;
  std::vector<std::pair<uint64_t, uint64_t>> failing_;
};

// Embedding, two blocks and a head tied to the embedding; every unit's element count is odd, so
// each unit's last shard ends in padding (align 1: shards of 1054, 525, 389 and 5 elements).
inline const std::vector<std::pair<std::string, std::vector<TensorSpec>>> kUnits = {
    {"embedding", {{"e", {301, 7}}}},
    {"block.0", {{"b0.a", {1001}}, {"b0.b", {16, 3}}}},
    {"block.1", {{"b1", {777}}}},
    {"head", {{"h.a", {3, 3}}}}};
inline constexpr size_t kHead = 3;
inline constexpr size_t kBackward[] = {3, 2, 1, 0};  // stages in backward order

inline StatePlacement grads_in(Placement p) {
  return StatePlacement{Placement::kHost, p, Placement::kHost, Placement::kHost};
}

// Runs `fn` on a thread of its own; true if it returned within `limit` (otherwise it is left to
// finish once the test releases what it waits for, and joined then).
struct Background {
  std::future<void> done;
  explicit Background(std::function<void()> fn) : done(std::async(std::launch::async, std::move(fn))) {}
  bool finished_within(std::chrono::milliseconds limit) { return done.wait_for(limit) == std::future_status::ready; }
};

struct Bench {
  test::TempDir dir;
  std::shared_ptr<WriteGate> gate = std::make_shared<WriteGate>();
  std::unique_ptr<Device> device;
  state::HostMemory host;
  std::unique_ptr<offload::IoEngine> io;
  std::unique_ptr<offload::SwapSpace> swap;
  Profiler prof;
  PeerComm comm;
  Partition partition{kUnits, 2, /*align_numel=*/1};
  layout::Schedule schedule{{{0}, {1}, {2}, {3, 0}}, 4};
  const StatePlacement plan;
  const bool bf16;
  std::unique_ptr<state::StateStore> store;
  std::vector<std::vector<at::Tensor>> params;  // unit u's tensors, in the unit's order
  std::vector<at::Tensor> want;                 // the step's accumulated contributions so far, by unit
  std::unique_ptr<GradientReducer> reducer;     // last: goes first

  // `backend`: the tests that hold writes use the thread pool, whose completions do not queue
  // behind a held one (io_uring's are reaped by one thread: a read would wait behind a held write).
  Bench(const StatePlacement& p, bool reduce_bf16 = false, offload::IoBackend backend = offload::IoBackend::kAuto)
      : device(Device::create_host(UINT64_MAX)), host(*device), plan(p), bf16(reduce_bf16), want(4) {
    offload::IoEngineConfig ic;
    ic.backend = backend;
    ic.fault_injector = gate;
    io = offload::IoEngine::create(ic);
    offload::SwapConfig sc;
    sc.dirs = {dir.path()};
    swap = std::make_unique<offload::SwapSpace>(*io, sc);
    store = std::make_unique<state::StateStore>(partition, at::kBFloat16, plan, *device, host, swap.get(), prof);
    at::manual_seed(7);
    std::vector<std::vector<GradientReducer::ParamRef>> stage_params(4);
    for (size_t u = 0; u < 4; ++u) {
      const int64_t n = int64_t(partition.unit(u).shard_numel);
      store->allocate(u, at::randn({n}), plan.grads_transient);
      std::vector<at::Tensor> ts;
      for (const TensorSpec& s : kUnits[u].second) ts.push_back(at::zeros(s.shape).requires_grad_(true));
      params.push_back(ts);
    }
    for (size_t s = 0; s < 4; ++s)
      for (size_t u : schedule.units_of(s))
        for (size_t i = 0; i < params[u].size(); ++i) stage_params[s].push_back({params[u][i], u, i});
    // Transient gradients: a pool of a buffer per unit (no update gives one back here).
    uint64_t largest = 0;
    for (const UnitLayout& L : partition.units()) largest = std::max(largest, L.shard_numel);
    reducer = std::make_unique<GradientReducer>(schedule, partition, *store, host, *device, comm, prof, bf16,
                                                std::move(stage_params), plan.grads_transient ? 4 : 0, largest);
  }
  ~Bench() { gate->release(); }  // a test that failed holding writes must not hang the reducer's end

  Placement where(size_t u) const { return store->placement(u, kGrad); }
  int64_t shard(size_t u) const { return int64_t(partition.unit(u).shard_numel); }

  // Unit u's accumulator now (after the d2h stream and the swap writes are done).
  at::Tensor accumulator(size_t u) {
    if (where(u) != Placement::kNvme) return store->tensor(u, kGrad).clone();
    at::Tensor out = state::HostMemory::unpinned(uint64_t(shard(u)), at::kFloat);
    store->read(u, kGrad, 0, out).get();
    return out;
  }
  // Garbage (NaN) in every host or swap accumulator: a first contribution must not read it.
  void poison() {
    for (size_t u = 0; u < 4; ++u) {
      const at::Tensor nan = state::HostMemory::unpinned(uint64_t(shard(u)), at::kFloat).fill_(std::nan(""));
      if (where(u) == Placement::kHost) store->tensor(u, kGrad).copy_(nan);
      if (where(u) == Placement::kNvme) store->write(u, kGrad, 0, nan).get();
    }
  }

  // The oracle: the shard rank 0 receives for unit u when its tensors' gradients are `grads`.
  at::Tensor reduced(size_t u, const std::vector<at::Tensor>& grads) const {
    std::vector<at::Tensor> parts;
    int64_t numel = 0;
    for (size_t i = 0; i < grads.size(); ++i) {
      parts.push_back(grads[i].defined() ? grads[i].reshape(-1) : at::zeros({params[u][i].numel()}));
      numel += params[u][i].numel();
    }
    const int64_t n = (numel + 1) / 2;  // two ranks, no alignment
    EXPECT_EQ(n, shard(u));
    parts.push_back(at::zeros({2 * n - numel}));
    at::Tensor flat = at::cat(parts);
    if (bf16) flat = flat.to(at::kBFloat16);  // rounded to nearest even, as a copy into bf16 does
    return flat.narrow(0, 0, n).add(peer_contribution(flat.narrow(0, n, n))).to(at::kFloat);
  }

  // Stage s's backward: every tensor of every unit it uses gets a fresh random gradient unless
  // `skip(u, i)`; the stage is reduced and each unit's contribution added to `want` (fp32, in
  // order). Checks that every unit of the stage was reduce-scattered once, in the right dtype,
  // and that the gradients were taken (the next backward must not accumulate onto them).
  void reduce(size_t s, const std::function<bool(size_t, size_t)>& skip = {}) {
    std::map<size_t, std::vector<at::Tensor>> given;
    for (size_t u : schedule.units_of(s)) {
      for (size_t i = 0; i < params[u].size(); ++i) {
        at::Tensor g;
        if (!skip || !skip(u, i)) g = at::randn(params[u][i].sizes());
        params[u][i].mutable_grad() = g;
        given[u].push_back(g);
      }
    }
    comm.calls.clear();
    reducer->reduce(s);
    std::vector<int64_t> sent, expected;
    for (const PeerComm::Call& c : comm.calls) {
      sent.push_back(c.numel);
      EXPECT_EQ(c.dtype, bf16 ? at::kBFloat16 : at::kFloat) << "stage " << s;
    }
    for (size_t u : schedule.units_of(s)) expected.push_back(2 * shard(u));
    std::sort(sent.begin(), sent.end());
    std::sort(expected.begin(), expected.end());
    EXPECT_EQ(sent, expected) << "stage " << s << ": one reduce-scatter of each unit it uses, padded";
    for (auto& [u, grads] : given) {
      for (const at::Tensor& t : params[u]) EXPECT_FALSE(t.grad().defined()) << "stage " << s << " unit " << u;
      const at::Tensor c = reduced(u, grads);
      want[u] = want[u].defined() ? want[u].add(c) : c;
    }
  }
  void micro_batch(const std::function<bool(size_t, size_t)>& skip = {}) {
    for (size_t s : kBackward) reduce(s, skip);
  }
  void sync() { device->synchronize(device->d2h_stream()); }
  // Runs `fn` while writes may be held: if it has not returned within `limit` it waits for a held
  // write, which fails the test; the writes are then released so that it ends.
  void within(const std::string& what, std::function<void()> fn, std::chrono::milliseconds limit = 2s) {
    Background r(std::move(fn));
    if (!r.finished_within(limit)) {
      ADD_FAILURE() << what << " waited for a held write";
      gate->release();
    }
    r.done.get();
  }
  // What the engine does at the end of a backward.
  void finish() {
    device->synchronize(device->d2h_stream());
    reducer->finish_writes();
  }
  void end_step() {
    reducer->end_step();
    want.assign(4, at::Tensor());
  }
  void expect_accumulated(const std::string& what) {
    for (size_t u = 0; u < 4; ++u) {
      ASSERT_TRUE(want[u].defined());
      EXPECT_TRUE(at::equal(accumulator(u), want[u])) << what << ", unit " << u << " (" << to_string(where(u)) << ")";
    }
  }
};

}  // namespace strata::engine::runtime::reducer_testing
