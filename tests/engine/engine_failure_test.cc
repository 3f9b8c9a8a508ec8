// Failures during training: a failed swap read or write fails its step naming the swap file, a
// stopped download stream fails the update during backward instead of hanging, and a rank that
// is killed or whose swap fails makes the others fail promptly.
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

// Builds an engine on a tiny GPT-2 with `placement` and swap, then injects EIO into the first
// swap operation of `kind` after construction (which writes the initial state): the step fails
// with the I/O error naming the swap file, the fault fired once, and the engine then refuses to
// go on from undefined state.
// With `overlap`, that optimizer.overlap (and no clipping).
void expect_swap_fault_fails_the_step(const json& placement, strata::offload::IoRequest::Kind kind,
                                      const char* overlap = nullptr) {
  TempDir swap;
  json j = tiny_config(false, 3);
  j["placement"] = placement;
  if (overlap) {
    j["optimizer"]["overlap"] = overlap;
    j["optimizer"]["clip_grad_norm"] = 0.0;
  }
  j["offload"] = {{"nvme_dirs", {swap.path().string()}}};
  se::TrainConfig tc = se::parse_train_config(j.dump(), "test");
  auto faults = std::make_shared<strata::offload::RuleFaultInjector>();
  tc.engine.io_fault_injector = faults;
  auto comm = se::Communicator::create(se::DistEnv{}, std::chrono::seconds(30));
  auto dev = se::Device::create_host(UINT64_MAX);
  se::Engine eng(std::make_unique<sm::Decoder>(tc.model, tc.init_seed), tc.engine, *comm, *dev);
  faults->add({.kind = kind, .error = EIO, .uses = 1});
  at::Tensor ids = at::randint(0, tc.model.vocab_size, {tc.engine.micro_batch * tc.engine.grad_accum, tc.engine.seq_len + 1}, at::kLong);
  try {
    eng.train_step(ids);
    ADD_FAILURE() << "the failed swap operation went unnoticed";
  } catch (const std::exception& e) {
    EXPECT_NE(std::string(e.what()).find("strata-swap"), std::string::npos) << e.what();
    // ... and the state it was moving: "swap write of partition 'block.0.grad' ... of rank 0".
    EXPECT_NE(std::string(e.what()).find(" of partition '"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("of rank 0"), std::string::npos) << e.what();
  }
  EXPECT_EQ(faults->fired(), 1u);
  try {
    eng.train_step(ids);
    ADD_FAILURE() << "trained on from undefined state";
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find("failed half way"), std::string::npos) << e.what();
  }
}

// An activation checkpoint that cannot be written to swap.
TEST(EngineActivations, AFailedCheckpointWriteFailsTheStepNamingTheSwapFile) {
  expect_swap_fault_fails_the_step({{"activations", "nvme"}}, strata::offload::IoRequest::Kind::kWrite);
}

// A swap read that fails on the upload stream (a gather of NVMe-placed compute copies, or an
// activation checkpoint coming back): never trained on as if it had been read.
TEST(EngineActivations, AFailedSwapReadFailsTheStepNamingTheSwapFile) {
  for (const char* what : {"params", "activations"}) {
    SCOPED_TRACE(what);
    expect_swap_fault_fails_the_step({{what, "nvme"}}, strata::offload::IoRequest::Kind::kRead);
  }
}

// A gradient write to swap (submitted by the d2h stream, not waited for there; the step's first
// write is the head's gradient) fails the step at its end.
TEST(EngineNvme, AFailedGradientWriteFailsTheStepNamingTheSwapFile) {
  expect_swap_fault_fails_the_step({{"params", "host"}, {"grads", "nvme"}, {"master", "nvme"}, {"moments", "nvme"}},
                                   strata::offload::IoRequest::Kind::kWrite);
}

// The update during backward: a failed gradient write (the updater waits for it) and a failed
// read of the state it updates (the step's first swap read) fail that same step, not the next.
TEST(EngineOverlap, AFailedSwapOperationOfTheUpdateDuringBackwardFailsItsStep) {
  expect_swap_fault_fails_the_step({{"params", "host"}, {"grads", "nvme"}, {"master", "nvme"}, {"moments", "nvme"}},
                                   strata::offload::IoRequest::Kind::kWrite, "backward");
  expect_swap_fault_fails_the_step({{"params", "host"}, {"grads", "host"}, {"master", "nvme"}, {"moments", "nvme"}},
                                   strata::offload::IoRequest::Kind::kRead, "backward");
  // The training thread fails half way through the backward (an activation checkpoint that was
  // never written is needed), with the updater waiting for units that will not come: it stops.
  expect_swap_fault_fails_the_step({{"activations", "nvme"}}, strata::offload::IoRequest::Kind::kWrite, "backward");
}

// A download stream that stops running its work (as a CUDA stream does after an error) during
// the update during backward: the host functions that mark gradients final never run, so the
// updater would wait for them forever and the backward for the gradient buffers it holds. The
// step fails naming the stream instead, and the engine is destroyed without hanging.
TEST(EngineOverlap, AFailedDownloadStreamFailsTheUpdateDuringBackwardInsteadOfHanging) {
  json j = tiny_config(false, 4);  // tied GPT-2: 6 units, a pool of 3 gradient buffers
  j["optimizer"]["overlap"] = "backward";
  j["optimizer"]["clip_grad_norm"] = 0;
  j["batch"] = {{"micro_batch", 4}, {"grad_accum", 1}};
  j["placement"] = {{"params", "host"}, {"grads", "host"}, {"master", "host"}, {"moments", "host"}, {"activations", "device"}};
  const se::TrainConfig tc = se::parse_train_config(j.dump(), "test");
  auto comm = se::Communicator::create(se::DistEnv{}, std::chrono::seconds(30));
  // The head's reduce puts two pieces of work on the stream (a wait and the copy down); its
  // "final" mark, the third, is never run.
  auto dev = se::Device::create_host(UINT64_MAX, 2);
  const auto t0 = std::chrono::steady_clock::now();
  {
    se::Engine eng(std::make_unique<sm::Decoder>(tc.model, tc.init_seed), tc.engine, *comm, *dev);
    ASSERT_FALSE(eng.gradients_stored());
    const at::Tensor ids = at::randint(0, tc.model.vocab_size, {4, tc.engine.seq_len + 1}, at::kLong);
    try {
      eng.train_step(ids);
      FAIL() << "the step succeeded without its gradients";
    } catch (const std::exception& e) {
      EXPECT_NE(std::string(e.what()).find("d2h stream: injected failure"), std::string::npos) << e.what();
    }
    EXPECT_THROW(eng.train_step(ids), std::runtime_error) << "a failed step leaves the engine broken";
  }
  EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(), 30.0);
}

// Rank 0, left alone with a dead or failed peer: exits non-zero well within `within`, saying
// which collective of which rank failed.
void expect_survivor_fails(RankProcesses& rp, std::chrono::seconds within) {
  const std::optional<int> status = rp.wait_exit(0, within);
  ASSERT_TRUE(status) << "rank 0 still running " << within.count() << " s after its peer failed:\n" << rp.err(0);
  const std::string err = rp.err(0);
  ASSERT_TRUE(WIFEXITED(*status)) << "rank 0 died of signal " << WTERMSIG(*status) << ":\n" << err;
  EXPECT_NE(WEXITSTATUS(*status), 0);
  EXPECT_NE(err.find("strata: error:"), std::string::npos) << err;
  EXPECT_NE(err.find("rank 0 of 2"), std::string::npos) << err;
}

TEST(EngineEquivalence, KilledRankMakesTheOtherFailWithinTheTimeout) {
  TempDir dir;
  json j = tiny_config(false, 4);
  j["run"]["steps"] = 100000;
  j["distributed"] = {{"timeout_s", 10}};
  RankProcesses rp = start_ranks(j, 2, dir);
  if (!wait_for_training(rp, 4)) return;
  // Killed in the middle of a step.
  kill(rp.pids[1], SIGKILL);
  ASSERT_TRUE(rp.wait_exit(1, std::chrono::seconds(10)));
  expect_survivor_fails(rp, std::chrono::seconds(15));
}

// Three ranks saving a checkpoint after every step, in the background; one is killed with -9
// at a moment that varies by trial (each rank in turn, at once or some milliseconds into the
// next step or save). Every survivor exits non-zero on its own (no launcher here) well within
// the collective timeout, saying so and naming the dead rank: a failed collective ends the
// process at once
// (Communicator::set_failure_handler in strata train) instead of unwinding into joins of
// threads that wait on the broken world, which printed nothing until the timeout.
TEST(EngineEquivalence, ARankKilledDuringAsynchronousSavesFailsEverySurvivorPromptly) {
  for (int trial = 0; trial < 3; ++trial) {
    SCOPED_TRACE("trial " + std::to_string(trial));
    TempDir dir;
    json j = tiny_config(false, 3);
    j["run"]["steps"] = 100000;
    j["run"]["save_every"] = 1;
    j["run"]["checkpoint_dir"] = (dir / "ckpt").string();
    j["distributed"] = {{"timeout_s", 20}};
    RankProcesses rp = start_ranks(j, 3, dir);
    if (!wait_for_training(rp, 4)) return;
    std::this_thread::sleep_for(std::chrono::milliseconds(37 * trial));
    const int victim = (trial + 1) % 3;
    const pid_t victim_pid = rp.pids[victim];
    kill(victim_pid, SIGKILL);
    ASSERT_TRUE(rp.wait_exit(victim, std::chrono::seconds(10)));
    for (int r = 0; r < 3; ++r) {
      if (r == victim) continue;
      const std::optional<int> status = rp.wait_exit(r, std::chrono::seconds(12));
      ASSERT_TRUE(status) << "rank " << r << " still running 12 s after rank " << victim << " was killed:\n"
                          << rp.err(r);
      expect_survivor_names_the_dead(rp, r, *status, victim, victim_pid);
    }
  }
}

// A rank whose swap fails under it (its swap file truncated, as a failing drive might leave it)
// fails its step naming the partition and itself, exits, and the other rank fails within
// seconds, not after distributed.timeout_s: in every overlap mode, with the optimizer reading
// master and moments from swap (the updater thread's reads fail where the update runs).
TEST(EngineEquivalence, ASwapFailureOnOneRankFailsBothRanksPromptly) {
  for (const char* overlap : {"off", "forward", "backward"}) {
    SCOPED_TRACE(overlap);
    TempDir dir, swap;
    json j = tiny_config(false, 4);
    j["run"]["steps"] = 100000;
    j["distributed"] = {{"timeout_s", 120}};
    j["optimizer"]["overlap"] = overlap;
    j["optimizer"]["clip_grad_norm"] = 0.0;
    j["placement"] = {{"params", "host"}, {"grads", "host"}, {"master", "nvme"}, {"moments", "nvme"}};
    j["offload"] = {{"nvme_dirs", {swap.path().string()}}};
    RankProcesses rp = start_ranks(j, 2, dir);
    if (!wait_for_training(rp, 4)) return;
    // Truncated until rank 1 exits: a write landing after one truncation grows the file again
    // (holes read as zeros, no error), so a single cut could go unnoticed.
    std::optional<int> failed;
    for (int i = 0; i < 600 && !(failed = rp.wait_exit(1, std::chrono::seconds(0))); ++i) {
      std::error_code gone;  // the file goes when rank 1 exits
      std::filesystem::resize_file(swap / "strata-swap-r00001-d0.bin", 0, gone);
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
    ASSERT_TRUE(failed) << "rank 1 still running 30 s after its swap file was truncated:\n" << rp.err(1);
    EXPECT_TRUE(WIFEXITED(*failed) && WEXITSTATUS(*failed) != 0) << rp.err(1);
    const std::string err = rp.err(1);
    EXPECT_NE(err.find("swap read of partition '"), std::string::npos) << err;
    EXPECT_NE(err.find("of rank 1: read "), std::string::npos) << err;
    EXPECT_NE(err.find("strata-swap-r00001-d0.bin"), std::string::npos) << err;
    expect_survivor_fails(rp, std::chrono::seconds(20));
  }
}

}  // namespace
