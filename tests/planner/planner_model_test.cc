// The planner's model piece by piece: cluster files, each product at the rate of its size, block
// and head tiles, swap reads and writes together, the engine's own copies and the host's
// collectives as compute, the --max-model family, and a LoRA run's frozen units.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "planner_fixture.h"
#include "strata/engine/config.h"
#include "strata/engine/layout/schedule.h"
#include "strata/models/model_shapes.h"
#include "strata/planner/compare.h"
#include "strata/planner/compute.h"

namespace strata::planner {
namespace {

using namespace planner_testing;

TEST(Planner, ClusterFilesRoundTripAndBadOnesAreNamed) {
  for (const std::string& name : cluster_presets()) {
    const Cluster c = cluster_preset(name);
    const Cluster back = parse_cluster(cluster_json(c), "round trip");
    EXPECT_EQ(back.name, c.name);
    EXPECT_EQ(back.node.gpus, c.node.gpus);
    EXPECT_NEAR(back.node.gpu.memory, c.node.gpu.memory, 1);
    EXPECT_NEAR(back.node.gpu.peak_flops, c.node.gpu.peak_flops, 1);
    EXPECT_EQ(back.node.gpu.matmul_efficiency, c.node.gpu.matmul_efficiency);
    EXPECT_NEAR(back.node.nvme_capacity, c.node.nvme_capacity, 1);
    EXPECT_NEAR(back.node.inter_bandwidth, c.node.inter_bandwidth, 1);
  }
  {
    Cluster c = cluster_preset("h100-box");
    c.node.nvme_duplex = 3.5e9;
    c.node.intra_cpu_share = 0.76;
    const Cluster back = parse_cluster(cluster_json(c), "round trip");
    EXPECT_NEAR(back.node.nvme_duplex, 3.5e9, 1);
    EXPECT_DOUBLE_EQ(back.node.intra_cpu_share, 0.76);
  }
  const auto fails_with = [](const std::string& text, const std::string& what) {
    try {
      parse_cluster(text, "f.json");
      ADD_FAILURE() << "accepted: " << text;
    } catch (const std::invalid_argument& e) {
      EXPECT_NE(std::string(e.what()).find(what), std::string::npos) << e.what();
    }
  };
  fails_with("{", "not JSON");
  fails_with(R"({"node": {"gpus": 1}})", "f.json.node: missing object \"gpu\"");
  fails_with(R"({"node": {"gpus": 2, "gpu": {"memory_gib": 1, "peak_tflops": 1, "memory_gbps": 1},
                 "host_memory_gib": 1, "cpu_adam_gparams": 1, "pcie_h2d_gbps": 1, "pcie_d2h_gbps": 1}})",
             "missing \"intra_gbps\"");
  fails_with(R"({"node": {"gpus": 1, "gpu": {"memory_gib": -1}}})", "\"memory_gib\" must be a number >= 0");
  fails_with(R"({"node": {"gpus": 1, "gpu": {"memory_gib": 1, "peak_tflops": 1, "memory_gbps": 1},
                 "host_memory_gib": 1, "cpu_adam_gparams": 1, "pcie_h2d_gbps": 1, "pcie_d2h_gbps": 1,
                 "intra_cpu_share": 1.5}})",
             "\"intra_cpu_share\" must be in (0, 1]");
  fails_with(R"({"node": {"gpus": 1, "gpu": {"memory_gib": 1, "peak_tflops": 1, "memory_gbps": 1,
                 "matmul_efficiency": [[1e9, 1.5]]}}})",
             "0 < fraction <= 1");
  EXPECT_THROW(cluster_preset("dgx-z"), std::invalid_argument);
}

TEST(Planner, MatmulRateInterpolatesOnLogFlops) {
  GpuSpec g;
  g.peak_flops = 100e12;
  g.matmul_efficiency = {{1e9, 0.2}, {1e11, 0.6}};
  EXPECT_DOUBLE_EQ(matmul_rate(g, 1e8), 20e12);    // clamped below
  EXPECT_DOUBLE_EQ(matmul_rate(g, 1e12), 60e12);   // clamped above
  EXPECT_NEAR(matmul_rate(g, 1e10), 40e12, 1e3);   // halfway in log
  EXPECT_DOUBLE_EQ(matmul_rate(g, 1e10, true), matmul_rate(g, 1e10) / 2);  // fp32: half the 16-bit peak
}

// A GPU whose efficiency curve punishes small products (10% of peak at 1 MFLOP, all of it at
// 1 TFLOP), and a block of hidden 512, 8 heads (GPT-2: 8 key/value heads; Llama: 4) and 1376
// intermediate features.
GpuSpec small_products_slow() {
  GpuSpec g;
  g.peak_flops = 100e12;
  g.matmul_efficiency = {{1e6, 0.1}, {1e12, 1.0}};
  g.memory_bandwidth = 1e12;
  return g;
}
models::ModelConfig block_512(const std::string& preset) {
  models::ModelConfig m = models::preset(preset);
  m.hidden = 512;
  m.heads = 8;
  m.kv_heads = preset == "gpt2" ? 8 : 4;
  m.head_dim = 64;
  m.intermediate = 1376;
  return m;
}

// A block's products each run at the rate of their own size: with an efficiency curve that
// punishes small products, the attention projections (h x h) take longer per FLOP than the MLP's
// (h x 4h). Llama-style blocks run q, k and v as three products, GPT-2 as one.
TEST(Planner, EachProductRunsAtTheRateOfItsSize) {
  const GpuSpec g = small_products_slow();
  for (const char* preset : {"gpt2", "llama-1b"}) {
    const models::ModelConfig m = block_512(preset);
    const double tokens = 4 * 128, d = 512, q = 512, kv = 64.0 * m.kv_heads, f = 1376;
    const bool gpt2 = std::string(preset) == "gpt2";
    const Work w = block_forward(m, 4, 128, ShardOf{});
    // The FLOPs are the block's, however they are split.
    EXPECT_DOUBLE_EQ(w.gemm_flops(), 2 * tokens * (d * (q + 2 * kv) + q * d + (gpt2 ? 2 : 3) * d * f)) << preset;
    // The time: each product at its own rate.
    std::vector<std::pair<double, double>> products = {{2 * tokens * q * d, 1}, {2 * tokens * d * f, gpt2 ? 2 : 3}};
    if (gpt2) products.push_back({2 * tokens * d * (q + 2 * kv), 1});
    else products.insert(products.end(), {{2 * tokens * d * q, 1}, {2 * tokens * d * kv, 2}});
    double expected = 0;
    for (auto [flops, count] : products) expected += count * flops / matmul_rate(g, flops);
    EXPECT_NEAR(seconds_by_kind(w, g).matmul, expected, expected * 1e-12) << preset;
    // Slower than pricing every product at the MLP's size (the old single rate).
    EXPECT_GT(seconds_by_kind(w, g).matmul, w.gemm_flops() / matmul_rate(g, 2 * tokens * d * f)) << preset;
    // Scaling the work scales each product's count, not its size: twice the time.
    EXPECT_NEAR(seconds_by_kind(w.scaled(2), g).matmul, 2 * expected, expected * 1e-12) << preset;
  }
}

// Block tiles (placement.tiling) do a whole block's work in more, smaller products: the same
// FLOPs, each tile's q, k, v, output, up and down products at their own sizes (uneven cuts
// included), so a curve that punishes small products prices them slower; their memory traffic
// adds the tiles' residual adds and the stacks that pass (normed input, running sum) on.
// A mixture of experts' block: its router's product and each expert's three on its even share of
// the tokens' choices, whose FLOPs are the forward's (models::forward_flops_per_token, top_k
// experts a token), in products 8 / 2 = 4 times smaller than a dense MLP of top_k x the width.
TEST(Planner, AMixtureOfExpertsRunsEachExpertOnItsShareOfTheTokens) {
  const models::ModelConfig m = models::preset("mixtral-8x7b");
  const double sequences = 4, tokens = sequences * 4096;
  const Work w = mlp_forward(m, sequences, 4096, ShardOf{});
  ASSERT_EQ(w.gemms.size(), 2u);
  EXPECT_DOUBLE_EQ(w.gemms[0].flops, 2 * tokens * 4096 * 8);  // the router
  EXPECT_DOUBLE_EQ(w.gemms[1].flops, 2 * (tokens * 2 / 8) * 4096 * 14336);
  EXPECT_DOUBLE_EQ(w.gemms[1].count, 3 * 8);
  const models::ForwardFlops ff = models::forward_flops_per_token(m, 4096);
  const double d = 4096, q = 4096, kv = 1024, s = 4096;
  const double attention = 2 * (d * (q + 2 * kv) + q * d) + 2 * 2 * s * q;
  EXPECT_NEAR(w.gemm_flops() / tokens, ff.blocks / double(m.layers) - attention, 1e-6 * ff.blocks / double(m.layers));
}

TEST(Planner, BlockTilesRunTheBlocksFlopsInSmallerProducts) {
  const GpuSpec g = small_products_slow();
  for (const char* preset : {"gpt2", "llama-1b"}) {
    const bool gpt2 = std::string(preset) == "gpt2";
    const models::ModelConfig m = block_512(preset);
    const Work whole = block_forward(m, 4, 128, ShardOf{});
    ShardOf cut;
    cut.attention_tiles = 3;  // 8 (or 4) key/value heads: 3 + 3 + 2 (2 + 1 + 1)
    cut.mlp_tiles = 5;        // 1376: 276 + 275 x 4
    const Work tiled = block_forward(m, 4, 128, cut);
    EXPECT_NEAR(tiled.gemm_flops(), whole.gemm_flops(), whole.gemm_flops() * 1e-12) << preset;
    // Every tile's products at their own size: q, k, v and the output per attention tile, up
    // (gate) and down per MLP tile.
    const double tokens = 4 * 128, d = 512;
    const int64_t rep = m.heads / m.kv_heads;
    std::vector<std::pair<double, double>> products;  // (flops, count)
    for (int64_t i = 0; i < 3; ++i) {
      const double kv = double(models::tile_range(m.kv_heads, 3, i).size() * 64), q = kv * double(rep);
      products.insert(products.end(), {{2 * tokens * d * q, 1}, {2 * tokens * d * kv, 2}, {2 * tokens * q * d, 1}});
    }
    for (int64_t j = 0; j < 5; ++j)
      products.push_back({2 * tokens * d * double(models::tile_range(1376, 5, j).size()), gpt2 ? 2.0 : 3.0});
    double expected = 0;
    for (auto [flops, count] : products) expected += count * flops / matmul_rate(g, flops);
    EXPECT_NEAR(seconds_by_kind(tiled, g).matmul, expected, expected * 1e-12) << preset;
    EXPECT_GT(seconds_by_kind(tiled, g).matmul, seconds_by_kind(whole, g).matmul * 1.05) << preset;
    // 3 + 5 residual adds instead of 2 (3 activations read or written each), 2 + 4 stacks (4
    // each), per token and hidden unit, at 2 bytes a 16-bit activation.
    EXPECT_NEAR(tiled.memory_bytes - whole.memory_bytes, 2 * tokens * d * (3 * 6 + 4 * 6), 1e-6) << preset;
    EXPECT_DOUBLE_EQ(tiled.attention_flops, whole.attention_flops) << preset;
  }
  // The head's logits in tiles: the same FLOPs in tiles of their own size.
  models::ModelConfig m = models::preset("gpt2");
  const Work head = head_forward(m, 4, 128, ShardOf{});
  ShardOf cut;
  cut.logits_token_chunk = 128;
  cut.logits_vocab_tile = 4096;
  const Work tiles = head_forward(m, 4, 128, cut);
  EXPECT_NEAR(tiles.gemm_flops(), head.gemm_flops(), head.gemm_flops() * 1e-12);
  // 50257 rows: 12 tiles of 4096 and one of 1105, each over 4 chunks of 128 tokens.
  ASSERT_EQ(tiles.gemms.size(), 2u);
  EXPECT_DOUBLE_EQ(tiles.gemms[0].flops, 2.0 * 128 * 768 * 4096);
  EXPECT_DOUBLE_EQ(tiles.gemms[0].count, 4.0 * 12);
  EXPECT_DOUBLE_EQ(tiles.gemms[1].flops, 2.0 * 128 * 768 * (50257 - 12 * 4096));
  EXPECT_DOUBLE_EQ(tiles.gemms[1].count, 4.0);
  EXPECT_GT(seconds_by_kind(tiles, g).matmul, seconds_by_kind(head, g).matmul);
}

// Swap reads and writes in flight together: with the measured rate of both at once, a step's
// swap takes the longest of each direction alone and the two at the duplex rate, never longer
// than taking turns; without it, turns. Drives add up, ranks divide them.
TEST(Planner, SwapReadsAndWritesTogetherAtTheMeasuredDuplexRate) {
  NodeSpec n;
  n.nvme_read = 2e9;
  n.nvme_write = 1e9;
  EXPECT_DOUBLE_EQ(n.disk_seconds(2e9, 1e9, 1, 1), 2.0);  // turns: 1 s + 1 s
  EXPECT_DOUBLE_EQ(n.disk_seconds(0, 0, 1, 1), 0.0);
  n.nvme_duplex = 2.4e9;
  EXPECT_DOUBLE_EQ(n.disk_seconds(2e9, 1e9, 1, 1), 3e9 / 2.4e9);  // together: 1.25 s
  EXPECT_DOUBLE_EQ(n.disk_seconds(4e9, 0, 1, 1), 2.0);            // reads alone: the read rate
  EXPECT_DOUBLE_EQ(n.disk_seconds(2e9, 1e9, 2, 1), 3e9 / 4.8e9);  // two drives
  EXPECT_DOUBLE_EQ(n.disk_seconds(2e9, 1e9, 2, 4), 3e9 / 1.2e9);  // shared by four ranks
  n.nvme_duplex = 0.5e9;  // a drive slower with both than taking turns: turns
  EXPECT_DOUBLE_EQ(n.disk_seconds(2e9, 1e9, 1, 1), 2.0);
  n.nvme_read = 0;  // a direction without bandwidth: an error only for traffic that needs it
  EXPECT_THROW(n.disk_seconds(1, 0, 1, 1), std::invalid_argument);
  EXPECT_DOUBLE_EQ(n.disk_seconds(0, 1e9, 1, 1), 1.0);
}

// A small GPT-2 and a fp32 step of 2 x 64 tokens on the host device (the h100-box preset with
// the device made the CPU).
struct SmallHostRun {
  Cluster c = cluster_preset("h100-box");
  models::ModelConfig m = models::preset("gpt2");
  engine::EngineConfig cfg;
  SmallHostRun() {
    c.node.gpu.is_host = true;
    c.node.gpu.memory = 64.0 * (1 << 30);
    c.node.pcie_h2d = c.node.pcie_d2h = 10e9;
    m.layers = 2;
    m.hidden = 256;
    m.heads = m.kv_heads = 4;
    m.intermediate = 1024;
    m.vocab_size = 4096;
    cfg.compute = engine::Precision::kFp32;
    cfg.micro_batch = 2;
    cfg.seq_len = 64;
  }
};

// The engine's own copies on the device (gathers from a device-placed shard, each gradient
// zeroed, copied out of autograd, reduced and accumulated) count as compute time on the host
// device, where they take the cores: moving the compute copies off the device removes the
// gathers' copies, and a wider model copies proportionally more.
TEST(Planner, EngineCopiesOnTheDeviceCountAsCompute) {
  SmallHostRun run;
  Cluster& c = run.c;
  const models::ModelConfig& m = run.m;
  engine::EngineConfig& cfg = run.cfg;
  cfg.params = cfg.grads = cfg.master = cfg.moments = cfg.activations = engine::Placement::kDevice;
  const StrataEstimate on_device = estimate_strata_as_given(cfg, m, c);
  ASSERT_TRUE(on_device.fits()) << on_device.state.error;
  const StrataTime& t = on_device.time;
  EXPECT_GT(t.compute_local, 0);
  EXPECT_NEAR(t.compute, t.compute_matmul + t.compute_attention + t.compute_memory + t.compute_local, 1e-12);
  // Per unit: fp32 gradients copied into their buffer (4 + 4; on one rank that buffer is the
  // reduced shard), accumulated on the device (12 B of the shard); each of a unit's uses copies
  // its shard into the gathered buffer (4 + 4). One rank: shard = padded.
  const engine::StatePrediction& p = on_device.state;
  const engine::layout::Schedule schedule(p.stage_units, p.shard_numel.size(), size_t(p.tiles.vocab), size_t(p.tiles.vocab));
  std::vector<double> uses(p.shard_numel.size(), 0);
  for (const engine::layout::Use& use : schedule.uses())
    for (size_t u : schedule.units_of(use.stage)) uses[u] += 1;
  double bytes = 0, gathers = 0;
  for (size_t u = 0; u < uses.size(); ++u) {
    bytes += double(p.padded_numel[u]) * (8 + 12);
    gathers += uses[u] * double(p.padded_numel[u]) * 8;
  }
  EXPECT_NEAR(t.compute_local, (bytes + gathers) / 20e9, 1e-12);
  cfg.params = engine::Placement::kHost;
  const StrataEstimate on_host = estimate_strata_as_given(cfg, m, c);
  ASSERT_TRUE(on_host.fits()) << on_host.state.error;
  EXPECT_NEAR(on_host.time.compute_local, bytes / 20e9, 1e-12);
}

// The engine's resolved tiles reach the time model: the same run with its blocks in 2 x 4 tiles
// plans more compute (more products, each smaller, and the tiles' copies), and its head's logits
// in 8 tiles more than in 2.
TEST(Planner, TheResolvedTilesReachTheStepTime) {
  SmallHostRun run;
  GpuSpec& g = run.c.node.gpu;
  g.peak_flops = g.peak_flops_fp32 = 100e12;
  g.matmul_efficiency = {{1e6, 0.05}, {1e12, 1.0}};  // small products slower
  const auto compute = [&](uint64_t attention, uint64_t mlp, uint64_t head) {
    run.cfg.attention_tiles = attention;
    run.cfg.mlp_tiles = mlp;
    run.cfg.head_tiles = head;
    const StrataEstimate e = estimate_strata_as_given(run.cfg, run.m, run.c);
    EXPECT_TRUE(e.fits()) << e.state.error;
    return e.time;
  };
  const StrataTime whole = compute(1, 1, 1), blocks = compute(2, 4, 1);
  EXPECT_GT(blocks.compute_matmul, whole.compute_matmul * 1.01);
  EXPECT_GT(blocks.compute_memory, whole.compute_memory);
  // Both cuts recompute the logits in the backward; the finer one runs smaller products.
  EXPECT_GT(compute(1, 1, 8).compute_matmul, compute(1, 1, 2).compute_matmul);
}

// Two ranks on the host device: their collectives take the cores for the calibrated share of
// their time (intra_cpu_share) and add that to the compute; the rest is waiting, which the
// engine's other work fills, so the micro-batch is never shorter than the collectives' whole time.
TEST(Planner, HostCollectivesAddTheirCpuShareToTheCompute) {
  SmallHostRun run;
  Cluster& c = run.c;
  const models::ModelConfig& m = run.m;
  engine::EngineConfig& cfg = run.cfg;
  c.node.gpus = 2;
  GpuSpec& g = c.node.gpu;  // a CPU's rates
  g.peak_flops = g.peak_flops_fp32 = 100e9;
  g.matmul_efficiency.clear();
  g.memory_bandwidth = 10e9;
  cfg.update_overlap = engine::UpdateOverlap::kOff;
  const auto step = [&](double gbps, double share) {
    c.node.intra_bandwidth = gbps * 1e9;
    c.node.intra_cpu_share = share;
    const StrataEstimate e = estimate_strata_as_given(cfg, m, c);
    EXPECT_TRUE(e.fits()) << e.state.error;
    return e.time;
  };
  const StrataTime all = step(1, 1.0), part = step(1, 0.6);
  const double collectives = (all.gathered + all.reduced) / 1e9;
  ASSERT_GT(collectives, 0);
  ASSERT_GT(all.compute, collectives);  // the cores are the busiest resource here
  EXPECT_NEAR(all.step - part.step, 0.4 * collectives, 1e-9 * all.step);
  // A slow link: the collectives' own time bounds the micro-batch, their CPU share does not add.
  const StrataTime slow = step(0.05, 0.05);
  const double slow_collectives = (slow.gathered + slow.reduced) / 0.05e9;
  ASSERT_GT(slow_collectives, 2 * slow.compute);
  EXPECT_GE(slow.step, slow_collectives);
  EXPECT_LT(slow.step, slow_collectives + slow.compute);
}

// The model family of --max-model: 1T is 25600 x 128, sizes grow with the hidden size.
TEST(Planner, FamilyModels) {
  const models::ModelConfig t = family_model(25600);
  EXPECT_EQ(t.layers, 128);
  EXPECT_NEAR(double(t.parameters()), 1.008e12, 0.01e12);
  double last = 0;
  for (int64_t h = 1024; h < 100000; h += 4096) {
    const double p = double(family_model(h).parameters());
    EXPECT_GT(p, last);
    last = p;
  }
}

// A LoRA run (the base frozen, adapters on every block linear) beside the full fine-tune of the
// same Llama shape on two GPUs: its frozen units are gathered and do nothing else, so it reduces
// and updates only the adapters, its backward has no weight gradients for the base (model FLOPs
// 4 N + attention, give or take the adapters' share of the blocks), and it gathers what the full
// run gathers less the frozen embedding's backward, plus the adapters.
TEST(Planner, FrozenUnitsAreGatheredAndNothingElse) {
  const Cluster c = a100s(2);
  models::ModelConfig m = models::preset("llama-1b");
  m.layers = 4;
  m.hidden = 1024;
  m.heads = 8;
  m.kv_heads = 4;
  m.head_dim = 128;
  m.intermediate = 2816;
  m.vocab_size = 8192;
  m.tie_embeddings = false;
  engine::EngineConfig cfg;
  cfg.compute = engine::Precision::kBf16;
  cfg.micro_batch = 2;
  cfg.seq_len = 512;
  cfg.params = cfg.grads = cfg.master = cfg.moments = engine::Placement::kHost;
  const StrataEstimate full = estimate_strata_as_given(cfg, m, c);
  models::ModelConfig lm = m;
  lm.lora.r = 8;
  lm.lora.alpha = 16;
  lm.lora.target_modules = {"all-linear"};
  engine::EngineConfig lcfg = cfg;
  lcfg.trainable = models::adapter_patterns();
  const StrataEstimate lora = estimate_strata_as_given(lcfg, lm, c);
  ASSERT_TRUE(full.fits()) << full.state.error;
  ASSERT_TRUE(lora.fits()) << lora.state.error;
  const StrataTime &f = full.time, &l = lora.time;
  // Reduce-scatters and updates: the adapters' alone (their share of the model, padding aside).
  const double adapter_share = double(models::adapter_parameters(lm)) / double(m.parameters());
  EXPECT_GT(l.reduced, 0);
  EXPECT_LT(l.reduced, f.reduced * adapter_share * 1.1);
  EXPECT_LT(l.cpu_optimizer, f.cpu_optimizer * adapter_share * 1.1);
  EXPECT_LT(l.down, f.down * 0.2);  // the activation checkpoints still go down, no base gradient
  // Gathers: the base at each use, but the frozen embedding only in the forward (it has no
  // backward), and the adapters: less than the full run, by about one embedding.
  const double embedding = double(m.vocab_size * m.hidden) * 2 / 2;  // bf16, half of it from the other rank
  EXPECT_LT(l.gathered, f.gathered);
  EXPECT_NEAR(l.gathered, f.gathered - embedding, 3 * adapter_share * f.gathered);
  // Model FLOPs: the full run's less one forward of every linear product (the weight gradients),
  // within the adapters' share of the blocks (they keep theirs).
  const models::ForwardFlops ff = models::forward_flops_per_token(m, cfg.seq_len);
  const double tokens = double(cfg.micro_batch * cfg.seq_len);
  const double base_weight_grads = (models::forward_flops_per_token(m, 0).blocks + ff.head) * tokens;
  EXPECT_NEAR(f.flops, 3 * ff.total() * tokens, 1e-6 * f.flops);
  EXPECT_NEAR(l.flops, f.flops - base_weight_grads, 0.02 * base_weight_grads);
  // The products: every block 3 passes + its recompute vs ~2 + recompute, the head 3 vs 2.
  EXPECT_LT(l.compute_matmul, 0.85 * f.compute_matmul);
  EXPECT_GT(l.compute_matmul, 0.6 * f.compute_matmul);
  EXPECT_LT(l.step, f.step);
}

}  // namespace
}  // namespace strata::planner
