// Shared by the suites of tiles inside the engine (tiling_head_test.cc, tiling_blocks_test.cc,
// tiling_vocab_test.cc): their configuration, and masked steps and evaluation compared cut and whole.
#pragma once

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <chrono>
#include <functional>
#include <map>
#include <memory>
#include <string>

#include "equivalence.h"
#include "strata/engine/config_parse.h"

namespace strata::test {

inline se::TrainConfig parsed(const json& j) { return se::parse_train_config(j.dump(), "test"); }

// tiny_config at a learning rate of 1e-3: at its 3e-3, five Adam steps of this tiny model turn
// any reordering of a sum into weight differences near 1e-5 (measured: the untiled engine at 4
// ranks, whose reduce-scatter sums in another order, ends 8.5e-6 from one process), which would
// hide what the tiled loss adds.
inline json tiling_config(bool llama, int64_t layers) {
  json j = tiny_config(llama, layers);
  j["optimizer"]["lr"] = 1e-3;
  j["run"]["steps"] = 5;
  return j;
}

// Three supervised steps (a loss mask, one sequence masked out) and evaluations of `j` with
// placement.tiling `whole_tiling` and `cut_tiling`: the same counted targets, losses, norms and
// weights. `check_cut` sees the cut engine's resolved configuration.
inline void expect_masked_steps_and_evaluation_equal(const json& j, const json& whole_tiling, const json& cut_tiling,
                                                     const std::function<void(const se::EngineConfig&)>& check_cut) {
  auto comm = se::Communicator::create(se::DistEnv{}, std::chrono::seconds(30));
  const auto engine = [&](const json& tiling, std::unique_ptr<se::Device>& dev) {
    json jj = j;
    jj["placement"] = {{"tiling", tiling}};
    const se::TrainConfig tc = parsed(jj);
    dev = se::Device::create("cpu", 0, UINT64_MAX);
    return std::make_unique<se::Engine>(std::make_unique<sm::Decoder>(tc.model, tc.init_seed), tc.engine, *comm, *dev);
  };
  std::unique_ptr<se::Device> d1, d2;
  auto whole = engine(whole_tiling, d1), cut = engine(cut_tiling, d2);
  check_cut(cut->config());
  at::Generator g = at::detail::createCPUGenerator(5);
  const int64_t rows = 6, T = 24;
  for (int s = 0; s < 3; ++s) {
    const at::Tensor ids = at::randint(0, 256, {rows, T + 1}, g, at::kLong);
    at::Tensor mask = at::rand({rows, T}, g).lt(0.6).to(at::kByte);
    mask[2].zero_();
    const se::Engine::EvalResult a = whole->evaluate(ids, mask), b = cut->evaluate(ids, mask);
    EXPECT_EQ(a.tokens, b.tokens);
    EXPECT_NEAR(b.loss_sum, a.loss_sum, 1e-6 * a.loss_sum) << "evaluation " << s;
    const se::StepResult ra = whole->train_step(ids, mask), rb = cut->train_step(ids, mask);
    EXPECT_NEAR(rb.loss, ra.loss, 1e-6 * ra.loss) << "step " << s;
    EXPECT_NEAR(rb.grad_norm, ra.grad_norm, 1e-5 * ra.grad_norm) << "step " << s;
  }
  std::map<std::string, at::Tensor> w;
  for (auto& [n, p] : whole->gather_parameters()) w[n] = p;
  const auto got = cut->gather_parameters();
  EXPECT_EQ(got.size(), w.size());
  for (auto& [n, p] : got) EXPECT_LE(relative(p, w.at(n)), 1e-5) << n;
}

}  // namespace strata::test
