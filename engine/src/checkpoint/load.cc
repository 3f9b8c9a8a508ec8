// Loading a committed checkpoint into an engine at any world size: each rank reads the chunks
// that overlap its own slices, checked (ChunkReader), unit by unit.
#include <ATen/core/Tensor.h>

#include <algorithm>
#include <array>
#include <stdexcept>

#include "checkpoint/chunk_reader.h"
#include "checkpoint/format.h"
#include "strata/engine/checkpoint.h"

namespace strata::engine {
using namespace ckpt;

CheckpointMeta load_checkpoint(Engine& engine, Communicator& comm, const fs::path& dir) {
  json m = read_manifest(dir);
  const Partition& part = engine.partition();
  const json units = partition_json(part);
  if (m["units"] != units) {
    std::string why = "different number of units";
    if (m["units"].size() == units.size())
      for (size_t u = 0; u < units.size(); ++u)
        if (m["units"][u] != units[u]) {
          why = "unit " + units[u]["name"].get<std::string>() + " differs";
          break;
        }
    throw std::runtime_error("checkpoint " + dir.string() + " holds a different model (" + why + ")");
  }

  // Unit by unit (so that NVMe-placed state is held in memory one unit at a time): this rank's
  // slices, the chunks that overlap their element range read in parallel and checked, then the
  // slices stored back. A chunk wholly inside this rank's range is read straight into the
  // (page-aligned) host slice; others go through a buffer and only their overlap is copied.
  // From an object store, where each read is a request with a round trip, consecutive units are
  // read together, up to kObjectGroupBytes, so that enough requests are in flight.
  constexpr uint64_t kObjectGroupBytes = 256ull << 20;
  const uint64_t group_bytes = is_object_location(dir) ? kObjectGroupBytes : 0;
  const int rank = comm.rank();
  ChunkReader reader(dir, m);
  const std::vector<std::vector<const json*>> unit_chunks = chunks_by_unit(m, dir);
  std::vector<uint64_t> covered(part.num_units() * kStateKinds, 0);
  struct Overlap {
    const json* chunk;
    int kind;
    at::Tensor buf;  // the chunk's elements: a view of the slice itself, or a buffer
    bool direct;
  };
  struct UnitWork {
    size_t unit;
    uint64_t want_b;
    std::array<at::Tensor, kStateKinds> slices;
    std::vector<Overlap> overlaps;
  };
  for (size_t next = 0; next < part.num_units();) {
    std::vector<UnitWork> group;
    std::vector<ChunkReader::Request> batch;
    uint64_t bytes = 0;
    do {
      const size_t u = next++;
      const UnitLayout& L = part.unit(u);
      UnitWork w{u, L.shard_begin(rank), {}, {}};
      const uint64_t want_e = w.want_b + L.shard_valid_numel(rank);
      for (int k = 0; k < kStateKinds; ++k) w.slices[k] = engine.state_slice(u, Engine::StateKind(k));
      for (const json* cp : unit_chunks[u]) {
        const json& c = *cp;
        const uint64_t b = c["begin"].get<uint64_t>(), e = b + c["numel"].get<uint64_t>();
        if (e <= w.want_b || b >= want_e) continue;
        const int k = kind_index(c, dir);
        const bool direct = b >= w.want_b && e <= want_e && w.slices[k].is_cpu();
        at::Tensor buf = direct ? w.slices[k].narrow(0, int64_t(b - w.want_b), int64_t(e - b)) : aligned_floats(int64_t(e - b));
        w.overlaps.push_back({&c, k, buf, direct});
        bytes += (e - b) * 4;
      }
      group.push_back(std::move(w));
    } while (next < part.num_units() && bytes < group_bytes);
    for (const UnitWork& w : group)
      for (const Overlap& o : w.overlaps) batch.push_back({o.chunk, o.buf.data_ptr<float>()});
    reader.read(batch, batch.size());
    for (UnitWork& w : group) {
      for (const Overlap& o : w.overlaps) {
        const uint64_t b = (*o.chunk)["begin"].get<uint64_t>(), e = b + (*o.chunk)["numel"].get<uint64_t>();
        const uint64_t lo = std::max(b, w.want_b), hi = std::min(e, w.want_b + part.unit(w.unit).shard_valid_numel(rank));
        if (!o.direct)
          w.slices[o.kind].narrow(0, int64_t(lo - w.want_b), int64_t(hi - lo)).copy_(o.buf.narrow(0, int64_t(lo - b), int64_t(hi - lo)));
        covered[w.unit * kStateKinds + size_t(o.kind)] += hi - lo;
      }
      for (int k = 0; k < kStateKinds; ++k) engine.store_state_slice(w.unit, Engine::StateKind(k), w.slices[k]);
    }
  }
  for (size_t u = 0; u < part.num_units(); ++u)
    for (int k = 0; k < kStateKinds; ++k)
      if (covered[u * kStateKinds + size_t(k)] != part.unit(u).shard_valid_numel(rank))
        throw std::runtime_error("checkpoint " + dir.string() + ": the manifest's chunks do not cover " +
                                 kKindNames[k] + " of unit " + part.unit(u).name + " for rank " +
                                 std::to_string(rank) + " (" + std::to_string(covered[u * kStateKinds + size_t(k)]) +
                                 " of " + std::to_string(part.unit(u).shard_valid_numel(rank)) + " elements)");
  engine.refresh_compute_copies();
  const json& c = m["counters"];
  engine.set_counters({c["optimizer_step"].get<int64_t>(), c["loss_scale"].get<double>(),
                       c["good_steps"].get<int64_t>()});
  comm.barrier();
  return read_checkpoint_meta(dir);
}

}  // namespace strata::engine
