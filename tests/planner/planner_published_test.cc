// The planner against published results and this project's own runs. Each fixture names its
// source; the inputs are the cluster presets (planner/src/cluster.cc: datasheet numbers plus one
// assumed matmul efficiency curve, set before the first comparison and the same for every GPU)
// and the configurations as published. Nothing here is fitted per fixture.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <string>
#include <utility>
#include <vector>

#include "planner_fixture.h"
#include "strata/engine/config.h"
#include "strata/engine/config_parse.h"
#include "strata/models/model_shapes.h"
#include "strata/planner/compare.h"
#include "strata/planner/compute.h"

namespace strata::planner {
namespace {

using namespace planner_testing;

struct Errors {
  std::vector<double> e;
  void add(double predicted, double published) { e.push_back(predicted / published - 1); }
  double mean() const {
    double s = 0;
    for (double x : e) s += std::abs(x);
    return s / double(e.size());
  }
  double worst() const {
    double w = 0;
    for (double x : e) w = std::max(w, std::abs(x));
    return w;
  }
};

// Narayanan et al., "Efficient Large-Scale Language Model Training on GPU Clusters Using
// Megatron-LM" (SC21), table 1: GPT models, s = 2048, V = 51200, on DGX A100 80GB nodes (8 x 200
// Gb/s HDR), achieved TFLOPS per GPU counted as 96 B s l h^2 (1 + s/6h + V/16lh) (full
// recompute). Micro-batch sizes and interleaving are not in the table: micro-batch 1, no
// interleaving, no sequence parallelism (it came later), here. The runs trained in fp16, whose
// gradients Megatron then held and all-reduced in fp16.
TEST(Planner, MegatronTable1WithinFifteenPercent) {
  struct Row {
    const char* name;
    int64_t h, l, a;
    int tp, pp, gpus;
    int64_t batch;
    double tflops;
  };
  const Row rows[] = {{"1.7B", 2304, 24, 24, 1, 1, 32, 512, 137},        {"3.6B", 3072, 30, 32, 2, 1, 64, 512, 138},
                      {"7.5B", 4096, 36, 32, 4, 1, 128, 512, 142},       {"18.4B", 6144, 40, 48, 8, 1, 256, 1024, 135},
                      {"39.1B", 8192, 48, 64, 8, 2, 512, 1536, 138},     {"76.1B", 10240, 60, 80, 8, 4, 1024, 1792, 140},
                      {"145.6B", 12288, 80, 96, 8, 8, 1536, 2304, 148},  {"310.1B", 16384, 96, 128, 8, 16, 1920, 2160, 155},
                      {"529.6B", 20480, 105, 128, 8, 35, 2520, 2520, 163}, {"1008.0B", 25600, 128, 160, 8, 64, 3072, 3072, 163}};
  Errors err;
  std::printf("| model | TP x PP x DP | predicted s/step | predicted TFLOPS/GPU | published | error |\n");
  for (const Row& r : rows) {
    Workload w{gpt_model(r.h, r.l, r.a), 2048, r.batch, false};
    const Cluster c = a100s(r.gpus);
    ThreeDConfig k{r.tp, r.pp, r.gpus / (r.tp * r.pp), 1, 1, Recompute::kFull, false, false};
    k.grad_bytes = 2;  // fp16 training: fp16 gradients, all-reduced as they are
    const ThreeDEstimate e = estimate_3d(w, c, k);
    EXPECT_TRUE(e.fits()) << r.name << ": " << e.memory() / 1e9 << " GB";
    const double tflops = megatron_flops(w, true) / e.step / r.gpus / 1e12;
    err.add(tflops, r.tflops);
    std::printf("| %s | %d x %d x %d | %.2f | %.1f | %.0f | %+.1f%% |\n", r.name, k.tp, k.pp, k.dp, e.step, tflops,
                r.tflops, 100 * (tflops / r.tflops - 1));
    EXPECT_NEAR(tflops / r.tflops, 1.0, 0.15) << r.name;
  }
  std::printf("Megatron table 1: mean error %.1f%%, worst %.1f%%\n", 100 * err.mean(), 100 * err.worst());
}

// Korthikanti et al., "Reducing Activation Recomputation in Large Transformer Models" (2022),
// table 4 / figure 8: iteration times on A100s, s = 2048, V = 51200, micro-batch 1, with full
// recompute, and with sequence parallelism and selective recompute ("present work").
TEST(Planner, KorthikantiIterationTimesWithinFifteenPercent) {
  struct Row {
    const char* name;
    int64_t h, l, a;
    int tp, pp, gpus;
    int64_t batch;
    double full_s, selective_s;
  };
  const Row rows[] = {{"22B", 6144, 48, 64, 8, 1, 8, 4, 1.42, 1.10},
                      {"175B", 12288, 96, 96, 8, 8, 64, 64, 18.13, 13.75},
                      {"530B", 20480, 105, 128, 8, 35, 280, 280, 49.05, 37.83},
                      {"1T", 25600, 128, 160, 8, 64, 512, 512, 94.42, 71.49}};
  Errors err;
  std::printf("| model | recompute | predicted s | published s | error | memory GB |\n");
  for (const Row& r : rows)
    for (bool selective : {false, true}) {
      Workload w{gpt_model(r.h, r.l, r.a), 2048, r.batch, false};
      const Cluster c = a100s(r.gpus);
      const ThreeDConfig k{r.tp, r.pp, 1, 1, 1, selective ? Recompute::kSelective : Recompute::kFull, selective, false};
      const ThreeDEstimate e = estimate_3d(w, c, k);
      EXPECT_TRUE(e.fits()) << r.name;
      const double published = selective ? r.selective_s : r.full_s;
      err.add(e.step, published);
      std::printf("| %s | %s | %.2f | %.2f | %+.1f%% | %.1f |\n", r.name, selective ? "selective + SP" : "full",
                  e.step, published, 100 * (e.step / published - 1), e.memory() / 1e9);
      EXPECT_NEAR(e.step / published, 1.0, 0.15) << r.name << (selective ? " selective" : " full");
    }
  std::printf("Korthikanti: mean error %.1f%%, worst %.1f%%\n", 100 * err.mean(), 100 * err.worst());
}

// Selective recompute with sequence parallelism needs less memory than no recompute and more than
// full recompute, and is faster than full (Korthikanti et al.'s point).
TEST(Planner, RecomputeTradesMemoryForTime) {
  Workload w{gpt_model(12288, 96, 96), 2048, 64, false};
  const Cluster c = a100s(64);
  ThreeDConfig k{8, 8, 1, 1, 1, Recompute::kNone, true, false};
  const ThreeDEstimate none = estimate_3d(w, c, k);
  k.recompute = Recompute::kSelective;
  const ThreeDEstimate sel = estimate_3d(w, c, k);
  k.recompute = Recompute::kFull;
  const ThreeDEstimate full = estimate_3d(w, c, k);
  EXPECT_GT(none.activations, sel.activations);
  EXPECT_GT(sel.activations, full.activations);
  EXPECT_LT(none.step, sel.step);
  EXPECT_LT(sel.step, full.step);
  EXPECT_FALSE(none.fits()) << "175B without recompute does not fit 80 GB (Korthikanti et al.)";
  // The search finds a configuration that fits and is no slower than the published one.
  const auto best = best_3d(w, c);
  ASSERT_TRUE(best);
  EXPECT_TRUE(best->fits());
  EXPECT_LE(best->step, sel.step * 1.0000001);
}

// ZeRO-Infinity (Rajbhandari et al., SC21), figure 1 / section 8: the largest model trainable on
// one DGX-2 (16 V100-32GB, 1.5 TB RAM, NVMe): data parallelism 1.4B, 3D parallelism 20B,
// ZeRO-Infinity with CPU offload 70B, with NVMe 1T. Each row must come out the same order of
// magnitude (within 3.2x), and the ratio NVMe : 3D within 2x of the published one.
//
// A whole block's working set (16-bit weights and fp32 gradient buffers of 12 h^2 parameters)
// outgrows a 32 GB GPU long before host RAM and NVMe are full; Strata then cuts each block into
// tiles (placement.tiling "auto"), as ZeRO-Infinity tiles its largest operators, so that with
// NVMe the state's tiers, not the GPU, set the limit: the NVMe row equals the state capacity row.
TEST(Planner, ZeroInfinityLargestModelsOnOneDgx2) {
  const Cluster c = cluster_preset("dgx2-v100");
  engine::EngineConfig base;
  base.compute = engine::Precision::kBf16;
  base.micro_batch = 1;
  const Workload w{gpt_model(2048, 24, 16), 1024, 16, true};
  const std::vector<Largest> rows = largest_models(w, c, base);
  ASSERT_EQ(rows.size(), 5u);
  const auto show = [](const Largest& l, double published) {
    ASSERT_TRUE(l.model) << l.system;
    std::printf("| %s | %.1fB (%lld x %lld) | published %.1fB | next size: %s |\n", l.system.c_str(),
                l.parameters / 1e9, (long long)l.model->hidden, (long long)l.model->layers, published / 1e9,
                l.limit.substr(0, 160).c_str());
  };
  const double published[] = {1.4e9, 20e9, 70e9, 1e12, 1e12};
  for (size_t i = 0; i < rows.size(); ++i) {
    show(rows[i], published[i]);
    EXPECT_GT(rows[i].parameters, published[i] / 3.2) << rows[i].system;
    EXPECT_LT(rows[i].parameters, published[i] * 3.2) << rows[i].system;
  }
  // What stops Strata with NVMe is host RAM and NVMe, not the GPU's budget for one block: its
  // largest model has its blocks in tiles.
  EXPECT_EQ(rows[3].parameters, rows[4].parameters);
  EXPECT_NE(rows[3].limit.find("fit in no tier"), std::string::npos) << rows[3].limit;
  EXPECT_NE(rows[3].how.find("blocks in "), std::string::npos) << rows[3].how;
  const double published_ratio = 1e12 / 20e9;
  for (size_t i : {3, 4}) {
    const double ratio = rows[i].parameters / rows[1].parameters;
    std::printf("%s / 3D parallelism: %.1fx (published ZeRO-Infinity with NVMe / 3D: %.0fx)\n", rows[i].system.c_str(),
                ratio, published_ratio);
    EXPECT_GT(ratio, published_ratio / 2) << rows[i].system;
    EXPECT_LT(ratio, published_ratio * 2) << rows[i].system;
  }
}

// This project's H100 runs (docs/PERFORMANCE.md, 2026-11-23, the configurations in bench/configs):
// GPT 1.4B (24 x 2048, vocabulary 50304), 8 x 2048 tokens a step, bf16, prefetch 2, every block
// recomputed, activation checkpoints in host RAM ("auto" meant host then), the update after
// backward (optimizer.overlap did not exist yet). All state on the GPU: 0.413 s a step; within
// 20%. State on the host: 0.991 s, which the model does not reach (see docs/PLANNER.md: it
// predicts the overlap of transfers and compute that the engine's schedule is built for; the
// engine of 2026-11-23 fetched each checkpoint just before its recompute and synchronized per
// micro-batch), so that row is printed and bounded from below only: the prediction must not
// exceed the measurement (what the planner promises for a schedule must be reachable by it).
TEST(Planner, StrataOwnH100Runs) {
  const Cluster c = cluster_preset("h100-box");
  models::ModelConfig m = models::preset("gpt-1.4b");
  m.vocab_size = 50304;
  m.max_positions = 2048;
  for (const auto& [tier, measured] : {std::pair{engine::Placement::kDevice, 0.413}, {engine::Placement::kHost, 0.991}}) {
    engine::EngineConfig cfg;
    cfg.compute = engine::Precision::kBf16;
    cfg.micro_batch = 8;
    cfg.seq_len = 2048;
    cfg.grad_accum = 1;
    cfg.params = cfg.grads = cfg.master = cfg.moments = tier;
    cfg.activations = engine::Placement::kHost;
    cfg.prefetch = 2;
    cfg.update_overlap = engine::UpdateOverlap::kOff;
    const StrataEstimate e = estimate_strata_as_given(cfg, m, c);
    ASSERT_TRUE(e.fits()) << e.state.error;
    std::printf("| 1.4B state %s | predicted %.3f s (compute %.3f, PCIe up %.3f, down %.3f, CPU Adam %.3f) | "
                "measured %.3f s | %+.1f%% |\n",
                engine::to_string(tier), e.time.step, e.time.compute, e.time.pcie_up, e.time.pcie_down,
                e.time.cpu_optimizer, measured, 100 * (e.time.step / measured - 1));
    if (tier == engine::Placement::kDevice) EXPECT_NEAR(e.time.step / measured, 1.0, 0.2);
    else EXPECT_LT(e.time.step, measured);
  }
}

// This project's H200 runs (docs/PERFORMANCE.md, 2026-11-26 and 2026-11-27), planned from the
// configurations they ran (bench/configs) on the h200-box preset, whose constants come from
// Strata's own calibration and Adam benchmark on that machine, not from these runs. Within 20%,
// except the 14.1B run: its CPU update took 2.9-3.7 s for the 7.6G parameters of the host units
// (2.0-2.6 Gparam/s beside the backward's downloads and host gradient work, against 4.13 alone),
// which the model does not see; that row is printed and bounded from one side (the prediction
// must not exceed the measurement). The automatic placement of the 14.1B run is the one the
// engine printed there: units 0-18's optimizer state on the GPU, 19-45's in host RAM.
TEST(Planner, StrataOwnH200Runs) {
  const Cluster c = cluster_preset("h200-box");
  struct Run {
    const char* config;
    double measured;  // s/step, median after the first step
    bool within;
  };
  const Run runs[] = {{"gpu-gpt-1.4b-auto", 0.355, true},          {"gpu-gpt-1.4b-auto-keep", 0.286, true},
                      {"gpu-gpt-1.4b-host", 0.681, true},          {"gpu-gpt-2.8b-host", 1.355, true},
                      {"gpu-gpt-10b-auto-backward", 2.92, true},   {"gpu-gpt-14b-auto-backward", 4.73, false}};
  Errors errors;
  for (const Run& r : runs) {
    const engine::TrainConfig tc =
        engine::load_train_config(std::string(STRATA_SOURCE_DIR) + "/bench/configs/" + r.config + ".json");
    const StrataEstimate e = estimate_strata_as_given(tc.engine, tc.model, c);
    ASSERT_TRUE(e.fits()) << r.config << ": " << e.state.error;
    std::printf("| %s | predicted %.3f s (compute %.3f, PCIe up %.3f, down %.3f, CPU Adam %.3f) | measured %.3f s | "
                "%+.1f%% |\n",
                r.config, e.time.step, e.time.compute, e.time.pcie_up, e.time.pcie_down, e.time.cpu_optimizer,
                r.measured, 100 * (e.time.step / r.measured - 1));
    if (r.within) {
      EXPECT_NEAR(e.time.step / r.measured, 1.0, 0.2) << r.config;
      errors.add(e.time.step, r.measured);
    } else {
      EXPECT_LT(e.time.step, r.measured) << r.config;
    }
    if (std::string(r.config) == "gpu-gpt-14b-auto-backward") {
      EXPECT_NE(e.state.report.find("device 22.10 GiB (units 0-18)"), std::string::npos) << e.state.report;
      EXPECT_NE(e.state.report.find("host 30.48 GiB (units 19-45)"), std::string::npos) << e.state.report;
    }
  }
  std::printf("H200 runs within the bound: mean error %.1f%%, worst %.1f%%\n", 100 * errors.mean(), 100 * errors.worst());
}

}  // namespace
}  // namespace strata::planner
