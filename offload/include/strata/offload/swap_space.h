// Swap space: named partitions (flat byte ranges of tensor state) stored at aligned extents in
// per-rank swap files, striped across one or more directories (one per NVMe drive, no RAID).
//
// Layout (docs/FORMATS.md has the full description):
//   <dir[d]>/strata-swap-r<rank, 5 digits>-d<d>.bin   one file per directory per rank
//   A partition of S bytes is cut into stripes of `stripe_bytes`; stripe j lives in directory
//   (first_dir + j) % D, where first_dir rotates from one allocation to the next so that small
//   partitions spread too. In each directory the partition's stripes occupy one contiguous
//   extent, aligned to `alignment`, stripe after stripe. Extents are reserved with fallocate at
//   allocation time, so running out of disk fails allocate(), not a write in the middle of a
//   step. Swap files have no header: the index (partitions() / index_json()) describes them and
//   is what a checkpoint records.
//
// Each rank creates and owns its own files; no rank touches another's. The directories must
// exist (a missing one is a clear error). Each file is locked (flock) while the SwapSpace lives:
// a second one on the same directory and rank fails with IoError instead of overwriting it.
// Thread safety: all members are safe to call concurrently. Freeing a partition while I/O on it
// is in flight is a caller error. Errors: IoError (a failed read or write: "swap read of
// partition 'NAME' bytes [A, B) of rank R: " and the I/O engine's message with file, offset and
// errno text; disk full at allocate(): "swap: cannot allocate partition ...") and
// std::invalid_argument (unknown or duplicate names, out-of-range offsets) with the partition
// name in the message.
#pragma once

#include <cstdint>
#include <filesystem>
#include <map>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <vector>

#include "strata/offload/file.h"
#include "strata/offload/io_engine.h"

namespace strata::offload {

struct SwapConfig {
  std::vector<std::filesystem::path> dirs;  // at least one
  int rank = 0;
  uint64_t stripe_bytes = 1ull << 20;  // multiple of `alignment`
  uint64_t alignment = 4096;           // extent alignment, a multiple of 4096 (whole pages)
  bool remove_files_on_close = true;   // swap is scratch; checkpoints snapshot it elsewhere
};

struct SwapExtent {
  uint32_t dir;     // index into SwapConfig::dirs
  uint64_t offset;  // in that directory's swap file, aligned
  uint64_t length;  // reserved bytes, aligned
};

struct SwapPartition {
  std::string name;
  uint64_t bytes = 0;
  uint32_t first_dir = 0;
  std::vector<SwapExtent> extents;  // one per directory that holds stripes, by directory
};

struct SwapUsage {
  uint64_t partitions = 0;
  uint64_t bytes = 0;           // sum of partition sizes
  uint64_t reserved_bytes = 0;  // sum of extent lengths
  std::vector<uint64_t> file_bytes;  // high-water mark of each directory's swap file
};

class SwapSpace {
 public:
  // Creates (truncates) this rank's swap files. Throws IoError if a directory is missing or not
  // writable, std::invalid_argument on a bad configuration.
  SwapSpace(IoEngine& io, SwapConfig config);
  ~SwapSpace();
  SwapSpace(const SwapSpace&) = delete;
  SwapSpace& operator=(const SwapSpace&) = delete;

  void allocate(const std::string& name, uint64_t bytes);
  void free(const std::string& name);
  bool contains(const std::string& name) const;
  uint64_t size(const std::string& name) const;

  // Asynchronous transfer of [offset, offset + data.size()) of a partition. Best speed with
  // `offset` a multiple of `alignment` and page-aligned buffers (pinned on GPU machines:
  // state::HostMemory); anything else still works.
  IoFuture write(const std::string& name, uint64_t offset, std::span<const std::byte> src);
  IoFuture read(const std::string& name, uint64_t offset, std::span<std::byte> dst);

  // fsync every swap file.
  void sync();

  // Where bytes [offset, offset + length) of a partition live, in order: each piece in one swap
  // file. For copies that bypass memory (copy_range: checkpoint snapshots). The File stays
  // valid while this SwapSpace lives. Throws std::invalid_argument like read().
  struct Piece {
    const File* file;
    uint64_t file_offset;
    uint64_t length;
  };
  std::vector<Piece> locate(const std::string& name, uint64_t offset, uint64_t length) const;

  const SwapConfig& config() const { return config_; }
  std::filesystem::path file_path(uint32_t dir) const;
  std::vector<SwapPartition> partitions() const;
  std::string index_json() const;
  SwapUsage usage() const;

 private:
  struct DirState;
  uint64_t reserve_in(uint32_t dir, uint64_t length);
  void release_in(uint32_t dir, uint64_t offset, uint64_t length);
  IoFuture transfer(IoRequest::Kind kind, const std::string& name, uint64_t offset,
                    std::byte* data, uint64_t length);

  IoEngine& io_;
  SwapConfig config_;
  mutable std::mutex mu_;
  std::vector<std::unique_ptr<DirState>> dirs_;
  std::map<std::string, SwapPartition> parts_;
  uint32_t next_first_dir_ = 0;
};

}  // namespace strata::offload
