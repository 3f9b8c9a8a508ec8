// Loading a checkpoint whose units cut the model's tensors otherwise than this run's (saved with
// other block tiles, or whole blocks): load_recut (load_support.h), through the whole tensors.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>

#include <algorithm>
#include <functional>
#include <map>
#include <stdexcept>
#include <utility>

#include "checkpoint/chunk_reader.h"
#include "checkpoint/exchange.h"
#include "checkpoint/format.h"
#include "checkpoint/load_support.h"
#include "strata/engine/checkpoint.h"

namespace strata::engine::ckpt {

namespace {

// A stretch of a saved tensor that is contiguous in its whole tensor (whole_runs), in saved unit
// `unit`.
struct SavedRun {
  uint64_t whole_begin, numel, flat_begin;
  size_t unit;
};
struct Piece {  // [to, to + numel) of the range asked for comes from [from, ...) of saved unit `unit`
  uint64_t to, numel, from;
  size_t unit;
};

// Where the elements of this run's units are in the saved units, and which saved chunks hold
// them. Built from the manifest alike on every rank; read-only after.
class SavedCut {
 public:
  SavedCut(const Partition& part, const fs::path& dir, const json& m, const ChunkCatalog& catalog)
      : part_(part), dir_(dir), catalog_(catalog) {
    for (const ManifestTensor& t : manifest_tensors(m["units"], dir.string()))
      for (const WholeRun& r : whole_runs(t.slot)) saved_[t.slot.whole_name()].push_back({r.whole_begin, r.numel, r.flat_begin, t.unit});
    for (auto& [name, runs] : saved_)
      std::sort(runs.begin(), runs.end(), [](const SavedRun& a, const SavedRun& b) { return a.whole_begin < b.whole_begin; });
  }

  // The pieces of [want_b, want_e) of unit u's elements (one per run of each tensor: per row of a
  // column part), `to` counted from want_b.
  std::vector<Piece> pieces_of(size_t u, uint64_t want_b, uint64_t want_e) const {
    const UnitLayout& L = part_.unit(u);
    std::vector<Piece> pieces;
    for (const TensorSlot& slot : L.tensors) {
      if (slot.offset + slot.numel <= want_b || slot.offset >= want_e) continue;
      const std::vector<SavedRun>& from = saved_.at(slot.whole_name());
      for (const WholeRun& r : whole_runs(slot)) {
        const uint64_t lo = std::max(r.flat_begin, want_b), hi = std::min(r.flat_begin + r.numel, want_e);
        if (lo >= hi) continue;
        uint64_t g = r.whole_begin + (lo - r.flat_begin);  // in whole-tensor coordinates
        const uint64_t g_end = r.whole_begin + (hi - r.flat_begin);
        auto it = std::upper_bound(from.begin(), from.end(), g, [](uint64_t x, const SavedRun& s) { return x < s.whole_begin; });
        if (it != from.begin()) --it;
        for (; g < g_end && it != from.end(); ++it) {
          if (it->whole_begin + it->numel <= g) continue;
          if (it->whole_begin > g) break;  // a gap: reported below
          const uint64_t e = std::min(g_end, it->whole_begin + it->numel);
          pieces.push_back({r.flat_begin + (g - r.whole_begin) - want_b, e - g, it->flat_begin + (g - it->whole_begin), it->unit});
          g = e;
        }
        if (g < g_end)
          throw std::runtime_error("checkpoint " + dir_.string() + ": no saved unit holds element " + std::to_string(g) +
                                   " of " + slot.whole_name());
      }
    }
    return pieces;
  }
  std::vector<Piece> pieces_of_rank(size_t u, int r) const {
    const UnitLayout& L = part_.unit(u);
    return pieces_of(u, L.shard_begin(r), L.shard_begin(r) + L.shard_valid_numel(r));
  }

  // Calls f(piece, chunk, lo, hi) for each chunk of kind k holding elements [lo, hi) of a piece.
  template <class F>
  void for_each_overlap(int k, const std::vector<Piece>& pieces, const F& f) const {
    for (const Piece& p : pieces)
      for (const Chunk& c : catalog_.overlapping(p.unit, k, p.from, p.from + p.numel)) {
        const uint64_t lo = std::max(c.begin, p.from), hi = std::min(c.end(), p.from + p.numel);
        if (lo < hi) f(p, c, lo, hi);
      }
  }

 private:
  const Partition& part_;
  const fs::path& dir_;
  const ChunkCatalog& catalog_;
  std::map<std::string, std::vector<SavedRun>> saved_;  // by whole tensor, sorted by whole_begin
};

// Which (unit, kind) some rank cannot read alone ([unit * kSavedKinds + kind]), and the files no
// rank sees (thrown: a collective): the same picture on every rank (a piece error is the same
// everywhere too, and surfaces at the reads).
std::vector<uint8_t> plan_exchanges(Communicator& comm, const fs::path& dir, const json& m, const Partition& part,
                                    const SavedCut& cut, const FilesSeen& seen) {
  const int world = comm.world_size();
  std::vector<uint8_t> exchanged(part.num_units() * state::kSavedKinds, 0);
  std::map<int, std::vector<int>> missing;  // saving rank -> the ranks of this run that need its file
  for (size_t u = 0; u < part.num_units() && !seen.everywhere(); ++u)
    for (int r = 0; r < world; ++r) {
      std::vector<Piece> pieces;
      try {
        pieces = cut.pieces_of_rank(u, r);
      } catch (const std::exception&) {
        continue;
      }
      for (int k = 0; k < state::kSavedKinds; ++k)
        cut.for_each_overlap(k, pieces, [&](const Piece&, const Chunk& c, uint64_t, uint64_t) {
          if (seen.sees(r, c.rank)) return;
          exchanged[u * state::kSavedKinds + size_t(k)] = 1;
          if (seen.first_seeing(c.rank) < 0) {
            std::vector<int>& needers = missing[c.rank];
            if (std::find(needers.begin(), needers.end(), r) == needers.end()) needers.push_back(r);
          }
        });
    }
  if (!missing.empty()) throw_missing_files(comm, dir, m, std::move(missing));
  return exchanged;
}

// What the load of every kind shares.
struct RecutLoad {
  Engine& engine;
  Communicator& comm;
  ChunkReader& reader;
  const FilesSeen& seen;
  const SavedCut& cut;
  const std::vector<uint8_t>& exchanged;  // plan_exchanges
  LoadFailure& failure;
  ExchangeLimits limits;
};

// Kind k of this rank's slices, unit by unit: the chunks overlapping each slice read (or found in
// the cache) and their overlap copied, or, for an exchanged (unit, kind), the exchange
// (exchange.h): the chunks this rank serves read and their pieces sent to the ranks that need them.
void load_kind(const RecutLoad& ctx, int k) {
  const Partition& part = ctx.engine.checkpoint_partition();
  const int rank = ctx.comm.rank();
  LoadFailure& failure = ctx.failure;
  const auto attempt = [&](const std::function<void()>& f) { failure.attempt(f); };
  std::map<Chunk, at::Tensor> cache;  // chunks read, while the saved units they belong to are used
  // Reads the chunks `take` selects among those overlapping `pieces` (or finds them in the
  // cache), after dropping the cached chunks that are not among them (the saved units before
  // this one are done with).
  const auto read = [&](const std::vector<Piece>& pieces, const auto& take) {
    std::vector<Chunk> used;
    std::vector<ChunkReader::Request> batch;
    ctx.cut.for_each_overlap(k, pieces, [&](const Piece&, const Chunk& c, uint64_t, uint64_t) {
      if (!take(c)) return;
      used.push_back(c);
      if (cache.count(c)) return;
      at::Tensor buf = aligned_floats(int64_t(c.numel));
      cache.emplace(c, buf);
      batch.push_back({c, buf.data_ptr<float>()});
    });
    std::sort(used.begin(), used.end());
    for (auto it = cache.begin(); it != cache.end();)
      it = std::binary_search(used.begin(), used.end(), it->first) ? std::next(it) : cache.erase(it);
    attempt([&] { ctx.reader.read(batch, batch.size()); });
    if (failure.failed()) cache.clear();
  };
  // Copies what `take` selects of the pieces' elements into `dst` (indexed as the pieces' `to`).
  const auto copy = [&](const std::vector<Piece>& pieces, const at::Tensor& dst, const auto& take) {
    ctx.cut.for_each_overlap(k, pieces, [&](const Piece& p, const Chunk& c, uint64_t lo, uint64_t hi) {
      if (take(c))
        dst.narrow(0, int64_t(p.to + (lo - p.from)), int64_t(hi - lo))
            .copy_(cache.at(c).narrow(0, int64_t(lo - c.begin), int64_t(hi - lo)));
    });
  };
  const auto all = [](const Chunk&) { return true; };
  for (size_t u = 0; u < part.num_units(); ++u) {
    // After a failure this rank reads nothing more (not even its swap-resident slices) but
    // takes part in every exchange, sending zeros; the load fails on every rank at the end.
    at::Tensor slice;
    const auto get_slice = [&] { attempt([&] { slice = ctx.engine.state_slice(ctx.engine.checkpoint_units()[u], state::Kind(k)); }); };
    if (ctx.exchanged[u * state::kSavedKinds + size_t(k)]) {
      // What every rank's slice needs of each saved chunk, the same list on every rank whatever
      // failed where (a piece error is the same everywhere), through the exchange (exchange.h).
      std::vector<ExchangeNeed> needs;
      for (int r = 0; r < ctx.comm.world_size(); ++r) {
        std::vector<Piece> pieces;
        try {  // not through attempt(): after a failure, too, every rank lists the same needs
          pieces = ctx.cut.pieces_of_rank(u, r);
        } catch (const std::exception& e) {
          const std::string what = e.what();
          attempt([&] { throw std::runtime_error(what); });
        }
        ctx.cut.for_each_overlap(k, pieces, [&](const Piece& p, const Chunk& c, uint64_t lo, uint64_t hi) {
          needs.push_back({c, lo, hi - lo, r, p.to + (lo - p.from)});
        });
      }
      const ExchangePlan plan = plan_exchange(
          std::move(needs), [&](const Chunk& c) { return ctx.seen.first_seeing(c.rank); }, ctx.comm.world_size(),
          ctx.limits);
      if (!failure.failed()) get_slice();
      exchange_slices(ctx.comm, ctx.reader, failure, plan, failure.failed() ? at::Tensor() : slice);
      if (failure.failed()) continue;
    } else {
      if (failure.failed()) continue;
      std::vector<Piece> pieces;
      attempt([&] { pieces = ctx.cut.pieces_of_rank(u, rank); });
      if (!failure.failed()) read(pieces, all);
      if (!failure.failed()) get_slice();
      if (failure.failed()) continue;
      copy(pieces, slice, all);
    }
    attempt([&] { ctx.engine.store_state_slice(ctx.engine.checkpoint_units()[u], state::Kind(k), slice); });
  }
}

}  // namespace

// A checkpoint whose units cut the model's tensors otherwise than this run's (saved with other
// block tiles, or whole blocks): every element of this rank's slices is found through its whole
// tensor (whole_runs) in the saved units, and the chunks holding it are read, checked, and their
// overlap copied, kind by kind and unit by unit. Chunks read stay cached while the next units
// (a block's other tiles) use the same saved unit, so each is read about once per kind. Where
// some rank cannot see a data file its slice of a (unit, kind) needs (node-local disks), that
// (unit, kind) goes through an exchange, as in load_checkpoint: each chunk it needs is read by
// the lowest rank that sees its file and the pieces each rank's slice needs of it are sent there,
// in rounds of bounded size (exchange.h). Errors are agreed after the reads, as in
// load_checkpoint.
void load_recut(Engine& engine, Communicator& comm, const fs::path& dir, const json& m, const ChunkCatalog& catalog,
                ChunkReader& reader, const FilesSeen& seen) {
  const Partition& part = engine.checkpoint_partition();
  LoadFailure failure;
  const SavedCut cut(part, dir, m, catalog);
  const std::vector<uint8_t> exchanged = plan_exchanges(comm, dir, m, part, cut, seen);
  const RecutLoad ctx{engine, comm, reader, seen, cut, exchanged, failure, ExchangeLimits::agreed(comm)};
  for (int k = 0; k < state::kSavedKinds; ++k) load_kind(ctx, k);
  failure.agree(comm);
}

}  // namespace strata::engine::ckpt
