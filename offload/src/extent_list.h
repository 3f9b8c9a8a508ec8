// Free ranges of an address space (bytes of a slab, a swap file), first-fit with coalescing
// (private header). Not thread safe: its owner locks.
#pragma once

#include <cstdint>
#include <iterator>
#include <map>
#include <optional>

namespace strata::offload::detail {

class ExtentList {
 public:
  // Removes `length` bytes from the first free range that holds them; returns their offset.
  std::optional<uint64_t> take(uint64_t length) {
    for (auto it = free_.begin(); it != free_.end(); ++it) {
      if (it->second < length) continue;
      const uint64_t offset = it->first, rest = it->second - length;
      free_.erase(it);
      if (rest > 0) free_.emplace(offset + length, rest);
      return offset;
    }
    return std::nullopt;
  }

  // Returns [offset, offset + length) to the free list, merged with adjacent free ranges; the
  // merged range is returned.
  std::pair<uint64_t, uint64_t> give(uint64_t offset, uint64_t length) {
    auto next = free_.lower_bound(offset);
    if (next != free_.end() && offset + length == next->first) {
      length += next->second;
      next = free_.erase(next);
    }
    if (next != free_.begin()) {
      auto prev = std::prev(next);
      if (prev->first + prev->second == offset) {
        offset = prev->first;
        length += prev->second;
        free_.erase(prev);
      }
    }
    free_.emplace(offset, length);
    return {offset, length};
  }

  // Removes a free range that starts exactly at `offset` (e.g. the tail of a file being shrunk).
  void erase(uint64_t offset) { free_.erase(offset); }

  uint64_t largest() const {
    uint64_t m = 0;
    for (auto& [o, l] : free_) m = l > m ? l : m;
    return m;
  }

 private:
  std::map<uint64_t, uint64_t> free_;  // offset -> length, never adjacent
};

}  // namespace strata::offload::detail
