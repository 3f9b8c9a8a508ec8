// The peers' list and a failed collective's diagnostics (comm_peers.h).
#include "comm_peers.h"

#include <arpa/inet.h>
#include <ifaddrs.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cctype>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

namespace strata::engine {


// The IPv4 address of interface `name` ("" if it has none).
std::string interface_address(const std::string& name) {
  ifaddrs* ifs = nullptr;
  std::string out;
  if (getifaddrs(&ifs) != 0) return out;
  for (ifaddrs* i = ifs; i; i = i->ifa_next)
    if (i->ifa_addr && i->ifa_addr->sa_family == AF_INET && name == i->ifa_name) {
      char ip[INET_ADDRSTRLEN] = {};
      inet_ntop(AF_INET, &reinterpret_cast<sockaddr_in*>(i->ifa_addr)->sin_addr, ip, sizeof ip);
      out = ip;
      break;
    }
  freeifaddrs(ifs);
  return out;
}

// "; the connection to 10.0.0.2 (host h1: ranks 2, 3) is lost" when Gloo's error names the
// socket address of a peer on another host (its address known and not this rank's own: on one
// host, loopback names no one in particular); "" otherwise.
std::string lost_host(const std::vector<Peer>& peers, int self, const std::string& error) {
  // The error holds bracketed parts (Gloo's source position, then the peer's "[addr]:port").
  std::string addr, ranks, host;
  for (size_t open = error.find('['); open != std::string::npos && ranks.empty(); open = error.find('[', open + 1)) {
    const size_t close = error.find(']', open);
    if (close == std::string::npos) break;
    addr = error.substr(open + 1, close - open - 1);
    for (size_t r = 0; r < peers.size(); ++r)
      if (int(r) != self && !peers[r].addr.empty() && peers[r].addr == addr && addr != peers[size_t(self)].addr) {
        ranks += (ranks.empty() ? "" : ", ") + std::to_string(r);
        host = peers[r].host;
      }
  }
  if (ranks.empty()) return "";
  return "; the connection to " + addr + " (host " + host + ": rank" +
         (ranks.find(',') == std::string::npos ? " " : "s ") + ranks + ") is lost";
}

// Which of `addrs` answer at all within `ms`, probed at once (a rank with hundreds of peer
// hosts waits `ms`, not `ms` per host): a TCP connect to a port nothing listens on is refused
// at once by a host that is there; a host behind a cut link gives no answer (or "unreachable").
// Anything not an IPv4 address counts as answering (no claim made).
static std::vector<bool> hosts_answer(const std::vector<std::string>& addrs, int ms) {
  std::vector<bool> answered(addrs.size(), true);
  std::vector<pollfd> polls;
  std::vector<size_t> which;
  for (size_t i = 0; i < addrs.size(); ++i) {
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_port = htons(1);
    if (inet_pton(AF_INET, addrs[i].c_str(), &a.sin_addr) != 1) continue;
    const int fd = socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK, 0);
    if (fd < 0) continue;
    const bool connected = connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0;
    if (connected || errno != EINPROGRESS) {
      answered[i] = connected || errno == ECONNREFUSED;
      close(fd);
      continue;
    }
    answered[i] = false;
    polls.push_back({fd, POLLOUT, 0});
    which.push_back(i);
  }
  const auto give_up = std::chrono::steady_clock::now() + std::chrono::milliseconds(ms);
  size_t open = polls.size();
  while (open > 0) {
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(give_up - std::chrono::steady_clock::now());
    if (left.count() <= 0) break;
    const int ready = poll(polls.data(), polls.size(), int(left.count()));
    if (ready < 0 && errno == EINTR) continue;  // a signal (a launcher's SIGTERM): the deadline still holds
    if (ready <= 0) break;
    for (size_t k = 0; k < polls.size(); ++k) {
      if (polls[k].fd < 0 || polls[k].revents == 0) continue;
      int err = 0;
      socklen_t len = sizeof err;
      getsockopt(polls[k].fd, SOL_SOCKET, SO_ERROR, &err, &len);
      answered[which[k]] = err == 0 || err == ECONNREFUSED;
      close(polls[k].fd);
      polls[k].fd = -1;  // poll ignores negative descriptors
      --open;
    }
  }
  for (const pollfd& p : polls)
    if (p.fd >= 0) close(p.fd);
  return answered;
}

// After an error that names no peer (a timeout): "; host 10.0.0.2 (h1: ranks 2, 3) does not answer" for
// each other host that does not answer a connection within a second; "" if all do.
std::string silent_hosts(const std::vector<Peer>& peers, int self) {
  std::vector<std::string> addrs;
  std::vector<size_t> first_rank;
  for (size_t r = 0; r < peers.size(); ++r) {
    const std::string& addr = peers[r].addr;
    if (int(r) == self || addr.empty() || addr == peers[size_t(self)].addr ||
        std::find(addrs.begin(), addrs.end(), addr) != addrs.end())
      continue;
    addrs.push_back(addr);
    first_rank.push_back(r);
  }
  const std::vector<bool> answered = hosts_answer(addrs, 1000);
  std::string out;
  for (size_t i = 0; i < addrs.size(); ++i) {
    if (answered[i]) continue;
    std::string ranks;
    for (size_t q = 0; q < peers.size(); ++q)
      if (peers[q].addr == addrs[i]) ranks += (ranks.empty() ? "" : ", ") + std::to_string(q);
    out += "; host " + addrs[i] + " (" + peers[first_rank[i]].host + ": rank" +
           (ranks.find(',') == std::string::npos ? " " : "s ") + ranks + ") does not answer";
  }
  return out;
}

std::string this_host() {
  char name[256] = {};
  gethostname(name, sizeof name - 1);
  return name;
}

// A process that no longer exists, or has ended and waits to be reaped (a zombie).
static bool process_gone(long pid) {
  std::ifstream stat("/proc/" + std::to_string(pid) + "/stat");
  std::string line;
  if (!std::getline(stat, line)) return true;
  const size_t close = line.rfind(')');  // the command name may hold spaces and parentheses
  return close == std::string::npos || close + 2 >= line.size() || line[close + 2] == 'Z' || line[close + 2] == 'X';
}

// "; rank 2 (pid 1234 on this host) is gone", or "" when no peer on this host is gone.
// A killed process closes its sockets before it becomes a zombie: the error can come first, so
// the check is repeated for up to 0.2 s while no peer looks gone (an error path: the wait is
// cheap there).
std::string gone_peers(const std::vector<Peer>& peers, int self) {
  const std::string here = this_host();
  std::string gone;
  for (int attempt = 0; attempt < 10 && gone.empty(); ++attempt) {
    if (attempt > 0) usleep(20000);
    for (size_t r = 0; r < peers.size(); ++r)
      if (int(r) != self && peers[r].host == here && peers[r].addr == peers[size_t(self)].addr && peers[r].pid > 0 &&
          process_gone(peers[r].pid))
        gone += (gone.empty() ? "" : ", ") + std::string("rank ") + std::to_string(r) + " (pid " +
                std::to_string(peers[r].pid) + " on this host)";
  }
  if (gone.empty()) return "";
  return "; " + gone + (gone.find(", ") == std::string::npos ? " is" : " are") + " gone";
}

// Every rank's "host addr pid" line, through the store, in O(world) requests in all: each rank
// sets its own key; rank 0 reads them all and publishes one list; the others read that list
// (one request each, which waits until rank 0 has set it). Reading every peer's key from every
// rank was world^2 requests to rank 0's store: 16.7 million at 4096 ranks.
std::shared_ptr<const std::vector<Peer>> exchange_peers(c10d::Store& store, const DistEnv& env, const std::string& me) {
  store.set("strata/peer/" + std::to_string(env.rank), std::vector<uint8_t>(me.begin(), me.end()));
  std::string all;
  if (env.rank == 0) {
    for (int r = 0; r < env.world_size; ++r) {
      const std::vector<uint8_t> v = store.get("strata/peer/" + std::to_string(r));
      all.append(v.begin(), v.end()).push_back('\n');
    }
    store.set("strata/peers", std::vector<uint8_t>(all.begin(), all.end()));
  } else {
    const std::vector<uint8_t> v = store.get("strata/peers");
    all.assign(v.begin(), v.end());
  }
  auto peers = std::make_shared<std::vector<Peer>>();
  peers->reserve(size_t(env.world_size));
  for (size_t begin = 0, end; (end = all.find('\n', begin)) != std::string::npos; begin = end + 1) {
    // "host addr pid node": the address may be empty, the host name has no spaces.
    const std::string s = all.substr(begin, end - begin);
    const size_t a = s.find(' '), c = s.rfind(' '), b = c == 0 ? std::string::npos : s.rfind(' ', c - 1);
    if (a == std::string::npos || b == std::string::npos || b < a)
      throw std::runtime_error("the rendezvous's peer list has a malformed line: " + s);
    peers->push_back({s.substr(0, a), a < b ? s.substr(a + 1, b - a - 1) : "", std::atol(s.c_str() + b + 1),
                      std::atoi(s.c_str() + c + 1)});
  }
  if (peers->size() != size_t(env.world_size))
    throw std::runtime_error("the rendezvous's peer list has " + std::to_string(peers->size()) + " ranks, not " +
                             std::to_string(env.world_size));
  return peers;
}

// Which node each rank is on: its launcher's node number where every rank has one, else its host
// and address.
std::vector<std::string> node_keys(const std::vector<Peer>& peers) {
  const bool numbered = std::all_of(peers.begin(), peers.end(), [](const Peer& p) { return p.node >= 0; });
  std::vector<std::string> keys;
  for (const Peer& p : peers) keys.push_back(numbered ? std::to_string(p.node) : p.host + " " + p.addr);
  return keys;
}

}  // namespace strata::engine
