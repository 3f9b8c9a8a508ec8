// ZeRO-3 partitioning: how each fetch unit's parameters are flattened and split across the
// data-parallel ranks.
//
// A unit (the embedding stage, one block, the head; later a tile of a huge layer) lists its
// tensors in a fixed order. They are laid out back to back in one flat buffer per dtype, the
// buffer is padded with zeros to world_size * shard_numel, and rank r owns the contiguous slice
// [r * shard_numel, (r + 1) * shard_numel). shard_numel is a multiple of `align_numel` (default
// 1024 elements: 4 KiB of fp32), so every rank's slice of fp32 state is direct-I/O aligned.
// The map from tensor name to (unit, offset, shape) depends only on the units' tensor lists,
// the world size and the alignment: every rank computes the same map.
//
// A frozen unit's 4-bit tensors (model.quantize) are records of bytes in the flat buffer
// (models/quantized_base.h): a slot's offset and numel then count the buffer's elements, not the
// tensor's.
//
// Errors: std::invalid_argument for duplicate names, empty units, world_size < 1.
// Thread safety: immutable after construction.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "strata/models/quantized_base.h"

namespace strata::engine {

// Where a tensor of a unit comes from: all of a model tensor, or a part of one (a block tile's
// slice [begin, begin + shape[dim]) along `dim` of the tensor `whole` of shape `whole_shape`).
// Checkpoints, loading at another tiling and exports work on whole tensors through it.
struct TensorOrigin {
  std::string whole;                 // empty: the tensor is whole
  std::vector<int64_t> whole_shape;
  int64_t dim = 0, begin = 0;
  bool is_part() const { return !whole.empty(); }
};

struct TensorSpec {
  std::string name;
  std::vector<int64_t> shape;
  TensorOrigin origin;
  // How it is stored (models::stored_tensor): a 4-bit record of a frozen base's weight
  // (model.quantize) occupies other elements than its own, from an aligned start. numel 0: its
  // own elements, anywhere.
  models::StoredTensor stored{};
  uint64_t numel() const;
};

struct TensorSlot {
  std::string name;
  std::vector<int64_t> shape;
  uint64_t offset = 0;  // elements from the start of the unit's flat buffer
  uint64_t numel = 0;   // elements it occupies there (a 4-bit record's: not the shape's)
  TensorOrigin origin;
  bool quantized = false;  // a 4-bit record (models/quantized_base.h) of a tensor of `shape`
  // The tensor's elements (its shape's; `numel` too unless it is a 4-bit record).
  uint64_t elements() const {
    uint64_t n = 1;
    for (int64_t d : shape) n *= uint64_t(d);
    return n;
  }
  // The model tensor it is (a part of), and that tensor's shape.
  const std::string& whole_name() const { return origin.is_part() ? origin.whole : name; }
  const std::vector<int64_t>& whole_shape() const { return origin.is_part() ? origin.whole_shape : shape; }
};

// Whether `config` exempts tensor `slot` from weight decay (EngineConfig::no_decay_*): a bias is
// a 1-D tensor named "*bias", a norm weight any other 1-D tensor, an embedding a tensor named
// "*wte*", "*wpe*" or "*embed_tokens*" (a part is judged by its whole tensor).
struct EngineConfig;
bool exempt_from_weight_decay(const TensorSlot& slot, const EngineConfig& config);

struct UnitLayout {
  std::string name;
  std::vector<TensorSlot> tensors;
  uint64_t numel = 0;         // sum of the tensors' elements
  uint64_t shard_numel = 0;   // each rank's slice
  uint64_t padded_numel() const { return shard_numel * world_size; }
  uint64_t world_size = 1;
  // Frozen (model.trainable): the unit has only its compute copy; no gradient, no reduce-scatter,
  // no master weights, no moments, nothing in a checkpoint.
  bool frozen = false;
  // Rank r's slice [begin, end) of the flat buffer, and the part of it holding real elements.
  uint64_t shard_begin(int rank) const { return uint64_t(rank) * shard_numel; }
  uint64_t shard_valid_numel(int rank) const;
};

struct TensorLocation {
  size_t unit = 0;
  const TensorSlot* slot = nullptr;
};

class Partition {
 public:
  static constexpr uint64_t kDefaultAlignNumel = 1024;
  // `frozen[u]`: unit u is frozen (empty: none is).
  Partition(const std::vector<std::pair<std::string, std::vector<TensorSpec>>>& units,
            int world_size, uint64_t align_numel = kDefaultAlignNumel, const std::vector<char>& frozen = {});

  int world_size() const { return world_size_; }
  size_t num_units() const { return units_.size(); }
  const UnitLayout& unit(size_t i) const { return units_.at(i); }
  const std::vector<UnitLayout>& units() const { return units_; }
  // Throws std::out_of_range naming the tensor if unknown.
  TensorLocation locate(const std::string& name) const;
  bool frozen(size_t u) const { return units_.at(u).frozen; }
  // The units that train (not frozen), in order.
  std::vector<size_t> trainable_units() const;
  uint64_t total_numel() const;         // real elements over all units
  uint64_t total_shard_numel() const;   // one rank's elements over all units (with padding)

 private:
  int world_size_;
  std::vector<UnitLayout> units_;
  std::map<std::string, std::pair<size_t, size_t>> index_;  // name -> (unit, tensor)
};

}  // namespace strata::engine
