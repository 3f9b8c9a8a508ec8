// Models against Hugging Face transformers (the oracle): tiny random GPT-2 and Llama models saved
// by transformers load in Strata with the same logits, Strata's export loads back in transformers
// with the same logits, and block-by-block forward + recompute + backward gives the gradients of
// whole-model autograd.
#include <gtest/gtest.h>

#include <cstdlib>
#include <filesystem>
#include <map>

#include "strata/models/hf_io.h"
#include "hf_expected.h"
#include "test_util.h"

namespace strata::models {
namespace {

using test_oracle::expected;
using test_oracle::relative_error;

const std::string kPython = STRATA_PYTHON;
const std::string kOracle = std::string(STRATA_TEST_PY_DIR) + "/hf_oracle.py";

using test_oracle::run;

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
                                           "gemma", "qwen3", "gemma2", "mixtral", "qwen3_moe"));

// Packed examples (data.pack): a batch of rows each holding several examples, run once with
// their segments, gives every target's loss and the parameters' gradients that transformers
// gives running each example alone, unpadded (hf_oracle.py's packed_* tensors); whole, and cut
// into attention and MLP tiles and vocabulary tiles. With the sliding windows of the mistral and
// qwen2 models (shorter than some examples), the windows apply within each example.
TEST_P(HfInterop, PackedExamplesGiveTheLossesAndGradientsOfEachExampleAlone) {
  const at::Tensor ids = expected(model_dir(), "packed_ids");
  const at::Tensor segments = expected(model_dir(), "packed_segments");
  const at::Tensor counted = expected(model_dir(), "packed_counted").to(at::kBool);
  const at::Tensor want = expected(model_dir(), "packed_losses");
  const int64_t T = segments.size(1);
  for (const bool tiled : {false, true}) {
    SCOPED_TRACE(tiled ? "tiled" : "whole");
    auto model = load_hf_model(model_dir());
    const auto wanted_grads = model->hf_parameters();  // the names, in order, before any cut
    if (tiled) {  // as far as each family's blocks cut (check_tiles)
      const ModelConfig& c = model->config();
      LayerTiles t;
      t.attention = c.kv_heads > 1 && !c.qk_norm && !c.sandwich_norms ? 2 : 1;
      t.mlp = c.sandwich_norms ? 1 : 2;  // a sparse block's: two groups of experts
      t.vocab = 2;
      model->set_tiles(t);
    }
    const TokenLayout layout(segments);
    const at::Tensor logits = model->forward(ids.narrow(1, 0, T), layout);
    const at::Tensor losses =
        at::cross_entropy_loss(logits.reshape({-1, logits.size(-1)}), ids.narrow(1, 1, T).reshape({-1}), {},
                               at::Reduction::None)
            .view({ids.size(0), T});
    EXPECT_LE(relative_error(losses.masked_select(counted).detach(), want.masked_select(counted)), 1e-5);
    losses.masked_select(counted).sum().backward();
    // Each tensor's gradient, assembled from the stages' parts when tiled.
    std::map<std::string, at::Tensor> grads;
    for (Stage* s : model->stages()) {
      const auto params = s->hf_parameters();
      for (size_t i = 0; i < params.size(); ++i) {
        const TensorPart& part = s->parts()[i];
        at::Tensor& g = grads[part.tensor];
        if (!g.defined()) g = at::zeros(part.shape);
        ASSERT_TRUE(params[i].second.grad().defined()) << params[i].first;
        g.narrow(part.dim, part.begin, part.end - part.begin).add_(params[i].second.grad());
      }
    }
    for (const auto& [name, p] : wanted_grads) {
      const at::Tensor ref = expected(model_dir(), "grad/" + name);
      ASSERT_TRUE(grads.count(name)) << name;
      const double err = ((grads[name] - ref).norm() / ref.norm().clamp_min(1e-30)).item<double>();
      EXPECT_LE(err, 1e-5) << name;
    }
  }
}

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
  // Sliding windows: Mistral's on every layer; Qwen2's only with use_sliding_window, from
  // max_window_layers on, or as layer_types names them.
  const std::string mistral = R"({"model_type": "mistral", "vocab_size": 10, "hidden_size": 8,
      "num_hidden_layers": 1, "num_attention_heads": 2, "intermediate_size": 16, "sliding_window": 16})";
  const ModelConfig m = parse_hf_config(mistral, "m.json");
  // transformers' MistralConfig: 4096 when the key is absent, no window when it is null.
  const std::string base = R"({"model_type": "mistral", "vocab_size": 10, "hidden_size": 8,
      "num_hidden_layers": 1, "num_attention_heads": 2, "intermediate_size": 16)";
  EXPECT_EQ(parse_hf_config(base + "}", "m.json").sliding_window, 4096);
  EXPECT_EQ(parse_hf_config(base + R"(, "sliding_window": null})", "m.json").sliding_window, 0);
  EXPECT_EQ(m.sliding_window, 16);
  EXPECT_EQ(m.attention_window(0), 16);
  const std::string qwen_window = R"({"model_type": "qwen2", "vocab_size": 10, "hidden_size": 8,
      "num_hidden_layers": 3, "num_attention_heads": 2, "intermediate_size": 16, "sliding_window": 4,
      "use_sliding_window": true, "max_window_layers": 1)";
  const ModelConfig qw = parse_hf_config(qwen_window + "}", "q.json");
  EXPECT_EQ(qw.attention_window(0), 0);
  EXPECT_EQ(qw.attention_window(1), 4);
  EXPECT_EQ(qw.attention_window(2), 4);
  const ModelConfig typed = parse_hf_config(
      qwen_window + R"(, "layer_types": ["sliding_attention", "full_attention", "sliding_attention"]})", "q.json");
  EXPECT_EQ(typed.attention_window(0), 4);
  EXPECT_EQ(typed.attention_window(1), 0);
  // Written back as transformers reads it.
  const ModelConfig again = parse_hf_config(typed.to_hf_json(), "again.json");
  EXPECT_EQ(again.sliding_layers, typed.sliding_layers);
  EXPECT_THROW(parse_hf_config(qwen_window + R"(, "layer_types": ["chunked_attention", "x", "y"]})", "q.json"),
               std::invalid_argument);
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

namespace strata::models {
namespace {

// The layout's positions restart at each example; its mask lets a token see the earlier tokens
// of its own example, within the window; a layout of one example a row gives plain causal
// attention (no mask: the fused kernels), with or without a window no shorter than the rows.
TEST(TokenLayout, PositionsRestartAndMasksKeepEachTokenToItsExample) {
  const at::Tensor seg = segments_from_lengths({{2, 3}, {4}}, 6);
  EXPECT_TRUE(at::equal(seg, at::tensor({0, 0, 1, 1, 1, 2, 0, 0, 0, 0, 1, 1}, at::kLong).view({2, 6})));
  const TokenLayout layout(seg);
  EXPECT_TRUE(at::equal(layout.positions(6, at::kCPU),
                        at::tensor({0, 1, 0, 1, 2, 0, 0, 1, 2, 3, 0, 1}, at::kLong).view({2, 6})));
  const at::Tensor m = layout.attention_mask(6, 0, at::kCPU);
  ASSERT_EQ(m.sizes(), (std::vector<int64_t>{2, 1, 6, 6}));
  for (int64_t b = 0; b < 2; ++b)
    for (int64_t q = 0; q < 6; ++q)
      for (int64_t k = 0; k < 6; ++k) {
        const bool same = seg[b][q].item<int64_t>() == seg[b][k].item<int64_t>();
        EXPECT_EQ(m[b][0][q][k].item<bool>(), same && k <= q) << b << " " << q << " " << k;
        EXPECT_EQ(layout.attention_mask(6, 2, at::kCPU)[b][0][q][k].item<bool>(), same && k <= q && q - k < 2);
      }
  const TokenLayout whole;
  EXPECT_FALSE(whole.attention_mask(6, 0, at::kCPU).defined());
  EXPECT_FALSE(whole.attention_mask(6, 6, at::kCPU).defined());
  EXPECT_TRUE(at::equal(whole.attention_mask(6, 3, at::kCPU)[0][0],
                        at::ones({6, 6}, at::kBool).tril().logical_and(at::ones({6, 6}, at::kBool).triu(-2))));
  EXPECT_TRUE(at::equal(layout.rows(1, 1).positions(6, at::kCPU), layout.positions(6, at::kCPU).narrow(0, 1, 1)));
  EXPECT_THROW(TokenLayout(at::zeros({6}, at::kLong)), std::invalid_argument);
}

}  // namespace
}  // namespace strata::models
