// Shared by the engine suites that run ranks as processes: `strata train` under `strata launch`
// (or as srun starts tasks) with a JSON configuration, read back from its log and its export.
// Needs STRATA_BIN (the strata binary) defined by the test target.
#pragma once

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>

#include "equivalence.h"
#include "strata/models/hf_io.h"
#include "test_util.h"

namespace strata::test {

inline std::string read_file(const std::filesystem::path& p) {
  std::ifstream in(p);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

inline int run(const std::string& cmd) {
  int st = std::system(cmd.c_str());
  return WIFEXITED(st) ? WEXITSTATUS(st) : 128;
}

// How the ranks of run_launched are started: by `strata launch` (torchrun's variables), or as
// srun starts the tasks of a job step (only SLURM_* variables: rank, world, local rank, the
// rendezvous host from the step's node list and the port from the job id).
enum class Launcher { kStrataLaunch, kSrunEnvironment };

inline Trajectory run_launched(const se::TrainConfig& tc, const json& cfg, int ranks, const TempDir& dir,
                        Launcher launcher = Launcher::kStrataLaunch) {
  const auto cfg_path = dir / "config.json", log = dir / "train.jsonl", out = dir / "export";
  std::ofstream(cfg_path) << cfg.dump(2);
  const std::string train = std::string(STRATA_BIN) + " train --config " + cfg_path.string() + " --log " +
                            log.string() + " --export " + out.string();
  std::string cmd;
  if (launcher == Launcher::kStrataLaunch) {
    cmd = std::string(STRATA_BIN) + " launch -n " + std::to_string(ranks) + " -- " + train;
  } else {
    // The job id sets the port (20000 + id % 10000): one per test process.
    const std::string slurm = "env -u RANK -u WORLD_SIZE -u MASTER_ADDR -u MASTER_PORT -u LOCAL_RANK SLURM_JOB_ID=" +
                              std::to_string(getpid()) + " SLURM_STEP_NUM_TASKS=" + std::to_string(ranks) +
                              " SLURM_STEP_NODELIST=localhost SLURM_STEP_TASKS_PER_NODE=" + std::to_string(ranks) +
                              " SLURM_NODEID=0 SLURM_NTASKS=" + std::to_string(4 * ranks);
    cmd = "(";  // ranks 1.. in the background, rank 0 in the foreground, then wait for all
    for (int r = ranks - 1; r >= 0; --r)
      cmd += slurm + " SLURM_PROCID=" + std::to_string(r) + " SLURM_LOCALID=" + std::to_string(r) + " " + train +
             (r > 0 ? " & p" + std::to_string(r) + "=$!; " : "; rc=$?; ");
    for (int r = 1; r < ranks; ++r) cmd += "wait $p" + std::to_string(r) + " || rc=1; ";
    cmd += "exit $rc)";
  }
  cmd += " > " + (dir / "out.txt").string() + " 2>&1";
  EXPECT_EQ(run(cmd), 0) << read_file(dir / "out.txt");
  Trajectory t;
  std::istringstream lines(read_file(log));
  std::string line;
  while (std::getline(lines, line)) {
    json j = json::parse(line);
    if (j.contains("event")) {
      EXPECT_EQ(j["world_size"], ranks);
      EXPECT_EQ(j["launcher"], launcher == Launcher::kStrataLaunch ? "torchrun" : "slurm");
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

}  // namespace strata::test
