// Rendezvous from the launcher's environment (DistEnv: torchrun's variables or srun's), Slurm
// host lists, and ranks on one node sharing its cores.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <future>
#include <map>
#include <stdexcept>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include <sys/wait.h>
#include <unistd.h>

#include "strata/engine/comm.h"
#include "strata/engine/config.h"
#include "strata/engine/config_parse.h"
#include "strata/engine/cpu_share.h"
#include "strata/engine/device.h"
#include "strata/engine/partition.h"
#include "strata/models/model_config.h"
#include "test_util.h"
#include "thrown_message.h"

namespace strata::engine {
namespace {

using test::contains;
using test::thrown_message;

// --- Rendezvous from the launcher's environment ---------------------------------------------

DistEnv dist_env(const std::map<std::string, std::string>& vars) {
  return DistEnv::from_lookup([&](const char* name) -> const char* {
    auto it = vars.find(name);
    return it == vars.end() ? nullptr : it->second.c_str();
  });
}

// Ranks on one node share its cores: each gets an equal share, never none.
TEST(CpuShare, RanksOnANodeShareItsCores) {
  const unsigned cpus = usable_cpus();
  ASSERT_GE(cpus, 1u);
  EXPECT_LE(cpus, std::max(1u, std::thread::hardware_concurrency()));
  EXPECT_EQ(cpu_threads_per_rank(1), cpus);
  EXPECT_EQ(cpu_threads_per_rank(0), cpus);  // unknown: one rank
  EXPECT_EQ(cpu_threads_per_rank(2), std::max(1u, cpus / 2));
  EXPECT_EQ(cpu_threads_per_rank(1000), 1u);

  // The intra-op threads: one rank keeps libtorch's default; several divide it; OMP_NUM_THREADS,
  // where set, is left to libtorch.
  const int before = at::get_num_threads();
  const char* omp = std::getenv("OMP_NUM_THREADS");
  const std::string kept = omp ? omp : "";
  unsetenv("OMP_NUM_THREADS");
  EXPECT_EQ(apply_compute_threads(1), before);
  EXPECT_EQ(apply_compute_threads(1000), 1);
  at::set_num_threads(before);
  setenv("OMP_NUM_THREADS", "1", 1);
  EXPECT_EQ(apply_compute_threads(2), before);
  if (omp) setenv("OMP_NUM_THREADS", kept.c_str(), 1);
  else unsetenv("OMP_NUM_THREADS");
  at::set_num_threads(before);
}

TEST(DistEnv, NoLauncherVariablesMeanOneProcess) {
  const DistEnv e = dist_env({{"SLURM_JOB_ID", "77"}, {"SLURM_PROCID", "0"}, {"SLURM_NTASKS", "8"}});
  // A batch script's own shell has SLURM_PROCID and SLURM_NTASKS but no step task count:
  // `strata train` run there directly is one process, not rank 0 waiting for 7 that never come.
  EXPECT_EQ(e.launcher, "none");
  EXPECT_EQ(e.rank, 0);
  EXPECT_EQ(e.world_size, 1);
}

TEST(DistEnv, TorchrunVariablesAreTakenAsGiven) {
  const DistEnv e = dist_env({{"RANK", "5"}, {"WORLD_SIZE", "8"}, {"LOCAL_RANK", "1"},
                              {"MASTER_ADDR", "node7"}, {"MASTER_PORT", "31000"}});
  EXPECT_EQ(e.launcher, "torchrun");
  EXPECT_EQ(e.rank, 5);
  EXPECT_EQ(e.world_size, 8);
  EXPECT_EQ(e.local_rank, 1);
  EXPECT_EQ(e.master_addr, "node7");
  EXPECT_EQ(e.master_port, 31000);
  // LOCAL_RANK defaults to RANK, the address and port to torchrun's defaults.
  const DistEnv d = dist_env({{"RANK", "1"}, {"WORLD_SIZE", "2"}});
  EXPECT_EQ(d.local_rank, 1);
  EXPECT_EQ(d.master_addr, "127.0.0.1");
  EXPECT_EQ(d.master_port, 29500);
}

TEST(DistEnv, SrunTasksTakeRankWorldLocalRankAndRendezvousFromSlurm) {
  const std::map<std::string, std::string> task = {
      {"SLURM_JOB_ID", "123456"},  {"SLURM_PROCID", "13"},
      {"SLURM_STEP_NUM_TASKS", "16"}, {"SLURM_LOCALID", "5"},
      {"SLURM_STEP_NODELIST", "gpu-[07-08]"}, {"SLURM_JOB_NODELIST", "gpu-[01-08]"},
      {"SLURM_NTASKS", "64"}};
  const DistEnv e = dist_env(task);
  EXPECT_EQ(e.launcher, "slurm");
  EXPECT_EQ(e.rank, 13);
  EXPECT_EQ(e.world_size, 16);  // the step's tasks, not the allocation's
  EXPECT_EQ(e.local_rank, 5);
  EXPECT_EQ(e.master_addr, "gpu-07");  // the step's first node, where srun puts task 0
  EXPECT_EQ(e.master_port, 20000 + 123456 % 10000);  // below Linux's ephemeral ports (32768)
  EXPECT_EQ(e.local_world_size, 0);  // srun did not say
  // Every task of the job computes the same rendezvous.
  auto other = task;
  other["SLURM_PROCID"] = "0";
  other["SLURM_LOCALID"] = "0";
  EXPECT_EQ(dist_env(other).master_addr, e.master_addr);
  EXPECT_EQ(dist_env(other).master_port, e.master_port);
  // MASTER_ADDR and MASTER_PORT override what Slurm implies; the job's node list serves when
  // the step's is missing.
  other["MASTER_ADDR"] = "10.1.2.3";
  other["MASTER_PORT"] = "29999";
  EXPECT_EQ(dist_env(other).master_addr, "10.1.2.3");
  EXPECT_EQ(dist_env(other).master_port, 29999);
  auto job_list = task;
  job_list.erase("SLURM_STEP_NODELIST");
  EXPECT_EQ(dist_env(job_list).master_addr, "gpu-01");
  // A federated cluster's job ids go past 2^31; and with MASTER_PORT set, the id is not needed.
  auto federated = task;
  federated["SLURM_JOB_ID"] = "4026531841";
  EXPECT_EQ(dist_env(federated).master_port, 20000 + int(4026531841ull % 10000));
  federated["SLURM_JOB_ID"] = "n/a";
  federated["MASTER_PORT"] = "29400";
  EXPECT_EQ(dist_env(federated).master_port, 29400);
}

TEST(DistEnv, SrunTasksPerNodeGiveTheLocalWorldSize) {
  std::map<std::string, std::string> task = {{"SLURM_JOB_ID", "5"}, {"SLURM_PROCID", "9"},
                                             {"SLURM_STEP_NUM_TASKS", "16"}, {"SLURM_STEP_NODELIST", "n[1-2]"},
                                             {"SLURM_NODEID", "1"}, {"SLURM_STEP_TASKS_PER_NODE", "8(x2)"}};
  EXPECT_EQ(dist_env(task).local_world_size, 8);
  task["SLURM_STEP_TASKS_PER_NODE"] = "8";
  EXPECT_EQ(dist_env(task).local_world_size, 8);
  task["SLURM_STEP_NUM_TASKS"] = "7";
  task["SLURM_PROCID"] = "6";
  task["SLURM_STEP_TASKS_PER_NODE"] = "2(x3),1";  // node 1 of 4 runs 2 tasks, node 3 one
  EXPECT_EQ(dist_env(task).local_world_size, 2);
  task["SLURM_NODEID"] = "3";
  EXPECT_EQ(dist_env(task).local_world_size, 1);
  task["SLURM_NODEID"] = "9";  // not in the list: unknown, not a guess
  EXPECT_EQ(dist_env(task).local_world_size, 0);
  task["SLURM_STEP_TASKS_PER_NODE"] = "2(x";  // malformed: unknown
  EXPECT_EQ(dist_env(task).local_world_size, 0);
  // torchrun says it outright.
  EXPECT_EQ(dist_env({{"RANK", "0"}, {"WORLD_SIZE", "16"}, {"LOCAL_WORLD_SIZE", "8"}}).local_world_size, 8);
}

TEST(DistEnv, TorchrunUnderSrunWinsOverSlurm) {
  const DistEnv e = dist_env({{"RANK", "3"}, {"WORLD_SIZE", "4"}, {"MASTER_ADDR", "a"},
                              {"SLURM_JOB_ID", "9"}, {"SLURM_PROCID", "0"},
                              {"SLURM_STEP_NUM_TASKS", "1"}, {"SLURM_STEP_NODELIST", "b"}});
  EXPECT_EQ(e.launcher, "torchrun");
  EXPECT_EQ(e.rank, 3);
  EXPECT_EQ(e.world_size, 4);
  EXPECT_EQ(e.master_addr, "a");
}

TEST(DistEnv, SlurmHostListsGiveTheirFirstHost) {
  EXPECT_EQ(slurm_first_host("node1"), "node1");
  EXPECT_EQ(slurm_first_host("node1,node2"), "node1");
  EXPECT_EQ(slurm_first_host("gnode[10,20,25,37]"), "gnode10");
  EXPECT_EQ(slurm_first_host("gpu-[007-009,012],login1"), "gpu-007");
  EXPECT_EQ(slurm_first_host("rack[2-3]-n[01-04]"), "rack2-n01");
  EXPECT_EQ(slurm_first_host("n[5]x"), "n5x");
  EXPECT_EQ(slurm_first_host("dgx-a100.cluster.local"), "dgx-a100.cluster.local");
  for (const char* bad : {"", ",node1", "node[1-3", "node1]", "node[]", "node[a-b]", "[-3]"})
    EXPECT_THROW(slurm_first_host(bad), std::invalid_argument) << bad;
}

// The message DistEnv gives for `vars` (a failure is recorded if it accepts them).
std::string dist_env_error(const std::map<std::string, std::string>& vars) {
  return thrown_message<std::invalid_argument>([&] { dist_env(vars); });
}

TEST(DistEnv, BadOrInconsistentValuesNameTheVariable) {
  EXPECT_TRUE(contains(dist_env_error({{"RANK", "1"}}), "RANK and WORLD_SIZE"));
  EXPECT_TRUE(contains(dist_env_error({{"RANK", "2"}, {"WORLD_SIZE", "2"}}), "rank 2 is not below the world size 2"));
  EXPECT_TRUE(contains(dist_env_error({{"SLURM_PROCID", "x"}, {"SLURM_STEP_NUM_TASKS", "2"}}), "SLURM_PROCID=\"x\""));
  const std::map<std::string, std::string> task = {{"SLURM_PROCID", "0"}, {"SLURM_STEP_NUM_TASKS", "2"}};
  auto with = [&](std::map<std::string, std::string> more) {
    more.insert(task.begin(), task.end());
    return more;
  };
  EXPECT_TRUE(contains(dist_env_error(with({{"SLURM_JOB_ID", "1"}, {"SLURM_STEP_NODELIST", "n[1-2"}})),
                       "Slurm host list \"n[1-2\""));
  EXPECT_TRUE(contains(dist_env_error(with({{"SLURM_STEP_NODELIST", "n1"}})), "SLURM_JOB_ID"));
  EXPECT_TRUE(contains(dist_env_error(with({{"SLURM_STEP_NODELIST", "n1"}, {"SLURM_JOB_ID", "-3"}})),
                       "numeric SLURM_JOB_ID (\"-3\"): set MASTER_PORT"));
  EXPECT_TRUE(contains(dist_env_error(with({{"SLURM_JOB_ID", "1"}})), "MASTER_ADDR"));
}

}  // namespace
}  // namespace strata::engine
