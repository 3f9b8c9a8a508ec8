// Blocks cut into attention and MLP tiles (placement.tiling "attention", "mlp") and MLPs over
// token chunks ("mlp_tokens"): equal to plain libtorch with whole blocks at 1, 2 and 4 ranks;
// "auto" cuts only what does not fit the device budget.
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

// ---------------------------------------------------------------- block tiles
// Each block cut into attention tiles (groups of key/value heads) and MLP tiles (slices of the
// intermediate dimension), each tile a unit: gathered, recomputed, reduce-scattered, updated and
// placed alone. Training equals plain libtorch with whole blocks to 1e-5 relative over 5 steps.
struct BlockCase {
  std::string name;
  bool llama;
  int64_t attention, mlp;
  json placement;  // merged into "placement"
  std::string overlap;
};

class TiledBlocks : public ::testing::TestWithParam<BlockCase> {};

TEST_P(TiledBlocks, TrainAsLibtorchDoesWithWholeBlocks) {
  const BlockCase& k = GetParam();
  TempDir swap;
  json j = tiling_config(k.llama, 3);
  j["placement"] = k.placement;
  j["placement"]["tiling"] = {{"attention", k.attention}, {"mlp", k.mlp}};
  j["optimizer"]["overlap"] = k.overlap;
  if (k.overlap == "backward") j["optimizer"].erase("clip_grad_norm");
  if (k.placement.dump().find("nvme") != std::string::npos)
    j["offload"] = {{"nvme_dirs", {swap.path().string()}}, {"optimizer_chunk", "16KiB"}};
  const se::TrainConfig tc = parsed(j);
  if (k.placement.contains("recompute")) {
    // placement.recompute counts whole blocks: N blocks are N x (attention + MLP tiles) stages.
    const int n = k.placement["recompute"].get<int>();
    auto comm = se::Communicator::create(se::DistEnv{}, std::chrono::seconds(30));
    auto dev = se::Device::create("cpu", 0, UINT64_MAX);
    se::Engine eng(std::make_unique<sm::Decoder>(tc.model, tc.init_seed, sm::Decoder::Init::kDeferred), tc.engine,
                   *comm, *dev);
    EXPECT_EQ(eng.config().recompute_blocks, n);
    EXPECT_EQ(eng.working_set_choices().recomputed, size_t(n * (k.attention + k.mlp)));
  }
  uint64_t peak = 0;
  expect_close(run_in_process(tc, UINT64_MAX, &peak), reference(tc, 1), 1e-5);
}

INSTANTIATE_TEST_SUITE_P(
    Cases, TiledBlocks,
    ::testing::Values(BlockCase{"gpt2_1x3_host", false, 1, 3, json::object(), "forward"},
                      BlockCase{"llama_2x3_serial", true, 2, 3, json::object(), "off"},
                      BlockCase{"llama_2x5_state_in_swap", true, 2, 5,
                                {{"grads", "nvme"}, {"master", "nvme"}, {"moments", "nvme"}}, "forward"},
                      BlockCase{"gpt2_4x2_update_in_backward", false, 4, 2, json::object(), "backward"},
                      BlockCase{"llama_2x4_kept_graphs_device_checkpoints", true, 2, 4,
                                {{"recompute", 1}, {"activations", "device"}}, "forward"},  // 1 of 3 blocks
                      BlockCase{"gpt2_3x7_checkpoints_in_swap", false, 3, 7,
                                {{"activations", "nvme"}, {"params", "host"}}, "forward"}),
    [](const ::testing::TestParamInfo<BlockCase>& i) { return i.param.name; });

// Several ranks: against whole blocks at the same rank count (the reduce-scatters sum alike).
TEST(TiledBlocks, TwoAndFourRanksMatchWholeBlocks) {
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
    cut["placement"]["tiling"] = {{"attention", 2}, {"mlp", 3}};
    const se::TrainConfig tc = parsed(j);
    expect_close(run_launched(tc, cut, ranks, cut_dir), run_launched(tc, whole, ranks, whole_dir), 1e-5);
    EXPECT_NE(read_file(cut_dir / "out.txt").find("blocks in 2 attention x 3 MLP tiles"), std::string::npos)
        << read_file(cut_dir / "out.txt");
  }
}

// The same at 2 and 4 ranks (state in swap at 4) under a device budget that whole blocks do not
// fit: "auto" cuts them on every rank alike, stays within the budget, and ends where whole blocks
// with no budget end. The budget is set between the two working sets measured at one rank (the
// gathered units and activations a rank holds do not depend on the world size; the shards do,
// and they live on the host here).
json wide_block_config(bool llama) {
  json j = tiling_config(llama, 2);
  j["model"]["hidden"] = 128;
  j["model"]["heads"] = 8;
  if (llama) j["model"]["kv_heads"] = 4;
  j["model"]["intermediate"] = 1536;
  j["model"]["vocab_size"] = 256;
  j["data"]["seq_len"] = 16;
  j["placement"] = {{"params", "host"}, {"grads", "host"}, {"master", "host"}, {"moments", "host"}};
  return j;
}

uint64_t device_need(const json& j) {
  const se::TrainConfig tc = parsed(j);
  auto comm = se::Communicator::create(se::DistEnv{}, std::chrono::seconds(30));
  auto dev = se::Device::create("cpu", 0, UINT64_MAX);
  se::Engine eng(std::make_unique<sm::Decoder>(tc.model, tc.init_seed, sm::Decoder::Init::kDeferred), tc.engine, *comm,
                 *dev);
  return eng.memory_model().largest_need(eng.working_set_choices()) + eng.device_state_bytes();
}

TEST(TiledBlocks, TwoAndFourRanksUnderABudgetOnlyTilesFit) {
  for (int ranks : {2, 4}) {
    SCOPED_TRACE(std::to_string(ranks) + " ranks");
    TempDir whole_dir, cut_dir, swap;
    json j = wide_block_config(ranks == 4);
    if (ranks == 4) {
      j["placement"] = {{"params", "host"}, {"grads", "nvme"}, {"master", "nvme"}, {"moments", "nvme"}};
      j["offload"] = {{"nvme_dirs", {swap.path().string()}}};
    }
    json whole = j, cut = j, eight = j;
    whole["placement"]["tiling"] = "off";
    eight["placement"]["tiling"] = {{"attention", 4}, {"mlp", 8}};
    const uint64_t need_whole = device_need(whole), need_cut = device_need(eight);
    ASSERT_LT(2 * need_cut, need_whole) << "the blocks must dominate the device's working set";
    const uint64_t budget = (need_whole + need_cut) / 2;
    cut["device"] = {{"budget", budget}, {"prefetch", 0}};
    const se::TrainConfig tc = parsed(j);
    const Trajectory got = run_launched(tc, cut, ranks, cut_dir);
    expect_close(got, run_launched(tc, whole, ranks, whole_dir), 1e-5);
    EXPECT_LE(got.device_peak, budget);
    const std::string out = read_file(cut_dir / "out.txt");
    EXPECT_NE(out.find("blocks in "), std::string::npos) << out;
  }
}

// The MLP over token chunks (placement.tiling "mlp_tokens"): whole blocks and MLP tiles, with
// kept graphs and with recompute, equal plain libtorch over whole sequences to 1e-5.
TEST(MlpTokenChunks, TrainAsLibtorchDoesOverWholeSequences) {
  struct Run {
    bool llama;
    json tiling, placement;
  };
  for (const Run& r : {Run{true, {{"attention", 1}, {"mlp", 3}, {"mlp_tokens", 7}}, json::object()},
                       Run{false, {{"attention", "off"}, {"mlp", "off"}, {"mlp_tokens", 5}}, {{"recompute", 1}}},
                       Run{true, {{"attention", "off"}, {"mlp", "off"}, {"mlp_tokens", 48}}, json::object()}}) {
    SCOPED_TRACE(r.tiling.dump());
    json j = tiling_config(r.llama, 3);
    j["placement"] = r.placement;
    j["placement"]["tiling"] = r.tiling;
    const se::TrainConfig tc = parsed(j);
    EXPECT_EQ(tc.engine.mlp_token_chunk, r.tiling["mlp_tokens"].get<int64_t>());
    uint64_t peak = 0;
    expect_close(run_in_process(tc, UINT64_MAX, &peak), reference(tc, 1), 1e-5);
  }
  EXPECT_THROW(parsed(json{{"placement", {{"tiling", {{"mlp_tokens", 0}}}}}}), std::invalid_argument);
  EXPECT_THROW(parsed(json{{"placement", {{"tiling", {{"mlp_tokens", "some"}}}}}}), std::invalid_argument);
  EXPECT_EQ(parsed(json{{"placement", {{"tiling", {{"mlp_tokens", "off"}}}}}}).engine.mlp_token_chunk, 0);
  EXPECT_EQ(parsed(json{{"placement", {{"tiling", "off"}}}}).engine.mlp_token_chunk, 0);
  EXPECT_EQ(parsed(json{{"placement", {{"tiling", {{"mlp_tokens", "auto"}}}}}}).engine.mlp_token_chunk,
            se::EngineConfig::kMlpChunkAuto);
  EXPECT_EQ(parsed(json::object()).engine.mlp_token_chunk, se::EngineConfig::kMlpChunkAuto) << "the default";
}

// Long sequences (placement.tiling "mlp_tokens" "auto"): where the blocks' autograd graphs, whose
// MLP intermediates grow with the tokens, leave no tiling that fits, the MLPs run over token
// chunks (layout::auto_mlp_token_chunk); the run stays within the budget and matches libtorch over
// whole sequences; "off" fails there with BudgetExceeded; with room to spare nothing is chunked.
TEST(MlpTokenChunks, AutoChunksOnlyWhereNothingFitsWithoutThem) {
  json j = tiling_config(true, 2);
  j["model"]["intermediate"] = 512;
  j["data"]["seq_len"] = 512;
  j["run"]["steps"] = 3;
  j["placement"] = {{"tiling", {{"attention", "off"}, {"mlp", "off"}, {"vocab", "off"}, {"mlp_tokens", "auto"}}}};
  j["device"] = {{"prefetch", 0}};
  const se::TrainConfig tc = parsed(j);
  const uint64_t tokens = uint64_t(tc.engine.micro_batch * tc.engine.seq_len);
  const int64_t chunk = int64_t(se::layout::auto_mlp_token_chunk(tokens));
  ASSERT_LT(chunk, int64_t(tokens)) << "the test's premise: chunks shorter than the micro-batch";
  const auto fits = [&](int64_t mlp_chunk, uint64_t budget) {
    se::EngineConfig e = tc.engine;
    e.mlp_token_chunk = mlp_chunk;
    return se::tiles_fit(e, tc.model, {1, 1, 1}, 1, budget, false);
  };
  uint64_t lo = 1 << 16, hi = 256 << 20;  // the smallest budget the chunked MLPs fit in
  while (lo + 1024 < hi) {
    const uint64_t mid = (lo + hi) / 2;
    (fits(chunk, mid) ? hi : lo) = mid;
  }
  ASSERT_FALSE(fits(0, hi)) << "whole-sequence MLPs must not fit where the chunked ones just do";
  std::printf("chunks of %lld of %llu tokens fit in %.2f MiB\n", (long long)chunk, (unsigned long long)tokens, hi / 1048576.0);
  const auto engine_config = [&](uint64_t budget) {
    auto comm = se::Communicator::create(se::DistEnv{}, std::chrono::seconds(30));
    auto dev = se::Device::create_host(budget);
    se::Engine eng(std::make_unique<sm::Decoder>(tc.model, tc.init_seed, sm::Decoder::Init::kDeferred), tc.engine,
                   *comm, *dev);
    return eng.config();
  };
  EXPECT_EQ(engine_config(hi).mlp_token_chunk, chunk);
  EXPECT_EQ(engine_config(UINT64_MAX).mlp_token_chunk, 0) << "nothing to save: whole sequences";
  uint64_t peak = 0;
  const Trajectory got = run_in_process(tc, hi, &peak);
  EXPECT_LE(peak, hi);
  expect_close(got, reference(tc, 1), 1e-5);

  json off = j;
  off["placement"]["tiling"]["mlp_tokens"] = "off";
  try {
    run_in_process(parsed(off), hi, &peak);
    ADD_FAILURE() << "whole-sequence MLPs ran within a budget they do not fit";
  } catch (const se::BudgetExceeded& e) {
    EXPECT_NE(std::string(e.what()).find("block"), std::string::npos) << e.what();
  }
}

// A model whose one block is larger than the device budget allows: whole blocks fail with
// BudgetExceeded naming the block and the remedy; "auto" cuts the blocks into the fewest tiles
// that fit, trains within the budget and matches libtorch with whole blocks.
TEST(TiledBlocks, AutoCutsBlocksThatDoNotFitAndTrainsWithinTheBudget) {
  json j = tiling_config(true, 2);
  j["model"]["hidden"] = 128;
  j["model"]["heads"] = 8;
  j["model"]["kv_heads"] = 4;
  j["model"]["intermediate"] = 1536;
  j["model"]["vocab_size"] = 256;
  j["data"]["seq_len"] = 16;
  j["batch"] = {{"micro_batch", 2}, {"grad_accum", 2}};  // one sequence a micro-batch ends ~1e-5 from libtorch untiled
  j["placement"] = {{"params", "host"}, {"grads", "host"}, {"master", "host"}, {"moments", "host"}};
  auto comm = se::Communicator::create(se::DistEnv{}, std::chrono::seconds(30));
  const auto built = [&](const json& jj, uint64_t budget, sm::LayerTiles* tiles) {
    const se::TrainConfig tc = parsed(jj);
    auto dev = se::Device::create("cpu", 0, budget);
    se::Engine eng(std::make_unique<sm::Decoder>(tc.model, tc.init_seed, sm::Decoder::Init::kDeferred), tc.engine,
                   *comm, *dev);
    if (tiles) *tiles = {int64_t(eng.config().attention_tiles), int64_t(eng.config().mlp_tiles)};
    return eng.memory_model().working_set(eng.working_set_choices()) + eng.device_state_bytes();
  };
  json off = j, auto_ = j;
  off["placement"]["tiling"] = {{"attention", "off"}, {"mlp", "off"}};
  sm::LayerTiles tiles;
  const uint64_t whole = built(off, UINT64_MAX, &tiles);
  EXPECT_EQ(built(auto_, UINT64_MAX, &tiles), whole);
  EXPECT_TRUE(tiles.blocks_whole()) << "an unlimited budget needs no tiles";
  json eight = j;
  eight["placement"]["tiling"] = {{"attention", 4}, {"mlp", 8}};
  const uint64_t cut = built(eight, UINT64_MAX, nullptr);
  ASSERT_LT(2 * cut, whole) << "the blocks' parameters must dominate the working set";
  const uint64_t budget = (cut + whole) / 2;
  try {
    built(off, budget, nullptr);
    ADD_FAILURE() << "whole blocks fit " << budget;
  } catch (const se::BudgetExceeded& e) {
    const std::string m = e.what();
    EXPECT_NE(m.find("cannot run unit block.0"), std::string::npos) << m;
    EXPECT_NE(m.find("cut the blocks into more tiles (placement.tiling"), std::string::npos) << m;
  }
  EXPECT_LE(built(auto_, budget, &tiles), budget);
  EXPECT_FALSE(tiles.blocks_whole());

  j["device"] = {{"budget", budget}};
  const se::TrainConfig tc = parsed(j);
  uint64_t peak = 0;
  const Trajectory got = run_in_process(tc, budget, &peak);
  EXPECT_LE(peak, budget);
  expect_close(got, reference(tc, 1), 1e-5);
}

}  // namespace
