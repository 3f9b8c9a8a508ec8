// Several ranks in one test: forked processes over Gloo on loopback, each running the same body.
#pragma once

#include <ATen/Parallel.h>
#include <gtest/gtest.h>

#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <exception>
#include <functional>
#include <vector>

#include "strata/engine/comm.h"

namespace strata::test {

// Runs `body` as each of `world` ranks, given the rank's DistEnv (loopback, a free port); a
// rank's result is the number of wrong values it saw (an exception counts as 100). Expects every
// rank's 0. A child uses one intra-op thread (a forked process has none of its parent's pool) and
// exits without running the parent's destructors.
inline void expect_forked_ranks(int world, const std::function<int(const engine::DistEnv&)>& body) {
  const int port = engine::free_loopback_port();
  std::vector<pid_t> pids;
  for (int rank = 0; rank < world; ++rank) {
    const pid_t pid = fork();
    ASSERT_GE(pid, 0);
    if (pid > 0) {
      pids.push_back(pid);
      continue;
    }
    int bad = 0;
    try {
      at::set_num_threads(1);
      engine::DistEnv env;
      env.rank = rank;
      env.world_size = world;
      env.local_rank = rank;
      env.master_port = port;
      bad = body(env);
    } catch (const std::exception& e) {
      std::fprintf(stderr, "rank %d: %s\n", rank, e.what());
      bad = 100;
    }
    _exit(std::min(bad, 100));
  }
  for (size_t r = 0; r < pids.size(); ++r) {
    int st = 0;
    waitpid(pids[r], &st, 0);
    EXPECT_TRUE(WIFEXITED(st) && WEXITSTATUS(st) == 0) << "rank " << r << " saw wrong values or failed: status " << st;
  }
}

// The same with the rank's communicator (timeout 60 s), ending in a barrier.
inline void expect_ranks_agree(int world, const std::function<int(engine::Communicator&)>& body) {
  expect_forked_ranks(world, [&](const engine::DistEnv& env) {
    auto comm = engine::Communicator::create(env, std::chrono::seconds(60));
    const int bad = body(*comm);
    comm->barrier();
    return bad;
  });
}

}  // namespace strata::test
