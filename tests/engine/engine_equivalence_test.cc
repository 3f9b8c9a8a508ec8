// The engine against plain libtorch: same initial weights, same data, AdamW/Adam,
// gradient accumulation and clipping; fp32 on the CPU. One rank runs in this process with a
// device budget below the model's parameter bytes; 2 and 4 ranks run as `strata launch`
// processes over Gloo and are checked through their log and exported weights. Also: a rank
// killed mid-run makes the other fail with a clear error within the timeout.
#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>
#include <signal.h>
#include <sys/wait.h>
#include <torch/nn/utils/clip_grad.h>
#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <fstream>
#include <limits>
#include <map>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "strata/engine/comm.h"
#include "strata/engine/config.h"
#include "strata/engine/device.h"
#include "strata/engine/engine.h"
#include "strata/models/hf_io.h"
#include "strata/models/token_data.h"
#include "test_util.h"

namespace se = strata::engine;
namespace sm = strata::models;
using nlohmann::json;
using strata::test::TempDir;

namespace {

json tiny_config(bool llama, int64_t layers) {
  json model = llama ? json{{"preset", "llama-1b"}, {"layers", layers}, {"hidden", 64}, {"heads", 4},
                            {"kv_heads", 2}, {"intermediate", 96}, {"vocab_size", 256},
                            {"tie_embeddings", false}}
                     : json{{"preset", "gpt2"}, {"layers", layers}, {"hidden", 64}, {"heads", 4},
                            {"vocab_size", 256}, {"max_positions", 64}};
  model["seed"] = 7;
  return {{"model", model},
          {"data", {{"seq_len", 24}, {"seed", 3}}},
          {"batch", {{"micro_batch", 2}, {"grad_accum", 2}}},
          {"optimizer", {{"type", "adamw"}, {"lr", 3e-3}, {"betas", {0.9, 0.95}}, {"eps", 1e-8},
                         {"weight_decay", 0.05}, {"clip_grad_norm", 1.0}}},
          {"run", {{"steps", 20}, {"progress", false}}}};
}

struct Trajectory {
  std::vector<double> losses;
  std::vector<double> grad_norms;  // global norm before clipping
  uint64_t device_peak = 0;
  std::vector<se::StepResult> steps;
  std::map<std::string, at::Tensor> params;
};

// Plain libtorch: the whole model with autograd, gradient accumulation over the global batch in
// micro-batches of the same size (loss / count backward each), clip_grad_norm_, torch::optim.
Trajectory reference(const se::TrainConfig& tc, int world_size) {
  const se::EngineConfig& e = tc.engine;
  sm::Decoder model(tc.model, tc.init_seed);
  std::vector<at::Tensor> ps;
  for (auto& [n, p] : model.hf_parameters()) ps.push_back(p);
  std::unique_ptr<torch::optim::Optimizer> opt;
  if (e.decoupled_weight_decay)
    opt = std::make_unique<torch::optim::AdamW>(
        ps, torch::optim::AdamWOptions(e.lr).betas({e.beta1, e.beta2}).eps(e.eps).weight_decay(e.weight_decay));
  else
    opt = std::make_unique<torch::optim::Adam>(
        ps, torch::optim::AdamOptions(e.lr).betas({e.beta1, e.beta2}).eps(e.eps).weight_decay(e.weight_decay));
  auto corpus = std::make_shared<sm::TokenCorpus>(tc.data_path, sm::parse_token_format(tc.data_format),
                                                  uint64_t(tc.model.vocab_size));
  const int64_t G = e.micro_batch * e.grad_accum * world_size;
  sm::BatchLoader loader(corpus, uint64_t(e.seq_len), uint64_t(G), 0, 1, tc.data_seed);
  at::Tensor ids = at::empty({G, e.seq_len + 1}, at::kLong);
  Trajectory t;
  for (int64_t s = 0; s < tc.steps; ++s) {
    loader.next(ids.data_ptr<int64_t>());
    opt->zero_grad();
    const int64_t micro = G / e.micro_batch;
    double loss_sum = 0;
    for (int64_t m = 0; m < micro; ++m) {
      at::Tensor rows = ids.narrow(0, m * e.micro_batch, e.micro_batch);
      at::Tensor logits = model.forward(rows.narrow(1, 0, e.seq_len));
      at::Tensor loss = at::cross_entropy_loss(logits.reshape({-1, logits.size(-1)}),
                                               rows.narrow(1, 1, e.seq_len).reshape(-1));
      (loss / double(micro)).backward();
      loss_sum += loss.item<double>();
    }
    t.grad_norms.push_back(torch::nn::utils::clip_grad_norm_(
        ps, e.clip_grad_norm > 0 ? e.clip_grad_norm : std::numeric_limits<double>::infinity()));
    opt->step();
    t.losses.push_back(loss_sum / double(micro));
  }
  for (auto& [n, p] : model.hf_parameters()) t.params[n] = p.detach().clone();
  return t;
}

void expect_close(const Trajectory& got, const Trajectory& want, double rel) {
  ASSERT_EQ(got.losses.size(), want.losses.size());
  for (size_t i = 0; i < want.losses.size(); ++i)
    EXPECT_NEAR(got.losses[i], want.losses[i], rel * std::abs(want.losses[i])) << "step " << i + 1;
  ASSERT_EQ(got.grad_norms.size(), want.grad_norms.size());
  for (size_t i = 0; i < want.grad_norms.size(); ++i)
    EXPECT_NEAR(got.grad_norms[i], want.grad_norms[i], 1e-4 * want.grad_norms[i]) << "step " << i + 1;
  ASSERT_EQ(got.params.size(), want.params.size());
  for (auto& [name, w] : want.params) {
    ASSERT_TRUE(got.params.count(name)) << name;
    const at::Tensor g = got.params.at(name);
    ASSERT_EQ(g.sizes(), w.sizes()) << name;
    // Tensor-norm relative error: elementwise ratios are meaningless where Adam turns gradients
    // that are zero in exact arithmetic (GPT-2's key bias) into +-lr steps of rounding noise.
    const double err = (g - w).norm().item<double>() / w.norm().item<double>();
    // GPT-2's fused q/k/v bias holds the key bias, whose gradient is zero in exact arithmetic
    // (softmax ignores a per-query constant): both runs move it by Adam-normalized rounding
    // noise, which no order of summation reproduces. It gets a looser bound, stated here.
    const bool noise_driven = name.find("attn.c_attn.bias") != std::string::npos;
    EXPECT_LE(err, noise_driven ? 1e-3 : rel) << name << ": |engine - libtorch| / |libtorch| = " << err;
    if (getenv("STRATA_TEST_VERBOSE")) printf("%s %.3g\n", name.c_str(), err);
  }
  // The run must have moved the weights: equal by accident is not equivalence.
  EXPECT_LT(got.losses.back(), got.losses.front());
}

Trajectory run_in_process(const se::TrainConfig& tc, uint64_t budget, uint64_t* peak) {
  auto comm = se::Communicator::create(se::DistEnv{}, std::chrono::seconds(30));
  auto dev = se::Device::create_host(budget);
  const se::EngineConfig& e = tc.engine;
  auto corpus = std::make_shared<sm::TokenCorpus>(tc.data_path, sm::parse_token_format(tc.data_format),
                                                  uint64_t(tc.model.vocab_size));
  sm::BatchLoader loader(corpus, uint64_t(e.seq_len), uint64_t(e.micro_batch * e.grad_accum), 0, 1,
                         tc.data_seed);
  Trajectory t;
  {
    se::Engine eng(std::make_unique<sm::Decoder>(tc.model, tc.init_seed), e, *comm, *dev);
    at::Tensor ids = at::empty({e.micro_batch * e.grad_accum, e.seq_len + 1}, at::kLong);
    for (int64_t s = 0; s < tc.steps; ++s) {
      loader.next(ids.data_ptr<int64_t>());
      se::StepResult r = eng.train_step(ids);
      if (tc.engine.compute != se::Precision::kFp16) {
        EXPECT_FALSE(r.skipped);
        EXPECT_EQ(r.step, s + 1);
      }
      t.losses.push_back(r.loss);
      t.grad_norms.push_back(r.grad_norm);
      t.steps.push_back(r);
    }
    for (auto& [n, p] : eng.gather_parameters()) t.params[n] = p;
    *peak = dev->peak();
  }
  EXPECT_EQ(dev->used(), 0u) << "device memory left allocated after the engine";
  return t;
}

uint64_t param_bytes(const sm::ModelConfig& c) { return uint64_t(c.parameters()) * 4; }

TEST(EngineEquivalence, OneRankBudgetBelowModelGpt2Tied) {
  se::TrainConfig tc = se::parse_train_config(tiny_config(false, 8).dump(), "test");
  const uint64_t budget = 1200 * 1024;
  ASSERT_LT(budget, param_bytes(tc.model));
  uint64_t peak = 0;
  Trajectory got = run_in_process(tc, budget, &peak);
  EXPECT_GT(peak, budget / 2) << "the budget should be what limits the run";
  const Trajectory want = reference(tc, 1);
  EXPECT_GT(*std::max_element(want.grad_norms.begin(), want.grad_norms.end()), tc.engine.clip_grad_norm)
      << "clipping never engaged: the test would not check it";
  expect_close(got, want, 1e-5);
}

TEST(EngineEquivalence, OneRankLlamaAdamL2Prefetch2) {
  json j = tiny_config(true, 5);
  j["optimizer"]["type"] = "adam";
  j["optimizer"]["clip_grad_norm"] = 0.5;
  j["device"] = {{"prefetch", 2}};
  se::TrainConfig tc = se::parse_train_config(j.dump(), "test");
  uint64_t peak = 0;
  Trajectory got = run_in_process(tc, UINT64_MAX, &peak);
  expect_close(got, reference(tc, 1), 1e-5);
}

TEST(EngineEquivalence, DevicePlacedStateCountsInBudget) {
  json j = tiny_config(false, 3);
  j["placement"] = {{"params", "device"}, {"grads", "device"}, {"master", "device"}, {"moments", "device"}};
  j["run"]["steps"] = 5;
  se::TrainConfig tc = se::parse_train_config(j.dump(), "test");
  uint64_t peak = 0;
  Trajectory got = run_in_process(tc, 64ull << 20, &peak);
  // master + 2 moments + gradient (fp32) + compute copy (fp32) of every parameter
  EXPECT_GE(peak, 5 * param_bytes(tc.model));
  expect_close(got, reference(tc, 1), 1e-5);
}

TEST(EngineEquivalence, BudgetTooSmallIsAClearError) {
  se::TrainConfig tc = se::parse_train_config(tiny_config(false, 2).dump(), "test");
  auto comm = se::Communicator::create(se::DistEnv{}, std::chrono::seconds(30));
  auto dev = se::Device::create_host(64 * 1024);
  try {
    se::Engine eng(std::make_unique<sm::Decoder>(tc.model, tc.init_seed), tc.engine, *comm, *dev);
    FAIL() << "expected BudgetExceeded";
  } catch (const se::BudgetExceeded& e) {
    EXPECT_NE(std::string(e.what()).find("raise device.budget"), std::string::npos) << e.what();
  }
}

// --- mixed precision ------------------------------------------------------------------------

double relative(const at::Tensor& a, const at::Tensor& b) {
  return (a - b).norm().item<double>() / b.norm().item<double>();
}

TEST(EngineMixedPrecision, Bf16ComputeAndReduceTrackFp32) {
  json j = tiny_config(true, 3);
  j["run"]["steps"] = 12;
  const se::TrainConfig fp32 = se::parse_train_config(j.dump(), "test");
  j["precision"] = {{"compute", "bf16"}, {"reduce", "bf16"}};
  const se::TrainConfig bf16 = se::parse_train_config(j.dump(), "test");
  uint64_t peak = 0;
  const Trajectory want = run_in_process(fp32, UINT64_MAX, &peak);
  const Trajectory got = run_in_process(bf16, UINT64_MAX, &peak);
  // bf16 keeps 8 significant bits: the losses of the two runs agree to about 2^-8 relative.
  for (size_t i = 0; i < want.losses.size(); ++i)
    EXPECT_NEAR(got.losses[i], want.losses[i], 1e-2 * want.losses[i]) << "step " << i + 1;
  EXPECT_LT(got.losses.back(), got.losses.front() - 0.5);
  double worst = 0, any = 0;
  for (auto& [name, w] : want.params) {
    const double e = relative(got.params.at(name), w);
    worst = std::max(worst, e);
    any += e;
  }
  // fp32 master weights: the runs differ only through bf16 forward/backward rounding, which
  // Adam's normalized steps carry into the weights (measured 3.1e-2 after 12 steps at lr 3e-3).
  EXPECT_LT(worst, 6e-2);
  EXPECT_GT(any, 0.0) << "bf16 run identical to fp32: bf16 compute was not used";
}

TEST(EngineMixedPrecision, Fp16LossScaleSkipsOverflowingStepsThenTrains) {
  json j = tiny_config(false, 3);
  j["run"]["steps"] = 24;
  j["precision"] = {{"compute", "fp16"}, {"initial_loss_scale", 1 << 24}, {"loss_scale_window", 4}};
  const se::TrainConfig tc = se::parse_train_config(j.dump(), "test");
  uint64_t peak = 0;
  const Trajectory t = run_in_process(tc, UINT64_MAX, &peak);
  ASSERT_TRUE(t.steps.front().skipped) << "a 2^24 loss scale must overflow fp16 gradients";
  EXPECT_EQ(t.steps.front().step, 0);
  int64_t taken = 0, good_run = 0;
  double scale = double(1 << 24);
  for (size_t i = 0; i < t.steps.size(); ++i) {
    const se::StepResult& r = t.steps[i];
    EXPECT_EQ(r.loss_scale, scale) << "step " << i + 1;
    if (r.skipped) {
      scale /= 2;
      good_run = 0;
    } else {
      ++taken;
      EXPECT_TRUE(std::isfinite(r.grad_norm));
      if (++good_run == 4) scale *= 2, good_run = 0;
    }
    EXPECT_EQ(r.step, taken) << "skipped steps must not count as optimizer steps";
  }
  EXPECT_GE(taken, 12);
  EXPECT_LT(t.losses.back(), t.losses.front() - 0.3);
}

// --- multi-process ------------------------------------------------------------------------

std::string read_file(const std::filesystem::path& p) {
  std::ifstream in(p);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

int run(const std::string& cmd) {
  int st = std::system(cmd.c_str());
  return WIFEXITED(st) ? WEXITSTATUS(st) : 128;
}

Trajectory run_launched(const se::TrainConfig& tc, const json& cfg, int ranks, const TempDir& dir) {
  const auto cfg_path = dir / "config.json", log = dir / "train.jsonl", out = dir / "export";
  std::ofstream(cfg_path) << cfg.dump(2);
  const std::string cmd = std::string(STRATA_BIN) + " launch -n " + std::to_string(ranks) + " -- " +
                          STRATA_BIN + " train --config " + cfg_path.string() + " --log " +
                          log.string() + " --export " + out.string() + " > " +
                          (dir / "out.txt").string() + " 2>&1";
  EXPECT_EQ(run(cmd), 0) << read_file(dir / "out.txt");
  Trajectory t;
  std::istringstream lines(read_file(log));
  std::string line;
  while (std::getline(lines, line)) {
    json j = json::parse(line);
    if (j.contains("event")) {
      EXPECT_EQ(j["world_size"], ranks);
      continue;
    }
    t.losses.push_back(j["loss"].get<double>());
    t.grad_norms.push_back(j["grad_norm"].get<double>());
    t.device_peak = std::max<uint64_t>(t.device_peak, j["device_peak"].get<uint64_t>());
  }
  auto model = sm::load_hf_model(out);
  for (auto& [n, p] : model->hf_parameters()) t.params[n] = p.detach().clone();
  (void)tc;
  return t;
}

TEST(EngineEquivalence, TwoRanksOverGlooMatchOneProcess) {
  TempDir dir;
  json j = tiny_config(false, 4);
  se::TrainConfig tc = se::parse_train_config(j.dump(), "test");
  expect_close(run_launched(tc, j, 2, dir), reference(tc, 2), 1e-5);
}

TEST(EngineEquivalence, FourRanksOverGlooMatchOneProcessLlamaUnderBudget) {
  TempDir dir;
  json j = tiny_config(true, 3);
  j["batch"]["micro_batch"] = 1;
  // Binding: about two units fit beside the working set, so prefetch (2) is cut by the budget
  // and must be decided the same way on every rank.
  j["device"] = {{"budget", "400KiB"}, {"prefetch", 2}};
  se::TrainConfig tc = se::parse_train_config(j.dump(), "test");
  const Trajectory got = run_launched(tc, j, 4, dir);
  EXPECT_LE(got.device_peak, 400u * 1024);
  EXPECT_GT(got.device_peak, 300u * 1024) << "the budget does not bind";
  expect_close(got, reference(tc, 4), 1e-5);
}

TEST(EngineEquivalence, KilledRankMakesTheOtherFailWithinTheTimeout) {
  TempDir dir;
  json j = tiny_config(false, 4);
  j["run"]["steps"] = 100000;
  j["distributed"] = {{"timeout_s", 10}};
  const auto cfg_path = dir / "config.json", log = dir / "train.jsonl";
  std::ofstream(cfg_path) << j.dump(2);
  const int port = 20000 + int(getpid() % 20000);
  std::vector<pid_t> pids;
  for (int r = 0; r < 2; ++r) {
    pid_t pid = fork();
    ASSERT_GE(pid, 0);
    if (pid == 0) {
      setenv("RANK", std::to_string(r).c_str(), 1);
      setenv("WORLD_SIZE", "2", 1);
      setenv("MASTER_ADDR", "127.0.0.1", 1);
      setenv("MASTER_PORT", std::to_string(port).c_str(), 1);
      const std::string err = (dir / ("rank" + std::to_string(r) + ".txt")).string();
      freopen(err.c_str(), "w", stderr);
      execl(STRATA_BIN, STRATA_BIN, "train", "--config", cfg_path.c_str(), "--log", log.c_str(),
            nullptr);
      _exit(127);
    }
    pids.push_back(pid);
  }
  // Wait until training runs (a few steps logged), then kill rank 1 in the middle of a step.
  const auto start = std::chrono::steady_clock::now();
  auto lines_logged = [&] {
    const std::string text = read_file(log);
    return std::count(text.begin(), text.end(), '\n');
  };
  while (lines_logged() < 4) {
    ASSERT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(60)) << "training never started";
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  kill(pids[1], SIGKILL);
  waitpid(pids[1], nullptr, 0);
  const auto killed = std::chrono::steady_clock::now();
  int status = 0;
  pid_t done = 0;
  while ((done = waitpid(pids[0], &status, WNOHANG)) == 0 &&
         std::chrono::steady_clock::now() - killed < std::chrono::seconds(30))
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  if (done == 0) {
    kill(pids[0], SIGKILL);
    waitpid(pids[0], nullptr, 0);
    FAIL() << "rank 0 still running 30 s after its peer died (timeout 10 s)";
  }
  EXPECT_LT(std::chrono::steady_clock::now() - killed, std::chrono::seconds(15));
  const std::string err = read_file(dir / "rank0.txt");
  ASSERT_TRUE(WIFEXITED(status)) << "rank 0 died of signal " << WTERMSIG(status) << ":\n" << err;
  EXPECT_NE(WEXITSTATUS(status), 0);
  EXPECT_NE(err.find("strata: error:"), std::string::npos) << err;
  EXPECT_NE(err.find("rank 0 of 2"), std::string::npos) << err;
}

}  // namespace
