#include "moe_bench.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <iostream>
#include <nlohmann/json.hpp>
#include <thread>

#include "bench_model.h"
#include "strata/engine/comm.h"
#include "strata/engine/device.h"
#include "strata/engine/engine.h"
#include "strata/models/moe.h"
#include "timing.h"

namespace strata::bench {
namespace {

// transformers' MixtralExperts.forward (its "eager" loop), the baseline of the dispatch: a
// one-hot mask of the choices, then for every expert chosen at least once torch.where over its
// mask, its MLP on those tokens, and index_add_ of the weighted output.
at::Tensor transformers_loop(const models::ModelConfig& c, const at::Tensor& x, const at::Tensor& router,
                             const std::vector<tiling::MlpWeights>& experts) {
  const at::Tensor probs = at::softmax(at::linear(x, router), -1, at::kFloat);
  auto [top, choice] = probs.topk(c.moe.top_k, -1);
  top = top / top.sum(-1, true);
  at::Tensor out = at::zeros_like(x);
  at::Tensor mask;
  {
    at::NoGradGuard no_grad;
    mask = at::one_hot(choice, c.moe.experts).permute({2, 1, 0});  // [E, k, tokens]
  }
  for (int64_t e = 0; e < c.moe.experts; ++e) {
    const auto where = at::where(mask[e]);  // (choice slot, token)
    if (where[1].numel() == 0) continue;
    const auto& w = experts[size_t(e)];
    const at::Tensor xs = x.index({where[1]});
    const at::Tensor h = at::silu(at::linear(xs, w.gate)) * at::linear(xs, w.up);
    const at::Tensor y = at::linear(h, w.down) * top.index({where[1], where[0]}).unsqueeze(-1);
    out = out.index_add(0, where[1], y);
  }
  return out;
}

}  // namespace

void run_moe_bench(const MoeBenchOptions& o) {
  if (o.top_k < 1 || o.top_k > o.experts)
    throw std::invalid_argument("bench moe: --top-k must be between 1 and --experts");
  const unsigned threads = o.threads ? o.threads : std::max(1u, std::thread::hardware_concurrency());
  at::set_num_threads(int(threads));
  models::ModelConfig moe =
      llama_shape("moe-bench", o.layers, o.hidden, o.heads, o.heads, o.expert_intermediate, o.vocab);
  moe.hf_type = "mixtral";
  moe.moe.experts = o.experts;
  moe.moe.top_k = o.top_k;
  moe.moe.intermediate = o.expert_intermediate;
  moe.validate();
  const models::ModelConfig dense =
      llama_shape("dense-bench", o.layers, o.hidden, o.heads, o.heads, o.top_k * o.expert_intermediate, o.vocab);

  engine::EngineConfig e;
  e.micro_batch = o.batch;
  e.seq_len = o.seq;
  e.lr = 1e-4;
  e.weight_decay = 0.01;
  e.cpu_threads = threads;
  e.params = e.grads = e.master = e.moments = e.activations = engine::Placement::kHost;
  auto comm = engine::Communicator::create(engine::DistEnv{}, std::chrono::seconds(60));
  auto dev = engine::Device::create_host(UINT64_MAX);
  engine::Engine moe_engine(std::make_unique<models::Decoder>(moe, 1), e, *comm, *dev);
  engine::Engine dense_engine(std::make_unique<models::Decoder>(dense, 1), e, *comm, *dev);
  const at::Tensor ids = at::randint(0, o.vocab, {o.batch, o.seq + 1}, at::kLong);
  std::cerr << "bench moe: " << o.experts << " experts, top-" << o.top_k << " of width " << o.expert_intermediate
            << " (" << moe.parameters() / 1e6 << "M parameters, " << moe.active_parameters() / 1e6
            << "M active) beside a dense MLP of width " << dense.intermediate << " (" << dense.parameters() / 1e6
            << "M), " << o.layers << " x " << o.hidden << ", batch " << o.batch << " x " << o.seq << ", fp32, "
            << threads << " threads" << std::endl;
  const std::vector<double> step =
      median_seconds(o.steps, {[&] { moe_engine.train_step(ids); }, [&] { dense_engine.train_step(ids); }});

  // The dispatch alone (a block's MoE MLP, forward and backward) beside transformers' loop.
  const int64_t tokens = o.batch * o.seq, d = o.hidden, f = o.expert_intermediate;
  const at::Tensor x = (at::randn({tokens, d})).requires_grad_(true);
  const at::Tensor router = (at::randn({o.experts, d}) * 0.1).requires_grad_(true);
  std::vector<tiling::MlpWeights> experts(size_t(o.experts));
  for (auto& w : experts) {
    w.gate = (at::randn({f, d}) * 0.05).requires_grad_(true);
    w.up = (at::randn({f, d}) * 0.05).requires_grad_(true);
    w.down = (at::randn({d, f}) * 0.05).requires_grad_(true);
  }
  models::RouterStats stats;
  const std::vector<double> mlp = median_seconds(
      o.steps, {[&] { models::moe_mlp(moe, x, router, experts, stats).sum().backward(); },
                [&] { transformers_loop(moe, x, router, experts).sum().backward(); }});
  const double tok = double(o.batch * o.seq);
  std::cerr << "bench moe: step " << step[0] << " s (" << tok / step[0] << " tokens/s) vs dense " << step[1]
            << " s; dispatch forward+backward " << mlp[0] << " s vs transformers' loop " << mlp[1] << " s"
            << std::endl;
  nlohmann::json summary = {
      {"metric", "moe_step_vs_dense_active"},
      {"value", step[0]},
      {"baseline", "the same engine on a dense Llama with the same active parameters (MLP width top_k x expert width)"},
      {"baseline_value", step[1]},
      {"ratio", step[0] / step[1]},
      {"dispatch_seconds", mlp[0]},
      {"transformers_loop_seconds", mlp[1]},
      {"dispatch_vs_loop", mlp[0] / mlp[1]},
      {"parameters", moe.parameters()},
      {"active_parameters", moe.active_parameters()},
      {"dense_parameters", dense.parameters()},
      {"experts", o.experts},
      {"top_k", o.top_k},
      {"threads", threads}};
  std::cout << summary.dump() << std::endl;
}

}  // namespace strata::bench
