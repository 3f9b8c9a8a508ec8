// Stopping on a signal: SIGTERM, SIGINT and Slurm's SIGUSR1, to one rank or to the launcher's
// process group, stop every rank after the same step and save it; a second request ends at once.
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
#include "checkpoint_trainer.h"
#include "launched.h"
#include "saved_chunks.h"
#include "test_util.h"
#include "checkpoint_names.h"

namespace {

// --- stopping on a signal ------------------------------------------------------------------

// `strata train ARGS` in a child process (stderr to `err`), with `env` added (torchrun's
// variables for a rank).
pid_t spawn_train(const std::vector<std::string>& args, const std::filesystem::path& err,
                  const std::vector<std::pair<std::string, std::string>>& env = {}) {
  const pid_t pid = fork();
  if (pid == 0) {
    prctl(PR_SET_PDEATHSIG, SIGKILL);  // never outlive a crashed test binary
    for (const auto& [k, v] : env) setenv(k.c_str(), v.c_str(), 1);
    freopen(err.c_str(), "w", stderr);
    std::vector<char*> argv{const_cast<char*>(STRATA_BIN)};
    for (const std::string& a : args) argv.push_back(const_cast<char*>(a.c_str()));
    argv.push_back(nullptr);
    execv(STRATA_BIN, argv.data());
    _exit(127);
  }
  return pid;
}

// Step lines in a run log.
int64_t logged_steps(const std::filesystem::path& log) {
  const std::string text = read_file(log);
  int64_t n = 0;
  for (size_t at = 0; (at = text.find("\"step\":", at)) != std::string::npos; ++at) ++n;
  return n;
}

// The wait status of `pid`, waiting at most `limit`; kills it and fails the test past that.
int wait_for(pid_t pid, std::chrono::seconds limit, const std::string& what) {
  const auto start = std::chrono::steady_clock::now();
  int st = 0;
  while (waitpid(pid, &st, WNOHANG) == 0) {
    if (std::chrono::steady_clock::now() - start > limit) {
      kill(pid, SIGKILL);
      waitpid(pid, &st, 0);
      ADD_FAILURE() << what << " still running after " << limit.count() << " s";
      return st;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  return st;
}

// Waits (up to 90 s) until `file` holds `text` `times` times.
bool wait_for_text(const std::filesystem::path& file, const std::string& text, int64_t times = 1,
                   std::chrono::seconds timeout = std::chrono::seconds(90)) {
  const auto start = std::chrono::steady_clock::now();
  auto count = [&] {
    const std::string t = read_file(file);
    int64_t n = 0;
    for (size_t at = 0; (at = t.find(text, at)) != std::string::npos; ++at) ++n;
    return n;
  };
  while (count() < times && std::chrono::steady_clock::now() - start < timeout)
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  return count() >= times;
}
bool wait_until_steps(const std::filesystem::path& log, int64_t steps,
                      std::chrono::seconds timeout = std::chrono::seconds(90)) {
  return wait_for_text(log, "\"step\":", steps, timeout);
}

// A scheduler's SIGTERM in the middle of a run: the step under way finishes, is saved, and the
// process exits with 128 + SIGTERM; the checkpoint holds exactly the steps the log shows, it
// verifies, and a resumed run goes on from the next step.
TEST(Checkpoint, SigtermStopsAfterTheCurrentStepAndSavesIt) {
  TempDir dir;
  const auto cfg = dir / "cfg.json", log = dir / "train.jsonl", ck = dir / "ckpt";
  json j = tiny_llama(1000000);
  j["run"]["save_every"] = 1000;  // no save of its own before the signal
  std::ofstream(cfg) << j.dump(2);
  const pid_t pid = spawn_train({"train", "--config", cfg.string(), "--log", log.string(), "--checkpoint-dir",
                                 ck.string(), "--export", (dir / "never").string()},
                                dir / "err.txt");
  ASSERT_TRUE(wait_until_steps(log, 3)) << "training never got going:\n" << read_file(dir / "err.txt");
  kill(pid, SIGTERM);
  const int st = wait_for(pid, std::chrono::seconds(90), "the run after SIGTERM");
  const std::string err = read_file(dir / "err.txt");
  ASSERT_TRUE(WIFEXITED(st)) << err;
  EXPECT_EQ(WEXITSTATUS(st), 128 + SIGTERM) << err;
  const int64_t steps = logged_steps(log);
  EXPECT_NE(err.find("stopped by SIGTERM after step " + std::to_string(steps) + " of 1000000"), std::string::npos) << err;
  EXPECT_NE(err.find("not exported"), std::string::npos) << err;
  EXPECT_FALSE(std::filesystem::exists(dir / "never"));
  const auto latest = se::latest_checkpoint(ck);
  ASSERT_TRUE(latest) << err;
  char name[32];
  snprintf(name, sizeof name, "step-%08lld", (long long)steps);
  EXPECT_EQ(latest->filename().string(), name) << err;
  EXPECT_NO_THROW(se::verify_checkpoint(*latest));
  // Resumed, it starts at the step after the last one done.
  const pid_t again = spawn_train({"train", "--config", cfg.string(), "--log", (dir / "resumed.jsonl").string(),
                                   "--checkpoint-dir", ck.string(), "--resume", "--steps", std::to_string(steps + 2)},
                                  dir / "err2.txt");
  const int st2 = wait_for(again, std::chrono::seconds(90), "the resumed run");
  ASSERT_TRUE(WIFEXITED(st2) && WEXITSTATUS(st2) == 0) << read_file(dir / "err2.txt");
  const json start = json::parse(read_file(dir / "resumed.jsonl").substr(0, read_file(dir / "resumed.jsonl").find('\n')));
  EXPECT_EQ(start["first_step"].get<int64_t>(), steps + 1);
  EXPECT_EQ(logged_steps(dir / "resumed.jsonl"), 2);
}

// Without a checkpoint directory the run still stops cleanly and says that nothing is saved;
// SIGINT ends it by SIGINT (what a shell's loop expects) once that is done. A second SIGTERM
// while it stops ends it at once, as SIGTERM would; the same SIGTERM delivered twice within a
// second (a process-group kill that also comes through a launcher) does not.
TEST(Checkpoint, SigintWithoutACheckpointDirectoryAndASecondSigterm) {
  TempDir dir;
  const auto cfg = dir / "cfg.json", log = dir / "train.jsonl";
  std::ofstream(cfg) << tiny_llama(1000000).dump(2);
  pid_t pid = spawn_train({"train", "--config", cfg.string(), "--log", log.string()}, dir / "err.txt");
  ASSERT_TRUE(wait_until_steps(log, 2)) << read_file(dir / "err.txt");
  kill(pid, SIGINT);
  int st = wait_for(pid, std::chrono::seconds(90), "the run after SIGINT");
  std::string err = read_file(dir / "err.txt");
  EXPECT_TRUE(WIFSIGNALED(st) && WTERMSIG(st) == SIGINT) << "status " << st << ":\n" << err;
  EXPECT_NE(err.find("stopped by SIGINT after step"), std::string::npos) << err;
  EXPECT_NE(err.find("no checkpoint directory"), std::string::npos) << err;

  // Steps of seconds (many micro-batches: ~4 s alone on the 2-core development machine, many
  // times that beside the 4-rank tests), the first signal sent right after a step's log line (so
  // early in the next step) and the second once the first has been taken and a second has
  // passed: the step the stop waits for is still running then.
  json slow = tiny_llama(1000000);
  slow["batch"]["grad_accum"] = 1024;
  std::ofstream(cfg) << slow.dump(2);
  const auto log2 = dir / "slow.jsonl";
  pid = spawn_train({"train", "--config", cfg.string(), "--log", log2.string()}, dir / "err2.txt");
  ASSERT_TRUE(wait_until_steps(log2, 1, std::chrono::seconds(600))) << read_file(dir / "err2.txt");
  kill(pid, SIGTERM);
  kill(pid, SIGTERM);  // the same request twice at once: ignored (or merged by the kernel)
  ASSERT_TRUE(wait_for_text(dir / "err2.txt", "SIGTERM: stopping after the current step")) << read_file(dir / "err2.txt");
  std::this_thread::sleep_for(std::chrono::milliseconds(1100));  // a second request, not a repeat
  kill(pid, SIGTERM);
  st = wait_for(pid, std::chrono::seconds(90), "the run after two SIGTERMs");
  err = read_file(dir / "err2.txt");
  EXPECT_TRUE(WIFSIGNALED(st) && WTERMSIG(st) == SIGTERM) << "status " << st << ":\n" << err;
  EXPECT_EQ(err.find("stopped by SIGTERM"), std::string::npos) << "the second SIGTERM did not stop it at once:\n" << err;
}

// Two ranks: Slurm's SIGUSR1 warning to one of them, and its SIGTERM right after, stop both
// after the same step (the SIGTERM does not end the stop under way), and the checkpoint they save
// holds both ranks' state. Through `strata launch`, resumed: SIGTERM to the whole process group
// (as systemd or a pkill sends it) reaches each rank directly and again through the launcher,
// and every rank still stops cleanly; the launcher exits as they do, reporting no failure.
TEST(Checkpoint, StopSignalsToOneRankOrToTheLauncherStopEveryRankAfterTheSameStep) {
  TempDir dir;
  const auto cfg = dir / "cfg.json", log = dir / "train.jsonl", ck = dir / "ckpt";
  json j = tiny_llama(1000000);
  j["run"]["save_every"] = 1000;
  j["distributed"] = {{"timeout_s", 60}};
  std::ofstream(cfg) << j.dump(2);
  const std::string port = std::to_string(20000 + int(getpid() % 10000));
  std::vector<pid_t> ranks;
  for (int r = 0; r < 2; ++r)
    ranks.push_back(spawn_train({"train", "--config", cfg.string(), "--log", log.string(), "--checkpoint-dir", ck.string()},
                                dir / ("rank" + std::to_string(r) + ".txt"),
                                {{"RANK", std::to_string(r)}, {"WORLD_SIZE", "2"}, {"MASTER_ADDR", "127.0.0.1"},
                                 {"MASTER_PORT", port}}));
  ASSERT_TRUE(wait_until_steps(log, 3)) << read_file(dir / "rank0.txt") << read_file(dir / "rank1.txt");
  kill(ranks[1], SIGUSR1);
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
  kill(ranks[1], SIGTERM);
  // The ranks agree on the signal at a step boundary: SIGUSR1 if one came between the two.
  int status[2];
  for (int r = 0; r < 2; ++r) {
    status[r] = wait_for(ranks[r], std::chrono::seconds(90), "rank " + std::to_string(r));
    EXPECT_TRUE(WIFEXITED(status[r]) &&
                (WEXITSTATUS(status[r]) == 128 + SIGUSR1 || WEXITSTATUS(status[r]) == 128 + SIGTERM))
        << "rank " << r << " status " << status[r] << ":\n" << read_file(dir / ("rank" + std::to_string(r) + ".txt"));
  }
  EXPECT_EQ(status[0], status[1]);
  const int64_t steps = logged_steps(log);
  const std::string err0 = read_file(dir / "rank0.txt");
  EXPECT_NE(err0.find(" after step " + std::to_string(steps) + " of"), std::string::npos) << err0;
  auto latest = se::latest_checkpoint(ck);
  ASSERT_TRUE(latest) << err0;
  char name[32];
  snprintf(name, sizeof name, "step-%08lld", (long long)steps);
  EXPECT_EQ(latest->filename().string(), name) << err0;
  EXPECT_NO_THROW(se::verify_checkpoint(*latest));
  EXPECT_NE(se::describe_checkpoint(*latest).find("saved by 2 ranks"), std::string::npos) << se::describe_checkpoint(*latest);

  // Through the launcher (in a process group of its own, with its ranks), resumed.
  const auto log2 = dir / "launched.jsonl";
  const pid_t launcher = fork();
  if (launcher == 0) {
    setpgid(0, 0);
    prctl(PR_SET_PDEATHSIG, SIGKILL);
    freopen((dir / "launcher.txt").c_str(), "w", stderr);
    execl(STRATA_BIN, STRATA_BIN, "launch", "-n", "2", "--", STRATA_BIN, "train", "--config", cfg.c_str(), "--log",
          log2.c_str(), "--checkpoint-dir", ck.c_str(), "--resume", nullptr);
    _exit(127);
  }
  setpgid(launcher, launcher);  // either side may run first
  ASSERT_TRUE(wait_until_steps(log2, 2)) << read_file(dir / "launcher.txt");
  kill(-launcher, SIGTERM);
  const int st = wait_for(launcher, std::chrono::seconds(90), "the launcher");
  const std::string lerr = read_file(dir / "launcher.txt");
  EXPECT_TRUE(WIFEXITED(st) && WEXITSTATUS(st) == 128 + SIGTERM) << "status " << st << ":\n" << lerr;
  const int64_t total = steps + logged_steps(log2);
  EXPECT_NE(lerr.find("stopped by SIGTERM after step " + std::to_string(total)), std::string::npos) << lerr;
  EXPECT_EQ(lerr.find("stopping the other ranks"), std::string::npos) << "a stop was taken for a failure:\n" << lerr;
  latest = se::latest_checkpoint(ck);
  ASSERT_TRUE(latest);
  snprintf(name, sizeof name, "step-%08lld", (long long)total);
  EXPECT_EQ(latest->filename().string(), name) << lerr;
  EXPECT_NO_THROW(se::verify_checkpoint(*latest));
}

}  // namespace
