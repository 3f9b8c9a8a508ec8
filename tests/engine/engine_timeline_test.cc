// What the engine reports of its work: each step's timeline (bytes moved, compute and optimizer
// time) and trace, and construction's progress unit by unit.
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

// --- the per-step timeline --------------------------------------------------------------------

struct Profiled {
  std::vector<se::StepResult> steps;
  std::vector<se::TraceSpan> spans;
  uint64_t shard_bytes = 0;  // sum over units of this rank's fp32 shard
};

Profiled run_profiled(const se::TrainConfig& tc) {
  auto comm = se::Communicator::create(se::DistEnv{}, std::chrono::seconds(30));
  auto dev = se::Device::create_host(UINT64_MAX);
  const se::EngineConfig& e = tc.engine;
  auto corpus = std::make_shared<sm::TokenCorpus>(tc.data_path, sm::parse_token_format(tc.data_format),
                                                  uint64_t(tc.model.vocab_size));
  sm::BatchLoader loader(corpus, uint64_t(e.seq_len), uint64_t(e.micro_batch * e.grad_accum), 0, 1, tc.data_seed);
  se::Engine eng(std::make_unique<sm::Decoder>(tc.model, tc.init_seed), e, *comm, *dev);
  Profiled out;
  for (const se::UnitLayout& u : eng.partition().units()) out.shard_bytes += u.shard_numel * 4;
  at::Tensor ids = at::empty({e.micro_batch * e.grad_accum, e.seq_len + 1}, at::kLong);
  for (int64_t s = 0; s < tc.steps; ++s) {
    loader.next(ids.data_ptr<int64_t>());
    out.steps.push_back(eng.train_step(ids));
  }
  eng.gather_parameters();  // waits for the last step's overlapped update
  out.spans = eng.take_trace();
  return out;
}

// The timeline's byte counts are exactly what the schedule moves, its compute time fits in the
// step, and the trace holds a device compute span per stage and micro-batch and the updater's.
TEST(EngineTimeline, CountsWhatTheScheduleMovesOnTheHostDevice) {
  json j = tiny_config(true, 3);  // untied: each unit's gradient is reduced once per micro-batch
  j["run"]["steps"] = 3;
  se::TrainConfig tc = se::parse_train_config(j.dump(), "test");
  tc.engine.profile = true;
  const Profiled p = run_profiled(tc);
  const se::EngineConfig& e = tc.engine;
  const int64_t L = tc.model.layers, A = e.grad_accum;
  // Down: every unit's reduced fp32 gradient shard once per micro-batch, and the input of
  // every block but the first (the embedding's input is the token ids) as a checkpoint.
  const uint64_t acts = uint64_t(L * e.micro_batch * e.seq_len * tc.model.hidden) * 4;
  for (size_t i = 0; i < p.steps.size(); ++i) {
    const se::StepTimeline& t = p.steps[i].timeline;
    EXPECT_EQ(t.d2h_bytes, uint64_t(A) * (p.shard_bytes + acts)) << "step " << i + 1;
    EXPECT_GE(t.h2d_bytes, uint64_t(A) * (p.shard_bytes + acts)) << "every unit is gathered each micro-batch";
    EXPECT_EQ(t.nvme_read_bytes, 0u);
    EXPECT_EQ(t.nvme_write_bytes, 0u);
    EXPECT_GT(t.compute_busy, 0);
    EXPECT_LE(t.compute_busy, p.steps[i].seconds);
  }
  size_t compute = 0, updates = 0;
  for (const se::TraceSpan& s : p.spans) {
    EXPECT_LE(s.begin, s.end) << s.name;
    compute += s.lane == "device compute";
    updates += s.lane == "optimizer";
  }
  const size_t stages = size_t(L) + 2;  // embedding, blocks, head
  EXPECT_EQ(compute, p.steps.size() * size_t(A) * (2 * stages - 1));  // the head's once
  EXPECT_EQ(updates, p.steps.size() * stages);
}

TEST(EngineTimeline, CountsTheSwapTrafficOfTheStreamedOptimizer) {
  TempDir swap;
  json j = tiny_config(true, 2);
  j["run"]["steps"] = 3;
  j["placement"] = {{"master", "nvme"}, {"moments", "nvme"}};
  j["offload"] = {{"nvme_dirs", {swap.path().string()}}, {"optimizer_chunk", "16KiB"}};
  j["optimizer"]["overlap"] = false;  // the update inside its own step, on the critical path
  const se::TrainConfig tc = se::parse_train_config(j.dump(), "test");
  const Profiled p = run_profiled(tc);
  for (size_t i = 1; i < p.steps.size(); ++i) {  // step 1 also counts the initial state written
    const se::StepTimeline& t = p.steps[i].timeline;
    EXPECT_EQ(t.nvme_read_bytes, 3 * p.shard_bytes) << "master and moments read once";
    EXPECT_EQ(t.nvme_write_bytes, 3 * p.shard_bytes) << "master and moments written once";
    EXPECT_GT(t.optimizer, 0);
    EXPECT_EQ(t.optimizer_exposed, t.optimizer) << "not overlapped: all of it is exposed";
    EXPECT_EQ(t.compute_busy, -1) << "not profiled";
  }
  EXPECT_TRUE(p.spans.empty());
}

// Construction reports each unit as its initial weights reach their shards (and swap files), in
// order, on the constructing thread.
TEST(EngineProgress, ConstructionReportsEveryUnitInOrder) {
  TempDir swap;
  json j = tiny_config(false, 4);
  j["placement"] = {{"master", "nvme"}, {"moments", "nvme"}};
  j["offload"] = {{"nvme_dirs", {swap.path().string()}}};
  se::TrainConfig tc = se::parse_train_config(j.dump(), "test");
  std::vector<std::pair<size_t, size_t>> calls;
  const auto caller = std::this_thread::get_id();
  tc.engine.on_unit_placed = [&](size_t done, size_t total) {
    EXPECT_EQ(std::this_thread::get_id(), caller);
    calls.emplace_back(done, total);
  };
  auto comm = se::Communicator::create(se::DistEnv{}, std::chrono::seconds(30));
  auto dev = se::Device::create_host(UINT64_MAX);
  se::Engine eng(std::make_unique<sm::Decoder>(tc.model, tc.init_seed, sm::Decoder::Init::kDeferred), tc.engine,
                 *comm, *dev);
  const size_t units = eng.partition().num_units();
  ASSERT_EQ(units, 6u);  // embedding, 4 blocks, head
  ASSERT_EQ(calls.size(), units);
  for (size_t i = 0; i < units; ++i) EXPECT_EQ(calls[i], std::make_pair(i + 1, units));
}

}  // namespace
