// Safetensors: files written by the Python safetensors package read back exactly, files written
// by SafetensorsWriter load in Python exactly (the oracle, tests/models/py/st_oracle.py), sharded
// checkpoints are checked against their index, every malformed file the header promises to reject
// is rejected with a message naming the file and tensor, and the writer's atomicity and
// bookkeeping errors.
#include <gtest/gtest.h>

#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <span>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>
#include <string>
#include <system_error>
#include <vector>

#include "strata/models/safetensors.h"
#include "strata/models/sharded_safetensors.h"
#include "test_util.h"

namespace strata::models {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

const std::string kPython = STRATA_PYTHON;
const std::string kOracle = std::string(STRATA_TEST_PY_DIR) + "/st_oracle.py";

// ---------------------------------------------------------------------------------------------
// Helpers

std::string slurp(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  std::ostringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

void spit(const fs::path& p, const std::string& bytes) {
  std::ofstream out(p, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  ASSERT_TRUE(out.good()) << p;
}

std::string le64(uint64_t n) {
  std::string s(8, '\0');
  for (int i = 0; i < 8; ++i) s[i] = static_cast<char>((n >> (8 * i)) & 0xff);
  return s;
}

// A safetensors file from a header text and `data_bytes` bytes of data (0, 1, 2, ...).
std::string st_bytes(const std::string& header, size_t data_bytes) {
  std::string data(data_bytes, '\0');
  for (size_t i = 0; i < data_bytes; ++i) data[i] = static_cast<char>(i * 7 + 1);
  return le64(header.size()) + header + data;
}

std::string as_string(std::span<const std::byte> s) {
  return std::string(reinterpret_cast<const char*>(s.data()), s.size());
}

std::span<const std::byte> as_bytes(const std::string& s) {
  return std::as_bytes(std::span<const char>(s.data(), s.size()));
}

// Runs a shell command with its output in `log`; returns the exit status.
int run(const std::string& cmd, const fs::path& log) {
  return std::system((cmd + " >" + log.string() + " 2>&1").c_str());
}

template <class F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (const SafetensorsError& e) {
    return e.what();
  }
  return "<no SafetensorsError thrown>";
}

#define EXPECT_HAS(msg, part) \
  EXPECT_NE((msg).find(part), std::string::npos) << "message: " << (msg) << "\nwanted: " << (part)

// A valid hand-made header: two tensors, contiguous, 64 data bytes.
const std::string kGoodHeader =
    R"({"__metadata__":{"format":"pt"},)"
    R"("h.0.attn.c_attn.weight":{"dtype":"F32","shape":[3,4],"data_offsets":[0,48]},)"
    R"("b":{"dtype":"I64","shape":[2],"data_offsets":[48,64]}})";

// A header with one tensor `name` given by its JSON entry, and a data section of `data` bytes.
std::string one_tensor(const std::string& name, const std::string& entry) {
  return "{\"" + name + "\":" + entry + "}";
}

class Safetensors : public ::testing::Test {
 protected:
  // Writes a file named `name` and returns the error message of opening it.
  std::string open_error(const std::string& name, const std::string& bytes) {
    spit(dir_ / name, bytes);
    return error_of([&] { SafetensorsFile f(dir_ / name); });
  }
  test::TempDir dir_;
};

// ---------------------------------------------------------------------------------------------
// Reading hand-made files

TEST_F(Safetensors, ReadsAValidFile) {
  spit(dir_ / "good.safetensors", st_bytes(kGoodHeader, 64));
  SafetensorsFile f(dir_ / "good.safetensors");
  ASSERT_EQ(f.tensors().size(), 2u);
  EXPECT_EQ(f.tensors()[0].name, "h.0.attn.c_attn.weight");  // file order
  EXPECT_EQ(f.tensors()[1].name, "b");
  EXPECT_EQ(f.metadata(), (std::map<std::string, std::string>{{"format", "pt"}}));
  EXPECT_TRUE(f.contains("b"));
  EXPECT_FALSE(f.contains("c"));
  const TensorView w = f.get("h.0.attn.c_attn.weight");
  EXPECT_EQ(w.info->dtype, StDType::kF32);
  EXPECT_EQ(w.info->shape, (std::vector<int64_t>{3, 4}));
  EXPECT_EQ(w.info->numel(), 12u);
  ASSERT_EQ(w.data.size(), 48u);
  const TensorView b = f.get("b");
  ASSERT_EQ(b.data.size(), 16u);
  EXPECT_EQ(b.data.data(), w.data.data() + 48);
  const std::string file = st_bytes(kGoodHeader, 64);
  EXPECT_EQ(as_string(b.data), file.substr(8 + kGoodHeader.size() + 48, 16));
}

TEST_F(Safetensors, FileOrderIsDataOrderNotJsonOrder) {
  const std::string h =
      R"({"late":{"dtype":"U8","shape":[4],"data_offsets":[4,8]},)"
      R"("early":{"dtype":"U8","shape":[4],"data_offsets":[0,4]}})";
  spit(dir_ / "order.safetensors", st_bytes(h, 8));
  SafetensorsFile f(dir_ / "order.safetensors");
  ASSERT_EQ(f.tensors().size(), 2u);
  EXPECT_EQ(f.tensors()[0].name, "early");
  EXPECT_EQ(f.tensors()[1].name, "late");
}

TEST_F(Safetensors, GapsAndTrailingBytesAreAcceptedZeroSizedTensorsOverlapNothing) {
  const std::string h =
      R"({"a":{"dtype":"F16","shape":[2],"data_offsets":[8,12]},)"
      R"("z":{"dtype":"F32","shape":[0,5],"data_offsets":[9,9]},)"
      R"("s":{"dtype":"BF16","shape":[],"data_offsets":[20,22]},)"
      R"("e":{"dtype":"BOOL","shape":[0],"data_offsets":[40,40]}})";
  spit(dir_ / "gaps.safetensors", st_bytes(h, 40));
  SafetensorsFile f(dir_ / "gaps.safetensors");
  EXPECT_EQ(f.get("s").info->shape.size(), 0u);
  EXPECT_EQ(f.get("s").info->numel(), 1u);
  EXPECT_EQ(f.get("s").data.size(), 2u);
  EXPECT_EQ(f.get("z").data.size(), 0u);
  EXPECT_EQ(f.get("e").data.size(), 0u);  // at the very end of the data section
}

TEST_F(Safetensors, ZeroLengthDataSectionMaps) {
  spit(dir_ / "empty.safetensors", st_bytes("{}", 0));
  SafetensorsFile f(dir_ / "empty.safetensors");
  EXPECT_TRUE(f.tensors().empty());
  spit(dir_ / "zeros.safetensors",
       st_bytes(one_tensor("z", R"({"dtype":"I64","shape":[3,0],"data_offsets":[0,0]})"), 0));
  SafetensorsFile z(dir_ / "zeros.safetensors");
  EXPECT_EQ(z.get("z").data.size(), 0u);
  EXPECT_EQ(z.get("z").info->numel(), 0u);
}

TEST_F(Safetensors, DTypeNamesAndSizes) {
  for (auto t : {StDType::kF64, StDType::kF32, StDType::kF16, StDType::kBF16, StDType::kI64,
                 StDType::kI32, StDType::kI16, StDType::kI8, StDType::kU8, StDType::kBool}) {
    EXPECT_EQ(parse_st_dtype(to_string(t)), t);
  }
  EXPECT_EQ(st_dtype_bytes(StDType::kBF16), 2u);
  EXPECT_EQ(st_dtype_bytes(StDType::kF64), 8u);
  EXPECT_EQ(st_dtype_bytes(StDType::kBool), 1u);
  EXPECT_HAS(error_of([] { parse_st_dtype("f32"); }), "unknown dtype 'f32'");
}

// ---------------------------------------------------------------------------------------------
// Every malformed file named in the header comment

TEST_F(Safetensors, FileShorterThanTheLengthField) {
  const std::string m = open_error("tiny.safetensors", "abc");
  EXPECT_HAS(m, "tiny.safetensors");
  EXPECT_HAS(m, "too short");
}

TEST_F(Safetensors, HeaderLengthBeyondTheFile) {
  const std::string m = open_error("hlen.safetensors", le64(1000) + kGoodHeader);
  EXPECT_HAS(m, "hlen.safetensors");
  EXPECT_HAS(m, "header length 1000 goes beyond the file");
}

TEST_F(Safetensors, AbsurdHeaderLength) {
  const std::string m = open_error("huge.safetensors", le64(uint64_t{1} << 62) + kGoodHeader);
  EXPECT_HAS(m, "huge.safetensors");
  EXPECT_HAS(m, "larger than the limit");
  const std::string m2 = open_error("max.safetensors", le64(~uint64_t{0}) + kGoodHeader);
  EXPECT_HAS(m2, "larger than the limit");
}

TEST_F(Safetensors, TruncatedData) {
  const std::string full = st_bytes(kGoodHeader, 64);
  const std::string m = open_error("trunc.safetensors", full.substr(0, full.size() - 10));
  EXPECT_HAS(m, "trunc.safetensors");
  EXPECT_HAS(m, "tensor 'b'");
  EXPECT_HAS(m, "data_offsets [48, 64) go beyond the data section of 54 bytes");
  // Cut inside the header: the length now points beyond the file.
  const std::string m2 = open_error("trunc2.safetensors", full.substr(0, 20));
  EXPECT_HAS(m2, "goes beyond the file");
}

TEST_F(Safetensors, HeaderThatIsNotJson) {
  const std::string m = open_error("notjson.safetensors", st_bytes(R"({"a": {"dtype": )", 0));
  EXPECT_HAS(m, "notjson.safetensors");
  EXPECT_HAS(m, "not valid JSON");
  EXPECT_HAS(open_error("arr.safetensors", st_bytes("[1, 2]", 0)), "header is a JSON array, not an object");
  EXPECT_HAS(open_error("nul.safetensors", st_bytes(std::string("{}\0", 3), 0)), "not valid JSON: NUL byte at offset 2");
  EXPECT_HAS(open_error("nul2.safetensors", st_bytes(std::string("{}\0garbage", 10), 0)), "NUL byte");
  EXPECT_HAS(open_error("utf8.safetensors", st_bytes("{\"\xff\":1}", 0)), "not valid JSON");
  EXPECT_HAS(open_error("empty.safetensors", st_bytes("", 0)), "not valid JSON");
}

TEST_F(Safetensors, UnknownDType) {
  const std::string m = open_error(
      "dtype.safetensors",
      st_bytes(one_tensor("w8", R"({"dtype":"F8_E4M3","shape":[4],"data_offsets":[0,4]})"), 4));
  EXPECT_HAS(m, "dtype.safetensors: tensor 'w8': unknown dtype 'F8_E4M3'");
  const std::string m2 = open_error(
      "dtype2.safetensors",
      st_bytes(one_tensor("w", R"({"dtype":32,"shape":[4],"data_offsets":[0,4]})"), 4));
  EXPECT_HAS(m2, "tensor 'w': dtype missing or not a string");
}

TEST_F(Safetensors, MalformedShape) {
  for (const std::string shape : {"[-1,4]", "[3.0,4]", "[\"3\",4]", "3", "null", "[[3],4]",
                                  "[9223372036854775808]", "[1e3]"}) {
    const std::string m = open_error(
        "shape.safetensors",
        st_bytes(one_tensor("w", R"({"dtype":"U8","shape":)" + shape + R"(,"data_offsets":[0,12]})"), 12));
    EXPECT_HAS(m, "shape.safetensors: tensor 'w'");
    EXPECT_HAS(m, "shape");
  }
  EXPECT_HAS(open_error("noshape.safetensors",
                        st_bytes(one_tensor("w", R"({"dtype":"U8","data_offsets":[0,12]})"), 12)),
             "tensor 'w': shape missing");
}

TEST_F(Safetensors, MalformedOffsets) {
  for (const std::string off : {"[0]", "[0,4,8]", "[-1,4]", "[0,4.0]", "\"0,4\"", "{}",
                                "[0,18446744073709551616]"}) {
    const std::string m = open_error(
        "off.safetensors",
        st_bytes(one_tensor("w", R"({"dtype":"U8","shape":[4],"data_offsets":)" + off + "}"), 8));
    EXPECT_HAS(m, "off.safetensors: tensor 'w': data_offsets");
    EXPECT_HAS(m, "not a pair");
  }
  const std::string m = open_error(
      "rev.safetensors",
      st_bytes(one_tensor("w", R"({"dtype":"U8","shape":[4],"data_offsets":[8,4]})"), 8));
  EXPECT_HAS(m, "tensor 'w': data_offsets [8, 4) end before they begin");
  EXPECT_HAS(open_error("nooff.safetensors",
                        st_bytes(one_tensor("w", R"({"dtype":"U8","shape":[4]})"), 8)),
             "tensor 'w': data_offsets missing");
  EXPECT_HAS(open_error("notobj.safetensors", st_bytes(one_tensor("w", "[1]"), 8)),
             "tensor 'w': entry is array, not an object");
}

TEST_F(Safetensors, OffsetsOutOfRange) {
  const std::string m = open_error(
      "range.safetensors",
      st_bytes(one_tensor("far", R"({"dtype":"F32","shape":[2],"data_offsets":[1000,1008]})"), 16));
  EXPECT_HAS(m, "range.safetensors: tensor 'far': data_offsets [1000, 1008) go beyond the data section of 16 bytes");
  // Zero-sized but placed beyond the end is out of range too.
  EXPECT_HAS(open_error("range0.safetensors",
                        st_bytes(one_tensor("z", R"({"dtype":"F32","shape":[0],"data_offsets":[17,17]})"), 16)),
             "tensor 'z': data_offsets [17, 17) go beyond");
}

TEST_F(Safetensors, OverlappingTensors) {
  const std::string h =
      R"({"a":{"dtype":"F32","shape":[3,4],"data_offsets":[0,48]},)"
      R"("b":{"dtype":"I64","shape":[2],"data_offsets":[40,56]}})";
  const std::string m = open_error("overlap.safetensors", st_bytes(h, 64));
  EXPECT_HAS(m, "overlap.safetensors: tensor 'b': data_offsets [40, 56) overlap tensor 'a' at [0, 48)");
  // The same bytes twice.
  const std::string h2 =
      R"({"x":{"dtype":"U8","shape":[8],"data_offsets":[0,8]},)"
      R"("y":{"dtype":"I8","shape":[8],"data_offsets":[0,8]}})";
  EXPECT_HAS(open_error("same.safetensors", st_bytes(h2, 8)), "overlap tensor 'x'");
  // Inside another, after a gap.
  const std::string h3 =
      R"({"x":{"dtype":"U8","shape":[20],"data_offsets":[4,24]},)"
      R"("y":{"dtype":"U8","shape":[2],"data_offsets":[10,12]}})";
  EXPECT_HAS(open_error("inside.safetensors", st_bytes(h3, 32)), "tensor 'y': data_offsets [10, 12) overlap tensor 'x'");
}

TEST_F(Safetensors, SizeMismatch) {
  const std::string h = one_tensor("h.0.attn.c_attn.weight",
                                   R"({"dtype":"F32","shape":[3,4],"data_offsets":[0,100]})");
  const std::string m = open_error("model.safetensors", st_bytes(h, 100));
  EXPECT_HAS(m, "model.safetensors: tensor 'h.0.attn.c_attn.weight': data_offsets [0, 100) hold "
                "100 bytes but shape [3, 4] of F32 needs 48");
  // Scalar: one element.
  EXPECT_HAS(open_error("scalar.safetensors",
                        st_bytes(one_tensor("s", R"({"dtype":"F64","shape":[],"data_offsets":[0,0]})"), 8)),
             "tensor 's': data_offsets [0, 0) hold 0 bytes but shape [] of F64 needs 8");
}

TEST_F(Safetensors, ElementCountOverflow) {
  const std::string m = open_error(
      "overflow.safetensors",
      st_bytes(one_tensor("big", R"({"dtype":"F32","shape":[4294967296,4294967296,2],"data_offsets":[0,0]})"), 0));
  EXPECT_HAS(m, "overflow.safetensors: tensor 'big': shape [4294967296, 4294967296, 2] of F32 overflows");
  // numel fits, bytes do not.
  EXPECT_HAS(open_error("overflow2.safetensors",
                        st_bytes(one_tensor("big", R"({"dtype":"I64","shape":[2305843009213693952,2],"data_offsets":[0,0]})"), 0)),
             "overflows");
  // A zero dimension makes the rest irrelevant.
  spit(dir_ / "zerobig.safetensors",
       st_bytes(one_tensor("z", R"({"dtype":"I64","shape":[9223372036854775807,9223372036854775807,0],"data_offsets":[0,0]})"), 0));
  EXPECT_EQ(SafetensorsFile(dir_ / "zerobig.safetensors").get("z").info->numel(), 0u);
}

TEST_F(Safetensors, DuplicateNamesDeepNestingAndBadMetadata) {
  const std::string dup =
      R"({"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1]},)"
      R"("a":{"dtype":"U8","shape":[1],"data_offsets":[1,2]}})";
  EXPECT_HAS(open_error("dup.safetensors", st_bytes(dup, 2)), "dup.safetensors: header names 'a' twice");
  EXPECT_HAS(open_error("deep.safetensors", st_bytes(std::string(10000, '[') + std::string(10000, ']'), 0)),
             "nests deeper");
  EXPECT_HAS(open_error("meta.safetensors", st_bytes(R"({"__metadata__":{"k":1}})", 0)),
             "meta.safetensors: __metadata__ value of 'k' is not a string");
  EXPECT_HAS(open_error("meta2.safetensors", st_bytes(R"({"__metadata__":[]})", 0)),
             "__metadata__ is not an object");
}

TEST_F(Safetensors, MissingTensorOnGet) {
  spit(dir_ / "good.safetensors", st_bytes(kGoodHeader, 64));
  SafetensorsFile f(dir_ / "good.safetensors");
  const std::string m = error_of([&] { f.get("h.0.mlp.c_fc.weight"); });
  EXPECT_HAS(m, "good.safetensors");
  EXPECT_HAS(m, "tensor 'h.0.mlp.c_fc.weight': no such tensor");
}

TEST_F(Safetensors, IoErrorsAreSystemErrors) {
  EXPECT_THROW(SafetensorsFile(dir_ / "absent.safetensors"), std::system_error);
  fs::create_directory(dir_ / "dir.safetensors");
  EXPECT_HAS(error_of([&] { SafetensorsFile f(dir_ / "dir.safetensors"); }), "not a regular file");
}

TEST_F(Safetensors, ParseHeaderDirectly) {
  std::map<std::string, std::string> meta;
  const auto ts = parse_safetensors_header(kGoodHeader, 64, "mem", &meta);
  ASSERT_EQ(ts.size(), 2u);
  EXPECT_EQ(ts[1].begin, 48u);
  EXPECT_EQ(ts[1].end, 64u);
  EXPECT_EQ(meta.at("format"), "pt");
  EXPECT_NO_THROW(parse_safetensors_header(kGoodHeader, 64, "mem", nullptr));
  EXPECT_HAS(error_of([&] { parse_safetensors_header(kGoodHeader, 63, "mem", nullptr); }),
             "mem: tensor 'b': data_offsets [48, 64) go beyond the data section of 63 bytes");
}

// ---------------------------------------------------------------------------------------------
// The writer

std::string pattern(size_t n, uint64_t seed) {
  const auto v = test::random_bytes(n, seed);
  return std::string(reinterpret_cast<const char*>(v.data()), v.size());
}

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

// ---------------------------------------------------------------------------------------------
// Sharded checkpoints (made here with the writer; the Python-made one is an oracle test below)

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

namespace strata::models {
namespace {

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
