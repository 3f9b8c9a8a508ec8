// The checkpoint format's one definition (docs/FORMATS.md, "Checkpoints"): the layout of a
// checkpoint directory, the manifest, chunking, and the atomic file writes the commit protocol
// rests on. Private to engine/src; the checkpoint/ sources (save, load, export, inspect, the chunk
// reader) use it.
//
//   <root>/latest                      name of the newest committed checkpoint
//   <root>/<name>/rank-RRRRR.data      a rank's chunks: <= kChunkElements fp32 each, at
//                                      kAlign-aligned offsets
//   <root>/<name>/rank-RRRRR.index.json where the rank's chunks are, and their CRCs (catalog.h)
//   <root>/<name>/manifest.json        written last: the commit point
//
// Errors: std::runtime_error naming the path and errno's text.
#pragma once

#include <algorithm>

#include <ATen/core/Tensor.h>
#include <nlohmann/json.hpp>

#include <cstdint>
#include <filesystem>
#include <map>
#include <vector>
#include <memory>
#include <optional>
#include <string>

#include "strata/engine/partition.h"
#include "strata/engine/placement.h"
#include "strata/models/quantized_base.h"
#include "strata/offload/object_store.h"

namespace strata::engine {
struct CheckpointMeta;  // strata/engine/checkpoint.h
}

namespace strata::engine::ckpt {

namespace fs = std::filesystem;
using nlohmann::json;

// Format 2 added tensors that are parts of whole tensors ("of": block tiles). Format 3 moved the
// chunk list out of the manifest into one index file per rank (catalog.h): the metadata grows
// with units x ranks, not with the bytes. Saves write format 3; all three are read.
constexpr int kFormatVersion = 3;
constexpr int kFormatWithIndexes = 3;
constexpr int kFormatWithoutParts = 1;
constexpr uint64_t kChunkElements = 1ull << 20;  // 4 MiB of fp32
constexpr uint64_t kAlign = 4096;
// The kinds saved are state::kSavedKinds (placement.h), named by state::kind_name.

// "rank-00007".
std::string rank_name(int rank);
// Bytes a chunk of `numel` elements takes in a data file (its offset advances by this).
inline uint64_t chunk_extent(uint64_t numel) { return (numel * 4 + kAlign - 1) / kAlign * kAlign; }
// How one rank's slice of a unit's kind (`numel` elements) is cut into chunks and laid out in its
// data file: chunk i holds elements [i x chunk_elements, +numel_of(i)) (the last one shorter) at
// i x chunk_extent(chunk_elements) bytes from the slice's offset. The one rule of the writer
// (save.cc) and the readers (catalog.cc).
struct SliceChunks {
  uint64_t numel;
  uint64_t chunk_elements = kChunkElements;
  uint64_t count() const { return (numel + chunk_elements - 1) / chunk_elements; }
  uint64_t first(uint64_t i) const { return i * chunk_elements; }  // its first element
  uint64_t numel_of(uint64_t i) const { return std::min(chunk_elements, numel - first(i)); }
  uint64_t offset(uint64_t i) const { return i * chunk_extent(chunk_elements); }
  uint64_t chunk_at(uint64_t element) const { return element / chunk_elements; }  // the chunk holding it
  uint64_t file_bytes() const { return count() == 0 ? 0 : offset(count() - 1) + chunk_extent(numel_of(count() - 1)); }
};

[[noreturn]] void fail_errno(const std::string& what, const fs::path& p);
// Temporary file, fsync, rename, fsync of the directory (offload::sync_directory): durable once
// it returns, provided the directory's own entry is (offload::create_directories_durably).
void write_atomically(const fs::path& path, const std::string& text);
std::string read_text(const fs::path& p);

// The save directories under a root (`step-*`, names sorted): those with a manifest (committed)
// and those without (a save a crash cut short, or one in flight). The one listing that retention
// and the resume point both read.
struct StepDirectories {
  std::vector<std::string> committed, half_written;
};
StepDirectories step_directories(const fs::path& root);

// The units and their tensors as the manifest records them (a load compares them).
json partition_json(const Partition& part);

// The manifest's tensors ("units" as partition_json writes them), in unit order, each with its
// place in its unit's flat buffer and, for a block tile's part, the whole tensor it is cut from
// ("of": {"name", "shape", "dim", "begin"}); a 4-bit record of a frozen unit (model.quantize)
// with its place and elements ("at", "stored", "quant4": slot.quantized). Throws std::runtime_error naming `where` when a
// unit's tensors do not add up to its size.
struct ManifestTensor {
  size_t unit = 0;
  uint64_t offset = 0, numel = 0;  // in the unit's flat buffer
  TensorSlot slot;                 // name, shape, origin (offset/numel as above)
};
std::vector<ManifestTensor> manifest_tensors(const json& units, const std::string& where);
// A stretch of a tensor's elements that is contiguous in its whole tensor as well:
// [whole_begin, whole_begin + numel) of the whole tensor is [flat_begin, flat_begin + numel) of
// the unit's buffer. A whole tensor is one run; a part along dim 0 one; along dim 1 one a row.
struct WholeRun {
  uint64_t whole_begin = 0, numel = 0, flat_begin = 0;
};
std::vector<WholeRun> whole_runs(const TensorSlot& slot);
// The whole tensors a manifest's units hold: name -> shape (Strata's layout).
std::map<std::string, std::vector<int64_t>> whole_tensors(const std::vector<ManifestTensor>& tensors);
// Throws std::runtime_error naming `where` unless the parts of every whole tensor cover it
// exactly once (whole tensors trivially do).
void check_whole_coverage(const std::vector<ManifestTensor>& tensors, const std::string& where);
// A page-aligned fp32 host tensor, so that the I/O engine can move it with O_DIRECT.
at::Tensor aligned_floats(int64_t n);

// A checkpoint's location is a directory or, for one uploaded to object storage
// (checkpoint_store.h), "<store URL>/<name>" with an s3:// (or registered) store URL: every
// reader below takes either. (fs::path carries the URL unchanged; it is never normalized.)
bool is_object_location(const fs::path& location);
struct ObjectLocation {
  std::unique_ptr<offload::ObjectStore> store;  // the store the checkpoint is in
  std::string name;                             // the checkpoint's name there
};
ObjectLocation open_object_location(const fs::path& location);
// Where a manifest's data files are, relative to the checkpoint: "<save id>/" in one uploaded to
// an object store, "" in one saved locally.
std::string data_prefix(const json& manifest);

// The manifest of a committed checkpoint; throws naming what is wrong (never committed, not
// JSON, another format).
json read_manifest(const fs::path& dir);
// The key of checkpoint `name`'s manifest in an object store.
inline std::string stored_manifest_key(const std::string& name) { return name + "/manifest.json"; }
// The manifest of checkpoint `name` in an object store: nullopt when it is not there (never
// committed, or not visible yet); throws like read_manifest for one that is not a manifest.
std::optional<json> read_stored_manifest(offload::ObjectStore& store, const std::string& name);
// A 4-bit base's quantization as a manifest records it ("quantize": BitsAndBytesConfig's keys,
// bnb_4bit_compute_dtype the run's compute dtype), and back: what a merge into the dequantized
// weights repeats. manifest_quantization: nullopt for a manifest without one (a 16-bit base, or
// saved before it was recorded).
json quantization_json(const models::QuantizedBase& q, at::ScalarType compute);
struct ManifestQuantization {
  models::QuantizedBase q;
  at::ScalarType compute = at::kFloat;
};
std::optional<ManifestQuantization> manifest_quantization(const json& manifest, const fs::path& dir);
// The training position a manifest records (`dir` names the checkpoint in errors).
CheckpointMeta checkpoint_meta(const json& manifest, const fs::path& dir);
// Parses and checks a manifest's text (`where` names it in errors).
json parse_manifest(const std::string& text, const std::string& where);

}  // namespace strata::engine::ckpt
