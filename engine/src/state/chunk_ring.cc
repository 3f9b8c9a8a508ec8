#include "state/chunk_ring.h"

#include <algorithm>

namespace strata::engine::state {

ChunkRing::ChunkRing(Source& source, const HostMemory& host, uint64_t chunk_bytes)
    : source_(source), host_(host), chunk_(std::max<uint64_t>(4096, chunk_bytes / 4 / 4096 * 4096)) {}

void ChunkRing::run(unsigned in, unsigned out, const std::vector<size_t>& units, const Fn& fn,
                    const std::function<void(size_t)>& unit_done, const std::function<void(size_t)>& before_unit) {
  std::vector<Chunk> items;
  uint64_t largest = 0;
  for (size_t u : units) {
    const uint64_t n = source_.shard_numel(u);
    for (uint64_t b = 0; b < n; b += chunk_) items.push_back({u, b, std::min(chunk_, n - b)});
    largest = std::max(largest, std::min(chunk_, n));
  }
  unsigned buffered = 0;  // kinds that some unit of the pass streams through the slots' buffers
  for (int k = 0; k < kKinds; ++k)
    for (size_t u : units)
      if (((in | out) >> k & 1) && source_.streamed(u, k)) buffered |= 1u << k;
  struct Slot {
    std::array<at::Tensor, kKinds> buf;
    std::vector<offload::IoFuture> reads, writes;
  };
  std::array<Slot, 3> slots;
  for (Slot& sl : slots)
    for (int k = 0; k < kKinds; ++k)
      if (buffered >> k & 1) sl.buf[k] = host_.buffer(largest, source_.dtype(k));
  auto issue_reads = [&](size_t i) {
    Slot& sl = slots[i % slots.size()];
    for (auto& w : sl.writes) w.get();
    sl.writes.clear();
    const Chunk& c = items[i];
    for (int k = 0; k < kKinds; ++k)
      if ((in & buffered) >> k & 1 && source_.on_nvme(c.unit, k))
        sl.reads.push_back(source_.read(c.unit, k, c.begin, sl.buf[k].narrow(0, 0, int64_t(c.numel))));
  };
  auto drain_writes = [&] {
    for (Slot& sl : slots) {
      for (auto& w : sl.writes) w.get();
      sl.writes.clear();
    }
  };
  try {
    if (!items.empty()) issue_reads(0);
    for (size_t i = 0; i < items.size(); ++i) {
      if (unit_done && i > 0 && items[i].unit != items[i - 1].unit) {
        drain_writes();
        unit_done(items[i - 1].unit);
      }
      if (i + 1 < items.size()) issue_reads(i + 1);
      if (before_unit && (i == 0 || items[i].unit != items[i - 1].unit)) before_unit(items[i].unit);
      Slot& sl = slots[i % slots.size()];
      for (auto& r : sl.reads) r.get();
      sl.reads.clear();
      const Chunk& c = items[i];
      Pointers ptr{};
      for (int k = 0; k < kKinds; ++k) {
        if (buffered >> k & 1 && source_.streamed(c.unit, k)) ptr[k] = sl.buf[k].data_ptr();
        else if ((in | out) >> k & 1) ptr[k] = source_.resident(c.unit, k, c.begin);
      }
      fn(c, ptr);
      for (int k = 0; k < kKinds; ++k) {
        if (!((out & buffered) >> k & 1) || !source_.streamed(c.unit, k)) continue;
        const at::Tensor b = sl.buf[k].narrow(0, 0, int64_t(c.numel));
        if (source_.on_nvme(c.unit, k)) sl.writes.push_back(source_.write(c.unit, k, c.begin, b));
        else source_.store(c.unit, k, c.begin, b);
      }
    }
    drain_writes();
    if (unit_done && !items.empty()) unit_done(items.back().unit);
  } catch (...) {
    // The buffers must outlive every transfer into or out of them.
    for (Slot& sl : slots) {
      for (auto& r : sl.reads) r.wait();
      for (auto& w : sl.writes) w.wait();
    }
    throw;
  }
}

}  // namespace strata::engine::state
