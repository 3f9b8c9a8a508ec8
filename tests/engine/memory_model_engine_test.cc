// The memory model is what the engine enforces: for each placement, recompute and overlap mode,
// a device budget of exactly the device-placed state plus the model's largest need runs (and
// trains to the same numbers as an unlimited budget), and one byte less is refused at
// construction, naming the budget.
#include <gtest/gtest.h>

#include <algorithm>
#include <string>
#include <vector>

#include "equivalence.h"
#include "test_util.h"

namespace strata::test {
namespace {

struct Mode {
  std::string name;
  json placement;
  json optimizer;
  bool nvme = false;
};

std::vector<Mode> modes() {
  return {
      {"state on the host, checkpoints on the host, every block recomputed",
       {{"params", "host"}, {"activations", "host"}}, {{"overlap", "forward"}}},
      {"compute copies on the device, checkpoints on the device",
       {{"params", "device"}, {"activations", "device"}}, {{"overlap", false}}},
      {"all state on the device, the last block keeps its graph",
       {{"params", "device"}, {"grads", "device"}, {"master", "device"}, {"moments", "device"}, {"recompute", 1},
        {"activations", "host"}},
       {{"overlap", false}}},
      {"update during backward, no block recomputed",
       {{"params", "host"}, {"activations", "host"}, {"recompute", "none"}},
       {{"overlap", "backward"}, {"clip_grad_norm", 0.0}}},
      {"everything in swap", {{"params", "nvme"}, {"grads", "nvme"}, {"master", "nvme"}, {"moments", "nvme"},
                              {"activations", "nvme"}}, {{"overlap", "forward"}}, true},
  };
}

TEST(MemoryModelInEngine, ThePredictedWorkingSetIsExactlyTheBudgetTheEngineNeeds) {
  for (const Mode& mode : modes()) {
    SCOPED_TRACE(mode.name);
    TempDir swap;
    json j = tiny_config(false, 2);
    j["run"]["steps"] = 2;
    j["placement"] = mode.placement;
    // Whole blocks and whole-sequence MLPs: a budget a byte short must fail here, where "auto"
    // would cut the blocks or chunk the MLPs.
    j["placement"]["tiling"] = {{"attention", "off"}, {"mlp", "off"}, {"mlp_tokens", "off"}};
    for (auto& [k, v] : mode.optimizer.items()) j["optimizer"][k] = v;
    if (mode.nvme) j["offload"] = {{"nvme_dirs", {swap.path().string()}}, {"optimizer_chunk", "16KiB"}};
    se::TrainConfig tc = se::parse_train_config(j.dump(), "test");
    tc.engine.prefetch = 0;  // what the budget check itself needs; gathering ahead is opportunistic
    auto comm = se::Communicator::create(se::DistEnv{}, std::chrono::seconds(30));

    uint64_t base = 0, need = 0;
    {
      auto dev = se::Device::create_host(UINT64_MAX);
      se::Engine eng(std::make_unique<sm::Decoder>(tc.model, tc.init_seed), tc.engine, *comm, *dev);
      base = eng.device_state_bytes();
      need = eng.memory_model().largest_need(eng.working_set_choices());
      EXPECT_EQ(base, dev->used()) << "device-placed state is what the device holds after construction";
    }
    ASSERT_GT(need, 0u);
    uint64_t peak = 0;
    const Trajectory unlimited = run_in_process(tc, UINT64_MAX, &peak);
    const Trajectory exact = run_in_process(tc, base + need, &peak);
    EXPECT_LE(peak, base + need);
    ASSERT_EQ(exact.losses.size(), unlimited.losses.size());
    for (size_t i = 0; i < exact.losses.size(); ++i) EXPECT_EQ(exact.losses[i], unlimited.losses[i]) << "step " << i + 1;

    auto dev = se::Device::create_host(base + need - 1);
    try {
      se::Engine eng(std::make_unique<sm::Decoder>(tc.model, tc.init_seed), tc.engine, *comm, *dev);
      ADD_FAILURE() << "a budget one byte under the model's need was accepted";
    } catch (const se::BudgetExceeded& e) {
      EXPECT_NE(std::string(e.what()).find("cannot run unit"), std::string::npos) << e.what();
    }
  }
}

// The head's loss is counted while it runs: with logits far larger than any unit or gradient
// buffer, the ledger's peak reaches the gathered head and the loss's bytes the model gives it,
// and stays within the model's working set.
TEST(MemoryModelInEngine, TheHeadsLossIsCountedAgainstTheBudgetWhileItRuns) {
  json j = tiny_config(false, 2);
  j["model"]["vocab_size"] = 8192;
  j["data"]["seq_len"] = 64;
  j["batch"] = {{"micro_batch", 4}, {"grad_accum", 1}};
  j["run"]["steps"] = 1;
  j["placement"] = {{"params", "host"}, {"activations", "host"}, {"tiling", "off"}};
  const se::TrainConfig tc = se::parse_train_config(j.dump(), "test");
  uint64_t loss = 0, head_units = 0, largest_grads = 0, bound = 0;
  {
    auto comm = se::Communicator::create(se::DistEnv{}, std::chrono::seconds(30));
    auto dev = se::Device::create_host(UINT64_MAX);
    se::Engine eng(std::make_unique<sm::Decoder>(tc.model, tc.init_seed), tc.engine, *comm, *dev);
    const se::layout::MemoryModel& m = eng.memory_model();
    loss = m.head_loss_bytes();
    for (const se::layout::Use& use : m.schedule().uses())
      if (use.kind == se::layout::Use::kHead) head_units = m.use_bytes(use);
    for (size_t u = 0; u < eng.partition().num_units(); ++u)
      largest_grads = std::max<uint64_t>(largest_grads, 8 * eng.partition().unit(u).padded_numel());
    bound = eng.device_state_bytes() + m.working_set(eng.working_set_choices());
  }
  ASSERT_GT(loss, 3 * largest_grads) << "the logits must outweigh every gradient buffer";
  uint64_t peak = 0;
  run_in_process(tc, UINT64_MAX, &peak);
  EXPECT_GE(peak, loss + head_units);
  EXPECT_LE(peak, bound);
}

}  // namespace
}  // namespace strata::test
