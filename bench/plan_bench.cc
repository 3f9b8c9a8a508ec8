#include "plan_bench.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <iostream>
#include <nlohmann/json.hpp>
#include <vector>

#include "calibrate.h"
#include "shell.h"
#include "strata/engine/config.h"
#include "strata/engine/config_parse.h"
#include "strata/planner/compare.h"

namespace strata::bench {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

struct Case {
  std::string name;
  int ranks;
  json model, placement, optimizer;
  int64_t micro_batch, seq_len;
  bool nvme = false;
};

struct Measured {
  double seconds = 0;             // median of the timed steps
  std::vector<double> times;      // the timed steps
  double device_peak = 0, host_state = 0, nvme_state = 0;
};

// `device_budget` 0: none (the engine's default, no limit on the host device).
json config_of(const Case& k, const fs::path& dir, int64_t steps, const std::string& device, uint64_t device_budget = 0) {
  json j = {{"model", k.model},
            {"data", {{"path", "/usr/share/common-licenses"}, {"format", "bytes"}, {"seq_len", k.seq_len}, {"seed", 0}}},
            {"batch", {{"micro_batch", k.micro_batch}, {"grad_accum", 1}}},
            {"optimizer", {{"type", "adamw"}, {"lr", 1e-4}, {"weight_decay", 0.1}, {"clip_grad_norm", 1.0}}},
            {"precision", {{"compute", device == "cuda" ? "bf16" : "fp32"}}},
            {"placement", k.placement},
            {"device", {{"type", device}, {"prefetch", 1}}},
            {"run", {{"steps", steps}, {"progress", false}}}};
  if (device_budget) j["device"]["budget"] = device_budget;
  for (auto& [key, v] : k.optimizer.items()) j["optimizer"][key] = v;
  if (k.nvme) j["offload"] = {{"nvme_dirs", {fs::absolute(dir / ("swap-" + k.name)).string()}}};
  return j;
}

Measured measure(const Case& k, const fs::path& config, const fs::path& dir, const std::string& log_name) {
  const fs::path log = fs::absolute(dir / (log_name + ".jsonl"));
  fs::remove(log);
  if (k.nvme) fs::create_directories(dir / ("swap-" + k.name));
  const std::string self = self_command();
  std::string cmd = "cd " + shell_quote(dir.string()) + " && ";
  if (k.ranks > 1) cmd += self + " launch -n " + std::to_string(k.ranks) + " -- ";
  cmd += self + " train --config " + shell_quote(fs::absolute(config).string()) + " --log " +
         shell_quote(log.string()) + " --no-progress 1>&2";
  run_capture(cmd, "bench plan");
  std::ifstream in(log);
  std::vector<double> times;
  Measured m;
  std::string line;
  while (std::getline(in, line)) {
    const json j = json::parse(line);
    if (!j.contains("step") || !j.contains("seconds")) continue;
    if (j.at("step").get<int64_t>() > 2) times.push_back(j.at("seconds").get<double>());
    m.device_peak = std::max(m.device_peak, j.value("device_peak", 0.0));
    m.host_state = std::max(m.host_state, j.value("host_state", 0.0));
    m.nvme_state = std::max(m.nvme_state, j.value("nvme_state", 0.0));
  }
  if (times.empty()) throw std::runtime_error("bench plan: no timed step in " + log.string());
  m.times = times;
  std::sort(times.begin(), times.end());
  m.seconds = times[times.size() / 2];
  return m;
}

std::string pct(double predicted, double measured) {
  if (measured <= 0 && predicted <= 0) return "0 = 0";
  if (measured <= 0) return "(measured 0)";
  char b[32];
  std::snprintf(b, sizeof b, "%+.1f%%", 100 * (predicted / measured - 1));
  return b;
}

}  // namespace

void run_plan_bench(const PlanBenchOptions& o) {
  fs::create_directories(o.dir);
  // Calibrated here unless given: rounds before the runs and one after each; each case is
  // predicted from the rounds just before and after its own runs, so that the calibration and the
  // runs sample the same stretch of this machine's time (a shared VM's speed drifts by tens of
  // percent over minutes). cluster.json holds the medians of all rounds.
  std::unique_ptr<Calibration> calibration;
  if (o.cluster.empty()) {
    CalibrateOptions co;
    co.dir = o.dir.string();
    co.device = o.device;
    calibration = std::make_unique<Calibration>(co);
    calibration->rounds(kCalibrationRounds);
  }
  planner::Cluster machine;
  if (calibration && o.device == "cuda") {
    // On a GPU the probes' tensors (about 2 GB) would hold the memory the runs plan with: the
    // calibration ends before the runs (the host device's RAM has room for them beside).
    machine = calibration->cluster();
    calibration.reset();
    std::ofstream(o.dir / "cluster.json") << planner::cluster_json(machine);
  }
  const bool cuda = o.device == "cuda";
  const int64_t scale = cuda ? 4 : o.quick ? 1 : 2;
  const json gpt = {{"preset", "gpt2"}, {"layers", 2 * scale}, {"hidden", 256 * scale}, {"heads", 4 * scale},
                    {"vocab_size", 4096}, {"max_positions", 2048}};
  const json gpt_big = {{"preset", "gpt2"}, {"layers", 3 * scale}, {"hidden", 384 * scale}, {"heads", 6 * scale},
                        {"vocab_size", 8192}, {"max_positions", 2048}};
  const json llama = {{"preset", "llama-1b"}, {"layers", 2 * scale}, {"hidden", 256 * scale}, {"heads", 4 * scale},
                      {"kv_heads", 2 * scale}, {"intermediate", 688 * scale}, {"vocab_size", 4096},
                      {"tie_embeddings", false}};
  const json host = {{"params", "host"}, {"grads", "host"}, {"master", "host"}, {"moments", "host"}, {"activations", "host"}};
  const json device = {{"params", "device"}, {"grads", "device"}, {"master", "device"}, {"moments", "device"},
                       {"activations", "device"}};
  const json swap = {{"params", "host"}, {"grads", "host"}, {"master", "nvme"}, {"moments", "nvme"}, {"activations", "host"}};
  const json automatic = {{"params", "auto"}, {"grads", "auto"}, {"master", "auto"}, {"moments", "auto"},
                          {"activations", "auto"}};
  json block_tiles = host;
  block_tiles["tiling"] = {{"attention", 2}, {"mlp", 4}};
  const int64_t seq = cuda ? 1024 : 128, mb = cuda ? 8 : 4;
  std::vector<Case> cases = {
      {"gpt-host-after-backward", 1, gpt, host, {{"overlap", false}}, mb, seq},
      {"gpt-device-overlap-forward", 1, gpt, device, {{"overlap", "forward"}}, mb, seq},
      {"gpt-big-nvme", 1, gpt_big, swap, {{"overlap", "forward"}}, mb / 2, 2 * seq, true},
      {"llama-host-update-in-backward", 1, llama, host, {{"overlap", "backward"}, {"clip_grad_norm", 0.0}}, mb, seq},
      {"gpt-host-2-ranks", 2, gpt, host, {{"overlap", false}}, mb, seq},
      {"gpt-big-nvme-2-ranks", 2, gpt_big, swap, {{"overlap", "forward"}}, mb / 2, 2 * seq, true},
      // Block tiles (placement.tiling): the first case's model and placement, each block cut into 2
      // attention x 4 MLP tiles, units of their own; the planner prices each tile's products at
      // their own size and the tiles' extra memory traffic.
      {"gpt-host-block-tiles", 1, gpt, block_tiles, {{"overlap", false}}, mb, seq},
  };
  if (cuda) {  // one GPU: no second rank; automatic placement and the host placement's big model instead
    cases[4] = {"gpt-auto", 1, gpt, automatic, {{"overlap", "forward"}}, mb, seq};
    cases[5] = {"gpt-big-host-after-backward", 1, gpt_big, host, {{"overlap", false}}, mb / 2, 2 * seq};
  }
  // Each case runs `passes` times, every other pass in reverse order (a drift over the bench then
  // falls on both ends alike); its figure is the median of its passes' medians (with 3 passes one
  // slow pass, which this VM has at random moments, does not move it), and the spread between
  // its passes' medians is this machine's run-to-run noise, printed beside the errors.
  const int passes = o.quick ? 1 : 3;
  std::vector<Measured> measured(cases.size());
  std::vector<std::vector<double>> pass_medians(cases.size());
  // The calibration rounds next to each case's runs: its prediction uses those, so that a drift
  // of this machine's speed over the bench falls on the prediction and the runs alike.
  std::vector<std::vector<int>> rounds_of(cases.size());
  std::vector<engine::TrainConfig> configs;
  std::vector<fs::path> config_files;
  for (const Case& k : cases) {
    const json cj = config_of(k, o.dir, o.steps, o.device);
    config_files.push_back(o.dir / (k.name + ".json"));
    std::ofstream(config_files.back()) << cj.dump(2);
    configs.push_back(engine::parse_train_config(cj.dump(), config_files.back().string()));
  }
  // One run first, left out: the bench's first run was 25-35% slower than the same case's later
  // runs in two of three benches on the 2-core VM (2026-11-27; files and libraries coming into the
  // page cache after the calibration's probes).
  if (!o.quick) measure(cases[0], config_files[0], o.dir, cases[0].name + "-warm-up");
  for (int pass = 0; pass < passes; ++pass)
    for (size_t j = 0; j < cases.size(); ++j) {
      const size_t i = pass % 2 ? cases.size() - 1 - j : j;
      if (calibration) rounds_of[i].push_back(calibration->rounds_done() - 1);  // the round just before
      const Measured m = measure(cases[i], config_files[i], o.dir, cases[i].name);
      std::printf("bench plan: pass %d, %s: %.3f s a step (median of %zu)\n", pass + 1, cases[i].name.c_str(),
                  m.seconds, m.times.size());
      std::fflush(stdout);
      pass_medians[i].push_back(m.seconds);
      std::vector<double> all = measured[i].times;
      all.insert(all.end(), m.times.begin(), m.times.end());
      const Measured before = measured[i];
      measured[i] = m;
      measured[i].times = all;
      measured[i].device_peak = std::max(before.device_peak, m.device_peak);  // the largest of all passes
      measured[i].host_state = std::max(before.host_state, m.host_state);
      measured[i].nvme_state = std::max(before.nvme_state, m.nvme_state);
      std::vector<double> medians = pass_medians[i];
      std::sort(medians.begin(), medians.end());
      measured[i].seconds = medians.size() % 2 ? medians[medians.size() / 2]
                                               : (medians[medians.size() / 2 - 1] + medians[medians.size() / 2]) / 2;
      if (calibration) {
        calibration->rounds(1);
        rounds_of[i].push_back(calibration->rounds_done() - 1);  // and the one just after
      }
    }
  if (calibration) {
    machine = calibration->cluster();
    std::ofstream(o.dir / "cluster.json") << planner::cluster_json(machine);
  } else if (!o.cluster.empty()) {
    machine = planner::cluster_from(o.cluster);
  }

  // The plans, and each case once more with the plan's device bytes as its device budget: the
  // plan's figure is the budget the run needs (the engine decides with the same memory model).
  // Without a budget the peak also holds what the engine keeps only because it has room: the
  // previous stage's gradient buffers while their copies are in flight beside the next graph, so
  // it depends on the threads' timing. At the plan's budget the engine waits for those copies
  // instead; a plan below the real need makes the run fail (BudgetExceeded), one above it
  // leaves the peak short of the budget.
  std::vector<planner::StrataEstimate> estimates;
  std::vector<Measured> at_budget(cases.size());
  std::vector<std::string> budget_failure(cases.size());
  for (size_t i = 0; i < cases.size(); ++i) {
    planner::Cluster c = calibration ? calibration->cluster(false, rounds_of[i]) : machine;
    c.nodes = 1;
    c.node.gpus = cases[i].ranks;
    estimates.push_back(planner::estimate_strata_as_given(configs[i].engine, configs[i].model, c));
    const planner::StrataEstimate& e = estimates.back();
    if (!e.fits())
      throw std::runtime_error("bench plan: the planner says " + cases[i].name + " does not fit: " + e.state.error);
    const fs::path file = o.dir / (cases[i].name + "-at-plan.json");
    std::ofstream(file) << config_of(cases[i], o.dir, std::min<int64_t>(o.steps, 4), o.device, e.state.device_bytes())
                               .dump(2);
    try {
      at_budget[i] = measure(cases[i], file, o.dir, cases[i].name + "-at-plan");
      std::printf("bench plan: %s at the plan's device budget (%.1f MB): peak %.1f MB, %.3f s a step\n",
                  cases[i].name.c_str(), double(e.state.device_bytes()) / 1e6, at_budget[i].device_peak / 1e6,
                  at_budget[i].seconds);
    } catch (const std::exception& ex) {
      budget_failure[i] = ex.what();
      std::printf("bench plan: %s FAILED at the plan's device budget (%.1f MB): %s\n", cases[i].name.c_str(),
                  double(e.state.device_bytes()) / 1e6, ex.what());
    }
    std::fflush(stdout);
  }

  std::printf("\n| case | ranks | measured s/step | passes | predicted | error | device peak at the plan's budget / "
              "planned (no budget) | host state | NVMe state |\n|---|---|---|---|---|---|---|---|---|\n");
  double worst_time = 0, sum_time = 0, worst_memory = 0, worst_device = 0, measured_mean = 0, worst_spread = 0;
  json rows = json::array();
  for (size_t i = 0; i < cases.size(); ++i) {
    const Case& k = cases[i];
    const Measured& m = measured[i];
    const planner::StrataEstimate& e = estimates[i];
    const double dev = double(e.state.device_bytes()), hostb = double(e.state.host_state),
                 nvme = double(e.state.nvme_state);
    const double err_t = e.time.step / m.seconds - 1;
    const auto [lo, hi] = std::minmax_element(pass_medians[i].begin(), pass_medians[i].end());
    const double spread = *hi / *lo - 1;
    worst_spread = std::max(worst_spread, spread);
    std::string passes_text;
    for (double x : pass_medians[i]) {
      char b[16];
      std::snprintf(b, sizeof b, "%.3f", x);
      passes_text += (passes_text.empty() ? "" : " / ") + std::string(b);
    }
    worst_time = std::max(worst_time, std::abs(err_t));
    sum_time += std::abs(err_t);
    measured_mean += m.seconds / double(cases.size());
    for (auto [p, q] : {std::pair{hostb, m.host_state}, {nvme, m.nvme_state}})
      if (q > 0) worst_memory = std::max(worst_memory, std::abs(p / q - 1));
    // The device: the plan's figure against the ledger's peak in the run given it as its budget (a
    // failed run there: the plan is below the need, counted as a 100% error).
    const Measured& b = at_budget[i];
    const bool failed = !budget_failure[i].empty();
    if (failed) worst_device = std::max(worst_device, 1.0);
    else if (b.device_peak > 0) worst_device = std::max(worst_device, std::abs(dev / b.device_peak - 1));
    const std::string device_text = failed ? "FAILED at the plan's budget" : pct(dev, b.device_peak);
    std::printf("| %s | %d | %.3f | %s | %.3f | %s | %.1f / %.1f MB (%s; %.1f MB) | %.1f / %.1f MB (%s) | %.1f / %.1f MB (%s) |\n",
                k.name.c_str(), k.ranks, m.seconds, passes_text.c_str(), e.time.step, pct(e.time.step, m.seconds).c_str(),
                b.device_peak / 1e6, dev / 1e6, device_text.c_str(), m.device_peak / 1e6, m.host_state / 1e6, hostb / 1e6,
                pct(hostb, m.host_state).c_str(), m.nvme_state / 1e6, nvme / 1e6, pct(nvme, m.nvme_state).c_str());
    std::fflush(stdout);
    json row = {{"case", k.name}, {"ranks", k.ranks}, {"measured_s", m.seconds}, {"passes_s", pass_medians[i]},
                {"predicted_s", e.time.step}, {"device_peak", b.device_peak}, {"predicted_device", dev},
                {"device_peak_without_budget", m.device_peak}, {"seconds_at_plan_budget", b.seconds},
                {"host_state", m.host_state}, {"predicted_host", hostb}, {"nvme_state", m.nvme_state},
                {"predicted_nvme", nvme}, {"bottleneck", e.time.bottleneck}};
    if (failed) row["failed_at_plan_budget"] = budget_failure[i];
    rows.push_back(row);
  }
  std::printf("\nstep time: mean error %.1f%%, worst %.1f%% (the same case's passes differ by up to %.1f%%); host and "
              "NVMe state: worst error %.1f%%; device: worst error %.1f%%\n",
              100 * sum_time / double(cases.size()), 100 * worst_time, 100 * worst_spread, 100 * worst_memory,
              100 * worst_device);
  std::cout << json{{"metric", "plan_step_time_worst_error"},
                    {"value", worst_time},
                    {"baseline", "measured strata train runs (mean s/step)"},
                    {"baseline_value", measured_mean},
                    {"ratio", worst_time},
                    {"mean_error", sum_time / double(cases.size())},
                    {"worst_memory_error", worst_memory},
                    {"worst_device_error", worst_device},
                    {"worst_pass_spread", worst_spread},
                    {"cases", rows}}
                   .dump()
            << std::endl;
}

}  // namespace strata::bench
