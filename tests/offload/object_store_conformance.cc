#include "object_store_conformance.h"

#include <algorithm>
#include <atomic>
#include <fstream>
#include <random>
#include <set>
#include <thread>

#include "test_util.h"

namespace strata::offload::test {

using strata::test::random_bytes;
using Kind = ObjectStoreError::Kind;

std::unique_ptr<ObjectStore> ObjectStoreConformance::fresh() {
  static std::atomic<int> counter{0};
  const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
  std::string tag = std::string(info->name()) + "-" + std::to_string(::getpid()) + "-" +
                    std::to_string(counter++);
  std::replace(tag.begin(), tag.end(), '/', '-');
  return GetParam().make(tag);
}

namespace {

std::string text(const std::vector<std::byte>& bytes) {
  return std::string(reinterpret_cast<const char*>(bytes.data()), bytes.size());
}
std::span<const std::byte> bytes_of(const std::string& s) { return std::as_bytes(std::span(s)); }

template <class F>
Kind kind_thrown(F f, std::string* message = nullptr) {
  try {
    f();
  } catch (const ObjectStoreError& e) {
    if (message) *message = e.what();
    return e.kind();
  }
  ADD_FAILURE() << "no ObjectStoreError thrown";
  return Kind::kOther;
}

TEST_P(ObjectStoreConformance, PutGetRoundTripsAwkwardSizesAndRanges) {
  auto store = fresh();
  std::mt19937_64 rng(11);
  for (size_t size : {size_t{0}, size_t{1}, size_t{4097}, size_t{(1 << 20) + 13}}) {
    const std::string key = "dir/sub/object-" + std::to_string(size) + ".bin";
    const auto data = random_bytes(size, size + 1);
    store->put(key, data);
    EXPECT_EQ(store->get_all(key), data) << key;
    const auto info = store->head(key);
    ASSERT_TRUE(info) << key;
    EXPECT_EQ(info->size, size);
    EXPECT_EQ(info->key, key);
    for (int trial = 0; trial < 5 && size > 0; ++trial) {
      const uint64_t offset = rng() % size;
      const uint64_t length = 1 + rng() % (size - offset);
      std::vector<std::byte> part(length);
      store->get(key, offset, part);
      EXPECT_TRUE(std::equal(part.begin(), part.end(), data.begin() + offset)) << key << " @" << offset;
    }
  }
}

TEST_P(ObjectStoreConformance, ReadsPastTheEndAndMissingKeysAreClearErrors) {
  auto store = fresh();
  store->put("short", random_bytes(100, 1));
  std::vector<std::byte> buffer(10);
  std::string message;
  EXPECT_EQ(kind_thrown([&] { store->get("short", 95, buffer); }, &message), Kind::kInvalidArgument);
  EXPECT_NE(message.find("short"), std::string::npos) << message;
  EXPECT_NE(message.find("past the end"), std::string::npos) << message;
  EXPECT_EQ(kind_thrown([&] { store->get("short", 200, buffer); }), Kind::kInvalidArgument);
  EXPECT_EQ(kind_thrown([&] { store->get("missing", 0, buffer); }, &message), Kind::kNotFound);
  EXPECT_NE(message.find("missing"), std::string::npos) << message;
  EXPECT_EQ(kind_thrown([&] { store->get_all("missing"); }), Kind::kNotFound);
  EXPECT_FALSE(store->head("missing"));
  std::vector<std::byte> none;
  store->get("short", 100, none);  // an empty range at the end is fine
}

TEST_P(ObjectStoreConformance, PutReplacesAndTheEtagChanges) {
  auto store = fresh();
  store->put("k", bytes_of("first version"));
  const auto before = store->head("k");
  store->put("k", bytes_of("second"));
  const auto after = store->head("k");
  ASSERT_TRUE(before && after);
  EXPECT_EQ(text(store->get_all("k")), "second");
  EXPECT_EQ(after->size, 6u);
  EXPECT_NE(before->etag, after->etag);
}

TEST_P(ObjectStoreConformance, CreateOnlyWritesHaveExactlyOneWinner) {
  auto store = fresh();
  EXPECT_TRUE(store->put_if_absent("manifest", bytes_of("mine")));
  EXPECT_FALSE(store->put_if_absent("manifest", bytes_of("theirs")));
  EXPECT_EQ(text(store->get_all("manifest")), "mine");

  const int racers = GetParam().racers;
  for (int round = 0; round < 3; ++round) {
    const std::string key = "race-" + std::to_string(round);
    std::atomic<int> winners{0}, winner{-1};
    std::vector<std::thread> threads;
    for (int i = 0; i < racers; ++i) {
      threads.emplace_back([&, i] {
        if (store->put_if_absent(key, bytes_of("writer " + std::to_string(i)))) {
          ++winners;
          winner = i;
        }
      });
    }
    for (auto& t : threads) t.join();
    EXPECT_EQ(winners.load(), 1) << key;
    EXPECT_EQ(text(store->get_all(key)), "writer " + std::to_string(winner.load()));
  }
}

TEST_P(ObjectStoreConformance, ListFiltersByPrefixSortsAndPaginates) {
  auto store = fresh();
  std::set<std::string> expected;
  std::vector<std::thread> threads;
  std::vector<std::string> keys;
  for (int i = 0; i < 23; ++i) keys.push_back("ckpt/step-" + std::to_string(100 + i * 7) + "/rank-" + std::to_string(i % 3));
  keys.push_back("ckpt-other/x");
  keys.push_back("top");
  for (const auto& k : keys) store->put(k, random_bytes(k.size(), 3));
  for (const auto& k : keys) {
    if (k.starts_with("ckpt/")) expected.insert(k);
  }
  const auto listed = store->list("ckpt/");
  std::vector<std::string> names;
  for (const auto& o : listed) {
    names.push_back(o.key);
    EXPECT_EQ(o.size, o.key.size()) << o.key;
  }
  EXPECT_EQ(names, std::vector<std::string>(expected.begin(), expected.end()));
  EXPECT_EQ(store->list("ckpt").size(), expected.size() + 1);     // a plain string prefix
  EXPECT_EQ(store->list("ckpt/step-10").size(), 2u);               // step-100, step-107
  EXPECT_EQ(store->list("").size(), keys.size());
  EXPECT_TRUE(store->list("nothing-here/").empty());
}

TEST_P(ObjectStoreConformance, RemoveDeletesAndMissingKeysAreFine) {
  auto store = fresh();
  store->put("a/b/c", bytes_of("x"));
  store->put("a/d", bytes_of("y"));
  store->remove("a/b/c");
  store->remove("a/b/c");
  store->remove("never/was");
  EXPECT_FALSE(store->head("a/b/c"));
  const auto listed = store->list("a/");
  ASSERT_EQ(listed.size(), 1u);
  EXPECT_EQ(listed[0].key, "a/d");
  store->put("a/b/c", bytes_of("again"));  // the key can be made again
  EXPECT_EQ(text(store->get_all("a/b/c")), "again");
}

TEST_P(ObjectStoreConformance, MultipartUploadsAssembleInNumberOrderAndAbortLeavesNothing) {
  auto store = fresh();
  const uint64_t part = store->min_part_bytes() < 1024 ? 300000 : store->min_part_bytes();
  const auto p1 = random_bytes(part, 21), p2 = random_bytes(part + 17, 22), p3 = random_bytes(1023, 23);
  {
    auto upload = store->start_multipart("big/object");
    std::thread t3([&] { upload->put_part(3, p3); });
    std::thread t1([&] { upload->put_part(1, p1); });
    upload->put_part(2, random_bytes(part, 99));  // replaced below
    t1.join();
    t3.join();
    EXPECT_FALSE(store->head("big/object")) << "visible before complete";
    upload->put_part(2, p2);
    const ObjectInfo info = upload->complete();
    EXPECT_EQ(info.size, p1.size() + p2.size() + p3.size());
    EXPECT_FALSE(info.etag.empty());
  }
  auto expected = p1;
  expected.insert(expected.end(), p2.begin(), p2.end());
  expected.insert(expected.end(), p3.begin(), p3.end());
  EXPECT_EQ(store->get_all("big/object"), expected);
  {
    auto upload = store->start_multipart("aborted");
    upload->put_part(1, p1);
    upload->abort();
    upload->abort();
  }
  {
    auto upload = store->start_multipart("dropped");  // destroyed without complete: aborted
    upload->put_part(1, p3);
  }
  EXPECT_FALSE(store->head("aborted"));
  EXPECT_FALSE(store->head("dropped"));
  {
    auto upload = store->start_multipart("gap");
    upload->put_part(1, p1);
    upload->put_part(3, p3);
    EXPECT_EQ(kind_thrown([&] { upload->complete(); }), Kind::kInvalidArgument);
  }
  EXPECT_FALSE(store->head("gap"));
  EXPECT_EQ(store->list("").size(), 1u);
}

// An upload its writer never finished (a process killed mid-upload) is listed, and any client
// can abort it by its id: the store then drops its parts, and the writer, were it alive, cannot
// complete.
TEST_P(ObjectStoreConformance, UnfinishedUploadsAreListedAndAbortedByTheirId) {
  auto store = fresh();
  const uint64_t part = std::max<uint64_t>(store->min_part_bytes(), 1024);
  const auto p1 = random_bytes(part, 31), p2 = random_bytes(777, 32);
  EXPECT_TRUE(store->list_multipart_uploads("").empty());
  auto left = store->start_multipart("ckpt/step-1/rank-00001.data");
  left->put_part(1, p1);
  auto other = store->start_multipart("elsewhere/object");
  other->put_part(1, p2);
  {
    auto done = store->start_multipart("ckpt/step-1/rank-00000.data");
    done->put_part(1, p2);
    done->complete();
  }
  const std::vector<PendingUpload> pending = store->list_multipart_uploads("ckpt/");
  ASSERT_EQ(pending.size(), 1u);
  EXPECT_EQ(pending[0].key, "ckpt/step-1/rank-00001.data");
  EXPECT_FALSE(pending[0].upload_id.empty());
  const std::vector<PendingUpload> all = store->list_multipart_uploads("");
  ASSERT_EQ(all.size(), 2u);
  EXPECT_EQ(all[0].key, "ckpt/step-1/rank-00001.data");
  EXPECT_EQ(all[1].key, "elsewhere/object");

  // By id alone, as a later run does (the writer's own handle is not used).
  store->abort_multipart_upload(pending[0]);
  store->abort_multipart_upload(pending[0]);  // already gone: not an error
  EXPECT_TRUE(store->list_multipart_uploads("ckpt/").empty());
  EXPECT_THROW(left->complete(), ObjectStoreError);
  EXPECT_FALSE(store->head("ckpt/step-1/rank-00001.data"));
  EXPECT_TRUE(store->head("ckpt/step-1/rank-00000.data"));
  other->abort();
  EXPECT_TRUE(store->list_multipart_uploads("").empty());
}

TEST_P(ObjectStoreConformance, LargeTransfersInConcurrentPartsRoundTrip) {
  auto store = fresh();
  TransferOptions options;
  options.part_bytes = std::max<uint64_t>(store->min_part_bytes(), 256 << 10);
  options.concurrency = 4;
  const auto data = random_bytes(options.part_bytes * 3 + options.part_bytes / 2 + 5, 31);
  const ObjectInfo info = put_object(*store, "large", data, options);
  EXPECT_EQ(info.size, data.size());
  std::vector<std::byte> back(data.size());
  get_object(*store, "large", 0, back, options);
  EXPECT_EQ(back, data);
  std::vector<std::byte> middle(options.part_bytes * 2 + 3);
  get_object(*store, "large", 1001, middle, options);
  EXPECT_TRUE(std::equal(middle.begin(), middle.end(), data.begin() + 1001));
  // The same bytes from a file, read part by part as the upload goes.
  strata::test::TempDir dir;
  const std::string path = (dir / "data.bin").string();
  {
    std::ofstream out(path, std::ios::binary);
    out.write(reinterpret_cast<const char*>(data.data()), static_cast<std::streamsize>(data.size()));
  }
  uint64_t last_progress = 0;
  put_file(*store, "from-file", path, options, [&](uint64_t done) { last_progress = done; });
  EXPECT_EQ(last_progress, data.size());
  EXPECT_EQ(store->get_all("from-file"), data);
  // Small objects go in one put.
  put_object(*store, "small", random_bytes(10, 1), options);
  EXPECT_EQ(store->get_all("small"), random_bytes(10, 1));
}

TEST_P(ObjectStoreConformance, KeysWithSpecialCharactersRoundTrip) {
  auto store = fresh();
  const std::vector<std::string> keys = {"a b/c+d=e&f%g~h.bin", "ünïcødé/ключ", "q?x#y;z,@$!'()*",
                                         "step-000100/rank-00003.chunk"};
  for (size_t i = 0; i < keys.size(); ++i) store->put(keys[i], random_bytes(i + 1, i));
  for (size_t i = 0; i < keys.size(); ++i) {
    EXPECT_EQ(store->get_all(keys[i]), random_bytes(i + 1, i)) << keys[i];
  }
  std::vector<std::string> listed;
  for (const auto& o : store->list("")) listed.push_back(o.key);
  std::vector<std::string> sorted = keys;
  std::sort(sorted.begin(), sorted.end());
  EXPECT_EQ(listed, sorted);
  EXPECT_EQ(store->list("ünïcødé/").size(), 1u);
}

TEST_P(ObjectStoreConformance, BadKeysAreRefusedBeforeAnythingIsSent) {
  auto store = fresh();
  for (const std::string& key : std::vector<std::string>{"", "/lead", "trail/", "a//b", "a/../b", "./a", std::string(1025, 'k')}) {
    std::string message;
    EXPECT_EQ(kind_thrown([&] { store->put(key, bytes_of("x")); }, &message), Kind::kInvalidArgument)
        << key;
    EXPECT_NE(message.find("bad object key"), std::string::npos) << message;
  }
  EXPECT_TRUE(store->list("").empty());
}

TEST_P(ObjectStoreConformance, ConcurrentClientsOnDistinctKeys) {
  auto store = fresh();
  std::vector<std::thread> threads;
  std::atomic<int> mismatches{0};
  for (int t = 0; t < 6; ++t) {
    threads.emplace_back([&, t] {
      for (int i = 0; i < 5; ++i) {
        const std::string key = "t" + std::to_string(t) + "/o" + std::to_string(i);
        const auto data = random_bytes(1000 + 37 * i + t, 100 * t + i);
        store->put(key, data);
        if (store->get_all(key) != data) ++mismatches;
      }
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_EQ(mismatches.load(), 0);
  EXPECT_EQ(store->list("").size(), 30u);
}

}  // namespace
}  // namespace strata::offload::test
