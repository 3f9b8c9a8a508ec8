// Resolution of the state's placement, recompute and activation checkpoints
// (strata/engine/layout/resolve.h) from a configuration, budgets and the memory model, with the
// ranks' agreement simulated by a peer; the effective configuration and the working set's check.
//
// Oracles: the planner's own plan for one rank alone, the memory model's working set for the fit
// tests, and the element-wise maximum with the peer.
#include <gtest/gtest.h>

#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

#include "resolve_fixture.h"
#include "strata/engine/bytes.h"
#include "strata/engine/layout/memory_model.h"
#include "strata/engine/layout/resolve.h"
#include "strata/engine/layout/schedule.h"
#include "strata/engine/layout/tiles.h"
#include "strata/engine/placement.h"
#include "strata/models/model_config.h"

namespace strata::engine {
namespace {

using namespace resolve_testing;

TEST(StateBytes, SumsEachKindAndSizesTheTransientBuffersByTheLargestShard) {
  const StateBytes b = state_bytes({7, 11, 5}, 2, 3);
  EXPECT_EQ(b.params, 23u * 2);
  EXPECT_EQ(b.grads, 23u * 4);
  EXPECT_EQ(b.master, 23u * 4);
  EXPECT_EQ(b.moments, 23u * 8);
  EXPECT_EQ(b.unit_numel, (std::vector<uint64_t>{7, 11, 5}));
  EXPECT_EQ(b.grad_buffers, 3u * 11 * 4);
}

TEST(ResolvePlacement, AnExplicitPlacementIsKeptAndNeverAsksThePeers) {
  Model m;
  EngineConfig cfg;
  cfg.params = Placement::kDevice;
  cfg.grads = Placement::kNvme;
  cfg.master = cfg.moments = Placement::kNvme;
  cfg.update_overlap = UpdateOverlap::kBackward;
  cfg.grad_accum = 1;
  Peer p{{9, 9, 9, 9, 9, 9}};
  std::string report;
  const StatePlacement plan = resolve_placement(
      cfg, m.memory, {}, m.need, UINT64_MAX, [](uint64_t) -> TierBudgets { ADD_FAILURE() << "no budgets needed"; return {}; },
      p.agree(), report);
  EXPECT_EQ(p.calls, 0);
  EXPECT_EQ(plan.params, Placement::kDevice);
  EXPECT_EQ(plan.master, Placement::kNvme);
  EXPECT_EQ(plan.moments, Placement::kNvme);
  ASSERT_TRUE(plan.grads_transient) << "backward overlap, one micro-batch, master off the device";
  EXPECT_EQ(plan.grads, Placement::kHost) << "transient gradients wait in host buffers";
  EXPECT_EQ(plan.device_units + plan.host_units, 0u);
  EXPECT_EQ(report.rfind("placement: ", 0), 0u) << report;
  cfg.grad_accum = 2;  // accumulators needed: gradients stay where placed
  EXPECT_EQ(resolve_placement(cfg, m.memory, {}, m.need, UINT64_MAX, {}, p.agree(), report).grads, Placement::kNvme);
}

TEST(ResolvePlacement, AloneItIsThePlannersPlanWithTheDeviceKeepingRoomForTheWorkingSet) {
  Model m;
  const EngineConfig cfg = all_auto();
  layout::Choices choice;
  choice.recomputed = 3;
  choice.prefetch = 2;
  const uint64_t working = m.memory.working_set(choice);
  // Room on the device for the compute copies and part of the optimizer group only.
  const uint64_t usable = working + m.need.params + 16 * 6000;
  TierBudgets given{};
  uint64_t asked = 0;
  const auto budgets = [&](uint64_t device) {
    asked = device;
    given = {device, 16 * 4000, 1ull << 30};
    return given;
  };
  Peer alone;
  std::string report;
  const StatePlacement plan = resolve_placement(cfg, m.memory, choice, m.need, usable, budgets, alone.agree(), report);
  EXPECT_EQ(asked, usable - working) << "the device's budget for state is what the working set leaves";
  const StatePlacement want = place_state(cfg, m.need, given);
  EXPECT_EQ(plan.params, want.params);
  EXPECT_EQ(plan.grads, want.grads);
  EXPECT_EQ(plan.master, want.master);
  EXPECT_EQ(plan.moments, want.moments);
  EXPECT_EQ(plan.device_units, want.device_units);
  EXPECT_EQ(plan.host_units, want.host_units);
  EXPECT_GT(plan.device_units, 0u) << "the test's budgets should split the group";
  EXPECT_EQ(alone.calls, 1);
  ASSERT_EQ(alone.last.size(), 6u) << "four tiers and two unit counts, agreed in one call";
  EXPECT_NE(report.find("placement (auto): "), std::string::npos) << report;
  EXPECT_NE(report.find("working set"), std::string::npos) << report;
}

TEST(ResolvePlacement, APeerWithLessRoomMakesThisRankTakeItsSlowerTiersAndFewerFastUnits) {
  Model m;
  const EngineConfig cfg = all_auto();
  const auto roomy = [](uint64_t device) { return TierBudgets{device, 1ull << 30, 1ull << 30}; };
  // The peer: compute copies on the host, the group in swap with one unit in host RAM, none on
  // the device (codes: tiers, then units not in host RAM, then units not on the device).
  Peer p{{int64_t(Placement::kHost), int64_t(Placement::kHost), int64_t(Placement::kNvme), int64_t(Placement::kNvme), 4, 5}};
  std::string report;
  const StatePlacement plan = resolve_placement(cfg, m.memory, {}, m.need, UINT64_MAX, roomy, p.agree(), report);
  ASSERT_EQ(p.calls, 1);
  EXPECT_EQ(p.last[0], int64_t(Placement::kDevice)) << "alone, this rank would have kept everything on the device";
  EXPECT_EQ(plan.params, Placement::kHost);
  EXPECT_EQ(plan.master, Placement::kNvme);
  EXPECT_EQ(plan.moments, Placement::kNvme);
  EXPECT_EQ(plan.device_units, 0u);
  EXPECT_EQ(plan.host_units, 1u);
  // The same peer, but this rank's host RAM cannot take what the peer's choice puts there.
  const auto tight_host = [](uint64_t device) { return TierBudgets{device, 1000, 1ull << 30}; };
  try {
    resolve_placement(cfg, m.memory, {}, m.need, UINT64_MAX, tight_host, p.agree(), report);
    FAIL() << "expected the agreed placement to be refused";
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find("another rank had less room"), std::string::npos) << e.what();
  }
}

TEST(ResolveRecompute, KeepsTheMostGraphsThatFitAndRecomputesAsManyAsAnyRankMust) {
  Model m;
  layout::Choices choice;
  choice.recomputed = 3;
  const uint64_t base = 77777;
  for (size_t keep = 0; keep <= 3; ++keep) {
    layout::Choices c = choice;
    c.recomputed = 3 - keep;
    const uint64_t usable = base + m.memory.working_set(c);  // exactly `keep` graphs fit
    Peer alone;
    EXPECT_EQ(resolve_recompute(m.memory, choice, base, usable, alone.agree(), 1), 3 - keep) << "keep " << keep;
    Peer peer{{3}};
    EXPECT_EQ(resolve_recompute(m.memory, choice, base, usable, peer.agree(), 1), 3u) << "a peer that must recompute all";
    if (keep < 3) {
      c.recomputed = 2 - keep;
      EXPECT_GT(base + m.memory.working_set(c), usable) << "one more kept graph would not fit: the test's premise";
    }
  }
}

// placement.recompute counts whole blocks: with blocks in 1 attention x 3 MLP tiles (4 stages a
// block), N blocks are 4 N stages, and "auto" keeps graphs only for whole blocks.
TEST(ResolveRecompute, CountsWholeBlocksOfTileStages) {
  const models::LayerTiles whole{1, 1, 1}, tiled{1, 3, 1};
  EXPECT_EQ(recomputed_stages(1, 3, whole), 1u);
  EXPECT_EQ(recomputed_stages(1, 8, tiled), 4u);
  EXPECT_EQ(recomputed_stages(0, 8, tiled), 0u);
  EXPECT_EQ(recomputed_stages(5, 8, tiled), 8u) << "more than the model has: all";
  EXPECT_EQ(recomputed_stages(EngineConfig::kRecomputeAll, 8, tiled), 8u);
  EXPECT_EQ(recomputed_stages(EngineConfig::kRecomputeAuto, 8, tiled), 8u) << "auto starts at the leanest";

  // Embedding, two blocks of 4 tile stages each, a tied head.
  const layout::Schedule schedule{{{0}, {1}, {2}, {3}, {4}, {5}, {6}, {7}, {8}, {9, 0}}, 10};
  layout::ModelSizes z = Model::sizes();
  z.padded_numel = {10240, 2048, 3072, 3072, 3072, 2048, 3072, 3072, 3072, 1024};
  z.shard_numel = {5120, 1024, 1536, 1536, 1536, 1024, 1536, 1536, 1536, 512};
  z.graph_bytes = {0, 9973, 9973, 9973, 9973, 9973, 9973, 9973, 9973, 0};
  const layout::MemoryModel memory(schedule, z);
  ASSERT_EQ(schedule.blocks(), 8u);
  layout::Choices choice;
  choice.recomputed = 8;
  const uint64_t base = 4321;
  for (size_t kept_stages = 0; kept_stages <= 8; ++kept_stages) {
    layout::Choices c = choice;
    c.recomputed = 8 - kept_stages;
    const uint64_t usable = base + memory.working_set(c);  // exactly `kept_stages` graphs fit
    Peer alone;
    const size_t got = resolve_recompute(memory, choice, base, usable, alone.agree(), 4);
    EXPECT_EQ(got, 8 - kept_stages / 4 * 4) << kept_stages << " stages' graphs fit: whole blocks only";
    EXPECT_EQ(got % 4, 0u);
  }
}

TEST(ResolveActivations, DeviceIfTheyFitElseHostElseSwapAndTheSlowestAnyRankChose) {
  Model m;
  EngineConfig cfg;
  cfg.activations = Placement::kAuto;
  cfg.nvme_dirs = {"/unused"};
  layout::Choices choice;
  choice.recomputed = 3;
  choice.activations = Placement::kAuto;
  layout::Choices on_device = choice;
  on_device.activations = Placement::kDevice;
  const uint64_t base = 4096, fits = base + m.memory.working_set(on_device);
  const uint64_t all = m.memory.checkpoint_bytes(choice);
  ASSERT_GT(all, 0u);
  const TierBudgets roomy{0, 1ull << 30, 1ull << 30}, no_host{0, all - 1, 1ull << 30};
  Peer alone;
  EXPECT_EQ(resolve_activations(cfg, m.memory, choice, base, fits, 0, roomy, alone.agree()), Placement::kDevice);
  EXPECT_EQ(resolve_activations(cfg, m.memory, choice, base, fits - 1, 0, roomy, alone.agree()), Placement::kHost);
  EXPECT_EQ(resolve_activations(cfg, m.memory, choice, base, fits - 1, 0, no_host, alone.agree()), Placement::kNvme);
  // A configured host budget holds the host state too.
  cfg.host_budget = 1ull << 30;
  const TierBudgets exact{0, all + 100, 1ull << 30};
  EXPECT_EQ(resolve_activations(cfg, m.memory, choice, base, fits - 1, 100, exact, alone.agree()), Placement::kHost);
  EXPECT_EQ(resolve_activations(cfg, m.memory, choice, base, fits - 1, 101, exact, alone.agree()), Placement::kNvme);
  cfg.host_budget = 0;
  cfg.nvme_dirs.clear();  // nowhere else to go
  EXPECT_EQ(resolve_activations(cfg, m.memory, choice, base, fits - 1, 0, no_host, alone.agree()), Placement::kHost);
  Peer slow{{int64_t(Placement::kNvme)}};
  EXPECT_EQ(resolve_activations(cfg, m.memory, choice, base, fits, 0, roomy, slow.agree()), Placement::kNvme);
  cfg.activations = Placement::kHost;  // explicit: kept, nobody asked
  Peer none;
  EXPECT_EQ(resolve_activations(cfg, m.memory, choice, base, fits, 0, roomy, none.agree()), Placement::kHost);
  EXPECT_EQ(none.calls, 0);
}

TEST(EffectiveConfig, ShowsEveryResolvedChoiceAndKeepsTheRest) {
  EngineConfig cfg = all_auto();
  cfg.activations = Placement::kAuto;
  cfg.recompute_blocks = EngineConfig::kRecomputeAuto;
  cfg.lr = 0.125;
  UnitTable units;
  units.stage_units = {{0}, {1}, {2}, {3}, {4, 0}};
  units.unit_numel = units.padded_numel = units.shard_numel = Model().shards;
  Layout layout(units, Model::sizes());
  layout.placement = {Placement::kDevice, Placement::kHost, Placement::kNvme, Placement::kNvme};
  layout.mlp_token_chunk = 96;
  layout::Choices choice;
  choice.activations = Placement::kHost;
  choice.recomputed = 2;
  const EngineConfig e = effective_config(cfg, layout, choice);
  EXPECT_EQ(e.mlp_token_chunk, 96);
  EXPECT_EQ(e.params, Placement::kDevice);
  EXPECT_EQ(e.grads, Placement::kHost);
  EXPECT_EQ(e.master, Placement::kNvme);
  EXPECT_EQ(e.moments, Placement::kNvme);
  EXPECT_EQ(e.activations, Placement::kHost);
  EXPECT_EQ(e.recompute_blocks, 2);
  EXPECT_EQ(e.lr, 0.125);
  EXPECT_EQ(cfg.master, Placement::kAuto) << "the given configuration is untouched";
}

// The error names where the scratch comes from when that is another use than the one that does
// not fit: here the embedding's forward fails, but most of what it needs is the block's gradient
// buffers (counted in every use's scratch), so the block tiles are the remedy.
TEST(CheckWorkingSet, NamesTheUseTheScratchComesFromAndTheBlockTilesWhenItIsABlocksBackward) {
  layout::Schedule schedule{{{0}, {1}, {2}}, 3};
  layout::ModelSizes z;
  z.padded_numel = {8192, 65536, 1024};
  z.shard_numel = {8192, 65536, 1024};
  z.compute_bytes = 4;
  z.tokens = 8;
  z.hidden = 16;
  z.vocab = 64;
  const layout::MemoryModel mm(schedule, z);
  EXPECT_EQ(mm.largest_scratch_use().stage, 1u);
  EXPECT_EQ(mm.largest_scratch_use().kind, layout::Use::kBackward);
  layout::Choices c;
  c.activations = Placement::kHost;
  c.recomputed = 1;
  const uint64_t first_need = mm.need(schedule.uses().front(), c);
  ASSERT_GT(mm.scratch(c), first_need / 2);
  const auto name = [](size_t u) { return std::vector<std::string>{"embedding", "block.0", "head"}.at(u); };
  try {
    check_working_set(EngineConfig{}, mm, c, 0, first_need - 1, name);
    ADD_FAILURE() << "the embedding's forward does not fit";
  } catch (const BudgetExceeded& e) {
    const std::string m = e.what();
    EXPECT_NE(m.find("cannot run unit embedding"), std::string::npos) << m;
    EXPECT_NE(m.find("(the largest, of unit block.0's backward)"), std::string::npos) << m;
    EXPECT_NE(m.find("the gradient buffers of unit block.0's backward"), std::string::npos) << m;
  }
}

}  // namespace
}  // namespace strata::engine
