// Resuming from a checkpoint: bitwise exact at the same world size (fp32, fp16 with its loss
// scale, state in swap or split between host and swap), with the learning-rate schedule and the
// global batch kept across world sizes, and never over existing checkpoints silently.
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
#include "checkpoint_fixture.h"
#include "checkpoint_trainer.h"
#include "launched.h"
#include "saved_chunks.h"
#include "test_util.h"
#include "checkpoint_names.h"

namespace {

void exact_resume(const json& cfg) {
  TempDir dir;
  const se::TrainConfig tc = se::parse_train_config(cfg.dump(), "test");
  Losses straight, resumed;
  Trainer a(tc);
  a.train(10, straight);
  a.save(dir.path(), "step-10");
  const se::Engine::Counters saved = a.engine().counters();
  a.train(10, straight);

  se::TrainConfig tcb = tc;  // swap files are locked per engine: b gets its own directory
  TempDir b_swap;
  if (!tcb.engine.nvme_dirs.empty()) tcb.engine.nvme_dirs = {b_swap.path().string()};
  Trainer b(tcb);  // fresh weights from the same seed, then the checkpoint
  auto latest = se::latest_checkpoint(dir.path());
  ASSERT_TRUE(latest.has_value());
  EXPECT_EQ(latest->filename(), "step-10");
  b.load(*latest);
  EXPECT_EQ(b.engine().counters().step, saved.step);
  EXPECT_EQ(b.engine().counters().loss_scale, saved.loss_scale);
  EXPECT_EQ(b.engine().counters().good_steps, saved.good_steps);
  b.train(10, resumed);
  for (size_t i = 0; i < 10; ++i)
    EXPECT_EQ(resumed.losses[i], straight.losses[10 + i]) << "step " << 11 + i;  // bitwise
  expect_bitwise(b.params(), a.params());
}

TEST(Checkpoint, ResumeIsBitwiseExactFp32) { exact_resume(tiny_llama(20)); }

TEST(Checkpoint, ResumeIsBitwiseExactFp16WithLossScale) {
  json j = tiny_llama(20);
  j["precision"] = {{"compute", "fp16"}, {"initial_loss_scale", 1 << 20}, {"loss_scale_window", 3}};
  exact_resume(j);
}

TEST(Checkpoint, ResumeIsBitwiseExactWithStateOnNvme) {
  // Saved from and loaded into swap files: state_slice reads them, store_state_slice writes back.
  TempDir swap;
  json j = tiny_llama(20);
  j["placement"] = {{"params", "nvme"}, {"grads", "nvme"}, {"master", "nvme"}, {"moments", "nvme"}};
  j["offload"] = {{"nvme_dirs", {swap.path().string()}}, {"optimizer_chunk", "16KiB"}};
  exact_resume(j);
}

// Master and moments split by unit between host RAM and swap (automatic placement with a host
// budget that holds the first two units): each unit's slices are saved from and loaded into
// wherever that unit lives.
TEST(Checkpoint, ResumeIsBitwiseExactWithMasterSplitBetweenHostAndSwap) {
  TempDir swap;
  json j = tiny_llama(20);
  j["placement"] = {{"params", "host"}, {"grads", "host"}, {"master", "auto"}, {"moments", "auto"}};
  j["offload"] = {{"nvme_dirs", {swap.path().string()}}, {"optimizer_chunk", "16KiB"}};
  uint64_t all = 0, first_two = 0;
  {
    json probe = j;
    probe["placement"] = json::object();
    Trainer t(se::parse_train_config(probe.dump(), "test"));
    const se::Partition& p = t.engine().partition();
    for (size_t u = 0; u < p.num_units(); ++u) all += p.unit(u).shard_numel;
    first_two = p.unit(0).shard_numel + p.unit(1).shard_numel;
  }
  // ... and room for the activation checkpoints (host-placed: 3 blocks x 2 x 24 tokens x 64 x 4 B).
  j["offload"]["host_budget"] = 8 * all + 12 * first_two + 3 * 2 * 24 * 64 * 4 + 1024;
  {
    Trainer t(se::parse_train_config(j.dump(), "test"));
    ASSERT_NE(t.engine().placement_report().find("(units 0-1) + nvme"), std::string::npos)
        << t.engine().placement_report();
  }
  exact_resume(j);
}

// A learning-rate schedule is a function of the step, which checkpoints hold: stopped and
// resumed, a run has the straight run's rate and loss at every step, bit for bit.
TEST(Checkpoint, ResumedRunContinuesTheLearningRateSchedule) {
  TempDir dir;
  json j = tiny_llama(7);
  j["optimizer"]["schedule"] = {{"decay", "linear"}, {"warmup_steps", 2}, {"min_lr_ratio", 0.2}};
  launch(1, j, dir, "straight", "--log " + (dir / "straight.jsonl").string());
  const auto ck = dir / "ck";
  launch(1, j, dir, "first", "--steps 3 --log " + (dir / "resumed.jsonl").string() + " --checkpoint-dir " + ck.string());
  launch(1, j, dir, "second", "--resume --log " + (dir / "resumed.jsonl").string() + " --checkpoint-dir " + ck.string());
  const auto field = [](const std::filesystem::path& log, const char* key) {
    std::vector<double> out;
    std::istringstream lines(read_file(log));
    std::string line;
    while (std::getline(lines, line))
      if (json l = json::parse(line); !l.contains("event")) out.push_back(l[key].get<double>());
    return out;
  };
  const std::vector<double> lr = field(dir / "straight.jsonl", "lr");
  ASSERT_EQ(lr.size(), 7u);
  EXPECT_EQ(lr[0], 0.0);
  EXPECT_EQ(lr[2], 3e-3);  // warmup done: the peak, optimizer.lr
  EXPECT_EQ(field(dir / "resumed.jsonl", "lr"), lr);
  EXPECT_EQ(field(dir / "resumed.jsonl", "loss"), field(dir / "straight.jsonl", "loss"));
}

TEST(Checkpoint, ResumeBatchKeepsChangesOrRefusesTheSavedGlobalBatch) {
  const se::CheckpointMeta saved{10, 240, 24, 4};  // 4 ranks x micro_batch 3 x grad_accum 2
  EXPECT_EQ(se::resume_batch(saved, 3, 2, 4, false).note, "");
  const se::ResumeBatch at8 = se::resume_batch(saved, 3, 2, 8, false);
  EXPECT_EQ(at8.grad_accum, 1);
  EXPECT_NE(at8.note.find("grad_accum 2 -> 1"), std::string::npos) << at8.note;
  EXPECT_EQ(se::resume_batch(saved, 2, 5, 3, false).grad_accum, 4);  // 3 x 2 x 4 = 24
  // The same world size with another configured batch: the user's own change, refused unless allowed.
  EXPECT_THROW(se::resume_batch(saved, 3, 4, 4, false), std::invalid_argument);
  const se::ResumeBatch allowed = se::resume_batch(saved, 3, 4, 4, true);
  EXPECT_EQ(allowed.grad_accum, 4);
  EXPECT_NE(allowed.note.find("= 48 (allowed"), std::string::npos) << allowed.note;
  EXPECT_THROW(se::resume_batch(saved, 5, 1, 8, false), std::invalid_argument);  // 40 per accumulation
  EXPECT_EQ(se::resume_batch({10, 240, 0, 4}, 7, 1, 3, false).note, "");  // not known: not checked
}

// The data position counts sequences: a resumed run at another world size keeps the saved
// global batch by changing grad_accum when it divides (and trains to the numbers of a run never
// stopped), and otherwise refuses, naming both batches, unless --allow-batch-change.
TEST(Checkpoint, ResumeAtAnotherWorldSizeKeepsTheGlobalBatchOrSaysWhy) {
  TempDir dir;
  const auto ck = dir / "ckpt";
  json j = tiny_llama(6);
  j["batch"] = {{"micro_batch", 2}, {"grad_accum", 4}};  // global batch 8 on one rank
  launch(1, j, dir, "straight", "--log " + (dir / "straight.jsonl").string());
  j["run"]["steps"] = 3;
  launch(1, j, dir, "first", "--log " + (dir / "resumed.jsonl").string() + " --checkpoint-dir " + ck.string());
  j["run"]["steps"] = 6;
  launch(2, j, dir, "second",  // the same configuration on two ranks: grad_accum 4 -> 2
         "--log " + (dir / "resumed.jsonl").string() + " --checkpoint-dir " + ck.string() + " --resume");
  const std::string second = read_file(dir / "second.out");
  EXPECT_NE(second.find("saved at world size 1 with a global batch of 8 sequences; at world size 2 "
                        "batch.grad_accum 4 -> 2 keeps it"),
            std::string::npos)
      << second;
  const std::vector<double> want = losses(dir / "straight.jsonl"), got = losses(dir / "resumed.jsonl");
  ASSERT_EQ(want.size(), 6u);
  ASSERT_EQ(got.size(), 6u);
  for (size_t i = 0; i < 6; ++i) EXPECT_NEAR(got[i], want[i], 1e-5 * want[i]) << "step " << i + 1;

  // 2 ranks x 3 sequences: no grad_accum makes 8.
  j["batch"] = {{"micro_batch", 3}, {"grad_accum", 1}};
  j["run"]["steps"] = 8;
  const auto cfg = dir / "odd.json";
  std::ofstream(cfg) << j.dump(2);
  const std::string bin = STRATA_BIN, train = bin + " launch -n 2 -- " + bin + " train --config " + cfg.string() +
                                               " --no-progress --log " + (dir / "odd.jsonl").string() +
                                               " --checkpoint-dir " + ck.string() + " --resume";
  EXPECT_NE(run_quiet(train, dir / "refused.out"), 0);
  const std::string refused = read_file(dir / "refused.out");
  EXPECT_NE(refused.find("global batch of 8 sequences, this run's is world size 2 x micro_batch 3 x grad_accum 1 = 6"),
            std::string::npos)
      << refused;
  EXPECT_NE(refused.find("--allow-batch-change"), std::string::npos) << refused;
  EXPECT_EQ(se::latest_checkpoint(ck)->filename().string(), "step-00000006") << "nothing saved over";
  EXPECT_EQ(run_quiet(train + " --allow-batch-change", dir / "allowed.out"), 0) << read_file(dir / "allowed.out");
  EXPECT_NE(read_file(dir / "allowed.out").find("= 6 (allowed by run.allow_batch_change)"), std::string::npos)
      << read_file(dir / "allowed.out");
  EXPECT_EQ(losses(dir / "odd.jsonl").size(), 2u);
  EXPECT_EQ(se::read_checkpoint_meta(*se::latest_checkpoint(ck)).global_batch, 6u);
}

// `strata train` with a checkpoint directory never starts over existing checkpoints silently:
// without --resume it refuses a directory holding committed ones; with --resume, a `latest`
// that cannot be followed is an error naming what is there, and nothing is touched; an empty
// directory starts at step 0 and says so; --resume-from loads the checkpoint it names.
TEST(Checkpoint, ResumeNeverStartsOverExistingCheckpointsSilently) {
  TempDir dir;
  const auto ck = dir / "ckpt", cfg_path = dir / "cfg.json";
  json j = tiny_llama(4);
  j["model"]["layers"] = 2;
  j["run"]["save_every"] = 2;
  std::ofstream(cfg_path) << j.dump(2);
  const auto train = [&](const std::string& tag, const std::string& extra) {
    const std::string cmd = std::string(STRATA_BIN) + " train --config " + cfg_path.string() + " --log " +
                            (dir / (tag + ".jsonl")).string() + " " + extra + " > " + (dir / (tag + ".out")).string() +
                            " 2>&1";
    const int st = std::system(cmd.c_str());
    return std::make_pair(WIFEXITED(st) ? WEXITSTATUS(st) : -1, read_file(dir / (tag + ".out")));
  };
  auto [first, first_out] = train("first", "--resume --checkpoint-dir " + ck.string());
  ASSERT_EQ(first, 0) << first_out;
  EXPECT_NE(first_out.find("no committed checkpoint under " + ck.string() + " yet: starting at step 0"),
            std::string::npos) << first_out;
  const auto two = ck / "step-00000002", four = ck / "step-00000004";
  ASSERT_EQ(se::committed_checkpoints(ck), (std::vector<std::filesystem::path>{two, four}));
  const auto manifest_time = [&] { return std::filesystem::last_write_time(four / "manifest.json"); };
  const auto before = manifest_time();
  const auto intact = [&](const std::string& why) {
    EXPECT_EQ(se::committed_checkpoints(ck), (std::vector<std::filesystem::path>{two, four})) << why;
    EXPECT_EQ(manifest_time(), before) << why;
    EXPECT_NO_THROW(se::verify_checkpoint(four)) << why;
  };

  auto [again, again_out] = train("again", "--checkpoint-dir " + ck.string());
  EXPECT_NE(again, 0) << again_out;
  EXPECT_NE(again_out.find("already holds 2 committed checkpoint(s) (the newest step-00000004)"), std::string::npos)
      << again_out;
  intact("a run without --resume");

  // `latest` that cannot be followed (after a power cut it can lag or be lost): the newest complete
  // checkpoint, said on stderr and in the log, and nothing saved over (every step already ran).
  const std::string fallback = "; resuming from step-00000004, the newest complete checkpoint there";
  std::filesystem::remove(ck / "latest");
  auto [nolatest, nolatest_out] = train("nolatest", "--resume --checkpoint-dir " + ck.string());
  EXPECT_EQ(nolatest, 0) << nolatest_out;
  EXPECT_NE(nolatest_out.find("cannot follow `latest` in " + ck.string() + ": it has no `latest` file" + fallback),
            std::string::npos) << nolatest_out;
  EXPECT_NE(nolatest_out.find("resumed from " + four.string() + " after step 4"), std::string::npos) << nolatest_out;
  EXPECT_NE(read_file(dir / "nolatest.jsonl").find("it has no `latest` file"), std::string::npos)
      << "the log's start line carries the note";
  intact("--resume without latest");

  std::ofstream(ck / "latest") << "step-00000099\n";
  auto [dangling, dangling_out] = train("dangling", "--resume --checkpoint-dir " + ck.string());
  EXPECT_EQ(dangling, 0) << dangling_out;
  EXPECT_NE(dangling_out.find("`latest` names step-00000099, but " + (ck / "step-00000099").string() +
                              " does not exist" + fallback), std::string::npos) << dangling_out;
  intact("--resume with a dangling latest");
  std::filesystem::create_directory(ck / "step-00000099");
  auto [uncommitted, uncommitted_out] = train("uncommitted", "--resume --checkpoint-dir " + ck.string());
  EXPECT_EQ(uncommitted, 0) << uncommitted_out;
  EXPECT_NE(uncommitted_out.find("has no manifest.json (never committed)" + fallback), std::string::npos)
      << uncommitted_out;
  EXPECT_NE(uncommitted_out.find("holds 1 half-written save (step-00000099: never committed, never loaded"),
            std::string::npos) << uncommitted_out;
  intact("--resume with latest naming an uncommitted directory");
  // A committed checkpoint whose index is not the one its manifest recorded is not complete.
  std::filesystem::copy_file(two / "rank-00000.index.json", dir / "index-two");
  { std::ofstream(two / "rank-00000.index.json", std::ios::app) << " "; }
  EXPECT_NE(se::incomplete_checkpoint(two).find("unlike the manifest's record"), std::string::npos);
  EXPECT_EQ(se::incomplete_checkpoint(four), "");
  std::filesystem::rename(four / "rank-00000.data", dir / "data-four");
  EXPECT_EQ(se::incomplete_checkpoint(four), "lacks rank-00000.data");
  std::filesystem::remove(ck / "latest");
  try {
    se::find_resume_point(ck);
    ADD_FAILURE() << "no complete checkpoint, yet find_resume_point chose one";
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find("no committed checkpoint there is complete"), std::string::npos) << e.what();
  }
  // Step 2 put back as saved; `latest` names step 4, whose data file is gone: --resume takes step
  // 2, says why, trains steps 3 and 4 to the straight run's losses, and saves step 4 over the
  // incomplete one (the latest checkpoint is never saved over, unless it is incomplete).
  std::filesystem::copy_file(dir / "index-two", two / "rank-00000.index.json",
                             std::filesystem::copy_options::overwrite_existing);
  std::ofstream(ck / "latest") << "step-00000004\n";
  auto [damaged, damaged_out] = train("damaged", "--resume --checkpoint-dir " + ck.string());
  ASSERT_EQ(damaged, 0) << damaged_out;
  EXPECT_NE(damaged_out.find("`latest` names step-00000004, but " + four.string() +
                             " lacks rank-00000.data; resuming from step-00000002"), std::string::npos)
      << damaged_out;
  {
    const std::vector<double> straight = losses(dir / "first.jsonl"), resumed = losses(dir / "damaged.jsonl");
    ASSERT_EQ(resumed.size(), 2u);
    EXPECT_EQ(resumed[0], straight[2]);
    EXPECT_EQ(resumed[1], straight[3]);
  }
  EXPECT_EQ(se::incomplete_checkpoint(four), "");
  EXPECT_NO_THROW(se::verify_checkpoint(four));
  // Back to step 2 in the same directory: the run would have to save step 4 over the latest, a
  // checkpoint it did not load; refused before it trains, not at that save.
  auto [branch, branch_out] = train("branch", "--resume-from " + two.string());
  EXPECT_NE(branch, 0) << branch_out;
  EXPECT_NE(branch_out.find("this run would save step-00000004 over " + four.string() + ", the latest checkpoint"),
            std::string::npos) << branch_out;
  EXPECT_EQ(branch_out.find("resumed from"), std::string::npos) << "refused before it loads and trains";
  // As the runs below expect: `latest` names the half-written step 99.
  std::ofstream(ck / "latest") << "step-00000099\n";
  std::filesystem::create_directory(ck / "step-00000099");

  // Explicitly from step 2: two more steps, the same losses as the straight run's steps 3 and 4.
  auto [from, from_out] = train("from", "--resume-from " + two.string());
  ASSERT_EQ(from, 0) << from_out;
  EXPECT_NE(from_out.find("resumed from " + two.string() + " after step 2"), std::string::npos) << from_out;
  const std::vector<double> straight = losses(dir / "first.jsonl"), resumed = losses(dir / "from.jsonl");
  ASSERT_EQ(straight.size(), 4u);
  ASSERT_EQ(resumed.size(), 2u);
  EXPECT_EQ(resumed[0], straight[2]);
  EXPECT_EQ(resumed[1], straight[3]);
  EXPECT_EQ(se::latest_checkpoint(ck), four) << "the resumed run saved its last step into the parent directory";
  EXPECT_FALSE(std::filesystem::exists(ck / "step-00000099")) << "the save removes a crash's half-written one";
  auto [bad_from, bad_from_out] = train("bad_from", "--resume-from " + (ck / "step-00000099").string());
  EXPECT_NE(bad_from, 0);
  EXPECT_NE(bad_from_out.find("not a committed checkpoint directory"), std::string::npos) << bad_from_out;
}

}  // namespace
