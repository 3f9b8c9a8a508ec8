// The head's logits in tiles (placement.tiling "head"): equal to plain libtorch's whole logits for
// tied and untied heads in every placement and overlap mode, at 1, 2 and 4 ranks; "auto" cuts them
// exactly when they do not fit; masked steps, evaluation and bf16; the tiling keys parsed.
#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <cmath>
#include <functional>
#include <string>

#include "equivalence.h"
#include "launched.h"
#include "strata/engine/config_parse.h"
#include "strata/engine/device.h"
#include "strata/engine/layout/tiles.h"
#include "strata/engine/predict.h"
#include "test_util.h"
#include "tiling_engine.h"

namespace se = strata::engine;
namespace sm = strata::models;
using nlohmann::json;
using namespace strata::test;

namespace {

struct HeadCase {
  std::string name;
  bool llama;
  uint64_t tiles;
  json placement;  // merged into "placement"
  std::string overlap;
  bool one_pass = false;  // placement.tiling.head_pass "one"
};

class TiledHead : public ::testing::TestWithParam<HeadCase> {};

TEST_P(TiledHead, TrainsAsLibtorchDoesWithWholeLogits) {
  const HeadCase& k = GetParam();
  TempDir swap;
  json j = tiling_config(k.llama, 3);
  j["placement"] = k.placement;
  j["placement"]["tiling"] = {{"head", k.tiles}};
  if (k.one_pass) j["placement"]["tiling"]["head_pass"] = "one";
  j["optimizer"]["overlap"] = k.overlap;
  if (k.overlap == "backward") j["optimizer"].erase("clip_grad_norm");  // not known until the end
  if (k.placement.dump().find("nvme") != std::string::npos)
    j["offload"] = {{"nvme_dirs", {swap.path().string()}}, {"optimizer_chunk", "16KiB"}};
  const se::TrainConfig tc = parsed(j);
  if (k.one_pass) {  // the cut that runs is in one pass (its weight gradient fits: no budget)
    auto comm = se::Communicator::create(se::DistEnv{}, std::chrono::seconds(30));
    auto dev = se::Device::create_host(UINT64_MAX);
    se::Engine eng(std::make_unique<sm::Decoder>(tc.model, tc.init_seed, sm::Decoder::Init::kDeferred), tc.engine,
                   *comm, *dev);
    EXPECT_TRUE(eng.config().head_one_pass);
    EXPECT_EQ(eng.config().head_tiles, k.tiles);
  }
  uint64_t peak = 0;
  expect_close(run_in_process(tc, UINT64_MAX, &peak), reference(tc, 1), 1e-5);
}

INSTANTIATE_TEST_SUITE_P(
    Cases, TiledHead,
    ::testing::Values(HeadCase{"gpt2_tied_5_tiles", false, 5, json::object(), "forward"},
                      HeadCase{"llama_37_tiles_serial", true, 37, json::object(), "off"},
                      HeadCase{"llama_6_tiles_state_in_swap", true, 6,
                               {{"grads", "nvme"}, {"master", "nvme"}, {"moments", "nvme"}}, "forward"},
                      HeadCase{"gpt2_3_tiles_update_in_backward", false, 3, json::object(), "backward"},
                      HeadCase{"llama_4_tiles_kept_graphs_device_checkpoints", true, 4,
                               {{"recompute", 1}, {"activations", "device"}}, "forward"},
                      HeadCase{"gpt2_tied_7_tiles_one_pass", false, 7, json::object(), "forward", true},
                      HeadCase{"llama_6_tiles_one_pass_update_in_backward", true, 6, json::object(), "backward", true}),
    [](const ::testing::TestParamInfo<HeadCase>& i) { return i.param.name; });

// Several ranks: each rank's head computes its own micro-batches' loss tile by tile. Checked
// against the untiled head at the same rank count, whose reduce-scatters sum alike, so that only
// the head differs (the untiled engine against libtorch at several ranks is
// engine_equivalence_test.cc's; at 4 ranks with one sequence a micro-batch, the first block's
// o_proj of the untiled run ends 1.3e-5 from libtorch's, from the reduction order alone).
TEST(TiledHead, TwoAndFourRanksMatchTheUntiledHead) {
  for (int ranks : {2, 4}) {
    SCOPED_TRACE(std::to_string(ranks) + " ranks");
    TempDir whole_dir, cut_dir, swap;
    json j = tiling_config(ranks == 4, 3);
    if (ranks == 4) {
      j["placement"] = {{"grads", "nvme"}, {"master", "nvme"}, {"moments", "nvme"}};
      j["offload"] = {{"nvme_dirs", {swap.path().string()}}};
    }
    json whole = j, cut = j;
    whole["placement"]["tiling"] = "off";
    cut["placement"]["tiling"] = {{"head", 9}};
    const se::TrainConfig tc = parsed(j);
    expect_close(run_launched(tc, cut, ranks, cut_dir), run_launched(tc, whole, ranks, whole_dir), 1e-5);
    EXPECT_NE(read_file(cut_dir / "out.txt").find("head logits 9 tiles"), std::string::npos)
        << read_file(cut_dir / "out.txt");
  }
}

// A head whose logits dominate (vocabulary 4096, 4 x 64 tokens: 12 MiB of fp32 logits and their
// gradients beside about 1 MiB of weights): with a budget between the tiled and the untiled
// working sets, "off" is refused with the remedy named, and "auto" cuts the logits into the
// fewest tiles that fit, trains within the budget and matches libtorch.
TEST(TiledHead, AutoCutsTheLogitsExactlyWhenTheyDoNotFit) {
  json j = tiling_config(false, 2);
  j["model"]["vocab_size"] = 4096;
  j["model"]["max_positions"] = 64;
  j["data"]["seq_len"] = 64;
  j["batch"] = {{"micro_batch", 4}, {"grad_accum", 1}};
  auto comm = se::Communicator::create(se::DistEnv{}, std::chrono::seconds(30));
  const auto working_set = [&](const json& jj, uint64_t budget, uint64_t* tiles) {
    const se::TrainConfig tc = parsed(jj);
    auto dev = se::Device::create("cpu", 0, budget);
    se::Engine eng(std::make_unique<sm::Decoder>(tc.model, tc.init_seed, sm::Decoder::Init::kDeferred), tc.engine,
                   *comm, *dev);
    if (tiles) *tiles = eng.config().head_tiles;
    return eng.memory_model().working_set(eng.working_set_choices()) + eng.device_state_bytes();
  };
  json off = j, auto_ = j;
  off["placement"] = {{"tiling", "off"}};
  uint64_t tiles = 0;
  const uint64_t untiled = working_set(off, UINT64_MAX, &tiles);
  EXPECT_EQ(tiles, 1u);
  EXPECT_EQ(working_set(auto_, UINT64_MAX, &tiles), untiled);
  EXPECT_EQ(tiles, 1u) << "an unlimited budget needs no tiles";
  json sixteen = j;
  sixteen["placement"] = {{"tiling", {{"head", 16}}}};
  const uint64_t tiled = working_set(sixteen, UINT64_MAX, nullptr);
  ASSERT_LT(2 * tiled, untiled) << "the logits must dominate the working set";
  const uint64_t budget = (tiled + untiled) / 2;

  try {
    working_set(off, budget, nullptr);
    ADD_FAILURE() << "the untiled head fits " << budget;
  } catch (const se::BudgetExceeded& e) {
    const std::string m = e.what();
    EXPECT_NE(m.find("placement.tiling"), std::string::npos) << m;
    EXPECT_NE(m.find("cut the head's logits into more tiles (placement.tiling; the head's loss takes "),
              std::string::npos) << m;
    EXPECT_NE(m.find(" untiled)"), std::string::npos) << m;
    EXPECT_EQ(m.find("untiled or"), std::string::npos) << m;
  }
  EXPECT_LE(working_set(auto_, budget, &tiles), budget);
  EXPECT_GT(tiles, 1u);
  EXPECT_LE(tiles, 16u);
  json fewer = j;
  fewer["placement"] = {{"tiling", {{"head", tiles - 1}}}};
  EXPECT_GT(working_set(fewer, UINT64_MAX, nullptr), budget) << tiles - 1 << " tiles fit too";

  j["device"] = {{"budget", budget}};
  const se::TrainConfig tc = parsed(j);
  uint64_t peak = 0;
  const Trajectory got = run_in_process(tc, budget, &peak);
  EXPECT_LE(peak, budget);
  expect_close(got, reference(tc, 1), 1e-5);
}

// Supervised steps (a loss mask) and evaluation: the tiled head sums the same counted targets.
TEST(TiledHead, MaskedStepsAndEvaluationEqualTheUntiledHead) {
  json j = tiny_config(true, 2);
  j["batch"] = {{"micro_batch", 3}, {"grad_accum", 2}};
  expect_masked_steps_and_evaluation_equal(j, {{"head", 1}}, {{"head", 13}},
                                           [](const se::EngineConfig& e) { EXPECT_EQ(e.head_tiles, 13u); });
}

// The same in one pass (token chunks over the whole vocabulary, each chunk's gradients with its
// loss), at tiling_config's learning rate: at tiny_config's, Adam's first step (lr x the
// gradient's sign) turns the chunks' other order of summing the weight gradient into weight
// differences near 2e-5.
TEST(TiledHead, MaskedStepsAndEvaluationInOnePassEqualTheUntiledHead) {
  json j = tiling_config(true, 2);
  j["batch"] = {{"micro_batch", 3}, {"grad_accum", 2}};
  expect_masked_steps_and_evaluation_equal(j, {{"head", 1}}, {{"head", 13}, {"head_pass", "one"}},
                                           [](const se::EngineConfig& e) {
                                             EXPECT_EQ(e.head_tiles, 13u);
                                             EXPECT_TRUE(e.head_one_pass) << "the cut that ran";
                                           });
}

// bf16 compute: the tiled head rounds each tile's products to bf16 where the untiled one rounds
// one product over the whole vocabulary, so the two runs differ by bf16 rounding (the fp32 runs
// above agree to 1e-5); both must track the fp32 run as closely as each other.
TEST(TiledHead, Bf16TracksTheUntiledHeadWithinBf16Rounding) {
  json j = tiling_config(true, 3);
  j["run"]["steps"] = 8;
  j["precision"] = {{"compute", "bf16"}, {"reduce", "bf16"}};
  json fp32 = tiling_config(true, 3);
  fp32["run"]["steps"] = 8;
  json whole = j, cut = j;
  whole["placement"] = {{"tiling", "off"}};
  cut["placement"] = {{"tiling", {{"head", 11}}}};
  uint64_t peak = 0;
  const Trajectory exact = run_in_process(parsed(fp32), UINT64_MAX, &peak);
  const Trajectory a = run_in_process(parsed(whole), UINT64_MAX, &peak);
  const Trajectory b = run_in_process(parsed(cut), UINT64_MAX, &peak);
  double worst_a = 0, worst_b = 0, apart = 0;
  for (size_t i = 0; i < exact.losses.size(); ++i) {
    EXPECT_NEAR(b.losses[i], a.losses[i], 1e-2 * a.losses[i]) << "step " << i + 1;
    EXPECT_NEAR(b.losses[i], exact.losses[i], 1e-2 * exact.losses[i]) << "step " << i + 1;
  }
  for (auto& [name, w] : exact.params) {
    worst_a = std::max(worst_a, relative(a.params.at(name), w));
    worst_b = std::max(worst_b, relative(b.params.at(name), w));
    apart += relative(b.params.at(name), a.params.at(name));
  }
  EXPECT_GT(apart, 0.0) << "the tiled bf16 run is the untiled one: was the head tiled?";
  EXPECT_LT(worst_b, 2 * worst_a + 1e-3) << "the tiled head drifts further from fp32 than the untiled one";
  RecordProperty("untiled_vs_fp32", std::to_string(worst_a));
  RecordProperty("tiled_vs_fp32", std::to_string(worst_b));
  std::printf("bf16 weights vs fp32 after 8 steps: untiled head %.3g, tiled head %.3g\n", worst_a, worst_b);
}

TEST(TilingConfig, ParsesEveryFormAndRefusesTheRest) {
  const auto tiles = [](const std::string& v) {
    return se::parse_train_config(R"({"placement": {"tiling": )" + v + "}}", "t.json").engine.head_tiles;
  };
  EXPECT_EQ(se::parse_train_config("{}", "t.json").engine.head_tiles, se::EngineConfig::kTilesAuto);
  EXPECT_EQ(tiles(R"("auto")"), se::EngineConfig::kTilesAuto);
  EXPECT_EQ(tiles(R"("off")"), 1u);
  EXPECT_EQ(tiles(R"({"head": 12})"), 12u);
  EXPECT_EQ(tiles(R"({"head": "off"})"), 1u);
  EXPECT_EQ(tiles(R"({"head": "auto"})"), se::EngineConfig::kTilesAuto);
  const auto blocks = [](const std::string& v) {
    const se::EngineConfig e = se::parse_train_config(R"({"placement": {"tiling": )" + v + "}}", "t.json").engine;
    return std::make_pair(e.attention_tiles, e.mlp_tiles);
  };
  EXPECT_EQ(blocks("{}"), std::make_pair(se::EngineConfig::kTilesAuto, se::EngineConfig::kTilesAuto));
  EXPECT_EQ(blocks(R"("off")"), std::make_pair(uint64_t(1), uint64_t(1)));
  EXPECT_EQ(blocks(R"({"attention": 2, "mlp": 5})"), std::make_pair(uint64_t(2), uint64_t(5)));
  EXPECT_EQ(blocks(R"({"mlp": "off"})"), std::make_pair(se::EngineConfig::kTilesAuto, uint64_t(1)));
  const auto vocab = [](const std::string& v) {
    return se::parse_train_config(R"({"placement": {"tiling": )" + v + "}}", "t.json").engine.vocab_tiles;
  };
  EXPECT_EQ(vocab("{}"), se::EngineConfig::kTilesAuto);
  EXPECT_EQ(vocab(R"("off")"), 1u);
  EXPECT_EQ(vocab(R"({"vocab": 7})"), 7u);
  EXPECT_EQ(vocab(R"({"head": 7})"), se::EngineConfig::kTilesAuto);
  for (const std::string bad : {R"("on")", R"(4)", R"({"head": 0})", R"({"head": -3})", R"({"head": 2.5})",
                                R"({"conv": 4})", R"({"mlp": 0})", R"({"attention": "on"})", R"([1])",
                                R"({"vocab": 0})", R"({"vocab": "some"})"}) {
    try {
      tiles(bad);
      ADD_FAILURE() << bad << " accepted";
    } catch (const std::invalid_argument& e) {
      EXPECT_NE(std::string(e.what()).find("placement.tiling"), std::string::npos) << bad << ": " << e.what();
    }
  }
}

}  // namespace
