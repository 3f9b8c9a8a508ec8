// What both ways of loading a checkpoint share (load.cc: the same cut of the model as the save;
// load_recut.cc: another cut): which rank of this run sees which saving rank's data file
// (node-local disks: each node its own), the error naming the files no rank sees, the agreement
// on a failed read, and the end of every load. Private to engine/src/checkpoint.
//
// Ownership: the manifest's JSON belongs to the caller; FilesSeen and LoadFailure are values.
// Errors: std::runtime_error naming the checkpoint, thrown alike on every rank (the picture of
// who sees what, and every rank's failure, are gathered first).
// Thread safety: files_seen_by_all, throw_missing_files, LoadFailure::agree, finish_load and
// load_recut are collectives, called by every rank in the same order on the training thread.
#pragma once

#include <algorithm>
#include <cstdint>
#include <functional>
#include <map>
#include <stdexcept>
#include <string>
#include <vector>

#include "checkpoint/catalog.h"
#include "checkpoint/chunk_reader.h"
#include "checkpoint/commit.h"
#include "checkpoint/format.h"
#include "strata/engine/checkpoint.h"

namespace strata::engine::ckpt {

// Which rank of this run sees which saving rank's data file (node-local disks: each node its
// own), the same picture on every rank. Ranks that see the same files (a node's, usually) form a
// group; the picture is each rank's group and each group's bits: O(world + groups x saved) on
// every rank, not world x saved (2 MiB at 4096 x 4096).
struct FilesSeen {
  int saved = 0;
  size_t words = 0;             // 32-bit words a group: ceil(saved / 32)
  std::vector<int> group;       // [rank]: its group; groups numbered in the order of their first rank
  std::vector<int> leader;      // [group]: its first (lowest) rank
  std::vector<uint32_t> bits;   // [group * words + q / 32], bit q % 32
  bool all = false;             // every rank sees every file (a shared directory, an object store): no exchange
  bool sees(int r, int q) const {
    return (bits[size_t(group[size_t(r)]) * words + size_t(q) / 32] >> (q % 32) & 1u) != 0;
  }
  bool everywhere() const { return all; }
  // The lowest rank of this run that sees q's file, or -1 (a group's lowest rank is its leader).
  int first_seeing(int q) const {
    int first = -1;
    for (size_t g = 0; g < leader.size(); ++g)
      if ((bits[g * words + size_t(q) / 32] >> (q % 32) & 1u) != 0 && (first < 0 || leader[g] < first)) first = leader[g];
    return first;
  }
};

// Collective: an all-gather of a 64-bit digest of each rank's bits (which ranks share a group),
// then one all-reduce of the groups' bits, each written by its leader; every rank checks its own
// bits against its group's, and should two different pictures ever share a digest, the ranks
// fall back to gathering every rank's bits.
FilesSeen files_seen_by_all(Communicator& comm, const fs::path& dir, const ChunkCatalog& catalog);

// Data files no rank of this run sees, by saving rank, with the ranks that need them: every rank
// has the same picture and throws the same error, naming where each node looked (nodes in the
// order of their first rank). A collective (it gathers where each rank looked).
[[noreturn]] void throw_missing_files(Communicator& comm, const fs::path& dir, const json& m,
                                      std::map<int, std::vector<int>> missing);

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
    if (const std::optional<RankError> e = first_error(comm, message))
      throw std::runtime_error(e->rank == comm.rank() ? e->message : "rank " + std::to_string(e->rank) + ": " + e->message);
  }
};

// The end of every load: compute copies from the loaded masters, the counters, and a barrier.
CheckpointMeta finish_load(Engine& engine, Communicator& comm, const fs::path& dir, const json& m);

// Loads checkpoint `dir` (manifest `m`, its chunks in `catalog`, read through `reader`) whose
// units cut the model's tensors otherwise than this run's (load_recut.cc); `seen` is
// files_seen_by_all's picture. Errors are agreed after the reads (LoadFailure); the caller then
// calls finish_load.
void load_recut(Engine& engine, Communicator& comm, const fs::path& dir, const json& m, const ChunkCatalog& catalog,
                ChunkReader& reader, const FilesSeen& seen);

}  // namespace strata::engine::ckpt
