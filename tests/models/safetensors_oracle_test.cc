// The oracle, tests/models/py/st_oracle.py (the Python safetensors package): files and a sharded
// checkpoint it wrote read back exactly, and files SafetensorsWriter wrote load in Python exactly.
// The oracle tests skip when STRATA_PYTHON is not set.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <map>
#include <nlohmann/json.hpp>
#include <set>
#include <string>
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

const std::string kPython = STRATA_PYTHON;
const std::string kOracle = std::string(STRATA_TEST_PY_DIR) + "/st_oracle.py";

// Runs a shell command with its output in `log`; returns the exit status.
int run(const std::string& cmd, const fs::path& log) {
  return std::system((cmd + " >" + log.string() + " 2>&1").c_str());
}

// ---------------------------------------------------------------------------------------------
// Oracle: the Python safetensors package

class StOracle : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    dir_ = new test::TempDir();
    if (!kPython.empty()) {
      made_ = run(kPython + " " + kOracle + " make " + dir_->path().string(),
                  dir_->path() / "make.log") == 0;
    }
  }
  static void TearDownTestSuite() {
    delete dir_;
    dir_ = nullptr;
  }
  void SetUp() override {
    if (kPython.empty()) {
      GTEST_SKIP() << "no Python with safetensors configured (set STRATA_PYTHON at configure time)";
    }
    ASSERT_TRUE(made_) << "st_oracle.py make failed:\n" << slurp(dir_->path() / "make.log");
    expected_ = json::parse(slurp(dir_->path() / "expected.json"));
  }
  static fs::path path(const std::string& rel) { return dir_->path() / rel; }

  // Checks one tensor against its description {"name", "dtype", "shape", "bin"}.
  static void expect_tensor(const TensorView& v, const json& want, const fs::path& file) {
    const std::string name = want["name"];
    SCOPED_TRACE(file.string() + ": " + name);
    EXPECT_EQ(v.info->name, name);
    EXPECT_EQ(to_string(v.info->dtype), want["dtype"].get<std::string>());
    EXPECT_EQ(v.info->shape, want["shape"].get<std::vector<int64_t>>());
    EXPECT_EQ(as_string(v.data), slurp(path(want["bin"])));
    EXPECT_EQ(v.data.size(), v.info->numel() * st_dtype_bytes(v.info->dtype));
  }

  static test::TempDir* dir_;
  static bool made_;
  json expected_;
};
test::TempDir* StOracle::dir_ = nullptr;
bool StOracle::made_ = false;

TEST_F(StOracle, ReadsFilesWrittenByPythonSafetensors) {
  size_t files = 0, tensors = 0;
  for (const json& want : expected_["files"]) {
    const fs::path p = path(want["file"]);
    SafetensorsFile f(p);
    using Meta = std::map<std::string, std::string>;
    EXPECT_EQ(f.metadata(), want["metadata"].get<Meta>()) << p;
    ASSERT_EQ(f.tensors().size(), want["tensors"].size()) << p;
    // The data section starts 8-byte aligned in files the library writes, and tensors follow
    // each other without gaps.
    uint64_t at = 0;
    for (const TensorInfo& t : f.tensors()) {
      EXPECT_EQ(t.begin, at) << p << " " << t.name;
      at = t.end;
    }
    for (const json& t : want["tensors"]) {
      ASSERT_TRUE(f.contains(t["name"])) << p << " " << t["name"];
      expect_tensor(f.get(t["name"]), t, p);
      ++tensors;
    }
    ++files;
  }
  EXPECT_EQ(files, 5u);
  EXPECT_GE(tensors, 25u);
}

TEST_F(StOracle, ReadsAShardedCheckpointWrittenByPython) {
  SafetensorsCheckpoint c(path("sharded"));
  std::set<std::string> want_names;
  for (const json& t : expected_["sharded"]) {
    want_names.insert(t["name"].get<std::string>());
    expect_tensor(c.get(t["name"]), t, path("sharded"));
  }
  const auto names = c.names();
  EXPECT_EQ(std::set<std::string>(names.begin(), names.end()), want_names);
  EXPECT_TRUE(std::is_sorted(names.begin(), names.end()));
}

TEST_F(StOracle, PythonShardedCheckpointWithAMissingOrUnexpectedTensorFails) {
  test::TempDir tmp;
  const fs::path d = tmp / "sharded";
  fs::copy(path("sharded"), d);
  json index = json::parse(slurp(d / "model.safetensors.index.json"));
  const json original = index;
  index["weight_map"]["h.3.attn.missing"] = "model-00001-of-00002.safetensors";
  spit(d / "model.safetensors.index.json", index.dump());
  EXPECT_HAS(error_of([&] { SafetensorsCheckpoint c(d); }), "tensor 'h.3.attn.missing'");
  index = original;
  index["weight_map"].erase("lm_head.weight");
  spit(d / "model.safetensors.index.json", index.dump());
  const std::string m = error_of([&] { SafetensorsCheckpoint c(d); });
  EXPECT_HAS(m, "tensor 'lm_head.weight'");
  EXPECT_HAS(m, "holds it but the weight_map does not");
}

class StOracleWriter : public StOracle {
 protected:
  // Writes `out` with SafetensorsWriter (each tensor in pieces of `piece` bytes, across tensor
  // boundaries) and its description for `st_oracle.py check`.
  struct T {
    std::string name;
    StDType dtype;
    std::vector<int64_t> shape;
  };
  static void write_with_strata(const fs::path& out, const std::vector<T>& ts, size_t piece,
                                const std::map<std::string, std::string>& meta) {
    std::vector<SafetensorsWriter::Spec> specs;
    std::string all;
    json desc = {{"metadata", meta}, {"tensors", json::array()}};
    fs::create_directories(out.parent_path() / "bin");
    for (size_t i = 0; i < ts.size(); ++i) {
      specs.push_back({ts[i].name, ts[i].dtype, ts[i].shape});
      uint64_t numel = 1;
      for (int64_t d : ts[i].shape) numel *= static_cast<uint64_t>(d);
      std::string bytes = pattern(numel * st_dtype_bytes(ts[i].dtype), 100 + i);
      if (ts[i].dtype == StDType::kBool) {
        for (char& c : bytes) c &= 1;  // numpy/torch bools are 0 or 1
      }
      const std::string bin = "bin/" + std::to_string(i) + ".bin";
      spit(out.parent_path() / bin, bytes);
      desc["tensors"].push_back(
          {{"name", ts[i].name}, {"dtype", to_string(ts[i].dtype)}, {"shape", ts[i].shape}, {"bin", bin}});
      all += bytes;
    }
    SafetensorsWriter w(out, specs, meta);
    for (size_t at = 0; at < all.size(); at += piece) {
      w.append(as_bytes(all.substr(at, piece)));
    }
    w.finish();
    spit(out.string() + ".json", desc.dump(1));
  }
  // Runs `st_oracle.py check` on the files (each described by FILE.json); returns its status.
  static int check(const std::vector<fs::path>& files, const fs::path& log) {
    std::string cmd = kPython + " " + kOracle + " check";
    for (const auto& f : files) cmd += " " + f.string();
    return run(cmd, log);
  }
};

TEST_F(StOracleWriter, PythonReadsFilesWrittenByStrata) {
  test::TempDir tmp;
  const std::vector<T> ts = {
      {"h.0.attn.c_attn.weight", StDType::kF32, {4, 12}}, {"bias", StDType::kBF16, {12}},
      {"scalar", StDType::kF16, {}},   {"empty", StDType::kF32, {0}},
      {"ids", StDType::kI64, {2, 9}},  {"img", StDType::kU8, {3, 4, 5}},
      {"flags", StDType::kBool, {17}}, {"mid0", StDType::kBF16, {3, 0, 2}},
      {"f64", StDType::kF64, {3}},     {"i32", StDType::kI32, {5, 1}},
      {"i16", StDType::kI16, {1, 7}},  {"i8", StDType::kI8, {11}},
      {"ünïcödé \"q\"", StDType::kF32, {2, 2}}};
  std::vector<fs::path> files;
  for (size_t piece : {size_t{1}, size_t{5}, size_t{1000}}) {
    const std::string name = "strata-" + std::to_string(piece);
    files.push_back(tmp / name / "model.safetensors");
    write_with_strata(files.back(), ts, piece, {{"format", "pt"}, {"piece", std::to_string(piece)}});
  }
  // No metadata; numpy-only dtypes (the oracle then also loads with safetensors.numpy).
  files.push_back(tmp / "plain" / "model.safetensors");
  write_with_strata(files.back(), {{"a", StDType::kF32, {3, 3}}, {"b", StDType::kI64, {}}, {"c", StDType::kU8, {0}}}, 7, {});
  // No tensors at all.
  files.push_back(tmp / "empty" / "model.safetensors");
  write_with_strata(files.back(), {}, 1, {{"k", "v"}});
  EXPECT_EQ(check(files, tmp / "check.log"), 0) << slurp(tmp / "check.log");
  const std::string log = slurp(tmp / "check.log");
  for (const auto& f : files) EXPECT_HAS(log, f.string() + ": ok,");
}

TEST_F(StOracleWriter, TheOracleDetectsAMismatch) {
  // Guards against an oracle that always passes: one file right, one with a byte changed in the
  // expected values of tensor b.
  test::TempDir tmp;
  const std::vector<fs::path> files = {tmp / "good" / "m.safetensors", tmp / "bad" / "m.safetensors"};
  for (const auto& f : files) {
    write_with_strata(f, {{"a", StDType::kF32, {3}}, {"b", StDType::kU8, {2}}}, 4, {{"k", "v"}});
  }
  std::string bin = slurp(tmp / "bad" / "bin/1.bin");
  bin[1] ^= 1;
  spit(tmp / "bad" / "bin/1.bin", bin);
  EXPECT_NE(check(files, tmp / "check.log"), 0);
  const std::string log = slurp(tmp / "check.log");
  EXPECT_HAS(log, files[0].string() + ": ok, 2 tensors");
  EXPECT_HAS(log, files[1].string() + ": b: torch bytes differ");
  EXPECT_EQ(log.find(files[1].string() + ": a:"), std::string::npos) << log;
}

}  // namespace
}  // namespace strata::models
