// `strata ckpt export`: a checkpoint saved by 2 ranks exported to Hugging Face in fp32, bf16 and
// fp16 equals the run's own export and loads in transformers; a corrupt chunk exports nothing.
#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>
#include <signal.h>
#include <sys/mount.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <atomic>
#include <cstring>
#include <fstream>
#include <functional>
#include <iomanip>
#include <numeric>
#include <thread>
#include <random>
#include <sstream>

#include "strata/engine/checkpoint.h"
#include "strata/engine/comm.h"
#include "strata/engine/config.h"
#include "strata/engine/config_parse.h"
#include "strata/engine/device.h"
#include "strata/engine/engine.h"
#include "strata/models/hf_io.h"
#include "strata/models/model_config.h"
#include "strata/models/safetensors.h"
#include "strata/models/token_data.h"
#include "strata/offload/crc32c.h"
#include "strata/offload/fault_injection.h"
#include "checkpoint_fixture.h"
#include "checkpoint_trainer.h"
#include "launched.h"
#include "saved_chunks.h"
#include "test_util.h"
#include "checkpoint_names.h"

namespace {

// A checkpoint saved by 2 ranks, exported by `strata ckpt export` (no engine, no world size):
// in fp32 every tensor equals what the training run itself exported from its gathered weights
// (GPT-2 Conv1D weights transposed, the tied head once); bf16 and fp16 exports equal libtorch's
// conversion of those; transformers computes Strata's logits from the export; a corrupt chunk
// is an error naming it.
void export_matches(const json& cfg, const std::string& tag) {
  TempDir dir;
  const auto ck = dir / "ckpt";
  launch(2, cfg, dir, tag, "--checkpoint-dir " + ck.string() + " --export " + (dir / "trained").string());
  const auto latest = se::latest_checkpoint(ck);
  ASSERT_TRUE(latest.has_value());
  const std::string bin = STRATA_BIN;
  for (const char* dtype : {"float32", "bfloat16", "float16"}) {
    const auto out = dir / (std::string("export-") + dtype);
    ASSERT_EQ(run_quiet(bin + " ckpt export " + ck.string() + " " + out.string() + " --dtype " + dtype,
                        dir / "export.out"), 0)
        << read_file(dir / "export.out");
    sm::SafetensorsFile want(dir / "trained" / "model.safetensors"), got(out / "model.safetensors");
    ASSERT_EQ(got.tensors().size(), want.tensors().size()) << dtype;
    const auto to = std::string(dtype) == "float32" ? at::kFloat : std::string(dtype) == "bfloat16" ? at::kBFloat16 : at::kHalf;
    for (const sm::TensorInfo& t : want.tensors()) {
      const at::Tensor g = st_tensor(got, t.name);
      ASSERT_EQ(g.scalar_type(), to) << t.name;
      EXPECT_TRUE(at::equal(g, st_tensor(want, t.name).to(to))) << dtype << " " << t.name;
    }
    const sm::ModelConfig a = sm::load_hf_config(dir / "trained" / "config.json");
    const sm::ModelConfig b = sm::load_hf_config(out / "config.json");
    EXPECT_EQ(a.to_hf_json(), b.to_hf_json()) << dtype;
  }

  // transformers on the fp32 export against Strata's forward pass of the trained weights.
  const std::string python = STRATA_PYTHON;
  if (!python.empty()) {
    auto model = sm::load_hf_model(dir / "trained");
    at::NoGradGuard no_grad;
    const at::Tensor ids = at::randint(model->config().vocab_size, {2, 11}, at::kLong);
    const at::Tensor logits = model->forward(ids).contiguous();
    {
      sm::SafetensorsWriter w(dir / "expected.safetensors",
                              {{"ids", sm::StDType::kI64, {2, 11}},
                               {"logits", sm::StDType::kF32, std::vector<int64_t>(logits.sizes().begin(), logits.sizes().end())}});
      w.write("ids", {static_cast<const std::byte*>(ids.data_ptr()), ids.nbytes()});
      w.write("logits", {static_cast<const std::byte*>(logits.data_ptr()), logits.nbytes()});
      w.finish();
    }
    EXPECT_EQ(run_quiet(python + " " + STRATA_TEST_PY_DIR + "/hf_oracle.py check " + (dir / "export-float32").string() +
                            " " + (dir / "expected.safetensors").string(),
                        dir / "oracle.out"),
              0)
        << read_file(dir / "oracle.out");
  }

  // Into a directory that is not empty: refused without --force, nothing changed; with --force
  // the weights and config are replaced and other files (a tokenizer) kept; nothing temporary
  // is left behind.
  {
    const auto out = dir / "export-bfloat16", weights = out / "model.safetensors";
    std::ofstream(out / "tokenizer.json") << "{\"kept\": true}";
    const auto before = std::filesystem::last_write_time(weights);
    EXPECT_NE(run_quiet(bin + " ckpt export " + ck.string() + " " + out.string(), dir / "again.out"), 0);
    EXPECT_NE(read_file(dir / "again.out").find("is not empty"), std::string::npos) << read_file(dir / "again.out");
    EXPECT_NE(read_file(dir / "again.out").find("--force"), std::string::npos) << read_file(dir / "again.out");
    EXPECT_EQ(std::filesystem::last_write_time(weights), before) << "a refused export touched the weights";
    ASSERT_EQ(run_quiet(bin + " ckpt export " + ck.string() + " " + out.string() + " --force", dir / "forced.out"), 0)
        << read_file(dir / "forced.out");
    sm::SafetensorsFile got(weights), fp32(dir / "export-float32" / "model.safetensors");
    for (const sm::TensorInfo& t : fp32.tensors())
      EXPECT_TRUE(at::equal(st_tensor(got, t.name), st_tensor(fp32, t.name))) << "replaced by the fp32 export: " << t.name;
    EXPECT_EQ(read_file(out / "tokenizer.json"), "{\"kept\": true}");
    EXPECT_FALSE(std::filesystem::exists(dir / "export-bfloat16.export-tmp"));
  }

  // A flipped byte in the data is named, and nothing is exported.
  const auto data = *latest / "rank-00001.data";
  {
    std::fstream f(data, std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(100);
    f.put('\x5a');
  }
  EXPECT_NE(run_quiet(bin + " ckpt export " + ck.string() + " " + (dir / "bad").string(), dir / "bad.out"), 0);
  EXPECT_NE(read_file(dir / "bad.out").find("rank-00001.data at offset 0"), std::string::npos) << read_file(dir / "bad.out");
  EXPECT_NE(read_file(dir / "bad.out").find("CRC32C"), std::string::npos) << read_file(dir / "bad.out");
  EXPECT_FALSE(std::filesystem::exists(dir / "bad" / "model.safetensors"));
  EXPECT_FALSE(std::filesystem::exists(dir / "bad.export-tmp")) << "a failed export leaves nothing behind";
}

TEST(CheckpointExport, Gpt2TiedFromTwoRanksLoadsInTransformers) {
  json j = tiny_llama(4);
  j["model"] = {{"preset", "gpt2"}, {"layers", 2}, {"hidden", 48}, {"heads", 4}, {"vocab_size", 256},
                {"max_positions", 32}, {"seed", 3}};
  export_matches(j, "gpt2");
}

TEST(CheckpointExport, LlamaFromTwoRanksLoadsInTransformers) { export_matches(tiny_llama(4), "llama"); }

// The same from a run whose tied embedding and head are cut into vocabulary tiles: the export
// assembles the whole tensors from the tiles' row ranges, once for the tied weight.
TEST(CheckpointExport, Gpt2TiedInVocabularyTilesLoadsInTransformers) {
  json j = tiny_llama(4);
  j["model"] = {{"preset", "gpt2"}, {"layers", 2}, {"hidden", 48}, {"heads", 4}, {"vocab_size", 256},
                {"max_positions", 32}, {"seed", 3}};
  j["placement"] = {{"tiling", {{"vocab", 3}}}};
  export_matches(j, "gpt2_vocab_tiles");
}

}  // namespace
