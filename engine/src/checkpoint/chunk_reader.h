// The one way a checkpoint's chunks are read back (load, verify, export): data files opened on
// first use, a batch of chunks read concurrently through one I/O engine, each checked against
// its CRC32C.
//
// Ownership: the reader owns its I/O engine and open files; the manifest's JSON (`units`, the
// chunks passed to read()) must outlive it. Destinations belong to the caller.
// Errors: std::runtime_error naming the checkpoint and the chunk (file, offset, unit, kind,
// elements): a missing data file, a failed or short read, a CRC mismatch. read() waits for every
// read of its batch before it returns or throws, so no read lands in memory the caller frees.
// Thread safety: one thread at a time.
#pragma once

#include <filesystem>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "checkpoint/format.h"
#include "strata/offload/file.h"
#include "strata/offload/io_engine.h"

namespace strata::engine::ckpt {

class ChunkReader {
 public:
  ChunkReader(fs::path dir, const json& units);

  // One chunk into `dst`: numel x 4 bytes (page-aligned memory is read with direct I/O).
  struct Request {
    const json* chunk;
    float* dst;
  };
  // Reads and checks every request; at most `window` in flight at once.
  void read(const std::vector<Request>& batch, size_t window = 16);

  const fs::path& dir() const { return dir_; }

 private:
  offload::File& file(const json& chunk);

  fs::path dir_;
  const json& units_;
  std::unique_ptr<offload::IoEngine> io_;
  std::map<std::string, offload::File> files_;
};

}  // namespace strata::engine::ckpt
