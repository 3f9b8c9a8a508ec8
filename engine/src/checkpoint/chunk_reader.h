// The one way a checkpoint's chunks are read back (load, verify, export): from a directory, data
// files opened on first use and a batch of chunks read concurrently through one I/O engine; from
// object storage, ranged GETs on up to `window` threads (at most the transfer's concurrency), one
// per run of chunks adjacent both in their data object and in memory (up to the transfer's part
// size). Each chunk is checked against its CRC32C.
//
// Ownership: the reader owns its I/O engine, open files and store client; the catalog must
// outlive it. Destinations belong to the caller.
// Errors: std::runtime_error naming the checkpoint and the chunk (file, offset, unit, kind,
// elements): a missing data file or object, a failed or short read, a CRC mismatch. read() waits
// for every read of its batch before it returns or throws, so no read lands in memory the caller
// frees. A data object that a committed manifest names but the store does not show yet (a store
// weaker than read-after-write) is asked for again for up to about 4 s before that is an error.
// Thread safety: one thread at a time.
#pragma once

#include <filesystem>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "checkpoint/catalog.h"
#include "checkpoint/format.h"
#include "strata/offload/file.h"
#include "strata/offload/io_engine.h"
#include "strata/offload/object_store.h"

namespace strata::engine::ckpt {

class ChunkReader {
 public:
  // `location`: the checkpoint's directory or object URL; `catalog`: its chunks; `transfer`: the
  // object reads' largest request and how many are in flight.
  ChunkReader(fs::path location, ChunkCatalog& catalog, offload::TransferOptions transfer = {});

  // One chunk into `dst`: numel x 4 bytes (page-aligned memory is read with direct I/O).
  struct Request {
    Chunk chunk;  // placed or not: the reader places it through the catalog
    float* dst;
  };
  // Reads and checks every request; at most `window` in flight at once.
  void read(const std::vector<Request>& batch, size_t window = 16);

  const fs::path& dir() const { return dir_; }

 private:
  offload::File& file(const Chunk& chunk);
  void read_objects(const std::vector<Request>& batch, size_t window);

  fs::path dir_;
  ChunkCatalog& catalog_;
  std::unique_ptr<offload::IoEngine> io_;
  std::map<std::string, offload::File> files_;
  std::unique_ptr<offload::ObjectStore> store_;  // set for an object location
  std::string object_name_;
  offload::TransferOptions transfer_;
};

}  // namespace strata::engine::ckpt
