// Models against Hugging Face transformers (the oracle): tiny random GPT-2 and Llama models saved
// by transformers load in Strata with the same logits, Strata's export loads back in transformers
// with the same logits, and block-by-block forward + recompute + backward gives the gradients of
// whole-model autograd.
#include <gtest/gtest.h>

#include <cstdlib>
#include <filesystem>

#include "strata/models/hf_io.h"
#include "test_util.h"

namespace strata::models {
namespace {

const std::string kPython = STRATA_PYTHON;
const std::string kOracle = std::string(STRATA_TEST_PY_DIR) + "/hf_oracle.py";

int run(const std::string& cmd) { return std::system((cmd + " >/dev/null 2>&1").c_str()); }

class HfInterop : public ::testing::TestWithParam<std::string> {
 protected:
  static void SetUpTestSuite() {
    dir_ = new test::TempDir();
    made_ = !kPython.empty() && run(kPython + " " + kOracle + " make " + dir_->path().string()) == 0;
  }
  static void TearDownTestSuite() {
    delete dir_;
    dir_ = nullptr;
  }
  void SetUp() override {
    if (kPython.empty()) GTEST_SKIP() << "no Python with transformers configured (STRATA_PYTHON)";
    ASSERT_TRUE(made_) << "the transformers oracle failed to make its models";
  }
  std::filesystem::path model_dir() const { return dir_->path() / GetParam(); }

  static test::TempDir* dir_;
  static bool made_;
};
test::TempDir* HfInterop::dir_ = nullptr;
bool HfInterop::made_ = false;

double relative_error(const at::Tensor& got, const at::Tensor& want) {
  return ((got - want).abs().max() / want.abs().max()).item<double>();
}

at::Tensor expected(const std::filesystem::path& dir, const std::string& name) {
  SafetensorsFile f(dir / "expected.safetensors");
  const TensorView v = f.get(name);
  const auto dtype = v.info->dtype == StDType::kI64 ? at::kLong : at::kFloat;
  return at::from_blob(const_cast<std::byte*>(v.data.data()), v.info->shape, dtype).clone();
}

TEST_P(HfInterop, TransformersCheckpointLoadsWithTheSameLogitsAndExportRoundTrips) {
  auto model = load_hf_model(model_dir());
  const at::Tensor ids = expected(model_dir(), "ids");
  const at::Tensor want = expected(model_dir(), "logits");
  at::NoGradGuard no_grad;
  const at::Tensor logits = model->forward(ids);
  ASSERT_EQ(logits.sizes(), want.sizes());
  EXPECT_LE(relative_error(logits, want), 1e-5) << GetParam();

  test::TempDir out;
  export_hf_model(*model, out.path() / "export");
  EXPECT_EQ(run(kPython + " " + kOracle + " check " + (out.path() / "export").string() + " " +
                (model_dir() / "expected.safetensors").string()),
            0)
      << "transformers did not reproduce the logits from Strata's export of " << GetParam();
  // And Strata reads its own export back exactly.
  auto again = load_hf_model(out.path() / "export");
  EXPECT_TRUE(at::equal(again->forward(ids), logits));
}

TEST_P(HfInterop, BlockByBlockRecomputeGivesTheGradientsOfWholeModelAutograd) {
  auto model = load_hf_model(model_dir());
  const at::Tensor ids = expected(model_dir(), "ids");
  const at::Tensor targets = ids.roll(-1, 1);
  auto loss_of = [&](const at::Tensor& logits) {
    return at::cross_entropy_loss(logits.reshape({-1, logits.size(-1)}), targets.reshape({-1}));
  };
  auto params = model->hf_parameters();

  // Oracle: autograd over the whole model.
  const at::Tensor loss_ref = loss_of(model->forward(ids));
  loss_ref.backward();
  std::vector<at::Tensor> ref;
  for (auto& [n, p] : params) {
    ref.push_back(p.grad().clone());
    p.mutable_grad().reset();
  }

  // The engine's schedule: forward without a graph, keeping only each block's input.
  std::vector<at::Tensor> block_inputs;
  at::Tensor h;
  {
    at::NoGradGuard no_grad;
    h = model->embedding().forward(ids);
    for (size_t b = 0; b < model->num_blocks(); ++b) {
      block_inputs.push_back(h);
      h = model->block(b).forward(h);
    }
  }
  // Head: forward + backward, giving the gradient of the last block's output.
  at::Tensor x = h.detach().requires_grad_(true);
  const at::Tensor loss = loss_of(model->head().forward(x));
  loss.backward();
  at::Tensor grad = x.grad();
  // Blocks in reverse: recompute from the saved input, backward, pass the input's gradient on.
  for (size_t b = model->num_blocks(); b-- > 0;) {
    at::Tensor xin = block_inputs[b].detach().requires_grad_(true);
    at::Tensor out = model->block(b).forward(xin);
    // Recompute reproduces the forward pass's output bit for bit.
    const at::Tensor& forward_out = b + 1 < model->num_blocks() ? block_inputs[b + 1] : h;
    ASSERT_TRUE(at::equal(out.detach(), forward_out)) << "block " << b;
    out.backward(grad);
    grad = xin.grad();
  }
  model->embedding().forward(ids).backward(grad);

  EXPECT_EQ(loss.item<float>(), loss_ref.item<float>());
  for (size_t i = 0; i < params.size(); ++i) {
    const at::Tensor& g = params[i].second.grad();
    ASSERT_TRUE(g.defined()) << params[i].first;
    const double err = ((g - ref[i]).norm() / ref[i].norm().clamp_min(1e-30)).item<double>();
    EXPECT_LE(err, 1e-6) << params[i].first;
  }
}

INSTANTIATE_TEST_SUITE_P(Models, HfInterop,
                         ::testing::Values("gpt2", "llama", "llama_tied", "llama3_rope", "qwen2", "mistral",
                                           "gemma"));

ModelConfig tiny_llama(int64_t hidden) {
  ModelConfig c = preset("llama-1b");
  c.vocab_size = 50;
  c.hidden = hidden;
  c.layers = 2;
  c.heads = 4;
  c.kv_heads = 2;
  c.head_dim = hidden / 4;
  c.intermediate = 2 * hidden;
  return c;
}

TEST(HfIo, MismatchedCheckpointsAreErrorsNamingTheCheckpointAndTensor) {
  test::TempDir dir;
  Decoder saved(tiny_llama(32), 1);
  export_hf_model(saved, dir / "m");
  // Same architecture, other width: a shape error naming the checkpoint and tensor.
  Decoder wider(tiny_llama(48));
  try {
    load_hf_weights(wider, SafetensorsCheckpoint(dir / "m"), (dir / "m").string());
    FAIL();
  } catch (const std::runtime_error& e) {
    const std::string m = e.what();
    EXPECT_NE(m.find((dir / "m").string() + ": tensor 'model.embed_tokens.weight' has shape [50, 32]"),
              std::string::npos) << m;
  }
  // Another architecture: the first missing tensor is named.
  ModelConfig g = preset("gpt2");
  g.vocab_size = 50;
  g.layers = 1;
  g.hidden = 32;
  g.heads = g.kv_heads = 4;
  g.head_dim = 8;
  g.intermediate = 64;
  g.max_positions = 16;
  Decoder gpt(g);
  try {
    load_hf_weights(gpt, SafetensorsCheckpoint(dir / "m"), "ckpt");
    FAIL();
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find("ckpt: no tensor 'transformer.wte.weight'"), std::string::npos) << e.what();
  }
  // Fewer layers than the checkpoint: the extra tensors are reported as unexpected.
  ModelConfig one = tiny_llama(32);
  one.layers = 1;
  Decoder shallow(one);
  try {
    load_hf_weights(shallow, SafetensorsCheckpoint(dir / "m"), "ckpt");
    FAIL();
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find("ckpt: 9 unexpected tensors"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("model.layers.1."), std::string::npos) << e.what();
  }
  // A bf16 copy exports as bf16 and loads back to the same (rounded) weights.
  Decoder half(tiny_llama(32), 1);
  half.to(at::kBFloat16);
  export_hf_model(half, dir / "bf16");
  Decoder back(tiny_llama(32), 2);
  load_hf_weights(back, SafetensorsCheckpoint(dir / "bf16"), "bf16");
  auto a = half.hf_parameters(), b = back.hf_parameters();
  for (size_t i = 0; i < a.size(); ++i) {
    ASSERT_TRUE(at::equal(a[i].second.to(at::kFloat), b[i].second)) << a[i].first;
  }
  EXPECT_EQ(load_hf_config(dir / "bf16" / "config.json").vocab_size, 50);
}

TEST(Decoder, DeferredInitializationGivesTheSameWeightsStageByStage) {
  ModelConfig c = preset("llama-1b");
  c.layers = 3;
  c.hidden = 64;
  c.heads = 4;
  c.kv_heads = 2;
  c.intermediate = 96;
  c.vocab_size = 101;
  Decoder eager(c, 42), deferred(c, 42, Decoder::Init::kDeferred);
  auto a = eager.hf_parameters(), b = deferred.hf_parameters();
  ASSERT_EQ(a.size(), b.size());
  deferred.initialize_through(1);  // embedding and block 0
  deferred.initialize_through(1);  // a no-op
  EXPECT_TRUE(at::equal(a.front().second, b.front().second)) << a.front().first;
  deferred.initialize_through(4);  // the rest, head included
  for (size_t i = 0; i < a.size(); ++i) EXPECT_TRUE(at::equal(a[i].second, b[i].second)) << a[i].first;
  EXPECT_THROW(deferred.initialize_through(5), std::out_of_range);
}

// open_hf_model loads each tensor when its stage is initialized (the engine's stream: one block
// at a time), cut or whole, to the values load_hf_model gives; a missing tensor is named when
// the model is opened, before anything loads.
TEST(Decoder, OpenedModelLoadsEachStageWhenItIsInitialized) {
  test::TempDir dir;
  Decoder saved(tiny_llama(32), 5);
  export_hf_model(saved, dir / "m", at::kBFloat16);
  const auto whole = load_hf_model(dir / "m");
  std::vector<std::string> loaded;
  Decoder counted(tiny_llama(32), 0, Decoder::Init::kDeferred);
  const Decoder::TensorSource file = hf_model_source(counted.config(), dir / "m");
  counted.set_source([&](const std::string& name, at::Tensor& t) {
    loaded.push_back(name);
    return file(name, t);
  });
  counted.initialize_through(1);  // the embedding and block 0
  EXPECT_EQ(loaded.size(), 1u + 9u);
  EXPECT_EQ(loaded.back(), "model.layers.0.mlp.down_proj.weight");
  counted.initialize_through(counted.stages().size() - 1);
  EXPECT_EQ(loaded.size(), 1u + 2 * 9u + (counted.config().tie_embeddings ? 1u : 2u));  // the final norm (and lm_head)
  auto a = whole->hf_parameters(), b = counted.hf_parameters();
  ASSERT_EQ(a.size(), b.size());
  for (size_t i = 0; i < a.size(); ++i) EXPECT_TRUE(at::equal(a[i].second, b[i].second)) << a[i].first;
  // Cut before it loads: each tile's part of the file's tensors, the same logits.
  auto cut = open_hf_model(dir / "m");
  cut->set_tiles({2, 3, 2});
  cut->initialize_through(cut->stages().size() - 1);
  const at::Tensor ids = at::randint(0, 50, {2, 11}, at::kLong);
  at::NoGradGuard no_grad;
  EXPECT_LE(relative_error(cut->forward(ids), whole->forward(ids)), 1e-5);
  // Another shape of model: the file's first missing tensor, named when opening.
  ModelConfig deeper = tiny_llama(32);
  deeper.layers = 3;
  try {
    hf_model_source(deeper, dir / "m");
    FAIL();
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find("no tensor 'model.layers.2."), std::string::npos) << e.what();
  }
}

TEST(ModelConfig, PresetsHaveThePublishedParameterCounts) {
  // Published sizes: GPT-2 124M / 1558M (tied), Llama 3.2 1B (tied), Llama 3.1 8B and 70B.
  EXPECT_EQ(preset("gpt2").parameters(), 124439808);
  EXPECT_EQ(preset("gpt2-xl").parameters(), 1557611200);
  EXPECT_EQ(preset("llama-1b").parameters(), 1235814400);
  EXPECT_EQ(preset("llama-8b").parameters(), 8030261248);
  EXPECT_EQ(preset("llama-70b").parameters(), 70553706496);
  // And a Strata model built from a config has exactly that many parameters, biases included.
  ModelConfig biased = tiny_llama(32);
  biased.attention_bias = biased.attention_out_bias = biased.mlp_bias = true;
  biased.head_dim = 16;  // != hidden / heads
  ModelConfig qwen2 = tiny_llama(32);  // q/k/v biases only
  qwen2.hf_type = "qwen2";
  qwen2.attention_bias = true;
  for (const ModelConfig& c : {preset("gpt2"), tiny_llama(32), biased, qwen2}) {
    Decoder d(c);
    int64_t n = 0;
    for (auto& [name, p] : d.hf_parameters()) n += p.numel();
    EXPECT_EQ(n, c.parameters()) << c.name;
  }
  EXPECT_THROW(preset("gpt5"), std::invalid_argument);
}

TEST(ModelConfig, UnsupportedSettingsAreClearErrors) {
  try {
    parse_hf_config(R"({"model_type": "llama", "vocab_size": 10, "hidden_size": 8,
      "num_hidden_layers": 1, "num_attention_heads": 2, "intermediate_size": 16,
      "rope_scaling": {"rope_type": "yarn", "factor": 8.0}})", "cfg.json");
    FAIL();
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("cfg.json: rope_scaling: rope_type 'yarn'"), std::string::npos) << e.what();
  }
  // A sliding window is accepted, and sequences longer than it are refused, naming it; Qwen2's
  // window applies only with use_sliding_window.
  const std::string mistral = R"({"model_type": "mistral", "vocab_size": 10, "hidden_size": 8,
      "num_hidden_layers": 1, "num_attention_heads": 2, "intermediate_size": 16, "sliding_window": 16})";
  const ModelConfig m = parse_hf_config(mistral, "m.json");
  // transformers' MistralConfig: 4096 when the key is absent, no window when it is null.
  const std::string base = R"({"model_type": "mistral", "vocab_size": 10, "hidden_size": 8,
      "num_hidden_layers": 1, "num_attention_heads": 2, "intermediate_size": 16)";
  EXPECT_EQ(parse_hf_config(base + "}", "m.json").sliding_window, 4096);
  EXPECT_EQ(parse_hf_config(base + R"(, "sliding_window": null})", "m.json").sliding_window, 0);
  EXPECT_EQ(m.sliding_window, 16);
  EXPECT_NO_THROW(m.check_sequence_length(16));
  try {
    m.check_sequence_length(17);
    ADD_FAILURE() << "a sequence longer than the window was accepted";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("sliding attention window of 16"), std::string::npos) << e.what();
  }
  const std::string qwen = R"({"model_type": "qwen2", "vocab_size": 10, "hidden_size": 8, "num_hidden_layers": 1,
      "num_attention_heads": 2, "intermediate_size": 16, "sliding_window": 4, "use_sliding_window": false})";
  EXPECT_EQ(parse_hf_config(qwen, "q.json").sliding_window, 0);
  const ModelConfig q = parse_hf_config(qwen, "q.json");
  EXPECT_TRUE(q.attention_bias);
  EXPECT_FALSE(q.attention_out_bias);
  EXPECT_THROW(parse_hf_config(R"({"model_type": "gemma", "vocab_size": 10, "hidden_size": 8, "num_hidden_layers": 1,
      "num_attention_heads": 2, "intermediate_size": 16, "hidden_act": "relu"})", "g.json"), std::invalid_argument);
  EXPECT_THROW(parse_hf_config(R"({"model_type": "bert"})", "x"), std::invalid_argument);
  EXPECT_THROW(parse_hf_config(R"({"model_type": "gpt2", "n_embd": 8})", "x"), std::invalid_argument);
  EXPECT_THROW(parse_hf_config("{not json", "x"), std::invalid_argument);
}

}  // namespace
}  // namespace strata::models
