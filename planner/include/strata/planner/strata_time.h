// Strata's step time on a cluster, from what the engine would decide (engine::predict_state: the
// placement by unit, recompute, checkpoints' tier, the head's tiles, prefetch) and the cluster's
// speeds. Per micro-batch, the resources work side by side as the engine's schedule lets them:
// compute on the GPU, the all-gathers and reduce-scatters on the network, parameters and
// checkpoints coming up over PCIe, gradients and checkpoints going down, swap traffic on NVMe.
// With prefetch, a micro-batch takes as long as its busiest resource; without, gathers wait in
// line with compute. The optimizer step (CPU Adam for units off the device, with their swap
// traffic; device Adam for the rest) runs after backward, or overlapped with the next forward or
// with the backward (optimizer.overlap). On the host device (the GPU is this CPU), compute, copies
// and the optimizer share the same cores and memory and add up; only the disk works beside them.
// Equations and blind spots: docs/PLANNER.md.
//
// Pure function; thread-safe.
#pragma once

#include <string>
#include <vector>

#include "strata/engine/config.h"
#include "strata/engine/predict.h"
#include "strata/planner/cluster.h"

namespace strata::planner {

struct StrataTime {
  // Seconds of one step (grad_accum micro-batches and the update) on each resource.
  double compute = 0, network = 0, pcie_up = 0, pcie_down = 0, nvme = 0, cpu_optimizer = 0, device_optimizer = 0;
  // compute, by kind of work: matrix products, fused attention, memory-bound kernels, and the
  // engine's own copies of gathered units and gradients on the device
  double compute_matmul = 0, compute_attention = 0, compute_memory = 0, compute_local = 0;
  double step = 0;
  double bound = 0;          // the busiest resource's total: no schedule does better
  double flops = 0;          // model FLOPs of a step on this rank (3 x forward, no recompute)
  std::string bottleneck;    // the resource with the largest total
  // Bytes a step moves per rank.
  double gathered = 0, reduced = 0, up = 0, down = 0, nvme_read = 0, nvme_written = 0;
};

// `ranks_per_node`: ranks sharing a node's CPU, NVMe drives and network link.
StrataTime strata_step_time(const engine::StatePrediction& p, const engine::EngineConfig& cfg,
                            const models::ModelConfig& m, const Cluster& c, int world_size, int ranks_per_node);

}  // namespace strata::planner
