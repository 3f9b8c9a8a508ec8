// The embedding and LM head in vocabulary tiles (placement.tiling "vocab"): equal to the whole
// vocabulary at 1, 2 and 4 ranks, with masked steps and evaluation; "auto" cuts a vocabulary
// that does not fit the device budget.
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

// ---------------------------------------------------------------- vocabulary tiles
// The embedding and the LM head cut into ranges of vocabulary rows (placement.tiling "vocab"),
// each range a unit and a stage: the embedding tiles add their rows' lookups, the head tiles
// their rows' part of each token's log-sum-exp, the loss is taken after the last, and the
// backward runs the head tiles in reverse against it. A tied head tile uses its embedding tile's
// unit. Training equals plain libtorch with the whole vocabulary to 1e-5 relative over 5 steps.
struct VocabCase {
  std::string name;
  bool llama;
  json tiling;     // placement.tiling
  json placement;  // merged into "placement"
  std::string overlap;
};

class TiledVocab : public ::testing::TestWithParam<VocabCase> {};

TEST_P(TiledVocab, TrainsAsLibtorchDoesWithTheWholeVocabulary) {
  const VocabCase& k = GetParam();
  TempDir swap;
  json j = tiling_config(k.llama, 3);
  j["placement"] = k.placement;
  j["placement"]["tiling"] = k.tiling;
  j["optimizer"]["overlap"] = k.overlap;
  if (k.overlap == "backward") j["optimizer"].erase("clip_grad_norm");
  if (k.placement.dump().find("nvme") != std::string::npos)
    j["offload"] = {{"nvme_dirs", {swap.path().string()}}, {"optimizer_chunk", "16KiB"}};
  const se::TrainConfig tc = parsed(j);
  {
    auto comm = se::Communicator::create(se::DistEnv{}, std::chrono::seconds(30));
    auto dev = se::Device::create("cpu", 0, UINT64_MAX);
    se::Engine eng(std::make_unique<sm::Decoder>(tc.model, tc.init_seed), tc.engine, *comm, *dev);
    EXPECT_EQ(eng.config().vocab_tiles, k.tiling.at("vocab").get<uint64_t>());
  }
  uint64_t peak = 0;
  expect_close(run_in_process(tc, UINT64_MAX, &peak), reference(tc, 1), 1e-5);
}

INSTANTIATE_TEST_SUITE_P(
    Cases, TiledVocab,
    ::testing::Values(
        VocabCase{"gpt2_tied_4_tiles", false, {{"vocab", 4}}, json::object(), "forward"},
        VocabCase{"llama_untied_3_tiles_serial", true, {{"vocab", 3}}, json::object(), "off"},
        VocabCase{"llama_5_tiles_state_in_swap", true, {{"vocab", 5}},
                  {{"grads", "nvme"}, {"master", "nvme"}, {"moments", "nvme"}}, "forward"},
        VocabCase{"gpt2_tied_2_tiles_update_in_backward", false, {{"vocab", 2}}, json::object(), "backward"},
        VocabCase{"llama_3_tiles_logits_in_7_with_block_tiles_kept_graphs", true,
                  {{"vocab", 3}, {"head", 7}, {"attention", 2}, {"mlp", 2}},
                  {{"recompute", 1}, {"activations", "device"}}, "forward"},  // 1 of 3 blocks
        VocabCase{"gpt2_tied_3_tiles_checkpoints_in_swap", false, {{"vocab", 3}}, {{"activations", "nvme"}}, "forward"}),
    [](const ::testing::TestParamInfo<VocabCase>& i) { return i.param.name; });

// Several ranks: against the whole vocabulary at the same rank count.
TEST(TiledVocab, TwoAndFourRanksMatchTheWholeVocabulary) {
  for (int ranks : {2, 4}) {
    SCOPED_TRACE(std::to_string(ranks) + " ranks");
    TempDir whole_dir, cut_dir, swap;
    // 2 ranks: Llama untied; 4: Llama tied. Not GPT-2: its key bias moves by Adam-normalized
    // rounding noise (equivalence.h), which reached the next block's ln_1.bias at 2.2e-5 with 4
    // ranks, tied, state in swap on one machine (2-core EPYC VM, 2026-11-27) and below 1e-5 on
    // another.
    json j = tiling_config(true, 3);
    j["model"]["tie_embeddings"] = ranks == 4;
    if (ranks == 4) {
      j["placement"] = {{"grads", "nvme"}, {"master", "nvme"}, {"moments", "nvme"}};
      j["offload"] = {{"nvme_dirs", {swap.path().string()}}};
    }
    json whole = j, cut = j;
    whole["placement"]["tiling"] = "off";
    cut["placement"]["tiling"] = {{"vocab", 3}};
    const se::TrainConfig tc = parsed(j);
    expect_close(run_launched(tc, cut, ranks, cut_dir), run_launched(tc, whole, ranks, whole_dir), 1e-5);
    EXPECT_NE(read_file(cut_dir / "out.txt").find("embedding and LM head in 3 vocabulary tiles"), std::string::npos)
        << read_file(cut_dir / "out.txt");
  }
}

// Supervised steps (a loss mask) and evaluation: the head tiles sum the same counted targets.
// (Llama untied and tied: GPT-2's key biases get gradients of rounding noise alone, which Adam
// turns into steps of the learning rate's size whatever their sign, so its weights cannot be
// compared to 1e-5 after three steps at tiny_config's learning rate. At that rate, 3e-3, the
// untied Llama's mlp.up_proj came out 1.41e-5 apart on an AVX2 machine (below 1e-5 with
// AVX-512's kernels): the weights move with the rate and their rounding differences with them,
// so this test runs at 1e-3.)
TEST(TiledVocab, MaskedStepsAndEvaluationEqualTheWholeVocabulary) {
  for (bool tied : {false, true}) {
    SCOPED_TRACE(tied ? "tied" : "untied");
    json j = tiny_config(true, 2);
    j["model"]["tie_embeddings"] = tied;
    j["batch"] = {{"micro_batch", 3}, {"grad_accum", 2}};
    j["optimizer"]["lr"] = 1e-3;
    expect_masked_steps_and_evaluation_equal(j, "off", {{"vocab", 6}, {"head", 1}},
                                             [](const se::EngineConfig& e) { EXPECT_EQ(e.vocab_tiles, 6u); });
  }
}

// A model whose vocabulary dominates (vocabulary 16384 x hidden 64: 4 MiB a weight in fp32,
// 12 MiB with its gradient buffers, beside blocks of 50K parameters): with a
// budget below what the whole embedding needs, "off" fails naming the embedding and the
// vocabulary tiles as the remedy; "auto" cuts the vocabulary into the fewest tiles (doubling)
// that fit, trains within the budget and matches the engine with the whole vocabulary and no
// budget. (Against libtorch this model's grad norm differs by 2.4e-4 at step 5, tiled or not:
// the tiles are what is tested here.)
TEST(TiledVocab, AutoCutsAVocabularyThatDoesNotFitAndTrainsWithinTheBudget) {
  json j = tiling_config(true, 2);
  j["model"]["vocab_size"] = 16384;
  j["data"]["seq_len"] = 16;
  j["batch"] = {{"micro_batch", 2}, {"grad_accum", 2}};
  j["placement"] = {{"params", "host"}, {"grads", "host"}, {"master", "host"}, {"moments", "host"}};
  auto comm = se::Communicator::create(se::DistEnv{}, std::chrono::seconds(30));
  const auto built = [&](const json& jj, uint64_t budget, uint64_t* vocab) {
    const se::TrainConfig tc = parsed(jj);
    auto dev = se::Device::create("cpu", 0, budget);
    se::Engine eng(std::make_unique<sm::Decoder>(tc.model, tc.init_seed, sm::Decoder::Init::kDeferred), tc.engine,
                   *comm, *dev);
    if (vocab) *vocab = eng.config().vocab_tiles;
    // What construction checks against the budget (units gathered ahead are opportunistic).
    return eng.memory_model().largest_need(eng.working_set_choices()) + eng.device_state_bytes();
  };
  json off = j, auto_ = j, cut = j;
  off["placement"]["tiling"] = {{"vocab", "off"}};
  cut["placement"]["tiling"] = {{"vocab", 16}};
  uint64_t vocab = 0;
  const uint64_t whole = built(off, UINT64_MAX, nullptr);
  EXPECT_EQ(built(auto_, UINT64_MAX, &vocab), whole);
  EXPECT_EQ(vocab, 1u) << "an unlimited budget needs no vocabulary tiles";
  const uint64_t sixteen = built(cut, UINT64_MAX, nullptr);
  ASSERT_LT(3 * sixteen, whole) << "the vocabulary must dominate the working set";
  const uint64_t budget = (sixteen + whole) / 2;
  try {
    built(off, budget, nullptr);
    ADD_FAILURE() << "the whole vocabulary fits " << budget;
  } catch (const se::BudgetExceeded& e) {
    const std::string m = e.what();
    EXPECT_NE(m.find("embedding"), std::string::npos) << m;
    EXPECT_NE(m.find("cut the vocabulary into more tiles (placement.tiling \"vocab\""), std::string::npos) << m;
  }
  EXPECT_LE(built(auto_, budget, &vocab), budget);
  EXPECT_GT(vocab, 1u);
  EXPECT_LT(vocab, 16u) << "auto takes the fewest that fit";

  json limited = auto_;
  limited["device"] = {{"budget", budget}};
  uint64_t peak = 0;
  const Trajectory got = run_in_process(parsed(limited), budget, &peak);
  EXPECT_LE(peak, budget);
  expect_close(got, run_in_process(parsed(off), UINT64_MAX, &peak), 1e-5);
}

}  // namespace
