// Sharded safetensors checkpoints: loaded through their index (or as one model.safetensors) and
// checked against it; ShardedSafetensorsWriter cuts shards as transformers does, and writers of
// parts of one shard set write the files of one writer.
#include <gtest/gtest.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <nlohmann/json.hpp>
#include <span>
#include <string>
#include <system_error>
#include <vector>

#include "safetensors_fixture.h"
#include "strata/models/safetensors.h"
#include "strata/models/sharded_safetensors.h"
#include "test_util.h"

namespace strata::models {
namespace {

using namespace safetensors_testing;
namespace fs = std::filesystem;
using nlohmann::json;

// ---------------------------------------------------------------------------------------------
// Sharded checkpoints (made here with the writer; the Python-made one: safetensors_oracle_test.cc)

class StCheckpoint : public Safetensors {
 protected:
  void SetUp() override {
    ckpt_ = dir_ / "ckpt";
    fs::create_directory(ckpt_);
    write_shard("model-00001-of-00002.safetensors", {"wte.weight", "h.0.w"});
    write_shard("model-00002-of-00002.safetensors", {"h.1.w", "lm_head.weight"});
    index_ = {{"metadata", {{"total_size", 64}}},
              {"weight_map",
               {{"wte.weight", "model-00001-of-00002.safetensors"},
                {"h.0.w", "model-00001-of-00002.safetensors"},
                {"h.1.w", "model-00002-of-00002.safetensors"},
                {"lm_head.weight", "model-00002-of-00002.safetensors"}}}};
    write_index();
  }
  void write_shard(const std::string& file, const std::vector<std::string>& names) {
    std::vector<SafetensorsWriter::Spec> specs;
    for (const auto& n : names) specs.push_back({n, StDType::kF32, {4}});
    SafetensorsWriter w(ckpt_ / file, specs);
    for (const auto& n : names) w.write(n, as_bytes(pattern(16, std::hash<std::string>()(n))));
    w.finish();
  }
  void write_index() { spit(ckpt_ / "model.safetensors.index.json", index_.dump(1)); }
  std::string load_error() {
    return error_of([&] { SafetensorsCheckpoint c(ckpt_); });
  }
  fs::path ckpt_;
  json index_;
};

TEST_F(StCheckpoint, LoadsFromTheDirectoryOrTheIndex) {
  for (const fs::path& p : {ckpt_, ckpt_ / "model.safetensors.index.json"}) {
    SafetensorsCheckpoint c(p);
    EXPECT_EQ(c.names(), (std::vector<std::string>{"h.0.w", "h.1.w", "lm_head.weight", "wte.weight"}));
    for (const auto& n : c.names()) {
      EXPECT_TRUE(c.contains(n));
      EXPECT_EQ(as_string(c.get(n).data), pattern(16, std::hash<std::string>()(n))) << n;
    }
    EXPECT_FALSE(c.contains("nope"));
    const std::string m = error_of([&] { c.get("h.2.w"); });
    EXPECT_HAS(m, "tensor 'h.2.w': no such tensor");
    EXPECT_HAS(m, ckpt_.string());
  }
}

TEST_F(StCheckpoint, SingleFileAndItsDirectory) {
  const fs::path single = dir_ / "single";
  fs::create_directory(single);
  {
    SafetensorsWriter w(single / "model.safetensors", {{"x", StDType::kI32, {1}}});
    w.write("x", as_bytes(std::string("\1\2\3\4", 4)));
    w.finish();
  }
  for (const fs::path& p : {single, single / "model.safetensors"}) {
    SafetensorsCheckpoint c(p);
    EXPECT_EQ(c.names(), std::vector<std::string>{"x"});
    EXPECT_EQ(as_string(c.get("x").data), std::string("\1\2\3\4", 4));
    EXPECT_HAS(error_of([&] { c.get("y"); }), "model.safetensors: tensor 'y'");
  }
  fs::create_directory(dir_ / "nothing");
  EXPECT_HAS(error_of([&] { SafetensorsCheckpoint c(dir_ / "nothing"); }),
             "holds neither model.safetensors nor model.safetensors.index.json");
}

TEST_F(StCheckpoint, IndexNamesATensorItsShardDoesNotHold) {
  index_["weight_map"]["h.0.mlp.ghost"] = "model-00002-of-00002.safetensors";
  write_index();
  const std::string m = load_error();
  EXPECT_HAS(m, "model.safetensors.index.json: tensor 'h.0.mlp.ghost'");
  EXPECT_HAS(m, "model-00002-of-00002.safetensors");
}

TEST_F(StCheckpoint, ShardHoldsATensorTheIndexDoesNotList) {
  index_["weight_map"].erase("h.1.w");
  write_index();
  const std::string m = load_error();
  EXPECT_HAS(m, "tensor 'h.1.w'");
  EXPECT_HAS(m, "shard 'model-00002-of-00002.safetensors' holds it but the weight_map does not");
}

TEST_F(StCheckpoint, IndexPutsATensorInTheWrongShard) {
  index_["weight_map"]["h.1.w"] = "model-00001-of-00002.safetensors";
  write_index();
  EXPECT_HAS(load_error(), "tensor 'h.1.w'");
}

TEST_F(StCheckpoint, MalformedIndex) {
  spit(ckpt_ / "model.safetensors.index.json", "{\"weight_map\": [");
  EXPECT_HAS(load_error(), "not valid JSON");
  spit(ckpt_ / "model.safetensors.index.json", "{\"metadata\": {}}");
  EXPECT_HAS(load_error(), "no weight_map");
  index_["weight_map"]["h.0.w"] = 3;
  write_index();
  EXPECT_HAS(load_error(), "tensor 'h.0.w': weight_map value is not a string");
  index_["weight_map"]["h.0.w"] = "../elsewhere.safetensors";
  write_index();
  EXPECT_HAS(load_error(), "tensor 'h.0.w': shard '../elsewhere.safetensors' is not a file name");
  index_["weight_map"]["wte.weight"] = "model-00003-of-00002.safetensors";
  index_["weight_map"]["h.0.w"] = "model-00003-of-00002.safetensors";
  write_index();
  EXPECT_THROW(SafetensorsCheckpoint c(ckpt_), std::system_error);  // the shard does not exist
}

// Shards are cut as transformers cuts them (huggingface_hub's split_state_dict_into_shards: the
// shard in progress closes when the next tensor would pass the limit, a tensor above the limit
// is a shard of its own numbered when it comes), the index maps every tensor to its file and
// states the total, the bytes read back through the index are the bytes written (appended in
// pieces that cross tensor and shard boundaries, two shards open at once), and one shard is a
// plain model.safetensors without an index.
TEST(ShardedSafetensors, CutsLikeTransformersAndReadsBackThroughTheIndex) {
  test::TempDir dir;
  // F32 tensors of 40, 24, 100 (above the limit), 8, 8, 36 bytes; limit 48.
  const std::vector<SafetensorsWriter::Spec> specs = {{"a", StDType::kF32, {10}}, {"b", StDType::kF32, {2, 3}},
                                                      {"c", StDType::kF32, {25}}, {"d", StDType::kF32, {2}},
                                                      {"e", StDType::kF32, {2}},  {"f", StDType::kF32, {9}}};
  std::vector<float> all;
  for (int i = 0; i < 10 + 6 + 25 + 2 + 2 + 9; ++i) all.push_back(float(i) * 0.5f - 3.0f);
  {
    ShardedSafetensorsWriter w(dir.path(), specs, 48, {{"format", "pt"}});
    EXPECT_EQ(w.shards(), 4u);  // {a}, {c}, {b, d, e}, {f}
    // Each shard is announced once, complete under its name, as its last tensor's bytes go in.
    std::vector<std::pair<std::string, size_t>> announced;  // file, its tensors
    w.on_shard_complete([&](const std::string& file) { announced.push_back({file, SafetensorsFile(dir / file).tensors().size()}); });
    const auto bytes = std::as_bytes(std::span(all));
    for (size_t at = 0; at < bytes.size(); at += 7) w.append(bytes.subspan(at, std::min<size_t>(7, bytes.size() - at)));
    w.finish();
    EXPECT_EQ(w.files().back(), "model.safetensors.index.json");
    EXPECT_EQ(announced, (std::vector<std::pair<std::string, size_t>>{{"model-00001-of-00004.safetensors", 1},
                                                                      {"model-00002-of-00004.safetensors", 1},
                                                                      {"model-00003-of-00004.safetensors", 3},
                                                                      {"model-00004-of-00004.safetensors", 1}}));
  }
  const nlohmann::json index = nlohmann::json::parse(std::ifstream(dir / "model.safetensors.index.json"));
  EXPECT_EQ(index["metadata"]["total_size"], all.size() * 4);
  const std::map<std::string, std::string> want = {
      {"a", "model-00001-of-00004.safetensors"}, {"b", "model-00003-of-00004.safetensors"},
      {"c", "model-00002-of-00004.safetensors"}, {"d", "model-00003-of-00004.safetensors"},
      {"e", "model-00003-of-00004.safetensors"}, {"f", "model-00004-of-00004.safetensors"}};
  const auto weight_map = index["weight_map"].get<std::map<std::string, std::string>>();
  EXPECT_EQ(weight_map, want);
  SafetensorsCheckpoint ck(dir.path());
  size_t offset = 0;
  for (const auto& spec : specs) {
    const TensorView v = ck.get(spec.name);
    ASSERT_EQ(v.data.size() % 4, 0u);
    std::vector<float> got(v.data.size() / 4);
    std::memcpy(got.data(), v.data.data(), v.data.size());
    EXPECT_EQ(got, std::vector<float>(all.begin() + long(offset), all.begin() + long(offset + got.size()))) << spec.name;
    offset += got.size();
  }
  EXPECT_EQ(offset, all.size());

  test::TempDir one;
  {
    ShardedSafetensorsWriter w(one.path(), specs, 1 << 20);
    for (size_t i = 0, off = 0; i < specs.size(); ++i) {
      size_t n = 1;
      for (int64_t d : specs[i].shape) n *= size_t(d);
      w.write(specs[i].name, std::as_bytes(std::span(all).subspan(off, n)));
      off += n;
    }
    EXPECT_THROW(w.write("a", {}), SafetensorsError);  // not the next tensor
    w.finish();
  }
  EXPECT_TRUE(std::filesystem::exists(one / "model.safetensors"));
  EXPECT_FALSE(std::filesystem::exists(one / "model.safetensors.index.json"));
  EXPECT_EQ(SafetensorsFile(one / "model.safetensors").tensors().size(), specs.size());
  // An unfinished writer leaves no shard half written: the complete ones stay (an export's
  // temporary directory goes as a whole), the one in progress goes.
  test::TempDir cut;
  {
    ShardedSafetensorsWriter w(cut.path(), specs, 48);
    w.append(std::as_bytes(std::span(all).subspan(0, 12)));  // all of "a" (shard 1), 8 bytes of "b"
  }
  EXPECT_TRUE(std::filesystem::exists(cut / "model-00001-of-00004.safetensors"));
  std::filesystem::remove(cut / "model-00001-of-00004.safetensors");
  for (const auto& e : std::filesystem::directory_iterator(cut.path())) ADD_FAILURE() << "left behind: " << e.path();
}

// Writers that share one set (ranks of an export, ShardSetPart), each given only its shards'
// tensors, write together the files one writer writes, byte for byte, whichever way the shards
// are dealt; plan_shards is the cut the writer makes; a part that names the wrong number of
// shards is refused.
TEST(ShardedSafetensors, WritersOfPartsWriteTheFilesOfOneWriter) {
  // 7 tensors of awkward sizes (bytes: 12, 52, 4, 200 over the limit, 36, 0, 28), limit 64.
  const std::vector<SafetensorsWriter::Spec> specs = {
      {"w0", StDType::kF32, {3}},    {"w1", StDType::kF32, {13}}, {"w2", StDType::kBF16, {2}},
      {"w3", StDType::kF32, {5, 10}}, {"w4", StDType::kF32, {9}},  {"w5", StDType::kF32, {0}},
      {"w6", StDType::kF16, {14}}};
  std::vector<std::vector<std::byte>> bytes;
  for (size_t t = 0; t < specs.size(); ++t) {
    size_t n = st_dtype_bytes(specs[t].dtype);
    for (int64_t d : specs[t].shape) n *= size_t(d);
    std::vector<std::byte> b(n);
    for (size_t i = 0; i < n; ++i) b[i] = std::byte((t * 37 + i * 11) & 0xff);
    bytes.push_back(std::move(b));
  }
  const std::vector<std::vector<size_t>> shards = plan_shards(specs, 64);
  EXPECT_EQ(shards, (std::vector<std::vector<size_t>>{{0, 1}, {3}, {2, 4, 5}, {6}}));
  test::TempDir one, parts;
  {
    ShardedSafetensorsWriter w(one.path(), specs, 64, {{"format", "pt"}});
    ASSERT_EQ(w.shards(), shards.size());
    for (size_t t = 0; t < specs.size(); ++t)
      if (!bytes[t].empty()) w.write(specs[t].name, bytes[t]);  // an empty one is written by itself
    w.finish();
  }
  for (const std::vector<int>& deal : {std::vector<int>{0, 1, 2, 0}, {1, 1, 0, 2}, {2, 0, 1, 1}}) {
    std::filesystem::remove_all(parts.path());
    std::filesystem::create_directories(parts.path());
    std::vector<std::string> announced;
    for (int writer = 0; writer < 3; ++writer) {
      ShardSetPart part{std::vector<bool>(shards.size()), writer == 0};
      for (size_t s = 0; s < shards.size(); ++s) part.shards[s] = deal[s] == writer;
      ShardedSafetensorsWriter w(parts.path(), specs, 64, {{"format", "pt"}}, part);
      w.on_shard_complete([&](const std::string& f) { announced.push_back(f); });
      for (size_t s = 0; s < shards.size(); ++s)
        if (deal[s] == writer)
          for (size_t t : shards[s])
            if (!bytes[t].empty()) w.write(specs[t].name, bytes[t]);
      w.finish();
      EXPECT_EQ(w.files(), shard_set_files(shards.size()));
    }
    EXPECT_EQ(announced.size(), shards.size());
    for (const std::string& f : shard_set_files(shards.size()))
      EXPECT_EQ(slurp(parts / f), slurp(one / f)) << f;
    size_t files = 0;
    for (const auto& e : std::filesystem::directory_iterator(parts.path())) files += e.is_regular_file();
    EXPECT_EQ(files, shards.size() + 1);
  }
  // A writer given another's tensor, or a part of the wrong size, is refused.
  test::TempDir bad;
  ShardedSafetensorsWriter w(bad.path(), specs, 64, {}, ShardSetPart{{false, true, false, false}, false});
  EXPECT_THROW(w.write("w0", bytes[0]), SafetensorsError);
  EXPECT_THROW(ShardedSafetensorsWriter(bad.path(), specs, 64, {}, ShardSetPart{{true}, true}), SafetensorsError);
}

}  // namespace
}  // namespace strata::models
