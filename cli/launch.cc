// `strata launch -n N [--port P] -- command ...`: runs N copies of a command on this node with
// the torchrun environment (RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR,
// MASTER_PORT). When one rank fails, the others are terminated (SIGTERM tagged with the failed
// rank, kPeerFailedTag in train.h; then SIGKILL after 10 s, said on stderr) and the launcher
// exits with the failing rank's status. SIGINT, SIGTERM and SIGUSR1 that a
// process sends to the launcher are passed on to every rank, as often as they came (a terminal's
// Ctrl-C reaches the ranks directly: they share the launcher's process group); a rank that then
// ends with 128 + that signal, or by it, is not a failure. A rank whose launcher dies gets
// SIGTERM.
#include <arpa/inet.h>
#include <ifaddrs.h>
#include <netdb.h>
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
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "args.h"
#include "strata/engine/comm.h"
#include "strata/engine/cpu_share.h"
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
       strata launch --nnodes N --node-rank R --master-addr HOST --master-port P
                     --nproc-per-node K -- command [args...]        (on each of N hosts)

Runs processes of `command` as data-parallel ranks, with RANK, LOCAL_RANK, WORLD_SIZE,
LOCAL_WORLD_SIZE, GROUP_RANK (the node's rank), MASTER_ADDR and MASTER_PORT set as torchrun sets
them: on one node, N ranks over loopback; on several, K ranks on this node, ranks R*K .. R*K+K-1
of N*K, meeting at HOST:P (node 0 is where rank 0 and the rendezvous store run). The network
interface Gloo uses is GLOO_SOCKET_IFNAME where set, else the one this host reaches HOST through;
NCCL's is NCCL_SOCKET_IFNAME where set, else the same. Both are printed at start. If a rank fails, the others on this node are stopped and the launcher
exits non-zero (ranks on other nodes fail on their own at their next collective). SIGINT,
SIGTERM and SIGUSR1 are passed on to every rank (`strata train` then stops after the current
step, saving a checkpoint if it has a directory). With K > 1, OMP_NUM_THREADS, unless set, is each
rank's share of this host's cores (the CPUs the launcher may run on, divided by K).

  -n, --nproc N, --nproc-per-node N   ranks (processes) on this node
  --port P, --master-port P           rendezvous port (one node: default a free port;
                                      several: required, the same on every node)
  --nnodes N          nodes (default 1)
  --node-rank R       this node's rank, 0 .. N-1 (default 0)
  --master-addr HOST  node 0's address (default 127.0.0.1; required with several nodes)
)";

// The interface this host reaches `addr` through (no packet is sent: a UDP socket is connected,
// and its local address looked up among the interfaces), with that address.
std::pair<std::string, std::string> interface_towards(const std::string& addr, int port) {
  addrinfo hints{}, *res = nullptr;
  hints.ai_family = AF_INET;
  hints.ai_socktype = SOCK_DGRAM;
  if (getaddrinfo(addr.c_str(), std::to_string(port).c_str(), &hints, &res) != 0 || !res)
    throw std::invalid_argument("strata launch: cannot resolve the master address " + addr);
  const int fd = socket(AF_INET, SOCK_DGRAM, 0);
  sockaddr_in local{};
  socklen_t len = sizeof local;
  const bool ok = fd >= 0 && connect(fd, res->ai_addr, res->ai_addrlen) == 0 &&
                  getsockname(fd, reinterpret_cast<sockaddr*>(&local), &len) == 0;
  freeaddrinfo(res);
  if (fd >= 0) close(fd);
  if (!ok) throw std::runtime_error("strata launch: no route to the master address " + addr + ": " + strerror(errno));
  char ip[INET_ADDRSTRLEN] = {};
  inet_ntop(AF_INET, &local.sin_addr, ip, sizeof ip);
  ifaddrs* ifs = nullptr;
  std::string name;
  if (getifaddrs(&ifs) == 0) {
    for (ifaddrs* i = ifs; i; i = i->ifa_next)
      if (i->ifa_addr && i->ifa_addr->sa_family == AF_INET &&
          reinterpret_cast<sockaddr_in*>(i->ifa_addr)->sin_addr.s_addr == local.sin_addr.s_addr)
        name = i->ifa_name;
    freeifaddrs(ifs);
  }
  if (name.empty()) throw std::runtime_error(std::string("strata launch: no interface holds ") + ip);
  return {name, ip};
}

std::string describe(int status) {
  if (WIFEXITED(status)) return "exited with status " + std::to_string(WEXITSTATUS(status));
  if (WIFSIGNALED(status)) return std::string("killed by signal ") + strsignal(WTERMSIG(status));
  return "stopped";
}

// What to run and where this node's ranks sit among all of them.
struct LaunchOptions {
  std::vector<std::string> cmd;  // the command after `--`
  unsigned n = 0;                // ranks on this node
  unsigned nodes = 1, node = 0;  // --nnodes, --node-rank
  unsigned world = 0, first = 0;  // ranks in all, this node's first rank
  std::string master;
  int port = 0;
};

// Reads the launcher's own options (before `--`) and the command; nothing when --help printed
// the usage.
std::optional<LaunchOptions> parse_launch_options(const std::vector<std::string>& argv) {
  auto sep = std::find(argv.begin(), argv.end(), "--");
  std::vector<std::string> own(argv.begin(), sep);
  for (auto& a : own)
    if (a == "-n" || a == "--nproc-per-node") a = "--nproc";
    else if (a == "--master-port") a = "--port";
    else if (a.starts_with("--nproc-per-node=")) a = "--nproc=" + a.substr(17);
    else if (a.starts_with("--master-port=")) a = "--port=" + a.substr(14);
  for (const auto& a : own)
    if (a == "--help" || a == "-h") {
      std::cout << kLaunchUsage;
      return std::nullopt;
    }
  if (sep == argv.end() || sep + 1 == argv.end())
    throw std::invalid_argument("strata launch: expected `-- command [args...]`\n\n" +
                                std::string(kLaunchUsage));
  LaunchOptions o;
  o.cmd.assign(sep + 1, argv.end());
  Args args(own, {"nproc", "port", "nnodes", "node-rank", "master-addr"}, {});
  o.n = args.count("nproc", 0);
  if (o.n < 1) throw std::invalid_argument("strata launch: -n must be >= 1");
  o.nodes = args.count("nnodes", 1);
  o.node = args.count("node-rank", 0);
  if (o.nodes < 1 || o.node >= o.nodes)
    throw std::invalid_argument("strata launch: --node-rank must be in 0 .. --nnodes - 1 (" + std::to_string(o.node) +
                                " of " + std::to_string(o.nodes) + ")");
  if (o.nodes > 1 && (!args.has("master-addr") || !args.has("port")))
    throw std::invalid_argument("strata launch: several nodes need --master-addr and --master-port, the same on every node");
  o.master = args.get("master-addr", "127.0.0.1");
  o.port = args.has("port") ? int(args.count("port", 0)) : engine::free_loopback_port();
  o.world = o.nodes * o.n;
  o.first = o.node * o.n;
  return o;
}

// Picks the network interfaces Gloo and NCCL use (for the ranks, through the environment) and
// says which, when the ranks talk beyond loopback.
void choose_interfaces(const LaunchOptions& o) {
  if (!(o.nodes > 1 || o.master.rfind("127.", 0) != 0)) return;
  std::string iface = std::getenv("GLOO_SOCKET_IFNAME") ? std::getenv("GLOO_SOCKET_IFNAME") : "";
  std::string how = "GLOO_SOCKET_IFNAME";
  if (iface.empty()) {
    const auto [name, ip] = interface_towards(o.master, o.port);
    iface = name;
    how = "the route to " + o.master + ", local address " + ip;
    setenv("GLOO_SOCKET_IFNAME", iface.c_str(), 1);
  }
  // NCCL (the ranks' GPU collectives) goes the same way unless told otherwise.
  std::string nccl = std::getenv("NCCL_SOCKET_IFNAME") ? std::getenv("NCCL_SOCKET_IFNAME") : "";
  if (nccl.empty()) {
    nccl = iface;
    setenv("NCCL_SOCKET_IFNAME", nccl.c_str(), 1);
  }
  std::cerr << "strata launch: node " << o.node << " of " << o.nodes << ", ranks " << o.first << "-" << o.first + o.n - 1
            << " of " << o.world << ", master " << o.master << ":" << o.port << ", interface " << iface << " (" << how
            << ")" << (nccl == iface ? "" : ", NCCL interface " + nccl + " (NCCL_SOCKET_IFNAME)") << std::endl;
}

// Installs the launcher's handler of the stop signals.
void install_stop_handlers() {
  for (int sig : kStopSignals) {
    struct sigaction sa {};
    sa.sa_sigaction = on_launcher_stop_signal;
    sa.sa_flags = SA_SIGINFO;
    sigaction(sig, &sa, nullptr);
  }
}

// In the child forked for local rank `r`: sets up its signals and environment and runs the
// command; does not return.
[[noreturn]] void exec_rank(const LaunchOptions& o, unsigned r, pid_t launcher, const std::string& threads_per_rank) {
  // SIGTERM if the launcher dies (SIGKILL included), rather than training on without it
  // (the default disposition first, so that it cannot land in the launcher's handler).
  for (int sig : kStopSignals) signal(sig, SIG_DFL);
  prctl(PR_SET_PDEATHSIG, SIGTERM);
  if (getppid() != launcher) _exit(128 + SIGTERM);
  setenv("RANK", std::to_string(o.first + r).c_str(), 1);
  setenv("LOCAL_RANK", std::to_string(r).c_str(), 1);
  setenv("WORLD_SIZE", std::to_string(o.world).c_str(), 1);
  setenv("LOCAL_WORLD_SIZE", std::to_string(o.n).c_str(), 1);
  setenv("GROUP_RANK", std::to_string(o.node).c_str(), 1);
  setenv("MASTER_ADDR", o.master.c_str(), 1);
  setenv("MASTER_PORT", std::to_string(o.port).c_str(), 1);
  // Each rank's share of the cores, as torchrun does (kept where the caller set it).
  if (o.n > 1) setenv("OMP_NUM_THREADS", threads_per_rank.c_str(), 0);
  std::vector<char*> cargv;
  for (auto& s : o.cmd) cargv.push_back(const_cast<char*>(s.c_str()));
  cargv.push_back(nullptr);
  execvp(cargv[0], cargv.data());
  std::cerr << "strata launch: cannot run " << o.cmd[0] << ": " << strerror(errno) << "\n";
  _exit(127);
}

// Forks this node's ranks; their pids by local rank.
std::vector<pid_t> start_ranks(const LaunchOptions& o) {
  const pid_t launcher = getpid();
  std::vector<pid_t> pids(o.n, -1);
  const std::string threads_per_rank = std::to_string(engine::cpu_threads_per_rank(int(o.n)));
  for (unsigned r = 0; r < o.n; ++r) {
    pid_t pid = fork();
    if (pid < 0) throw std::runtime_error("fork: " + std::string(strerror(errno)));
    if (pid == 0) exec_rank(o, r, launcher, threads_per_rank);
    pids[r] = pid;
  }
  return pids;
}

// Passes each stop signal a process sent the launcher since the last call on to every live rank.
void forward_stop_signals(const std::vector<pid_t>& pids) {
  for (int i = 0; i < 3; ++i)
    for (unsigned k = to_forward[i].exchange(0); k > 0; --k)
      for (pid_t p : pids)
        if (p > 0) kill(p, kStopSignals[i]);
}

// SIGKILLs the ranks still running, saying so on stderr.
void kill_remaining(const std::vector<pid_t>& pids, unsigned first) {
  for (size_t r = 0; r < pids.size(); ++r)
    if (pids[r] > 0) {
      std::cerr << "strata launch: rank " << first + r << " is still running 10 s after SIGTERM: killing it (SIGKILL)\n";
      kill(pids[r], SIGKILL);
    }
}

// Whether a rank that ended with `status` ended as a stop signal the launcher got asks it to.
bool ended_as_asked(int status) {
  bool asked = false;
  for (int i = 0; i < 3; ++i)
    asked |= received[i].load() && ((WIFEXITED(status) && WEXITSTATUS(status) == 128 + kStopSignals[i]) ||
                                    (WIFSIGNALED(status) && WTERMSIG(status) == kStopSignals[i]));
  return asked;
}

// The exit status the launcher passes on for a rank that ended with `status`.
int exit_status_of(int status) { return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status); }

// Sends every live rank SIGTERM tagged with the failed rank (kPeerFailedTag in train.h).
void stop_peers(const std::vector<pid_t>& pids, unsigned rank) {
  for (pid_t p : pids)
    if (p > 0) {
      union sigval failed_rank {};
      failed_rank.sival_int = kPeerFailedTag | int(rank & 0xffff);
      sigqueue(p, SIGTERM, failed_rank);
    }
}

// How the ranks ended, for the launcher's own exit.
struct Outcome {
  int result = 0;               // the launcher's exit status
  bool died_by_sigint = false;  // a rank was killed by a SIGINT the launcher got
};

// Waits for every rank to end: passes stop signals on, stops the others when one fails and
// kills those still running 10 s later. Ended ranks' pids become -1.
Outcome supervise_ranks(std::vector<pid_t>& pids, unsigned first) {
  Outcome out;
  unsigned running = unsigned(pids.size());
  bool stopping = false;
  auto stop_deadline = std::chrono::steady_clock::time_point::max();
  while (running > 0) {
    // Polled, not a blocking wait: a signal arriving just before a blocking waitpid would wait
    // for a rank to end before being passed on.
    forward_stop_signals(pids);
    int status = 0;
    pid_t pid = waitpid(-1, &status, WNOHANG);
    if (pid < 0) {
      if (errno == EINTR) continue;
      break;
    }
    if (pid == 0) {  // nothing ended: when stopping, kill at the deadline
      if (std::chrono::steady_clock::now() > stop_deadline) {
        kill_remaining(pids, first);
        stop_deadline = std::chrono::steady_clock::time_point::max();
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
      continue;
    }
    auto it = std::find(pids.begin(), pids.end(), pid);
    if (it == pids.end()) continue;
    const unsigned rank = first + unsigned(it - pids.begin());
    *it = -1;
    --running;
    const bool failed = !(WIFEXITED(status) && WEXITSTATUS(status) == 0);
    // A rank that ended as a stop signal the launcher got asks it to (128 + signal, or by the
    // signal): expected; the others are not hurried, their save may still be running.
    if (ended_as_asked(status)) {
      if (out.result == 0) out.result = exit_status_of(status);
      out.died_by_sigint |= WIFSIGNALED(status) && WTERMSIG(status) == SIGINT;
    } else if (failed && !stopping) {
      std::cerr << "strata launch: rank " << rank << " " << describe(status)
                << "; stopping the other ranks\n";
      out.result = exit_status_of(status);
      stopping = true;
      stop_deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
      stop_peers(pids, rank);
    }
  }
  return out;
}

// Ends the launcher as its ranks ended: their status, or SIGINT.
int exit_as_ranks_did(const Outcome& out) {
  if (out.died_by_sigint) {  // as the ranks did: the cooperative exit a shell expects
    signal(SIGINT, SIG_DFL);
    raise(SIGINT);
  }
  return out.result;
}

}  // namespace

int launch_main(const std::vector<std::string>& argv) {
  const std::optional<LaunchOptions> o = parse_launch_options(argv);
  if (!o) return 0;  // --help
  choose_interfaces(*o);
  install_stop_handlers();
  std::vector<pid_t> pids = start_ranks(*o);
  return exit_as_ranks_did(supervise_ranks(pids, o->first));
}

}  // namespace strata::cli
