// What every rank knows of its peers (comm.cc): hosts, addresses, process ids and node numbers,
// exchanged at rendezvous, and what a failed collective says with them (the peers on this host
// that are gone, the hosts that stopped answering). Thread safety: any thread (the peer list is
// immutable). Errors: exchange_peers throws std::runtime_error (a malformed list) and the store's
// errors; the diagnostics do not throw.
#pragma once

#include <torch/csrc/distributed/c10d/Store.hpp>

#include <memory>
#include <string>
#include <vector>

#include "strata/engine/comm.h"

namespace strata::engine {

// Every rank's host, the address its collectives use and its process id, exchanged through the
// store at rendezvous, so that a rank whose collective failed can say which peers on its own host
// are gone and which ranks sit behind the socket address Gloo's error names.
struct Peer {
  std::string host;
  std::string addr;  // IPv4 of the interface its Gloo device uses ("": the host name's)
  long pid = 0;
  int node = -1;     // its launcher's node number (DistEnv::node; -1: unknown)
};

// The IPv4 address of interface `name` ("" if it has none).
std::string interface_address(const std::string& name);
// This host's name.
std::string this_host();
// Every rank's "host addr pid node" line, through the store, in O(world) requests in all.
std::shared_ptr<const std::vector<Peer>> exchange_peers(c10d::Store& store, const DistEnv& env, const std::string& me);
// Which node each rank is on: its launcher's node number where every rank has one, else its host
// and address.
std::vector<std::string> node_keys(const std::vector<Peer>& peers);
// A failed collective's explanations, each "" when it has none: the peers on this host that are
// gone, the host behind the connection the error names, the hosts that do not answer.
std::string gone_peers(const std::vector<Peer>& peers, int self);
std::string lost_host(const std::vector<Peer>& peers, int self, const std::string& error);
std::string silent_hosts(const std::vector<Peer>& peers, int self);

}  // namespace strata::engine
