// SafetensorsWriter: files written in pieces read back exactly, with the header the safetensors
// library writes; the writer's atomicity (nothing, or the old file, until finish()) and its
// bookkeeping errors.
#include <gtest/gtest.h>

#include <cstdint>
#include <filesystem>
#include <map>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "safetensors_fixture.h"
#include "strata/models/safetensors.h"
#include "test_util.h"

namespace strata::models {
namespace {

using namespace safetensors_testing;
namespace fs = std::filesystem;
using nlohmann::json;

TEST_F(Safetensors, WriterRoundTripsWithPiecesZeroSizedAndScalarTensors) {
  const fs::path p = dir_ / "w.safetensors";
  const std::vector<SafetensorsWriter::Spec> specs = {
      {"a", StDType::kF32, {3, 5}},   {"empty", StDType::kBF16, {0, 7}}, {"s", StDType::kI64, {}},
      {"z", StDType::kU8, {0}},       {"odd", StDType::kU8, {13}},       {"mask", StDType::kBool, {2, 2}},
      {"tail0", StDType::kF16, {4, 0}}};
  const std::string a = pattern(60, 1), s = pattern(8, 2), odd = pattern(13, 3);
  const std::string mask("\1\0\0\1", 4);
  {
    SafetensorsWriter w(p, specs, {{"format", "pt"}, {"author", "strata"}});
    EXPECT_TRUE(fs::exists(dir_ / "w.safetensors.tmp"));
    EXPECT_FALSE(fs::exists(p));
    w.append(as_bytes(a.substr(0, 7)));        // a in three pieces
    w.append(as_bytes(a.substr(7, 50)));
    w.append(as_bytes(a.substr(57) + s.substr(0, 3)));  // a's tail and s's head in one piece
    w.append(as_bytes(s.substr(3)));
    w.write("z", {});  // zero-sized, already complete: a no-op in order
    w.write("odd", as_bytes(odd));
    w.write("mask", as_bytes(mask));
    w.finish();
    EXPECT_FALSE(fs::exists(dir_ / "w.safetensors.tmp"));
  }
  const std::string raw = slurp(p);
  uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | static_cast<uint8_t>(raw[i]);
  EXPECT_EQ((8 + n) % 8, 0u) << "data section not 8-byte aligned";
  EXPECT_EQ(raw.size(), 8 + n + 60 + 8 + 13 + 4);

  SafetensorsFile f(p);
  EXPECT_EQ(f.metadata(), (std::map<std::string, std::string>{{"format", "pt"}, {"author", "strata"}}));
  ASSERT_EQ(f.tensors().size(), specs.size());
  for (size_t i = 0; i < specs.size(); ++i) {
    EXPECT_EQ(f.tensors()[i].name, specs[i].name) << "declared order";
    EXPECT_EQ(f.tensors()[i].dtype, specs[i].dtype);
    EXPECT_EQ(f.tensors()[i].shape, specs[i].shape);
  }
  EXPECT_EQ(as_string(f.get("a").data), a);
  EXPECT_EQ(as_string(f.get("s").data), s);
  EXPECT_EQ(as_string(f.get("odd").data), odd);
  EXPECT_EQ(as_string(f.get("mask").data), mask);
  EXPECT_EQ(f.get("empty").data.size(), 0u);
  // The header itself is as the safetensors library writes it: metadata first, offsets contiguous.
  const json h = json::parse(raw.substr(8, n));
  EXPECT_EQ(h["a"]["data_offsets"], json({0, 60}));
  EXPECT_EQ(h["s"]["data_offsets"], json({60, 68}));
  EXPECT_EQ(raw.substr(8, 15), R"({"__metadata__")");
}

TEST_F(Safetensors, WriterWithNoTensorsWritesAnEmptyDataSection) {
  {
    SafetensorsWriter w(dir_ / "none.safetensors", {});
    w.finish();
  }
  SafetensorsFile f(dir_ / "none.safetensors");
  EXPECT_TRUE(f.tensors().empty());
  EXPECT_TRUE(f.metadata().empty());
}

TEST_F(Safetensors, UnfinishedWriterLeavesNoFileAndNoTmp) {
  const fs::path p = dir_ / "unfinished.safetensors";
  {
    SafetensorsWriter w(p, {{"a", StDType::kF32, {4}}});
    w.append(as_bytes(pattern(8, 4)));
    EXPECT_TRUE(fs::exists(dir_ / "unfinished.safetensors.tmp"));
  }
  EXPECT_FALSE(fs::exists(p));
  EXPECT_FALSE(fs::exists(dir_ / "unfinished.safetensors.tmp"));
  // Fully written but not finished: still nothing.
  {
    SafetensorsWriter w(p, {{"a", StDType::kF32, {4}}});
    w.append(as_bytes(pattern(16, 4)));
  }
  EXPECT_FALSE(fs::exists(p));
  EXPECT_FALSE(fs::exists(dir_ / "unfinished.safetensors.tmp"));
  EXPECT_TRUE(fs::is_empty(dir_.path()));
}

TEST_F(Safetensors, ExistingFileIsReplacedOnlyAtFinish) {
  const fs::path p = dir_ / "replace.safetensors";
  spit(p, "old contents");
  {
    SafetensorsWriter w(p, {{"a", StDType::kU8, {2}}});
    w.write("a", as_bytes(std::string("xy")));
    EXPECT_EQ(slurp(p), "old contents");
  }
  EXPECT_EQ(slurp(p), "old contents");  // abandoned: old file untouched
  SafetensorsWriter w(p, {{"a", StDType::kU8, {2}}});
  w.write("a", as_bytes(std::string("xy")));
  w.finish();
  EXPECT_EQ(as_string(SafetensorsFile(p).get("a").data), "xy");
}

TEST_F(Safetensors, WriterRejectsTooManyBytesWithoutWritingThem) {
  const fs::path p = dir_ / "many.safetensors";
  SafetensorsWriter w(p, {{"a", StDType::kU8, {4}}, {"b", StDType::kI16, {2}}});
  w.append(as_bytes(std::string("abc")));
  const std::string m = error_of([&] { w.append(as_bytes(std::string(7, 'x'))); });
  EXPECT_HAS(m, "many.safetensors");
  EXPECT_HAS(m, "at tensor 'a'");
  EXPECT_HAS(m, "goes 2 bytes beyond the declared tensors");
  w.append(as_bytes(std::string("d1234")));  // exactly the rest still fits
  EXPECT_HAS(error_of([&] { w.append(as_bytes(std::string("!"))); }), "after the last tensor");
  w.finish();
  EXPECT_EQ(as_string(SafetensorsFile(p).get("a").data), "abcd");
  EXPECT_EQ(as_string(SafetensorsFile(p).get("b").data), "1234");
}

TEST_F(Safetensors, FinishWithATensorShortNamesIt) {
  const fs::path p = dir_ / "short.safetensors";
  {
    SafetensorsWriter w(p, {{"a", StDType::kU8, {2}}, {"h.1.mlp.weight", StDType::kF32, {2}}});
    w.write("a", as_bytes(std::string("ab")));
    w.append(as_bytes(std::string("123")));
    const std::string m = error_of([&] { w.finish(); });
    EXPECT_HAS(m, "short.safetensors");
    EXPECT_HAS(m, "tensor 'h.1.mlp.weight': not fully written at finish(): 3 of 8 bytes");
  }
  EXPECT_FALSE(fs::exists(p));
  EXPECT_FALSE(fs::exists(dir_ / "short.safetensors.tmp"));
  {
    SafetensorsWriter w(p, {{"first", StDType::kU8, {2}}, {"second", StDType::kU8, {2}}});
    EXPECT_HAS(error_of([&] { w.finish(); }), "tensor 'first': not fully written at finish(): 0 of 2");
  }
}

TEST_F(Safetensors, WriterBookkeepingErrors) {
  const fs::path p = dir_ / "book.safetensors";
  SafetensorsWriter w(p, {{"a", StDType::kU8, {2}}, {"b", StDType::kU8, {2}}});
  EXPECT_HAS(error_of([&] { w.write("b", as_bytes(std::string("xy"))); }),
             "tensor 'b': written out of order: the next tensor is 'a' (0 of 2 bytes written)");
  EXPECT_HAS(error_of([&] { w.write("a", as_bytes(std::string("xyz"))); }),
             "tensor 'a': write of 3 bytes but the tensor holds 2");
  EXPECT_HAS(error_of([&] { w.write("c", as_bytes(std::string("xy"))); }), "tensor 'c': not declared");
  w.append(as_bytes(std::string("x")));
  EXPECT_HAS(error_of([&] { w.write("b", as_bytes(std::string("xy"))); }), "'a' (1 of 2 bytes written)");
  w.append(as_bytes(std::string("y")));
  w.write("b", as_bytes(std::string("zw")));
  w.finish();
  EXPECT_HAS(error_of([&] { w.append(as_bytes(std::string("q"))); }), "already finished");

  EXPECT_HAS(error_of([&] { SafetensorsWriter d(dir_ / "d.safetensors", {{"a", StDType::kU8, {1}}, {"a", StDType::kU8, {1}}}); }),
             "tensor 'a': declared twice");
  EXPECT_HAS(error_of([&] { SafetensorsWriter d(dir_ / "d.safetensors", {{"n", StDType::kU8, {2, -1}}}); }),
             "tensor 'n': negative dimension in shape [2, -1]");
  EXPECT_HAS(error_of([&] { SafetensorsWriter d(dir_ / "d.safetensors", {{"__metadata__", StDType::kU8, {1}}}); }),
             "reserved name");
  EXPECT_HAS(error_of([&] {
               SafetensorsWriter d(dir_ / "d.safetensors",
                                   {{"o", StDType::kF64, {int64_t{1} << 62, 4}}});
             }),
             "tensor 'o': shape [4611686018427387904, 4] overflows");
  EXPECT_FALSE(fs::exists(dir_ / "d.safetensors.tmp"));
}

}  // namespace
}  // namespace strata::models
