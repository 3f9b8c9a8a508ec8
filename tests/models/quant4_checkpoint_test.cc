// Checkpoints saved in 4 bits by transformers + bitsandbytes (the oracle: hf_oracle.py make4bit)
// load with the logits transformers computes from them, export as 16-bit models transformers
// reads with the same logits, and are refused clearly when a statistic is missing or a code
// table is not bitsandbytes'.
#include <gtest/gtest.h>

#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <functional>

#include "strata/models/hf_io.h"
#include "strata/models/quant4_checkpoint.h"
#include "hf_expected.h"
#include "test_util.h"

namespace strata::models {
namespace {

using test_oracle::expected;
using test_oracle::relative_error;

const std::string kPython = STRATA_PYTHON;
const std::string kOracle = std::string(STRATA_TEST_PY_DIR) + "/hf_oracle.py";

// The message of what `fn` throws ("" and a failure if nothing).
template <typename Fn>
std::string thrown(Fn&& fn) {
  try {
    fn();
  } catch (const std::exception& e) {
    return e.what();
  }
  ADD_FAILURE() << "expected an exception, none was thrown";
  return "";
}
bool contains(const std::string& text, const std::string& part) { return text.find(part) != std::string::npos; }

using test_oracle::run;

class SavedIn4Bits : public ::testing::TestWithParam<std::string> {
 protected:
  static void SetUpTestSuite() {
    dir_ = new test::TempDir();
    made_ = !kPython.empty() && run(kPython + " " + kOracle + " make4bit " + dir_->path().string()) == 0;
  }
  static void TearDownTestSuite() {
    delete dir_;
    dir_ = nullptr;
  }
  void SetUp() override {
    if (kPython.empty()) GTEST_SKIP() << "no Python with transformers configured (STRATA_PYTHON)";
    ASSERT_TRUE(made_) << "the transformers + bitsandbytes oracle failed to save its 4-bit models";
  }
  std::filesystem::path model_dir() const { return dir_->path() / GetParam(); }

  static test::TempDir* dir_;
  static bool made_;
};
test::TempDir* SavedIn4Bits::dir_ = nullptr;
bool SavedIn4Bits::made_ = false;


// `from`'s model.safetensors into `to` (its config.json copied), each tensor through `edit`
// (which may drop it by returning false, or change its bytes).
void rewrite(const std::filesystem::path& from, const std::filesystem::path& to,
             const std::function<bool(const std::string&, std::vector<std::byte>&)>& edit) {
  std::filesystem::create_directories(to);
  std::filesystem::copy_file(from / "config.json", to / "config.json");
  const SafetensorsFile in(from / "model.safetensors");
  std::vector<SafetensorsWriter::Spec> specs;
  std::vector<std::vector<std::byte>> bytes;
  for (const TensorInfo& t : in.tensors()) {
    const TensorView v = in.get(t.name);
    std::vector<std::byte> b(v.data.begin(), v.data.end());
    if (!edit(t.name, b)) continue;
    std::vector<int64_t> shape = t.shape;
    if (b.size() != v.data.size()) shape = {int64_t(b.size()), 1};  // a U8 tensor cut short
    specs.push_back({t.name, t.dtype, shape});
    bytes.push_back(std::move(b));
  }
  SafetensorsWriter out(to / "model.safetensors", specs);
  for (size_t i = 0; i < specs.size(); ++i) out.write(specs[i].name, {bytes[i].data(), bytes[i].size()});
  out.finish();
}

TEST_P(SavedIn4Bits, LoadsWithTheLogitsOfTransformersAndExportsThemIn16Bits) {
  auto model = load_hf_model(model_dir());
  const at::Tensor ids = expected(model_dir(), "ids");
  const at::Tensor want = expected(model_dir(), "logits");
  at::NoGradGuard no_grad;
  const at::Tensor logits = model->forward(ids);
  ASSERT_EQ(logits.sizes(), want.sizes());
  EXPECT_LE(relative_error(logits, want), 1e-5) << GetParam();
  // The dequantized model exported in fp32 (no quantization_config): transformers reads it back
  // with the 4-bit model's logits.
  test::TempDir out;
  export_hf_model(*model, out.path() / "export");
  EXPECT_EQ(run(kPython + " " + kOracle + " check " + (out.path() / "export").string() + " " +
                (model_dir() / "expected.safetensors").string()),
            0)
      << "transformers did not reproduce the 4-bit model's logits from Strata's 16-bit export of " << GetParam();
}

TEST_P(SavedIn4Bits, RecordsHoldTheSavedBytesAndDequantizeAsTheFp32Read) {
  const SafetensorsCheckpoint ckpt(model_dir());
  const std::string w = "model.layers.1.mlp.down_proj.weight";
  ASSERT_TRUE(saved_in_4bit(ckpt, w));
  EXPECT_FALSE(saved_in_4bit(ckpt, "lm_head.weight"));  // transformers keeps the head
  const SavedQuant4 s = read_quant4_state(ckpt, w, "test");
  ASSERT_EQ(s.shape.size(), 2u);
  EXPECT_EQ(s.shape[1], GetParam() == "qwen3_fp4" ? 70 : 83);  // [hidden, intermediate]
  const uint64_t n = uint64_t(s.shape[0] * s.shape[1]);
  const Quant4Record r = quant4_record(n, s.settings);
  std::vector<std::byte> record(r.bytes());
  read_quant4_record(ckpt, w, s.settings, record, "test");
  const TensorView packed = ckpt.get(w);
  EXPECT_EQ(std::memcmp(record.data() + r.packed_at(), packed.data.data(), r.packed_bytes), 0);
  const TensorView absmax = ckpt.get(w + ".absmax");
  EXPECT_EQ(std::memcmp(record.data() + r.absmax_at(), absmax.data.data(), r.absmax_bytes), 0);
  // Another quantization than the saved one is refused, naming both.
  QuantizedBase other = s.settings;
  other.quant_type = s.settings.quant_type == "nf4" ? "fp4" : "nf4";
  EXPECT_TRUE(contains(thrown([&] { read_quant4_record(ckpt, w, other, record, "test"); }),
                             "is saved in " + s.settings.describe()));
  // The fp32 read is the dequantization, the model's weight.
  auto model = load_hf_model(model_dir());
  size_t found = 0;
  for (auto& [name, p] : model->hf_parameters())
    if (name == w) {
      EXPECT_TRUE(at::equal(p, dequantize_saved_4bit(ckpt, w, "test")));
      ++found;
    }
  EXPECT_EQ(found, 1u);
}

TEST_P(SavedIn4Bits, AMissingStatisticOrAnotherCodeTableIsRefusedNamingTheTensor) {
  test::TempDir dir;
  const std::string w = "model.layers.0.self_attn.o_proj.weight";
  rewrite(model_dir(), dir.path() / "missing", [&](const std::string& name, std::vector<std::byte>&) {
    return name != w + ".absmax";
  });
  EXPECT_TRUE(contains(thrown([&] { load_hf_model(dir.path() / "missing"); }),
                             "no tensor '" + w + ".absmax'"));
  rewrite(model_dir(), dir.path() / "table", [&](const std::string& name, std::vector<std::byte>& b) {
    if (name == w + ".quant_map") b[0] = std::byte(uint8_t(b[0]) ^ 1);
    return true;
  });
  EXPECT_TRUE(contains(thrown([&] { load_hf_model(dir.path() / "table"); }),
                             "'" + w + ".quant_map' is not bitsandbytes'"));
  rewrite(model_dir(), dir.path() / "short", [&](const std::string& name, std::vector<std::byte>& b) {
    if (name == w) b.resize(b.size() - 1);
    return true;
  });
  const std::string msg = thrown([&] { load_hf_model(dir.path() / "short"); });
  EXPECT_TRUE(contains(msg, "tensor '" + w + "' is U8")) << msg;
}

INSTANTIATE_TEST_SUITE_P(Oracle, SavedIn4Bits, ::testing::Values("llama_nf4_double", "qwen3_fp4"));

}  // namespace
}  // namespace strata::models
