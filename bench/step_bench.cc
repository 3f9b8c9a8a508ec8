#include "step_bench.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/optim/adamw.h>

#include <iostream>
#include <nlohmann/json.hpp>
#include <thread>

#include "strata/engine/comm.h"
#include "strata/engine/device.h"
#include "strata/engine/engine.h"
#include "bench_model.h"
#include "timing.h"

namespace strata::bench {
namespace {

// Plain libtorch training of a Decoder: forward, loss, backward, torch::optim::AdamW.
// With `recompute`, each block runs without autograd in the forward pass and again, from its
// saved input, in the backward pass: the same recipe the engine follows (and that large-model
// training uses), so that the comparison isolates the engine's own work.
class PlainTrainer {
 public:
  PlainTrainer(const models::ModelConfig& c, bool recompute, const engine::EngineConfig& e)
      : model_(c, 1), recompute_(recompute) {
    for (auto& [n, p] : model_.hf_parameters()) params_.push_back(p);
    opt_ = std::make_unique<torch::optim::AdamW>(
        params_, torch::optim::AdamWOptions(e.lr).betas({e.beta1, e.beta2}).eps(e.eps).weight_decay(e.weight_decay));
  }
  double step(const at::Tensor& ids) {
    const int64_t T = ids.size(1) - 1;
    at::Tensor in = ids.narrow(1, 0, T), targets = ids.narrow(1, 1, T).reshape(-1);
    opt_->zero_grad();
    at::Tensor loss;
    if (!recompute_) {
      at::Tensor logits = model_.forward(in);
      loss = at::cross_entropy_loss(logits.reshape({-1, logits.size(-1)}), targets);
      loss.backward();
    } else {
      auto stages = model_.stages();
      std::vector<at::Tensor> inputs;
      at::Tensor x = in;
      {
        at::NoGradGuard ng;
        for (size_t s = 0; s + 1 < stages.size(); ++s) {
          inputs.push_back(x);
          x = stages[s]->forward(x);
        }
      }
      at::Tensor xh = x.detach().requires_grad_(true);
      at::Tensor logits = stages.back()->forward(xh);
      loss = at::cross_entropy_loss(logits.reshape({-1, logits.size(-1)}), targets);
      loss.backward();
      at::Tensor dy = xh.grad();
      for (size_t s = stages.size() - 1; s-- > 0;) {
        at::Tensor xin = inputs[s];
        if (s > 0) xin = xin.detach().requires_grad_(true);
        at::Tensor y = stages[s]->forward(xin);
        y.backward(dy);
        if (s > 0) dy = xin.grad();
      }
    }
    opt_->step();
    return loss.item<double>();
  }

 private:
  models::Decoder model_;
  bool recompute_;
  std::vector<at::Tensor> params_;
  std::unique_ptr<torch::optim::AdamW> opt_;
};

}  // namespace

void run_step_bench(const StepBenchOptions& o) {
  const unsigned threads = o.threads ? o.threads : std::max(1u, std::thread::hardware_concurrency());
  at::set_num_threads(int(threads));
  const models::ModelConfig c = gpt2_shape("gpt2-bench", o.layers, o.hidden, o.heads, o.vocab, o.seq);

  engine::EngineConfig e;
  e.micro_batch = o.batch;
  e.seq_len = o.seq;
  e.lr = 1e-4;
  e.weight_decay = 0.01;
  e.cpu_threads = threads;
  if (o.overlap == "off") e.update_overlap = engine::UpdateOverlap::kOff;
  else if (o.overlap == "forward") e.update_overlap = engine::UpdateOverlap::kForward;
  else if (o.overlap == "backward") e.update_overlap = engine::UpdateOverlap::kBackward;
  else throw std::invalid_argument("bench step: --overlap must be off, forward or backward, not " + o.overlap);
  const engine::Placement where = o.placement == "device" ? engine::Placement::kDevice : engine::Placement::kHost;
  e.params = e.grads = e.master = e.moments = e.activations = where;
  if (o.recompute == "all") e.recompute_blocks = engine::EngineConfig::kRecomputeAll;
  else if (o.recompute == "none") e.recompute_blocks = 0;
  else if (o.recompute == "auto") e.recompute_blocks = engine::EngineConfig::kRecomputeAuto;
  else if (!o.recompute.empty() && o.recompute.find_first_not_of("0123456789") == std::string::npos && o.recompute.size() < 9)
    e.recompute_blocks = std::stoi(o.recompute);
  else
    throw std::invalid_argument("bench step: --recompute must be all, none, auto or a block count, not " + o.recompute);
  auto comm = engine::Communicator::create(engine::DistEnv{}, std::chrono::seconds(60));
  auto dev = engine::Device::create_host(UINT64_MAX);
  engine::Engine eng(std::make_unique<models::Decoder>(c, 1), e, *comm, *dev);
  PlainTrainer plain(c, false, e), plain_rc(c, true, e);

  at::Tensor ids = at::randint(0, o.vocab, {o.batch, o.seq + 1}, at::kLong);
  const int recomputed = eng.config().recompute_blocks;
  std::cerr << "bench step: " << c.parameters() / 1e6 << "M parameters (" << o.layers << " x "
            << o.hidden << ", vocab " << o.vocab << "), batch " << o.batch << " x " << o.seq
            << ", fp32, " << threads << " threads; the engine recomputes " << recomputed << " of "
            << o.layers << " blocks" << std::endl;
  const std::vector<double> sec = median_seconds(
      o.steps, {[&] { eng.train_step(ids); }, [&] { plain_rc.step(ids); }, [&] { plain.step(ids); }});
  const double tokens = double(o.batch * o.seq);
  const bool none = recomputed == 0;
  const double base = none ? sec[2] : sec[1];
  nlohmann::json summary = {
      {"metric", "train_step_seconds"},
      {"value", sec[0]},
      {"baseline", none ? "plain libtorch, no recompute, torch::optim::AdamW"
                   : recomputed < o.layers
                       ? "plain libtorch, every block recomputed (the engine recomputes only some), torch::optim::AdamW"
                       : "plain libtorch, every block recomputed, torch::optim::AdamW"},
      {"baseline_value", base},
      {"ratio", sec[0] / base},
      {"overhead", sec[0] / base - 1},
      {"plain_recompute_seconds", sec[1]},
      {"plain_no_recompute_seconds", sec[2]},
      {"ratio_vs_plain_recompute", sec[0] / sec[1]},
      {"ratio_vs_no_recompute", sec[0] / sec[2]},
      {"recomputed_blocks", recomputed},
      {"tokens_per_s", tokens / sec[0]},
      {"placement", o.placement},
      {"overlap", o.overlap},
      {"parameters", c.parameters()},
      {"threads", threads}};
  std::cout << summary.dump() << std::endl;
}

}  // namespace strata::bench
