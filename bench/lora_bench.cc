#include "lora_bench.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <filesystem>
#include <chrono>
#include <future>
#include <iostream>
#include <memory>
#include <nlohmann/json.hpp>
#include <stdexcept>
#include <thread>

#include "bench_model.h"
#include "engine_args.h"
#include "strata/engine/comm.h"
#include "strata/engine/device.h"
#include "strata/engine/engine.h"
#include "strata/models/model_shapes.h"
#include "timing.h"

namespace strata::bench {
namespace {

// One side: its engine, on a device of its own.
struct Side {
  std::string name;
  std::unique_ptr<engine::Device> dev;
  std::unique_ptr<engine::Engine> eng;
};


// The 4-bit side's seconds against the 16-bit side's (the first line, when there is a baseline),
// with both sides' bytes moved a step and state bytes.
nlohmann::json qlora_final_line(const LoraBenchOptions& o, const std::vector<nlohmann::json>& lines,
                                const std::string& device, unsigned threads) {
  const nlohmann::json& lora = lines.back();
  nlohmann::json final_line = {{"metric", "qlora_step_s"},
                               {"value", lora["step_s"]},
                               {"baseline", "lora_" + o.compute + "_base_step_s"},
                               {"baseline_value", o.baseline ? lines.front()["step_s"] : nlohmann::json()},
                               {"ratio", o.baseline ? nlohmann::json(lora["step_s"].get<double>() /
                                                                     lines.front()["step_s"].get<double>())
                                                    : nlohmann::json()},
                               {"quant_type", o.quant_type},
                               {"qlora_h2d_bytes_per_step", lora["h2d_bytes_per_step"]},
                               {"qlora_swap_read_bytes_per_step", lora["swap_read_bytes_per_step"]},
                               {"qlora_host_state_bytes", lora["host_state_bytes"]},
                               {"qlora_nvme_state_bytes", lora["nvme_state_bytes"]},
                               {"device", device},
                               {"compute", o.compute},
                               {"threads", threads}};
  if (o.baseline) {
    final_line["qlora_step_vs_" + o.compute + "_base"] = final_line["ratio"];
    for (const char* k : {"h2d_bytes_per_step", "swap_read_bytes_per_step", "host_state_bytes", "nvme_state_bytes"})
      final_line[std::string(o.compute) + "_base_" + k] = lines.front()[k];
  }
  return final_line;
}

}  // namespace

void run_lora_bench(const LoraBenchOptions& o) {
  const unsigned threads = o.threads ? o.threads : std::max(1u, std::thread::hardware_concurrency());
  at::set_num_threads(int(threads));
  auto comm = engine::Communicator::create(engine::DistEnv{}, std::chrono::seconds(600));
  const models::ModelConfig base = llama_shape("llama-lora-bench", o.layers, o.hidden, o.heads, o.kv_heads,
                                               o.intermediate, o.vocab);
  engine::EngineConfig e;
  e.device = o.device;
  e.compute = compute_named(o.compute, "bench lora: --compute");
  e.micro_batch = o.batch;
  e.seq_len = o.seq;
  e.lr = 1e-4;
  e.cpu_threads = threads;
  e.params = placement_named(o.params, "bench lora: --params");
  e.grads = e.master = e.moments = placement_named(o.state, "bench lora: --state");
  e.nvme_dirs = o.nvme_dirs;
  e.recompute_blocks = o.recompute ? engine::EngineConfig::kRecomputeAll : 0;

  models::ModelConfig adapted = base;
  adapted.lora.r = o.r;
  adapted.lora.alpha = o.alpha;
  adapted.lora.target_modules = {"all-linear"};
  engine::EngineConfig lora_cfg = e;
  lora_cfg.trainable = models::adapter_patterns();

  std::vector<Side> sides;
  // Each side's swap files in a directory of its own under each of --nvme-dirs (one swap space
  // per engine).
  const auto build = [&](const std::string& name, const models::ModelConfig& c, engine::EngineConfig cfg) {
    for (std::string& d : cfg.nvme_dirs) {
      d += "/side" + std::to_string(sides.size());
      std::filesystem::create_directories(d);
    }
    Side s{name, engine::Device::create(o.device, 0, o.budget ? o.budget : UINT64_MAX), nullptr};
    s.eng = std::make_unique<engine::Engine>(std::make_unique<models::Decoder>(c, 1, models::Decoder::Init::kDeferred),
                                             cfg, *comm, *s.dev);
    sides.push_back(std::move(s));
  };
  models::ModelConfig quantized = adapted;
  quantized.quantize.load_in_4bit = true;
  quantized.quantize.quant_type = o.quant_type;
  const std::string lora_side = o.qlora ? "LoRA, 4-bit base" : "LoRA";
  if (o.baseline) {
    if (o.qlora) build("LoRA, " + o.compute + " base", adapted, lora_cfg);
    else build("full fine-tune", base, e);
  }
  build(lora_side, o.qlora ? quantized : adapted, lora_cfg);
  const int64_t tokens = o.batch * o.seq;
  std::cerr << (o.qlora ? "bench qlora: " : "bench lora: ") << base.parameters() / 1e6 << "M parameters (" << o.layers << " x " << o.hidden
            << ", GQA " << o.heads << "/" << o.kv_heads << ", MLP " << o.intermediate << ", vocab " << o.vocab
            << "), LoRA r " << o.r << (o.qlora ? " over a " + o.quant_type + " base" : "") << " on every block linear (" << models::adapter_parameters(adapted) / 1e6
            << "M adapter parameters), batch " << o.batch << " x " << o.seq << ", " << o.compute << " on "
            << sides.front().dev->description() << ", " << threads << " threads; params " << o.params << ", state "
            << o.state << (o.recompute ? ", recompute" : "") << std::endl;

  // Each side's steps back to back (a warm-up, then the timed ones), not round-robin: an engine's
  // update runs behind its next step (optimizer.overlap), and would otherwise run behind the
  // other side's. Its last update is waited for before the other side starts.
  const at::Tensor ids = at::randint(0, o.vocab, {o.batch, o.seq + 1}, at::kLong);
  std::vector<double> sec;
  std::vector<engine::StepTimeline> last;
  for (Side& s : sides) {
    s.eng->train_step(ids);
    std::vector<double> t;
    for (unsigned k = 0; k < o.steps; ++k) {
      const auto t0 = std::chrono::steady_clock::now();
      const engine::StepResult r = s.eng->train_step(ids);
      t.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
      if (k + 1 == o.steps) last.push_back(r.timeline);
    }
    const std::shared_future<void> update = s.eng->update_finished();
    if (update.valid()) update.get();
    sec.push_back(median(t));
  }

  std::vector<nlohmann::json> lines;
  for (size_t i = 0; i < sides.size(); ++i) {
    const Side& s = sides[i];
    const engine::MemoryReport m = s.eng->memory();
    const double flops = s.eng->flops_per_token() * double(tokens);
    nlohmann::json line = {{"side", s.name},
                           {"step_s", sec[i]},
                           {"tokens_per_s", double(tokens) / sec[i]},
                           {"model_tflops", flops / sec[i] / 1e12},
                           {"model_flops_per_step", flops},
                           {"device_peak_bytes", m.device_peak},
                           {"host_state_bytes", m.host_state},
                           {"nvme_state_bytes", m.nvme_state},
                           {"host_activation_bytes", m.host_activations},
                           {"h2d_bytes_per_step", last[i].h2d_bytes},
                           {"swap_read_bytes_per_step", last[i].nvme_read_bytes},
                           {"parameters", base.parameters()},
                           {"trainable_parameters", s.name.rfind("LoRA", 0) == 0 ? models::adapter_parameters(adapted)
                                                                                  : base.parameters()}};
    std::cout << line.dump() << std::endl;
    lines.push_back(line);
  }
  const nlohmann::json& lora = lines.back();
  if (o.qlora) {
    std::cout << qlora_final_line(o, lines, sides.front().dev->description(), threads).dump() << std::endl;
    return;
  }
  nlohmann::json final_line = {{"metric", "lora_step_s"},
                               {"value", lora["step_s"]},
                               {"lora_host_state_bytes", lora["host_state_bytes"]},
                               {"lora_device_peak_bytes", lora["device_peak_bytes"]},
                               {"lora_model_tflops", lora["model_tflops"]},
                               {"device", sides.front().dev->description()},
                               {"compute", o.compute},
                               {"threads", threads}};
  if (o.baseline) {
    const nlohmann::json& full = lines.front();
    final_line["baseline"] = "full_finetune_step_s";
    final_line["baseline_value"] = full["step_s"];
    final_line["ratio"] = lora["step_s"].get<double>() / full["step_s"].get<double>();
    final_line["full_host_state_bytes"] = full["host_state_bytes"];
    final_line["full_device_peak_bytes"] = full["device_peak_bytes"];
    final_line["host_state_ratio"] =
        lora["host_state_bytes"].get<double>() / std::max(1.0, full["host_state_bytes"].get<double>());
  } else {
    final_line["baseline"] = nullptr;
    final_line["baseline_value"] = nullptr;
    final_line["ratio"] = nullptr;
  }
  std::cout << final_line.dump() << std::endl;
}

}  // namespace strata::bench
