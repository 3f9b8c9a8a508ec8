#include "strata/planner/compare.h"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cmath>
#include <functional>
#include <cstdio>
#include <sstream>
#include <stdexcept>

#include "strata/engine/placement.h"

namespace strata::planner {

using engine::Placement;
using json = nlohmann::json;

namespace {

std::string gb(double bytes) {
  char b[32];
  std::snprintf(b, sizeof b, "%.1f GB", bytes / 1e9);
  return b;
}
std::string num(double v, const char* fmt = "%.3f") {
  char b[32];
  std::snprintf(b, sizeof b, fmt, v);
  return b;
}

}  // namespace

StrataEstimate estimate_strata_as_given(const engine::EngineConfig& cfg, const models::ModelConfig& model,
                                        const Cluster& c) {
  StrataEstimate e;
  e.config = cfg;
  e.config.local_ranks = c.node.gpus;
  const int world = c.gpus();
  check_cluster(c);
  e.device_capacity = c.node.gpu.memory - c.node.gpu.reserved;
  const engine::MachineShare share{uint64_t(e.device_capacity), uint64_t(c.node.host_memory),
                                   uint64_t(c.node.nvme_capacity * c.node.nvme_drives), c.node.gpus};
  e.state = engine::predict_state(e.config, model, world, share);
  e.host_capacity = double(e.state.budgets.host);
  e.nvme_capacity = double(e.state.budgets.nvme);
  if (e.state.fits) {
    // The engine keeps checkpoints in what RAM its state leaves (or, with no swap directory, in
    // RAM whatever their size): that must exist. A capacity check, not a placement rule.
    const double host = double(e.state.host_state) +
                        (e.state.choice.activations == Placement::kHost ? double(e.state.checkpoint_bytes) : 0);
    const double ram_share = c.node.host_memory / c.node.gpus;
    if (host > ram_share) {
      e.state.fits = false;
      e.state.error = "host RAM: " + gb(host) + " of state and activation checkpoints a rank, over its share of " +
                      gb(ram_share);
    }
  }
  e.time = strata_step_time(e.state, e.config, model, c, world, c.node.gpus);
  return e;
}

engine::EngineConfig strata_config(const Workload& w, const Cluster& c, const engine::EngineConfig& base,
                                   bool use_nvme) {
  engine::EngineConfig cfg = base;
  const int world = c.gpus();
  const int64_t per_rank = int64_t(cfg.micro_batch) * world;
  if (w.global_batch < per_rank || w.global_batch % per_rank)
    throw std::invalid_argument("Strata: a global batch of " + std::to_string(w.global_batch) +
                                " sequences does not split into micro-batches of " + std::to_string(cfg.micro_batch) +
                                " on " + std::to_string(world) + " ranks");
  cfg.grad_accum = w.global_batch / per_rank;
  cfg.seq_len = w.seq_len;
  cfg.params = cfg.grads = cfg.master = cfg.moments = Placement::kAuto;
  cfg.activations = Placement::kAuto;
  cfg.recompute_blocks = engine::EngineConfig::kRecomputeAuto;
  cfg.head_tiles = engine::EngineConfig::kTilesAuto;
  cfg.prefetch_auto = true;
  cfg.prefetch = 1;
  cfg.host_budget = cfg.nvme_budget = 0;
  cfg.nvme_dirs.clear();
  if (use_nvme && c.node.nvme_drives > 0) cfg.nvme_dirs.push_back("/planned/nvme");  // only its presence counts
  return cfg;
}

StrataEstimate estimate_strata(const Workload& w, const Cluster& c, const engine::EngineConfig& base, bool use_nvme) {
  return estimate_strata_as_given(strata_config(w, c, base, use_nvme), w.model, c);
}

Comparison compare(const Workload& w, const Cluster& c, const engine::EngineConfig& base, bool search_micro_batch) {
  Comparison cmp{w, c, estimate_strata(w, c, base), best_3d(w, c)};
  if (search_micro_batch) {
    const int64_t share = w.global_batch / c.gpus();
    for (int64_t mb = 1; mb <= share; mb *= 2) {
      if (share % mb || w.global_batch % c.gpus()) continue;
      engine::EngineConfig b = base;
      b.micro_batch = mb;
      const StrataEstimate e = estimate_strata(w, c, b);
      if (e.fits() && (!cmp.strata.fits() || e.time.step < cmp.strata.time.step)) cmp.strata = e;
    }
  }
  return cmp;
}

namespace {

std::string three_d_absent(const Workload&) { return "nothing fits"; }

}  // namespace

std::string comparison_table(const Comparison& cmp) {
  const Workload& w = cmp.workload;
  const Cluster& c = cmp.cluster;
  std::ostringstream o;
  o << "strata plan: " << w.model.name << " (" << num(double(w.model.parameters()) / 1e9, "%.2f") << "B parameters, "
    << (w.model.moe.enabled() ? num(double(w.model.active_parameters()) / 1e9, "%.2f") + "B active, " : "")
    << w.model.layers << " x " << w.model.hidden << "), " << w.global_batch << " x " << w.seq_len
    << " tokens a step, on " << c.nodes << " x " << c.name << " (" << c.gpus() << " " << c.node.gpu.name << ")\n\n";
  const StrataEstimate& s = cmp.strata;
  const double tokens = double(w.global_batch) * double(w.seq_len);
  o << "| | Strata (ZeRO-3 + offload) | 3D parallelism |\n|---|---|---|\n";
  const auto* d = cmp.three_d ? &*cmp.three_d : nullptr;
  o << "| configuration | " << c.gpus() << " ranks, micro-batch " << s.config.micro_batch << " x "
    << s.config.grad_accum << "; " << (s.fits() ? s.state.report : "does not fit") << "; recompute "
    << s.state.tiles.whole_blocks(s.state.choice.recomputed) << " of " << w.model.layers << " blocks, checkpoints "
    << engine::to_string(s.state.choice.activations) << " | " << (d ? d->config.describe() : three_d_absent(w)) << " |\n";
  o << "| GPU memory per GPU | " << gb(double(s.state.device_bytes())) << " of " << gb(s.device_capacity) << " | "
    << (d ? gb(d->memory()) + " of " + gb(d->capacity) + " (weights " + gb(d->weights) + ", gradients " +
                gb(d->gradients) + ", optimizer " + gb(d->optimizer) + ", activations " + gb(d->activations) + ")"
          : "-")
    << " |\n";
  o << "| host RAM per GPU | " << gb(double(s.state.host_state)) << " of " << gb(s.host_capacity) << " | 0 |\n";
  o << "| NVMe per GPU | " << gb(double(s.state.nvme_state)) << " of " << gb(s.nvme_capacity) << " | 0 |\n";
  o << "| fits | " << (s.fits() ? "yes" : "no: " + s.state.error) << " | " << (d ? "yes" : w.model.moe.enabled() ? "-" : "no") << " |\n";
  if (s.fits() || d) {
    o << "| step time | " << (s.fits() ? num(s.time.step) + " s" : "-") << " | " << (d ? num(d->step) + " s" : "-")
      << " |\n";
    o << "| tokens/s | " << (s.fits() ? num(tokens / s.time.step, "%.0f") : "-") << " | "
      << (d ? num(tokens / d->step, "%.0f") : "-") << " |\n";
    o << "| model TFLOPS per GPU | " << (s.fits() ? num(s.time.flops / s.time.step / 1e12, "%.1f") : "-") << " | "
      << (d ? num(megatron_flops(w, false) / d->step / c.gpus() / 1e12, "%.1f") : "-") << " |\n";
    o << "| bottleneck | " << (s.fits() ? s.time.bottleneck + " (bound " + num(s.time.bound) + " s, step at " +
                                              num(100 * s.time.bound / s.time.step, "%.0f") + "% of it)"
                                        : "-")
      << " | " << (d ? d->bottleneck : "-") << " |\n";
  }
  if (s.fits()) {
    const StrataTime& t = s.time;
    o << "\nStrata per step and rank: compute " << num(t.compute) << " s, network " << num(t.network) << " s ("
      << gb(t.gathered) << " gathered, " << gb(t.reduced) << " reduced), PCIe up " << num(t.pcie_up) << " s ("
      << gb(t.up) << "), down " << num(t.pcie_down) << " s (" << gb(t.down) << "), NVMe " << num(t.nvme) << " s ("
      << gb(t.nvme_read) << " read, " << gb(t.nvme_written) << " written), CPU optimizer " << num(t.cpu_optimizer)
      << " s, device optimizer " << num(t.device_optimizer) << " s\n";
  }
  if (d)
    o << "3D per step: compute " << num(d->compute) << " s, tensor-parallel " << num(d->tp_comm) << " s, bubble "
      << num(d->bubble) << " s, pipeline transfers " << num(d->pp_comm) << " s, data-parallel reduction "
      << num(d->dp_comm) << " s, optimizer " << num(d->optimizer_step) << " s (" << num(d->micro_batches, "%.0f")
      << " micro-batches a pipeline)\n";
  return o.str();
}

std::string comparison_json(const Comparison& cmp) {
  const StrataEstimate& s = cmp.strata;
  json strata = {{"fits", s.fits()},
                 {"error", s.state.error},
                 {"placement", s.state.report},
                 {"micro_batch", s.config.micro_batch},
                 {"grad_accum", s.config.grad_accum},
                 {"recomputed_blocks", s.state.tiles.whole_blocks(s.state.choice.recomputed)},
                 {"checkpoints", engine::to_string(s.state.choice.activations)},
                 {"head_tiles", s.state.head_tiles},
                 {"attention_tiles", s.state.tiles.attention},
                 {"mlp_tiles", s.state.tiles.mlp},
                 {"vocab_tiles", s.state.tiles.vocab},
                 {"mlp_token_chunk", s.state.mlp_token_chunk},
                 {"device_bytes", s.state.device_bytes()},
                 {"host_bytes", s.state.host_state},
                 {"nvme_bytes", s.state.nvme_state},
                 {"step_s", s.time.step},
                 {"bound_s", s.time.bound},
                 {"bottleneck", s.time.bottleneck},
                 {"model_tflops_per_gpu", s.time.flops / s.time.step / 1e12},
                 {"seconds", {{"compute", s.time.compute}, {"network", s.time.network}, {"pcie_up", s.time.pcie_up},
                              {"pcie_down", s.time.pcie_down}, {"nvme", s.time.nvme},
                              {"cpu_optimizer", s.time.cpu_optimizer}, {"device_optimizer", s.time.device_optimizer}}}};
  json three_d = nullptr;
  if (cmp.three_d) {
    const ThreeDEstimate& d = *cmp.three_d;
    three_d = {{"config", d.config.describe()},
               {"tp", d.config.tp},
               {"pp", d.config.pp},
               {"dp", d.config.dp},
               {"micro_batch", d.config.micro_batch},
               {"interleave", d.config.interleave},
               {"recompute", to_string(d.config.recompute)},
               {"distributed_optimizer", d.config.distributed_optimizer},
               {"memory_bytes", d.memory()},
               {"step_s", d.step},
               {"bottleneck", d.bottleneck},
               {"model_tflops_per_gpu", megatron_flops(cmp.workload, false) / d.step / cmp.cluster.gpus() / 1e12}};
  }
  return json{{"model", cmp.workload.model.name},
              {"parameters", cmp.workload.model.parameters()},
              {"active_parameters", cmp.workload.model.active_parameters()},
              {"cluster", cmp.cluster.name},
              {"gpus", cmp.cluster.gpus()},
              {"strata", strata},
              {"three_d", three_d}}
      .dump();
}

models::ModelConfig gpt_model(int64_t hidden, int64_t layers, int64_t heads, int64_t vocab, int64_t positions) {
  models::ModelConfig m = models::preset("gpt2");
  m.hidden = hidden;
  m.layers = layers;
  m.heads = m.kv_heads = heads;
  m.head_dim = hidden / heads;
  m.intermediate = 4 * hidden;
  m.vocab_size = vocab;
  m.max_positions = positions;
  m.tie_embeddings = true;
  m.name = "gpt-" + num(double(m.parameters()) / 1e9, "%.1f") + "b";
  return m;
}

models::ModelConfig family_model(int64_t hidden) {
  return gpt_model(hidden, std::max<int64_t>(4, (hidden / 200 + 3) / 4 * 4), std::max<int64_t>(1, hidden / 128));
}

std::vector<Largest> largest_models(const Workload& w, const Cluster& c, const engine::EngineConfig& base) {
  // Hidden sizes from 1024 up, about 10% apart, in multiples of 128.
  std::vector<int64_t> ladder;
  for (double h = 1024; h <= 262144; h *= 1.1) ladder.push_back(int64_t(std::lround(h / 128)) * 128);
  ladder.erase(std::unique(ladder.begin(), ladder.end()), ladder.end());
  std::vector<Largest> out;
  // `fits` gives the configuration that fits, or none and why not.
  using Verdict = std::pair<std::optional<std::string>, std::string>;
  const auto walk = [&](const std::string& system, const std::function<Verdict(const Workload&)>& fits) {
    Largest best{system, std::nullopt, 0, "", ""};
    int misses = 0;
    for (int64_t h : ladder) {
      Workload x = w;
      x.model = family_model(h);
      if (x.seq_len > x.model.max_positions) x.model.max_positions = x.seq_len;
      const Verdict v = fits(x);
      if (v.first) {
        best.model = x.model;
        best.parameters = double(x.model.parameters());
        best.how = *v.first;
        best.limit.clear();
        misses = 0;
      } else {
        if (best.limit.empty()) best.limit = x.model.name + ": " + v.second;
        if (best.model && ++misses >= 3) break;  // three sizes in a row do not fit: the largest is behind us
      }
    }
    out.push_back(best);
  };
  const auto three_d = [&](const ThreeDSearch& limits) {
    return [&, limits](const Workload& x) -> Verdict {
      const auto e = best_3d(x, c, limits);
      if (!e) return {std::nullopt, "no configuration fits the GPUs' memory"};
      return {e->config.describe(), ""};
    };
  };
  ThreeDSearch dp_only;
  dp_only.max_tp = dp_only.max_pp = 1;
  dp_only.sharded_optimizer = false;
  walk("data parallel", three_d(dp_only));
  walk("3D parallelism", three_d(ThreeDSearch{}));
  const auto strata = [&](bool nvme) {
    return [&, nvme](const Workload& x) -> Verdict {
      const StrataEstimate e = estimate_strata(x, c, base, nvme);
      if (!e.fits()) return {std::nullopt, e.state.error};
      return {e.state.report, ""};
    };
  };
  walk("Strata, state in GPU and host memory", strata(false));
  if (c.node.nvme_drives > 0) {
    walk("Strata, with NVMe", strata(true));
    // The state capacity: the GPU holds the working set and nothing else, whatever its size.
    walk("Strata, with NVMe: state capacity alone", [&](const Workload& x) -> Verdict {
      Cluster roomy = c;
      roomy.node.gpu.memory = double(UINT64_MAX / 4);
      roomy.node.gpu.reserved = 0;
      engine::EngineConfig off = strata_config(x, c, base, true);
      off.params = off.grads = off.master = off.moments = engine::Placement::kHost;
      off.activations = engine::Placement::kHost;
      off.recompute_blocks = engine::EngineConfig::kRecomputeAll;  // the leanest working set
      off.prefetch_auto = false;
      off.prefetch = 1;
      off.host_budget = off.nvme_budget = uint64_t(1) << 62;
      const StrataEstimate ws = estimate_strata_as_given(off, x.model, roomy);
      roomy.node.gpu.memory = double(ws.state.working_set);
      const StrataEstimate e = estimate_strata(x, roomy, base, true);
      if (!e.fits()) return {std::nullopt, e.state.error};
      return {e.state.report + " (a GPU of " + gb(double(ws.state.working_set)) + " for the working set)", ""};
    });
  }
  return out;
}

}  // namespace strata::planner
