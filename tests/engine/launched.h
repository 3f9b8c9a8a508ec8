// Shared by the engine suites that run ranks as processes: `strata train` under `strata launch`
// (or as srun starts tasks, or forked one by one with torchrun's variables) with a JSON
// configuration, read back from its log and its export. Needs STRATA_BIN (the strata binary)
// defined by the test target.
#pragma once

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <optional>
#include <sstream>
#include <stdexcept>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "equivalence.h"
#include "strata/models/hf_io.h"
#include "test_util.h"

namespace strata::test {


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

// `strata launch -n ranks -- strata train --config <dir>/<tag>.json <extra>`, its output in
// <dir>/<tag>.out; the test fails unless every rank succeeds.
inline void launch(int ranks, const json& cfg, const TempDir& dir, const std::string& tag, const std::string& extra) {
  const auto cfg_path = dir / (tag + ".json");
  std::ofstream(cfg_path) << cfg.dump(2);
  const std::string cmd = std::string(STRATA_BIN) + " launch -n " + std::to_string(ranks) + " -- " +
                          STRATA_BIN + " train --config " + cfg_path.string() + " " + extra + " > " +
                          (dir / (tag + ".out")).string() + " 2>&1";
  const int st = std::system(cmd.c_str());
  ASSERT_TRUE(WIFEXITED(st) && WEXITSTATUS(st) == 0) << read_file(dir / (tag + ".out"));
}

// Checkpoints on disks each node sees differently, simulated on one machine: each rank works in
// <dir>/node<RANK / per_node>, where the relative checkpoint directory `ckpt` resolves.
inline void launch_on_nodes(int ranks, int per_node, const json& cfg, const TempDir& dir, const std::string& tag,
                            const std::string& extra, bool expect_ok = true) {
  const auto cfg_path = dir / (tag + ".json");
  std::ofstream(cfg_path) << cfg.dump(2);
  const std::string node = "\"" + dir.path().string() + "/node$((RANK / " + std::to_string(per_node) + "))\"";
  const std::string cmd = std::string(STRATA_BIN) + " launch -n " + std::to_string(ranks) + " -- sh -c 'mkdir -p " +
                          node + " && cd " + node + " && exec " + STRATA_BIN + " train --config " + cfg_path.string() +
                          " " + extra + "' > " + (dir / (tag + ".out")).string() + " 2>&1";
  const int st = std::system(cmd.c_str());
  const bool ok = WIFEXITED(st) && WEXITSTATUS(st) == 0;
  ASSERT_EQ(ok, expect_ok) << read_file(dir / (tag + ".out"));
}

// The losses of a run.log, in step order.
inline std::vector<double> losses(const std::filesystem::path& log) {
  std::vector<double> out;
  std::istringstream lines(read_file(log));
  std::string line;
  while (std::getline(lines, line)) {
    json j = json::parse(line);
    if (!j.contains("event")) out.push_back(j["loss"].get<double>());
  }
  return out;
}

// Ranks of `strata train` as separate processes with torchrun's variables and no launcher that
// would stop the others when one fails: what happens to the survivors is the engine's doing.
struct RankProcesses {
  std::vector<pid_t> pids;
  std::filesystem::path dir;
  RankProcesses() = default;
  RankProcesses(const RankProcesses&) = delete;  // the destructor kills the ranks: one owner
  RankProcesses(RankProcesses&& o) noexcept : pids(std::exchange(o.pids, {})), dir(std::move(o.dir)) {}
  std::string err(int r) const { return read_file(dir / ("rank" + std::to_string(r) + ".txt")); }
  // Lines rank 0 logged so far (its run.log: a start line, then one per step).
  long logged() const {
    const std::string text = read_file(dir / "train.jsonl");
    return std::count(text.begin(), text.end(), '\n');
  }
  // Waits up to `limit` for rank r to exit; its wait status, or nullopt if it still runs.
  std::optional<int> wait_exit(int r, std::chrono::milliseconds limit) {
    const auto start = std::chrono::steady_clock::now();
    int status = 0;
    pid_t done = 0;
    while ((done = waitpid(pids[r], &status, WNOHANG)) == 0 && std::chrono::steady_clock::now() - start < limit)
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    if (done == 0) return std::nullopt;
    pids[r] = -1;
    return status;
  }
  ~RankProcesses() {
    for (pid_t p : pids)
      if (p > 0) {
        kill(p, SIGKILL);
        waitpid(p, nullptr, 0);
      }
  }
};

// `ranks` processes of `strata train --config <dir>/config.json --log <dir>/train.jsonl`, rank r's
// stderr in <dir>/rank<r>.txt; the rendezvous on a loopback port of this test process's own.
inline RankProcesses start_ranks(const json& cfg, int ranks, const TempDir& dir) {
  RankProcesses rp;
  rp.dir = dir.path();
  const auto cfg_path = dir / "config.json", log = dir / "train.jsonl";
  std::ofstream(cfg_path) << cfg.dump(2);
  const int port = 20000 + int(getpid() % 20000);
  for (int r = 0; r < ranks; ++r) {
    pid_t pid = fork();
    if (pid < 0) throw std::runtime_error("fork failed");
    if (pid == 0) {
      setenv("RANK", std::to_string(r).c_str(), 1);
      setenv("WORLD_SIZE", std::to_string(ranks).c_str(), 1);
      setenv("MASTER_ADDR", "127.0.0.1", 1);
      setenv("MASTER_PORT", std::to_string(port).c_str(), 1);
      const std::string err = (dir / ("rank" + std::to_string(r) + ".txt")).string();
      if (!freopen(err.c_str(), "w", stderr)) _exit(126);
      execl(STRATA_BIN, STRATA_BIN, "train", "--config", cfg_path.c_str(), "--log", log.c_str(), nullptr);
      _exit(127);
    }
    rp.pids.push_back(pid);
  }
  return rp;
}

// Waits until rank 0 logged `lines` lines (training runs); fails the test after `limit`.
inline bool wait_for_training(const RankProcesses& rp, long lines,
                              std::chrono::seconds limit = std::chrono::seconds(60)) {
  const auto start = std::chrono::steady_clock::now();
  while (rp.logged() < lines) {
    if (std::chrono::steady_clock::now() - start > limit) {
      ADD_FAILURE() << "training never started:\n" << rp.err(0) << rp.err(1);
      return false;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  return true;
}

// Rank r of `rp`, exited with `status` after rank `victim` (process `victim_pid`) was killed: it
// failed by itself, saying so, and named the dead rank among the gone (a survivor that failed
// later may also name survivors that exited before it), whichever peer its error came from.
inline void expect_survivor_names_the_dead(const RankProcesses& rp, int r, int status, int victim, pid_t victim_pid) {
  const std::string err = rp.err(r);
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) != 0) << err;
  EXPECT_NE(err.find("strata: error: rank " + std::to_string(r) + ":"), std::string::npos) << err;
  EXPECT_NE(err.find("rank " + std::to_string(victim) + " (pid " + std::to_string(victim_pid) + " on this host)"),
            std::string::npos)
      << err;
  EXPECT_NE(err.find(" gone)"), std::string::npos) << err;
}

}  // namespace strata::test
