// The optimizer's chunk ring: runs a function over units' shards chunk by chunk, with a host
// pointer to the chunk of every state kind it asks for. Resident host state is handed over in
// place; kinds that pass through host buffers (state in swap, or a compute copy on a GPU) go
// through a ring of three buffers per kind: the kinds in `in` are read one chunk ahead, the
// kinds in `out` written back behind (swap: an asynchronous write; elsewhere: a copy into the
// resident tensor after the function). So while chunk i is processed, chunk i+1 is being read
// and chunk i-1 written.
//
// The ring knows nothing of placements: it asks its Source. Kinds are numbered 0..kKinds-1 (the
// engine's master, exp_avg, exp_avg_sq, grad, compute).
//
// Threads: one thread runs a pass; the Source's reads and writes may complete on I/O threads.
// Errors: an I/O error is rethrown from the wait on it; on any exception the ring waits for every
// transfer into or out of its buffers before they go, then rethrows.
#pragma once

#include <ATen/core/Tensor.h>

#include <array>
#include <cstdint>
#include <functional>
#include <vector>

#include "state/host_memory.h"
#include "strata/offload/io_future.h"

namespace strata::engine::state {

class ChunkRing {
 public:
  static constexpr int kKinds = 5;
  using Pointers = std::array<void*, kKinds>;
  struct Chunk {
    size_t unit;
    uint64_t begin, numel;  // elements of the unit's shard
  };
  // What the ring needs to know of the state: sizes, dtypes, where each kind of each unit is.
  class Source {
   public:
    virtual ~Source() = default;
    virtual uint64_t shard_numel(size_t unit) const = 0;
    virtual at::ScalarType dtype(int kind) const = 0;
    // Kind k of unit u passes through a ring buffer (in swap, or a compute copy on a GPU).
    virtual bool streamed(size_t unit, int kind) const = 0;
    virtual bool on_nvme(size_t unit, int kind) const = 0;
    // Resident host state of a kind that is not streamed: its element `begin`; nullptr if none.
    virtual void* resident(size_t unit, int kind, uint64_t begin) = 0;
    // Swap: elements [begin, begin + numel) of (unit, kind) into / from host memory.
    virtual offload::IoFuture read(size_t unit, int kind, uint64_t begin, const at::Tensor& dst) = 0;
    virtual offload::IoFuture write(size_t unit, int kind, uint64_t begin, const at::Tensor& src) = 0;
    // A streamed kind that is not in swap (a device compute copy): `src` into its elements from
    // `begin`.
    virtual void store(size_t unit, int kind, uint64_t begin, const at::Tensor& src) = 0;
  };
  using Fn = std::function<void(const Chunk&, const Pointers&)>;

  // `chunk_bytes`: fp32 bytes per kind per chunk (offload.optimizer_chunk), at least 4096
  // elements and a multiple of them so that every chunk of a shard stays direct-I/O aligned.
  ChunkRing(Source& source, const HostMemory& host, uint64_t chunk_bytes);

  // One pass over `units`, in that order, with `in` and `out` bitmasks of kinds. `unit_done(u)`
  // once every chunk of u is processed and written back (units finish in pass order);
  // `before_unit(u)` before u's first chunk is processed, once that chunk's reads (and the next
  // chunk's) are under way: it may block until u is ready.
  void run(unsigned in, unsigned out, const std::vector<size_t>& units, const Fn& fn,
           const std::function<void(size_t)>& unit_done = {}, const std::function<void(size_t)>& before_unit = {});

  uint64_t chunk_numel() const { return chunk_; }

 private:
  Source& source_;
  const HostMemory& host_;
  uint64_t chunk_;
};

}  // namespace strata::engine::state
