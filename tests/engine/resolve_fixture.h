// What the resolution tests share (resolve_state_test.cc, resolve_tiles_test.cc): a small model
// and its memory model, a peer whose codes are known, and a configuration with every state tier
// "auto".
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

#include "strata/engine/config.h"
#include "strata/engine/layout/memory_model.h"
#include "strata/engine/layout/resolve.h"
#include "strata/engine/layout/schedule.h"
#include "strata/engine/placement.h"

namespace strata::engine::resolve_testing {

// Embedding, three blocks, a head tied to the embedding; shards of awkward sizes.
struct Model {
  layout::Schedule schedule{{{0}, {1}, {2}, {3}, {4, 0}}, 5};
  layout::MemoryModel memory{schedule, sizes()};
  std::vector<uint64_t> shards{5120, 3072, 3584, 2560, 1536};
  StateBytes need = state_bytes(shards, 2, 3);
  static layout::ModelSizes sizes() {
    layout::ModelSizes z;
    z.padded_numel = {10240, 6144, 7168, 5120, 3072};
    z.shard_numel = {5120, 3072, 3584, 2560, 1536};
    z.compute_bytes = 2;
    z.tokens = 3 * 37;
    z.hidden = 13;
    z.vocab = 101;
    z.graph_bytes = {0, 9973, 9973, 9973, 0};
    return z;
  }
};

// The agreement of this rank with a peer that passes `peer` (element-wise maximum); counts calls.
struct Peer {
  std::vector<int64_t> peer;
  int calls = 0;
  std::vector<int64_t> last;
  Agree agree() {
    return [this](const std::vector<int64_t>& mine) {
      ++calls;
      last = mine;
      std::vector<int64_t> out = mine;
      for (size_t i = 0; i < out.size() && i < peer.size(); ++i) out[i] = std::max(out[i], peer[i]);
      return out;
    };
  }
};

inline EngineConfig all_auto() {
  EngineConfig c;
  c.params = c.grads = c.master = c.moments = Placement::kAuto;
  c.nvme_dirs = {"/swap"};  // named only: nothing here opens it
  return c;
}

}  // namespace strata::engine::resolve_testing
