// An in-process training rank for the checkpoint tests (checkpoint_*_test.cc): a tiny Llama, a
// token corpus, an engine on the host device.
#pragma once

#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <chrono>
#include <filesystem>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "strata/engine/checkpoint.h"
#include "strata/engine/comm.h"
#include "strata/engine/config.h"
#include "strata/engine/device.h"
#include "strata/engine/engine.h"
#include "strata/models/decoder.h"
#include "strata/models/token_data.h"

namespace strata::test {

namespace se = strata::engine;
namespace sm = strata::models;
using nlohmann::json;

inline json tiny_llama(int64_t steps) {
  return {{"model", {{"preset", "llama-1b"}, {"layers", 3}, {"hidden", 64}, {"heads", 4},
                     {"kv_heads", 2}, {"intermediate", 96}, {"vocab_size", 256},
                     {"tie_embeddings", false}, {"seed", 11}}},
          {"data", {{"seq_len", 24}, {"seed", 5}}},
          {"batch", {{"micro_batch", 2}, {"grad_accum", 2}}},
          {"optimizer", {{"lr", 3e-3}, {"weight_decay", 0.05}, {"clip_grad_norm", 1.0}}},
          {"run", {{"steps", steps}, {"progress", false}}}};
}

struct Losses {
  std::vector<double> losses;
  std::vector<uint64_t> nvme_reads;  // bytes the engine read from swap in each step
  std::vector<double> wait_checkpoint;  // seconds the update waited for a save's writer
  std::vector<std::pair<std::string, at::Tensor>> params;
};

// One in-process rank: optionally loads `load_from`, trains steps [from, to), optionally saves.
class Trainer {
 public:
  explicit Trainer(const se::TrainConfig& tc)
      : Trainer(tc, se::Communicator::create(se::DistEnv{}, std::chrono::seconds(30))) {}
  // One of comm's ranks, reading its share of each global batch.
  Trainer(const se::TrainConfig& tc, std::unique_ptr<se::Communicator> comm)
      : tc_(tc),
        comm_(std::move(comm)),
        dev_(se::Device::create_host(UINT64_MAX)),
        corpus_(std::make_shared<sm::TokenCorpus>(tc.data_path, sm::parse_token_format(tc.data_format),
                                                  uint64_t(tc.model.vocab_size))),
        loader_(corpus_, uint64_t(tc.engine.seq_len),
                uint64_t(tc.engine.micro_batch * tc.engine.grad_accum) * uint64_t(comm_->world_size()),
                comm_->rank(), comm_->world_size(), tc.data_seed),
        eng_(std::make_unique<sm::Decoder>(tc.model, tc.init_seed), tc.engine, *comm_, *dev_) {}

  void train(int64_t steps, Losses& run) {
    at::Tensor ids = at::empty({tc_.engine.micro_batch * tc_.engine.grad_accum, tc_.engine.seq_len + 1}, at::kLong);
    for (int64_t s = 0; s < steps; ++s) {
      loader_.next(ids.data_ptr<int64_t>());
      const se::StepResult r = eng_.train_step(ids);
      run.losses.push_back(r.loss);
      run.nvme_reads.push_back(r.timeline.nvme_read_bytes);
      run.wait_checkpoint.push_back(r.timeline.wait_checkpoint);
      ++done_;
    }
  }
  void save(const std::filesystem::path& root, const std::string& name) {
    se::save_checkpoint(eng_, *comm_, root, name, {done_, loader_.position()});
  }
  void load(const std::filesystem::path& dir) {
    const se::CheckpointMeta m = se::load_checkpoint(eng_, *comm_, dir);
    loader_.set_position(m.samples_consumed);
    done_ = m.train_steps;
  }
  std::vector<std::pair<std::string, at::Tensor>> params() { return eng_.gather_parameters(); }
  se::Engine& engine() { return eng_; }
  se::Communicator& comm() { return *comm_; }
  se::CheckpointMeta meta() { return {done_, loader_.position()}; }

 private:
  se::TrainConfig tc_;
  std::unique_ptr<se::Communicator> comm_;
  std::unique_ptr<se::Device> dev_;
  std::shared_ptr<sm::TokenCorpus> corpus_;
  sm::BatchLoader loader_;
  se::Engine eng_;
  int64_t done_ = 0;
};

inline void expect_bitwise(const std::vector<std::pair<std::string, at::Tensor>>& a,
                    const std::vector<std::pair<std::string, at::Tensor>>& b) {
  ASSERT_EQ(a.size(), b.size());
  for (size_t i = 0; i < a.size(); ++i) {
    EXPECT_EQ(a[i].first, b[i].first);
    EXPECT_TRUE(at::equal(a[i].second, b[i].second)) << a[i].first;
  }
}

}  // namespace strata::test
