// The gradient reducer (engine/src/runtime/gradient_reducer.h): what each reduce reduce-scatters
// and accumulates where the gradient lives (device, host, swap), over micro-batches and steps, in
// fp32 and with a bf16 reduce-scatter; a tied unit's two stages; transient gradients' lent
// buffers; final gradients handed on. The bench and its oracle: gradient_reducer_bench.h.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <cmath>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "gradient_reducer_bench.h"

namespace strata::engine::runtime {
namespace {

using namespace reducer_testing;
using state::kGrad;

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
  StatePlacement plan = grads_in(Placement::kHost);
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

}  // namespace
}  // namespace strata::engine::runtime
