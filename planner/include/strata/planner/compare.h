// `strata plan`: one workload on one cluster with Strata and with 3D parallelism side by side,
// and the largest model each can train there.
//
// Strata's side is the engine's own decisions (engine::predict_state, every kind "auto"; the
// budgets a run would take from a node of the cluster: budgets_from) timed by strata_step_time.
// 3D parallelism's is the fastest configuration best_3d finds.
//
// Pure functions; thread-safe. Errors: std::invalid_argument for a workload the cluster cannot
// divide (a global batch smaller than the GPUs).
#pragma once

#include <optional>
#include <string>
#include <vector>

#include "strata/engine/config.h"
#include "strata/engine/predict.h"
#include "strata/planner/cluster.h"
#include "strata/planner/strata_time.h"
#include "strata/planner/three_d.h"

namespace strata::planner {

struct StrataEstimate {
  engine::EngineConfig config;     // what the run would be given (placement "auto" ...)
  engine::StatePrediction state;   // what the engine decides: per-tier bytes, recompute, ...
  StrataTime time;
  // Capacities per rank: the GPU (less reserved), host RAM and NVMe, shared among a node's ranks.
  double device_capacity = 0, host_capacity = 0, nvme_capacity = 0;
  bool fits() const { return state.fits; }
};

// Strata on every GPU of `c` (one rank each) for `w`: micro-batches of `base.micro_batch`
// sequences, as many as the global batch needs (grad_accum); the rest of `base` as given
// (overlap modes, precision); every placement kind, recompute, checkpoints, tiling and prefetch
// "auto"; NVMe swap where the cluster has drives (`use_nvme`).
StrataEstimate estimate_strata(const Workload& w, const Cluster& c, const engine::EngineConfig& base,
                               bool use_nvme = true);
// The configuration estimate_strata gives the engine.
engine::EngineConfig strata_config(const Workload& w, const Cluster& c, const engine::EngineConfig& base,
                                   bool use_nvme = true);

// Strata with `cfg` exactly as given (placements, recompute, prefetch as configured; a run's
// seq_len, micro_batch and grad_accum) on every GPU of `c`.
StrataEstimate estimate_strata_as_given(const engine::EngineConfig& cfg, const models::ModelConfig& m,
                                        const Cluster& c);

// A side-by-side table (text) and the same as JSON.
struct Comparison {
  Workload workload;
  Cluster cluster;
  StrataEstimate strata;
  std::optional<ThreeDEstimate> three_d;
};
// `search_micro_batch`: Strata takes the fastest micro-batch that fits (powers of two dividing its
// share of the batch) instead of base.micro_batch; a larger one gathers the parameters fewer times.
Comparison compare(const Workload& w, const Cluster& c, const engine::EngineConfig& base,
                   bool search_micro_batch = true);
std::string comparison_table(const Comparison& cmp);
std::string comparison_json(const Comparison& cmp);

// A GPT shape as the published runs describe them: `layers` x `hidden`, `heads` heads, an MLP of
// 4 x hidden, tied embeddings, `vocab` tokens, `positions` learned positions.
models::ModelConfig gpt_model(int64_t hidden, int64_t layers, int64_t heads, int64_t vocab = 51200,
                              int64_t positions = 2048);

// The model family `--max-model` walks: GPT shapes (MLP 4h, 128-wide heads, tied embeddings,
// vocabulary 51200) with about h / 200 layers (a multiple of 4): 1T is 25600 x 128.
models::ModelConfig family_model(int64_t hidden);

struct Largest {
  std::string system;
  std::optional<models::ModelConfig> model;  // none: not even the smallest fits
  double parameters = 0;
  std::string how;     // the configuration that fits
  std::string limit;   // why the next size up does not
};
// The largest model of the family each system fits on `c` with `w`'s sequence length and batch:
// data parallelism alone (tp = pp = 1, no sharding), 3D parallelism, Strata without NVMe, Strata
// with NVMe (where the cluster has drives), and, beside it, the NVMe row's state capacity alone:
// the largest model whose state host RAM and NVMe hold when the GPU holds nothing but the
// working set, however large one block's working set is. Strata cuts blocks that do not fit the
// GPU into tiles (placement.tiling "auto"), so the NVMe row reaches the capacity row unless a
// single tile (one key/value head group, 64 intermediate features) outgrows the GPU.
std::vector<Largest> largest_models(const Workload& w, const Cluster& c, const engine::EngineConfig& base);

}  // namespace strata::planner
