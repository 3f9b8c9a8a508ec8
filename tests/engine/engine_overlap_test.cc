// The optimizer update overlapped with training (optimizer.overlap "forward" and "backward"):
// bitwise the serial update's numbers with state on the host, the device or in swap, at one
// rank and two; the update during backward's gradient buffers, limits and non-finite steps.
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

// --- the update overlapped with the next step -------------------------------------------------

// The overlapped update gives bitwise the serial numbers, and it really runs behind: the
// overlapped run's first step has no optimizer work in it (its update runs during step 2), the
// serial run's has, and only the overlapped run waits for updates.
void expect_overlap_is_bitwise_serial(json j, uint64_t budget = 1200 * 1024) {
  j["run"]["steps"] = 8;
  j["optimizer"]["overlap"] = false;
  const se::TrainConfig serial = se::parse_train_config(j.dump(), "test");
  j["optimizer"]["overlap"] = true;
  const se::TrainConfig overlapped = se::parse_train_config(j.dump(), "test");
  ASSERT_EQ(overlapped.engine.update_overlap, se::UpdateOverlap::kForward);
  uint64_t peak = 0;
  // By default a budget that holds about one unit: every gather waits for its unit's update.
  const Trajectory a = run_in_process(serial, budget, &peak);
  const Trajectory b = run_in_process(overlapped, budget, &peak);
  ASSERT_EQ(a.losses.size(), b.losses.size());
  for (size_t i = 0; i < a.losses.size(); ++i) {
    EXPECT_EQ(a.losses[i], b.losses[i]) << "step " << i + 1;
    EXPECT_EQ(a.grad_norms[i], b.grad_norms[i]) << "step " << i + 1;
  }
  for (auto& [name, w] : a.params) EXPECT_TRUE(b.params.at(name).equal(w)) << name;
  EXPECT_GT(a.steps[0].timeline.optimizer, 0);
  EXPECT_EQ(b.steps[0].timeline.optimizer, 0);
  for (size_t i = 1; i < b.steps.size(); ++i) {
    EXPECT_GT(b.steps[i].timeline.optimizer, 0) << "step " << i + 1;
    EXPECT_EQ(a.steps[i].timeline.wait_update, 0) << "step " << i + 1;
  }
}

TEST(EngineOverlap, OverlappedUpdateIsBitwiseTheSerialOne) { expect_overlap_is_bitwise_serial(tiny_config(false, 4)); }

// --- the update during backward (optimizer.overlap "backward") --------------------------------

// The update during backward gives bitwise the serial numbers (clipping off, which it needs),
// inside its own step: its first step already holds optimizer work. It also really starts
// before the backward is over: in some step an update of a unit ends before the last stage's
// backward begins (the head's unit is final with every block's backward still to run, so one
// step of eight where the updater thread got a core in time is enough).
void expect_backward_overlap_is_bitwise_serial(json j, uint64_t budget = 1200 * 1024) {
  j["run"]["steps"] = 8;
  j["optimizer"]["clip_grad_norm"] = 0.0;
  j["optimizer"]["overlap"] = false;
  const se::TrainConfig serial = se::parse_train_config(j.dump(), "test");
  j["optimizer"]["overlap"] = "backward";
  se::TrainConfig backward = se::parse_train_config(j.dump(), "test");
  ASSERT_EQ(backward.engine.update_overlap, se::UpdateOverlap::kBackward);
  uint64_t peak = 0;
  const Trajectory a = run_in_process(serial, budget, &peak);
  const Trajectory b = run_in_process(backward, budget, &peak);
  ASSERT_EQ(a.losses.size(), b.losses.size());
  for (size_t i = 0; i < a.losses.size(); ++i) {
    EXPECT_EQ(a.losses[i], b.losses[i]) << "step " << i + 1;
    // Summed unit by unit here, chunk by chunk over all units there (NVMe gradients).
    EXPECT_NEAR(a.grad_norms[i], b.grad_norms[i], 1e-12 * a.grad_norms[i]) << "step " << i + 1;
    EXPECT_GT(b.steps[i].timeline.optimizer, 0) << "step " << i + 1;
  }
  for (auto& [name, w] : a.params) EXPECT_TRUE(b.params.at(name).equal(w)) << name;

  // Traced step by step: each step's device compute spans and its updates (the step joins them).
  backward.engine.profile = true;
  auto comm = se::Communicator::create(se::DistEnv{}, std::chrono::seconds(30));
  auto dev = se::Device::create_host(UINT64_MAX);
  se::Engine eng(std::make_unique<sm::Decoder>(backward.model, backward.init_seed), backward.engine, *comm, *dev);
  const se::EngineConfig& e = backward.engine;
  at::Tensor ids = at::randint(0, backward.model.vocab_size, {e.micro_batch * e.grad_accum, e.seq_len + 1}, at::kLong);
  bool overlapped = false;
  for (int64_t i = 0; i < backward.steps; ++i) {
    eng.train_step(ids);
    double last_backward_begin = 0, first_update_end = 1e300;
    size_t updates = 0;
    for (const se::TraceSpan& s : eng.take_trace()) {
      if (s.lane == "device compute" && s.name.find("backward") != std::string::npos && s.name.find("forward+") == std::string::npos)
        last_backward_begin = std::max(last_backward_begin, s.begin);
      if (s.lane == "optimizer") {
        ++updates;
        first_update_end = std::min(first_update_end, s.end);
      }
    }
    EXPECT_EQ(updates, eng.partition().num_units()) << "step " << i + 1;
    EXPECT_GT(last_backward_begin, 0) << "step " << i + 1;
    overlapped |= first_update_end < last_backward_begin;
    if (std::getenv("STRATA_TEST_VERBOSE"))
      printf("step %lld: first update ends %.6f s, last backward begins %.6f s\n", (long long)i + 1,
             first_update_end, last_backward_begin);
  }
  EXPECT_TRUE(overlapped) << "no update ran before its step's last backward";
}

TEST(EngineOverlap, UpdateDuringBackwardIsBitwiseTheSerialOne) {
  expect_backward_overlap_is_bitwise_serial(tiny_config(false, 4));  // tied: the embedding's last use is stage 0
}

TEST(EngineOverlap, UpdateDuringBackwardKeepingGraphsIsBitwiseTheSerialOne) {
  json j = tiny_config(true, 4);
  j["placement"] = {{"recompute", 1}};
  expect_backward_overlap_is_bitwise_serial(j, 8ull << 20);  // room for three graphs
}

// Master and moments streamed from swap, by either overlapped update.
TEST(EngineOverlap, UpdateStreamedFromNvmeIsBitwiseTheSerialOne) {
  TempDir swap;
  json j = tiny_config(true, 3);
  j["placement"] = {{"params", "host"}, {"grads", "host"}, {"master", "nvme"}, {"moments", "nvme"}};
  j["offload"] = {{"nvme_dirs", {swap.path().string()}}, {"optimizer_chunk", "16KiB"}};
  {
    SCOPED_TRACE("forward");
    expect_overlap_is_bitwise_serial(j);
  }
  SCOPED_TRACE("backward");
  expect_backward_overlap_is_bitwise_serial(j);
}

// Gradients in swap too: the update during backward waits for each unit's last gradient write.
TEST(EngineOverlap, UpdateWithAllStateOnNvmeIsBitwiseTheSerialOne) {
  TempDir swap;
  json j = tiny_config(false, 3);
  j["placement"] = {{"params", "nvme"}, {"grads", "nvme"}, {"master", "nvme"}, {"moments", "nvme"}};
  j["offload"] = {{"nvme_dirs", {swap.path().string()}}, {"optimizer_chunk", "16KiB"}};
  {
    SCOPED_TRACE("forward");
    expect_overlap_is_bitwise_serial(j);
  }
  SCOPED_TRACE("backward");
  expect_backward_overlap_is_bitwise_serial(j);
}

// Compute copies on the device, master on the host: the updater writes the device copies (on a
// GPU, by copies on a stream of its own) after their last read, before the next.
TEST(EngineOverlap, UpdateOfComputeCopiesOnTheDeviceIsBitwiseTheSerialOne) {
  json j = tiny_config(false, 3);
  j["placement"] = {{"params", "device"}, {"grads", "host"}, {"master", "host"}, {"moments", "host"}};
  {
    SCOPED_TRACE("forward");
    expect_overlap_is_bitwise_serial(j, 8ull << 20);
  }
  SCOPED_TRACE("backward");
  expect_backward_overlap_is_bitwise_serial(j, 8ull << 20);
}

// One micro-batch a step and the update during backward: no gradient accumulators. Each unit's
// gradient goes to a host buffer its update frees; gradients take no host or swap bytes and
// move no swap traffic, and the numbers are bitwise those of the serial update with stored
// gradients (and libtorch's). Tied GPT-2: the embedding's buffer is held from the head's reduce
// to the embedding's.
TEST(EngineOverlap, UpdateDuringBackwardWithOneMicroBatchStoresNoGradients) {
  TempDir swap;
  for (const char* master : {"host", "nvme"}) {
    SCOPED_TRACE(master);
    json j = tiny_config(false, 3);
    j["batch"] = {{"micro_batch", 2}, {"grad_accum", 1}};
    // Gradients placed explicitly (in swap beside a swapped master): ignored, as documented.
    j["placement"] = {{"params", "host"}, {"grads", master}, {"master", master}, {"moments", master}};
    j["offload"] = {{"nvme_dirs", {swap.path().string()}}, {"optimizer_chunk", "16KiB"}};
    expect_backward_overlap_is_bitwise_serial(j);

    j["optimizer"]["clip_grad_norm"] = 0.0;
    j["run"]["steps"] = 4;
    auto comm = se::Communicator::create(se::DistEnv{}, std::chrono::seconds(30));
    auto dev = se::Device::create_host(UINT64_MAX);
    std::map<std::string, se::MemoryReport> mem;
    std::map<std::string, se::StepTimeline> last;
    uint64_t numel = 0, embedding = 0, largest = 0;
    for (const char* overlap : {"off", "backward"}) {
      j["optimizer"]["overlap"] = overlap;
      const se::TrainConfig tc = se::parse_train_config(j.dump(), "test");
      se::Engine eng(std::make_unique<sm::Decoder>(tc.model, tc.init_seed), tc.engine, *comm, *dev);
      const bool backward = std::string(overlap) == "backward";
      EXPECT_EQ(eng.gradients_stored(), !backward);
      EXPECT_EQ(eng.placement_report().find("grads not stored") != std::string::npos, backward) << eng.placement_report();
      numel = 0;
      for (const se::UnitLayout& u : eng.partition().units()) {
        numel += u.shard_numel;
        largest = std::max(largest, u.shard_numel);
      }
      embedding = eng.partition().unit(0).shard_numel;
      at::Tensor ids = at::randint(0, tc.model.vocab_size, {2, tc.engine.seq_len + 1}, at::kLong);
      for (int s = 0; s < 3; ++s) last[overlap] = eng.train_step(ids).timeline;
      mem[overlap] = eng.memory();
    }
    const bool nvme = std::string(master) == "nvme";
    // Host: fp32 compute copies (4), and master and moments (12) where they are on the host;
    // without stored gradients, three buffers of the largest shard (two, and one for the tied
    // embedding, whose gradient is held from the head's reduce to the embedding's).
    EXPECT_EQ(mem["backward"].host_state, (nvme ? 4 : 16) * numel + 3 * 4 * largest);
    EXPECT_EQ(mem["off"].host_state, (nvme ? 4 : 20) * numel) << "stored: 4 more bytes per parameter";
    EXPECT_EQ(mem["backward"].nvme_state, nvme ? 12 * numel : 0);
    EXPECT_EQ(mem["off"].nvme_state, nvme ? 16 * numel : 0);
    // Swap traffic of a step: master and moments read and written; stored gradients also go
    // down to swap, and come back twice (for the norm, then for the update), and the tied
    // embedding's is read back and written again when its second contribution lands.
    EXPECT_EQ(last["backward"].nvme_read_bytes, nvme ? 12 * numel : 0);
    EXPECT_EQ(last["backward"].nvme_write_bytes, nvme ? 12 * numel : 0);
    EXPECT_EQ(last["off"].nvme_read_bytes, nvme ? 20 * numel + 4 * embedding : 0);
    EXPECT_EQ(last["off"].nvme_write_bytes, nvme ? 16 * numel + 4 * embedding : 0);
  }
  json j = tiny_config(true, 3);
  j["batch"] = {{"micro_batch", 2}, {"grad_accum", 1}};
  j["optimizer"]["clip_grad_norm"] = 0.0;
  j["optimizer"]["overlap"] = "backward";
  const se::TrainConfig tc = se::parse_train_config(j.dump(), "test");
  uint64_t peak = 0;
  expect_close(run_in_process(tc, UINT64_MAX, &peak), reference(tc, 1), 1e-5);
}

// The gradient buffers bound what a backward faster than its update holds: with the updater held
// back (it waits for a checkpoint's hold on the swap state before its first update), the
// backward of a 5-unit model with 3 buffers waits for buffers, and the numbers are unchanged.
TEST(EngineOverlap, GradientBuffersHoldTheBackwardBackWhenTheUpdateLags) {
  json j = tiny_config(false, 3);
  j["batch"] = {{"micro_batch", 2}, {"grad_accum", 1}};
  j["optimizer"]["clip_grad_norm"] = 0.0;
  j["optimizer"]["overlap"] = "backward";
  se::TrainConfig tc = se::parse_train_config(j.dump(), "test");
  tc.engine.profile = true;
  auto comm = se::Communicator::create(se::DistEnv{}, std::chrono::seconds(30));
  auto dev = se::Device::create_host(UINT64_MAX);
  at::Tensor ids = at::randint(0, tc.model.vocab_size, {2, tc.engine.seq_len + 1}, at::kLong);
  std::vector<double> losses;
  std::vector<at::Tensor> params;
  for (bool held : {false, true}) {
    se::Engine eng(std::make_unique<sm::Decoder>(tc.model, tc.init_seed), tc.engine, *comm, *dev);
    ASSERT_EQ(eng.partition().num_units(), 5u);
    eng.train_step(ids);
    auto hold = std::make_shared<se::StateHold>(eng.partition().num_units());
    std::thread release;
    if (held) {
      eng.hold_state(hold);
      release = std::thread([&] {
        // Far longer than the backward of this model takes, even on a loaded machine (300 ms
        // was not always enough there).
        std::this_thread::sleep_for(std::chrono::seconds(2));
        hold->release_all();
      });
    }
    eng.take_trace();
    const se::StepResult r = eng.train_step(ids);
    if (release.joinable()) release.join();
    size_t buffer_waits = 0;
    for (const se::TraceSpan& s : eng.take_trace()) buffer_waits += s.name.rfind("wait update (gradient buffers)", 0) == 0;
    if (held) {
      EXPECT_GE(buffer_waits, 1u) << "the backward went on past its buffers";
      EXPECT_GT(r.timeline.wait_update, 0);
      EXPECT_GE(r.seconds, 1.5) << "the update wrote before the hold was released";
    }
    losses.push_back(eng.train_step(ids).loss);
    for (auto& [n, p] : eng.gather_parameters()) params.push_back(p);
  }
  EXPECT_EQ(losses[0], losses[1]);
  ASSERT_EQ(params.size() % 2, 0u);
  for (size_t i = 0; i < params.size() / 2; ++i) EXPECT_TRUE(params[i].equal(params[i + params.size() / 2]));
}

TEST(EngineOverlap, UpdateDuringBackwardNeedsNoClippingAndNoFp16) {
  json j = tiny_config(false, 2);
  j["optimizer"]["overlap"] = "backward";
  try {
    se::parse_train_config(j.dump(), "cfg.json");  // tiny_config clips at 1.0
    ADD_FAILURE() << "clipping accepted";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("clip_grad_norm 0"), std::string::npos) << e.what();
  }
  j["optimizer"]["clip_grad_norm"] = 0.0;
  j["precision"] = {{"compute", "fp16"}};
  try {
    se::parse_train_config(j.dump(), "cfg.json");
    ADD_FAILURE() << "fp16 accepted";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("fp16"), std::string::npos) << e.what();
  }
  j.erase("precision");
  EXPECT_EQ(se::parse_train_config(j.dump(), "cfg.json").engine.update_overlap, se::UpdateOverlap::kBackward);
  j["optimizer"]["overlap"] = "sideways";
  try {
    se::parse_train_config(j.dump(), "cfg.json");
    ADD_FAILURE() << "a bad overlap accepted";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("cfg.json: optimizer.overlap must be"), std::string::npos) << e.what();
  }
  j["optimizer"]["overlap"] = false;
  EXPECT_EQ(se::parse_train_config(j.dump(), "cfg.json").engine.update_overlap, se::UpdateOverlap::kOff);
  j["optimizer"]["overlap"] = true;
  EXPECT_EQ(se::parse_train_config(j.dump(), "cfg.json").engine.update_overlap, se::UpdateOverlap::kForward);
}

// Already applied when the norm is known: a non-finite gradient cannot be skipped, so the step
// fails saying so (the serial and "forward" updates skip it) and the engine refuses to go on.
TEST(EngineOverlap, UpdateDuringBackwardFailsTheStepOnANonFiniteGradient) {
  json j = tiny_config(false, 2);
  j["optimizer"]["clip_grad_norm"] = 0.0;
  j["optimizer"]["lr"] = 1e30;  // weights of 1e30 after one step: the next forward overflows
  j["optimizer"]["overlap"] = "backward";
  const se::TrainConfig tc = se::parse_train_config(j.dump(), "test");
  auto comm = se::Communicator::create(se::DistEnv{}, std::chrono::seconds(30));
  auto dev = se::Device::create_host(UINT64_MAX);
  se::Engine eng(std::make_unique<sm::Decoder>(tc.model, tc.init_seed), tc.engine, *comm, *dev);
  at::Tensor ids = at::randint(0, tc.model.vocab_size, {tc.engine.micro_batch * tc.engine.grad_accum, tc.engine.seq_len + 1}, at::kLong);
  std::string error;
  for (int s = 0; s < 4 && error.empty(); ++s) try {
      const se::StepResult r = eng.train_step(ids);
      EXPECT_TRUE(std::isfinite(r.grad_norm)) << "a non-finite step returned";
    } catch (const std::runtime_error& e) {
      error = e.what();
    }
  EXPECT_NE(error.find("already applied the update"), std::string::npos) << error;
  EXPECT_THROW(eng.train_step(ids), std::runtime_error);
}

// Each rank updates its own shards during backward as its reduce-scatters land.
// With two micro-batches (gradients stored in swap) and with one (gradients not stored).
TEST(EngineOverlap, TwoRanksUpdatingDuringBackwardMatchOneProcess) {
  for (int accum : {2, 1}) {
    SCOPED_TRACE(accum);
    TempDir dir, swap;
    json j = tiny_config(true, 3);
    j["batch"]["grad_accum"] = accum;
    j["optimizer"]["clip_grad_norm"] = 0.0;
    j["optimizer"]["overlap"] = "backward";
    j["placement"] = {{"params", "host"}, {"grads", "nvme"}, {"master", "nvme"}, {"moments", "nvme"}};
    j["offload"] = {{"nvme_dirs", {swap.path().string()}}, {"optimizer_chunk", "32KiB"}};
    se::TrainConfig tc = se::parse_train_config(j.dump(), "test");
    expect_close(run_launched(tc, j, 2, dir), reference(tc, 2), 1e-5);
    EXPECT_NE(read_file(dir / "out.txt").find(accum == 1 ? "grads not stored" : "grads nvme"), std::string::npos)
        << read_file(dir / "out.txt");
  }
}

}  // namespace
