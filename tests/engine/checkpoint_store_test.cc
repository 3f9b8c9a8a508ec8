// Checkpoints in object storage (checkpoint_store.h): an uploaded checkpoint resumes bit for bit
// from S3 (a real RGW) and from a directory store; verify, describe and export read it there; a
// name saved again replaces the stored checkpoint whole; and a store weaker than read-after-write
// (stale reads, listings that miss new keys, deletions seen late, uploads that die halfway)
// never makes a reader load an uncommitted or mixed checkpoint, over seeded trials.
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

std::string unique(const std::string& tag) {
  static std::atomic<int> n{0};
  return tag + "-" + std::to_string(::getpid()) + "-" + std::to_string(n++);
}

std::string s3_store_url(const std::string& tag) {
  s3_server();
  return std::string("s3://") + kS3Bucket + "/" + unique(tag);
}

void offload_upload(const std::filesystem::path& dir, const std::string& url) {
  so::upload_directory(*so::open_object_store(url), dir.string(), "config.json");
}

std::string read_bytes(const std::filesystem::path& p) {
  std::ifstream in(p, std::ios::binary);
  return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
}

// Trains 4 steps, saves and uploads, trains 4 more; a second engine loads the uploaded checkpoint
// by URL and must train the same 4 steps bit for bit.
void resumes_from(const std::string& store_url) {
  TempDir dir;
  const se::TrainConfig tc = se::parse_train_config(tiny_llama(8).dump(), "test");
  Losses straight, resumed;
  Trainer a(tc);
  a.train(4, straight);
  a.save(dir.path(), "step-4");
  se::CheckpointUploader up(a.comm(), store_url);
  up.start(dir / "step-4");
  const auto url = up.finish();
  ASSERT_TRUE(url) << up.last_error();
  EXPECT_EQ(*url, up.store_url() + "/step-4");
  EXPECT_GT(up.last_bytes(), 0u);
  a.train(4, straight);

  EXPECT_EQ(se::newest_stored_checkpoint(store_url), url);
  EXPECT_EQ(se::stored_checkpoints(store_url), std::vector<std::string>{"step-4"});
  Trainer b(tc);
  b.load(*url);
  b.train(4, resumed);
  for (size_t i = 0; i < 4; ++i) EXPECT_EQ(resumed.losses[i], straight.losses[4 + i]) << "step " << 5 + i;
  expect_bitwise(b.params(), a.params());

  // Read where it is: verify, describe, meta and export equal the local checkpoint's.
  EXPECT_EQ(se::verify_checkpoint(*url), se::verify_checkpoint(dir / "step-4"));
  EXPECT_NE(se::describe_checkpoint(*url).find("train steps 4"), std::string::npos);
  EXPECT_EQ(se::read_checkpoint_meta(*url).train_steps, 4);
  se::export_checkpoint_hf(*url, dir / "from-store", "float32");
  se::export_checkpoint_hf(dir / "step-4", dir / "from-disk", "float32");
  EXPECT_EQ(read_bytes(dir / "from-store/model.safetensors"), read_bytes(dir / "from-disk/model.safetensors"));
}

TEST(StoredCheckpoint, ResumesBitwiseFromS3) { resumes_from(s3_store_url("resume")); }

TEST(StoredCheckpoint, ResumesBitwiseFromADirectoryStore) {
  TempDir store;
  resumes_from((store / "bucket").string());
}

// What a rank killed mid-upload leaves (parts of a multipart upload no one completes or aborts,
// which the store keeps and bills): the next run's uploader aborts it before uploading anything.
void leftover_uploads_are_aborted(const std::string& store_url) {
  const se::TrainConfig tc = se::parse_train_config(tiny_llama(2).dump(), "test");
  Trainer a(tc);
  const std::string key = "step-00000002/0123456789abcdef/rank-00001.data";
  {
    auto store = so::open_object_store(store_url);
    auto left = store->start_multipart(key);
    left->put_part(1, std::vector<std::byte>(std::max<uint64_t>(store->min_part_bytes(), 1024)));
    (void)left.release();  // leaked on purpose: its destructor would abort the upload
    ASSERT_EQ(store->list_multipart_uploads("").size(), 1u);
  }
  se::CheckpointUploader up(a.comm(), store_url);
  EXPECT_TRUE(up.leftover_error().empty()) << up.leftover_error();
  ASSERT_EQ(up.aborted_leftovers().size(), 1u);
  EXPECT_EQ(up.aborted_leftovers()[0].key, key);
  EXPECT_TRUE(so::open_object_store(store_url)->list_multipart_uploads("").empty());
  EXPECT_FALSE(so::open_object_store(store_url)->head(key));
}

TEST(StoredCheckpoint, AnUploadAKilledRankLeftIsAbortedByTheNextUploaderOnS3) {
  leftover_uploads_are_aborted(s3_store_url("leftover"));
}

TEST(StoredCheckpoint, AnUploadAKilledRankLeftIsAbortedByTheNextUploaderInADirectoryStore) {
  TempDir store;
  leftover_uploads_are_aborted((store / "bucket").string());
}

TEST(StoredCheckpoint, ANameSavedAgainReplacesTheStoredCheckpointWhole) {
  TempDir dir;
  const std::string store_url = s3_store_url("again");
  const se::TrainConfig tc = se::parse_train_config(tiny_llama(8).dump(), "test");
  Losses run;
  Trainer a(tc);
  se::CheckpointUploader up(a.comm(), store_url);
  a.train(2, run);
  a.save(dir / "first", "step-x");
  up.start(dir / "first" / "step-x");
  ASSERT_TRUE(up.finish()) << up.last_error();
  const auto first = a.params();
  // A replacement whose upload fails leaves the stored one committed and whole.
  a.save(dir / "broken", "step-x");
  std::filesystem::remove(dir / "broken" / "step-x" / "rank-00000.data");
  up.start(dir / "broken" / "step-x");
  EXPECT_FALSE(up.finish());
  {
    Trainer c(tc);
    c.load(store_url + "/step-x");
    expect_bitwise(c.params(), first);
  }
  a.train(2, run);
  a.save(dir / "second", "step-x");
  up.start(dir / "second" / "step-x");
  const auto url = up.finish();
  ASSERT_TRUE(url) << up.last_error();
  // Only the second upload's data is left, and it is what loads.
  auto store = so::open_object_store(store_url);
  std::set<std::string> save_ids;
  for (const auto& o : store->list("step-x/"))
    if (o.key != "step-x/manifest.json") save_ids.insert(o.key.substr(7, 16));
  EXPECT_EQ(save_ids.size(), 1u);
  Trainer b(tc);
  b.load(*url);
  expect_bitwise(b.params(), a.params());
  EXPECT_EQ(b.meta().train_steps, 4);
}

TEST(StoredCheckpoint, AFailedUploadCommitsNothingAndSaysWhy) {
  TempDir dir;
  const std::string store_url = s3_store_url("fail");
  const se::TrainConfig tc = se::parse_train_config(tiny_llama(4).dump(), "test");
  Losses run;
  Trainer a(tc);
  a.train(1, run);
  a.save(dir.path(), "step-1");
  std::filesystem::remove(dir / "step-1" / "rank-00000.data");  // this rank's data is gone
  se::CheckpointUploader up(a.comm(), store_url);
  up.start(dir / "step-1");
  EXPECT_FALSE(up.finish());
  EXPECT_NE(up.last_error().find("upload of step-1"), std::string::npos) << up.last_error();
  EXPECT_NE(up.last_error().find("rank-00000.data"), std::string::npos) << up.last_error();
  EXPECT_NE(up.last_error().find("local checkpoint"), std::string::npos) << up.last_error();
  EXPECT_FALSE(se::newest_stored_checkpoint(store_url));
  try {
    se::read_checkpoint_meta(store_url + "/step-1");
    FAIL() << "an uncommitted stored checkpoint was read";
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find("never committed"), std::string::npos) << e.what();
  }
}

TEST(StoredCheckpoint, PruningKeepsTheNewestAndDeletesManifestsFirst) {
  TempDir dir;
  const std::string store_url = s3_store_url("prune");
  const se::TrainConfig tc = se::parse_train_config(tiny_llama(4).dump(), "test");
  Losses run;
  Trainer a(tc);
  se::CheckpointUploader up(a.comm(), store_url);
  for (int s = 1; s <= 3; ++s) {
    a.train(1, run);
    a.save(dir.path(), "step-" + std::to_string(s));
    up.start(dir / ("step-" + std::to_string(s)));
    ASSERT_TRUE(up.finish()) << up.last_error();
  }
  se::prune_stored_checkpoints(a.comm(), store_url, 2);
  EXPECT_EQ(se::stored_checkpoints(store_url), (std::vector<std::string>{"step-2", "step-3"}));
  EXPECT_TRUE(so::open_object_store(store_url)->list("step-1/").empty());
}

// A bucket whose quota is smaller than one rank's data: the upload fails with S3's
// QuotaExceeded, says so, commits nothing, and the checkpoint committed before still loads.
TEST(StoredCheckpoint, AFullBucketQuotaFailsTheUploadAndKeepsThePreviousCheckpoint) {
  s3_server();
  const char* server_dir = std::getenv("STRATA_S3_DIR");
  ASSERT_NE(server_dir, nullptr) << "the S3 server's variables do not name its directory";
  TempDir dir;
  const std::string bucket = "quota-" + std::to_string(::getpid());
  so::s3_create_bucket(bucket, s3_server());
  const std::string store_url = "s3://" + bucket + "/run";
  const se::TrainConfig tc = se::parse_train_config(tiny_llama(4).dump(), "test");
  Losses run;
  Trainer a(tc);
  se::CheckpointUploader up(a.comm(), store_url);
  a.train(1, run);
  a.save(dir.path(), "step-1");
  up.start(dir / "step-1");
  ASSERT_TRUE(up.finish()) << up.last_error();
  const auto saved = a.params();

  const std::string admin = std::string("radosgw-admin -c ") + server_dir + "/ceph.conf -n client.rgw ";
  ASSERT_EQ(std::system((admin + "quota set --quota-scope=bucket --bucket=" + bucket + " --max-size=65536 >/dev/null 2>&1").c_str()), 0);
  ASSERT_EQ(std::system((admin + "quota enable --quota-scope=bucket --bucket=" + bucket + " >/dev/null 2>&1").c_str()), 0);
  a.train(1, run);
  a.save(dir.path(), "step-2");
  up.start(dir / "step-2");
  EXPECT_FALSE(up.finish());
  EXPECT_NE(up.last_error().find("QuotaExceeded"), std::string::npos) << up.last_error();
  EXPECT_NE(up.last_error().find("local checkpoint"), std::string::npos) << up.last_error();
  EXPECT_EQ(se::newest_stored_checkpoint(store_url), store_url + "/step-1");
  Trainer b(tc);
  b.load(store_url + "/step-1");
  expect_bitwise(b.params(), saved);
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

// --- a store weaker than read-after-write --------------------------------------------------------

// An in-memory store whose every write becomes visible to reads and listings only after a random
// delay (a new key is missing, an overwritten one shows its old bytes, a deleted one is still
// there), drawn per write from a seeded generator. Create-only writes decide on the true state,
// as S3's conditional writes do. Writes fail once `fail_writes_after` more writes have happened
// (an upload that dies halfway). Instances opened on one URL share the state, as clients of one
// bucket do.
struct LagState {
  std::mutex mu;
  struct Version {
    int64_t visible_at;  // steady clock, ms
    bool deleted;
    std::vector<std::byte> bytes;
  };
  std::map<std::string, std::vector<Version>> keys;
  std::mt19937_64 rng;
  int64_t max_lag_ms = 0;
  int64_t fail_writes_after = -1;  // -1: never
  uint64_t stale_reads = 0;        // reads that saw an older version than the newest
  std::map<std::string, std::string> pending;  // multipart uploads in progress: id -> key
  uint64_t uploads_started = 0;

  static int64_t now_ms() {
    return std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::now().time_since_epoch()).count();
  }
  void write(const std::string& key, bool deleted, std::vector<std::byte> bytes) {
    if (fail_writes_after == 0) throw ObjectStoreError(ObjectStoreError::Kind::kUnavailable, "lagging store: injected failure writing " + key);
    if (fail_writes_after > 0) --fail_writes_after;
    keys[key].push_back({now_ms() + int64_t(rng() % uint64_t(max_lag_ms + 1)), deleted, std::move(bytes)});
  }
  // The version a read sees now, or null.
  const Version* visible(const std::string& key) {
    auto it = keys.find(key);
    if (it == keys.end()) return nullptr;
    const int64_t now = now_ms();
    const Version* seen = nullptr;
    for (const Version& v : it->second)
      if (v.visible_at <= now) seen = &v;  // the newest visible, in write order
    if (seen != &it->second.back()) ++stale_reads;
    return seen && !seen->deleted ? seen : nullptr;
  }
  bool exists_now(const std::string& key) {
    auto it = keys.find(key);
    return it != keys.end() && !it->second.back().deleted;
  }
};

class LaggingStore final : public so::ObjectStore {
 public:
  LaggingStore(std::string url, std::shared_ptr<LagState> s) : url_(std::move(url)), s_(std::move(s)) {}
  std::string url() const override { return url_; }
  uint64_t min_part_bytes() const override { return 1; }
  void put(const std::string& key, std::span<const std::byte> data) override {
    so::check_object_key(key);
    std::lock_guard lock(s_->mu);
    s_->write(key, false, {data.begin(), data.end()});
  }
  bool put_if_absent(const std::string& key, std::span<const std::byte> data) override {
    so::check_object_key(key);
    std::lock_guard lock(s_->mu);
    if (s_->exists_now(key)) return false;
    s_->write(key, false, {data.begin(), data.end()});
    return true;
  }
  std::optional<so::ObjectInfo> head(const std::string& key) override {
    std::lock_guard lock(s_->mu);
    const auto* v = s_->visible(key);
    if (!v) return std::nullopt;
    return so::ObjectInfo{key, v->bytes.size(), std::to_string(v->visible_at)};
  }
  void get(const std::string& key, uint64_t offset, std::span<std::byte> out) override {
    std::lock_guard lock(s_->mu);
    const auto* v = s_->visible(key);
    if (!v) throw ObjectStoreError(ObjectStoreError::Kind::kNotFound, "get " + url_of(key) + ": no such key");
    if (offset + out.size() > v->bytes.size())
      throw ObjectStoreError(ObjectStoreError::Kind::kInvalidArgument, "get " + url_of(key) + ": past the end");
    std::copy_n(v->bytes.begin() + int64_t(offset), out.size(), out.begin());
  }
  std::vector<so::ObjectInfo> list(const std::string& prefix) override {
    std::lock_guard lock(s_->mu);
    std::vector<so::ObjectInfo> out;
    std::vector<std::string> names;
    for (const auto& [key, versions] : s_->keys)
      if (key.starts_with(prefix)) names.push_back(key);
    for (const auto& key : names)
      if (const auto* v = s_->visible(key)) out.push_back({key, v->bytes.size(), ""});
    return out;
  }
  void remove(const std::string& key) override {
    std::lock_guard lock(s_->mu);
    s_->write(key, true, {});
  }
  std::unique_ptr<so::MultipartUpload> start_multipart(const std::string& key) override {
    struct Upload final : so::MultipartUpload {
      LaggingStore* store;
      std::string key;
      std::map<int, std::vector<std::byte>> parts;
      void put_part(int n, std::span<const std::byte> d) override { parts[n] = {d.begin(), d.end()}; }
      std::string id;
      so::ObjectInfo complete() override {
        std::vector<std::byte> all;
        for (auto& [n, p] : parts) all.insert(all.end(), p.begin(), p.end());
        const uint64_t size = all.size();
        std::lock_guard lock(store->s_->mu);
        store->s_->write(key, false, std::move(all));
        store->s_->pending.erase(id);
        return {key, size, ""};
      }
      void abort() override {
        std::lock_guard lock(store->s_->mu);
        store->s_->pending.erase(id);
      }
    };
    auto u = std::make_unique<Upload>();
    u->store = this;
    u->key = key;
    std::lock_guard lock(s_->mu);
    u->id = "upload-" + std::to_string(++s_->uploads_started);
    s_->pending[u->id] = key;
    return u;
  }
  std::vector<so::PendingUpload> list_multipart_uploads(const std::string& prefix) override {
    std::lock_guard lock(s_->mu);
    std::vector<so::PendingUpload> out;
    for (const auto& [id, key] : s_->pending)
      if (key.starts_with(prefix)) out.push_back({key, id});
    return out;
  }
  void abort_multipart_upload(const so::PendingUpload& upload) override {
    std::lock_guard lock(s_->mu);
    s_->pending.erase(upload.upload_id);
  }

 private:
  std::string url_;
  std::shared_ptr<LagState> s_;
};

std::mutex lag_mu;
std::map<std::string, std::shared_ptr<LagState>> lag_states;

std::shared_ptr<LagState> lag_state(const std::string& url) {
  static const bool registered = [] {
    so::register_object_store_scheme("lagging://", [](const std::string& u) -> std::unique_ptr<so::ObjectStore> {
      std::string root = u;
      while (root.back() == '/') root.pop_back();
      std::lock_guard lock(lag_mu);
      auto& s = lag_states[root];
      if (!s) s = std::make_shared<LagState>();
      return std::make_unique<LaggingStore>(root, s);
    });
    return true;
  }();
  (void)registered;
  std::lock_guard lock(lag_mu);
  auto& s = lag_states[url];
  if (!s) s = std::make_shared<LagState>();
  return s;
}

TEST(StoredCheckpoint, AWeakStoreNeverYieldsAnUncommittedOrMixedCheckpoint) {
  TempDir dir;
  const se::TrainConfig tc = se::parse_train_config(tiny_llama(1000).dump(), "test");
  Losses run;
  Trainer a(tc), b(tc);
  int trials = 0, loads = 0, older = 0, failed_uploads = 0, settled_checks = 0;
  uint64_t stale_reads = 0;
  for (uint64_t seed = 1; seed <= 10; ++seed) {
    const std::string url = "lagging://run-" + std::to_string(seed);
    auto state = lag_state(url);
    state->rng.seed(seed);
    state->max_lag_ms = int64_t(20 + seed * 37 % 300);
    std::mt19937_64 rng(seed * 1000003);
    se::CheckpointUploader up(a.comm(), url);
    std::map<std::string, std::vector<std::pair<std::string, at::Tensor>>> committed;
    std::string newest_committed;
    for (int trial = 0; trial < 6; ++trial, ++trials) {
      a.train(1, run);
      const std::string name = "step-" + std::to_string(1000 + seed * 100 + uint64_t(trial));
      a.save(dir.path(), name);
      const bool dies = rng() % 4 == 0;  // this upload dies after a few writes
      {
        std::lock_guard lock(state->mu);
        state->fail_writes_after = dies ? int64_t(rng() % 3) : -1;
      }
      up.start(dir / name);
      const auto done = up.finish();
      {
        std::lock_guard lock(state->mu);
        state->fail_writes_after = -1;
      }
      if (done) {
        committed[name] = a.params();
        newest_committed = name;
      } else {
        ++failed_uploads;
        EXPECT_FALSE(up.last_error().empty());
      }
      // A reader now: whatever it finds must be committed and whole.
      const auto found = se::newest_stored_checkpoint(url);
      if (!found) continue;  // nothing visible yet
      const std::string found_name = found->substr(found->rfind('/') + 1);
      ASSERT_TRUE(committed.count(found_name)) << "seed " << seed << ": " << *found << " was never committed";
      try {
        b.load(*found);
      } catch (const std::runtime_error& e) {
        ADD_FAILURE() << "seed " << seed << ": loading committed " << *found << ": " << e.what();
        continue;
      }
      expect_bitwise(b.params(), committed[found_name]);
      ++loads;
      if (found_name != newest_committed) ++older;
    }
    // Once every write is visible, the newest committed one is found.
    std::this_thread::sleep_for(std::chrono::milliseconds(state->max_lag_ms + 1));
    {
      std::lock_guard lock(state->mu);
      stale_reads += state->stale_reads;
    }
    if (!newest_committed.empty()) {
      EXPECT_EQ(se::newest_stored_checkpoint(url), url + "/" + newest_committed) << "seed " << seed;
      ++settled_checks;
    }
  }
  std::cout << "weak store: " << trials << " trials, " << loads << " loads (" << older
            << " found an older committed checkpoint), " << failed_uploads << " uploads died, "
            << stale_reads << " stale reads, " << settled_checks << " settled checks\n";
  EXPECT_GE(trials, 50);
  EXPECT_GT(failed_uploads, 0);
  EXPECT_GT(stale_reads, 0u);
  EXPECT_GT(loads, 0);
}

// A store that forwards to a directory store and records every ranged GET: how the reads of a
// restore are counted.
struct GetLog {
  std::mutex mu;
  std::vector<std::pair<std::string, uint64_t>> gets;  // key, bytes
};
class CountingStore final : public so::ObjectStore {
 public:
  CountingStore(std::string url, std::unique_ptr<so::ObjectStore> inner, std::shared_ptr<GetLog> log)
      : url_(std::move(url)), inner_(std::move(inner)), log_(std::move(log)) {}
  std::string url() const override { return url_; }
  uint64_t min_part_bytes() const override { return inner_->min_part_bytes(); }
  void put(const std::string& k, std::span<const std::byte> d) override { inner_->put(k, d); }
  bool put_if_absent(const std::string& k, std::span<const std::byte> d) override { return inner_->put_if_absent(k, d); }
  std::optional<so::ObjectInfo> head(const std::string& k) override { return inner_->head(k); }
  void get(const std::string& k, uint64_t offset, std::span<std::byte> out) override {
    {
      std::lock_guard lock(log_->mu);
      log_->gets.emplace_back(k, out.size());
    }
    inner_->get(k, offset, out);
  }
  std::vector<so::ObjectInfo> list(const std::string& p) override { return inner_->list(p); }
  void remove(const std::string& k) override { inner_->remove(k); }
  std::unique_ptr<so::MultipartUpload> start_multipart(const std::string& k) override { return inner_->start_multipart(k); }
  std::vector<so::PendingUpload> list_multipart_uploads(const std::string& p) override {
    return inner_->list_multipart_uploads(p);
  }
  void abort_multipart_upload(const so::PendingUpload& u) override { inner_->abort_multipart_upload(u); }

 private:
  std::string url_;
  std::unique_ptr<so::ObjectStore> inner_;
  std::shared_ptr<GetLog> log_;
};

// A restore from a store asks for runs of chunks adjacent in the data object and in memory in one
// ranged GET (up to a transfer's part size), and still checks every chunk: one corrupt chunk in
// the middle of such a run fails the load naming that chunk.
TEST(StoredCheckpoint, RestoreReadsRunsOfChunksInFewGetsAndNamesACorruptOne) {
  TempDir dir, root;
  static std::shared_ptr<GetLog> log = std::make_shared<GetLog>();
  static const std::string directory = (root / "bucket").string();
  so::register_object_store_scheme("counting://", [](const std::string& u) -> std::unique_ptr<so::ObjectStore> {
    return std::make_unique<CountingStore>(u, so::open_file_store(directory), log);
  });
  json cfg = tiny_llama(2);
  cfg["model"]["vocab_size"] = 40000;  // 2.56M-element embedding and LM head: 3 chunks a kind each
  const se::TrainConfig tc = se::parse_train_config(cfg.dump(), "test");
  Losses run;
  Trainer a(tc);
  a.train(1, run);
  a.save(dir.path(), "step-1");
  se::CheckpointUploader up(a.comm(), "counting://store");
  up.start(dir / "step-1");
  const auto url = up.finish();
  ASSERT_TRUE(url) << up.last_error();

  auto store = so::open_file_store(directory);
  const json m = json::parse([&] {
    std::string key;
    for (const auto& o : store->list("step-1/"))
      if (o.key.ends_with("manifest.json")) key = o.key;
    const std::vector<std::byte> bytes = store->get_all(key);
    return std::string(reinterpret_cast<const char*>(bytes.data()), bytes.size());
  }());
  // The manifest names each rank's index object beside its data, under the save id.
  const std::vector<json> all_chunks = strata::test::saved_chunks(m, [&](int q) {
    char name[64];
    std::snprintf(name, sizeof name, "step-1/%s/rank-%05d.index.json", m["store"]["save_id"].get<std::string>().c_str(), q);
    const std::vector<std::byte> bytes = store->get_all(name);
    return std::string(reinterpret_cast<const char*>(bytes.data()), bytes.size());
  });
  size_t chunks = 0;
  const json* second = nullptr;  // the embedding's master weights, second of three chunks
  for (const json& c : all_chunks) {
    ++chunks;
    if (m["units"][c["unit"].get<size_t>()]["name"] == "embedding" && c["kind"] == "master" &&
        c["begin"].get<uint64_t>() == (1ull << 20))
      second = &c;
  }
  ASSERT_NE(second, nullptr);

  Trainer b(tc);
  log->gets.clear();
  b.load(*url);
  expect_bitwise(b.params(), a.params());
  size_t data_gets = 0;
  uint64_t largest = 0;
  for (const auto& [key, bytes] : log->gets)
    if (key.ends_with(".data")) ++data_gets, largest = std::max(largest, bytes);
  std::cout << chunks << " chunks read in " << data_gets << " ranged GETs, the largest " << largest << " bytes\n";
  EXPECT_LT(data_gets, chunks);
  EXPECT_GT(largest, 4ull << 20);  // several 4 MiB chunks in one request
  EXPECT_LE(largest, so::TransferOptions{}.part_bytes);
  // The transfer options size the requests (run.checkpoint_part_size): 8 MiB holds two chunks.
  log->gets.clear();
  se::load_checkpoint(b.engine(), b.comm(), *url, so::TransferOptions{8ull << 20, 2});
  expect_bitwise(b.params(), a.params());
  uint64_t largest_small = 0;
  for (const auto& [key, bytes] : log->gets)
    if (key.ends_with(".data")) largest_small = std::max(largest_small, bytes);
  EXPECT_GT(largest_small, 4ull << 20);
  EXPECT_LE(largest_small, 8ull << 20);

  // One flipped bit in the middle chunk of the embedding's master run.
  std::string data_key;
  for (const auto& o : store->list("step-1/"))
    if (o.key.ends_with((*second)["file"].get<std::string>())) data_key = o.key;
  ASSERT_FALSE(data_key.empty());
  {
    std::fstream f(directory + "/" + data_key, std::ios::in | std::ios::out | std::ios::binary);
    ASSERT_TRUE(f.good()) << directory + "/" + data_key;
    const uint64_t at = (*second)["offset"].get<uint64_t>() + 4096;
    f.seekg(std::streamoff(at));
    char byte = 0;
    f.read(&byte, 1);
    byte = char(byte ^ 0x10);
    f.seekp(std::streamoff(at));
    f.write(&byte, 1);
  }
  try {
    b.load(*url);
    ADD_FAILURE() << "a corrupt chunk was loaded";
  } catch (const std::runtime_error& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("corrupt"), std::string::npos) << msg;
    EXPECT_NE(msg.find("unit embedding, master, elements 1048576+1048576"), std::string::npos) << msg;
  }
}

}  // namespace
