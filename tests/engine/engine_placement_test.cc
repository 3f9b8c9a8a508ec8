// Placement in the engine: "auto" resolved from the budgets (the optimizer group split over
// device, host and swap) and state in swap files train as plain libtorch does, at one rank and
// two; swap placement without directories is refused.
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

// Split by unit in the engine over the three tiers: the first unit's master, moments and
// gradients on the device (updated there), the next unit's master and moments in host RAM, the
// rest in swap; trains bitwise like the group wholly on the host or in swap, with either
// overlapped update or none, and only the swapped units' state moves through swap.
TEST(EngineAuto, SplitsTheOptimizerGroupOverDeviceHostAndSwapAndTrainsBitwiseAlike) {
  TempDir swap;
  json j = tiny_config(true, 3);
  j["run"]["steps"] = 5;
  j["offload"] = {{"nvme_dirs", {swap.path().string()}}, {"optimizer_chunk", "16KiB"}};
  std::vector<uint64_t> shard;
  // The working set (the memory model's) with every overlap mode this test runs: the update during
  // backward runs one micro-batch a step, of the same 2 sequences (the blocks' graphs, which grow
  // with the tokens, alike).
  json backward_cfg = j;
  backward_cfg["optimizer"]["overlap"] = "backward";
  backward_cfg["optimizer"]["clip_grad_norm"] = 0;
  backward_cfg["batch"] = {{"micro_batch", 2}, {"grad_accum", 1}};
  uint64_t working_set = 0, working_set_forward = 0;
  for (const json& cfg : {j, backward_cfg}) {
    json h = cfg;
    h["placement"] = {{"params", "host"}, {"grads", "host"}, {"master", "host"}, {"moments", "host"}, {"activations", "host"}};
    const se::TrainConfig tc = se::parse_train_config(h.dump(), "test");
    auto comm = se::Communicator::create(se::DistEnv{}, std::chrono::seconds(30));
    auto dev = se::Device::create_host(UINT64_MAX);
    se::Engine eng(std::make_unique<sm::Decoder>(tc.model, tc.init_seed), tc.engine, *comm, *dev);
    const uint64_t ws = eng.memory_model().working_set(eng.working_set_choices());
    working_set = std::max(working_set, ws);
    if (working_set_forward == 0) working_set_forward = ws;
    if (shard.empty())
      for (size_t u = 0; u < eng.partition().num_units(); ++u) shard.push_back(eng.partition().unit(u).shard_numel);
  }
  ASSERT_EQ(shard.size(), 5u);
  uint64_t all = 0;
  for (uint64_t n : shard) all += n;
  // The device holds the working set and unit 0's 16 bytes an element with every mode; beside
  // the smaller working set there is no room for unit 1's as well, nor for the fp32 compute
  // copies. Host RAM: fp32 compute copies, the other units' gradients, unit
  // 1's master and moments, and the host-placed activation checkpoints (3 blocks x 2 x 24 tokens
  // x 64 x fp32).
  const uint64_t budget = working_set + 16 * shard[0] + 4096;
  ASSERT_LT(budget - working_set_forward, 16 * (shard[0] + shard[1]));
  ASSERT_LT(budget - working_set_forward, 4 * all);
  const uint64_t checkpoints = 3 * 2 * 24 * 64 * 4;
  const uint64_t host = 4 * all + 4 * (all - shard[0]) + 12 * shard[1] + checkpoints + 1024;
  j["placement"] = {{"params", "auto"}, {"grads", "auto"}, {"master", "auto"}, {"moments", "auto"},
                    {"activations", "host"}};
  j["offload"]["host_budget"] = host;
  {
    const se::TrainConfig split = se::parse_train_config(j.dump(), "test");
    auto comm = se::Communicator::create(se::DistEnv{}, std::chrono::seconds(30));
    auto dev = se::Device::create_host(budget);
    se::Engine eng(std::make_unique<sm::Decoder>(split.model, split.init_seed), split.engine, *comm, *dev);
    const std::string first = se::format_bytes(4 * shard[0]) + " (units 0-0) + host ";
    EXPECT_NE(eng.placement_report().find("master device " + first), std::string::npos) << eng.placement_report();
    EXPECT_NE(eng.placement_report().find("grads device " + first), std::string::npos) << eng.placement_report();
    EXPECT_NE(eng.placement_report().find("(units 1-1) + nvme"), std::string::npos) << eng.placement_report();
    EXPECT_EQ(eng.optimizer_device_units(), 1u);
    EXPECT_EQ(eng.optimizer_host_units(), 2u);
    EXPECT_EQ(eng.config().master, se::Placement::kNvme);
    EXPECT_EQ(eng.config().grads, se::Placement::kHost);
    EXPECT_EQ(eng.config().params, se::Placement::kHost);
    const se::MemoryReport m = eng.memory();
    EXPECT_EQ(m.device_used, 16 * shard[0]);
    EXPECT_EQ(m.host_state, host - checkpoints - 1024);
    EXPECT_EQ(m.nvme_state, 12 * (all - shard[0] - shard[1]));
  }
  std::map<std::string, Trajectory> whole;
  for (const char* tier : {"host", "nvme"}) {
    json w = j;
    w["placement"] = {{"params", "host"}, {"grads", "host"}, {"master", tier}, {"moments", tier}, {"activations", "host"}};
    uint64_t peak = 0;
    whole[tier] = run_in_process(se::parse_train_config(w.dump(), "test"), budget, &peak);
  }
  for (const char* overlap : {"off", "forward", "backward"}) {
    SCOPED_TRACE(std::string("overlap ") + overlap);
    j["optimizer"]["overlap"] = overlap;
    const bool backward = std::string(overlap) == "backward";
    if (backward) {  // no clipping, one micro-batch: gradients not stored off the device
      j["optimizer"]["clip_grad_norm"] = 0;
      j["batch"] = {{"micro_batch", 2}, {"grad_accum", 1}};
      for (const char* tier : {"host", "nvme"}) {
        json w = j;
        w["optimizer"]["overlap"] = "off";
        w["placement"] = {{"params", "host"}, {"grads", "host"}, {"master", tier}, {"moments", tier}, {"activations", "host"}};
        uint64_t peak = 0;
        whole[tier] = run_in_process(se::parse_train_config(w.dump(), "test"), budget, &peak);
      }
    }
    const se::TrainConfig split = se::parse_train_config(j.dump(), "test");
    uint64_t peak = 0;
    const Trajectory got = run_in_process(split, budget, &peak);
    EXPECT_LE(peak, budget);
    for (auto& [tier, t] : whole) {
      ASSERT_EQ(got.losses.size(), t.losses.size());
      for (size_t i = 0; i < t.losses.size(); ++i) {
        EXPECT_EQ(got.losses[i], t.losses[i]) << tier << " step " << i + 1;
        // "backward" sums the streamed units' squares chunk by chunk (the norm only reported)
        if (backward) EXPECT_NEAR(got.grad_norms[i], t.grad_norms[i], 1e-12 * t.grad_norms[i]) << tier << " step " << i + 1;
        else EXPECT_EQ(got.grad_norms[i], t.grad_norms[i]) << tier << " step " << i + 1;
      }
      for (auto& [name, w] : t.params) EXPECT_TRUE(got.params.at(name).equal(w)) << tier << " " << name;
    }
    // Each step's update reads and writes master and moments of the swapped units only.
    for (size_t i = 1; i < got.steps.size(); ++i) {
      EXPECT_EQ(got.steps[i].timeline.nvme_read_bytes, 12 * (all - shard[0] - shard[1])) << "step " << i + 1;
      EXPECT_EQ(whole["nvme"].steps[i].timeline.nvme_read_bytes, 12 * all) << "step " << i + 1;
    }
    expect_close(got, reference(split, 1), 1e-5);
  }
}

// "auto" resolved from the budgets in the configuration, reported, and training as exactly as
// the explicit placement would.
TEST(EngineAuto, ResolvesFromBudgetsAndMatchesLibtorch) {
  TempDir swap;
  json j = tiny_config(true, 3);
  j["placement"] = {{"params", "auto"}, {"grads", "auto"}, {"master", "auto"}, {"moments", "auto"}};
  j["offload"] = {{"nvme_dirs", {swap.path().string()}}, {"optimizer_chunk", "16KiB"}};
  auto resolved = [&](const json& cfg, uint64_t budget) {
    const se::TrainConfig tc = se::parse_train_config(cfg.dump(), "test");
    auto comm = se::Communicator::create(se::DistEnv{}, std::chrono::seconds(30));
    auto dev = se::Device::create_host(budget);
    se::Engine eng(std::make_unique<sm::Decoder>(tc.model, tc.init_seed), tc.engine, *comm, *dev);
    EXPECT_NE(eng.placement_report().find("placement (auto)"), std::string::npos) << eng.placement_report();
    const se::EngineConfig& e = eng.config();
    return std::string(se::to_string(e.params)) + " " + se::to_string(e.grads) + " " +
           se::to_string(e.master) + " " + se::to_string(e.moments);
  };
  EXPECT_EQ(resolved(j, UINT64_MAX), "device device device device");
  // Each kind is 504 KiB (moments twice that); the working set (556 KiB) leaves less than that of
  // the budget: no kind fits beside it.
  const uint64_t budget = 1000 * 1024;
  j["offload"]["host_budget"] = "1GiB";
  EXPECT_EQ(resolved(j, budget), "host host host host") << "the device holds only the working set";
  // Room on the host for the gradients and the compute copies, not the rest.
  j["offload"]["host_budget"] = "1100KiB";
  EXPECT_EQ(resolved(j, budget), "host host nvme nvme");

  const se::TrainConfig tc = se::parse_train_config(j.dump(), "test");
  uint64_t peak = 0;
  Trajectory got = run_in_process(tc, budget, &peak);
  EXPECT_GT(got.steps.back().timeline.nvme_read_bytes, 0u) << "master and moments are in swap";
  se::TrainConfig want = tc;  // the libtorch reference ignores placement
  expect_close(got, reference(want, 1), 1e-5);
}

// --- NVMe placement ---------------------------------------------------------------------------

TEST(EngineNvme, AllStateOnNvmeMatchesLibtorch) {
  TempDir swap;
  json j = tiny_config(false, 4);
  j["placement"] = {{"params", "nvme"}, {"grads", "nvme"}, {"master", "nvme"}, {"moments", "nvme"}};
  // 16 KiB chunks: every unit streams through the optimizer in several chunks.
  j["offload"] = {{"nvme_dirs", {swap.path().string()}}, {"optimizer_chunk", "16KiB"}, {"queue_depth", 8}};
  se::TrainConfig tc = se::parse_train_config(j.dump(), "test");
  uint64_t peak = 0;
  Trajectory got = run_in_process(tc, 1200 * 1024, &peak);
  // 2e-5, not 1e-5: on an AVX-512 BF16 CPU (2026-11-24) GPT-2's fused q/k/v weights of blocks 0
  // and 3 end 1.07e-5 and 1.11e-5 away (their key part's gradient cancels across keys, so the
  // order of sums shows most there); every other weight stays within 6e-6.
  expect_close(got, reference(tc, 1), 2e-5);
}

TEST(EngineNvme, MixedPlacementLlamaAdamMatchesLibtorch) {
  TempDir a, b;
  json j = tiny_config(true, 3);
  j["optimizer"]["type"] = "adam";
  // Master and moments striped over two swap directories; gradients and compute copies on the
  // host.
  j["placement"] = {{"params", "host"}, {"grads", "host"}, {"master", "nvme"}, {"moments", "nvme"}};
  j["offload"] = {{"nvme_dirs", {a.path().string(), b.path().string()}}, {"optimizer_chunk", "64KiB"}};
  se::TrainConfig tc = se::parse_train_config(j.dump(), "test");
  uint64_t peak = 0;
  Trajectory got = run_in_process(tc, UINT64_MAX, &peak);
  expect_close(got, reference(tc, 1), 1e-5);
}

// Master, moments and gradients on the device and the compute copies in swap (what automatic
// placement picks when the compute copies fit nowhere else): the device's update writes each
// unit's compute copy to its swap file; training and a refresh of the compute copies match.
TEST(EngineNvme, ComputeCopiesInSwapBesideAnOptimizerOnTheDeviceMatchLibtorch) {
  TempDir swap;
  json j = tiny_config(false, 3);
  j["placement"] = {{"params", "nvme"}, {"grads", "device"}, {"master", "device"}, {"moments", "device"}};
  j["offload"] = {{"nvme_dirs", {swap.path().string()}}};
  const se::TrainConfig tc = se::parse_train_config(j.dump(), "test");
  uint64_t peak = 0;
  expect_close(run_in_process(tc, UINT64_MAX, &peak), reference(tc, 1), 1e-5);
  // A refresh rewrites the compute copies from the master weights: the same values, so the next
  // step's loss is unchanged.
  std::vector<double> losses[2];
  for (int refresh = 0; refresh < 2; ++refresh) {
    auto comm = se::Communicator::create(se::DistEnv{}, std::chrono::seconds(30));
    auto dev = se::Device::create_host(UINT64_MAX);
    se::Engine eng(std::make_unique<sm::Decoder>(tc.model, tc.init_seed), tc.engine, *comm, *dev);
    const se::EngineConfig& e = tc.engine;
    at::manual_seed(7);
    const at::Tensor ids = at::randint(0, tc.model.vocab_size, {e.micro_batch * e.grad_accum, e.seq_len + 1}, at::kLong);
    for (int s = 0; s < 3; ++s) {
      if (refresh && s == 2) eng.refresh_compute_copies();
      losses[refresh].push_back(eng.train_step(ids).loss);
    }
  }
  for (size_t s = 0; s < losses[0].size(); ++s) EXPECT_EQ(losses[0][s], losses[1][s]) << "step " << s + 1;
}

TEST(EngineNvme, StateReallyLivesInTheSwapFiles) {
  TempDir swap;
  json j = tiny_config(false, 2);
  j["placement"] = {{"params", "nvme"}, {"grads", "nvme"}, {"master", "nvme"}, {"moments", "nvme"}};
  j["offload"] = {{"nvme_dirs", {swap.path().string()}}};
  se::TrainConfig tc = se::parse_train_config(j.dump(), "test");
  auto comm = se::Communicator::create(se::DistEnv{}, std::chrono::seconds(30));
  auto dev = se::Device::create_host(UINT64_MAX);
  se::Engine eng(std::make_unique<sm::Decoder>(tc.model, tc.init_seed), tc.engine, *comm, *dev);
  const se::MemoryReport m = eng.memory();
  EXPECT_EQ(m.host_state, 0u);
  // fp32 master, two moments, gradient and compute copy of every (padded) parameter
  EXPECT_GE(m.nvme_state, 5 * param_bytes(tc.model));
  const auto file = swap.path() / "strata-swap-r00000-d0.bin";
  ASSERT_TRUE(std::filesystem::exists(file));
  EXPECT_GE(std::filesystem::file_size(file), m.nvme_state);
  // The master slice read back from swap is the initial weights.
  sm::Decoder init(tc.model, tc.init_seed);
  at::Tensor w = init.hf_parameters().front().second.reshape(-1);
  at::Tensor slice = eng.state_slice(0, se::state::kMaster);
  EXPECT_TRUE(slice.narrow(0, 0, w.numel()).equal(w));
}

TEST(EngineNvme, NvmePlacementWithoutDirectoriesIsRejected) {
  json j = tiny_config(false, 2);
  j["placement"] = {{"master", "nvme"}, {"moments", "nvme"}, {"grads", "nvme"}};
  try {
    se::parse_train_config(j.dump(), "cfg.json");
    FAIL() << "expected a configuration error";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("offload.nvme_dirs is empty"), std::string::npos) << e.what();
  }
  j["placement"] = {{"activations", "nvme"}};  // checkpoints in swap need directories too
  EXPECT_THROW(se::parse_train_config(j.dump(), "cfg.json"), std::invalid_argument);
  j["placement"] = {{"master", "nvme"}, {"moments", "host"}, {"grads", "host"}};
  j["offload"] = {{"nvme_dirs", {"/tmp"}}};
  EXPECT_THROW(se::parse_train_config(j.dump(), "cfg.json"), std::invalid_argument);
  j["placement"] = {{"master", "nvme"}, {"moments", "nvme"}, {"grads", "nvme"}};
  j["offload"] = {{"nvme_dirs", {"/nonexistent/strata-swap"}}};
  se::TrainConfig tc = se::parse_train_config(j.dump(), "cfg.json");
  auto comm = se::Communicator::create(se::DistEnv{}, std::chrono::seconds(30));
  auto dev = se::Device::create_host(UINT64_MAX);
  try {
    se::Engine eng(std::make_unique<sm::Decoder>(tc.model, tc.init_seed), tc.engine, *comm, *dev);
    FAIL() << "expected an error for a missing swap directory";
  } catch (const std::exception& e) {
    EXPECT_NE(std::string(e.what()).find("/nonexistent/strata-swap"), std::string::npos) << e.what();
  }
}

TEST(EngineNvme, TwoRanksWithStateOnNvmeMatchOneProcess) {
  TempDir dir, swap;
  json j = tiny_config(false, 3);
  j["placement"] = {{"params", "host"}, {"grads", "nvme"}, {"master", "nvme"}, {"moments", "nvme"}};
  j["offload"] = {{"nvme_dirs", {swap.path().string()}}, {"optimizer_chunk", "32KiB"}};
  j["optimizer"]["no_decay"] = {"bias", "norm", "embedding"};  // groups cut by chunks and ranks
  se::TrainConfig tc = se::parse_train_config(j.dump(), "test");
  expect_close(run_launched(tc, j, 2, dir), reference(tc, 2), 1e-5);
}

// Two ranks, each with a host budget that holds its gradients and compute copies and about two
// units' master and moments: both split alike (the fewest host units any rank chose) and the run
// matches one plain process.
TEST(EngineAuto, TwoRanksSplittingMasterByUnitMatchOneProcess) {
  TempDir dir, swap;
  json j = tiny_config(true, 3);
  j["run"]["steps"] = 6;
  j["placement"] = {{"params", "host"}, {"grads", "host"}, {"master", "auto"}, {"moments", "auto"}};
  j["offload"] = {{"nvme_dirs", {swap.path().string()}}, {"optimizer_chunk", "16KiB"}};
  uint64_t all = 0, first_two = 0;
  {
    const se::TrainConfig tc = se::parse_train_config(tiny_config(true, 3).dump(), "test");
    const sm::Decoder m(tc.model, 0, sm::Decoder::Init::kDeferred);
    std::vector<uint64_t> numel;
    for (sm::Stage* st : const_cast<sm::Decoder&>(m).stages()) {
      uint64_t n = 0;
      for (const at::Tensor& p : st->parameters()) n += uint64_t(p.numel());
      numel.push_back(n);
    }
    for (uint64_t n : numel) all += n;
    first_two = numel[0] + numel[1];
  }
  // Per rank: half of everything (shards), plus alignment slack.
  j["offload"]["host_budget"] = (8 * all + 12 * first_two) / 2 + 64 * 1024;
  se::TrainConfig tc = se::parse_train_config(j.dump(), "test");
  const Trajectory got = run_launched(tc, j, 2, dir);
  EXPECT_NE(read_file(dir / "out.txt").find(") + nvme"), std::string::npos) << read_file(dir / "out.txt");
  expect_close(got, reference(tc, 2), 1e-5);
}

// Two ranks placing everything automatically with a device that holds the working set and
// a little state: both give the device the same first units of the optimizer group, and the
// rest goes to host RAM and swap alike; the run matches one plain process.
TEST(EngineAuto, TwoRanksGivingTheDeviceTheFirstUnitsMatchOneProcess) {
  TempDir dir, swap;
  json j = tiny_config(true, 3);
  j["run"]["steps"] = 6;
  j["device"] = {{"budget", "1200KiB"}};
  j["placement"] = {{"params", "auto"}, {"grads", "auto"}, {"master", "auto"}, {"moments", "auto"}};
  j["offload"] = {{"nvme_dirs", {swap.path().string()}}, {"optimizer_chunk", "16KiB"}, {"host_budget", "600KiB"}};
  se::TrainConfig tc = se::parse_train_config(j.dump(), "test");
  const Trajectory got = run_launched(tc, j, 2, dir);
  const std::string out = read_file(dir / "out.txt");
  EXPECT_NE(out.find("master device "), std::string::npos) << out;
  EXPECT_NE(out.find("(units 0-"), std::string::npos) << out;
  EXPECT_NE(out.find("+ nvme "), std::string::npos) << out;
  const json start = json::parse(read_file(dir / "train.jsonl").substr(0, read_file(dir / "train.jsonl").find('\n')));
  EXPECT_GE(start["placement"]["optimizer_device_units"].get<int>(), 1) << start.dump();
  expect_close(got, reference(tc, 2), 1e-5);
}

}  // namespace
