// `strata launch -n N [--port P] -- command ...`: runs N copies of a command on this node with
// the torchrun environment (RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR,
// MASTER_PORT). When one rank fails, the others are terminated (SIGTERM tagged with the failed
// rank, kPeerFailedTag in train.h; then SIGKILL after 10 s, said on stderr) and the launcher
// exits with the failing rank's status. SIGINT, SIGTERM and SIGUSR1 that a
// process sends to the launcher are passed on to every rank, as often as they came (a terminal's
// Ctrl-C reaches the ranks directly: they share the launcher's process group); a rank that then
// ends with 128 + that signal, or by it, is not a failure. A rank whose launcher dies gets
// SIGTERM.
#include <netinet/in.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <iostream>
#include <string>
#include <thread>
#include <vector>

#include "args.h"
#include "train.h"

namespace strata::cli {
namespace {

// Stop signals the launcher got. Sent by a process (kill, a scheduler): counted to be passed on
// to every rank, as often as they came. From the terminal (Ctrl-C): the ranks, in the same
// process group, got it from the terminal too, so it is only noted.
constexpr int kStopSignals[] = {SIGINT, SIGTERM, SIGUSR1};
std::atomic<unsigned> to_forward[3];
std::atomic<bool> received[3];
int stop_index(int sig) { return sig == SIGINT ? 0 : sig == SIGTERM ? 1 : 2; }
extern "C" void on_launcher_stop_signal(int sig, siginfo_t* info, void*) {
  received[stop_index(sig)].store(true);
  if (info->si_code <= 0) to_forward[stop_index(sig)].fetch_add(1);  // SI_USER, SI_QUEUE, SI_TKILL
}

constexpr const char* kLaunchUsage = R"(usage: strata launch -n N [--port P] -- command [args...]

Runs N processes of `command` on this node as data-parallel ranks 0..N-1, with RANK,
LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR=127.0.0.1 and MASTER_PORT set as
torchrun sets them. If a rank fails, the others are stopped and the launcher exits non-zero.
SIGINT, SIGTERM and SIGUSR1 are passed on to every rank (`strata train` then stops after the
current step, saving a checkpoint if it has a directory).

  -n, --nproc N   number of ranks (processes)
  --port P    rendezvous port (default: a free port)
)";

int free_port() {
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) throw std::runtime_error("socket: " + std::string(strerror(errno)));
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  a.sin_port = 0;
  socklen_t len = sizeof a;
  if (bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) != 0 ||
      getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len) != 0) {
    close(fd);
    throw std::runtime_error("cannot find a free port: " + std::string(strerror(errno)));
  }
  close(fd);
  return ntohs(a.sin_port);
}

std::string describe(int status) {
  if (WIFEXITED(status)) return "exited with status " + std::to_string(WEXITSTATUS(status));
  if (WIFSIGNALED(status)) return std::string("killed by signal ") + strsignal(WTERMSIG(status));
  return "stopped";
}

}  // namespace

int launch_main(const std::vector<std::string>& argv) {
  auto sep = std::find(argv.begin(), argv.end(), "--");
  std::vector<std::string> own(argv.begin(), sep);
  for (auto& a : own)
    if (a == "-n") a = "--nproc";
  for (const auto& a : own)
    if (a == "--help" || a == "-h") {
      std::cout << kLaunchUsage;
      return 0;
    }
  if (sep == argv.end() || sep + 1 == argv.end())
    throw std::invalid_argument("strata launch: expected `-- command [args...]`\n\n" +
                                std::string(kLaunchUsage));
  std::vector<std::string> cmd(sep + 1, argv.end());
  Args args(own, {"nproc", "port"}, {});
  const unsigned n = args.count("nproc", 0);
  if (n < 1) throw std::invalid_argument("strata launch: -n must be >= 1");
  const int port = args.has("port") ? int(args.count("port", 0)) : free_port();

  for (int sig : kStopSignals) {
    struct sigaction sa {};
    sa.sa_sigaction = on_launcher_stop_signal;
    sa.sa_flags = SA_SIGINFO;
    sigaction(sig, &sa, nullptr);
  }
  const pid_t launcher = getpid();
  std::vector<pid_t> pids(n, -1);
  for (unsigned r = 0; r < n; ++r) {
    pid_t pid = fork();
    if (pid < 0) throw std::runtime_error("fork: " + std::string(strerror(errno)));
    if (pid == 0) {
      // SIGTERM if the launcher dies (SIGKILL included), rather than training on without it
      // (the default disposition first, so that it cannot land in the launcher's handler).
      for (int sig : kStopSignals) signal(sig, SIG_DFL);
      prctl(PR_SET_PDEATHSIG, SIGTERM);
      if (getppid() != launcher) _exit(128 + SIGTERM);
      setenv("RANK", std::to_string(r).c_str(), 1);
      setenv("LOCAL_RANK", std::to_string(r).c_str(), 1);
      setenv("WORLD_SIZE", std::to_string(n).c_str(), 1);
      setenv("LOCAL_WORLD_SIZE", std::to_string(n).c_str(), 1);
      setenv("MASTER_ADDR", "127.0.0.1", 1);
      setenv("MASTER_PORT", std::to_string(port).c_str(), 1);
      std::vector<char*> cargv;
      for (auto& s : cmd) cargv.push_back(const_cast<char*>(s.c_str()));
      cargv.push_back(nullptr);
      execvp(cargv[0], cargv.data());
      std::cerr << "strata launch: cannot run " << cmd[0] << ": " << strerror(errno) << "\n";
      _exit(127);
    }
    pids[r] = pid;
  }

  int result = 0;
  unsigned running = n;
  bool stopping = false, died_by_sigint = false;
  auto stop_deadline = std::chrono::steady_clock::time_point::max();
  while (running > 0) {
    // Polled, not a blocking wait: a signal arriving just before a blocking waitpid would wait
    // for a rank to end before being passed on.
    for (int i = 0; i < 3; ++i)
      for (unsigned k = to_forward[i].exchange(0); k > 0; --k)
        for (pid_t p : pids)
          if (p > 0) kill(p, kStopSignals[i]);
    int status = 0;
    pid_t pid = waitpid(-1, &status, WNOHANG);
    if (pid < 0) {
      if (errno == EINTR) continue;
      break;
    }
    if (pid == 0) {  // nothing ended: when stopping, kill at the deadline
      if (std::chrono::steady_clock::now() > stop_deadline) {
        for (size_t r = 0; r < pids.size(); ++r)
          if (pids[r] > 0) {
            std::cerr << "strata launch: rank " << r << " is still running 10 s after SIGTERM: killing it (SIGKILL)\n";
            kill(pids[r], SIGKILL);
          }
        stop_deadline = std::chrono::steady_clock::time_point::max();
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
      continue;
    }
    auto it = std::find(pids.begin(), pids.end(), pid);
    if (it == pids.end()) continue;
    const unsigned rank = unsigned(it - pids.begin());
    *it = -1;
    --running;
    const bool failed = !(WIFEXITED(status) && WEXITSTATUS(status) == 0);
    // A rank that ended as a stop signal the launcher got asks it to (128 + signal, or by the
    // signal): expected; the others are not hurried, their save may still be running.
    bool asked = false;
    for (int i = 0; i < 3; ++i)
      asked |= received[i].load() && ((WIFEXITED(status) && WEXITSTATUS(status) == 128 + kStopSignals[i]) ||
                                      (WIFSIGNALED(status) && WTERMSIG(status) == kStopSignals[i]));
    if (asked) {
      if (result == 0) result = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
      died_by_sigint |= WIFSIGNALED(status) && WTERMSIG(status) == SIGINT;
    } else if (failed && !stopping) {
      std::cerr << "strata launch: rank " << rank << " " << describe(status)
                << "; stopping the other ranks\n";
      result = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
      stopping = true;
      stop_deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
      for (pid_t p : pids)
        if (p > 0) {
          union sigval failed_rank {};
          failed_rank.sival_int = kPeerFailedTag | int(rank & 0xffff);
          sigqueue(p, SIGTERM, failed_rank);
        }
    }
  }
  if (died_by_sigint) {  // as the ranks did: the cooperative exit a shell expects
    signal(SIGINT, SIG_DFL);
    raise(SIGINT);
  }
  return result;
}

}  // namespace strata::cli
