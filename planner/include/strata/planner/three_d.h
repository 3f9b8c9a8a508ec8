// Megatron-style 3D parallelism (tensor x pipeline x data) on a cluster: memory per GPU and time
// per step for one configuration, and the fastest configuration that fits. The equations and
// their sources are in docs/PLANNER.md: Narayanan et al. (SC21) for the schedule and its bubble,
// Korthikanti et al. (2022) for activation memory with sequence parallelism and selective
// recompute.
//
// Pure functions; thread-safe. Errors: std::invalid_argument for a configuration that does not
// divide the model, the batch or the cluster (estimate_3d); best_3d returns nothing when no
// configuration fits.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "strata/models/model_config.h"
#include "strata/planner/cluster.h"

namespace strata::planner {

// What is trained: the model, the sequence length and the global batch in sequences.
struct Workload {
  models::ModelConfig model;
  int64_t seq_len = 2048;
  int64_t global_batch = 0;
  bool flash_attention = true;  // fused attention (Megatron in 2021-22: not)
};

enum class Recompute { kNone, kSelective, kFull };
const char* to_string(Recompute r);

struct ThreeDConfig {
  int tp = 1, pp = 1, dp = 1;
  int micro_batch = 1;
  int interleave = 1;  // model chunks per GPU (the interleaved 1F1B schedule)
  Recompute recompute = Recompute::kFull;
  bool sequence_parallel = true;        // with tp > 1
  bool distributed_optimizer = false;   // optimizer state sharded over dp (ZeRO-1)
  // Bytes of a gradient element, held and all-reduced: 4 with fp32 main gradients (bf16 training,
  // Megatron since 2022), 2 with fp16 gradients reduced as they are (fp16 training, Megatron 2021).
  int grad_bytes = 4;
  // Expert parallelism (a mixture of experts; 1 for a dense model): Megatron-Core's MoE layout,
  // its attention TP x DP as a dense model's and its experts EP x EDP over the same tp x dp GPUs
  // of a stage (expert tensor parallelism 1, EDP = tp dp / ep): each GPU holds experts / ep whole
  // experts, tokens travel to them and back by all-to-all, their gradients reduce over EDP.
  int ep = 1;
  // DeepEP's dispatch (Megatron-Core's flex dispatcher): a token crosses the network once to each
  // node holding one of its experts, then spreads over NVLink; else a plain all-to-all sends one
  // copy per chosen expert.
  bool dispatch_per_node = false;
  // Megatron's --account-for-embedding-in-pipeline-split and --account-for-loss-in-pipeline-split:
  // the embedding and the head take a layer's slot each, so layers + 2 split into the stages.
  bool embedding_and_loss_as_layers = false;
  std::string describe() const;
};

struct ThreeDEstimate {
  ThreeDConfig config;
  // Bytes on the fullest GPU (the first or the last pipeline stage).
  double weights = 0, gradients = 0, optimizer = 0, activations = 0;
  double memory() const { return weights + gradients + optimizer + activations; }
  double capacity = 0;  // what the GPU offers (memory - reserved)
  bool fits() const { return memory() <= capacity; }
  // Seconds of one step, by part: the pipeline's busy time (compute and tensor-parallel
  // communication of every micro-batch on the slowest stage), its bubble, point-to-point
  // transfers, the data-parallel gradient reduction, the optimizer step.
  double compute = 0, tp_comm = 0, bubble = 0, pp_comm = 0, dp_comm = 0, optimizer_step = 0;
  double ep_comm = 0;  // a mixture of experts' all-to-alls (dispatch and combine), not overlapped
  double step = 0;
  double micro_batches = 0;  // per pipeline
  std::string bottleneck;
};

ThreeDEstimate estimate_3d(const Workload& w, const Cluster& c, const ThreeDConfig& cfg);

// The fastest configuration on all of the cluster's GPUs that fits: tp up to a node's GPUs,
// every pp dividing the layers, micro-batches 1-8, interleaving, recompute none / selective /
// full, with and without the distributed optimizer; for a mixture of experts every power-of-two
// ep dividing the experts and tp x dp.
struct ThreeDSearch {
  int max_tp = 1 << 30, max_pp = 1 << 30;
  bool sharded_optimizer = true;
  std::vector<Recompute> recompute = {Recompute::kNone, Recompute::kSelective, Recompute::kFull};
};
std::optional<ThreeDEstimate> best_3d(const Workload& w, const Cluster& c, const ThreeDSearch& limits = {});

// FLOPs of one step as Megatron counts them (Narayanan et al., eq. 3): 96 B s l h^2 (1 + s/6h +
// V/16lh) with full recompute, 72 B s l h^2 (1 + s/6h + V/12lh) without (GPT shapes: MLP 4h).
double megatron_flops(const Workload& w, bool full_recompute);

}  // namespace strata::planner
