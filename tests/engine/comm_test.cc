// The communicator's collectives between forked ranks over Gloo on loopback (comm.h): uneven
// all-to-alls, reduce-scatters of large buffers in slices, and across "nodes" inside each node
// first (comm_nodes.h).
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <cstdio>
#include <cstring>
#include <cstdlib>
#include <string>
#include <vector>

#include "comm_nodes.h"
#include "forked_ranks.h"
#include "strata/engine/comm.h"

namespace strata::engine {
namespace {

using test::expect_ranks_agree;

// Four ranks exchange pieces of uneven sizes, some empty, one rank receiving nothing and one
// neither sending nor receiving (as in most rounds of a checkpoint exchange); every byte arrives
// where the counts say, NaN and -0 included.
TEST(Communicator, AllToAllMovesUnevenPiecesBetweenRanksBitForBit) {
  const int world = 4;
  // counts[from][to]: elements rank `from` sends rank `to`; rank 2 receives nothing, rank 3 takes
  // no part.
  const int64_t counts[4][4] = {{2, 5, 0, 0}, {0, 3, 0, 0}, {7, 1, 0, 0}, {0, 0, 0, 0}};
  // The bit pattern of element i of what `from` sends `to`.
  const auto bits = [](int from, int to, int64_t i) { return int32_t(0x7fc00000 ^ (from << 20) ^ (to << 16) ^ int32_t(i)); };
  expect_ranks_agree(world, [&](Communicator& comm) {
    const int rank = comm.rank();
    std::vector<int64_t> in_counts, out_counts;
    std::vector<int32_t> send;
    for (int to = 0; to < world; ++to) {
      in_counts.push_back(counts[rank][to]);
      out_counts.push_back(counts[to][rank]);
      for (int64_t i = 0; i < counts[rank][to]; ++i) send.push_back(bits(rank, to, i));
    }
    if (rank == 1) send[0] = int32_t(0x80000000u);  // -0.0f
    at::Tensor in = at::empty({int64_t(send.size())}, at::kFloat);
    std::memcpy(in.data_ptr(), send.data(), send.size() * 4);
    int64_t total = 0;
    for (int64_t c : out_counts) total += c;
    at::Tensor out = at::full({total}, 1.0f);
    comm.all_to_all(out, out_counts, in, in_counts)->wait();
    const int32_t* got = static_cast<const int32_t*>(out.data_ptr());
    int bad = 0;
    for (int from = 0, at = 0; from < world; ++from)
      for (int64_t i = 0; i < counts[from][rank]; ++i, ++at)
        bad += got[at] != (from == 1 && rank == 1 && i == 0 ? int32_t(0x80000000u) : bits(from, rank, i));
    return bad;
  });
}

// A CPU reduce-scatter of a buffer over 64 MiB goes in slices (comm.cc): three ranks get, bit for
// bit, the sums in rank order a single process computes, in fp32 and in bf16 (summed in fp32,
// rounded once), with a chunk that is no multiple of a slice.
TEST(Communicator, ReduceScatterOfALargeBufferInSlicesIsTheRankOrderSum) {
  const int world = 3;
  const int64_t n = 12000001;  // a rank's chunk: a buffer of 144 MB in fp32, 72 MB in bf16
  const auto input = [&](int rank, at::ScalarType type) {
    return at::arange(int64_t(world) * n, at::kInt).remainder_(1009 + rank).to(at::kFloat).mul_(0.37f + float(rank))
        .sub_(5.0f - float(rank)).to(type);
  };
  expect_ranks_agree(world, [&](Communicator& comm) {
    int bad = 0;
    for (const at::ScalarType type : {at::kFloat, at::kBFloat16}) {
      at::Tensor out = at::empty({n}, type);
      comm.reduce_scatter(out, input(comm.rank(), type))->wait();
      at::Tensor want = input(0, type).narrow(0, comm.rank() * n, n).to(at::kFloat);
      for (int r = 1; r < world; ++r) want.add_(input(r, type).narrow(0, comm.rank() * n, n));
      bad += !at::equal(out, want.to(type));
    }
    return bad;
  });
}


// Nodes that hold equal, contiguous blocks of ranks go in two steps; any other placement, one
// node, or one rank a node is flat.
TEST(NodeLayout, EqualContiguousNodesGoInTwoSteps) {
  const NodeLayout two = node_layout({"a", "a", "a", "b", "b", "b"}, 4);
  EXPECT_TRUE(two.two_steps());
  EXPECT_EQ(two.nodes, 2);
  EXPECT_EQ(two.per_node, 3);
  EXPECT_EQ(two.node, 1);
  EXPECT_EQ(two.local, 1);
  const NodeLayout named = node_layout({"7", "7", "2", "2", "9", "9"}, 3);  // numbered by first rank
  EXPECT_EQ(named.node, 1);
  EXPECT_EQ(named.nodes, 3);
  EXPECT_FALSE(node_layout({"a", "b", "a", "b"}, 0).two_steps());       // interleaved
  EXPECT_FALSE(node_layout({"a", "a", "a", "b", "b"}, 0).two_steps());  // uneven
  EXPECT_FALSE(node_layout({"a", "a", "a", "a"}, 2).two_steps());       // one node
  EXPECT_FALSE(node_layout({"a", "b", "c"}, 1).two_steps());            // one rank a node
  EXPECT_EQ(node_layout({"a", "b", "a", "b"}, 3).nodes, 1);
}

// Six ranks on two "nodes" of three (their launcher's node numbers, as GROUP_RANK gives them):
// the CPU reduce-scatter sums inside each node first, then across the nodes, bit for bit that
// order's sums (node by node, each node's ranks in order; fp32 sums for bf16, rounded once),
// which differ from the flat rank-order sums on random inputs, so a flat reduction fails this.
// Awkward chunk sizes, a buffer small enough for one step and one that goes in slices.
TEST(Communicator, ReduceScatterAcrossNodesSumsInsideEachNodeFirst) {
  constexpr int kWorld = 6, kPerNode = 3;
  const auto input = [](int rank, int64_t n, at::ScalarType type) {
    at::manual_seed(uint64_t(1000 + rank) * 7919 + uint64_t(n));
    return at::randn({int64_t(kWorld) * n}).mul_(1.0f + float(rank)).to(type);
  };
  test::expect_forked_ranks(kWorld, [&](const DistEnv& given) {
    DistEnv env = given;
    env.node = env.rank / kPerNode;
    env.local_rank = env.rank % kPerNode;
    env.local_world_size = kPerNode;
    auto comm = Communicator::create(env, std::chrono::seconds(60));
    const int rank = comm->rank();
    int bad = 0;
    for (const int64_t n : {int64_t(1237), int64_t(1500007)}) {  // 1.5M: 36 MB of fp32 a rank, two slices
      for (const at::ScalarType type : {at::kFloat, at::kBFloat16}) {
        at::Tensor out = at::empty({n}, type);
        comm->reduce_scatter(out, input(rank, n, type))->wait();
        at::Tensor want = at::zeros({n}), flat = at::zeros({n});
        for (int node = 0; node < kWorld / kPerNode; ++node) {
          at::Tensor in_node = input(node * kPerNode, n, type).narrow(0, rank * n, n).to(at::kFloat);
          for (int l = 1; l < kPerNode; ++l) in_node.add_(input(node * kPerNode + l, n, type).narrow(0, rank * n, n));
          want.add_(in_node);
        }
        for (int r = 0; r < kWorld; ++r) flat.add_(input(r, n, type).narrow(0, rank * n, n));
        const bool same = at::equal(out, want.to(type));
        if (!same) std::fprintf(stderr, "rank %d: n %lld %s: not the in-node-first sums\n", rank, (long long)n,
                                type == at::kFloat ? "fp32" : "bf16");
        bad += !same;
        bad += type == at::kFloat && at::equal(out, flat);  // the two orders must differ somewhere
      }
    }
    comm->barrier();
    return bad;
  });
}

}  // namespace
}  // namespace strata::engine
