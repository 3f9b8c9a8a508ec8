// A store weaker than read-after-write (stale reads, listings that miss new keys, deletions seen
// late, uploads that die halfway) never makes a reader load an uncommitted or mixed checkpoint,
// over seeded trials.
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

}  // namespace
