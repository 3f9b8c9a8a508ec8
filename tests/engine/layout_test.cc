// The plan on its own (no libtorch, no device, no communicator): the schedule and the memory
// model of the device working set, against sizes computed by hand on awkward numbers.
#include <gtest/gtest.h>

#include <algorithm>
#include <set>

#include <cstdint>
#include <stdexcept>
#include <vector>

#include "strata/engine/layout/memory_model.h"
#include "strata/engine/layout/schedule.h"

namespace strata::engine::layout {
namespace {

// Embedding (unit 0), three blocks (units 1-3), a head (unit 4) tied to the embedding.
Schedule tied_five() { return Schedule({{0}, {1}, {2}, {3}, {4, 0}}, 5); }

TEST(Schedule, ForwardHeadBackwardOrderAndWrapsOverMicroBatches) {
  const Schedule s = tied_five();
  ASSERT_EQ(s.uses().size(), 9u);
  const std::vector<std::pair<size_t, Use::Kind>> want = {
      {0, Use::kForward}, {1, Use::kForward}, {2, Use::kForward}, {3, Use::kForward}, {4, Use::kHead},
      {3, Use::kBackward}, {2, Use::kBackward}, {1, Use::kBackward}, {0, Use::kBackward}};
  for (size_t k = 0; k < want.size(); ++k) {
    EXPECT_EQ(s.uses()[k].stage, want[k].first) << k;
    EXPECT_EQ(s.uses()[k].kind, want[k].second) << k;
    EXPECT_EQ(s.use_at(k + 2 * 9).stage, want[k].first) << "micro-batch 2, use " << k;
  }
  EXPECT_EQ(s.blocks(), 3u);
}

TEST(Schedule, LastUsesSharedUnitsAndTheOrderGradientsBecomeFinal) {
  const Schedule s = tied_five();
  EXPECT_EQ(s.last_use_stage(4), 4u);
  EXPECT_EQ(s.last_use_stage(3), 3u);
  EXPECT_EQ(s.last_use_stage(0), 0u);  // the tied embedding: its gradient is final only at the end
  EXPECT_EQ(s.shared_units(), 1u);
  EXPECT_TRUE(s.uses_unit(4, 0));
  EXPECT_FALSE(s.uses_unit(3, 0));
  EXPECT_EQ(s.in_final_gradient_order({0, 1, 2, 3, 4}), (std::vector<size_t>{4, 3, 2, 1, 0}));
  EXPECT_EQ(s.in_final_gradient_order({2, 0, 4}), (std::vector<size_t>{4, 2, 0}));
  EXPECT_EQ(Schedule({{0}, {1}, {2}}, 3).shared_units(), 0u);
  // LoRA with block tiles (2 blocks of 2 attention tiles, a tied head): each block's adapters
  // (unit 1, unit 4) are shared by its tiles, open only over them; with the tied embedding, two
  // at most at once. Frozen units shared hold no gradient.
  const std::vector<char> frozen = {0, 0, 1, 1, 0, 1, 1, 0};
  const Schedule lora({{0}, {1, 2}, {3, 1}, {4, 5}, {6, 4}, {7, 0}}, 8, 1, 1, frozen);
  EXPECT_EQ(lora.shared_units(), 2u);
  EXPECT_EQ(Schedule({{0}, {1, 2}, {3, 1}, {4, 5}, {6, 4}, {7}}, 8, 1, 1, frozen).shared_units(), 1u);
  EXPECT_EQ(Schedule({{0}, {1, 2}, {3, 2}, {4}}, 5, 1, 1, {0, 0, 1, 0, 0}).shared_units(), 0u);
}

TEST(Schedule, RejectsStagesWithoutUnitsAndUnknownUnits) {
  EXPECT_THROW(Schedule({{0}, {}, {2}}, 3), std::invalid_argument);
  EXPECT_THROW(Schedule({{0}, {1}, {7}}, 3), std::invalid_argument);
  EXPECT_THROW(Schedule({{0}}, 1), std::invalid_argument);
}

// Frozen units: a stage has a backward when it, or a stage below it, learns (its input gradient
// carries the gradient down); an embedding stage when it learns (its input is token ids); the
// head always. A frozen block above a learning embedding keeps its backward.
TEST(Schedule, BackwardsStopBelowTheLowestStageThatLearns) {
  const auto backwards = [](const Schedule& s) {
    std::vector<size_t> out;
    for (const Use& u : s.uses())
      if (u.kind == Use::kBackward) out.push_back(u.stage);
    for (size_t st = 0; st < s.num_stages(); ++st)
      EXPECT_EQ(s.has_backward(st), std::count(out.begin(), out.end(), st) == 1) << st;
    return out;
  };
  // Units: embedding 0, blocks 1-3, head 4 (untied); frozen embedding and blocks 1-2.
  const std::vector<std::vector<size_t>> stages = {{0}, {1}, {2}, {3}, {4}};
  EXPECT_EQ(backwards(Schedule(stages, 5, 1, 1, {1, 1, 1, 0, 0})), (std::vector<size_t>{3}));
  // Block 2 learns (half of it, say): blocks 2 and 3 have backwards, block 1 and the embedding none.
  EXPECT_EQ(backwards(Schedule(stages, 5, 1, 1, {1, 1, 0, 1, 0})), (std::vector<size_t>{3, 2}));
  // The embedding learns: every block carries its gradient down.
  EXPECT_EQ(backwards(Schedule(stages, 5, 1, 1, {0, 1, 1, 1, 1})), (std::vector<size_t>{3, 2, 1, 0}));
  // Nothing frozen: every stage.
  EXPECT_EQ(backwards(Schedule(stages, 5)), (std::vector<size_t>{3, 2, 1, 0}));
  // Vocabulary tiles: each embedding tile by itself (tile 1 learns); the blocks all carry.
  EXPECT_EQ(backwards(Schedule({{0}, {1}, {2}, {3}, {4}, {5}}, 6, 2, 2, {1, 0, 1, 1, 1, 1})),
            (std::vector<size_t>{4, 3, 2, 1}));
}

// What a backward use brings back while it runs comes from the schedule: the next backward uses'
// stages in the same micro-batch, skipping stages without a backward, never into the next
// micro-batch. Before the engine read it here, backward_use hard-coded stages s-1 and s-2.
TEST(Schedule, BackwardStagesAheadOfAUse) {
  // Embedding 0, blocks 1-4, head 5: uses F0..F4 H5 B4 B3 B2 B1 B0 (11 a micro-batch).
  const Schedule s({{0}, {1}, {2}, {3}, {4}, {5}}, 6);
  const size_t n = s.uses().size(), none = Schedule::kNoStage;
  ASSERT_EQ(n, 11u);
  EXPECT_EQ(s.backward_stage_after(5, 1), 4u);  // the head's use: the top block is next
  EXPECT_EQ(s.backward_stage_after(6, 1), 3u);  // B4: B3 next, B2 after it
  EXPECT_EQ(s.backward_stage_after(6, 2), 2u);
  EXPECT_EQ(s.backward_stage_after(0, 1), 4u);  // from a forward use: the first backward
  EXPECT_EQ(s.backward_stage_after(9, 1), 0u);  // B1: the embedding
  EXPECT_EQ(s.backward_stage_after(9, 2), none);
  EXPECT_EQ(s.backward_stage_after(10, 1), none) << "the last use: nothing past the micro-batch";
  EXPECT_EQ(s.backward_stage_after(n + 6, 2), 2u) << "k counts over the step";
  // For every block use s with a backward, the old rule's s-1 and s-2 wherever those were blocks
  // with a backward (the only stages with activation checkpoints).
  const Schedule frozen({{0}, {1}, {2}, {3}, {4}, {5}}, 6, 1, 1, {1, 1, 0, 0, 0, 0});  // B4 B3 B2
  for (size_t k = 0; k < frozen.uses().size(); ++k) {
    const Use& u = frozen.uses()[k];
    if (u.kind != Use::kBackward) continue;
    for (size_t a = 1; a <= 2; ++a) {
      const size_t got = frozen.backward_stage_after(k, a);
      const bool old_rule = u.stage > a && frozen.is_block(u.stage - a) && frozen.has_backward(u.stage - a);
      EXPECT_EQ(got != none && frozen.is_block(got), old_rule) << "use " << k << " ahead " << a;
      if (old_rule) {
        EXPECT_EQ(got, u.stage - a);
      }
    }
  }
}

// A block stage without a backward neither keeps its graph nor is checkpointed, whatever the
// recompute choice: it runs without autograd.
TEST(MemoryModel, BlocksWithoutABackwardKeepNothing) {
  const Schedule s({{0}, {1}, {2}, {3}, {4}}, 5, 1, 1, {1, 1, 0, 0, 0});
  ModelSizes z;
  z.padded_numel = {64, 64, 64, 64, 64};
  z.shard_numel = z.padded_numel;
  z.tokens = 8;
  z.hidden = 4;
  z.vocab = 16;
  z.graph_bytes = {0, 100, 100, 100, 0};
  const MemoryModel m(s, z);
  for (size_t recomputed : {0u, 1u, 3u}) {
    Choices c;
    c.recomputed = recomputed;
    EXPECT_FALSE(m.keeps_graph(1, c) || m.checkpointed(1, c)) << recomputed;
    EXPECT_NE(m.keeps_graph(2, c), m.checkpointed(2, c)) << recomputed;
  }
}

// Awkward sizes: primes, two ranks' padding.
ModelSizes awkward_sizes() {
  ModelSizes z;
  z.padded_numel = {10240, 6144, 7168, 5120, 3072};
  z.shard_numel = {5120, 3072, 3584, 2560, 1536};
  z.compute_bytes = 2;
  z.reduce_bf16 = true;
  z.tokens = 3 * 37;
  z.hidden = 13;
  z.vocab = 101;
  z.graph_bytes = {0, 9973, 9973, 9973, 0};
  return z;
}

TEST(MemoryModel, UnitAndUseBytesAreTheGatheredBuffers) {
  const Schedule s = tied_five();
  const MemoryModel m(s, awkward_sizes());
  EXPECT_EQ(m.unit_bytes(2), 7168u * 2);
  EXPECT_EQ(m.use_bytes({4, Use::kHead}), (3072u + 10240u) * 2);  // head and tied embedding
  EXPECT_EQ(m.largest_unit(), 10240u * 2);
}

TEST(MemoryModel, ScratchIsTheLargestUsesActivationsGradientBuffersAndLogits) {
  const Schedule s = tied_five();
  const MemoryModel m(s, awkward_sizes());
  const uint64_t act = 111 * 13 * 2;
  EXPECT_EQ(m.activation_bytes(), act);
  // The head: the larger of its logits (fp32, their fp32 gradient and the compute-dtype output)
  // and its own and the tied embedding's gradient buffers (fp32 + bf16 full, fp32 shard): the
  // loss is freed before the reduce.
  const uint64_t grads = (3072 + 10240) * 6 + (1536 + 5120) * 4, logits = 111 * 101 * (4 + 4 + 2);
  ASSERT_GT(logits, grads);
  const uint64_t head = 4 * act + logits;
  Choices c;
  c.activations = Placement::kDevice;
  EXPECT_EQ(m.scratch(c), head);
  EXPECT_EQ(m.largest_scratch_use().kind, Use::kHead);
  EXPECT_EQ(m.head_gradient_bytes(), grads);
  c.activations = Placement::kHost;  // one checkpoint on its way back
  EXPECT_EQ(m.scratch(c), head + act);
  c.activations = Placement::kAuto;  // undecided: counted as off the device
  EXPECT_EQ(m.scratch(c), head + act);
  // A vocabulary whose logits weigh less than the gradient buffers: those alone.
  ModelSizes narrow = awkward_sizes();
  narrow.vocab = 37;
  const MemoryModel mn(s, narrow);
  ASSERT_LT(111u * 37 * (4 + 4 + 2), grads);
  c.activations = Placement::kDevice;
  EXPECT_EQ(mn.scratch(c), 4 * act + grads);
  EXPECT_EQ(mn.largest_scratch_use().kind, Use::kHead);
}

// With vocabulary tiles the loss's running state lives from the first head stage's forward to
// its backward: every head stage's use holds it beside its own gradient buffers.
TEST(MemoryModel, VocabularyTilesHoldTheLossBesideEveryHeadStagesGradients) {
  // Embedding tiles 0 and 1, blocks 2 and 3, head tiles 4 and 5 tied to the embedding's.
  const Schedule s({{0}, {1}, {2}, {3}, {4, 0}, {5, 1}}, 6, 2, 2);
  ASSERT_TRUE(s.vocab_tiled());
  ModelSizes z = awkward_sizes();
  z.padded_numel = {10240, 10240, 7168, 5120, 3072, 3072};
  z.shard_numel = {5120, 5120, 3584, 2560, 1536, 1536};
  z.vocab_tiles = 2;
  z.graph_bytes = {0, 0, 9973, 9973, 0, 0};
  const MemoryModel m(s, z);
  const uint64_t act = 111 * 13 * 2;
  const uint64_t grads = (3072 + 10240) * 6 + (1536 + 5120) * 4;  // a head tile's and its embedding tile's
  Choices c;
  c.activations = Placement::kDevice;
  EXPECT_EQ(m.scratch(c), 4 * act + grads + m.head_loss_bytes());
  EXPECT_TRUE(s.is_head(m.largest_scratch_use().stage));
  EXPECT_NE(m.largest_scratch_use().kind, Use::kForward);
  EXPECT_EQ(m.head_gradient_bytes(), grads);
}

TEST(MemoryModel, KeptBlocksHoldTheirGraphsAndUnitsFromForwardToBackward) {
  const Schedule s = tied_five();
  const MemoryModel m(s, awkward_sizes());
  Choices c;
  c.recomputed = 1;  // block 1 (stage 1) recomputed; stages 2 and 3 keep their graphs
  EXPECT_TRUE(m.checkpointed(1, c));
  EXPECT_FALSE(m.checkpointed(2, c));
  EXPECT_TRUE(m.keeps_graph(2, c));
  EXPECT_TRUE(m.keeps_graph(3, c));
  EXPECT_FALSE(m.keeps_graph(4, c));  // the head
  const uint64_t g = 9973;
  // The running stage's own graph is the use's scratch (below), not held.
  EXPECT_EQ(m.held_at({1, Use::kForward}, c), 0u);
  EXPECT_EQ(m.held_at({2, Use::kForward}, c), 0u);
  EXPECT_EQ(m.held_at({3, Use::kForward}, c), g + 7168u * 2);
  EXPECT_EQ(m.held_at({4, Use::kHead}, c), 2 * g + (7168u + 5120u) * 2);
  EXPECT_EQ(m.held_at({3, Use::kBackward}, c), g + 7168u * 2);  // stage 2's backward comes later
  EXPECT_EQ(m.held_at({2, Use::kBackward}, c), 0u);
  EXPECT_EQ(m.peak_held(c), 2 * g + (7168u + 5120u) * 2);
  EXPECT_EQ(m.checkpoint_bytes(c), m.activation_bytes());
}

// A block stage's backward holds its own graph (a recompute builds it there), and so does a kept
// stage's forward (it builds it); a recomputed stage's forward runs without one. Only the running
// use counts it (not scratch, which every use counts).
TEST(MemoryModel, ABlockStagesUseHoldsItsOwnGraph) {
  const Schedule s = tied_five();
  ModelSizes z = awkward_sizes();
  z.graph_bytes = {0, 400000, 500000, 300000, 0};
  const MemoryModel m(s, z);
  Choices c;
  c.activations = Placement::kDevice;
  c.recomputed = 2;  // stages 1 and 2 recomputed, stage 3 kept
  const MemoryModel plain(s, awkward_sizes());
  EXPECT_EQ(m.scratch(c), plain.scratch(c)) << "graphs are not the scratch every use counts";
  EXPECT_EQ(m.running_graph({2, Use::kForward}, c), 0u);
  EXPECT_EQ(m.running_graph({2, Use::kBackward}, c), 500000u);
  EXPECT_EQ(m.running_graph({3, Use::kForward}, c), 300000u);
  EXPECT_EQ(m.running_graph({3, Use::kBackward}, c), 300000u);
  EXPECT_EQ(m.running_graph({0, Use::kBackward}, c), 0u);
  EXPECT_EQ(m.running_graph({4, Use::kHead}, c), 0u);
  // Stage 2's backward: its boundary activations with its graph (larger than its gradient
  // buffers, which come at the reduce, once the graph is freed), more than the head's scratch;
  // the head's use: the head's scratch (no graph).
  const uint64_t act = 111 * 13 * 2, grads = 7168u * 6 + 3584u * 4, own = 4 * act + 500000;
  ASSERT_LT(grads, 500000u);
  EXPECT_EQ(m.running_scratch({2, Use::kBackward}, c), own);
  EXPECT_EQ(m.running_scratch({2, Use::kForward}, c), 4 * act) << "recomputed: no graph in its forward";
  ASSERT_GT(own, m.scratch(c));
  EXPECT_EQ(m.need({2, Use::kBackward}, c), m.use_bytes({2, Use::kBackward}) + own + m.device_checkpoints(c) +
                                                m.held_at({2, Use::kBackward}, c));
  EXPECT_EQ(m.need({4, Use::kHead}, c), plain.need({4, Use::kHead}, c) + m.held_at({4, Use::kHead}, c) -
                                            plain.held_at({4, Use::kHead}, c));
  EXPECT_EQ(m.room_scratch(c), own) << "the coordinator's room test: the largest with a graph";
  EXPECT_EQ(plain.room_scratch(c), plain.scratch(c));
  EXPECT_EQ(m.held_at({4, Use::kHead}, c), 300000u + 5120u * 2);
  EXPECT_EQ(m.block_graph_bytes(1), 400000u);
  z.graph_bytes = {0, 1};
  EXPECT_THROW(MemoryModel(s, z), std::invalid_argument);
}

TEST(MemoryModel, WorkingSetIsTheLargestNeedPlusThePrefetchedUnits) {
  const Schedule s = tied_five();
  const MemoryModel m(s, awkward_sizes());
  for (Placement act : {Placement::kDevice, Placement::kHost, Placement::kNvme, Placement::kAuto})
    for (size_t recomputed : {0u, 1u, 3u})
      for (int prefetch : {0, 1, 3}) {
        Choices c{act, recomputed, prefetch};
        uint64_t largest = 0;
        for (const Use& u : s.uses()) {
          const uint64_t need = m.use_bytes(u) + std::max(m.scratch(c), m.running_scratch(u, c)) + m.held_at(u, c) +
                                (act == Placement::kDevice ? recomputed * m.activation_bytes() : 0);
          EXPECT_EQ(m.need(u, c), need);
          largest = std::max(largest, need);
        }
        EXPECT_EQ(m.largest_need(c), largest);
        // Each use's need with the distinct units of the next `prefetch` uses (the schedule a
        // cycle) that it does not use itself.
        uint64_t working = 0;
        const size_t n = s.uses().size();
        for (size_t k = 0; k < n; ++k) {
          const std::vector<size_t>& own = s.units_of(s.uses()[k].stage);
          std::set<size_t> ahead;
          for (int j = 1; j <= prefetch; ++j)
            for (size_t u : s.units_of(s.uses()[(k + size_t(j)) % n].stage))
              if (std::find(own.begin(), own.end(), u) == own.end()) ahead.insert(u);
          uint64_t bytes = m.need(s.uses()[k], c);
          for (size_t u : ahead) bytes += m.unit_bytes(u);
          working = std::max(working, bytes);
        }
        EXPECT_EQ(m.working_set(c), working);
        EXPECT_LE(m.working_set(c), largest + uint64_t(2 * prefetch) * m.largest_unit());
        if (prefetch == 0) EXPECT_EQ(m.working_set(c), largest);
        // prefetch_room: how many of the largest unit fit beyond base + the largest need.
        const uint64_t base = 12345;
        Choices none = c;
        none.prefetch = 0;
        const uint64_t usable = base + m.largest_need(none) + 2 * m.largest_unit() + 1;
        EXPECT_EQ(m.prefetch_room(none, base, usable), 2u);
        EXPECT_EQ(m.prefetch_room(none, base, base + m.largest_need(none) - 1), 0u);
      }
}

TEST(MemoryModel, UsableDeviceIsTheBudgetOrWhatTheDeviceHasFree) {
  EXPECT_EQ(MemoryModel::usable_device(1000, 0, UINT64_MAX), 1000u);
  EXPECT_EQ(MemoryModel::usable_device(UINT64_MAX, 0, UINT64_MAX), UINT64_MAX);
  EXPECT_EQ(MemoryModel::usable_device(1000, 300, 500), 800u);
  EXPECT_EQ(MemoryModel::usable_device(1000, 300, 900), 1000u);
}

TEST(MemoryModel, RejectsSizesOfAnotherSchedule) {
  const Schedule s = tied_five();
  ModelSizes z = awkward_sizes();
  z.shard_numel.pop_back();
  EXPECT_THROW(MemoryModel(s, z), std::invalid_argument);
}

}  // namespace
}  // namespace strata::engine::layout
