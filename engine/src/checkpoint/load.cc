// Loading a committed checkpoint into an engine at any world size: rank 0 reads the manifest and
// every rank gets it over the communicator; each rank reads the chunks that overlap its own
// slices, checked (ChunkReader), unit by unit. Where the checkpoint is on node-local disks and
// some rank lacks a data file it needs, every chunk is read by one rank that sees its file and
// reaches its owners through a reduce-scatter of the chunk's bits (zeros elsewhere: exact).
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/from_blob.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <functional>
#include <map>
#include <stdexcept>

#include "checkpoint/chunk_reader.h"
#include "checkpoint/commit.h"
#include "checkpoint/format.h"
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

// Per saving rank: whether this process sees its data file in `dir`, at least as long as its
// chunks reach. An object store is one place every rank reads.
std::vector<int32_t> files_seen(const fs::path& dir, const json& m, int saved_world) {
  std::vector<int32_t> seen(size_t(saved_world), 1);
  if (is_object_location(dir)) return seen;
  std::vector<uint64_t> reach(size_t(saved_world), 0);
  std::vector<std::string> file{size_t(saved_world)};
  for (const json& c : m["chunks"]) {
    const int q = c["rank"].get<int>();
    if (q < 0 || q >= saved_world) throw std::runtime_error("checkpoint " + dir.string() + ": a chunk of rank " +
                                                            std::to_string(q) + " in a save of " +
                                                            std::to_string(saved_world) + " ranks");
    reach[size_t(q)] = std::max(reach[size_t(q)], c["offset"].get<uint64_t>() + c["numel"].get<uint64_t>() * 4);
    file[size_t(q)] = c["file"].get<std::string>();
  }
  const std::string prefix = data_prefix(m);  // "<save id>/" in a checkpoint a store holds
  for (size_t q = 0; q < seen.size(); ++q) {
    if (reach[q] == 0) continue;
    std::error_code ec;
    const uintmax_t size = fs::file_size(dir / (prefix + file[q]), ec);
    seen[q] = !ec && size >= reach[q];
  }
  return seen;
}

// "node 1 (host h1)": where this rank runs, for errors about node-local files.
std::string where_this_rank_runs() {
  char host[256] = {};
  gethostname(host, sizeof host - 1);
  const int node = DistEnv::from_env().node;
  return node >= 0 ? "node " + std::to_string(node) + " (host " + host + ")" : "host " + std::string(host);
}

std::string rank_list(const std::vector<int>& ranks) {
  std::string out;
  for (size_t i = 0; i < ranks.size();) {
    size_t j = i;
    while (j + 1 < ranks.size() && ranks[j + 1] == ranks[j] + 1) ++j;
    out += (out.empty() ? "" : ", ") + std::to_string(ranks[i]) + (j > i ? "-" + std::to_string(ranks[j]) : "");
    i = j + 1;
  }
  return out;
}

// Which rank of this run sees which saving rank's data file (node-local disks: each node its
// own), the same picture on every rank (one all-gather).
struct FilesSeen {
  int saved = 0;
  std::vector<int32_t> seen;  // [rank * saved + saving rank]
  bool sees(int r, int q) const { return seen[size_t(r) * size_t(saved) + size_t(q)] != 0; }
  // Every rank sees every file (a shared directory, an object store): no exchange.
  bool everywhere() const { return std::all_of(seen.begin(), seen.end(), [](int32_t x) { return x != 0; }); }
  // The lowest rank of this run that sees q's file, or -1.
  int first_seeing(int q) const {
    for (int r = 0; r < int(seen.size()) / saved; ++r)
      if (sees(r, q)) return r;
    return -1;
  }
};

FilesSeen files_seen_by_all(Communicator& comm, const fs::path& dir, const json& m) {
  FilesSeen f;
  f.saved = m["world_size"].get<int>();
  std::vector<int32_t> here = files_seen(dir, m, f.saved);
  at::Tensor all = at::empty({int64_t(comm.world_size()) * f.saved}, at::kInt);
  comm.all_gather(all, at::from_blob(here.data(), {f.saved}, at::kInt).clone())->wait();
  f.seen.assign(all.data_ptr<int32_t>(), all.data_ptr<int32_t>() + all.numel());
  return f;
}

// Data files no rank of this run sees, by saving rank, with the ranks that need them: every rank
// has the same picture and throws the same error, naming where each node looked (nodes in the
// order of their first rank). A collective (it gathers where each rank looked).
[[noreturn]] void throw_missing_files(Communicator& comm, const fs::path& dir, const json& m,
                                      std::map<int, std::vector<int>> missing) {
  const int world = comm.world_size(), saved = m["world_size"].get<int>();
  const std::vector<std::string> places =
      all_gather_strings(comm, where_this_rank_runs() + "\t" + fs::absolute(dir).string());
  std::vector<std::pair<std::string, std::vector<int>>> ranks_at;
  for (int r = 0; r < world; ++r) {
    auto it = std::find_if(ranks_at.begin(), ranks_at.end(), [&](const auto& p) { return p.first == places[size_t(r)]; });
    if (it == ranks_at.end()) ranks_at.push_back({places[size_t(r)], {r}});
    else it->second.push_back(r);
  }
  std::string files, looked;
  for (auto& [q, needers] : missing) {
    std::sort(needers.begin(), needers.end());
    files += std::string(files.empty() ? "" : "; ") + data_prefix(m) + rank_name(q) + ".data is missing (saved by rank " +
             std::to_string(q) + " of " + std::to_string(saved) + ", needed by rank" + (needers.size() > 1 ? "s " : " ") +
             rank_list(needers) + ")";
  }
  for (const auto& [place, ranks] : ranks_at) {
    const size_t tab = place.find('\t');
    looked += std::string(looked.empty() ? "" : "; ") + place.substr(0, tab) + ", rank" +
              (ranks.size() > 1 ? "s " : " ") + rank_list(ranks) + ": " + place.substr(tab + 1);
  }
  if (world == 1) throw std::runtime_error("checkpoint " + dir.string() + ": " + files + ". Looked in " + looked);
  throw std::runtime_error("checkpoint " + dir.string() + ": " + files + "; no rank of this run sees " +
                           (missing.size() > 1 ? "them" : "it") + ". Where each node looked: " + looked +
                           ". Copy " + (missing.size() > 1 ? "them" : "it") +
                           " into that directory on any node (each rank reads what its node sees; the rest "
                           "travels over the network)");
}


// A rank whose read fails (a bad chunk, a file that vanished) still takes part in every
// collective of a load, so that all ranks learn of it together at the end and throw alike:
// attempt() keeps the first error, agree() throws the first rank's on every rank.
struct LoadFailure {
  std::string message;
  void attempt(const std::function<void()>& f) {
    if (!message.empty()) return;
    try {
      f();
    } catch (const std::exception& e) {
      message = e.what();
    }
  }
  bool failed() const { return !message.empty(); }
  void agree(Communicator& comm) const {
    const std::vector<std::string> failures = all_gather_strings(comm, message);
    for (int r = 0; r < comm.world_size(); ++r)
      if (!failures[size_t(r)].empty())
        throw std::runtime_error(r == comm.rank() ? failures[size_t(r)]
                                                  : "rank " + std::to_string(r) + ": " + failures[size_t(r)]);
  }
};

// The end of every load: compute copies from the loaded masters, the counters, and a barrier.
CheckpointMeta finish_load(Engine& engine, Communicator& comm, const fs::path& dir, const json& m) {
  engine.refresh_compute_copies();
  const json& c = m["counters"];
  engine.set_counters({c["optimizer_step"].get<int64_t>(), c["loss_scale"].get<double>(),
                       c["good_steps"].get<int64_t>()});
  comm.barrier();
  return checkpoint_meta(m, dir);
}

// A checkpoint whose units cut the model's tensors otherwise than this run's (saved with other
// block tiles, or whole blocks): every element of this rank's slices is found through its whole
// tensor (whole_runs) in the saved units, and the chunks holding it are read, checked, and their
// overlap copied, kind by kind and unit by unit. Chunks read stay cached while the next units
// (a block's other tiles) use the same saved unit, so each is read about once per kind. Where
// some rank cannot see a data file its slice of a (unit, kind) needs (node-local disks), that
// (unit, kind) goes through an exchange, as in load_checkpoint: each chunk it needs is read by
// the lowest rank that sees its file, copied into a zeroed buffer of the unit at the places of
// its elements, and a reduce-scatter of the bits hands each rank its slice. Errors are agreed
// after the reads, as in load_checkpoint.
void load_recut(Engine& engine, Communicator& comm, const fs::path& dir, const json& m, ChunkReader& reader,
                const FilesSeen& seen) {
  const Partition& part = engine.partition();
  const int rank = comm.rank(), world = comm.world_size();
  LoadFailure failure;
  const auto attempt = [&](const std::function<void()>& f) { failure.attempt(f); };
  // The saved tensors' runs by whole tensor, sorted by their place in it.
  struct SavedRun {
    uint64_t whole_begin, numel, flat_begin;
    size_t unit;
  };
  std::map<std::string, std::vector<SavedRun>> saved;
  for (const ManifestTensor& t : manifest_tensors(m["units"], dir.string()))
    for (const WholeRun& r : whole_runs(t.slot)) saved[t.slot.whole_name()].push_back({r.whole_begin, r.numel, r.flat_begin, t.unit});
  for (auto& [name, runs] : saved)
    std::sort(runs.begin(), runs.end(), [](const SavedRun& a, const SavedRun& b) { return a.whole_begin < b.whole_begin; });
  struct Chunk {
    const json* j;
    uint64_t begin, numel;
    int rank;  // the saving rank, whose data file holds it
  };
  std::vector<std::vector<std::vector<Chunk>>> chunks(kStateKinds);  // [kind][saved unit], sorted by begin
  for (int k = 0; k < kStateKinds; ++k)
    for (const auto& of_unit : chunks_by_unit(m, dir, k)) {
      std::vector<Chunk> cs;
      for (const json* c : of_unit)
        cs.push_back({c, (*c)["begin"].get<uint64_t>(), (*c)["numel"].get<uint64_t>(), (*c)["rank"].get<int>()});
      std::sort(cs.begin(), cs.end(), [](const Chunk& a, const Chunk& b) { return a.begin < b.begin; });
      chunks[size_t(k)].push_back(std::move(cs));
    }
  struct Piece {  // [to, to + numel) of the range asked for comes from [from, ...) of saved unit `unit`
    uint64_t to, numel, from;
    size_t unit;
  };
  // The pieces of [want_b, want_e) of unit u's elements (one per run of each tensor: per row of a
  // column part), `to` counted from want_b.
  const auto pieces_of = [&](size_t u, uint64_t want_b, uint64_t want_e) {
    const UnitLayout& L = part.unit(u);
    std::vector<Piece> pieces;
    for (const TensorSlot& slot : L.tensors) {
      if (slot.offset + slot.numel <= want_b || slot.offset >= want_e) continue;
      const std::vector<SavedRun>& from = saved.at(slot.whole_name());
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
          throw std::runtime_error("checkpoint " + dir.string() + ": no saved unit holds element " + std::to_string(g) +
                                   " of " + slot.whole_name());
      }
    }
    return pieces;
  };
  const auto pieces_of_rank = [&](size_t u, int r) {
    const UnitLayout& L = part.unit(u);
    return pieces_of(u, L.shard_begin(r), L.shard_begin(r) + L.shard_valid_numel(r));
  };
  // The chunks of saved unit `su` (kind k) overlapping [from, from + n), as an index range.
  const auto overlapping = [&](int k, size_t su, uint64_t from, uint64_t n) {
    const std::vector<Chunk>& cs = chunks[size_t(k)].at(su);
    auto it = std::upper_bound(cs.begin(), cs.end(), from, [](uint64_t x, const Chunk& c) { return x < c.begin; });
    const size_t first = it == cs.begin() ? 0 : size_t(it - cs.begin()) - 1;
    size_t last = first;
    while (last < cs.size() && cs[last].begin < from + n) ++last;
    return std::make_pair(first, last);
  };
  // Calls f(chunk, lo, hi) for each chunk of kind k holding elements [lo, hi) of a piece.
  const auto for_each_overlap = [&](int k, const std::vector<Piece>& pieces, const auto& f) {
    for (const Piece& p : pieces) {
      const auto [first, last] = overlapping(k, p.unit, p.from, p.numel);
      for (size_t i = first; i < last; ++i) {
        const Chunk& c = chunks[size_t(k)][p.unit][i];
        const uint64_t lo = std::max(c.begin, p.from), hi = std::min(c.begin + c.numel, p.from + p.numel);
        if (lo < hi) f(p, c, lo, hi);
      }
    }
  };

  // Which (unit, kind) some rank cannot read alone, and the files no rank sees: the same picture
  // on every rank (a piece error is the same everywhere too, and surfaces at the reads below).
  std::vector<uint8_t> exchanged(part.num_units() * kStateKinds, 0);
  std::map<int, std::vector<int>> missing;  // saving rank -> the ranks of this run that need its file
  for (size_t u = 0; u < part.num_units() && !seen.everywhere(); ++u)
    for (int r = 0; r < world; ++r) {
      std::vector<Piece> pieces;
      try {
        pieces = pieces_of_rank(u, r);
      } catch (const std::exception&) {
        continue;
      }
      for (int k = 0; k < kStateKinds; ++k)
        for_each_overlap(k, pieces, [&](const Piece&, const Chunk& c, uint64_t, uint64_t) {
          if (seen.sees(r, c.rank)) return;
          exchanged[u * kStateKinds + size_t(k)] = 1;
          if (seen.first_seeing(c.rank) < 0) {
            std::vector<int>& needers = missing[c.rank];
            if (std::find(needers.begin(), needers.end(), r) == needers.end()) needers.push_back(r);
          }
        });
    }
  if (!missing.empty()) throw_missing_files(comm, dir, m, std::move(missing));

  for (int k = 0; k < kStateKinds; ++k) {
    std::map<const json*, at::Tensor> cache;  // chunks read, while the saved units they belong to are used
    // Reads the chunks `take` selects among those overlapping `pieces` (or finds them in the
    // cache), after dropping the cached chunks that are not among them (the saved units before
    // this one are done with).
    const auto read = [&](const std::vector<Piece>& pieces, const auto& take) {
      std::vector<const json*> used;
      std::vector<ChunkReader::Request> batch;
      for_each_overlap(k, pieces, [&](const Piece&, const Chunk& c, uint64_t, uint64_t) {
        if (!take(c)) return;
        used.push_back(c.j);
        if (cache.count(c.j)) return;
        at::Tensor buf = aligned_floats(int64_t(c.numel));
        cache.emplace(c.j, buf);
        batch.push_back({c.j, buf.data_ptr<float>()});
      });
      std::sort(used.begin(), used.end());
      for (auto it = cache.begin(); it != cache.end();)
        it = std::binary_search(used.begin(), used.end(), it->first) ? std::next(it) : cache.erase(it);
      attempt([&] { reader.read(batch, batch.size()); });
      if (failure.failed()) cache.clear();
    };
    // Copies what `take` selects of the pieces' elements into `dst` (indexed as the pieces' `to`).
    const auto copy = [&](const std::vector<Piece>& pieces, const at::Tensor& dst, const auto& take) {
      for_each_overlap(k, pieces, [&](const Piece& p, const Chunk& c, uint64_t lo, uint64_t hi) {
        if (take(c))
          dst.narrow(0, int64_t(p.to + (lo - p.from)), int64_t(hi - lo))
              .copy_(cache.at(c.j).narrow(0, int64_t(lo - c.begin), int64_t(hi - lo)));
      });
    };
    const auto all = [](const Chunk&) { return true; };
    for (size_t u = 0; u < part.num_units(); ++u) {
      const UnitLayout& L = part.unit(u);
      // After a failure this rank reads nothing more (not even its swap-resident slices) but
      // takes part in every exchange, sending zeros; the load fails on every rank at the end.
      at::Tensor slice;
      const auto get_slice = [&] { attempt([&] { slice = engine.state_slice(u, Engine::StateKind(k)); }); };
      if (exchanged[u * kStateKinds + size_t(k)]) {
        // The whole unit's elements, each written by the rank that serves its chunk: the lowest
        // that sees the chunk's file. Zeros elsewhere, so the reduce-scatter of the bits (as
        // int32: x + 0 is x for every pattern) is exact. One unit's padded buffer at a time.
        const auto serves = [&](const Chunk& c) { return seen.first_seeing(c.rank) == rank; };
        at::Tensor send = aligned_floats(int64_t(L.padded_numel()));
        send.zero_();
        std::vector<Piece> pieces;
        attempt([&] { pieces = pieces_of(u, 0, L.padded_numel()); });
        if (!failure.failed()) read(pieces, serves);
        if (!failure.failed()) copy(pieces, send, serves);
        else send.zero_();  // nothing half read travels
        at::Tensor mine = at::empty({int64_t(L.shard_numel)}, at::kInt);
        comm.reduce_scatter(mine, send.view(at::kInt))->wait();
        if (!failure.failed()) get_slice();
        if (failure.failed()) continue;
        const int64_t valid = int64_t(L.shard_valid_numel(rank));
        slice.narrow(0, 0, valid).copy_(mine.view(at::kFloat).narrow(0, 0, valid));
      } else {
        if (failure.failed()) continue;
        std::vector<Piece> pieces;
        attempt([&] { pieces = pieces_of_rank(u, rank); });
        if (!failure.failed()) read(pieces, all);
        if (!failure.failed()) get_slice();
        if (failure.failed()) continue;
        copy(pieces, slice, all);
      }
      attempt([&] { engine.store_state_slice(u, Engine::StateKind(k), slice); });
    }
  }
  failure.agree(comm);
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
  const Partition& part = engine.partition();
  const json units = partition_json(part);
  // Another cut of the same model's tensors (block tiles, or none, where the save had others)
  // loads through the whole tensors; anything else is another model.
  const bool same_units = m["units"] == units;
  const std::vector<ManifestTensor> saved_tensors = manifest_tensors(m["units"], dir.string());
  check_whole_coverage(saved_tensors, dir.string());  // alike on every rank, before any collective
  if (!same_units && whole_tensors(saved_tensors) != whole_tensors(manifest_tensors(units, "this run"))) {
    std::string why = "different number of units";
    if (m["units"].size() == units.size())
      for (size_t u = 0; u < units.size(); ++u)
        if (m["units"][u] != units[u]) {
          why = "unit " + units[u]["name"].get<std::string>() + " differs";
          break;
        }
    throw std::runtime_error("checkpoint " + dir.string() + " holds a different model (" + why + ")");
  }

  const int rank = comm.rank();
  ChunkReader reader(dir, m, transfer);
  const std::vector<std::vector<const json*>> unit_chunks = chunks_by_unit(m, dir);
  // Each (unit, kind)'s chunks cover its elements exactly once: checked here, before any
  // collective, alike on every rank. So every rank's slices are covered too (no count needed
  // after the reads), and an exchange writes each chunk at its own place in a buffer.
  for (int k = 0; k < kStateKinds; ++k) {
    std::vector<std::vector<const json*>> of_kind = chunks_by_unit(m, dir, k);
    for (size_t u = 0; u < m["units"].size(); ++u)
      if (!sort_and_check_tiling(of_kind[u], m["units"][u]["numel"].get<uint64_t>()))
        throw std::runtime_error("checkpoint " + dir.string() + ": the manifest's chunks do not cover " + kKindNames[k] +
                                 " of unit " + m["units"][u]["name"].get<std::string>() + " exactly once");
  }
  // Who sees which saving rank's data file (node-local disks: each node its own).
  const FilesSeen seen = files_seen_by_all(comm, dir, m);
  if (!same_units) {
    load_recut(engine, comm, dir, m, reader, seen);
    return finish_load(engine, comm, dir, m);
  }

  const int world = comm.world_size();
  // The rank that reads a chunk in an exchange: its first owner if that one sees the file, else
  // the lowest rank that does; -1 where none does.
  auto server = [&](const json& c, const UnitLayout& L) {
    const int q = c["rank"].get<int>();
    const int first = int(std::min<uint64_t>(c["begin"].get<uint64_t>() / L.shard_numel, uint64_t(world - 1)));
    return seen.sees(first, q) ? first : seen.first_seeing(q);
  };
  // The (unit, kind) pairs some owner cannot read alone go through an exchange; the same picture
  // on every rank.
  std::vector<uint8_t> exchanged(part.num_units() * kStateKinds, 0);
  std::map<int, std::vector<int>> missing;  // saving rank -> the ranks of this run that need its file
  for (size_t u = 0; u < part.num_units(); ++u) {
    const UnitLayout& L = part.unit(u);
    for (const json* cp : unit_chunks[u]) {
      const int q = (*cp)["rank"].get<int>();
      const uint64_t b = (*cp)["begin"].get<uint64_t>(), e = b + (*cp)["numel"].get<uint64_t>();
      const bool anywhere = server(*cp, L) >= 0;
      for (int r = int(b / L.shard_numel); r < world && L.shard_begin(r) < e; ++r) {
        if (L.shard_valid_numel(r) == 0 || L.shard_begin(r) + L.shard_valid_numel(r) <= b || seen.sees(r, q)) continue;
        exchanged[u * kStateKinds + size_t(kind_index(*cp, dir))] = 1;
        if (!anywhere) {
          std::vector<int>& needers = missing[q];
          if (std::find(needers.begin(), needers.end(), r) == needers.end()) needers.push_back(r);
        }
      }
    }
  }
  if (!missing.empty()) throw_missing_files(comm, dir, m, std::move(missing));

  LoadFailure failure;  // every collective below runs even after a failed read
  const auto attempt = [&](const std::function<void()>& f) { failure.attempt(f); };
  // Unit by unit (so that NVMe-placed state is held in memory one unit at a time): this rank's
  // slices, the chunks that overlap their element range read in parallel and checked, then the
  // slices stored back. A chunk wholly inside this rank's range is read straight into the
  // (page-aligned) host slice; others go through a buffer and only their overlap is copied.
  // From an object store, where each read is a request with a round trip, consecutive units are
  // read together, up to kObjectGroupBytes, so that enough requests are in flight. An exchanged
  // (unit, kind) is left out here and done after the unit's group.
  constexpr uint64_t kObjectGroupBytes = 256ull << 20;
  const uint64_t group_bytes = is_object_location(dir) ? kObjectGroupBytes : 0;
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
      // A rank that failed reads nothing more but takes part in every exchange (sending zeros).
      attempt([&] {
        for (int k = 0; k < kStateKinds; ++k) w.slices[k] = engine.state_slice(u, Engine::StateKind(k));
      });
      for (const json* cp : unit_chunks[u]) {
        if (failure.failed()) break;
        const json& c = *cp;
        const uint64_t b = c["begin"].get<uint64_t>(), e = b + c["numel"].get<uint64_t>();
        if (e <= w.want_b || b >= want_e) continue;
        const int k = kind_index(c, dir);
        if (exchanged[u * kStateKinds + size_t(k)]) continue;
        const bool direct = b >= w.want_b && e <= want_e && w.slices[k].is_cpu();
        at::Tensor buf = direct ? w.slices[k].narrow(0, int64_t(b - w.want_b), int64_t(e - b)) : aligned_floats(int64_t(e - b));
        w.overlaps.push_back({&c, k, buf, direct});
        bytes += (e - b) * 4;
      }
      group.push_back(std::move(w));
    } while (next < part.num_units() && bytes < group_bytes);
    for (const UnitWork& w : group)
      for (const Overlap& o : w.overlaps) batch.push_back({o.chunk, o.buf.data_ptr<float>()});
    attempt([&] { reader.read(batch, batch.size()); });
    for (UnitWork& w : group) {
      const UnitLayout& L = part.unit(w.unit);
      for (const Overlap& o : w.overlaps) {
        const uint64_t b = (*o.chunk)["begin"].get<uint64_t>(), e = b + (*o.chunk)["numel"].get<uint64_t>();
        const uint64_t lo = std::max(b, w.want_b), hi = std::min(e, w.want_b + L.shard_valid_numel(rank));
        if (!o.direct)
          w.slices[o.kind].narrow(0, int64_t(lo - w.want_b), int64_t(hi - lo)).copy_(o.buf.narrow(0, int64_t(lo - b), int64_t(hi - lo)));
      }
      // The exchange: the serving ranks read their chunks into a zeroed buffer of the unit's
      // padded size at the chunks' places, and a reduce-scatter of the bits (as int32: x + 0 is
      // x for every pattern, -0 and NaN included) hands each rank its slice. One kind at a time:
      // one unit's padded buffer is the extra memory.
      for (int k = 0; k < kStateKinds; ++k) {
        if (!exchanged[w.unit * kStateKinds + size_t(k)]) continue;
        at::Tensor send = aligned_floats(int64_t(L.padded_numel()));
        send.zero_();
        std::vector<ChunkReader::Request> served;
        for (const json* cp : unit_chunks[w.unit]) {
          const json& c = *cp;
          if (kind_index(c, dir) != k) continue;
          if (server(c, L) == rank) served.push_back({&c, send.data_ptr<float>() + c["begin"].get<uint64_t>()});
        }
        attempt([&] { reader.read(served, served.size()); });
        if (failure.failed()) send.zero_();  // nothing half read travels
        at::Tensor mine = at::empty({int64_t(L.shard_numel)}, at::kInt);
        comm.reduce_scatter(mine, send.view(at::kInt))->wait();
        if (failure.failed()) continue;
        const int64_t valid = int64_t(L.shard_valid_numel(rank));
        w.slices[k].narrow(0, 0, valid).copy_(mine.view(at::kFloat).narrow(0, 0, valid));
      }
      if (!failure.failed())
        attempt([&] {
          for (int k = 0; k < kStateKinds; ++k) engine.store_state_slice(w.unit, Engine::StateKind(k), w.slices[k]);
        });
    }
  }
  failure.agree(comm);
  return finish_load(engine, comm, dir, m);
}

}  // namespace strata::engine
