// The 3D model's expert parallelism (TP x PP x EP x DP, Megatron-Core's MoE layout) against
// published mixture-of-experts runs. The inputs are the cluster preset (dgx-h100: datasheet
// numbers and the same assumed matmul curve as every GPU), the model preset and the
// configurations as published; nothing is fitted.
#include <gtest/gtest.h>

#include <cstdio>
#include <string>

#include "strata/models/model_config.h"
#include "strata/planner/cluster.h"
#include "strata/planner/three_d.h"

namespace strata::planner {
namespace {

// Megatron-MoE-ModelZoo (NVIDIA's Megatron-Core MoE recipes, linked from Megatron-LM's MoE
// README), best_practice/qwen3/readme.md at commit 020b813 ("Performance Results, H100"):
// Qwen3-235B-A22B in bf16 on 256 H100s (NVLink 4, InfiniBand 8x50 GB/s), sequence 4096, global
// batch 2048, forced load balancing; model_configs/benchmarking/Qwen3-235B-A22B.yaml: sequence
// parallel, distributed optimizer, expert tensor parallelism 1, the embedding and the loss
// counted as pipeline layers. Rows: DeepEP cross-node EP (19.7 s, without its 1F1B overlap of
// the all-to-all), the plain all-to-all dispatcher with intra-node EP (24.2 s) and TP 4 without
// recompute (29.0 s). Recompute "norm, act" (layer norms and the experts' activation) is taken
// as selective recompute. Left out: the FSDP row (Strata's planner models no FSDP for 3D) and the
// row with the all-to-all overlapped. The model predicts every row short (2026-12-03: -6.9%,
// -19.4%, -28.1%), the more so the smaller each expert's products (4096, 1024 and 512 rows an
// expert a micro-batch): it prices no token permutation, no router top-k and a grouped product
// at the rate of one dense product of its size (docs/PLANNER.md). The bound is 30% and the
// ranking of the three layouts must be the published one, which is what a search relies on.
TEST(Planner, MegatronCoreQwen3MoeWithinThirtyPercentAndRankedAsPublished) {
  struct Row {
    const char* dispatcher;
    int tp, pp, vpp, ep;
    Recompute recompute;
    double published_s;
  };
  const Row rows[] = {{"DeepEP", 2, 8, 4, 32, Recompute::kSelective, 19.7},
                      {"A2A", 2, 32, 3, 8, Recompute::kSelective, 24.2},
                      {"DeepEP", 4, 8, 4, 8, Recompute::kNone, 29.0}};
  Cluster c = cluster_preset("dgx-h100");
  c.nodes = 32;
  const Workload w{models::preset("qwen3-235b-a22b"), 4096, 2048, true};
  std::printf("| dispatcher | TP x PP x EP (VPP) | predicted s | published s | error | compute | all-to-all | bubble | "
              "memory GB |\n");
  double worst = 0, previous_step = 0;
  for (const Row& r : rows) {
    ThreeDConfig k{r.tp, r.pp, c.gpus() / (r.tp * r.pp), 1, r.vpp, r.recompute, true, true};
    k.ep = r.ep;
    k.dispatch_per_node = std::string(r.dispatcher) == "DeepEP";
    k.embedding_and_loss_as_layers = true;
    const ThreeDEstimate e = estimate_3d(w, c, k);
    const double err = e.step / r.published_s - 1;
    worst = std::max(worst, std::abs(err));
    std::printf("| %s | %d x %d x %d (%d) | %.1f | %.1f | %+.1f%% | %.1f | %.1f | %.1f | %.1f |\n", r.dispatcher, r.tp,
                r.pp, r.ep, r.vpp, e.step, r.published_s, 100 * err, e.compute, e.ep_comm, e.bubble, e.memory() / 1e9);
    EXPECT_TRUE(e.fits()) << r.tp << "x" << r.pp << "x" << r.ep;
    EXPECT_NEAR(e.step / r.published_s, 1.0, 0.30) << r.tp << "x" << r.pp << "x" << r.ep;
    EXPECT_GT(e.step, previous_step) << "the rows are in the published order, fastest first";
    previous_step = e.step;
  }
  std::printf("Megatron-Core Qwen3-235B-A22B: worst error %.1f%%\n", 100 * worst);
}

// Expert parallelism is what makes such a model fit: without it (every GPU holding every expert
// of its stages) the published layout does not fit an 80 GB GPU, and the search picks a
// configuration with ep > 1 that fits.
TEST(Planner, ExpertParallelismIsWhatFitsAMixtureOfExperts) {
  Cluster c = cluster_preset("dgx-h100");
  c.nodes = 32;
  const Workload w{models::preset("qwen3-235b-a22b"), 4096, 2048, true};
  ThreeDConfig k{2, 8, 16, 1, 4, Recompute::kSelective, true, true};
  k.embedding_and_loss_as_layers = true;
  EXPECT_FALSE(estimate_3d(w, c, k).fits());
  k.ep = 32;
  EXPECT_TRUE(estimate_3d(w, c, k).fits());
  k.ep = 3;
  EXPECT_THROW(estimate_3d(w, c, k), std::invalid_argument);
  const auto best = best_3d(w, c);
  ASSERT_TRUE(best);
  EXPECT_GT(best->config.ep, 1) << best->config.describe();
  std::printf("best: %s, %.1f s a step\n", best->config.describe().c_str(), best->step);
}

}  // namespace
}  // namespace strata::planner
