// predict_state (what `strata plan` says Strata would decide and hold) against engines really
// built on the host device with the same budgets: the same placement, recompute, checkpoint
// tier, head tiles and device-placed bytes, and the same partition sizes at other world sizes.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "equivalence.h"
#include "strata/engine/config_parse.h"
#include "strata/engine/partition.h"
#include "strata/engine/predict.h"
#include "test_util.h"

namespace strata::test {
namespace {

struct Scenario {
  std::string name;
  bool llama;
  json placement;
  json optimizer;
  // Budgets as fractions of the model's whole state (params + grads + master + moments) at
  // world size 1; device: beside the working set of the leanest choices.
  double device, host, nvme;
  double working_set_share = 1;  // of the leanest working set, untiled
  json model = json::object();   // merged into "model"
};

const se::MachineShare kUnlimited{UINT64_MAX, 1ull << 50, 1ull << 50, 1};

const json kAuto = {{"params", "auto"}, {"grads", "auto"}, {"master", "auto"}, {"moments", "auto"}};

uint64_t whole_state(const se::TrainConfig& tc) {
  const se::StatePrediction p = se::predict_state(tc.engine, tc.model, 1, kUnlimited);
  return p.device_state + p.host_state + p.nvme_state;
}

TEST(PredictState, IsWhatTheEngineDecides) {
  const std::vector<Scenario> scenarios = {
      {"all auto, unlimited", false, kAuto, {}, -1, 1, 0},
      {"all auto, device holds part of the optimizer group", false, kAuto, {{"overlap", false}}, 0.5, 2, 0},
      {"all auto, state split between host and NVMe", true, kAuto, {{"overlap", "forward"}}, 0.02, 0.45, 4},
      {"update during backward (gradients not stored)", true,
       {{"params", "auto"}, {"grads", "auto"}, {"master", "auto"}, {"moments", "auto"}, {"recompute", "auto"}},
       {{"overlap", "backward"}, {"clip_grad_norm", 0.0}}, 0.1, 2, 0},
      {"explicit host state, recompute and checkpoints auto", false,
       {{"params", "host"}, {"grads", "host"}, {"master", "host"}, {"moments", "host"}, {"recompute", "auto"},
        {"activations", "auto"}},
       {}, 0.3, 2, 0},
      {"head tiles auto in a tight device", true,
       {{"params", "host"}, {"grads", "host"}, {"master", "host"}, {"moments", "host"}, {"tiling", "auto"}},
       {}, 0, 2, 0, 0.7},
      {"block tiles auto in a tight device", true,
       {{"params", "host"}, {"grads", "host"}, {"master", "host"}, {"moments", "host"}, {"tiling", "auto"}},
       {}, 0, 2, 0, 0.6, {{"hidden", 128}, {"heads", 8}, {"kv_heads", 4}, {"intermediate", 1536}, {"vocab_size", 256}}},
      {"block tiles with recompute auto", true,
       {{"params", "host"}, {"grads", "host"}, {"master", "host"}, {"moments", "host"}, {"recompute", "auto"},
        {"tiling", {{"attention", 2}, {"mlp", 3}}}},
       {}, 0.02, 2, 0},
  };
  for (const Scenario& sc : scenarios) {
    SCOPED_TRACE(sc.name);
    TempDir swap;
    json j = tiny_config(sc.llama, 3);
    if (sc.llama) j["model"]["vocab_size"] = 4000;
    for (auto& [k, v] : sc.model.items()) j["model"][k] = v;
    j["data"]["seq_len"] = 32;
    j["batch"]["grad_accum"] = 1;
    if (!sc.placement.is_null()) j["placement"] = sc.placement;
    for (auto& [k, v] : sc.optimizer.items()) j["optimizer"][k] = v;
    const se::TrainConfig probe = se::parse_train_config(j.dump(), "test");
    const double state = double(whole_state(probe));
    const auto bytes = [&](double f) { return f < 0 ? UINT64_MAX : uint64_t(f * state); };
    j["offload"] = {{"host_budget", std::to_string(bytes(sc.host))}};
    if (sc.nvme > 0) {
      j["offload"]["nvme_dirs"] = {swap.path().string()};
      j["offload"]["nvme_budget"] = std::to_string(bytes(sc.nvme));
    }
    se::TrainConfig tc = se::parse_train_config(j.dump(), "test");
    // The device: the scenario's share of the state beside the leanest working set.
    uint64_t device = UINT64_MAX;
    if (sc.device >= 0) {
      se::EngineConfig lean = tc.engine;
      const se::StatePrediction all_host = se::predict_state(
          [&] {
            se::EngineConfig e = lean;
            e.params = e.grads = e.master = e.moments = se::Placement::kHost;
            return e;
          }(),
          tc.model, 1, kUnlimited);
      device = uint64_t(double(all_host.working_set) * sc.working_set_share) + bytes(sc.device);
    }
    // The budgets a run takes: the configuration's (both set above), no NVMe without directories.
    const se::StatePrediction p = se::predict_state(tc.engine, tc.model, 1, {device, 1ull << 50, 1ull << 50, 1});
    ASSERT_TRUE(p.fits) << p.error;
    if (sc.working_set_share < 1) {
      EXPECT_TRUE(p.head_tiles > 1 || !p.tiles.blocks_whole()) << "the scenario is meant to cut the head or the blocks";
    }
    if (sc.device > 0 && sc.device < 1 && sc.placement == kAuto)
      EXPECT_NE(p.placement.master, se::Placement::kDevice) << "the scenario is meant to split the state";

    auto comm = se::Communicator::create(se::DistEnv{}, std::chrono::seconds(30));
    auto dev = se::Device::create_host(device);
    se::Engine eng(std::make_unique<sm::Decoder>(tc.model, tc.init_seed, sm::Decoder::Init::kDeferred), tc.engine,
                   *comm, *dev);
    const se::EngineConfig& e = eng.config();
    EXPECT_EQ(p.placement.params, e.params);
    EXPECT_EQ(p.placement.grads, e.grads);
    EXPECT_EQ(p.placement.master, e.master);
    EXPECT_EQ(p.placement.moments, e.moments);
    EXPECT_EQ(p.choice.recomputed, eng.working_set_choices().recomputed);  // block stages
    EXPECT_EQ(p.tiles.whole_blocks(p.choice.recomputed), size_t(e.recompute_blocks));  // blocks
    EXPECT_EQ(p.choice.recomputed % size_t(p.tiles.block_stages()), 0u) << "whole blocks only";
    EXPECT_EQ(p.choice.activations, e.activations);
    EXPECT_EQ(p.head_tiles, e.head_tiles);
    EXPECT_EQ(uint64_t(p.tiles.attention), e.attention_tiles);
    EXPECT_EQ(uint64_t(p.tiles.mlp), e.mlp_tiles);
    EXPECT_EQ(p.device_state, eng.device_state_bytes());
    EXPECT_EQ(p.working_set, eng.memory_model().working_set(eng.working_set_choices()));
    EXPECT_TRUE(eng.placement_report().starts_with(p.report)) << eng.placement_report() << "\n" << p.report;
    std::cout << "  " << sc.name << ": " << p.report << "; recompute " << p.choice.recomputed << " block stages, checkpoints "
              << se::to_string(p.choice.activations) << ", head tiles " << p.head_tiles << ", block tiles "
              << p.tiles.attention << " x " << p.tiles.mlp << "\n";
  }
}

// The prediction's units are the partition the engine builds from the real tensors.
TEST(PredictState, PartitionsLikeTheEngineAtAnyWorldSize) {
  for (bool llama : {false, true})
  for (const sm::LayerTiles tiles : {sm::LayerTiles{1, 1}, sm::LayerTiles{2, 3}, sm::LayerTiles{1, 1, 4},
                                      sm::LayerTiles{2, 3, 3}}) {
    se::TrainConfig tc = se::parse_train_config(tiny_config(llama, 3).dump(), "test");
    tc.engine.attention_tiles = uint64_t(tiles.attention);
    tc.engine.mlp_tiles = uint64_t(tiles.mlp);
    tc.engine.vocab_tiles = uint64_t(tiles.vocab);
    sm::Decoder m(tc.model, 1, sm::Decoder::Init::kDeferred);
    m.set_tiles(tiles);
    std::vector<std::pair<std::string, std::vector<se::TensorSpec>>> specs;
    for (sm::Stage* s : m.stages()) {
      std::vector<se::TensorSpec> ts;
      for (auto& [name, t] : s->hf_parameters()) ts.push_back({name, t.sizes().vec(), {}});
      if (!ts.empty()) specs.emplace_back("u" + std::to_string(specs.size()), ts);  // a tied head tile owns none
    }
    {
      // The stages' units: the schedule the engine builds from the modules' tensors.
      auto comm = se::Communicator::create(se::DistEnv{}, std::chrono::seconds(30));
      auto dev = se::Device::create("cpu", 0, UINT64_MAX);
      se::Engine eng(std::make_unique<sm::Decoder>(tc.model, 1, sm::Decoder::Init::kDeferred), tc.engine, *comm, *dev);
      const se::StatePrediction p = se::predict_state(tc.engine, tc.model, 1, kUnlimited);
      const auto& schedule = eng.memory_model().schedule();
      ASSERT_EQ(p.stage_units.size(), schedule.num_stages());
      for (size_t s = 0; s < schedule.num_stages(); ++s) EXPECT_EQ(p.stage_units[s], schedule.units_of(s)) << s;
      EXPECT_EQ(p.tiles, tiles);
    }
    for (int world : {1, 2, 3, 7, 64}) {
      const se::Partition real(specs, world);
      const se::StatePrediction p = se::predict_state(tc.engine, tc.model, world, kUnlimited);
      ASSERT_EQ(p.shard_numel.size(), real.num_units());
      for (size_t u = 0; u < real.num_units(); ++u) {
        EXPECT_EQ(p.shard_numel[u], real.unit(u).shard_numel) << "world " << world << " unit " << u;
        EXPECT_EQ(p.unit_numel[u], real.unit(u).numel);
      }
    }
  }
}

// One resolution: for random configurations (placements, recompute, checkpoints, tiles, the head's
// pass, MLP token chunks, overlap, prefetch, precision, budgets from roomy to tight), an engine
// built on the host device and predict_state decide alike: the effective configuration, the
// device-placed state, the working set, the prefetch window and the placement line; where one
// refuses the configuration, so does the other. The seed is printed; STRATA_SEED replays one.
TEST(PredictState, RandomConfigurationsResolveAsTheEngineDoes) {
  const char* env = std::getenv("STRATA_SEED");
  const uint32_t seed = env ? uint32_t(std::strtoul(env, nullptr, 10)) : std::random_device{}();
  std::cout << "  seed " << seed << "\n";
  std::mt19937 rng(seed);
  const auto pick = [&](const std::vector<json>& xs) { return xs[std::uniform_int_distribution<size_t>(0, xs.size() - 1)(rng)]; };
  const auto chance = [&](double p) { return std::uniform_real_distribution<double>(0, 1)(rng) < p; };
  int built = 0, refused = 0, tries = 0;
  while (built + refused < 20) {
    ASSERT_LT(++tries, 400) << "too few valid configurations drawn";
    TempDir swap;
    const bool llama = chance(0.5);
    json j = tiny_config(llama, pick({2, 3}).get<int64_t>());
    if (llama && chance(0.5)) j["model"]["vocab_size"] = 1000;
    if (chance(0.3))  // frozen units: compute copies alone, no gradient buffers
      j["model"]["trainable"] = llama ? json::array({"model.layers.1.*", "lm_head.weight"})
                                      : json::array({"transformer.h.1.mlp.*", "transformer.ln_f.*"});
    j["data"]["seq_len"] = pick({16, 24, 32});
    j["batch"]["micro_batch"] = pick({1, 2, 3});
    j["batch"]["grad_accum"] = pick({1, 2});
    const std::vector<json> tier = {"auto", "auto", "host", "device", "nvme"};
    const json group = pick(tier);
    j["placement"] = {{"params", pick(tier)}, {"grads", pick(tier)}, {"master", group}, {"moments", group},
                      {"recompute", pick({"auto", "all", "none", 1})}, {"activations", pick({"auto", "host", "device"})}};
    if (chance(0.6)) {
      json tiling = json::object();
      for (const char* k : {"head", "attention", "mlp", "vocab"})
        if (chance(0.7)) tiling[k] = pick({"auto", "off", 2});
      if (chance(0.3)) tiling["head_pass"] = pick({"one", "two"});
      if (chance(0.3)) tiling["mlp_tokens"] = pick({"auto", "off", 16});
      j["placement"]["tiling"] = chance(0.2) ? json("auto") : tiling;
    }
    j["optimizer"]["overlap"] = pick({"off", "forward", "backward"});
    if (chance(0.3)) j["precision"] = {{"compute", "bf16"}, {"reduce", pick({"fp32", "bf16"})}};
    j["device"] = {{"prefetch", pick({"auto", 1, 2})}};
    j["offload"] = {{"nvme_dirs", {swap.path().string()}}};
    se::TrainConfig tc;
    try {
      tc = se::parse_train_config(j.dump(), "random");
    } catch (const std::invalid_argument&) {
      continue;  // a combination the configuration refuses (e.g. nvme without a directory)
    }
    // Budgets: the whole state at world size 1 as the scale, the device beside the leanest
    // working set (all state on the host), each from a sliver to roomy.
    se::EngineConfig lean = tc.engine;
    lean.params = lean.grads = lean.master = lean.moments = se::Placement::kHost;
    const se::StatePrediction roomy = se::predict_state(tc.engine, tc.model, 1, kUnlimited);
    const se::StatePrediction all_host = se::predict_state(lean, tc.model, 1, kUnlimited);
    if (!roomy.fits || !all_host.fits) continue;
    const double state = double(roomy.device_state + roomy.host_state + roomy.nvme_state);
    const auto share = [&](double lo, double hi) { return uint64_t(state * std::uniform_real_distribution<double>(lo, hi)(rng)); };
    j["offload"] = {{"host_budget", std::to_string(share(0.2, 3))}};
    if (chance(0.6)) {
      j["offload"]["nvme_dirs"] = {swap.path().string()};
      j["offload"]["nvme_budget"] = std::to_string(share(0.5, 4));
    }
    try {
      tc = se::parse_train_config(j.dump(), "random");
    } catch (const std::invalid_argument&) {
      continue;
    }
    const uint64_t device = chance(0.2) ? UINT64_MAX
                                        : uint64_t(double(all_host.working_set) * std::uniform_real_distribution<double>(0.5, 1.2)(rng)) +
                                              share(0, 1.2);
    SCOPED_TRACE(j.dump() + " device " + std::to_string(device));
    const se::StatePrediction p = se::predict_state(tc.engine, tc.model, 1, {device, 1ull << 50, 1ull << 50, 1});
    auto comm = se::Communicator::create(se::DistEnv{}, std::chrono::seconds(30));
    auto dev = se::Device::create_host(device);
    std::unique_ptr<se::Engine> eng;
    std::string why;
    try {
      eng = std::make_unique<se::Engine>(std::make_unique<sm::Decoder>(tc.model, tc.init_seed, sm::Decoder::Init::kDeferred),
                                         tc.engine, *comm, *dev);
    } catch (const std::invalid_argument& e) {
      why = e.what();  // tile counts that do not cut the model
    } catch (const std::logic_error& e) {
      FAIL() << "the engine's construction broke: " << e.what();
    } catch (const std::exception& e) {
      why = e.what();
    }
    ASSERT_EQ(p.fits, eng != nullptr) << "prediction: " << (p.fits ? "fits" : p.error) << "\nengine: " << why;
    if (!eng) {
      std::cout << "  refused by both: " << p.error << "\n";
      ++refused;
      continue;
    }
    ++built;
    const se::EngineConfig& e = eng->config();
    EXPECT_EQ(p.placement.params, e.params);
    EXPECT_EQ(p.placement.grads, e.grads);
    EXPECT_EQ(p.placement.master, e.master);
    EXPECT_EQ(p.placement.moments, e.moments);
    EXPECT_EQ(p.choice.activations, e.activations);
    EXPECT_EQ(p.tiles.whole_blocks(p.choice.recomputed), size_t(e.recompute_blocks));
    EXPECT_EQ(p.choice.recomputed, eng->working_set_choices().recomputed);
    EXPECT_EQ(p.choice.prefetch, eng->working_set_choices().prefetch);
    EXPECT_EQ(p.head_tiles, e.head_tiles);
    EXPECT_EQ(p.head_one_pass, e.head_one_pass);
    EXPECT_EQ(uint64_t(p.tiles.attention), e.attention_tiles);
    EXPECT_EQ(uint64_t(p.tiles.mlp), e.mlp_tiles);
    EXPECT_EQ(uint64_t(p.tiles.vocab), e.vocab_tiles);
    EXPECT_EQ(p.mlp_token_chunk, e.mlp_token_chunk);
    EXPECT_EQ(p.device_state, eng->device_state_bytes());
    EXPECT_EQ(p.working_set, eng->memory_model().working_set(eng->working_set_choices()));
    EXPECT_TRUE(eng->placement_report().starts_with(p.report)) << eng->placement_report() << "\n" << p.report;
  }
  std::cout << "  " << built << " built, " << refused << " refused by both, in " << tries << " draws\n";
  EXPECT_GT(built, 0);
}

// A mixture of experts under a device budget its whole blocks do not fit: "auto" cuts its experts
// into tiles, and the prediction (no model, no device) is what the engine decides and allocates.
TEST(PredictState, AMixtureOfExpertsIsCutIntoExpertTilesAsTheEngineCutsIt) {
  json j = tiny_config(true, 3);
  j["model"] = {{"preset", "mixtral-8x7b"}, {"layers", 3}, {"hidden", 64}, {"heads", 4}, {"kv_heads", 2},
                {"intermediate", 96}, {"vocab_size", 256}, {"experts", 8}, {"experts_per_token", 2}, {"seed", 7}};
  se::TrainConfig tc = se::parse_train_config(j.dump(), "test");
  tc.engine.params = tc.engine.grads = tc.engine.master = tc.engine.moments = se::Placement::kHost;
  // The largest budget whose prediction cuts the experts (every other choice left to "auto").
  std::optional<se::StatePrediction> cut;
  uint64_t budget = 4u << 20;
  for (; budget > (64u << 10) && !cut; budget -= 32u << 10) {
    tc.engine.device_budget = budget;
    const se::StatePrediction p = se::predict_state(tc.engine, tc.model, 1, {budget, 1ull << 50, 1ull << 50, 1});
    if (p.fits && p.tiles.mlp > 1) cut = p;
  }
  ASSERT_TRUE(cut) << "no budget made \"auto\" cut the experts";
  budget += 32u << 10;
  EXPECT_LE(cut->tiles.mlp, 8);
  auto comm = se::Communicator::create(se::DistEnv{}, std::chrono::seconds(30));
  auto dev = se::Device::create_host(budget);
  se::Engine eng(std::make_unique<sm::Decoder>(tc.model, tc.init_seed, sm::Decoder::Init::kDeferred), tc.engine,
                 *comm, *dev);
  EXPECT_EQ(uint64_t(cut->tiles.mlp), eng.config().mlp_tiles);
  EXPECT_EQ(uint64_t(cut->tiles.attention), eng.config().attention_tiles);
  EXPECT_EQ(cut->working_set, eng.memory_model().working_set(eng.working_set_choices()));
  EXPECT_EQ(cut->device_state, eng.device_state_bytes());
  // And it trains within that budget.
  const at::Tensor ids = at::randint(0, 256, {tc.engine.micro_batch * tc.engine.grad_accum, tc.engine.seq_len + 1});
  const se::StepResult r = eng.train_step(ids);
  EXPECT_TRUE(std::isfinite(r.loss));
  EXPECT_LE(eng.memory().device_peak, budget);
  std::cout << "  " << cut->tiles.mlp << " expert tiles at a budget of " << budget << " B: " << cut->report << "\n";
}

TEST(PredictState, SaysWhyItDoesNotFit) {
  se::TrainConfig tc = se::parse_train_config(tiny_config(false, 2).dump(), "test");
  tc.engine.params = tc.engine.grads = tc.engine.master = tc.engine.moments = se::Placement::kDevice;
  const se::StatePrediction p = se::predict_state(tc.engine, tc.model, 1, {1 << 16, 1ull << 40, 0, 1});
  EXPECT_FALSE(p.fits);
  EXPECT_NE(p.error.find("device budget"), std::string::npos) << p.error;
}

}  // namespace
}  // namespace strata::test
