// Resharded resumes: a checkpoint saved at one world size, tiling or node count (node-local
// directories exchanging slices over the communicator) resumes at another, as the run never
// stopped would have gone on (1e-5: only the reduction order differs).
#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>
#include <signal.h>
#include <sys/mount.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <atomic>
#include <cstring>
#include <fstream>
#include <functional>
#include <iomanip>
#include <numeric>
#include <thread>
#include <random>
#include <sstream>

#include "strata/engine/checkpoint.h"
#include "strata/engine/comm.h"
#include "strata/engine/config.h"
#include "strata/engine/config_parse.h"
#include "strata/engine/device.h"
#include "strata/engine/engine.h"
#include "strata/models/hf_io.h"
#include "strata/models/model_config.h"
#include "strata/models/safetensors.h"
#include "strata/models/token_data.h"
#include "strata/offload/crc32c.h"
#include "strata/offload/fault_injection.h"
#include "checkpoint_fixture.h"
#include "checkpoint_trainer.h"
#include "launched.h"
#include "saved_chunks.h"
#include "test_util.h"
#include "checkpoint_names.h"

namespace {

// An environment variable set for the processes started in its scope, then unset.
struct ScopedEnv {
  ScopedEnv(const char* name, const char* value) : name(name) { setenv(name, value, 1); }
  ~ScopedEnv() { unsetenv(name); }
  const char* name;
};

// --- resharding through the command line -----------------------------------------------------

void reshard(int before, int after) {
  TempDir dir;
  const int64_t global = 8;
  auto cfg_for = [&](int ranks, int64_t steps) {
    json j = tiny_llama(steps);
    j["batch"]["micro_batch"] = global / 2 / ranks;
    return j;
  };
  const auto ck = dir / "ckpt";
  launch(before, cfg_for(before, 20), dir, "straight",
         "--log " + (dir / "straight.jsonl").string() + " --export " + (dir / "straight").string());
  launch(before, cfg_for(before, 10), dir, "first",
         "--log " + (dir / "resumed.jsonl").string() + " --checkpoint-dir " + ck.string());
  launch(after, cfg_for(after, 20), dir, "second",
         "--log " + (dir / "resumed.jsonl").string() + " --checkpoint-dir " + ck.string() +
             " --resume --export " + (dir / "resumed").string());
  EXPECT_NE(read_file(dir / "second.out").find("resumed from"), std::string::npos);
  const std::vector<double> want = losses(dir / "straight.jsonl"), got = losses(dir / "resumed.jsonl");
  ASSERT_EQ(want.size(), 20u);
  ASSERT_EQ(got.size(), 20u);
  for (size_t i = 0; i < 20; ++i)  // only the order of the gradient reduction differs
    EXPECT_NEAR(got[i], want[i], 1e-5 * want[i]) << "step " << i + 1;
  auto a = sm::load_hf_model(dir / "straight"), b = sm::load_hf_model(dir / "resumed");
  auto pa = a->hf_parameters(), pb = b->hf_parameters();
  ASSERT_EQ(pa.size(), pb.size());
  for (size_t i = 0; i < pa.size(); ++i) {
    const double rel = (pb[i].second - pa[i].second).norm().item<double>() / pa[i].second.norm().item<double>();
    EXPECT_LE(rel, 1e-5) << pa[i].first;
  }
}

TEST(Checkpoint, ResumeAtMoreRanks2To4) { reshard(2, 4); }

TEST(Checkpoint, ResumeAtFewerRanks4To2) { reshard(4, 2); }

// Checkpoints do not depend on the tiles (placement.tiling "attention"/"mlp"/"vocab"): a save
// with blocks cut 2 x 3 and the vocabulary in 3 at 2 ranks resumes whole at 4 ranks, a save
// whole resumes cut 1 x 5 with the vocabulary in 2 in one process, and both continue as an uninterrupted run with whole blocks
// does (1e-5: the reduction order differs); `strata ckpt export` of the tiled save equals the
// tiled run's own export bit for bit (whole Hugging Face tensors assembled from the parts).
TEST(Checkpoint, TilesSavedOneWayResumeAnother) {
  TempDir dir;
  const auto cfg_for = [&](int ranks, int64_t steps, const json& tiling) {
    json j = tiny_llama(steps);
    j["batch"]["micro_batch"] = 8 / 2 / ranks;
    j["placement"] = {{"tiling", tiling}};
    // At tiny_llama's 3e-3, 20 Adam steps turn the summation order of tiles and ranks into weight
    // differences above 1e-5; at 1e-3 they stayed below it with AVX-512's kernels but not with
    // AVX2's (the embedding 1.11e-5 apart); at 5e-4 they stay below it with both.
    j["optimizer"]["lr"] = 5e-4;
    return j;
  };
  const json whole = "off", cut23 = {{"attention", 2}, {"mlp", 3}, {"vocab", 3}},
             cut15 = {{"attention", 1}, {"mlp", 5}, {"vocab", 2}};
  const auto a = dir / "a", b = dir / "b";
  launch(2, cfg_for(2, 20, whole), dir, "straight",
         "--log " + (dir / "straight.jsonl").string() + " --export " + (dir / "straight").string());
  launch(2, cfg_for(2, 10, cut23), dir, "tiled_first",
         "--log " + (dir / "tiled.jsonl").string() + " --checkpoint-dir " + a.string() + " --export " +
             (dir / "tiled10").string());
  EXPECT_NE(read_file(dir / "tiled_first.out").find("blocks in 2 attention x 3 MLP tiles"), std::string::npos)
      << read_file(dir / "tiled_first.out");
  {
    // The tiled save exported offline equals what the tiled run exported from its engine.
    const auto saved = se::latest_checkpoint(a);
    ASSERT_TRUE(saved.has_value());
    ASSERT_EQ(run_quiet(std::string(STRATA_BIN) + " ckpt export " + saved->string() + " " + (dir / "offline").string(),
                        dir / "offline.out"),
              0)
        << read_file(dir / "offline.out");
    sm::SafetensorsFile online(dir / "tiled10" / "model.safetensors"), offline(dir / "offline" / "model.safetensors");
    ASSERT_EQ(offline.tensors().size(), online.tensors().size());
    for (const sm::TensorInfo& t : online.tensors())
      EXPECT_TRUE(at::equal(st_tensor(offline, t.name), st_tensor(online, t.name))) << t.name;
  }
  {
    // Loaded whole at 4 ranks and exported before any step: the tiled save's weights, bit for bit.
    launch(4, cfg_for(4, 10, whole), dir, "reload", "--checkpoint-dir " + a.string() + " --resume --export " +
                                                        (dir / "reloaded").string());
    sm::SafetensorsFile saved(dir / "tiled10" / "model.safetensors"), reloaded(dir / "reloaded" / "model.safetensors");
    ASSERT_EQ(reloaded.tensors().size(), saved.tensors().size());
    for (const sm::TensorInfo& t : saved.tensors())
      EXPECT_TRUE(at::equal(st_tensor(reloaded, t.name), st_tensor(saved, t.name))) << "reloaded " << t.name;
  }
  launch(4, cfg_for(4, 20, whole), dir, "untiled_second",
         "--log " + (dir / "tiled.jsonl").string() + " --checkpoint-dir " + a.string() + " --resume --export " +
             (dir / "from_tiled").string());
  launch(2, cfg_for(2, 10, whole), dir, "whole_first",
         "--log " + (dir / "whole.jsonl").string() + " --checkpoint-dir " + b.string());
  launch(1, cfg_for(1, 20, cut15), dir, "tiled_second",
         "--log " + (dir / "whole.jsonl").string() + " --checkpoint-dir " + b.string() + " --resume --export " +
             (dir / "from_whole").string());
  EXPECT_NE(read_file(dir / "tiled_second.out").find("blocks in 1 attention x 5 MLP tiles; embedding and LM head in 2 vocabulary tiles"),
            std::string::npos)
      << read_file(dir / "tiled_second.out");
  const std::vector<double> want = losses(dir / "straight.jsonl");
  ASSERT_EQ(want.size(), 20u);
  for (const char* chain : {"tiled.jsonl", "whole.jsonl"}) {
    const std::vector<double> got = losses(dir / chain);
    ASSERT_EQ(got.size(), 20u) << chain;
    for (size_t i = 0; i < 20; ++i) EXPECT_NEAR(got[i], want[i], 1e-5 * want[i]) << chain << " step " << i + 1;
  }
  auto straight = sm::load_hf_model(dir / "straight");
  const auto ps = straight->hf_parameters();
  for (const char* out : {"from_tiled", "from_whole"}) {
    auto m = sm::load_hf_model(dir / out);
    const auto pm = m->hf_parameters();
    ASSERT_EQ(pm.size(), ps.size());
    for (size_t i = 0; i < ps.size(); ++i) {
      ASSERT_EQ(pm[i].first, ps[i].first);
      const double rel = (pm[i].second - ps[i].second).norm().item<double>() / ps[i].second.norm().item<double>();
      EXPECT_LE(rel, 1e-5) << out << " " << ps[i].first;
    }
  }
}

// 2 nodes x 2 ranks save, each node into its own directory (the manifest only on node 0's); 3
// nodes x 1 rank resume: node 2 sees no file and nodes 0-1 only their own, so the slices travel
// over the communicator; the numbers are those of the straight run. With node 1's files gone,
// every rank fails naming them and each node's directory.
TEST(Checkpoint, NodeLocalDirectoriesResumeAtAnotherNodeCount) {
  TempDir dir;
  const int64_t global = 24;
  auto cfg_for = [&](int ranks, int64_t steps) {
    json j = tiny_llama(steps);
    j["batch"]["micro_batch"] = global / 2 / ranks;
    return j;
  };
  launch(4, cfg_for(4, 8), dir, "straight", "--log " + (dir / "straight.jsonl").string());
  launch_on_nodes(4, 2, cfg_for(4, 4), dir, "first", "--log " + (dir / "resumed.jsonl").string() + " --checkpoint-dir ckpt");
  ASSERT_TRUE(std::filesystem::exists(dir / "node0/ckpt/step-00000004/manifest.json"));
  ASSERT_FALSE(std::filesystem::exists(dir / "node1/ckpt/step-00000004/manifest.json"));
  ASSERT_TRUE(std::filesystem::exists(dir / "node1/ckpt/step-00000004/rank-00002.data"));
  ASSERT_FALSE(std::filesystem::exists(dir / "node0/ckpt/step-00000004/rank-00002.data"));

  std::filesystem::rename(dir / "node1/ckpt", dir / "node1-away");
  launch_on_nodes(3, 1, cfg_for(3, 8), dir, "missing", "--checkpoint-dir ckpt --resume", /*expect_ok=*/false);
  const std::string missing = read_file(dir / "missing.out");
  // Every rank throws the same error (the first to exit makes the launcher stop the others, so
  // one of them printing it is what the test can count on).
  EXPECT_NE(missing.find("strata: error: checkpoint ckpt/step-00000004: rank-00002.data is missing (saved by rank 2 "
                         "of 4, needed by rank"),
            std::string::npos)
      << missing;
  EXPECT_NE(missing.find("rank-00003.data is missing (saved by rank 3 of 4"), std::string::npos) << missing;
  EXPECT_NE(missing.find("no rank of this run sees them. Where each node looked: "), std::string::npos) << missing;
  for (int n = 0; n < 3; ++n)
    EXPECT_NE(missing.find("rank " + std::to_string(n) + ": " +
                           (std::filesystem::canonical(dir.path()) / ("node" + std::to_string(n)) / "ckpt/step-00000004").string()),
              std::string::npos)
        << missing;
  std::filesystem::remove_all(dir / "node1/ckpt");
  std::filesystem::rename(dir / "node1-away", dir / "node1/ckpt");

  {
    // The exchange in rounds of at most 4 KiB in flight a rank: a chunk a round, many rounds.
    const ScopedEnv small_rounds("STRATA_EXCHANGE_BYTES", "4096");
    launch_on_nodes(3, 1, cfg_for(3, 8), dir, "second",
                    "--log " + (dir / "resumed.jsonl").string() + " --checkpoint-dir ckpt --resume");
  }
  EXPECT_NE(read_file(dir / "second.out").find("resumed from ckpt/step-00000004 after step 4"), std::string::npos)
      << read_file(dir / "second.out");
  const std::vector<double> want = losses(dir / "straight.jsonl"), got = losses(dir / "resumed.jsonl");
  ASSERT_EQ(want.size(), 8u);
  ASSERT_EQ(got.size(), 8u);
  for (size_t i = 0; i < 8; ++i) EXPECT_NEAR(got[i], want[i], 1e-5 * want[i]) << "step " << i + 1;
  // The same save and resume through one shared directory (no exchange): the state loaded over
  // the network is the same bits, so the resumed steps are equal exactly.
  launch(4, cfg_for(4, 4), dir, "shared-first", "--log " + (dir / "shared.jsonl").string() + " --checkpoint-dir " +
                                                      (dir / "shared").string());
  launch(3, cfg_for(3, 8), dir, "shared-second", "--log " + (dir / "shared.jsonl").string() + " --checkpoint-dir " +
                                                       (dir / "shared").string() + " --resume");
  const std::vector<double> shared = losses(dir / "shared.jsonl");
  ASSERT_EQ(shared.size(), 8u);
  for (size_t i = 4; i < 8; ++i) EXPECT_EQ(got[i], shared[i]) << "step " << i + 1;
}

// Node-local checkpoints saved with one cut load with another: 2 nodes x 2 ranks save with
// blocks in 2 x 3 tiles and the vocabulary in 3, each node into its own directory; 3 nodes x 1
// rank load whole blocks (node 2 sees no file, nodes 0-1 only their own, so the recut load goes
// through the exchange) and export before any step: the tiled run's own export, bit for bit.
// With node 1's files gone, every rank fails naming them. And a whole save loads cut alike.
TEST(Checkpoint, NodeLocalTiledSaveLoadsWholeAtAnotherNodeCount) {
  TempDir dir;
  auto cfg_for = [&](int ranks, const json& tiling) {
    json j = tiny_llama(4);
    j["batch"]["micro_batch"] = 24 / 2 / ranks;
    j["placement"] = {{"tiling", tiling}};
    return j;
  };
  const json cut23 = {{"attention", 2}, {"mlp", 3}, {"vocab", 3}};
  launch_on_nodes(4, 2, cfg_for(4, cut23), dir, "tiled",
                  "--checkpoint-dir ckpt --export " + (dir / "tiled4").string());
  EXPECT_NE(read_file(dir / "tiled.out").find("blocks in 2 attention x 3 MLP tiles"), std::string::npos)
      << read_file(dir / "tiled.out");
  ASSERT_TRUE(std::filesystem::exists(dir / "node1/ckpt/step-00000004/rank-00002.data"));
  ASSERT_FALSE(std::filesystem::exists(dir / "node0/ckpt/step-00000004/rank-00002.data"));

  std::filesystem::rename(dir / "node1/ckpt", dir / "node1-away");
  launch_on_nodes(3, 1, cfg_for(3, "off"), dir, "missing", "--checkpoint-dir ckpt --resume", /*expect_ok=*/false);
  const std::string missing = read_file(dir / "missing.out");
  EXPECT_NE(missing.find("rank-00002.data is missing (saved by rank 2 of 4, needed by rank"), std::string::npos)
      << missing;
  EXPECT_NE(missing.find("no rank of this run sees them. Where each node looked: "), std::string::npos) << missing;
  std::filesystem::remove_all(dir / "node1/ckpt");
  std::filesystem::rename(dir / "node1-away", dir / "node1/ckpt");

  {
    const ScopedEnv small_rounds("STRATA_EXCHANGE_BYTES", "4096");  // many rounds of the exchange
    launch_on_nodes(3, 1, cfg_for(3, "off"), dir, "whole",
                    "--checkpoint-dir ckpt --resume --export " + (dir / "whole4").string());
  }
  EXPECT_NE(read_file(dir / "whole.out").find("resumed from ckpt/step-00000004 after step 4"), std::string::npos)
      << read_file(dir / "whole.out");
  sm::SafetensorsFile saved(dir / "tiled4" / "model.safetensors"), loaded(dir / "whole4" / "model.safetensors");
  ASSERT_EQ(loaded.tensors().size(), saved.tensors().size());
  for (const sm::TensorInfo& t : saved.tensors())
    EXPECT_TRUE(at::equal(st_tensor(loaded, t.name), st_tensor(saved, t.name))) << t.name;

  // The other way: whole blocks saved node-locally load cut 1 x 5 with the vocabulary in 2 (the
  // MLP's down projection in column parts: a run a row), through the exchange alike.
  launch_on_nodes(4, 2, cfg_for(4, "off"), dir, "whole_save",
                  "--checkpoint-dir ckpt-whole --export " + (dir / "saved_whole4").string());
  const json cut15 = {{"attention", 1}, {"mlp", 5}, {"vocab", 2}};
  launch_on_nodes(3, 1, cfg_for(3, cut15), dir, "cut_load",
                  "--checkpoint-dir ckpt-whole --resume --export " + (dir / "cut4").string());
  EXPECT_NE(read_file(dir / "cut_load.out").find("blocks in 1 attention x 5 MLP tiles"), std::string::npos)
      << read_file(dir / "cut_load.out");
  sm::SafetensorsFile whole_saved(dir / "saved_whole4" / "model.safetensors"), cut(dir / "cut4" / "model.safetensors");
  ASSERT_EQ(cut.tensors().size(), whole_saved.tensors().size());
  for (const sm::TensorInfo& t : whole_saved.tensors())
    EXPECT_TRUE(at::equal(st_tensor(cut, t.name), st_tensor(whole_saved, t.name))) << "cut " << t.name;
}

}  // namespace
