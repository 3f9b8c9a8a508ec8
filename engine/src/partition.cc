#include "strata/engine/partition.h"

#include "strata/engine/config.h"
#include "strata/engine/shard.h"

#include <algorithm>
#include <stdexcept>

namespace strata::engine {

bool exempt_from_weight_decay(const TensorSlot& slot, const EngineConfig& config) {
  const std::string& n = slot.whole_name();
  const bool ends_bias = n.size() >= 4 && n.compare(n.size() - 4, 4, "bias") == 0;
  if (slot.whole_shape().size() == 1) return ends_bias ? config.no_decay_bias : config.no_decay_norm;
  const bool embedding = n.find("wte") != std::string::npos || n.find("wpe") != std::string::npos ||
                         n.find("embed_tokens") != std::string::npos;
  return embedding && config.no_decay_embedding;
}

uint64_t TensorSpec::numel() const {
  uint64_t n = 1;
  for (int64_t d : shape) {
    if (d < 0) throw std::invalid_argument("tensor " + name + " has a negative dimension");
    n *= uint64_t(d);
  }
  return n;
}

uint64_t UnitLayout::shard_valid_numel(int rank) const {
  const uint64_t b = shard_begin(rank);
  if (b >= numel) return 0;
  return std::min(shard_numel, numel - b);
}

Partition::Partition(
    const std::vector<std::pair<std::string, std::vector<TensorSpec>>>& units, int world_size,
    uint64_t align_numel, const std::vector<char>& frozen)
    : world_size_(world_size) {
  if (!frozen.empty() && frozen.size() != units.size())
    throw std::invalid_argument("partition: " + std::to_string(frozen.size()) + " frozen flags for " +
                                std::to_string(units.size()) + " units");
  if (world_size < 1) throw std::invalid_argument("world size must be >= 1");
  if (align_numel == 0) throw std::invalid_argument("alignment must be >= 1 element");
  for (const auto& [uname, specs] : units) {
    if (specs.empty()) throw std::invalid_argument("unit " + uname + " has no tensors");
    UnitLayout u;
    u.name = uname;
    u.world_size = uint64_t(world_size);
    u.frozen = !frozen.empty() && frozen[units_.size()];
    for (const auto& s : specs) {
      const models::StoredTensor stored = s.stored.numel ? s.stored : models::StoredTensor{s.numel(), 1, false};
      TensorSlot slot{s.name, s.shape, models::stored_start(u.numel, stored), stored.numel, s.origin, stored.quantized};
      u.numel = slot.offset + slot.numel;
      if (!index_.emplace(s.name, std::make_pair(units_.size(), u.tensors.size())).second)
        throw std::invalid_argument("tensor " + s.name + " appears twice in the partition");
      u.tensors.push_back(std::move(slot));
    }
    u.shard_numel = shard_numel_of(u.numel, world_size, align_numel);
    units_.push_back(std::move(u));
  }
}

TensorLocation Partition::locate(const std::string& name) const {
  auto it = index_.find(name);
  if (it == index_.end()) throw std::out_of_range("no tensor named " + name + " in the partition");
  return {it->second.first, &units_[it->second.first].tensors[it->second.second]};
}

std::vector<size_t> Partition::trainable_units() const {
  std::vector<size_t> out;
  for (size_t u = 0; u < units_.size(); ++u)
    if (!units_[u].frozen) out.push_back(u);
  return out;
}

uint64_t Partition::total_numel() const {
  uint64_t n = 0;
  for (const auto& u : units_) n += u.numel;
  return n;
}

uint64_t Partition::total_shard_numel() const {
  uint64_t n = 0;
  for (const auto& u : units_) n += u.shard_numel;
  return n;
}

}  // namespace strata::engine
