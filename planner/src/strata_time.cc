#include "strata/planner/strata_time.h"

#include <algorithm>
#include <stdexcept>

#include "strata/engine/layout/resolve.h"
#include "strata/engine/layout/schedule.h"
#include "strata/models/model_shapes.h"
#include "strata/models/quantized_base.h"
#include "strata/models/trainable.h"
#include "strata/planner/compute.h"

namespace strata::planner {

using engine::Placement;

StrataTime strata_step_time(const engine::StatePrediction& p, const engine::EngineConfig& cfg,
                            const models::ModelConfig& m, const Cluster& c, int world, int per_node) {
  StrataTime t;
  const GpuSpec& gpu = c.node.gpu;
  const bool fp32 = cfg.compute == engine::Precision::kFp32;
  const double cb = double(p.compute_bytes), A = double(cfg.grad_accum), w = world;
  // The schedule the engine would run; its block stages are the blocks, or their tiles.
  const size_t vocab_tiles = size_t(p.tiles.vocab);
  const size_t units = p.shard_numel.size();
  // Frozen units (model.trainable, a LoRA run's base): their compute copy alone, no gradient,
  // reduce-scatter or update; their products have no weight gradient in the backward.
  const std::vector<char>& frozen = p.frozen;
  const auto is_frozen = [&](size_t u) { return u < frozen.size() && frozen[u]; };
  const engine::layout::Schedule schedule(p.stage_units, units, vocab_tiles, vocab_tiles, frozen);
  const size_t block_stages = schedule.blocks();
  const double blocks = double(m.layers);
  const double seqs = double(cfg.micro_batch);

  // --- compute of one micro-batch ------------------------------------------------------------
  ShardOf shard;
  shard.activation_bytes = cb;
  shard.mlp_token_chunk = p.mlp_token_chunk;
  // Tiles run the block's and the head's products at their own sizes (compute.h).
  shard.attention_tiles = p.tiles.attention;
  shard.mlp_tiles = p.tiles.mlp;
  shard.logits_token_chunk = double(p.head_logits.token_chunk);
  shard.logits_vocab_tile = double(p.head_logits.vocab_tile);
  const Seconds block_kinds = seconds_by_kind(block_forward(m, seqs, cfg.seq_len, shard), gpu, fp32);
  const Seconds head_kinds = seconds_by_kind(head_forward(m, seqs, cfg.seq_len, shard), gpu, fp32);
  const double block_fwd = block_kinds.total(), head_fwd = head_kinds.total();
  // Block stages with a backward (a frozen prefix has none), and those of them recomputed.
  size_t with_backward = 0, recomputed_stages = 0;
  for (size_t s = schedule.first_block(); s < schedule.first_head(); ++s)
    if (schedule.has_backward(s)) {
      ++with_backward;
      if (s < schedule.first_block() + p.choice.recomputed) ++recomputed_stages;
    }
  const double recomputed = double(recomputed_stages) * blocks / double(std::max<size_t>(1, block_stages));
  const double backward_blocks = double(with_backward) * blocks / double(std::max<size_t>(1, block_stages));
  // MLPs over token chunks: each block's backward runs its MLP's forward again, chunk by chunk.
  const Seconds mlp_again_kinds = p.mlp_token_chunk > 0
                                      ? seconds_by_kind(mlp_forward(m, seqs, cfg.seq_len, shard), gpu, fp32)
                                      : Seconds{};
  // Forward, backward (twice the forward), the recomputed blocks' forward again; the head's
  // forward and backward, plus its logits again in the backward when cut into tiles in two
  // passes (one pass computes each chunk's gradients with its loss).
  // The frozen share of the weights of the block stages with a backward and of the head: that
  // share of their products has no weight gradient (the backward computes input gradients alone).
  // (A frozen unit of 4-bit records, model.quantize, weighs its dequantized weights.)
  const auto weights = [&](size_t u) {
    const uint64_t q = u < p.dequantized.size() ? p.dequantized[u] : 0;
    return double(q > 0 ? q : p.unit_numel[u]);
  };
  const auto frozen_share = [&](bool head_stages) {
    double all = 0, still = 0;
    for (size_t s = 0; s < schedule.num_stages(); ++s)
      if (head_stages ? schedule.is_head(s) : schedule.is_block(s) && schedule.has_backward(s))
        for (size_t u : schedule.units_of(s)) {
          all += weights(u);
          if (is_frozen(u)) still += weights(u);
        }
    return all > 0 ? still / all : 0.0;
  };
  const double blocks_frozen = frozen_share(false), head_frozen = frozen_share(true);
  const double fwd = double(blocks) * block_fwd;
  const bool head_recomputed =
      p.head_logits.recomputes_logits(uint64_t(cfg.micro_batch * cfg.seq_len), uint64_t(m.vocab_size));
  const double head = (head_recomputed ? 4 : 3) * head_fwd - head_frozen * head_kinds.matmul;
  const double bwd = backward_blocks * (2 * block_fwd - blocks_frozen * block_kinds.matmul + mlp_again_kinds.total()) +
                     recomputed * block_fwd;
  // The host device's ranks share one CPU and its memory: each gets its share of both.
  const double share = gpu.is_host ? double(per_node) : 1;
  const double model_mb = (fwd + head + bwd) * share;
  const models::ForwardFlops ff = models::forward_flops_per_token(m, cfg.seq_len);
  // Without a weight gradient a frozen linear's 6 FLOPs a parameter are 4 (the blocks' linear
  // products alone: their FLOPs at seq_len 0).
  const double frozen_flops = blocks_frozen * models::forward_flops_per_token(m, 0).blocks + head_frozen * ff.head;
  t.flops = (3 * ff.total() - frozen_flops) * seqs * double(cfg.seq_len) * A;

  // --- what one micro-batch moves --------------------------------------------------------------
  // Each use of the schedule gathers its stage's units.
  std::vector<double> uses_of(units, 0);
  for (const engine::layout::Use& use : schedule.uses())
    for (size_t u : schedule.units_of(use.stage)) uses_of[u] += 1;
  const auto tier = [&](size_t u, int kind) {  // kind: 0 compute copy, 1 gradient, 2 optimizer group
    if (kind == 0) return p.placement.params;
    return p.placement.unit_tier(kind == 1 ? p.placement.grads : p.placement.master, true, u);
  };
  const double grad_bytes = cfg.reduce == engine::Precision::kBf16 ? 2 : 4;
  double gathered = 0, reduced = 0, up = 0, down = 0, nvme_r = 0, nvme_w = 0;
  for (size_t u = 0; u < units; ++u) {
    const double padded = double(p.padded_numel[u]), shard_n = double(p.shard_numel[u]);
    gathered += uses_of[u] * padded * cb * (w - 1) / w;
    if (tier(u, 0) != Placement::kDevice) up += uses_of[u] * shard_n * cb;  // each gather stages the shard
    if (tier(u, 0) == Placement::kNvme) nvme_r += uses_of[u] * shard_n * cb;
    if (is_frozen(u)) continue;
    reduced += padded * grad_bytes * (w - 1) / w;
    const Placement g = tier(u, 1);
    if (g != Placement::kDevice) down += shard_n * 4;
    if (g == Placement::kNvme && !p.placement.grads_transient) nvme_w += shard_n * 4, nvme_r += shard_n * 4;
  }
  // The engine's own passes over device memory beside the model's kernels, each byte read or
  // written (the dequantization of a 4-bit base's weights among them): on one rank, a gathered unit whose shard is on the device copied into its buffer
  // (the all-gather is that copy; on more, the collective's bytes are counted above); each
  // unit's gradient copied out of autograd's tensor into its fp32 buffer (zeros only where no
  // gradient came; on one rank that buffer is the reduced shard) and, kept on the device, added
  // to its accumulator.
  double local = 0;
  for (size_t u = 0; u < units; ++u) {
    const double padded = double(p.padded_numel[u]), shard_n = double(p.shard_numel[u]);
    if (tier(u, 0) == Placement::kDevice && w == 1) local += uses_of[u] * (shard_n + padded) * cb;
    // A 4-bit base (model.quantize): each gather dequantizes the unit's 4-bit weights, reading
    // their records (codes and absmax, as one record of all its 4-bit elements) and writing the
    // compute dtype.
    if (u < p.dequantized.size() && p.dequantized[u] > 0)
      local += uses_of[u] * (double(p.dequantized[u]) * cb + double(models::quant4_record(p.dequantized[u], m.quantize).bytes()));
    if (is_frozen(u)) continue;
    local += padded * (cb + 4);
    if (tier(u, 1) == Placement::kDevice) local += shard_n * 12;
  }
  // On the host device a copy of n bytes moves 2n (the calibrated copy rate counts n).
  const double local_mb = local / (gpu.is_host ? 2 * c.node.pcie_h2d : gpu.memory_bandwidth) * share;
  const double compute_mb = model_mb + local_mb;
  const double ckpt = double(p.checkpoint_bytes);
  if (p.choice.activations != Placement::kDevice) up += ckpt, down += ckpt;
  if (p.choice.activations == Placement::kNvme) nvme_r += ckpt, nvme_w += ckpt;

  // Per-rank shares of the node's links and drives.
  const double net_bw = world <= 1 ? 0
                        : world <= c.node.gpus ? c.node.intra_bandwidth
                                               : std::min(c.node.intra_bandwidth, c.node.inter_bandwidth / per_node);
  // On the host device, "PCIe" copies are memory copies: calibration measures them there.
  const double h2d = c.node.pcie_h2d / share, d2h = c.node.pcie_d2h / share;
  const double drives = std::max(1, c.node.nvme_drives);
  // Bytes over a link: a link that is needed but has no bandwidth is an error in the cluster
  // description (check_cluster catches the usual ones first).
  const auto safe = [](double bytes, double bw) {
    if (bytes <= 0) return 0.0;
    if (bw <= 0) throw std::invalid_argument("strata plan: traffic over a link the cluster gives no bandwidth");
    return bytes / bw;
  };
  const double net_mb = safe(gathered + reduced, net_bw);
  // On the host device Gloo's collectives cost CPU time: their calibrated share
  // (intra_cpu_share) of their time at the calibrated rate (intra_gbps). The rest of that time,
  // and across nodes the time the link itself takes beyond it, is waiting, which compute
  // overlaps (net_mb bounds the micro-batch instead).
  const double net_cpu_mb =
      world <= 1 ? 0 : safe(gathered + reduced, c.node.intra_bandwidth) * c.node.intra_cpu_share;
  const double up_mb = safe(up, h2d), down_mb = safe(down, d2h);
  const auto disk = [&](double read, double written) { return c.node.disk_seconds(read, written, drives, per_node); };
  const double nvme_mb = disk(nvme_r, nvme_w);

  // A micro-batch: the busiest resource with gathers ahead; without, each gather's transfers
  // wait in line before its compute. The first unit of each micro-batch waits anyway.
  const double first_unit = safe(double(p.shard_numel[0]) * cb, h2d) * (p.placement.params != Placement::kDevice);
  double mb_time;
  // On the host device compute, copies and Gloo's TCP copies take the same cores (they add up);
  // the disk works beside them.
  if (gpu.is_host) mb_time = std::max({compute_mb + net_cpu_mb + up_mb + down_mb, net_mb, nvme_mb});
  else if (cfg.prefetch > 0 || cfg.prefetch_auto) mb_time = std::max({compute_mb, net_mb, up_mb, down_mb, nvme_mb}) + first_unit;
  else mb_time = std::max(compute_mb + net_mb + up_mb + nvme_mb, down_mb);

  // --- the update ------------------------------------------------------------------------------
  double host_elems = 0, device_elems = 0, group_swap = 0, upload = 0, copies_to_swap = 0;
  for (size_t u = 0; u < units; ++u) {
    if (is_frozen(u)) continue;  // never updated
    const double n = double(p.shard_numel[u]);
    const Placement g = tier(u, 2);
    (g == Placement::kDevice ? device_elems : host_elems) += n;
    if (g == Placement::kNvme) group_swap += n;
    if (g != Placement::kDevice && p.placement.params == Placement::kDevice) upload += n * cb;
    if (p.placement.params == Placement::kNvme && g != Placement::kDevice) copies_to_swap += n * cb;  // new compute copies
  }
  const double cpu_rate = c.node.cpu_adam_rate / per_node;
  const double cpu_opt = safe(host_elems, cpu_rate);
  // On the host device the device's Adam is the CPU kernel.
  const double dev_opt = gpu.is_host ? safe(device_elems, cpu_rate) : safe(device_elems * 32, gpu.memory_bandwidth);
  // Master and moments read and written back (12 bytes each way an element).
  const double opt_nvme = disk(group_swap * 12, group_swap * 12 + copies_to_swap);
  const double opt_up = safe(upload, h2d);
  // Overlapped (optimizer.overlap), the update's CPU Adam and swap traffic hide behind the next
  // micro-batch's forward or this one's backward; on the host device only its disk traffic can
  // (the CPU's part takes the cores compute needs).
  const double fwd_mb = mb_time * (fwd / (fwd + head + bwd)), bwd_mb = mb_time * ((bwd + head) / (fwd + head + bwd));
  const double window = cfg.update_overlap == engine::UpdateOverlap::kForward    ? fwd_mb
                        : cfg.update_overlap == engine::UpdateOverlap::kBackward ? bwd_mb
                                                                                 : 0.0;
  double update;
  if (gpu.is_host) {
    const double cpu = cpu_opt + dev_opt + opt_up;
    update = cpu + std::max(0.0, opt_nvme - cpu - window);
  } else {
    const double off_device = std::max({cpu_opt, opt_nvme, opt_up});
    update = off_device - std::min(off_device, window) + dev_opt;
  }
  t.step = A * mb_time + update;

  // --- per resource, for the bound and the bottleneck --------------------------------------------
  t.compute = A * compute_mb;
  // By kind: the same passes (each block 3 + recompute, the head 3 or 4) over each kind's time,
  // less the weight gradients of frozen weights.
  const double block_passes = double(blocks) + 2 * backward_blocks + recomputed, head_passes = head_recomputed ? 4 : 3;
  t.compute_matmul = A * share *
                     ((block_passes - backward_blocks * blocks_frozen) * block_kinds.matmul +
                      backward_blocks * mlp_again_kinds.matmul + (head_passes - head_frozen) * head_kinds.matmul);
  t.compute_attention = A * share * block_passes * block_kinds.attention;
  t.compute_memory = A * share * (block_passes * block_kinds.memory + head_passes * head_kinds.memory);
  t.compute_local = A * local_mb;
  t.network = A * net_mb;
  t.pcie_up = A * up_mb + opt_up;
  t.pcie_down = A * down_mb;
  t.nvme = A * nvme_mb + opt_nvme;
  t.cpu_optimizer = cpu_opt;
  t.device_optimizer = dev_opt;
  t.gathered = A * gathered;
  t.reduced = A * reduced;
  t.up = A * up + upload;
  t.down = A * down;
  t.nvme_read = A * nvme_r + group_swap * 12;
  t.nvme_written = A * nvme_w + group_swap * 12 + copies_to_swap;
  const std::pair<double, const char*> parts[] = {{t.compute + t.device_optimizer, "compute"},
                                                  {t.network, "network"},
                                                  {t.pcie_up, "PCIe up"},
                                                  {t.pcie_down, "PCIe down"},
                                                  {t.nvme, "NVMe"},
                                                  {t.cpu_optimizer, "CPU optimizer"}};
  const auto top = std::max_element(std::begin(parts), std::end(parts));
  t.bound = gpu.is_host ? std::max({t.compute + t.device_optimizer + t.cpu_optimizer + t.pcie_up + t.pcie_down +
                                        A * net_cpu_mb,
                                    t.network, t.nvme})
                        : top->first;
  t.bottleneck = top->second;
  return t;
}

}  // namespace strata::planner
