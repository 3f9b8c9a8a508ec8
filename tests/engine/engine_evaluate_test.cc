// Engine::evaluate and masked (supervised) steps: evaluation changes nothing and is the next
// step's loss; a masked step is the whole batch's loss with ignored targets, as libtorch's.
#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>
#include <signal.h>
#include <sys/wait.h>
#include <torch/nn/utils/clip_grad.h>
#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <fstream>
#include <future>
#include <limits>
#include <map>
#include <optional>
#include <sstream>
#include <string>
#include <set>
#include <thread>
#include <utility>
#include <vector>

#include "strata/engine/comm.h"
#include "strata/engine/config.h"
#include "strata/engine/config_parse.h"
#include "strata/engine/placement.h"
#include "strata/engine/device.h"
#include "strata/engine/engine.h"
#include "strata/models/hf_io.h"
#include "strata/models/token_data.h"
#include "strata/offload/fault_injection.h"
#include "equivalence.h"
#include "launched.h"
#include "test_util.h"

namespace se = strata::engine;
namespace sm = strata::models;
using nlohmann::json;
using strata::test::TempDir;
using namespace strata::test;

namespace {

// Engine::evaluate reads the weights and changes nothing: a run with evaluations between its
// steps trains bitwise like one without (with the update overlapping the next forward, state on
// the host and in swap); its loss is the next step's loss on the same ids (the same weights),
// with and without a loss mask; and a masked step's loss is the mean over the counted targets.
TEST(EngineEvaluate, ChangesNothingAndIsTheLossTheNextStepReports) {
  TempDir swap;
  for (const char* master : {"host", "nvme"}) {
    json j = tiny_config(true, 3);
    j["placement"] = {{"master", master}, {"moments", master}};
    j["offload"] = {{"nvme_dirs", {swap.path().string()}}, {"optimizer_chunk", "16KiB"}};
    const se::TrainConfig tc = se::parse_train_config(j.dump(), "test");
    const se::EngineConfig& e = tc.engine;
    auto run = [&](bool evaluate, bool masked) {
      auto comm = se::Communicator::create(se::DistEnv{}, std::chrono::seconds(30));
      auto dev = se::Device::create("cpu", 0, 1200 * 1024);
      se::Engine eng(std::make_unique<sm::Decoder>(tc.model, tc.init_seed), e, *comm, *dev);
      at::Generator g = at::make_generator<at::CPUGeneratorImpl>(5);
      std::vector<double> losses, eval_losses;
      for (int s = 0; s < 4; ++s) {
        const at::Tensor ids = at::randint(0, 256, {e.micro_batch * e.grad_accum, e.seq_len + 1}, g, at::kLong);
        at::Tensor mask;
        if (masked) mask = at::rand({ids.size(0), e.seq_len}, g).lt(0.4).to(at::kByte);
        if (evaluate) {
          const se::Engine::EvalResult r = eng.evaluate(ids, mask);
          EXPECT_EQ(r.tokens, uint64_t(masked ? mask.sum().item<int64_t>() : ids.size(0) * e.seq_len));
          eval_losses.push_back(r.loss_sum / double(r.tokens));
        }
        const se::StepResult r = eng.train_step(ids, mask);
        EXPECT_EQ(r.loss_tokens, masked ? uint64_t(mask.sum().item<int64_t>()) : r.tokens);
        losses.push_back(r.loss);
      }
      std::map<std::string, at::Tensor> params;
      for (auto& [n, p] : eng.gather_parameters()) params[n] = p;
      return std::make_tuple(losses, eval_losses, params);
    };
    for (bool masked : {false, true}) {
      const auto [plain_losses, unused, plain_params] = run(false, masked);
      const auto [losses, eval_losses, params] = run(true, masked);
      EXPECT_EQ(losses, plain_losses) << master << (masked ? " masked" : "");
      for (auto& [n, p] : plain_params) EXPECT_TRUE(at::equal(params.at(n), p)) << n;
      for (size_t s = 0; s < losses.size(); ++s)
        EXPECT_NEAR(eval_losses[s], losses[s], 1e-6 * losses[s]) << "step " << s + 1;
    }
  }
}

// A masked step equals plain libtorch on the global batch with ignored targets: the loss (mean
// over all counted targets, not a mean of micro-batch means) and the AdamW update after clipping.
// The reference sums each micro-batch's losses and divides by the global count, accumulating
// gradients micro-batch by micro-batch as the engine does (the same sums in the same order).
TEST(EngineEvaluate, MaskedStepIsTheWholeBatchLossWithIgnoredTargets) {
  json j = tiny_config(true, 2);
  j["batch"] = {{"micro_batch", 3}, {"grad_accum", 2}};
  const se::TrainConfig tc = se::parse_train_config(j.dump(), "test");
  const se::EngineConfig& e = tc.engine;
  auto comm = se::Communicator::create(se::DistEnv{}, std::chrono::seconds(30));
  auto dev = se::Device::create("cpu", 0, UINT64_MAX);
  sm::Decoder ref(tc.model, tc.init_seed);
  se::Engine eng(std::make_unique<sm::Decoder>(tc.model, tc.init_seed), e, *comm, *dev);
  std::vector<at::Tensor> params;
  for (auto& [n, p] : ref.hf_parameters()) params.push_back(p);
  torch::optim::AdamW opt(params, torch::optim::AdamWOptions(e.lr).betas({e.beta1, e.beta2}).eps(e.eps).weight_decay(e.weight_decay));
  at::Generator g = at::make_generator<at::CPUGeneratorImpl>(9);
  for (int s = 0; s < 3; ++s) {
    const at::Tensor ids = at::randint(0, 256, {e.micro_batch * e.grad_accum, e.seq_len + 1}, g, at::kLong);
    // Uneven counts per micro-batch (one row with none at all), so a per-micro-batch mean would differ.
    at::Tensor mask = at::rand({ids.size(0), e.seq_len}, g).lt(0.5 + 0.2 * s).to(at::kByte);
    mask[1].zero_();
    const se::StepResult r = eng.train_step(ids, mask);
    opt.zero_grad();
    const double count = double(mask.sum().item<int64_t>());
    double loss_sum = 0;
    for (int64_t m = 0; m < e.grad_accum; ++m) {
      const at::Tensor rows = ids.narrow(0, m * e.micro_batch, e.micro_batch);
      const at::Tensor logits = ref.forward(rows.narrow(1, 0, e.seq_len));
      const at::Tensor targets = at::where(mask.narrow(0, m * e.micro_batch, e.micro_batch).ne(0),
                                           rows.narrow(1, 1, e.seq_len), at::full({}, -100, at::kLong));
      const at::Tensor loss = at::cross_entropy_loss(logits.reshape({-1, logits.size(-1)}), targets.reshape(-1), {},
                                                     at::Reduction::Sum, -100);
      (loss / count).backward();
      loss_sum += loss.item<double>();
    }
    const double norm = torch::nn::utils::clip_grad_norm_(params, e.clip_grad_norm);
    opt.step();
    EXPECT_NEAR(r.loss, loss_sum / count, 1e-6 * loss_sum / count) << "step " << s + 1;
    // The gradient itself: its global norm before clipping.
    EXPECT_NEAR(r.grad_norm, norm, 1e-5 * norm) << "step " << s + 1;
    if (std::getenv("STRATA_TEST_VERBOSE")) printf("step %d loss %.9g / %.9g norm %.9g / %.9g\n", s + 1, r.loss, loss_sum / count, r.grad_norm, norm);
    EXPECT_EQ(r.loss_tokens, uint64_t(mask.sum().item<int64_t>()));
  }
  std::map<std::string, at::Tensor> got;
  for (auto& [n, p] : eng.gather_parameters()) got[n] = p;
  // Both backpropagate each micro-batch's summed loss / count; the engine's recompute and
  // reduce-scatter sum in another order, a rounding difference (the gradient norm agrees above)
  // that Adam's per-element normalization amplifies over three steps to ~1e-5.
  for (auto& [n, p] : ref.hf_parameters()) EXPECT_LE(relative(got.at(n), p.detach()), 5e-5) << n;
  // A global batch with no counted target is skipped: NaN loss, no update, the step count kept.
  const at::Tensor ids = at::randint(0, 256, {e.micro_batch * e.grad_accum, e.seq_len + 1}, g, at::kLong);
  const se::StepResult r = eng.train_step(ids, at::zeros({ids.size(0), e.seq_len}, at::kByte));
  EXPECT_TRUE(r.skipped);
  EXPECT_TRUE(std::isnan(r.loss));
  EXPECT_EQ(r.step, 3);
  for (auto& [n, p] : eng.gather_parameters()) EXPECT_TRUE(at::equal(p, got.at(n))) << n;
  EXPECT_EQ(eng.train_step(ids, at::ones({ids.size(0), e.seq_len}, at::kByte)).step, 4);
}

}  // namespace
