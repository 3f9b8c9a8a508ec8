// `strata train` with tiered saves: checkpoints uploaded to a bucket as they commit resume from
// the store alone at another world size, a model read from and exported to a bucket equals the
// local run, and SIGKILL at any moment never leaves a bad stored checkpoint.
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <fstream>
#include <map>
#include <mutex>
#include <random>
#include <set>
#include <sstream>
#include <thread>

#include "checkpoint_store_fixture.h"
#include "checkpoint_trainer.h"
#include "saved_chunks.h"
#include "s3_server.h"
#include "strata/engine/config_parse.h"
#include "strata/engine/checkpoint_store.h"
#include "strata/offload/s3.h"
#include "strata/models/safetensors.h"
#include "test_util.h"

namespace {

using namespace strata::test;
namespace so = strata::offload;
using so::ObjectStoreError;

void offload_upload(const std::filesystem::path& dir, const std::string& url) {
  so::upload_directory(*so::open_object_store(url), dir.string(), "config.json");
}

// --- `strata train` with tiered saves ----------------------------------------------------------

std::string run_strata(const std::string& args, const std::filesystem::path& out) {
  const std::string cmd = std::string(STRATA_BIN) + " " + args + " > " + out.string() + " 2>&1";
  const int st = std::system(cmd.c_str());
  const std::string text = read_bytes(out);
  EXPECT_TRUE(WIFEXITED(st) && WEXITSTATUS(st) == 0) << cmd << "\n" << text;
  return text;
}

std::vector<double> logged_losses(const std::filesystem::path& log) {
  std::vector<double> out;
  std::istringstream lines(read_bytes(log));
  std::string line;
  while (std::getline(lines, line)) {
    const json j = json::parse(line);
    if (!j.contains("event")) out.push_back(j["loss"].get<double>());
  }
  return out;
}

json tiered_config(int ranks, int64_t steps, const std::filesystem::path& local) {
  json j = tiny_llama(steps);
  j["batch"]["micro_batch"] = 8 / 2 / ranks;  // global batch 8 at any world size
  j["run"]["save_every"] = 2;
  j["run"]["checkpoint_local_dir"] = local.string();
  return j;
}

// Two ranks train 4 steps saving every 2 to s3://; the local copies are then lost (another
// machine), and one rank resumes from the store alone: the same losses as 8 steps straight.
TEST(TieredSaves, TrainingResumesFromTheStoreAloneAtAnotherWorldSize) {
  TempDir dir;
  setenv("STRATA_CACHE", (dir / "cache").c_str(), 1);  // staged exports go there, not to ~/.cache
  const std::string store = s3_store_url("tiered");
  auto write_config = [&](const std::string& name, const json& j) {
    std::ofstream(dir / name) << j.dump(2);
    return (dir / name).string();
  };
  json straight = tiny_llama(8);
  straight["batch"]["micro_batch"] = 2;
  run_strata("launch -n 2 -- " + std::string(STRATA_BIN) + " train --config " +
                 write_config("straight.json", straight) + " --log " + (dir / "straight.jsonl").string(),
             dir / "straight.out");
  const std::string first = run_strata(
      "launch -n 2 -- " + std::string(STRATA_BIN) + " train --config " +
          write_config("first.json", tiered_config(2, 4, dir / "local-a")) + " --checkpoint-dir " + store +
          " --log " + (dir / "resumed.jsonl").string(),
      dir / "first.out");
  EXPECT_NE(first.find("uploaded " + store + "/step-00000002"), std::string::npos) << first;
  EXPECT_NE(first.find("uploaded " + store + "/step-00000004"), std::string::npos) << first;
  EXPECT_EQ(se::stored_checkpoints(store), (std::vector<std::string>{"step-00000002", "step-00000004"}));

  // Without --resume, a store that holds checkpoints is refused.
  const std::string refused_cmd = std::string(STRATA_BIN) + " train --config " +
                                  write_config("again.json", tiered_config(1, 8, dir / "local-c")) +
                                  " --checkpoint-dir " + store + " > " + (dir / "refused.out").string() + " 2>&1";
  EXPECT_NE(std::system(refused_cmd.c_str()), 0);
  EXPECT_NE(read_bytes(dir / "refused.out").find("already holds 2 committed checkpoint(s)"), std::string::npos)
      << read_bytes(dir / "refused.out");

  const std::string second = run_strata(
      "train --config " + write_config("second.json", tiered_config(1, 8, dir / "local-b")) + " --checkpoint-dir " +
          store + " --resume --log " + (dir / "resumed.jsonl").string(),
      dir / "second.out");
  EXPECT_NE(second.find("resumed from " + store + "/step-00000004"), std::string::npos) << second;
  const std::vector<double> want = logged_losses(dir / "straight.jsonl"), got = logged_losses(dir / "resumed.jsonl");
  ASSERT_EQ(want.size(), 8u);
  ASSERT_EQ(got.size(), 8u);
  for (size_t i = 0; i < 8; ++i) EXPECT_NEAR(got[i], want[i], 1e-5 * want[i]) << "step " << i + 1;

  // The tools read it there.
  EXPECT_NE(run_strata("ckpt verify " + store, dir / "verify.out").find("OK"), std::string::npos);
  run_strata("ckpt export " + store + "/step-00000008 " + (dir / "hf").string(), dir / "export.out");
  EXPECT_TRUE(std::filesystem::exists(dir / "hf" / "model.safetensors"));
  // And into a bucket: the same bytes, config.json among them.
  run_strata("ckpt export " + store + "/step-00000008 " + store + "-hf", dir / "export-s3.out");
  auto hf = so::open_object_store(store + "-hf");
  const auto weights = hf->get_all("model.safetensors");
  EXPECT_EQ(std::string(reinterpret_cast<const char*>(weights.data()), weights.size()),
            read_bytes(dir / "hf" / "model.safetensors"));
  EXPECT_TRUE(hf->head("config.json"));
}

// Fine-tuning a model that lives in a bucket, exported into one in shards, at two ranks: the same
// bytes as the same run from and to local directories (there the ranks share the shards of a
// directory both see), each shard uploaded by the rank that wrote it as it was written (none is
// left in the staging directory).
TEST(TieredSaves, InitFromAndExportToABucketEqualTheLocalRun) {
  TempDir dir;
  setenv("STRATA_CACHE", (dir / "cache").c_str(), 1);  // the model's mirror and the staged export
  const std::string bucket_model = s3_store_url("model"), bucket_out = s3_store_url("finetuned");
  // A Hugging Face model directory to start from: a short run's export.
  json base = tiny_llama(2);
  base["batch"]["micro_batch"] = 2;
  std::ofstream(dir / "base.json") << base.dump(2);
  run_strata("train --config " + (dir / "base.json").string() + " --export " + (dir / "model").string(), dir / "base.out");
  offload_upload(dir / "model", bucket_model);
  auto finetune = [&](const std::string& from, const std::string& to, const std::string& tag) {
    json j = {{"model", {{"init_from", from}}},
              {"data", {{"path", "/usr/share/common-licenses"}, {"format", "bytes"}, {"seq_len", 24}, {"seed", 7}}},
              {"batch", {{"micro_batch", 2}, {"grad_accum", 1}}},
              {"optimizer", {{"lr", 1e-3}}},
              {"run", {{"steps", 3}, {"progress", false}, {"export", to}, {"export_shard_size", "100KB"}}}};
    std::ofstream(dir / (tag + ".json")) << j.dump(2);
    return run_strata("launch -n 2 -- " + std::string(STRATA_BIN) + " train --config " + (dir / (tag + ".json")).string(),
                      dir / (tag + ".out"));
  };
  finetune((dir / "model").string(), (dir / "local-out").string(), "local");
  const std::string out = finetune(bucket_model, bucket_out, "bucket");
  EXPECT_NE(out.find("fetching " + bucket_model + "/model.safetensors"), std::string::npos) << out;
  EXPECT_NE(out.find("uploaded the export to " + bucket_out), std::string::npos) << out;
  // Every file of the local export, shards and index, is in the bucket with the same bytes.
  std::vector<std::string> shards;
  for (const auto& e : std::filesystem::directory_iterator(dir / "local-out")) {
    const std::string name = e.path().filename().string();
    if (name.starts_with("model-")) shards.push_back(name);
    if (!name.starts_with("model")) continue;
    const auto got = so::open_object_store(bucket_out)->get_all(name);
    EXPECT_EQ(std::string(reinterpret_cast<const char*>(got.data()), got.size()), read_bytes(e.path())) << name;
  }
  ASSERT_GE(shards.size(), 3u) << "the export was meant to be sharded";
  EXPECT_NE(out.find(std::to_string(shards.size()) + " weights file(s) as they were written"), std::string::npos) << out;
  const std::filesystem::path staged =
      dir / "cache" / "exports" / bucket_out.substr(std::string("s3://").size());
  EXPECT_TRUE(std::filesystem::exists(staged / "config.json"));
  for (const std::string& name : shards) EXPECT_FALSE(std::filesystem::exists(staged / name)) << name << " stayed staged";
  // An export over a non-empty bucket prefix is refused without export_overwrite; with it, a
  // second run finds the mirror of the model current and fetches nothing.
  const std::string cmd = std::string(STRATA_BIN) + " train --config " + (dir / "bucket.json").string() + " > " +
                          (dir / "again.out").string() + " 2>&1";
  EXPECT_NE(std::system(cmd.c_str()), 0);
  const std::string again = read_bytes(dir / "again.out");
  EXPECT_NE(again.find("already holds"), std::string::npos) << again;
  const std::string third = run_strata("train --config " + (dir / "bucket.json").string() + " --export-overwrite",
                                       dir / "third.out");
  EXPECT_EQ(third.find("fetching"), std::string::npos) << third;
  EXPECT_NE(third.find("(0 MiB fetched)"), std::string::npos) << third;
}

// SIGKILL at random moments of a run that saves, uploads and prunes every step: every checkpoint
// the store shows as committed verifies, and the newest never goes back.
TEST(TieredSaves, SigkillAtRandomMomentsNeverLeavesABadStoredCheckpoint) {
  TempDir dir;
  const std::string store = s3_store_url("sigkill");
  json j = tiny_llama(1000000);
  j["model"]["layers"] = 2;
  j["run"]["save_every"] = 1;
  j["run"]["keep_checkpoints"] = 2;
  j["run"]["keep_uploaded_checkpoints"] = 3;
  j["run"]["log"] = "";
  j["run"]["checkpoint_local_dir"] = (dir / "local").string();
  std::ofstream(dir / "cfg.json") << j.dump(2);
  std::mt19937 rng(20261126);
  std::string last_newest;
  int advanced = 0, checked = 0;
  const int trials = 12;
  for (int trial = 0; trial < trials; ++trial) {
    ::unlink((dir / "trial.txt").c_str());
    const pid_t pid = fork();
    ASSERT_GE(pid, 0);
    if (pid == 0) {
      freopen((dir / "trial.txt").c_str(), "w", stderr);
      execl(STRATA_BIN, STRATA_BIN, "train", "--config", (dir / "cfg.json").c_str(), "--checkpoint-dir",
            store.c_str(), "--resume", "--no-progress", nullptr);
      _exit(127);
    }
    const auto forked = std::chrono::steady_clock::now();
    while (read_bytes(dir / "trial.txt").find("strata train: uploaded ") == std::string::npos &&
           std::chrono::steady_clock::now() - forked < std::chrono::seconds(60))
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    std::this_thread::sleep_for(std::chrono::milliseconds(rng() % 800));
    kill(pid, SIGKILL);
    int st = 0;
    waitpid(pid, &st, 0);
    ASSERT_TRUE(WIFSIGNALED(st)) << "trial " << trial << " ended by itself:\n" << read_bytes(dir / "trial.txt");
    const auto newest = se::newest_stored_checkpoint(store);
    ASSERT_TRUE(newest || last_newest.empty()) << "trial " << trial << ": the stored checkpoints vanished";
    if (!newest) continue;
    EXPECT_GE(*newest, last_newest) << "trial " << trial << ": the newest stored checkpoint went back";
    for (const std::string& name : se::stored_checkpoints(store)) {
      EXPECT_NO_THROW(se::verify_checkpoint(store + "/" + name)) << "trial " << trial << ": " << name;
      ++checked;
    }
    if (*newest != last_newest) ++advanced;
    last_newest = *newest;
  }
  std::cout << "sigkill: " << trials << " trials, the newest stored checkpoint advanced in " << advanced
            << ", " << checked << " stored checkpoints verified\n";
  EXPECT_GE(advanced, trials / 2) << "training rarely got past start-up: the kills did not hit uploads";
}

}  // namespace
