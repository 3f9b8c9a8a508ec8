#include "train_bench.h"

#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <fstream>
#include <optional>
#include <iostream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <stdexcept>

#include "shell.h"
#include "strata/engine/config.h"
#include "strata/engine/config_parse.h"
#include "timing.h"

namespace strata::bench {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

std::string run(const std::string& command) { return run_capture(command, "bench train"); }

// What the baselines must reproduce of a configuration.
struct Shape {
  int64_t layers, hidden, heads, vocab, max_positions, seq, batch;
  double clip;
  std::string device;
  bool operator==(const Shape&) const = default;
  std::string describe() const {
    std::ostringstream s;
    s << layers << " layers, d " << hidden << ", " << heads << " heads, vocabulary " << vocab << ", "
      << batch << " x " << seq << " tokens a step, clip " << clip << ", " << device;
    return s.str();
  }
};

Shape shape_of(const engine::TrainConfig& tc, const fs::path& file) {
  const models::ModelConfig& m = tc.model;
  if (m.arch != models::Arch::kGpt2)
    throw std::runtime_error("bench train: " + file.string() + " is not a GPT-2-shaped model: the "
                             "PyTorch baselines (bench/train_baseline.py) model GPT-2 only");
  if (m.head_dim * m.heads != m.hidden || !m.tie_embeddings)
    throw std::runtime_error("bench train: " + file.string() + ": the baselines need tied embeddings "
                             "and hidden = heads x head_dim");
  const engine::EngineConfig& e = tc.engine;
  return {m.layers, m.hidden, m.heads, m.vocab_size, m.max_positions, e.seq_len,
          e.micro_batch * e.grad_accum, e.clip_grad_norm, e.device};
}

struct RunResult {
  std::string name;
  double seconds = 0, model_tflops = 0;
  uint64_t peak_rss = 0;
  json placement, losses = json::array();
};

RunResult strata_run(const fs::path& config, const TrainBenchOptions& o) {
  RunResult r;
  r.name = config.stem().string();
  const fs::path log = fs::absolute(o.dir / (r.name + ".jsonl"));
  fs::remove(log);
  std::string cmd = "cd " + shell_quote(o.dir.string()) + " && " + self_command() +
                    " train --config " + shell_quote(fs::absolute(config).string()) + " --steps " +
                    std::to_string(o.steps) + " --log " + shell_quote(log.string()) + " --no-progress";
  if (o.profile) cmd += " --profile " + shell_quote(fs::absolute(o.dir / (r.name + ".trace.json")).string());
  run(cmd + " 1>&2");
  std::ifstream in(log);
  std::vector<double> times;
  std::string line;
  for (int number = 1; std::getline(in, line); ++number) try {
    const json j = json::parse(line);
    if (j.value("event", "") == "start") r.placement = j.at("placement");
    if (!j.contains("step") || !j.contains("seconds")) continue;
    r.losses.push_back(j.at("loss"));
    r.peak_rss = std::max<uint64_t>(r.peak_rss, j.value("peak_rss", uint64_t(0)));
    if (int64_t(r.losses.size()) > o.warmup) {
      times.push_back(j.at("seconds").get<double>());
      r.model_tflops = j.at("model_tflops").get<double>();
    }
  } catch (const json::exception& e) {
    throw std::runtime_error("bench train: " + log.string() + " line " + std::to_string(number) + ": " + e.what());
  }
  if (times.empty())
    throw std::runtime_error("bench train: " + log.string() + " has no step past the warm-up");
  r.seconds = median(times);
  return r;
}

json baseline_run(const std::string& mode, const Shape& s, const TrainBenchOptions& o) {
  const int64_t timed = std::max<int64_t>(1, o.steps - o.warmup);
  char clip[32];
  snprintf(clip, sizeof clip, "%.17g", s.clip);
  const std::string cmd = shell_quote(o.python) + " " + shell_quote(o.script.string()) + " --mode " + shell_quote(mode) +
                          " --layers " + std::to_string(s.layers) + " --hidden " + std::to_string(s.hidden) +
                          " --heads " + std::to_string(s.heads) + " --vocab " + std::to_string(s.vocab) +
                          " --max-pos " + std::to_string(s.max_positions) + " --seq " + std::to_string(s.seq) +
                          " --batch " + std::to_string(s.batch) + " --steps " + std::to_string(timed) +
                          " --warmup " + std::to_string(o.warmup) + " --clip " + clip +
                          " --device " + shell_quote(s.device);
  const std::string out = run(cmd);
  const auto end = out.find_last_not_of("\n");
  if (end == std::string::npos) throw std::runtime_error("bench train: no result on stdout from " + cmd);
  const auto begin = out.rfind('\n', end);
  const std::string last = out.substr(begin == std::string::npos ? 0 : begin + 1, end + 1 - (begin == std::string::npos ? 0 : begin + 1));
  try {
    return json::parse(last);
  } catch (const json::exception& e) {
    throw std::runtime_error("bench train: the last line from " + cmd + " is not JSON (" + e.what() + "): " + last);
  }
}

}  // namespace

void run_train_bench(const TrainBenchOptions& o) {
  if (o.configs.empty()) throw std::invalid_argument("bench train: name at least one configuration");
  if (o.steps <= o.warmup || o.warmup < 0)
    throw std::invalid_argument("bench train: --steps must exceed --warmup");
  std::optional<Shape> shape;
  for (const fs::path& c : o.configs) {
    const engine::TrainConfig tc = engine::load_train_config(c.string());
    if (tc.resume || !tc.checkpoint_dir.empty())
      throw std::invalid_argument("bench train: " + c.string() + " saves or resumes checkpoints (run.checkpoint_dir, "
                                  "run.resume): a benchmark run must start fresh and time only training");
    const Shape s = shape_of(tc, c);
    if (shape && !(s == *shape))
      throw std::invalid_argument("bench train: " + c.string() + " (" + s.describe() + ") differs in shape from " +
                                  o.configs.front().string() + " (" + shape->describe() + ")");
    shape = s;
  }
  for (const std::string& b : o.baselines)
    if (b != "plain" && b != "fsdp2") throw std::invalid_argument("bench train: unknown baseline '" + b + "' (plain, fsdp2)");
  fs::create_directories(o.dir);
  // Relative swap directories of the configurations live in the work directory.
  for (const fs::path& c : o.configs)
    for (const std::string& d : engine::load_train_config(c.string()).engine.nvme_dirs)
      if (fs::path(d).is_relative()) fs::create_directories(o.dir / d);
  std::cerr << "bench train: " << shape->describe() << "; " << o.steps << " steps a run, median of the last "
            << o.steps - o.warmup << std::endl;

  json value = json::object(), tflops = json::object(), placement = json::object(), losses = json::object(),
       rss = json::object();
  std::vector<RunResult> runs;
  for (const fs::path& c : o.configs) {
    RunResult r = strata_run(c, o);
    value[r.name] = r.seconds;
    tflops[r.name] = r.model_tflops;
    placement[r.name] = r.placement;
    losses[r.name] = r.losses;
    rss[r.name] = r.peak_rss;
    std::cout << json{{"metric", "train_step_seconds"}, {"run", r.name}, {"value", r.seconds},
                      {"model_tflops", r.model_tflops}, {"placement", r.placement}, {"losses", r.losses},
                      {"peak_rss", r.peak_rss}}.dump()
              << std::endl;
    runs.push_back(std::move(r));
  }
  json baseline_value = json::object(), baseline_runs = json::object(), ratio = json::object();
  for (const std::string& b : o.baselines) {
    const json j = baseline_run(b, *shape, o);
    std::cout << j.dump() << std::endl;
    baseline_runs[b] = j;
    baseline_value[b] = j.at("value");  // null when it ran out of memory
    for (const RunResult& r : runs)
      ratio[r.name + " / " + b] = j.at("value").is_number() ? json(r.seconds / j.at("value").get<double>()) : json(nullptr);
  }
  std::string baseline = "none";
  if (!o.baselines.empty()) {
    baseline = "PyTorch (bench/train_baseline.py):";
    for (const std::string& b : o.baselines) baseline += " " + b;
  }
  std::cout << json{{"metric", "train_step_seconds"},
                    {"shape", shape->describe()},
                    {"value", value},
                    {"baseline", baseline},
                    {"baseline_value", baseline_value},
                    {"ratio", ratio},
                    {"model_tflops", tflops},
                    {"placement", placement},
                    {"losses", losses},
                    {"peak_rss", rss},
                    {"baseline_runs", baseline_runs}}.dump()
            << std::endl;
}

}  // namespace strata::bench
