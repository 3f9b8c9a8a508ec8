// The gradient reducer on its own (engine/src/runtime/gradient_reducer.h), on the host device
// with a state store and a two-rank communicator simulated in process: what each reduce
// reduce-scatters, and what it accumulates where the gradient lives (device, host, swap), over
// micro-batches and steps, in fp32 and with a bf16 reduce-scatter; a tied unit's two stages;
// transient gradients' lent buffers; and the swap writes (last_write, the bound on
// writes in flight, finish_writes and a failed write).
//
// The oracle is computed here from the gradients the test gave: each unit's flat gradient is its
// tensors' gradients back to back in the unit's order (zeros for a tensor without one), padded
// with zeros to two shards; the simulated peer's contribution to our shard is a known function of
// what we send; contributions are added in fp32 in the order they were made. The reducer does
// the same fp32 (or bf16, then fp32) additions in the same order, so every comparison is bitwise.
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

namespace strata::engine::runtime {
namespace {

using namespace std::chrono_literals;
using state::kGrad;

// What the peer (rank 1) contributes to our shard (rank 0's slice) given what we send: twice our
// rank-1 slice, plus one (so that a unit without local gradients still gets something). In the
// dtype sent, by the same ATen ops the oracle uses.
at::Tensor peer_contribution(const at::Tensor& ours_rank1_slice) { return ours_rank1_slice.mul(2).add(1); }

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
const std::vector<std::pair<std::string, std::vector<TensorSpec>>> kUnits = {
    {"embedding", {{"e", {301, 7}}}},
    {"block.0", {{"b0.a", {1001}}, {"b0.b", {16, 3}}}},
    {"block.1", {{"b1", {777}}}},
    {"head", {{"h.a", {3, 3}}}}};
constexpr size_t kHead = 3;
const size_t kBackward[] = {3, 2, 1, 0};  // stages in backward order

PlacementPlan grads_in(Placement p) { return PlacementPlan{Placement::kHost, p, Placement::kHost, Placement::kHost}; }

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
  const PlacementPlan plan;
  const bool bf16;
  std::unique_ptr<state::StateStore> store;
  std::vector<std::vector<at::Tensor>> params;  // unit u's tensors, in the unit's order
  std::vector<at::Tensor> want;                 // the step's accumulated contributions so far, by unit
  std::unique_ptr<GradientReducer> reducer;     // last: goes first

  // `backend`: the tests that hold writes use the thread pool, whose completions do not queue
  // behind a held one (io_uring's are reaped by one thread: a read would wait behind a held write).
  Bench(const PlacementPlan& p, bool reduce_bf16 = false, offload::IoBackend backend = offload::IoBackend::kAuto)
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

const Placement kTiers[] = {Placement::kDevice, Placement::kHost, Placement::kNvme};

TEST(GradientReducer, AccumulatesEachMicroBatchsReducedShardInFp32WhereTheGradientLives) {
  for (Placement p : kTiers) {
    SCOPED_TRACE(to_string(p));
    Bench b(grads_in(p));
    b.poison();  // host and swap: garbage that a step's first contribution must not add to
    for (int m = 0; m < 3; ++m) {
      b.micro_batch();
      b.finish();
      b.expect_accumulated("step 1, micro-batch " + std::to_string(m));
    }
    b.end_step();
    if (p == Placement::kDevice) {
      for (size_t u = 0; u < 4; ++u) EXPECT_EQ(b.accumulator(u).abs().max().item<float>(), 0.0f) << "zeroed, unit " << u;
    }
    // The next step: its first contribution replaces the last step's sums (device: added to zero).
    for (int m = 0; m < 2; ++m) {
      b.micro_batch();
      b.finish();
      b.expect_accumulated("step 2, micro-batch " + std::to_string(m));
    }
    if (p != Placement::kDevice) {
      // Five micro-batches, each copying down the fp32 shards of the head and the embedding, of
      // blocks 1 and 0, and of the embedding again.
      const int64_t per_micro_batch = b.shard(3) + b.shard(0) + b.shard(2) + b.shard(1) + b.shard(0);
      EXPECT_EQ(b.prof.step.d2h_bytes, uint64_t(5 * 4 * per_micro_batch)) << "fp32 shards copied down";
    }
  }
}

TEST(GradientReducer, Bf16ReduceScatterSendsBf16AndAccumulatesItsRoundedResultInFp32) {
  for (Placement p : kTiers) {
    SCOPED_TRACE(to_string(p));
    Bench b(grads_in(p), /*reduce_bf16=*/true);
    b.poison();
    // The same gradients through fp32 reduction (the same seed) must give other numbers, or this
    // test could not tell a bf16 reduce from an fp32 one.
    Bench fp32(grads_in(p), /*reduce_bf16=*/false);
    for (int m = 0; m < 2; ++m) {
      at::manual_seed(100 + m);
      b.micro_batch();
      at::manual_seed(100 + m);
      fp32.micro_batch();
    }
    b.finish();
    fp32.finish();
    b.expect_accumulated("bf16, step 1");  // the comm's calls were bf16 (checked per reduce)
    fp32.expect_accumulated("fp32, step 1");
    for (size_t u = 0; u < 4; ++u) EXPECT_FALSE(at::equal(b.want[u], fp32.want[u])) << "unit " << u;
    b.end_step();
    b.micro_batch();
    b.finish();
    b.expect_accumulated("bf16, step 2");
  }
}

TEST(GradientReducer, ATiedUnitAccumulatesTheHeadsContributionAndItsOwnStages) {
  for (Placement p : kTiers) {
    SCOPED_TRACE(to_string(p));
    Bench b(grads_in(p));
    b.poison();
    b.reduce(kHead);  // units 3 and 0: the head's gradient of the tied embedding comes first
    b.finish();
    const at::Tensor head_part = b.want[0];
    EXPECT_TRUE(at::equal(b.accumulator(0), head_part)) << "the head's contribution alone";
    b.reduce(2);
    b.reduce(1);
    b.reduce(0);
    b.finish();
    const at::Tensor both = b.accumulator(0);
    EXPECT_TRUE(at::equal(both, b.want[0])) << "the head's and the embedding stage's";
    EXPECT_FALSE(at::equal(both, head_part));
    b.expect_accumulated("one micro-batch");
  }
}

TEST(GradientReducer, EveryUnitAStageUsesIsReducedWithOrWithoutLocalGradients) {
  for (Placement p : kTiers) {
    SCOPED_TRACE(to_string(p));
    Bench b(grads_in(p));
    // The head produces no gradient for the tied embedding, block 0 none for its second tensor,
    // block 1 none at all: the collectives are the same (checked per reduce), zeros are sent
    // where the gradients are missing, and the peer's part is accumulated all the same.
    const auto missing = [](size_t u, size_t i) { return u == 2 || (u == 1 && i == 1); };
    b.reduce(kHead, [](size_t u, size_t) { return u == 0; });
    b.reduce(2, missing);
    b.reduce(1, missing);
    b.reduce(0, missing);
    b.micro_batch(missing);
    b.finish();
    b.expect_accumulated("missing gradients");
    EXPECT_GT(b.accumulator(2).abs().min().item<float>(), 0.0f) << "the peer's part of a unit without local gradients";
  }
}

TEST(GradientReducer, TransientGradientsTakeABufferFromItsPoolOncePerUnitAndStepAtTheirFirstReduce) {
  PlacementPlan plan = grads_in(Placement::kHost);
  plan.grads_transient = true;
  Bench b(plan);
  GradientBuffers* pool = b.reducer->gradient_buffers();
  ASSERT_NE(pool, nullptr) << "the reducer owns the transient gradients' pool";
  EXPECT_EQ(pool->size(), 4u);
  for (size_t u = 0; u < 4; ++u) ASSERT_FALSE(b.store->tensor(u, kGrad).defined()) << "no accumulator of its own";
  // NaN in the buffers first: a first reduce must overwrite its buffer, not add to it.
  for (size_t u = 0; u < 4; ++u) {
    pool->take(u);
    b.store->tensor(u, kGrad).fill_(std::nan(""));
  }
  for (size_t u = 0; u < 4; ++u) pool->release(u);
  for (int step = 0; step < 2; ++step) {
    SCOPED_TRACE("step " + std::to_string(step));
    // Backward order: the head's stage takes buffers for the head and the tied embedding, whose
    // own stage later adds to the buffer it already has.
    const std::vector<std::vector<size_t>> taken_by_stage = {{0, 3}, {2}, {1}, {}};
    std::vector<at::Tensor> held(4);
    for (size_t k = 0; k < 4; ++k) {
      b.reduce(kBackward[k]);
      std::vector<size_t> now;
      for (size_t u = 0; u < 4; ++u) {
        const at::Tensor& g = b.store->tensor(u, kGrad);
        if (!g.defined()) continue;
        if (!held[u].defined()) {
          now.push_back(u);
          held[u] = g;
        } else {
          EXPECT_TRUE(g.is_same(held[u])) << "unit " << u << " took a second buffer";
        }
      }
      EXPECT_EQ(now, taken_by_stage[k]) << "taken at stage " << kBackward[k];
    }
    b.sync();
    // Each buffer (NaN the first time, another unit's last gradient the second) received the
    // step's gradient, both stages' for the tied unit.
    for (size_t u = 0; u < 4; ++u) EXPECT_TRUE(at::equal(b.store->tensor(u, kGrad), b.want[u])) << "unit " << u;
    // The updater's part: each buffer goes back once its update has read it, in another order.
    for (size_t u : {2, 0, 3, 1}) {
      pool->release(u);
      EXPECT_FALSE(b.store->tensor(u, kGrad).defined());
    }
    b.end_step();
  }
}

// The updater's one call: after a stage's reduce, each unit whose last use that stage is reaches
// the sink once its gradient is final (after its accumulation, and for swap gradients with its
// last write); the tied embedding only after its own stage, not the head's.
TEST(GradientReducer, HandsEachUnitsFinalGradientOnAfterItsLastUse) {
  struct Sink final : FinalGradientSink {
    std::mutex mu;
    std::vector<std::pair<size_t, bool>> got;  // (unit, with a write to wait for)
    void mark_final(size_t u, offload::IoFuture written) override {
      std::lock_guard<std::mutex> lock(mu);
      got.emplace_back(u, written.valid());
    }
  };
  for (Placement p : {Placement::kHost, Placement::kNvme}) {
    SCOPED_TRACE(to_string(p));
    Bench b(grads_in(p));
    Sink sink;
    const std::vector<std::vector<size_t>> final_at = {{3}, {2}, {1}, {0}};  // the head's stage uses unit 0 too
    for (size_t k = 0; k < 4; ++k) {
      b.reduce(kBackward[k]);
      b.reducer->hand_final_gradients(kBackward[k], sink);
      b.sync();
      b.reducer->finish_writes();  // so that the accumulator can be read back below
      std::lock_guard<std::mutex> lock(sink.mu);
      ASSERT_EQ(sink.got.size(), k + 1) << "after stage " << kBackward[k];
      EXPECT_EQ(sink.got.back().first, final_at[k][0]);
      EXPECT_EQ(sink.got.back().second, p == Placement::kNvme) << "swap gradients come with their last write";
      // Final means accumulated: the accumulator holds the unit's whole gradient by now.
      EXPECT_TRUE(at::equal(b.accumulator(sink.got.back().first), b.want[sink.got.back().first]));
    }
    b.reducer->finish_writes();
  }
}

TEST(GradientReducer, ASwapReduceReadsAfterTheUnitsLastWriteAndFinishWritesWaitsForAll) {
  Bench b(grads_in(Placement::kNvme), false, offload::IoBackend::kThreadPool);
  for (size_t u = 0; u < 4; ++u) EXPECT_FALSE(b.reducer->last_write(u).valid()) << "nothing written yet";
  b.gate->hold();
  b.within("reduce(1)", [&] {
    b.reduce(1);
    b.sync();  // the write is submitted, not complete
  });
  const offload::IoFuture first = b.reducer->last_write(1);
  ASSERT_TRUE(first.valid());
  EXPECT_FALSE(first.ready()) << "held";
  EXPECT_FALSE(b.reducer->last_write(2).valid()) << "unit 2 was not reduced";
  // The next micro-batch's contribution reads the partition only once that write is done: the
  // d2h stream waits there.
  b.within("the second reduce(1)", [&] { b.reduce(1); });
  const std::shared_ptr<Event> past = b.device->record(b.device->d2h_stream());
  std::this_thread::sleep_for(100ms);
  EXPECT_FALSE(past->done()) << "the read-add-write of unit 1 did not wait for its last write";
  b.gate->release();
  b.sync();
  const offload::IoFuture second = b.reducer->last_write(1);
  ASSERT_TRUE(second.valid());
  b.reducer->finish_writes();
  EXPECT_TRUE(second.ready());
  EXPECT_FALSE(b.reducer->last_write(1).valid()) << "finish_writes forgets the step's writes";
  EXPECT_TRUE(at::equal(b.accumulator(1), b.want[1]));

  // finish_writes blocks until every write is done.
  b.end_step();
  b.gate->hold();
  b.within("reduce(head), reduce(1)", [&] {
    b.reduce(kHead);
    b.reduce(1);
    b.sync();
  });
  std::vector<offload::IoFuture> writes;
  for (size_t u : {0, 1, 3}) writes.push_back(b.reducer->last_write(u));
  for (const offload::IoFuture& w : writes) EXPECT_TRUE(w.valid() && !w.ready());
  Background finish([&] { b.reducer->finish_writes(); });
  EXPECT_FALSE(finish.finished_within(100ms)) << "finish_writes returned with writes in flight";
  b.gate->release();
  finish.done.get();
  for (const offload::IoFuture& w : writes) EXPECT_TRUE(w.valid() && w.ready() && w.wait().ok());
  for (size_t u : {0, 1, 3}) EXPECT_TRUE(at::equal(b.accumulator(u), b.want[u])) << "unit " << u;
}

TEST(GradientReducer, OverTwoSwapWritesInFlightTheNextSwapReduceWaitsForTheOldest) {
  Bench b(grads_in(Placement::kNvme), false, offload::IoBackend::kThreadPool);
  b.gate->hold();
  // Three writes held (units 1, 2, 0), each submitted before the next reduce: none of those
  // reduces waits, though two and then three writes are in flight.
  for (size_t s : {1, 2, 0}) {
    b.within("reduce(" + std::to_string(s) + ") with fewer than three writes in flight", [&] {
      b.reduce(s);
      b.sync();
    });
  }
  const double waited = b.prof.step.wait_grads;
  Background fourth([&] { b.reduce(1); });  // a second micro-batch's contribution of unit 1
  EXPECT_FALSE(fourth.finished_within(100ms)) << "a fourth write went in flight without waiting";
  b.gate->release();
  fourth.done.get();
  EXPECT_GT(b.prof.step.wait_grads, waited) << "the wait counts as waiting for gradients";
  b.finish();
  for (size_t u : {0, 1, 2}) EXPECT_TRUE(at::equal(b.accumulator(u), b.want[u])) << "unit " << u;
}

TEST(GradientReducer, AFailedSwapWriteFailsFinishWritesOnceEveryOtherWriteHasEnded) {
  Bench b(grads_in(Placement::kNvme), false, offload::IoBackend::kThreadPool);
  // The embedding's gradient partition fails its writes; the others are held.
  const std::string name = "embedding.grad";  // the store's swap region: "<unit>.<kind>"
  ASSERT_TRUE(b.swap->contains(name));
  for (const offload::SwapSpace::Piece& piece : b.swap->locate(name, 0, b.swap->size(name)))
    b.gate->fail(piece.file_offset, piece.file_offset + piece.length);
  b.gate->hold();
  // The failing write has ended before the held ones are submitted.
  b.within("reduce(0)", [&] {
    b.reduce(0);
    b.sync();
  });
  const offload::IoFuture failed = b.reducer->last_write(0);
  ASSERT_TRUE(failed.valid());
  for (int i = 0; i < 200 && !failed.ready(); ++i) std::this_thread::sleep_for(10ms);
  ASSERT_TRUE(failed.ready());
  EXPECT_FALSE(failed.wait().ok()) << "the injected failure";
  b.within("reduce(2), reduce(1)", [&] {
    b.reduce(2);
    b.reduce(1);
    b.sync();
  });
  const offload::IoFuture held1 = b.reducer->last_write(1), held2 = b.reducer->last_write(2);
  ASSERT_TRUE(held1.valid() && held2.valid());
  EXPECT_FALSE(held1.ready() || held2.ready());
  std::string error;
  Background finish([&] {
    try {
      b.reducer->finish_writes();
    } catch (const offload::IoError& e) {
      error = e.what();
    }
  });
  EXPECT_FALSE(finish.finished_within(100ms)) << "finish_writes rethrew before the other writes ended";
  b.gate->release();
  finish.done.get();
  EXPECT_NE(error.find(name), std::string::npos) << "finish_writes threw: \"" << error << "\"";
  EXPECT_TRUE(held1.ready() && held1.wait().ok());
  EXPECT_TRUE(held2.ready() && held2.wait().ok());
  EXPECT_NO_THROW(b.reducer->finish_writes()) << "the failure is reported once";
  for (size_t u : {1, 2}) EXPECT_TRUE(at::equal(b.accumulator(u), b.want[u])) << "unit " << u;
}

}  // namespace
}  // namespace strata::engine::runtime
