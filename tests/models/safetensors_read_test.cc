// Safetensors files read: hand-made files read back exactly (file order, gaps, zero-sized and
// scalar tensors), and every malformed file the header promises to reject is rejected with a
// message naming the file and tensor.
#include <gtest/gtest.h>

#include <cstdint>
#include <filesystem>
#include <map>
#include <string>
#include <system_error>
#include <vector>

#include "safetensors_fixture.h"
#include "strata/models/safetensors.h"
#include "test_util.h"

namespace strata::models {
namespace {

using namespace safetensors_testing;
namespace fs = std::filesystem;

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

// A valid hand-made header: two tensors, contiguous, 64 data bytes.
const std::string kGoodHeader =
    R"({"__metadata__":{"format":"pt"},)"
    R"("h.0.attn.c_attn.weight":{"dtype":"F32","shape":[3,4],"data_offsets":[0,48]},)"
    R"("b":{"dtype":"I64","shape":[2],"data_offsets":[48,64]}})";

// A header with one tensor `name` given by its JSON entry, and a data section of `data` bytes.
std::string one_tensor(const std::string& name, const std::string& entry) {
  return "{\"" + name + "\":" + entry + "}";
}

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

}  // namespace
}  // namespace strata::models
