// The rendezvous's environment (DistEnv: torchrun, Slurm's srun, or one process), Slurm host
// lists, and a free loopback port for ranks of this machine.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cctype>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <stdexcept>
#include <string>
#include <vector>

#include "strata/engine/comm.h"

namespace strata::engine {
namespace {

using Lookup = std::function<const char*(const char*)>;

int env_int(const Lookup& get, const char* name, int fallback, bool* present = nullptr) {
  const char* v = get(name);
  if (present) *present = v != nullptr;
  if (!v) return fallback;
  char* end = nullptr;
  long x = std::strtol(v, &end, 10);
  if (*v == '\0' || *end != '\0' || x < 0 || x > 1 << 30)
    throw std::invalid_argument(std::string("environment variable ") + name + "=\"" + v +
                                "\" is not a non-negative integer");
  return int(x);
}

}  // namespace

int free_loopback_port() {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof addr;
  const bool ok = fd >= 0 && ::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) == 0 &&
                  ::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) == 0;
  const int err = errno;
  if (fd >= 0) ::close(fd);
  if (!ok) throw std::runtime_error("cannot find a free port on loopback: " + std::string(std::strerror(err)));
  return ntohs(addr.sin_port);
}

std::string slurm_first_host(const std::string& nodelist) {
  auto bad = [&](const std::string& why) {
    return std::invalid_argument("Slurm host list \"" + nodelist + "\": " + why);
  };
  // The first entry of the top-level comma list; in it, each bracket group [a-b,c,...] stands
  // for its first value, which is the start of its first range, zero padding kept.
  std::string host;
  for (size_t i = 0; i < nodelist.size() && nodelist[i] != ','; ++i) {
    const char c = nodelist[i];
    if (c == ']') throw bad("']' without '['");
    if (c != '[') {
      host += c;
      continue;
    }
    const size_t close = nodelist.find(']', i);
    if (close == std::string::npos) throw bad("'[' without ']'");
    const std::string group = nodelist.substr(i + 1, close - i - 1);
    const std::string first = group.substr(0, std::min(group.find(','), group.find('-')));
    if (first.empty() || first.find_first_not_of("0123456789") != std::string::npos)
      throw bad("bracket group [" + group + "] does not start with a number");
    host += first;
    i = close;
  }
  if (host.empty()) throw bad("no host");
  return host;
}

namespace {
// Slurm's tasks per node, "2(x3),1" -> {2, 2, 2, 1}; empty if malformed.
std::vector<int> slurm_tasks_per_node(const std::string& text) {
  std::vector<int> out;
  size_t i = 0;
  while (i < text.size()) {
    size_t used = 0;
    int n = 0, repeat = 1;
    try {
      n = std::stoi(text.substr(i), &used);
    } catch (const std::exception&) {
      return {};
    }
    i += used;
    if (text.compare(i, 2, "(x") == 0) {
      const size_t close = text.find(')', i);
      if (close == std::string::npos) return {};
      try {
        repeat = std::stoi(text.substr(i + 2, close - i - 2));
      } catch (const std::exception&) {
        return {};
      }
      i = close + 1;
    }
    if (n < 1 || repeat < 1 || repeat > 1 << 20) return {};
    out.insert(out.end(), size_t(repeat), n);
    if (i < text.size() && text[i++] != ',') return {};
  }
  return out;
}
}  // namespace

DistEnv DistEnv::from_env() { return from_lookup([](const char* name) { return std::getenv(name); }); }

DistEnv DistEnv::from_lookup(const Lookup& get) {
  DistEnv e;
  bool has_rank = false, has_world = false, has_procid = false, has_tasks = false;
  e.rank = env_int(get, "RANK", 0, &has_rank);
  e.world_size = env_int(get, "WORLD_SIZE", 1, &has_world);
  if (has_rank != has_world)
    throw std::invalid_argument("set both RANK and WORLD_SIZE (as torchrun does), or neither");
  if (has_rank) {
    e.launcher = "torchrun";
    e.local_rank = env_int(get, "LOCAL_RANK", e.rank);
    e.local_world_size = env_int(get, "LOCAL_WORLD_SIZE", 0);
    e.node = env_int(get, "GROUP_RANK", -1);
  } else {
    const int procid = env_int(get, "SLURM_PROCID", 0, &has_procid);
    const int tasks = env_int(get, "SLURM_STEP_NUM_TASKS", 1, &has_tasks);
    if (has_procid && has_tasks) {
      e.launcher = "slurm";
      e.rank = procid;
      e.world_size = tasks;
      e.local_rank = env_int(get, "SLURM_LOCALID", e.rank);
      e.node = env_int(get, "SLURM_NODEID", -1);
      if (!get("MASTER_ADDR")) {
        const char* nodes = get("SLURM_STEP_NODELIST");
        if (!nodes) nodes = get("SLURM_JOB_NODELIST");
        if (!nodes)
          throw std::invalid_argument("srun task without SLURM_STEP_NODELIST or SLURM_JOB_NODELIST: "
                                      "set MASTER_ADDR to the host of task 0");
        e.master_addr = slurm_first_host(nodes);
      }
      if (const char* per_node = get("SLURM_STEP_TASKS_PER_NODE")) {
        const std::vector<int> tasks_per_node = slurm_tasks_per_node(per_node);
        const int node = env_int(get, "SLURM_NODEID", 0);
        if (!tasks_per_node.empty() &&
            std::all_of(tasks_per_node.begin(), tasks_per_node.end(), [&](int n) { return n == tasks_per_node[0]; }))
          e.local_world_size = tasks_per_node[0];
        else if (get("SLURM_NODEID") && size_t(node) < tasks_per_node.size())
          e.local_world_size = tasks_per_node[size_t(node)];
      }
      if (!get("MASTER_PORT")) {
        // Job ids reach 2^32 on federated clusters (the cluster id sits in bits 26-31).
        const char* job = get("SLURM_JOB_ID");
        char* end = nullptr;
        const unsigned long long id = job ? std::strtoull(job, &end, 10) : 0;
        if (!job || !std::isdigit(static_cast<unsigned char>(*job)) || *end != '\0')
          throw std::invalid_argument(std::string("srun task without a numeric SLURM_JOB_ID") +
                                      (job ? " (\"" + std::string(job) + "\")" : "") + ": set MASTER_PORT");
        e.master_port = 20000 + int(id % 10000);
      }
    }
  }
  if (const char* a = get("MASTER_ADDR")) e.master_addr = a;
  e.master_port = env_int(get, "MASTER_PORT", e.master_port);
  if (e.world_size < 1) throw std::invalid_argument("the world size (WORLD_SIZE or SLURM_STEP_NUM_TASKS) must be >= 1");
  if (e.rank >= e.world_size)
    throw std::invalid_argument("rank " + std::to_string(e.rank) + " is not below the world size " +
                                std::to_string(e.world_size) + " (from " + e.launcher + "'s variables)");
  if (e.master_port < 1 || e.master_port > 65535)
    throw std::invalid_argument("MASTER_PORT must be in 1..65535");
  return e;
}

}  // namespace strata::engine
