// Loading a committed checkpoint into an engine at any world size: rank 0 reads the manifest and
// every rank gets it over the communicator; each rank reads the chunks that overlap its own
// slices, checked (ChunkReader), unit by unit. Where the checkpoint is on node-local disks and
// some rank lacks a data file it needs, every chunk is read by one rank that sees its file and
// its owners' pieces reach them through bounded rounds of all-to-all (exchange.h).
// A checkpoint saved with another cut of the model's tensors loads through load_recut.cc; what
// both share is in load_support.h.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>

#include <algorithm>
#include <array>
#include <functional>
#include <map>
#include <stdexcept>

#include "checkpoint/chunk_reader.h"
#include "checkpoint/commit.h"
#include "checkpoint/exchange.h"
#include "checkpoint/format.h"
#include "checkpoint/load_support.h"
#include "strata/engine/checkpoint.h"

namespace strata::engine {
using namespace ckpt;

namespace {

// Rank 0's message, on every rank: "M" + a manifest's text, "E" + rank 0's error, or anything else
// a caller defines. An "E" is thrown on every rank.
std::string from_rank0(Communicator& comm, const std::string& mine) {
  const std::string got = broadcast_string(comm, mine, 0);
  if (!got.empty() && got[0] == 'E') throw std::runtime_error(got.substr(1));
  return got;
}

std::string manifest_message(const fs::path& dir) {
  try {
    return "M" + read_manifest(dir).dump();
  } catch (const std::exception& e) {
    return std::string("E") + e.what();
  }
}

// Whether the checkpoint's units are this run's. Another cut of the same model's tensors (block
// tiles, or none, where the save had others) loads through the whole tensors; anything else is
// another model, and throws. Alike on every rank, before any collective.
bool same_units_as_saved(const json& m, const Partition& part, const models::ModelConfig& mine, const fs::path& dir) {
  const json units = partition_json(part);
  const bool same_units = m["units"] == units;
  const std::vector<ManifestTensor> saved_tensors = manifest_tensors(m["units"], dir.string());
  check_whole_coverage(saved_tensors, dir.string());  // alike on every rank, before any collective
  if (!same_units && whole_tensors(saved_tensors) != whole_tensors(manifest_tensors(units, "this run"))) {
    std::string why = "different number of units";
    // A mixture of experts saved with another expert count: said in those words.
    const json saved = m.value("model", json::object());
    const int64_t saved_experts = saved.value("num_local_experts", saved.value("num_experts", int64_t(0)));
    if (saved_experts != mine.moe.experts && (saved_experts > 0 || mine.moe.enabled()))
      why = "its model has " + std::to_string(saved_experts) + " experts a sparse block, this run's " +
            std::to_string(mine.moe.experts);
    else if (m["units"].size() == units.size())
      for (size_t u = 0; u < units.size(); ++u)
        if (m["units"][u] != units[u]) {
          why = "unit " + units[u]["name"].get<std::string>() + " differs";
          break;
        }
    throw std::runtime_error("checkpoint " + dir.string() + " holds a different model (" + why +
                             "), or the state of other tensors than this run trains (model.trainable, or "
                             "model.lora's target_modules and modules_to_save)");
  }
  return same_units;
}

// The rank that reads a chunk in an exchange: its first owner if that one sees the file, else
// the lowest rank that does; -1 where none does.
int server_of(const Chunk& c, const UnitLayout& L, const FilesSeen& seen, int world) {
  const int first = int(std::min<uint64_t>(c.begin / L.shard_numel, uint64_t(world - 1)));
  return seen.sees(first, c.rank) ? first : seen.first_seeing(c.rank);
}

// Calls f(r, b, e) for each rank r, in order, whose valid slice of the unit holds elements
// [b, e) (b < e) of chunk c: the chunk's owners.
template <class F>
void for_each_owner(const Chunk& c, const UnitLayout& L, int world, const F& f) {
  for (int r = int(std::min<uint64_t>(c.begin / L.shard_numel, uint64_t(world - 1)));
       r < world && L.shard_begin(r) < c.end(); ++r) {
    const uint64_t b = std::max(c.begin, L.shard_begin(r)), e = std::min(c.end(), L.shard_begin(r) + L.shard_valid_numel(r));
    if (b < e) f(r, b, e);
  }
}

// The (unit, kind) pairs some owner cannot read alone go through an exchange
// ([unit * kSavedKinds + kind]); the same picture on every rank. Files no rank sees are thrown
// (throw_missing_files: a collective).
// Computed from the chunks' places alone: no index file is read.
std::vector<uint8_t> plan_exchanges(Communicator& comm, const fs::path& dir, const json& m, const Partition& part,
                                    const ChunkCatalog& catalog, const FilesSeen& seen) {
  const int world = comm.world_size();
  std::vector<uint8_t> exchanged(part.num_units() * state::kSavedKinds, 0);
  std::map<int, std::vector<int>> missing;  // saving rank -> the ranks of this run that need its file
  for (size_t u = 0; u < part.num_units() && !seen.everywhere(); ++u) {
    const UnitLayout& L = part.unit(u);
    for (int k = 0; k < state::kSavedKinds; ++k)
      for (const Chunk& c : catalog.chunks(u, k)) {
        const bool anywhere = server_of(c, L, seen, world) >= 0;
        for_each_owner(c, L, world, [&](int r, uint64_t, uint64_t) {
          if (seen.sees(r, c.rank)) return;
          exchanged[u * state::kSavedKinds + size_t(k)] = 1;
          if (!anywhere) {
            std::vector<int>& needers = missing[c.rank];
            if (std::find(needers.begin(), needers.end(), r) == needers.end()) needers.push_back(r);
          }
        });
      }
  }
  if (!missing.empty()) throw_missing_files(comm, dir, m, std::move(missing));
  return exchanged;
}

struct Overlap {
  Chunk chunk;
  int kind;
  at::Tensor buf;  // the chunk's elements: a view of the slice itself, or a buffer
  bool direct;
};
struct UnitWork {
  size_t unit;
  uint64_t want_b;
  std::array<at::Tensor, state::kSavedKinds> slices;
  std::vector<Overlap> overlaps;
};

// What the loading of every group of units shares.
struct SameCutLoad {
  Engine& engine;
  Communicator& comm;
  const fs::path& dir;
  ChunkReader& reader;
  const FilesSeen& seen;
  const ChunkCatalog& catalog;
  const std::vector<uint8_t>& exchanged;                     // plan_exchanges
  LoadFailure& failure;                                      // every collective runs even after a failed read
  int rank, world;
  ExchangeLimits limits;
};

// Unit u's slices and the chunks that overlap them, other than an exchanged (unit, kind)'s, each
// with where it is read to; adds their bytes to `bytes`.
UnitWork plan_unit(const SameCutLoad& ctx, size_t u, uint64_t& bytes) {
  const UnitLayout& L = ctx.engine.checkpoint_partition().unit(u);
  UnitWork w{u, L.shard_begin(ctx.rank), {}, {}};
  const uint64_t want_e = w.want_b + L.shard_valid_numel(ctx.rank);
  // A rank that failed reads nothing more but takes part in every exchange (sending zeros).
  ctx.failure.attempt([&] {
    for (int k = 0; k < state::kSavedKinds; ++k) w.slices[k] = ctx.engine.state_slice(ctx.engine.checkpoint_units()[u], state::Kind(k));
  });
  for (int k = 0; k < state::kSavedKinds && !ctx.failure.failed(); ++k) {
    if (ctx.exchanged[u * state::kSavedKinds + size_t(k)]) continue;
    for (const Chunk& c : ctx.catalog.overlapping(u, k, w.want_b, want_e)) {
      const uint64_t b = c.begin, e = c.end();
      const bool direct = b >= w.want_b && e <= want_e && w.slices[k].is_cpu();
      at::Tensor buf = direct ? w.slices[k].narrow(0, int64_t(b - w.want_b), int64_t(e - b)) : aligned_floats(int64_t(e - b));
      w.overlaps.push_back({c, k, buf, direct});
      bytes += (e - b) * 4;
    }
  }
  return w;
}

// The exchange (exchange.h): what each rank's slice needs of each chunk, the chunk read by its
// server and the pieces sent to their owners in bounded rounds. One kind at a time.
void exchange_unit(const SameCutLoad& ctx, UnitWork& w) {
  const UnitLayout& L = ctx.engine.checkpoint_partition().unit(w.unit);
  for (int k = 0; k < state::kSavedKinds; ++k) {
    if (!ctx.exchanged[w.unit * state::kSavedKinds + size_t(k)]) continue;
    std::vector<ExchangeNeed> needs;
    for (const Chunk& c : ctx.catalog.chunks(w.unit, k))
      for_each_owner(c, L, ctx.world, [&](int r, uint64_t b, uint64_t e) {
        needs.push_back({c, b, e - b, r, b - L.shard_begin(r)});
      });
    const ExchangePlan plan = plan_exchange(
        std::move(needs), [&](const Chunk& c) { return server_of(c, L, ctx.seen, ctx.world); }, ctx.world, ctx.limits);
    exchange_slices(ctx.comm, ctx.reader, ctx.failure, plan, ctx.failure.failed() ? at::Tensor() : w.slices[k]);
  }
}

// After its group's reads: the overlaps read into buffers copied into the slices, the exchanges,
// and the slices stored back.
void finish_unit(const SameCutLoad& ctx, UnitWork& w) {
  const UnitLayout& L = ctx.engine.checkpoint_partition().unit(w.unit);
  for (const Overlap& o : w.overlaps) {
    const uint64_t b = o.chunk.begin, e = o.chunk.end();
    const uint64_t lo = std::max(b, w.want_b), hi = std::min(e, w.want_b + L.shard_valid_numel(ctx.rank));
    if (!o.direct)
      w.slices[o.kind].narrow(0, int64_t(lo - w.want_b), int64_t(hi - lo)).copy_(o.buf.narrow(0, int64_t(lo - b), int64_t(hi - lo)));
  }
  exchange_unit(ctx, w);
  if (!ctx.failure.failed())
    ctx.failure.attempt([&] {
      for (int k = 0; k < state::kSavedKinds; ++k) ctx.engine.store_state_slice(ctx.engine.checkpoint_units()[w.unit], state::Kind(k), w.slices[k]);
    });
}

// Unit by unit (so that NVMe-placed state is held in memory one unit at a time): this rank's
// slices, the chunks that overlap their element range read in parallel and checked, then the
// slices stored back. A chunk wholly inside this rank's range is read straight into the
// (page-aligned) host slice; others go through a buffer and only their overlap is copied.
// From an object store, where each read is a request with a round trip, consecutive units are
// read together, up to kObjectGroupBytes, so that enough requests are in flight. An exchanged
// (unit, kind) is left out here and done after the unit's group.
void load_same_cut(const SameCutLoad& ctx) {
  const Partition& part = ctx.engine.checkpoint_partition();
  constexpr uint64_t kObjectGroupBytes = 256ull << 20;
  const uint64_t group_bytes = is_object_location(ctx.dir) ? kObjectGroupBytes : 0;
  for (size_t next = 0; next < part.num_units();) {
    std::vector<UnitWork> group;
    std::vector<ChunkReader::Request> batch;
    uint64_t bytes = 0;
    do {
      group.push_back(plan_unit(ctx, next++, bytes));
    } while (next < part.num_units() && bytes < group_bytes);
    for (const UnitWork& w : group)
      for (const Overlap& o : w.overlaps) batch.push_back({o.chunk, o.buf.data_ptr<float>()});
    ctx.failure.attempt([&] { ctx.reader.read(batch, batch.size()); });
    for (UnitWork& w : group) finish_unit(ctx, w);
  }
}

}  // namespace

ResumeChoice agree_resume_point(Communicator& comm, const std::optional<fs::path>& rank0_choice,
                                const std::string& rank0_error) {
  std::string mine;
  if (comm.rank() == 0) {
    if (!rank0_error.empty()) mine = "E" + rank0_error;
    else if (!rank0_choice) mine = "F";
    else {
      mine = manifest_message(*rank0_choice);
      if (mine[0] == 'M') mine = "D" + rank0_choice->string() + "\n" + mine.substr(1);
    }
  }
  const std::string got = from_rank0(comm, mine);
  ResumeChoice out;
  if (got.empty() || got[0] == 'F') return out;
  const size_t nl = got.find('\n');
  out.dir = fs::path(got.substr(1, nl - 1));
  out.meta = checkpoint_meta(parse_manifest(got.substr(nl + 1), out.dir->string() + " (rank 0's manifest.json)"), *out.dir);
  return out;
}

CheckpointMeta load_checkpoint(Engine& engine, Communicator& comm, const fs::path& dir,
                               const offload::TransferOptions& transfer) {
  const std::string text = from_rank0(comm, comm.rank() == 0 ? manifest_message(dir) : std::string());
  const json m = parse_manifest(text.substr(1), dir.string() + " (rank 0's manifest.json)");
  const Partition& part = engine.checkpoint_partition();
  const bool same_units = same_units_as_saved(m, part, engine.model_config(), dir);

  // Alike on every rank, before any collective: a format 1-2 manifest's chunks are checked to
  // cover every (unit, kind) exactly once (format 3's follow from its shards).
  ChunkCatalog catalog(dir, m);
  ChunkReader reader(dir, catalog, transfer);
  // Who sees which saving rank's data file (node-local disks: each node its own).
  const FilesSeen seen = files_seen_by_all(comm, dir, catalog);
  if (!same_units) {
    load_recut(engine, comm, dir, m, catalog, reader, seen);
    return finish_load(engine, comm, dir, m);
  }

  const std::vector<uint8_t> exchanged = plan_exchanges(comm, dir, m, part, catalog, seen);
  LoadFailure failure;  // every collective below runs even after a failed read
  load_same_cut({engine, comm, dir, reader, seen, catalog, exchanged, failure, comm.rank(), comm.world_size(),
                 ExchangeLimits::agreed(comm)});
  failure.agree(comm);
  return finish_load(engine, comm, dir, m);
}

}  // namespace strata::engine
