// Collectives that go inside a node first (comm.cc's CPU reduce-scatter across nodes): how the
// ranks sit on nodes, and the reduce-scatter in two steps.
//
// Why: a CPU reduce-scatter is an all-to-all (comm.cc), which sends each rank's copies straight
// to every other rank: of a node's G ranks, each sends (W - G) / W of the buffer off the node, G
// times what a ring or a two-step reduction sends. In two steps, the node's ranks first sum its
// copies among themselves (an all-to-all inside the node), then the ranks of one place on every
// node sum those partial sums (an all-to-all among N nodes, 1/G of the buffer): a node sends
// (N - 1) / N of the buffer off it, once: 1/G of the flat bytes. bf16 and fp16 send their partial
// sums in fp32 (so that they are rounded once, as flat): 2/G, so comm.cc takes two steps for them
// only with more than 2 ranks a node.
//
// Thread safety: none; the issuing thread. Errors: the all-to-alls' own (CommError).
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

namespace strata::engine {

struct NodeLayout {
  int nodes = 1, per_node = 1;  // N nodes of G ranks each
  int node = 0, local = 0;      // this rank's node (numbered in rank order) and its place there
  // Two steps pay off only with several nodes of several ranks.
  bool two_steps() const { return nodes > 1 && per_node > 1; }
};

// From every rank's node key (equal keys: the same node). Two steps only when the nodes hold
// equal, contiguous blocks of ranks (rank = node * G + local, as torchrun and srun's block
// distribution place them); any other placement is one flat node (nodes = 1).
NodeLayout node_layout(const std::vector<std::string>& key_of_rank, int rank);

// out (m elements) = recv's `parts` blocks of m added in order (rank order, node order), in out's
// own type (int32 sums bit patterns exactly); bf16 and fp16 in an fp32 buffer, rounded once at the
// end. The one summation of every CPU reduce-scatter, flat (comm.cc) or in two steps.
void sum_blocks(const at::Tensor& out, const at::Tensor& recv, int64_t parts);

// An equal-split all-to-all on one of the two groups, blocking: `recv` receives from each member
// in order what it sent this rank, `send` holds one equal block for each member in order.
using BlockAllToAll = std::function<void(const at::Tensor& recv, const at::Tensor& send)>;

// out (n elements) = the sum over the world's ranks of their in[rank * n, (rank + 1) * n), as
// the sum over nodes in order of each node's sum over its ranks in order (fp32 sums for bf16 and
// fp16, rounded once): deterministic, not the flat rank-order sum bit for bit. `in_node` runs on
// the node's G ranks, `across` on the N ranks of this one's place on every node. Goes in slices of
// each rank's chunk so that what it stages and receives stays within `slice_bytes` (about).
void reduce_scatter_by_node(const at::Tensor& out, const at::Tensor& in, const NodeLayout& layout,
                            uint64_t slice_bytes, const BlockAllToAll& in_node, const BlockAllToAll& across);

}  // namespace strata::engine
