#include "comm_nodes.h"

#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>

#include <algorithm>
#include <map>

namespace strata::engine {

NodeLayout node_layout(const std::vector<std::string>& key_of_rank, int rank) {
  const int world = int(key_of_rank.size());
  std::map<std::string, int> number;  // key -> node, in the order of the nodes' first ranks
  std::vector<int> node_of(key_of_rank.size());
  for (int r = 0; r < world; ++r) node_of[size_t(r)] = number.emplace(key_of_rank[size_t(r)], int(number.size())).first->second;
  const int nodes = int(number.size());
  if (nodes <= 1 || world % nodes != 0) return {};
  const int per_node = world / nodes;
  for (int r = 0; r < world; ++r)
    if (node_of[size_t(r)] != r / per_node) return {};  // not contiguous blocks of equal size
  return {nodes, per_node, rank / per_node, rank % per_node};
}

void sum_blocks(const at::Tensor& out, const at::Tensor& recv, int64_t parts) {
  const int64_t m = out.numel();
  const bool widen = out.scalar_type() == at::kBFloat16 || out.scalar_type() == at::kHalf;
  const at::Tensor sum = widen ? at::empty({m}, out.options().dtype(at::kFloat)) : out;
  sum.copy_(recv.narrow(0, 0, m));
  for (int64_t p = 1; p < parts; ++p) sum.add_(recv.narrow(0, p * m, m));
  if (widen) out.copy_(sum);
}

void reduce_scatter_by_node(const at::Tensor& out, const at::Tensor& in, const NodeLayout& L, uint64_t slice_bytes,
                            const BlockAllToAll& in_node, const BlockAllToAll& across) {
  const int64_t N = L.nodes, G = L.per_node, n = out.numel();
  const bool widen = out.scalar_type() == at::kBFloat16 || out.scalar_type() == at::kHalf;
  const at::ScalarType sum_type = widen ? at::kFloat : out.scalar_type();
  // Per slice: the staged and received copies (2 x W x len in the input's type) dominate.
  const int64_t slice =
      std::max<int64_t>(1, int64_t(slice_bytes / 2 / uint64_t(in.element_size())) / (N * G));
  const at::Tensor whole = in.view({N, G, n});  // [node][local][element]
  for (int64_t at = 0; at < n; at += slice) {
    const int64_t len = std::min(slice, n - at);
    // Inside the node: the block for place g holds every node's chunk of that place, [N][len].
    const at::Tensor staged = whole.narrow(2, at, len).permute({1, 0, 2}).contiguous().view({-1});
    const at::Tensor recv = at::empty_like(staged);
    in_node(recv, staged);
    // This node's sum for the ranks of this place on every node: [N][len], in the node's order.
    const at::Tensor partial = at::empty({N * len}, in.options().dtype(sum_type));
    sum_blocks(partial, recv, G);
    // Across the nodes: node k's partial sum of this rank's chunk, [N][len], summed in node order.
    const at::Tensor from_nodes = at::empty_like(partial);
    across(from_nodes, partial);
    sum_blocks(out.view({-1}).narrow(0, at, len), from_nodes, N);
  }
}

}  // namespace strata::engine
