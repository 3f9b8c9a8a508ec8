// Where a checkpoint's chunks are: the one reading of its chunk metadata, whatever the format
// (docs/FORMATS.md, "Strata checkpoints"). Private to engine/src/checkpoint; load, verify,
// describe and export go through it, never through the manifest's or the index files' JSON.
//
// Format 3 keeps the metadata in O(units x ranks): the manifest records each unit's saved shard
// size, so the chunks (which saving rank holds which elements of which unit and kind, cut every
// `chunk_elements`) follow from it without reading anything; where a chunk lies in its data file
// and its CRC32C are in its saving rank's index file, which the catalog reads (checked against the
// size and CRC the manifest records for it) the first time a chunk of that rank is placed. So a
// rank reads only the index files of the ranks whose data it reads. Formats 1 and 2 list every
// chunk in the manifest; the catalog takes them from there, checked to cover every (unit, kind)
// exactly once.
//
// Ownership: the catalog copies what it needs from the manifest; it owns the indexes it read.
// Errors: std::runtime_error naming the checkpoint and what is wrong (an index file missing, of
// another size or CRC than the manifest says, or not describing its rank's slices; chunks of a
// format 1-2 manifest that do not cover a unit).
// Thread safety: place() and of_rank() read and cache index files: one thread at a time. The
// const members may be called from any thread.
#pragma once

#include <cstdint>
#include <filesystem>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "checkpoint/format.h"
#include "strata/offload/object_store.h"

namespace strata::engine::ckpt {

// A run of one (unit, kind)'s elements in one saving rank's data file.
struct Chunk {
  int rank = 0;                   // the saving rank: rank-RRRRR.data holds it
  size_t unit = 0;                // index in the manifest's units
  int kind = 0;                   // state::Kind, one of the saved kinds
  uint64_t begin = 0, numel = 0;  // elements [begin, begin + numel) of the unit's flat buffer
  // Set by ChunkCatalog::place: the byte offset in the data file, and the CRC32C of its bytes.
  uint64_t offset = 0;
  uint32_t crc32c = 0;
  bool placed = false;
  uint64_t end() const { return begin + numel; }
  // Chunks of one (unit, kind) never overlap: (unit, kind, begin) names one.
  bool operator<(const Chunk& o) const {
    return unit != o.unit ? unit < o.unit : kind != o.kind ? kind < o.kind : begin < o.begin;
  }
  bool operator==(const Chunk& o) const { return unit == o.unit && kind == o.kind && begin == o.begin; }
};

class ChunkCatalog {
 public:
  // `location`: the checkpoint's directory or object URL; `manifest`: its manifest (parse_manifest).
  ChunkCatalog(fs::path location, const json& manifest);
  ~ChunkCatalog();

  int format() const { return format_; }
  int saved_world() const { return saved_world_; }
  size_t num_units() const { return numel_.size(); }
  uint64_t unit_numel(size_t u) const { return numel_.at(u); }

  // The chunks of unit u, kind k, that hold any of elements [b, e), sorted by begin; unplaced.
  std::vector<Chunk> overlapping(size_t u, int k, uint64_t b, uint64_t e) const;
  // Every chunk of unit u, kind k: they cover [0, unit_numel(u)) exactly once.
  std::vector<Chunk> chunks(size_t u, int k) const { return overlapping(u, k, 0, unit_numel(u)); }
  // How many chunks the checkpoint has, all units, kinds and ranks.
  uint64_t chunk_count() const;
  // The bytes saving rank q's data file must have (a shorter one is not the saved one).
  uint64_t data_bytes(int q) const;

  // `c` with its offset and CRC (reads its saving rank's index file on first use).
  Chunk place(const Chunk& c);
  // Every chunk saving rank q wrote, placed, in file order.
  std::vector<Chunk> of_rank(int q);
  // Saving rank q's data file, relative to the checkpoint ("<save id>/rank-00001.data" in a
  // store), and its index file (read in format 3).
  std::string data_file(int q) const;
  std::string index_file(int q) const;
  // "rank-00001.data at offset 8192 (unit block.0, master, elements 0+1024)".
  std::string name(const Chunk& c) const;
  // Bytes of index files read so far (the metadata beyond the manifest).
  uint64_t index_bytes_read() const { return index_bytes_read_; }

 private:
  struct RankIndex;  // one saving rank's index file, parsed (format 3)
  const RankIndex& index_of(int q);
  RankIndex parse_index(int q, const std::string& text) const;
  std::string read_index_text(int q);
  uint64_t valid_of(size_t u, int q) const;  // elements of unit u saving rank q holds (format 3)

  fs::path location_;
  std::string where_;  // the checkpoint, for errors
  int format_ = 0, saved_world_ = 0;
  std::string prefix_;                // data_prefix
  std::vector<std::string> unit_names_;
  std::vector<uint64_t> numel_;       // per unit
  // Format 3.
  uint64_t chunk_elements_ = kChunkElements;
  std::vector<uint64_t> shard_;       // per unit: each saving rank's share
  struct RankRecord {
    uint64_t index_bytes = 0, data_bytes = 0;
    uint32_t index_crc32c = 0;
  };
  std::vector<RankRecord> ranks_;
  std::map<int, RankIndex> indexes_;
  uint64_t index_bytes_read_ = 0;
  std::unique_ptr<offload::ObjectStore> store_;  // an object location's, opened on first use
  std::string object_name_;
  // Formats 1-2: every chunk, placed, by [unit][kind], sorted by begin.
  std::vector<std::vector<std::vector<Chunk>>> listed_;
  std::vector<uint64_t> listed_reach_;  // per saving rank: the end of its last chunk in its file
};

// Format 3's index file of one rank (save.cc writes it): the offset of each (unit, kind) slice's
// first chunk (its chunks follow at chunk_extent(chunk_elements) strides) and each chunk's CRC32C.
struct SliceRecord {
  size_t unit = 0;
  int kind = 0;
  uint64_t offset = 0;
  std::vector<uint32_t> crc32c;  // one per chunk
};
std::string index_text(int rank, uint64_t chunk_elements, const std::vector<SliceRecord>& slices);

}  // namespace strata::engine::ckpt
