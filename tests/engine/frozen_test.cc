// Frozen tensors (model.trainable) against plain libtorch with requires_grad false on them: the
// same trajectory, the frozen tensors bitwise untouched, and no optimizer state for them.
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <set>
#include <utility>

#include "equivalence.h"
#include "launched.h"
#include "strata/engine/config_parse.h"
#include "strata/engine/partition.h"
#include "strata/models/trainable.h"
#include "test_util.h"

namespace se = strata::engine;
namespace sm = strata::models;
using nlohmann::json;
using strata::test::TempDir;
using namespace strata::test;

namespace {

// The frozen tensors of `got` equal the initial model's bitwise; the trainable ones moved.
void expect_frozen_untouched(const se::TrainConfig& tc, const Trajectory& got) {
  sm::Decoder initial(tc.model, tc.init_seed);
  const sm::TrainableTensors trains(tc.engine.trainable);
  size_t frozen = 0, moved = 0;
  for (auto& [n, p] : initial.hf_parameters()) {
    ASSERT_TRUE(got.params.count(n)) << n;
    const bool same = at::equal(got.params.at(n), p);
    if (!trains.trainable(n)) {
      EXPECT_TRUE(same) << n << " is frozen but changed";
      ++frozen;
    } else {
      moved += !same;
    }
  }
  EXPECT_GT(frozen, 0u) << "nothing was frozen: the test checks nothing";
  EXPECT_GT(moved, 0u);
}

// GPT-2 with its (tied) embeddings frozen: the embedding stage has no backward use, the head uses
// the frozen unit, and only the blocks and the final norm train.
TEST(Frozen, EmbeddingsFrozenMatchTorchWithoutTheirGradients) {
  json j = tiny_config(false, 4);
  j["model"]["trainable"] = {"transformer.h.*", "transformer.ln_f.*"};
  se::TrainConfig tc = se::parse_train_config(j.dump(), "test");
  uint64_t peak = 0;
  const Trajectory got = run_in_process(tc, UINT64_MAX, &peak);
  const Trajectory want = reference(tc, 1);
  expect_close(got, want, 1e-5);
  expect_frozen_untouched(tc, got);
}

// Llama with its embedding, first blocks, and part of another block frozen (block 2's attention
// trains, its MLP and norms do not: two units of one stage), all state in swap, the update during
// backward; then the same with blocks and vocabulary cut into tiles.
TEST(Frozen, FirstBlocksAndPartsOfABlockFrozenMatchTorchInSwapAndInTiles) {
  for (const bool tiled : {false, true}) {
    SCOPED_TRACE(tiled ? "tiled" : "whole");
    TempDir swap;
    json j = tiny_config(true, 4);
    j["model"]["trainable"] = {"model.layers.{3-9}.*", "model.layers.2.self_attn.*", "model.norm.weight",
                               "lm_head.weight"};
    j["placement"] = {{"params", "nvme"}, {"grads", "nvme"}, {"master", "nvme"}, {"moments", "nvme"}};
    if (tiled) j["placement"]["tiling"] = {{"attention", 2}, {"mlp", 2}, {"vocab", 2}};
    j["offload"] = {{"nvme_dirs", {swap.path().string()}}, {"optimizer_chunk", "16KiB"}};
    j["optimizer"]["clip_grad_norm"] = 0.0;
    j["optimizer"]["overlap"] = "backward";
    // As the tiling suites: tiles sum in another order, which 20 steps at 3e-3 without clipping
    // amplify past 1e-5 (measured 1.3e-4); 8 steps at 1e-3 stay within it.
    j["optimizer"]["lr"] = 1e-3;
    j["run"]["steps"] = 8;
    se::TrainConfig tc = se::parse_train_config(j.dump(), "test");
    uint64_t peak = 0;
    const Trajectory got = run_in_process(tc, UINT64_MAX, &peak);
    expect_close(got, reference(tc, 1), 1e-5);
    expect_frozen_untouched(tc, got);
  }
}

// Frozen units hold only their compute copy: this rank's host state is the compute copies of
// every unit plus master, moments and gradient of the trainable ones, nothing more.
TEST(Frozen, FrozenUnitsHoldOnlyTheirComputeCopy) {
  json j = tiny_config(true, 3);
  j["model"]["trainable"] = {"model.layers.1.*"};
  j["precision"] = {{"compute", "bf16"}};
  se::TrainConfig tc = se::parse_train_config(j.dump(), "test");
  auto comm = se::Communicator::create(se::DistEnv{}, std::chrono::seconds(30));
  auto dev = se::Device::create("cpu", 0, UINT64_MAX);
  se::Engine eng(std::make_unique<sm::Decoder>(tc.model, tc.init_seed, sm::Decoder::Init::kDeferred), tc.engine,
                 *comm, *dev);
  const se::Partition& part = eng.partition();
  uint64_t want = 0;
  size_t frozen = 0;
  for (const se::UnitLayout& L : part.units()) {
    want += L.shard_numel * 2;                      // bf16 compute copy
    if (!L.frozen) want += L.shard_numel * 4 * 4;  // master, two moments, gradient (fp32)
    frozen += L.frozen;
    for (const se::TensorSlot& t : L.tensors)
      EXPECT_EQ(L.frozen, t.name.rfind("model.layers.1.", 0) != 0) << t.name << " in unit " << L.name;
  }
  EXPECT_EQ(frozen, part.num_units() - 1) << "one trainable unit: block 1";
  EXPECT_EQ(eng.memory().host_state, want);
  // The run also trains: block 1 alone moves.
  at::Tensor ids = at::randint(0, tc.model.vocab_size, {tc.engine.micro_batch * tc.engine.grad_accum, tc.engine.seq_len + 1},
                               at::TensorOptions().dtype(at::kLong));
  const double first = eng.train_step(ids).loss;
  for (int i = 0; i < 5; ++i) eng.train_step(ids);
  EXPECT_LT(eng.train_step(ids).loss, first);
}

TEST(Frozen, TwoRanksWithFrozenBlocksMatchOneProcess) {
  TempDir dir, swap;
  json j = tiny_config(false, 3);
  j["model"]["trainable"] = {"transformer.h.{1-2}.*", "transformer.wpe.weight"};
  j["placement"] = {{"params", "host"}, {"grads", "nvme"}, {"master", "nvme"}, {"moments", "nvme"}};
  j["offload"] = {{"nvme_dirs", {swap.path().string()}}, {"optimizer_chunk", "32KiB"}};
  se::TrainConfig tc = se::parse_train_config(j.dump(), "test");
  const Trajectory got = run_launched(tc, j, 2, dir);
  expect_close(got, reference(tc, 2), 1e-5);
  expect_frozen_untouched(tc, got);
}

TEST(Frozen, PatternsThatSelectNothingAreRefused) {
  const auto error = [](const json& trainable) {
    json j = tiny_config(true, 3);
    j["model"]["trainable"] = trainable;
    try {
      se::parse_train_config(j.dump(), "test");
    } catch (const std::invalid_argument& e) {
      return std::string(e.what());
    }
    return std::string();
  };
  EXPECT_NE(error(json::array({"model.layers.*", "model.layer.0.*"})).find("\"model.layer.0.*\" matches no tensor"),
            std::string::npos);
  EXPECT_NE(error(json::array({"model.layers.{7-9}.*"})).find("matches no tensor"), std::string::npos)
      << "layers 7-9 of a 3-layer model";
  EXPECT_NE(error(json::array()).find("empty list"), std::string::npos);
  EXPECT_NE(error(json::array({"model.layers.{3}.*"})).find("a range is {A-B}"), std::string::npos);
  EXPECT_NE(error("none").find("must be \"all\" or a list"), std::string::npos);
  EXPECT_EQ(error("all"), "");
}

}  // namespace

namespace {

// A checkpoint of a run with frozen tensors holds the trainable units alone and the base's
// fingerprint; resumed (at 2 ranks), the run is bitwise the straight one; resumed against another
// base, it is refused.
TEST(Frozen, CheckpointsHoldOnlyTrainableStateAndResumeBitwise) {
  TempDir dir;
  json j = tiny_config(false, 3);
  j["model"].erase("seed");
  for (const char* k : {"preset", "layers", "hidden", "heads", "vocab_size", "max_positions"}) j["model"].erase(k);
  // Two bases of the same shape, exported as a user's Hugging Face models.
  se::TrainConfig shape = se::parse_train_config(tiny_config(false, 3).dump(), "test");
  for (const auto& [name, seed] : {std::pair<std::string, uint64_t>{"base", 7}, {"other", 8}}) {
    sm::Decoder base(shape.model, seed);
    sm::export_hf_model(base, dir / name);
  }
  j["model"]["init_from"] = (dir / "base").string();
  j["model"]["trainable"] = {"transformer.h.{1-2}.*", "transformer.ln_f.*"};
  j["data"]["path"] = "/usr/share/common-licenses";
  j["run"]["steps"] = 6;
  launch(2, j, dir, "straight", "--log " + (dir / "straight.jsonl").string() + " --export " + (dir / "straight").string());
  json half = j;
  half["run"]["steps"] = 3;
  half["run"]["checkpoint_dir"] = (dir / "ckpt").string();
  launch(2, half, dir, "first", "--log " + (dir / "first.jsonl").string());
  const json manifest = json::parse(read_file(dir / "ckpt" / "step-00000003" / "manifest.json"));
  EXPECT_NE(manifest.value("frozen_base", "").find("fnv1a64:"), std::string::npos) << manifest.dump();
  std::set<std::string> saved;
  for (const json& u : manifest["units"])
    for (const json& t : u["tensors"]) saved.insert(t["name"].get<std::string>());
  const sm::TrainableTensors trains({"transformer.h.{1-2}.*", "transformer.ln_f.*"});
  size_t trainable = 0;
  for (const std::string& n : sm::tensor_names(shape.model)) {
    EXPECT_EQ(saved.count(n), size_t(trains.trainable(n))) << n;
    trainable += trains.trainable(n);
  }
  EXPECT_EQ(saved.size(), trainable);
  json rest = j;
  rest["run"]["checkpoint_dir"] = (dir / "ckpt").string();
  launch(2, rest, dir, "resumed",
         "--resume --log " + (dir / "resumed.jsonl").string() + " --export " + (dir / "resumed").string());
  const std::vector<double> want = losses(dir / "straight.jsonl");
  std::vector<double> got = losses(dir / "first.jsonl");
  for (double l : losses(dir / "resumed.jsonl")) got.push_back(l);
  EXPECT_EQ(got, want) << "resumed losses bitwise the straight run's";
  const auto a = sm::load_hf_model(dir / "straight"), b = sm::load_hf_model(dir / "resumed");
  const auto pa = a->hf_parameters(), pb = b->hf_parameters();
  ASSERT_EQ(pa.size(), pb.size());
  for (size_t i = 0; i < pa.size(); ++i) EXPECT_TRUE(at::equal(pa[i].second, pb[i].second)) << pa[i].first;
  // Against another base: refused before anything is loaded, naming both.
  json other = rest;
  other["model"]["init_from"] = (dir / "other").string();
  std::ofstream(dir / "other.json") << other.dump(2);
  const std::string cmd = std::string(STRATA_BIN) + " train --config " + (dir / "other.json").string() +
                          " --resume --log " + (dir / "other.jsonl").string() + " > " +
                          (dir / "other.out").string() + " 2>&1";
  EXPECT_NE(run(cmd), 0);
  EXPECT_NE(read_file(dir / "other.out").find("was trained beside the frozen base fnv1a64:"), std::string::npos)
      << read_file(dir / "other.out");
  // `strata ckpt export` has no base to take the frozen tensors from: refused, saying so.
  EXPECT_NE(run(std::string(STRATA_BIN) + " ckpt export " + (dir / "ckpt" / "step-00000003").string() + " " +
                (dir / "ckpt-export").string() + " > " + (dir / "ckpt-export.out").string() + " 2>&1"),
            0);
  EXPECT_NE(read_file(dir / "ckpt-export.out").find("holds only the tensors that trained"), std::string::npos)
      << read_file(dir / "ckpt-export.out");
}

}  // namespace

namespace {

// model.lora: what Strata does not compute is refused, naming the key; the adapters (and
// modules_to_save) alone train; block tiles cut adapted blocks.
TEST(Lora, SettingsStrataDoesNotComputeAreRefused) {
  const auto error = [](const json& lora, const json& extra = json::object()) {
    json j = tiny_config(true, 3);
    j["model"]["lora"] = lora;
    for (auto& [k, v] : extra.items()) j["model"][k] = v;
    try {
      const se::TrainConfig tc = se::parse_train_config(j.dump(), "test");
      EXPECT_EQ(tc.engine.trainable, (std::vector<std::string>{"*.lora_A.weight", "*.lora_B.weight"}));
      EXPECT_TRUE(tc.model.lora.enabled());
    } catch (const std::invalid_argument& e) {
      return std::string(e.what());
    }
    return std::string();
  };
  const json ok = {{"r", 4}, {"lora_alpha", 8}, {"target_modules", {"q_proj", "v_proj"}}};
  EXPECT_EQ(error(ok), "");
  EXPECT_EQ(error({{"r", 4}, {"target_modules", "all-linear"}}), "");
  const auto with = [&](const char* k, const json& v) {
    json l = ok;
    l[k] = v;
    return l;
  };
  EXPECT_NE(error(with("lora_dropout", 0.05)).find("no dropout"), std::string::npos);
  EXPECT_NE(error(with("use_dora", true)).find("use_dora"), std::string::npos);
  EXPECT_NE(error(with("rank_pattern", {{"q_proj", 8}})).find("rank_pattern"), std::string::npos);
  EXPECT_NE(error(with("init_lora_weights", "gaussian")).find("init_lora_weights"), std::string::npos);
  EXPECT_NE(error(with("target_modules", {"c_attn"})).find("names no linear layer"), std::string::npos);
  EXPECT_NE(error(with("target_modules", ".*q_proj")).find("regular expression"), std::string::npos);
  EXPECT_NE(error(with("r", 0)).find("at least 1"), std::string::npos);
  EXPECT_NE(error(ok, {{"trainable", {"lm_head.weight"}}}).find("cannot be combined with LoRA"), std::string::npos);
  // modules_to_save: PEFT's suffix rule selects whole tensors, which train beside the adapters;
  // an entry that selects nothing, or an adapted linear, is refused.
  {
    json j = tiny_config(true, 3);
    j["model"]["lora"] = with("modules_to_save", {"lm_head", "post_attention_layernorm"});
    const se::TrainConfig tc = se::parse_train_config(j.dump(), "test");
    EXPECT_EQ(tc.engine.trainable,
              (std::vector<std::string>{"*.lora_A.weight", "*.lora_B.weight", "lm_head.weight",
                                        "model.layers.0.post_attention_layernorm.weight",
                                        "model.layers.1.post_attention_layernorm.weight",
                                        "model.layers.2.post_attention_layernorm.weight"}));
  }
  const auto saving = [&](const json& modules) {
    json j = tiny_config(true, 3);
    j["model"]["lora"] = with("modules_to_save", modules);
    return error_of([&] { se::parse_train_config(j.dump(), "test"); });
  };
  EXPECT_NE(saving({"lm_head", "no_such_module"}).find("\"no_such_module\" selects no module"), std::string::npos);
  EXPECT_NE(saving({"self_attn"}).find("which LoRA adapts"), std::string::npos) << "a module holding an adapted linear";
  EXPECT_NE(saving({"q_proj"}).find("which LoRA adapts"), std::string::npos);
  // Block tiles: the engine cuts adapted blocks, and its units are the ones the shapes plan (the
  // first tile of each part holds the part's adapters, the others use them); MLP token chunks
  // are refused.
  json j = tiny_config(true, 3);
  j["model"]["lora"] = ok;
  j["placement"] = {{"tiling", {{"attention", 2}, {"mlp", 3}}}};
  se::TrainConfig tc = se::parse_train_config(j.dump(), "test");
  auto comm = se::Communicator::create(se::DistEnv{}, std::chrono::seconds(30));
  auto dev = se::Device::create("cpu", 0, UINT64_MAX);
  {
    se::Engine eng(std::make_unique<sm::Decoder>(tc.model, tc.init_seed, sm::Decoder::Init::kDeferred), tc.engine,
                   *comm, *dev);
    EXPECT_EQ(eng.config().attention_tiles, 2u);
    EXPECT_EQ(eng.config().mlp_tiles, 3u);
  }
  j["placement"] = {{"tiling", {{"attention", 2}, {"mlp_tokens", 8}}}};
  tc = se::parse_train_config(j.dump(), "test");
  EXPECT_NE(error_of([&] {
              se::Engine eng(std::make_unique<sm::Decoder>(tc.model, tc.init_seed, sm::Decoder::Init::kDeferred),
                             tc.engine, *comm, *dev);
            }).find("LoRA adapters (model.lora) run whole MLPs"),
            std::string::npos);
}

}  // namespace
