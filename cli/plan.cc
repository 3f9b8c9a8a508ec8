#include "plan.h"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <fstream>
#include <iostream>
#include <sstream>

#include "args.h"
#include "strata/engine/config.h"
#include "strata/engine/config_parse.h"
#include "strata/models/model_config.h"
#include "strata/planner/compare.h"
#include "calibrate.h"

namespace strata::cli {

namespace {

constexpr const char* kPlanUsage = R"(usage: strata plan --model PRESET|CONFIG.json [options]
       strata plan --calibrate [--output FILE] [--dir DIR] [--device cpu|cuda]

What fits where and how fast: Strata (ZeRO-3 with offload, the engine's own placement) beside
Megatron-style 3D parallelism (the fastest TP x PP x DP configuration that fits), on a cluster.
Equations, sources and blind spots: docs/PLANNER.md.

options:
  --model NAME|FILE    a preset (gpt2 ... gpt-1t, llama-*) or a Hugging Face config.json
  --cluster NAME|FILE  dgx-a100, dgx2-v100, h100-box (default), h200-box or a cluster JSON file
  --nodes N[,N...]     node counts to plan for (default: the cluster file's)
  --seq-len N          tokens a sequence (default 2048)
  --global-batch N     sequences a step (default: 8 per GPU)
  --micro-batch N      Strata's sequences a micro-batch and rank (default: the fastest that
                       fits, powers of two)
  --config FILE        a `strata train` configuration whose precision and overlap modes
                       Strata's side uses (placement and batch come from the plan)
  --as-given           Strata with the --config file exactly as given (its model, placement,
                       batch; no search) on the cluster: the predicted step and per-tier bytes
  --max-model          also the largest model each system trains on the cluster
  --json               one JSON line per node count instead of the table

--calibrate measures this machine (linear layers by size, fused attention and a real block
through libtorch, copies, the CPU Adam kernel, loopback TCP, the disk under --dir through the
I/O engine) and writes a cluster file (--output, default strata-cluster.json) of one node whose
"GPU" is the host device, or with --device cuda GPU 0.
)";

models::ModelConfig model_from(const std::string& s) {
  for (const std::string& n : models::preset_names())
    if (n == s) return models::preset(s);
  if (s.ends_with(".json")) return models::load_hf_config(s);
  std::string names;
  for (const std::string& n : models::preset_names()) names += (names.empty() ? "" : ", ") + n;
  throw std::invalid_argument("--model: '" + s + "' is neither a preset (" + names + ") nor a config.json");
}

std::vector<int> node_counts(const std::string& s) {
  std::vector<int> out;
  std::stringstream in(s);
  std::string part;
  while (std::getline(in, part, ',')) {
    const int n = std::atoi(part.c_str());
    if (n < 1) throw std::invalid_argument("--nodes: '" + part + "' is not a node count >= 1");
    out.push_back(n);
  }
  if (out.empty()) throw std::invalid_argument("--nodes: no node count");
  return out;
}

// `--calibrate`: measures this machine and writes its cluster file.
int calibrate_command(const Args& args) {
  bench::CalibrateOptions o;
  o.output = args.get("output", "strata-cluster.json");
  o.dir = args.get("dir", ".");
  o.device = args.get("device", "cpu");
  const planner::Cluster c = bench::calibrate_this_machine(o);
  std::ofstream f(o.output);
  f << planner::cluster_json(c);
  if (!f.flush()) throw std::runtime_error("cannot write " + o.output);
  std::cout << "wrote " << o.output << "\n";
  return 0;
}

// `--as-given`: Strata's predicted step and per-tier bytes for the --config file as it is; 1
// when it does not fit.
int plan_as_given(const Args& args) {
  if (!args.has("config")) throw std::invalid_argument("--as-given needs --config");
  const engine::TrainConfig tc = engine::load_train_config(args.get("config", ""));
  planner::Cluster c = planner::cluster_from(args.get("cluster", "h100-box"));
  if (args.has("nodes")) c.nodes = node_counts(args.get("nodes", "")).front();
  const planner::StrataEstimate e = planner::estimate_strata_as_given(tc.engine, tc.model, c);
  const planner::StrataTime& t = e.time;
  std::cout << "strata plan --as-given: " << tc.model.name << " on " << c.nodes << " x " << c.name << "\n  "
            << (e.fits() ? e.state.report : "does not fit: " + e.state.error) << "\n";
  if (e.fits())
    std::cout << "  step " << t.step << " s (bound " << t.bound << " s, bottleneck " << t.bottleneck
              << "): compute " << t.compute << " s (matmul " << t.compute_matmul << ", attention "
              << t.compute_attention << ", memory-bound " << t.compute_memory << ", engine copies " << t.compute_local
              << "), network " << t.network
              << " s, PCIe up " << t.pcie_up << " s, down " << t.pcie_down << " s, NVMe " << t.nvme
              << " s, CPU optimizer " << t.cpu_optimizer << " s, device optimizer " << t.device_optimizer
              << " s\n  per rank: device " << e.state.device_bytes() << " B (state " << e.state.device_state
              << ", working set " << e.state.working_set << "), host " << e.state.host_state << " B, NVMe "
              << e.state.nvme_state << " B\n";
  return e.fits() ? 0 : 1;
}

// `--max-model`: the largest model of the family each system trains on `n` nodes of `c`.
void print_largest_models(const planner::Workload& wn, const planner::Cluster& c, const engine::EngineConfig& base,
                          int n, bool as_json) {
  if (!as_json) std::cout << "largest model of the family (GPT, h/200 layers) on " << n << " x " << c.name << ":\n";
  for (const planner::Largest& l : planner::largest_models(wn, c, base)) {
    if (as_json) {
      std::cout << nlohmann::json{{"system", l.system}, {"nodes", n}, {"parameters", l.parameters},
                                  {"configuration", l.how}}.dump()
                << "\n";
    } else {
      std::cout << "  " << l.system << ": ";
      if (!l.model) std::cout << "nothing fits\n";
      else
        std::cout << l.parameters / 1e9 << "B (" << l.model->layers << " x " << l.model->hidden << "): " << l.how
                  << "\n";
    }
  }
  if (!as_json) std::cout << "\n";
}

// The plan proper: Strata beside 3D parallelism for --model on each node count, as a table or
// JSON lines.
int plan_comparison(const Args& args) {
  planner::Workload w;
  w.model = model_from(args.get("model", ""));
  w.seq_len = int64_t(args.count("seq-len", 2048));
  if (w.seq_len > w.model.max_positions) w.model.max_positions = w.seq_len;
  planner::Cluster cluster = planner::cluster_from(args.get("cluster", "h100-box"));
  engine::EngineConfig base;
  base.compute = cluster.node.gpu.is_host ? engine::Precision::kFp32 : engine::Precision::kBf16;
  if (args.has("config")) base = engine::load_train_config(args.get("config", "")).engine;
  base.micro_batch = int64_t(args.count("micro-batch", 1));
  const std::vector<int> nodes = args.has("nodes") ? node_counts(args.get("nodes", "")) : std::vector<int>{cluster.nodes};
  const bool as_json = args.has("json");
  for (int n : nodes) {
    planner::Cluster c = cluster;
    c.nodes = n;
    planner::Workload wn = w;
    wn.global_batch = int64_t(args.count("global-batch", unsigned(8 * c.gpus())));
    const planner::Comparison cmp = planner::compare(wn, c, base, !args.has("micro-batch"));
    if (as_json) std::cout << planner::comparison_json(cmp) << "\n";
    else std::cout << planner::comparison_table(cmp) << "\n";
    if (args.has("max-model")) print_largest_models(wn, c, base, n, as_json);
  }
  return 0;
}

}  // namespace

int plan_command(const std::vector<std::string>& argv) {
  for (const std::string& a : argv)
    if (a == "--help" || a == "-h") {
      std::cout << kPlanUsage;
      return 0;
    }
  const Args args(argv, {"model", "cluster", "nodes", "seq-len", "global-batch", "micro-batch", "config", "output", "dir",
                   "device"},
                  {"max-model", "json", "calibrate", "as-given"});
  if (args.has("calibrate")) return calibrate_command(args);
  if (args.has("as-given")) return plan_as_given(args);
  if (!args.has("model")) {
    std::cerr << kPlanUsage;
    return 2;
  }
  return plan_comparison(args);
}

}  // namespace strata::cli
