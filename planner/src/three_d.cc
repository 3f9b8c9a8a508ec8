#include "strata/planner/three_d.h"

#include <algorithm>
#include <cmath>
#include <stdexcept>

#include "strata/planner/compute.h"

namespace strata::planner {

const char* to_string(Recompute r) {
  return r == Recompute::kNone ? "none" : r == Recompute::kSelective ? "selective" : "full";
}

std::string ThreeDConfig::describe() const {
  std::string s = "TP " + std::to_string(tp) + " x PP " + std::to_string(pp) + " x DP " + std::to_string(dp) +
                  (ep > 1 ? " (EP " + std::to_string(ep) + ")" : "") + ", micro-batch " + std::to_string(micro_batch);
  if (interleave > 1) s += ", " + std::to_string(interleave) + " chunks a GPU";
  s += std::string(", recompute ") + planner::to_string(recompute);
  if (tp > 1 && sequence_parallel) s += ", sequence parallel";
  if (distributed_optimizer) s += ", distributed optimizer";
  return s;
}

double megatron_flops(const Workload& w, bool full) {
  const double B = double(w.global_batch), s = double(w.seq_len), l = double(w.model.layers),
               h = double(w.model.hidden), V = double(w.model.vocab_size);
  return full ? 96 * B * s * l * h * h * (1 + s / (6 * h) + V / (16 * l * h))
              : 72 * B * s * l * h * h * (1 + s / (6 * h) + V / (12 * l * h));
}

namespace {

// A ring collective's time: `factor` x bytes over the link, plus a latency a step.
double ring(double bytes, int ways, double bandwidth, double latency, double factor) {
  if (ways <= 1) return 0;
  return factor * (ways - 1) / ways * bytes / bandwidth + 2 * (ways - 1) * latency;
}

}  // namespace

ThreeDEstimate estimate_3d(const Workload& w, const Cluster& c, const ThreeDConfig& k) {
  check_cluster(c);
  const models::ModelConfig& m = w.model;
  const int gpus_per_node = c.node.gpus;
  if (k.tp < 1 || k.pp < 1 || k.dp < 1 || k.ep < 1 || k.micro_batch < 1 || k.interleave < 1)
    throw std::invalid_argument("3D: every degree must be >= 1");
  if (int64_t(k.tp) * k.pp * k.dp != c.gpus())
    throw std::invalid_argument("3D: " + k.describe() + " does not use the cluster's " + std::to_string(c.gpus()) +
                                " GPUs");
  if (!m.moe.enabled() && k.ep != 1) throw std::invalid_argument("3D: expert parallelism needs a mixture of experts");
  if (m.moe.enabled() && (m.moe.experts % k.ep != 0 || (int64_t(k.tp) * k.dp) % k.ep != 0))
    throw std::invalid_argument("3D: EP " + std::to_string(k.ep) + " divides neither the " +
                                std::to_string(m.moe.experts) + " experts and TP x DP " + std::to_string(k.tp * k.dp));
  // A stage's layer slots; with the embedding and the loss as layers the first and the last stage
  // hold one layer fewer.
  const int64_t slots = m.layers + (k.embedding_and_loss_as_layers ? 2 : 0);
  if (slots % (int64_t(k.pp) * k.interleave) != 0)
    throw std::invalid_argument("3D: " + std::to_string(slots) + " layers" +
                                (k.embedding_and_loss_as_layers ? " (the embedding and the loss counted)" : "") +
                                " do not split into " + std::to_string(k.pp * k.interleave) + " chunks");
  if (w.global_batch % (int64_t(k.dp) * k.micro_batch) != 0)
    throw std::invalid_argument("3D: a batch of " + std::to_string(w.global_batch) + " does not split into " +
                                std::to_string(k.dp) + " x micro-batches of " + std::to_string(k.micro_batch));
  ThreeDEstimate e;
  e.config = k;
  const double t = k.tp, p = k.pp, d = k.dp, b = k.micro_batch, s = double(w.seq_len), h = double(m.hidden),
               V = double(m.vocab_size), L = double(m.layers);
  const double mb = double(w.global_batch) / (d * b);  // micro-batches per pipeline
  e.micro_batches = mb;
  const bool sp = k.sequence_parallel && k.tp > 1;

  // --- memory on the first and the last stage --------------------------------------------------
  // A block's parameters on a GPU: the experts' (ep ways, whole) apart from the rest (tp ways).
  const double experts = m.moe.enabled() ? 3.0 * h * double(m.moe.intermediate) * double(m.moe.experts) : 0;
  const double block = (double(m.block_parameters()) - experts) / t, expert_block = experts / k.ep;
  const double layers_per_stage = double(slots) / p;
  const double edge_layers = layers_per_stage - (k.embedding_and_loss_as_layers ? 1 : 0);  // first, last stage
  const double embedding = V * h / t + (m.arch == models::Arch::kGpt2 ? double(m.max_positions) * h : 0);
  struct Held {
    double dense = 0, experts = 0;
    double all() const { return dense + experts; }
  };
  const Held first_params{edge_layers * block + embedding, edge_layers * expert_block};
  const Held last_params{edge_layers * block + V * h / t + 2 * h, edge_layers * expert_block};  // the head's copy
  const Held middle_params{layers_per_stage * block, layers_per_stage * expert_block};
  // Per parameter: 16-bit weights, fp32 gradients (main_grad), fp32 master and two moments, the
  // last three sharded over DP (the experts' over EDP) with the distributed optimizer.
  const double edp = t * d / k.ep;
  const double opt_dense = k.distributed_optimizer ? 12 / d : 12, opt_experts = k.distributed_optimizer ? 12 / edp : 12;
  const auto optimizer_bytes = [&](const Held& x) { return opt_dense * x.dense + opt_experts * x.experts; };
  // Activations of one layer and micro-batch (Korthikanti et al., table 2; compute.h).
  const double sbh = s * b * h;
  ShardOf shard;
  shard.tp = k.tp;
  shard.sequence_parallel = sp;
  shard.flash_attention = w.flash_attention;
  ShardOf no_scores = shard;
  no_scores.flash_attention = true;  // selective recompute keeps no scores either
  const double full_layer = sbh * activation_bytes_per_token_hidden(m, w.seq_len, shard);
  double per_layer = full_layer;
  if (k.recompute == Recompute::kSelective) per_layer = sbh * activation_bytes_per_token_hidden(m, w.seq_len, no_scores);
  if (k.recompute == Recompute::kFull) per_layer = 2 * sbh / (sp ? t : 1);
  // 1F1B: the first stage holds min(p, m) micro-batches of its layers, interleaving (1 + (p-1)/pv)
  // times the model's layers' worth; full recompute rebuilds one layer's activations at a time.
  const double in_flight = std::min(p, mb);
  double first_act = per_layer * edge_layers * in_flight;
  if (k.interleave > 1) first_act = per_layer * L * (1 + (p - 1) / (p * k.interleave)) * std::min(1.0, mb / p);
  const double logits = 8 * s * b * V / t;  // fp32 logits and their gradient
  double last_act = per_layer * edge_layers + logits;  // one micro-batch in flight
  if (k.recompute == Recompute::kFull) {
    first_act += full_layer;
    last_act += full_layer;
  }
  const auto stage_bytes = [&](const Held& x, double act) {
    return x.all() * (2 + k.grad_bytes) + optimizer_bytes(x) + act;
  };
  Held params;
  double activations;
  if (k.pp == 1) {  // one stage: the embedding, every block and the head (tied: no second copy)
    params = first_params;
    params.dense += 2 * h;
    activations = first_act + logits;
  } else {
    const bool first_fuller = stage_bytes(first_params, first_act) >= stage_bytes(last_params, last_act);
    params = first_fuller ? first_params : last_params;
    activations = first_fuller ? first_act : last_act;
    // The second stage holds a middle stage's layers and nearly as many micro-batches in flight.
    const double second_act = per_layer * layers_per_stage * std::max(1.0, in_flight - 1);
    if (k.embedding_and_loss_as_layers && k.pp > 2 && k.interleave == 1 &&
        stage_bytes(middle_params, second_act) > stage_bytes(params, activations)) {
      params = middle_params;
      activations = second_act;
    }
  }
  e.weights = 2 * params.all();
  e.gradients = double(k.grad_bytes) * params.all();
  e.optimizer = optimizer_bytes(params);
  e.activations = activations;
  e.capacity = c.node.gpu.memory - c.node.gpu.reserved;

  // --- time --------------------------------------------------------------------------------------
  const GpuSpec& gpu = c.node.gpu;
  shard.ep = k.ep;
  const Work fwd = block_forward(m, b, w.seq_len, shard);
  const double layer_fwd = seconds(fwd, gpu);
  double recompute = 0;
  if (k.recompute == Recompute::kFull) recompute = layer_fwd;
  if (k.recompute == Recompute::kSelective) {
    Work scores_only;  // the attention's products and its score traffic again
    scores_only.attention_flops = fwd.attention_flops;
    scores_only.attention_product = fwd.attention_product;
    // The scores' traffic: what the layer's activations hold beyond a fused attention's, twice.
    scores_only.memory_bytes = 2 * (full_layer - sbh * activation_bytes_per_token_hidden(m, w.seq_len, no_scores));
    recompute = seconds(scores_only, gpu);
  }
  const double head = 3 * seconds(head_forward(m, b, w.seq_len, shard), gpu);
  // Tensor parallelism: a ring all-reduce (or reduce-scatter + all-gather) of s b h 16-bit values.
  const bool tp_in_node = k.tp <= gpus_per_node;
  const double tp_bw = tp_in_node ? c.node.intra_bandwidth : c.node.inter_bandwidth / gpus_per_node;
  const double tp_lat = tp_in_node ? c.node.intra_latency : c.node.inter_latency;
  // Collectives a layer and micro-batch: two in its forward, two in its backward, two more in a
  // full recompute; the same count for tensor parallelism's all-reduces and experts' all-to-alls.
  const double layer_collectives = k.recompute == Recompute::kFull ? 6 : 4;
  const double tp_layer = layer_collectives * ring(2 * sbh, k.tp, tp_bw, tp_lat, 2);
  // A mixture of experts: each layer's tokens (this GPU's share of the sequence) travel to their
  // top_k experts and back (dispatch and combine, 16-bit), in the forward, the backward and a full
  // recompute; the EP group's ranks are consecutive (tensor-parallel first), so a share of each
  // all-to-all stays on the node and the rest crosses the network at a GPU's share of the node's
  // bandwidth, both at once.
  double ep_layer = 0;
  if (k.ep > 1) {
    const double topk = double(m.moe.top_k), token = h * 2, tokens = b * s / t;
    const double here = std::min(k.ep, gpus_per_node), away = k.ep - here;
    double crossing = tokens * topk * away / k.ep * token;  // one copy per expert on another node
    if (k.dispatch_per_node && away > 0) {  // one per other node among the choices (even spread)
      const double nodes = double(k.ep) / here;
      crossing = tokens * (nodes - 1) * (1 - std::pow(1 - 1 / nodes, topk)) * token;
    }
    const double a2a = std::max(tokens * topk * (here - 1) / k.ep * token / c.node.intra_bandwidth,
                                crossing / (c.node.inter_bandwidth / gpus_per_node)) +
                       (away > 0 ? c.node.inter_latency : c.node.intra_latency);
    ep_layer = layer_collectives * a2a;
  }
  // The slowest stage: the last (its layers and the head), or with the embedding and the loss as
  // layers a middle one (a layer more, no head).
  const double layer_time = 3 * layer_fwd + recompute;
  const double layers_slowest =
      k.embedding_and_loss_as_layers && (layers_per_stage * layer_time > edge_layers * layer_time + head)
          ? layers_per_stage
          : edge_layers;
  const double stage_compute = layers_slowest * layer_time + (layers_slowest == edge_layers ? head : 0);
  const double stage_tp = layers_slowest * tp_layer, stage_ep = layers_slowest * ep_layer;
  e.compute = mb * stage_compute;
  e.tp_comm = mb * stage_tp;
  e.ep_comm = mb * stage_ep;
  e.bubble = (p - 1) / k.interleave * (stage_compute + stage_tp + stage_ep);
  // Pipeline point-to-point: each micro-batch's activations forward and gradients back, once per
  // model chunk, over the network when the stages are on different nodes.
  // Megatron orders ranks tensor-parallel first, then data-parallel, then pipeline stages.
  if (k.pp > 1) {
    const bool across = int64_t(k.tp) * k.dp >= gpus_per_node;
    const double bw = across ? c.node.inter_bandwidth / gpus_per_node : c.node.intra_bandwidth;
    const double lat = across ? c.node.inter_latency : c.node.intra_latency;
    const double bytes = 2 * sbh / t;  // split over the tensor-parallel ranks (scatter-gather)
    e.pp_comm = mb * 2 * k.interleave * (bytes / bw + lat);
  }
  // Data parallelism: gradients all-reduced (or reduce-scattered, with 16-bit weights
  // all-gathered after the sharded update), after the last backward, over the network when the
  // data-parallel ranks span nodes.
  if (k.dp > 1) {
    const bool across = int64_t(k.tp) * k.dp > gpus_per_node;
    const double bw = across ? c.node.inter_bandwidth / gpus_per_node : c.node.intra_bandwidth;
    const double lat = across ? c.node.inter_latency : c.node.intra_latency;
    // The experts' gradients over their own data-parallel group (EDP).
    const auto reduce = [&](double n, int ways) {
      const double grads = double(k.grad_bytes) * n;
      return k.distributed_optimizer ? ring(grads, ways, bw, lat, 1) + ring(2 * n, ways, bw, lat, 1)
                                     : ring(grads, ways, bw, lat, 2);
    };
    e.dp_comm = reduce(params.dense, k.dp) + (params.experts > 0 ? reduce(params.experts, int(edp)) : 0);
  }
  // Adam on the GPU: about 32 bytes of traffic a parameter (read p, m, v, g; write p, m, v, and
  // the 16-bit copy).
  e.optimizer_step = 32 * optimizer_bytes(params) / 12 / gpu.memory_bandwidth;
  e.step = e.compute + e.tp_comm + e.ep_comm + e.bubble + e.pp_comm + e.dp_comm + e.optimizer_step;
  const std::pair<double, const char*> parts[] = {{e.compute, "compute"},
                                                  {e.tp_comm, "tensor-parallel communication"},
                                                  {e.ep_comm, "expert all-to-all"},
                                                  {e.bubble, "pipeline bubble"},
                                                  {e.pp_comm, "pipeline transfers"},
                                                  {e.dp_comm, "data-parallel gradient reduction"},
                                                  {e.optimizer_step, "optimizer"}};
  e.bottleneck = std::max_element(std::begin(parts), std::end(parts))->second;
  return e;
}

std::optional<ThreeDEstimate> best_3d(const Workload& w, const Cluster& c, const ThreeDSearch& limits) {
  std::optional<ThreeDEstimate> best;
  const int n = c.gpus();
  const bool moe = w.model.moe.enabled();
  for (int tp = 1; tp <= c.node.gpus && tp <= n && tp <= limits.max_tp; tp *= 2) {
    if (n % tp || w.model.heads % tp) continue;
    for (int pp = 1; pp <= n / tp && pp <= limits.max_pp; ++pp) {
      if ((n / tp) % pp) continue;
      // A mixture of experts' stages may also count the embedding and the loss as layers
      // (Megatron-Core's MoE recipes: 94 layers + 2 in 8 stages).
      for (bool as_layers : {false, true}) {
        const int64_t slots = w.model.layers + (as_layers ? 2 : 0);
        if ((as_layers && (!moe || pp == 1)) || slots % pp) continue;
        const int dp = n / (tp * pp);
        for (int ep = 1; ep <= (moe ? tp * dp : 1); ep *= 2) {
          if (moe && (w.model.moe.experts % ep || (tp * dp) % ep)) continue;
          for (int b : {1, 2, 4, 8}) {
            if (w.global_batch % (int64_t(dp) * b)) continue;
            const int64_t mb = w.global_batch / (int64_t(dp) * b);
            for (int v = 1; v <= 8; ++v) {
              if (v > 1 && (pp == 1 || mb % pp || (slots / pp) % v)) continue;
              for (Recompute r : limits.recompute)
                for (bool zero1 : {false, true}) {
                  if (zero1 && (dp == 1 || !limits.sharded_optimizer)) continue;
                  ThreeDConfig k{tp, pp, dp, b, v, r, true, zero1};
                  k.ep = ep;
                  k.embedding_and_loss_as_layers = as_layers;
                  const ThreeDEstimate e = estimate_3d(w, c, k);
                  if (e.fits() && (!best || e.step < best->step)) best = e;
                }
            }
          }
        }
      }
    }
  }
  return best;
}

}  // namespace strata::planner
