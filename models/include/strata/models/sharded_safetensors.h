// A Hugging Face weights set written tensor by tensor: one model.safetensors, or when the
// tensors' bytes exceed the shard limit, model-00001-of-0000N.safetensors ... with
// model.safetensors.index.json ({"metadata": {"total_size": bytes}, "weight_map": {tensor: file}})
// as transformers' save_pretrained writes them and from_pretrained (and SafetensorsCheckpoint)
// reads them. Shards are cut as transformers cuts them (huggingface_hub's
// split_state_dict_into_shards): tensors in the given order fill the shard in progress, which
// is closed when the next tensor would take it past the limit; a tensor larger than the limit is
// a shard of its own, numbered when it comes (so at most two shards are open at once).
//
// Several writers may share one set (ranks that all see the directory): each is given the same
// tensors and limit and a Part, the shards it writes (and whether it writes the index); it is
// then given only its shards' tensors, in the declared order. Together they write the files one
// writer would, byte for byte.
//
// Ownership and errors as SafetensorsWriter (each shard appears complete, via a temporary name,
// once its last tensor is written; destroyed unfinished, the shard in progress goes and the
// complete ones stay: exports write into a temporary directory that goes as a whole). Not thread
// safe.
#pragma once

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <functional>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "strata/models/safetensors.h"

namespace strata::models {

// A fingerprint of the Hugging Face model in `dir` that reads little of its data: a 64-bit FNV-1a
// hash over its config.json and, for each *.safetensors file in name order, its name, size, header
// (the JSON of names, dtypes, shapes and offsets) and 16 samples of 4 KiB evenly spaced over its
// data, as "fnv1a64:<16 hex digits> (<N> files, <bytes> bytes)". Another model, another cut into
// shards, other dtypes or shapes change it, and so do other values of one layout unless they
// differ only outside the samples (checkpoints of frozen tensors record it: hashing 140 GB at
// every start is not an option). Throws std::runtime_error naming a file it cannot read.
std::string model_fingerprint(const std::filesystem::path& dir);

// The tensors (indices into `specs`) of each shard, in file order, cut as above. Throws
// SafetensorsError for a zero limit.
std::vector<std::vector<size_t>> plan_shards(const std::vector<SafetensorsWriter::Spec>& specs, uint64_t max_shard_bytes);

// Which of a set's files one writer writes: shards[i] for shard i (empty: every shard), and the
// index.
struct ShardSetPart {
  std::vector<bool> shards;
  bool index = true;
};

class ShardedSafetensorsWriter {
 public:
  using Part = ShardSetPart;
  ShardedSafetensorsWriter(const std::filesystem::path& dir, std::vector<SafetensorsWriter::Spec> specs,
                           uint64_t max_shard_bytes, const std::map<std::string, std::string>& metadata = {},
                           Part part = {});
  ~ShardedSafetensorsWriter();
  ShardedSafetensorsWriter(const ShardedSafetensorsWriter&) = delete;
  ShardedSafetensorsWriter& operator=(const ShardedSafetensorsWriter&) = delete;

  // Bytes of the current tensor, in the declared order (as SafetensorsWriter::append); of a
  // part, the next of its shards' tensors.
  void append(std::span<const std::byte> bytes);
  // The whole of tensor `name`, which must be the next one.
  void write(const std::string& name, std::span<const std::byte> bytes);
  // Finishes the last shard and writes the index (when sharded, and the part writes it). Throws SafetensorsError naming
  // the first tensor not fully written.
  void finish();
  // The set's file names (shards, then the index when there is one), a part's and the others'.
  const std::vector<std::string>& files() const { return files_; }
  // Called with each shard's file name (in `dir`) as soon as the shard is complete, before the
  // next tensor is taken; it may move the file away (an export to object storage uploads each
  // shard and stages no more than one). Not called for the index, which finish() writes. Its
  // exceptions propagate from the append or write that completed the shard.
  void on_shard_complete(std::function<void(const std::string& file)> f) { on_shard_ = std::move(f); }
  size_t shards() const { return shard_specs_.size(); }

 private:
  void begin_tensor(size_t t);
  void end_tensor();
  bool writes_shard(size_t shard) const { return part_.shards.empty() || part_.shards[shard]; }

  std::filesystem::path dir_;
  std::map<std::string, std::string> metadata_;
  Part part_;
  std::vector<std::vector<SafetensorsWriter::Spec>> shard_specs_;
  std::vector<size_t> shard_of_;       // by tensor
  std::vector<size_t> last_of_shard_;  // the tensor that completes each shard
  std::vector<uint64_t> tensor_bytes_;
  std::vector<std::string> files_;
  std::vector<std::string> order_;  // tensor names in the declared order
  std::vector<std::unique_ptr<SafetensorsWriter>> writers_;  // by shard; open while in progress
  size_t tensor_ = 0;
  uint64_t left_in_tensor_ = 0, total_bytes_ = 0;
  bool finished_ = false;
  std::function<void(const std::string&)> on_shard_;
};

// transformers' default shard limit (save_pretrained's max_shard_size "5GB"): run.export_shard_size
// and `strata ckpt export` start from it.
inline constexpr uint64_t kDefaultShardBytes = 5'000'000'000;

// The shard file names transformers uses: model-00001-of-00003.safetensors, or
// model.safetensors for one shard.
std::string shard_file_name(size_t index, size_t count);
// The files of a set of `count` shards: the shards, then the index when count > 1.
std::vector<std::string> shard_set_files(size_t count);

}  // namespace strata::models
