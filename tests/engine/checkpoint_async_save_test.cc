// Asynchronous saves (AsyncCheckpointer): the state of the moment a save started, held unit by
// unit until the writer copied it in every update mode, through staging smaller than a unit and
// file to file from swap; a save that fails commits nothing and releases the engine.
#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>
#include <signal.h>
#include <sys/mount.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <atomic>
#include <cstring>
#include <fstream>
#include <functional>
#include <iomanip>
#include <numeric>
#include <thread>
#include <random>
#include <sstream>

#include "strata/engine/checkpoint.h"
#include "strata/engine/comm.h"
#include "strata/engine/config.h"
#include "strata/engine/config_parse.h"
#include "strata/engine/device.h"
#include "strata/engine/engine.h"
#include "strata/models/hf_io.h"
#include "strata/models/model_config.h"
#include "strata/models/safetensors.h"
#include "strata/models/token_data.h"
#include "strata/offload/crc32c.h"
#include "strata/offload/fault_injection.h"
#include "checkpoint_trainer.h"
#include "launched.h"
#include "saved_chunks.h"
#include "test_util.h"
#include "checkpoint_names.h"

namespace {

// The background save holds the state of the moment it started, however far training goes on
// before it commits.
TEST(Checkpoint, AsyncSaveSnapshotsTheStateWhileTrainingContinues) {
  TempDir dir;
  const se::TrainConfig tc = se::parse_train_config(tiny_llama(20).dump(), "test");
  Losses straight, resumed;
  Trainer a(tc);
  a.train(10, straight);
  se::AsyncCheckpointer ck(a.comm());
  ck.start(a.engine(), dir.path(), "step-10", a.meta());
  EXPECT_TRUE(ck.in_flight());
  std::optional<std::filesystem::path> committed;
  for (int s = 0; s < 10; ++s) {
    a.train(1, straight);  // updates the state the save is writing
    if (auto c = ck.poll()) committed = c;
  }
  if (!committed) committed = ck.finish();
  ASSERT_TRUE(committed.has_value());
  EXPECT_FALSE(ck.in_flight());
  EXPECT_EQ(se::latest_checkpoint(dir.path()), committed);
  EXPECT_GT(se::verify_checkpoint(*committed), 0u);
  Trainer b(tc);
  b.load(*committed);
  b.train(10, resumed);
  for (size_t i = 0; i < 10; ++i) EXPECT_EQ(resumed.losses[i], straight.losses[10 + i]) << "step " << 11 + i;
  expect_bitwise(b.params(), a.params());
}

// An asynchronous save whose writer releases each unit only once the engine is waiting for it
// (or after 20 s), while training goes on: every update after the save waits for its unit's
// release, in the order the writer goes, so the checkpoint holds the state of the moment the
// save started and resumes bitwise, and the waits show in the timeline. Returns the seconds the
// updates waited.
// Polls `done` every millisecond for up to 20 s; returns its last value.
bool wait_until(const std::function<bool()>& done) {
  const auto give_up = std::chrono::steady_clock::now() + std::chrono::seconds(20);
  while (!done() && std::chrono::steady_clock::now() < give_up)
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  return done();
}

double async_save_with_slow_writer(const json& cfg, const se::CheckpointOptions& base,
                                   se::SaveReport* report = nullptr) {
  TempDir dir, swap_b;
  const se::TrainConfig tc = se::parse_train_config(cfg.dump(), "test");
  Losses straight, resumed;
  Trainer a(tc);
  a.train(10, straight);
  se::CheckpointOptions options = base;
  std::vector<size_t> released, unwaited;
  options.before_release = [&](size_t u, const se::StateHold& hold) {
    if (!wait_until([&] { return hold.waited_for(u); })) unwaited.push_back(u);
    released.push_back(u);
  };
  se::AsyncCheckpointer ck(a.comm(), options);
  ck.start(a.engine(), dir.path(), "step-10", a.meta());
  std::optional<std::filesystem::path> committed;
  for (int s = 0; s < 10; ++s) {
    a.train(1, straight);
    if (auto c = ck.poll()) committed = c;
  }
  if (!committed) committed = ck.finish();
  std::vector<size_t> each_once = released;
  std::sort(each_once.begin(), each_once.end());
  std::vector<size_t> all_units(a.engine().partition().num_units());
  std::iota(all_units.begin(), all_units.end(), size_t(0));
  EXPECT_EQ(each_once, all_units) << "every unit released once by the writer";
  // The writer goes in Engine::update_order(); an update that reached its units in another order
  // would wait for a unit the writer has not come to, and this unit's hook would time out.
  EXPECT_TRUE(unwaited.empty()) << "an update went ahead without waiting for its unit, or waited "
                                   "for another one first: " << ::testing::PrintToString(unwaited);
  EXPECT_TRUE(committed.has_value());
  if (!committed) return 0;
  if (report) *report = ck.last_report();
  EXPECT_GT(se::verify_checkpoint(*committed), 0u);
  se::TrainConfig tcb = tc;
  if (!tcb.engine.nvme_dirs.empty()) tcb.engine.nvme_dirs = {swap_b.path().string()};
  Trainer b(tcb);
  b.load(*committed);
  b.train(10, resumed);
  for (size_t i = 0; i < 10; ++i) EXPECT_EQ(resumed.losses[i], straight.losses[10 + i]) << "step " << 11 + i;
  expect_bitwise(b.params(), a.params());
  double waited = 0;
  for (size_t i = 10; i < straight.wait_checkpoint.size(); ++i) waited += straight.wait_checkpoint[i];
  return waited;
}

// Every path that changes the saved state waits for the hold: the CPU update after backward
// ("off"), behind the next forward ("forward"), during backward ("backward"), and the update of
// state on the device (the host device stands in), each with a writer far slower than a step.
TEST(Checkpoint, AsyncSaveHoldsEachUnitUntilTheWriterCopiedItInEveryUpdateMode) {
  TempDir swap;
  for (const std::string mode : {"off", "forward", "backward", "backward, gradients in swap", "device"}) {
    SCOPED_TRACE(mode);
    json j = tiny_llama(20);
    if (mode == "device") {
      j["placement"] = {{"params", "device"}, {"grads", "device"}, {"master", "device"}, {"moments", "device"}};
    } else {
      j["optimizer"]["overlap"] = mode.substr(0, mode.find(','));
      if (mode.starts_with("backward")) j["optimizer"]["clip_grad_norm"] = 0.0;
      if (mode == "backward, gradients in swap") {  // the updater takes the final units in batches
        j["placement"] = {{"params", "host"}, {"grads", "nvme"}, {"master", "nvme"}, {"moments", "nvme"}};
        j["offload"] = {{"nvme_dirs", {swap.path().string()}}, {"optimizer_chunk", "16KiB"}};
      }
    }
    EXPECT_GT(async_save_with_slow_writer(j, {}), 0.0) << "no update waited for the writer";
  }
}

// Master and moments in swap, copied file to file unit by unit: the update of each waits for it.
TEST(Checkpoint, AsyncSaveHoldsNvmeStateUnitByUnit) {
  TempDir swap;
  json j = tiny_llama(20);
  j["placement"] = {{"params", "host"}, {"grads", "host"}, {"master", "nvme"}, {"moments", "nvme"}};
  j["offload"] = {{"nvme_dirs", {swap.path().string()}}, {"optimizer_chunk", "16KiB"}};
  EXPECT_GT(async_save_with_slow_writer(j, {}), 0.0);
}

// Units larger than the staging memory (three 4 MiB chunks of each kind, through two staging
// buffers): each buffer is reused once its write is done, and the save is still exact.
TEST(Checkpoint, AsyncSaveThroughStagingSmallerThanAUnit) {
  json j = tiny_llama(20);
  j["model"]["hidden"] = 512;
  j["model"]["heads"] = 8;
  j["model"]["kv_heads"] = 8;
  j["model"]["intermediate"] = 1024;
  j["batch"] = {{"micro_batch", 1}, {"grad_accum", 1}};
  {
    Trainer t(se::parse_train_config(j.dump(), "test"));
    ASSERT_GT(t.engine().partition().unit(1).shard_numel, 2u << 20) << "a unit of more than 8 MiB a kind";
  }
  se::CheckpointOptions options;
  options.staging_bytes = 8u << 20;
  se::SaveReport report;
  EXPECT_GT(async_save_with_slow_writer(j, options, &report), 0.0);
  EXPECT_EQ(report.staging_peak_bytes, 8u << 20) << "two 4 MiB buffers, no more";
  EXPECT_GT(report.data_bytes, 3 * report.staging_peak_bytes);
}

// Reading the weights (gather_parameters: an export, an evaluation) while a save is in flight
// does not wait for the writer: only changes of the state are held. The writer here holds its
// first unit until the weights were read (or 20 s went by).
TEST(Checkpoint, ReadingTheWeightsDuringAnAsyncSaveDoesNotWaitForIt) {
  TempDir dir;
  Losses run;
  Trainer a(se::parse_train_config(tiny_llama(20).dump(), "test"));
  a.train(3, run);
  const auto before = a.params();
  std::atomic<bool> read{false};
  bool read_while_held = false;
  se::CheckpointOptions options;
  options.before_release = [&](size_t, const se::StateHold&) {
    if (wait_until([&] { return read.load(); })) read_while_held = true;
  };
  se::AsyncCheckpointer ck(a.comm(), options);
  ck.start(a.engine(), dir.path(), "step-3", a.meta());
  const auto during = a.params();
  read = true;
  ASSERT_TRUE(ck.finish().has_value());
  EXPECT_TRUE(read_while_held) << "gather_parameters waited for the save";
  expect_bitwise(during, before);
}

// A write of the data file fails half way through an asynchronous save: the writer releases
// every unit (those it did not copy when it stops at the error, too: training never waits for it
// again and goes on exactly as without the save), the save commits nothing, and the previous
// checkpoint stays `latest`.
TEST(Checkpoint, AsyncSaveFailingMidWayReleasesTheEngineAndCommitsNothing) {
  TempDir dir;
  const se::TrainConfig tc = se::parse_train_config(tiny_llama(20).dump(), "test");
  Losses without_save, with_save;
  Trainer ref(tc);
  ref.train(16, without_save);

  Trainer a(tc);
  a.train(5, with_save);
  a.save(dir.path(), "step-5");
  a.train(5, with_save);
  uint64_t data_bytes = 0;
  for (const auto& e : std::filesystem::directory_iterator(dir.path() / "step-5"))
    if (e.path().extension() == ".data") data_bytes += std::filesystem::file_size(e.path());
  auto faults = std::make_shared<strata::offload::RuleFaultInjector>();
  // Past the first unit's chunks: some units are released by then, the rest are not.
  faults->add({.kind = strata::offload::IoRequest::Kind::kWrite, .path_contains = "step-10",
               .offset_begin = data_bytes / 2, .error = EIO});
  se::CheckpointOptions options;
  options.io_fault_injector = faults;
  std::vector<size_t> released;
  options.before_release = [&](size_t u, const se::StateHold&) { released.push_back(u); };
  se::AsyncCheckpointer ck(a.comm(), options);
  ck.start(a.engine(), dir.path(), "step-10", a.meta());
  bool failed = false;
  for (int s = 0; s < 6; ++s) {
    a.train(1, with_save);  // would hang on a unit never released
    try {
      ck.poll();
    } catch (const std::runtime_error& e) {
      failed = true;
      EXPECT_NE(std::string(e.what()).find("not saved"), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find("step-10"), std::string::npos) << e.what();
    }
  }
  if (!failed) {
    EXPECT_THROW(ck.finish(), std::runtime_error);
  }
  EXPECT_EQ(faults->fired(), 1u);
  EXPECT_GT(released.size(), 0u) << "the failure should come after some units were copied";
  EXPECT_FALSE(ck.in_flight());
  EXPECT_EQ(se::latest_checkpoint(dir.path()), dir.path() / "step-5");
  EXPECT_FALSE(std::filesystem::exists(dir.path() / "step-10" / "manifest.json"));
  EXPECT_NO_THROW(se::verify_checkpoint(dir.path() / "step-5"));
  for (size_t i = 0; i < without_save.losses.size(); ++i)
    EXPECT_EQ(with_save.losses[i], without_save.losses[i]) << "step " << i + 1;
  expect_bitwise(a.params(), ref.params());
}

// With master and moments in swap (striped over two directories), an asynchronous save copies
// them swap file to checkpoint file while training goes on: the engine reads nothing from swap
// for it (the step after the start reads what every step reads), the next update waits for the
// copy, and the checkpoint resumes bitwise.
TEST(Checkpoint, AsyncSaveCopiesNvmeStateFileToFile) {
  TempDir dir, swap_a, swap_b, swap_c;
  json j = tiny_llama(20);
  j["placement"] = {{"params", "host"}, {"grads", "host"}, {"master", "nvme"}, {"moments", "nvme"}};
  j["offload"] = {{"nvme_dirs", {swap_a.path().string(), swap_b.path().string()}}, {"optimizer_chunk", "16KiB"}};
  const se::TrainConfig tc = se::parse_train_config(j.dump(), "test");
  Losses straight, resumed;
  Trainer a(tc);
  a.train(10, straight);
  se::AsyncCheckpointer ck(a.comm());
  ck.start(a.engine(), dir.path(), "step-10", a.meta());
  std::optional<std::filesystem::path> committed;
  for (int s = 0; s < 10; ++s) {
    a.train(1, straight);
    if (auto c = ck.poll()) committed = c;
  }
  if (!committed) committed = ck.finish();
  ASSERT_TRUE(committed.has_value());
  ASSERT_EQ(straight.nvme_reads.size(), 20u);
  EXPECT_GT(straight.nvme_reads[9], 0u);
  EXPECT_EQ(straight.nvme_reads[10], straight.nvme_reads[9]) << "the save read the state through the engine";
  EXPECT_GT(se::verify_checkpoint(*committed), 0u);

  se::TrainConfig tcb = tc;
  tcb.engine.nvme_dirs = {swap_c.path().string()};  // another stripe layout: one directory
  Trainer b(tcb);
  b.load(*committed);
  b.train(10, resumed);
  for (size_t i = 0; i < 10; ++i) EXPECT_EQ(resumed.losses[i], straight.losses[10 + i]) << "step " << 11 + i;
  expect_bitwise(b.params(), a.params());
}

// The update running behind the training thread fails (its swap writes fail): a save started
// after it must not copy the half-updated swap files. It fails with the I/O error, commits
// nothing, the previous checkpoint stays `latest`, and the engine reports the error next step.
TEST(Checkpoint, AsyncSaveAfterAFailedBackgroundUpdateFailsAndCommitsNothing) {
  TempDir dir, swap;
  json j = tiny_llama(20);
  j["placement"] = {{"params", "host"}, {"grads", "host"}, {"master", "nvme"}, {"moments", "nvme"}};
  j["offload"] = {{"nvme_dirs", {swap.path().string()}}, {"optimizer_chunk", "16KiB"}};
  se::TrainConfig tc = se::parse_train_config(j.dump(), "test");
  ASSERT_EQ(tc.engine.update_overlap, se::UpdateOverlap::kForward);
  auto faults = std::make_shared<strata::offload::RuleFaultInjector>();
  tc.engine.io_fault_injector = faults;
  Losses run;
  Trainer a(tc);
  a.train(3, run);
  a.save(dir.path(), "step-3");
  a.params();  // the third step's update is done
  faults->add({.kind = strata::offload::IoRequest::Kind::kWrite, .error = EIO, .uses = -1});
  a.train(1, run);  // returns; its update fails behind it
  se::AsyncCheckpointer ck(a.comm());
  ck.start(a.engine(), dir.path(), "step-4", a.meta());
  try {
    ck.finish();
    FAIL() << "a save of half-updated swap state committed";
  } catch (const std::runtime_error& e) {
    const std::string m = e.what();
    EXPECT_NE(m.find("not saved"), std::string::npos) << m;
    EXPECT_NE(m.find("strata-swap"), std::string::npos) << "names the swap file: " << m;
  }
  EXPECT_GT(faults->fired(), 0u);
  EXPECT_EQ(se::latest_checkpoint(dir.path()), dir.path() / "step-3");
  EXPECT_FALSE(std::filesystem::exists(dir.path() / "step-4" / "manifest.json"));
  EXPECT_THROW(a.train(1, run), std::exception) << "the engine reports the failed update";
}

}  // namespace
