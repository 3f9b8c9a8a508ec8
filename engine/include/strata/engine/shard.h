// Each rank's share of a unit: the partition's one rule (partition.h), also used where only the
// sizes are needed (the layout's unit plan, which weighs thousands of candidate cuts).
#pragma once

#include <algorithm>
#include <cstdint>

namespace strata::engine {

// ceil(numel / world_size) rounded up to a multiple of align_numel, and at least align_numel.
inline uint64_t shard_numel_of(uint64_t numel, int world_size, uint64_t align_numel) {
  const uint64_t per_rank = (numel + uint64_t(world_size) - 1) / uint64_t(world_size);
  return std::max<uint64_t>(1, (per_rank + align_numel - 1) / align_numel) * align_numel;
}

}  // namespace strata::engine
