// The device's working set: activation checkpoints on the device, the host or in swap, blocks
// kept without recompute, and the prefetch depth; each trains bitwise alike, counts in the
// budget, and "auto" chooses what fits as a plan (`--plan`) would.
#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>
#include <signal.h>
#include <sys/wait.h>
#include <torch/nn/utils/clip_grad.h>
#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <fstream>
#include <future>
#include <limits>
#include <map>
#include <optional>
#include <sstream>
#include <string>
#include <set>
#include <thread>
#include <utility>
#include <vector>

#include "strata/engine/comm.h"
#include "strata/engine/config.h"
#include "strata/engine/config_parse.h"
#include "strata/engine/placement.h"
#include "strata/engine/device.h"
#include "strata/engine/engine.h"
#include "strata/models/hf_io.h"
#include "strata/models/token_data.h"
#include "strata/offload/fault_injection.h"
#include "equivalence.h"
#include "launched.h"
#include "test_util.h"

namespace se = strata::engine;
namespace sm = strata::models;
using nlohmann::json;
using strata::test::TempDir;
using namespace strata::test;

namespace {

// --- activation checkpoints on the device, the host or in swap -------------------------------

// Where the checkpoints live changes no number: host, device and NVMe placement train bitwise
// alike (and like libtorch), and each moves exactly the checkpoint bytes its tier implies: none
// for the device; down and up once for the host; down, to swap, back and up once for NVMe.
// Host memory: all of a micro-batch's checkpoints for the host, at most three staging buffers
// for NVMe, none for the device.
TEST(EngineActivations, EveryPlacementTrainsBitwiseAlikeAndMovesItsBytes) {
  TempDir swap;
  json j = tiny_config(true, 6);
  j["run"]["steps"] = 6;
  j["offload"] = {{"nvme_dirs", {swap.path().string()}}};
  std::map<std::string, Trajectory> runs;
  const uint64_t budget = 1200 * 1024;  // about one unit: gathers and checkpoints share it
  for (const char* where : {"host", "device", "nvme"}) {
    // Whole blocks: the boundaries searched here are the checkpoints', not the blocks' tiles'.
    j["placement"] = {{"activations", where}, {"tiling", {{"attention", "off"}, {"mlp", "off"}}}};
    const se::TrainConfig tc = se::parse_train_config(j.dump(), "test");
    uint64_t peak = 0;
    runs[where] = run_in_process(tc, budget, &peak);
    EXPECT_LE(peak, budget) << where;
  }
  const se::TrainConfig tc = se::parse_train_config(j.dump(), "test");
  const Trajectory& host = runs.at("host");
  for (const char* where : {"device", "nvme"}) {
    const Trajectory& t = runs.at(where);
    for (size_t i = 0; i < host.losses.size(); ++i) EXPECT_EQ(t.losses[i], host.losses[i]) << where << " step " << i + 1;
    for (auto& [name, w] : host.params) EXPECT_TRUE(t.params.at(name).equal(w)) << where << " " << name;
  }
  expect_close(runs.at("nvme"), reference(tc, 1), 1e-5);

  const se::EngineConfig& e = tc.engine;
  const uint64_t one = uint64_t(e.micro_batch * e.seq_len * tc.model.hidden) * 4;  // one checkpoint
  EXPECT_EQ(host.host_activations, uint64_t(tc.model.layers) * one);
  EXPECT_EQ(runs.at("device").host_activations, 0u);
  EXPECT_GT(runs.at("nvme").host_activations, 0u);
  EXPECT_LE(runs.at("nvme").host_activations, 3 * one);
  // Inputs of every block (the embedding's input is the token ids), per micro-batch.
  const uint64_t acts = uint64_t(e.grad_accum * tc.model.layers) * one;
  for (size_t i = 1; i < host.steps.size(); ++i) {
    const se::StepTimeline& h = host.steps[i].timeline;
    const se::StepTimeline& d = runs.at("device").steps[i].timeline;
    const se::StepTimeline& n = runs.at("nvme").steps[i].timeline;
    EXPECT_EQ(h.d2h_bytes - d.d2h_bytes, acts) << "step " << i + 1;
    EXPECT_EQ(h.h2d_bytes - d.h2d_bytes, acts) << "step " << i + 1;
    EXPECT_EQ(n.d2h_bytes, h.d2h_bytes);
    EXPECT_EQ(n.h2d_bytes, h.h2d_bytes);
    EXPECT_EQ(h.nvme_write_bytes, 0u);
    EXPECT_EQ(n.nvme_write_bytes, acts) << "step " << i + 1;
    EXPECT_EQ(n.nvme_read_bytes, acts) << "step " << i + 1;
  }
}

// Device-placed checkpoints count against the budget: all of a micro-batch's, beside the
// working set. "auto" takes the device where they fit, else the host, else swap.
TEST(EngineActivations, DevicePlacementCountsInTheBudgetAndAutoPicksATier) {
  TempDir swap;
  json j = tiny_config(false, 6);
  j["run"]["steps"] = 2;
  j["offload"] = {{"nvme_dirs", {swap.path().string()}}};
  auto build = [&](const char* where, uint64_t budget) {
    // Whole blocks: the boundaries searched here are the checkpoints', not the blocks' tiles'.
    j["placement"] = {{"activations", where}, {"tiling", {{"attention", "off"}, {"mlp", "off"}}}};
    const se::TrainConfig tc = se::parse_train_config(j.dump(), "test");
    auto comm = se::Communicator::create(se::DistEnv{}, std::chrono::seconds(30));
    auto dev = se::Device::create_host(budget);
    se::Engine eng(std::make_unique<sm::Decoder>(tc.model, tc.init_seed), tc.engine, *comm, *dev);
    return std::string(se::to_string(eng.config().activations)) + " | " + eng.placement_report();
  };
  const se::TrainConfig tc = se::parse_train_config(j.dump(), "test");
  const uint64_t all = uint64_t(6 * tc.engine.micro_batch * tc.engine.seq_len * tc.model.hidden) * 4;
  // The smallest budget the host placement runs in: the device placement needs `all` more,
  // less the one checkpoint the host placement brings back ahead.
  uint64_t lo = 1 << 16, hi = 64 << 20;
  while (lo + 1024 < hi) {
    const uint64_t mid = (lo + hi) / 2;
    try {
      build("host", mid);
      hi = mid;
    } catch (const se::BudgetExceeded&) {
      lo = mid;
    }
  }
  try {
    build("device", hi);
    ADD_FAILURE() << "device-placed checkpoints fit in the host placement's smallest budget";
  } catch (const se::BudgetExceeded& e) {
    EXPECT_NE(std::string(e.what()).find("activation checkpoints on the device"), std::string::npos) << e.what();
  }
  EXPECT_EQ(build("device", hi + all).substr(0, 6), "device");
  EXPECT_EQ(build("auto", UINT64_MAX).substr(0, 6), "device");
  const std::string host = build("auto", hi);
  EXPECT_EQ(host.substr(0, 4), "host") << host;
  EXPECT_NE(host.find("activation checkpoints host"), std::string::npos) << host;
  j["offload"]["host_budget"] = "1KiB";  // no room on the host either: swap
  EXPECT_EQ(build("auto", hi).substr(0, 4), "nvme");
}

// --- blocks kept without recompute (placement.recompute) ------------------------------------

// Keeping a block's autograd graph instead of recomputing it changes no number: recomputing all,
// some or none of the blocks trains bitwise alike (and like libtorch), with checkpoints on the
// host or in swap; only the recomputed blocks' checkpoints are moved (down and up once, and to
// swap and back) and held on the host, and only recomputed blocks are gathered again.
TEST(EngineRecompute, KeptGraphsTrainBitwiseLikeRecomputeAndMoveOnlyTheirCheckpoints) {
  TempDir swap;
  json j = tiny_config(true, 6);
  j["run"]["steps"] = 6;
  j["offload"] = {{"nvme_dirs", {swap.path().string()}}};
  struct Run {
    json recompute;
    const char* activations;
    size_t recomputed;
  };
  const std::vector<Run> cases = {{"all", "host", 6}, {2, "host", 2}, {"none", "host", 0}, {3, "nvme", 3}, {"auto", "host", 0}};
  std::vector<Trajectory> runs;
  for (const Run& c : cases) {
    j["placement"] = {{"recompute", c.recompute}, {"activations", c.activations}};
    const se::TrainConfig tc = se::parse_train_config(j.dump(), "test");
    uint64_t peak = 0;
    runs.push_back(run_in_process(tc, UINT64_MAX, &peak));
  }
  const se::TrainConfig tc = se::parse_train_config(j.dump(), "test");
  const Trajectory& all = runs[0];
  for (size_t r = 1; r < runs.size(); ++r) {
    SCOPED_TRACE(cases[r].recompute.dump() + " " + cases[r].activations);
    for (size_t i = 0; i < all.losses.size(); ++i) EXPECT_EQ(runs[r].losses[i], all.losses[i]) << "step " << i + 1;
    for (auto& [name, w] : all.params) EXPECT_TRUE(runs[r].params.at(name).equal(w)) << name;
  }
  expect_close(runs[2], reference(tc, 1), 1e-5);

  const se::EngineConfig& e = tc.engine;
  const uint64_t one = uint64_t(e.micro_batch * e.seq_len * tc.model.hidden) * 4;  // one checkpoint
  uint64_t block_shard = 0;  // bytes of a block's compute-copy shard, copied up for each gather
  {
    auto comm = se::Communicator::create(se::DistEnv{}, std::chrono::seconds(30));
    auto dev = se::Device::create_host(UINT64_MAX);
    se::Engine eng(std::make_unique<sm::Decoder>(tc.model, tc.init_seed), e, *comm, *dev);
    block_shard = eng.partition().unit(2).shard_numel * 4;
  }
  for (size_t r = 0; r < runs.size(); ++r) {
    SCOPED_TRACE(cases[r].recompute.dump() + " " + cases[r].activations);
    const bool nvme = std::string(cases[r].activations) == "nvme";
    if (!nvme) EXPECT_EQ(runs[r].host_activations, cases[r].recomputed * one);
    // Kept blocks move no checkpoints, and stay gathered for their backward: no second copy
    // of their parameters up (the last block is not gathered twice either way).
    const uint64_t kept = 6 - cases[r].recomputed;
    const uint64_t acts = uint64_t(e.grad_accum) * kept * one;
    const uint64_t regathers = kept > 0 ? uint64_t(e.grad_accum) * (kept - 1) * block_shard : 0;
    for (size_t i = 1; i < all.steps.size(); ++i) {
      const se::StepTimeline& a = all.steps[i].timeline;
      const se::StepTimeline& t = runs[r].steps[i].timeline;
      EXPECT_EQ(a.d2h_bytes - t.d2h_bytes, acts) << "step " << i + 1;
      EXPECT_EQ(a.h2d_bytes - t.h2d_bytes, acts + regathers) << "step " << i + 1;
      const uint64_t swapped = nvme ? uint64_t(e.grad_accum) * cases[r].recomputed * one : 0;
      EXPECT_EQ(t.nvme_write_bytes, swapped) << "step " << i + 1;
      EXPECT_EQ(t.nvme_read_bytes, swapped) << "step " << i + 1;
    }
  }
}

// A kept block holds its graph (Decoder::block_graph_bytes_per_token) and its gathered
// parameters against the budget from its forward to its backward: "none" does not fit the
// smallest budget that recomputing everything runs in; "auto" keeps none there, all where the
// budget is unlimited, and some in between, within the budget and with the same numbers.
TEST(EngineRecompute, KeptGraphsCountInTheBudgetAndAutoKeepsWhatFits) {
  json j = tiny_config(false, 6);
  j["run"]["steps"] = 2;
  j["device"] = {{"prefetch", 0}};
  auto config = [&](json recompute) {
    // Whole blocks: the boundaries searched here are the kept graphs', not the blocks' tiles'.
    j["placement"] = {{"recompute", recompute}, {"tiling", {{"attention", "off"}, {"mlp", "off"}}}};
    return se::parse_train_config(j.dump(), "test");
  };
  auto recomputed = [&](json recompute, uint64_t budget) {
    const se::TrainConfig tc = config(recompute);
    auto comm = se::Communicator::create(se::DistEnv{}, std::chrono::seconds(30));
    auto dev = se::Device::create_host(budget);
    se::Engine eng(std::make_unique<sm::Decoder>(tc.model, tc.init_seed), tc.engine, *comm, *dev);
    return eng.config().recompute_blocks;
  };
  uint64_t lo = 1 << 16, hi = 64 << 20;  // the smallest budget recomputing everything runs in
  while (lo + 1024 < hi) {
    const uint64_t mid = (lo + hi) / 2;
    try {
      recomputed("all", mid);
      hi = mid;
    } catch (const se::BudgetExceeded&) {
      lo = mid;
    }
  }
  try {
    recomputed("none", hi);
    ADD_FAILURE() << "keeping every graph fit in the smallest budget of recomputing them all";
  } catch (const se::BudgetExceeded& e) {
    EXPECT_NE(std::string(e.what()).find("blocks kept without recompute"), std::string::npos) << e.what();
  }
  EXPECT_EQ(recomputed("auto", hi), 6);
  EXPECT_EQ(recomputed("auto", UINT64_MAX), 0);
  EXPECT_EQ(recomputed(4, UINT64_MAX), 4);
  EXPECT_EQ(recomputed(9, UINT64_MAX), 6) << "more than the model has: all of them";

  // Room for about three more blocks' graphs and parameters.
  const se::TrainConfig tc = config("auto");
  const sm::Decoder probe(tc.model, 0, sm::Decoder::Init::kDeferred);
  const uint64_t graph = uint64_t(tc.engine.micro_batch * tc.engine.seq_len) * probe.block_graph_bytes_per_token(4);
  const uint64_t block = uint64_t(12 * tc.model.hidden * tc.model.hidden + 13 * tc.model.hidden) * 4 * 2;
  const uint64_t budget = hi + 3 * (graph + block);
  const int chosen = recomputed("auto", budget);
  EXPECT_GT(chosen, 0);
  EXPECT_LT(chosen, 6);
  uint64_t peak = 0;
  const Trajectory some = run_in_process(config("auto"), budget, &peak);
  EXPECT_LE(peak, budget);
  const Trajectory every = run_in_process(config("all"), budget, &peak);
  for (size_t i = 0; i < every.losses.size(); ++i) EXPECT_EQ(some.losses[i], every.losses[i]) << "step " << i + 1;
  for (auto& [name, w] : every.params) EXPECT_TRUE(some.params.at(name).equal(w)) << name;
}

// `--plan` (plan_only: nothing allocated) decides recompute, the activation checkpoints' tier and
// the prefetch window as the run does: the same resolution of the working set, over the state the
// layout places counted as allocated. Over budgets from the smallest that runs to unlimited, a
// plan builds exactly where the run builds, with the same choices and the same report.
TEST(EngineRecompute, PlanDecidesTheWorkingSetAsTheRunDoes) {
  json j = tiny_config(false, 6);
  j["device"] = {{"prefetch", "auto"}};
  j["placement"] = {{"recompute", "auto"}, {"activations", "auto"}, {"tiling", {{"attention", "off"}, {"mlp", "off"}}}};
  const se::TrainConfig tc = se::parse_train_config(j.dump(), "test");
  auto comm = se::Communicator::create(se::DistEnv{}, std::chrono::seconds(30));
  struct Built {
    bool ok = false;
    int recomputed = -1;
    se::Placement activations = se::Placement::kAuto;
    std::string report;
  };
  const auto build = [&](uint64_t budget, bool plan) {
    se::EngineConfig ec = tc.engine;
    ec.plan_only = plan;
    auto dev = se::Device::create_host(budget);
    Built b;
    try {
      se::Engine eng(std::make_unique<sm::Decoder>(tc.model, tc.init_seed, sm::Decoder::Init::kDeferred), ec, *comm,
                     *dev);
      b = {true, eng.config().recompute_blocks, eng.config().activations, eng.placement_report()};
    } catch (const se::BudgetExceeded&) {
    }
    return b;
  };
  uint64_t lo = 1 << 16, hi = 64 << 20;  // the smallest budget the run builds with
  ASSERT_TRUE(build(hi, false).ok);
  while (lo + 1024 < hi) {
    const uint64_t mid = (lo + hi) / 2;
    (build(mid, false).ok ? hi : lo) = mid;
  }
  std::set<int> seen;
  const std::string plan_only = "; plan only";
  for (uint64_t budget : {lo, hi, hi + (hi >> 4), hi + (hi >> 3), hi + (hi >> 2), hi + (hi >> 1), 2 * hi, 4 * hi,
                          uint64_t(UINT64_MAX)}) {
    SCOPED_TRACE("budget " + std::to_string(budget));
    const Built run = build(budget, false), plan = build(budget, true);
    ASSERT_EQ(plan.ok, run.ok);
    if (!run.ok) continue;
    EXPECT_EQ(plan.recomputed, run.recomputed);
    EXPECT_EQ(plan.activations, run.activations);
    EXPECT_EQ(plan.report.substr(0, plan.report.find(plan_only)), run.report);
    EXPECT_NE(plan.report.find(plan_only), std::string::npos) << plan.report;
    seen.insert(run.recomputed);
  }
  EXPECT_GE(seen.size(), 3u) << "the budgets span all, some and none of the blocks recomputed";
}

// --- prefetch depth from the budget and the measured waits ----------------------------------

TEST(PrefetchDepth, GrowsWhileDeeperCutsTheWaitsUpToTheBudget) {
  se::PrefetchTuner t;
  t.deepest = 4;
  EXPECT_EQ(t.next(0.30), 2);  // waiting: one deeper
  EXPECT_EQ(t.next(0.15), 3);  // that halved the waits: one deeper again
  EXPECT_EQ(t.next(0.01), 3);  // 1% of the step is not worth more memory
  EXPECT_EQ(t.next(0.05), 4);  // waits came back: deeper
  EXPECT_EQ(t.next(0.04), 4) << "the budget holds no deeper window";
  EXPECT_FALSE(t.settled);

  se::PrefetchTuner bound;  // the transfers themselves are too slow: deeper does not help
  bound.deepest = 8;
  EXPECT_EQ(bound.next(0.20), 2);
  EXPECT_EQ(bound.next(0.19), 1) << "a deepening that cut the waits by less than 10% is undone";
  EXPECT_TRUE(bound.settled);
  EXPECT_EQ(bound.next(0.50), 1) << "and the depth stays there";

  se::PrefetchTuner tight;
  tight.deepest = 1;
  EXPECT_EQ(tight.next(0.5), 1) << "nothing deeper fits the budget";
}

// "auto" changes no number and only deepens, one unit a step at most, within its bound; with
// compute copies in swap every gather reads the disk, so steps wait for parameters.
TEST(PrefetchDepth, AutoTrainsBitwiseLikeAFixedDepth) {
  TempDir swap;
  json j = tiny_config(false, 6);
  j["run"]["steps"] = 8;
  j["placement"] = {{"params", "nvme"}, {"grads", "host"}, {"master", "host"}, {"moments", "host"}};
  j["offload"] = {{"nvme_dirs", {swap.path().string()}}};
  const se::TrainConfig fixed = se::parse_train_config(j.dump(), "test");
  j["device"] = {{"prefetch", "auto"}};
  const se::TrainConfig adaptive = se::parse_train_config(j.dump(), "test");
  ASSERT_TRUE(adaptive.engine.prefetch_auto);
  uint64_t peak = 0;
  const uint64_t budget = 4 << 20;
  const Trajectory a = run_in_process(fixed, budget, &peak);
  const Trajectory b = run_in_process(adaptive, budget, &peak);
  EXPECT_LE(peak, budget);
  for (size_t i = 0; i < a.losses.size(); ++i) EXPECT_EQ(a.losses[i], b.losses[i]) << "step " << i + 1;
  for (auto& [name, w] : a.params) EXPECT_TRUE(b.params.at(name).equal(w)) << name;
  EXPECT_EQ(b.steps.front().timeline.prefetch, 1);
  for (size_t i = 1; i < b.steps.size(); ++i) {
    const int before = b.steps[i - 1].timeline.prefetch, now = b.steps[i].timeline.prefetch;
    EXPECT_LE(std::abs(now - before), 1) << "step " << i + 1 << ": " << before << " -> " << now;
    EXPECT_GE(now, 1);
    EXPECT_LE(now, 8);
  }
  for (const se::StepResult& r : a.steps) EXPECT_EQ(r.timeline.prefetch, 1);
}

TEST(EngineRecompute, TwoRanksKeepingSomeGraphsMatchOneProcess) {
  TempDir dir;
  json j = tiny_config(false, 4);
  j["placement"] = {{"recompute", 1}};
  se::TrainConfig tc = se::parse_train_config(j.dump(), "test");
  expect_close(run_launched(tc, j, 2, dir), reference(tc, 2), 1e-5);
}

}  // namespace
