// Checkpoints in object storage (checkpoint_store.h): an uploaded checkpoint resumes bit for bit
// from S3 (a real RGW) and from a directory store, is replaced whole, pruned, refused by a full
// bucket; leftover uploads are aborted; a restore reads runs of chunks in few ranged GETs.
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
