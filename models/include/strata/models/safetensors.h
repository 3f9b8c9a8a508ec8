// Hugging Face safetensors files: validated reading (memory-mapped, single or sharded) and
// streamed writing. No libtorch: tensors are (dtype, shape, bytes).
//
// File format (https://huggingface.co/docs/safetensors): an 8-byte little-endian header length
// N, N bytes of UTF-8 JSON {"name": {"dtype": "F32", "shape": [..], "data_offsets": [b, e]}, ...,
// "__metadata__": {"k": "v"}}, then the data section; offsets are relative to the data section.
//
// Validation on open (each failure is a SafetensorsError naming the file and, where there is one,
// the tensor): header length beyond the file or absurdly large, JSON that does not parse or is
// not an object, unknown dtype, malformed shape or offsets, offsets outside the data section,
// overlapping tensors, byte size != numel * dtype size, data section shorter than the tensors
// (truncated file). Sharded checkpoints: every tensor of model.safetensors.index.json's
// weight_map must be in the shard it names, and no shard may hold tensors the index does not.
//
// Ownership: SafetensorsFile owns its mapping; TensorView pointers stay valid while it lives.
// Thread safety: const members are safe from any thread. SafetensorsWriter is single-threaded.
#pragma once

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <map>
#include <memory>
#include <span>
#include <stdexcept>
#include <string>
#include <vector>

namespace strata::models {

class SafetensorsError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

enum class StDType { kF64, kF32, kF16, kBF16, kI64, kI32, kI16, kI8, kU8, kBool };
const char* to_string(StDType dtype);            // "F32", "BF16", ...
StDType parse_st_dtype(const std::string& name);  // throws SafetensorsError
size_t st_dtype_bytes(StDType dtype);

struct TensorInfo {
  std::string name;
  StDType dtype;
  std::vector<int64_t> shape;
  uint64_t begin = 0;  // byte offsets within the data section
  uint64_t end = 0;
  uint64_t numel() const;
  uint64_t bytes() const { return end - begin; }
};

struct TensorView {
  const TensorInfo* info;
  std::span<const std::byte> data;
};

// Parses and validates a header (the JSON text) against a data section of `data_bytes`.
// `file` is used in error messages only. Exposed for the fuzz test.
std::vector<TensorInfo> parse_safetensors_header(const std::string& json, uint64_t data_bytes,
                                                 const std::string& file,
                                                 std::map<std::string, std::string>* metadata);

class SafetensorsFile {
 public:
  // Maps and validates the file; throws SafetensorsError (format) or std::system_error (I/O).
  explicit SafetensorsFile(const std::filesystem::path& path);
  ~SafetensorsFile();
  SafetensorsFile(const SafetensorsFile&) = delete;
  SafetensorsFile& operator=(const SafetensorsFile&) = delete;

  const std::filesystem::path& path() const { return path_; }
  const std::vector<TensorInfo>& tensors() const { return tensors_; }  // in file order
  const std::map<std::string, std::string>& metadata() const { return metadata_; }
  bool contains(const std::string& name) const;
  // Throws SafetensorsError naming the file if absent.
  TensorView get(const std::string& name) const;
  // Lets the kernel drop the mapped pages wholly inside [begin, begin + bytes) (a range of this
  // file's mapping) from this process's memory; a later read faults them in again from the file.
  // For a reader passing once over a large tensor, so that its resident memory does not grow with
  // the file. No effect outside the mapping.
  void release(const std::byte* begin, size_t bytes) const;

 private:
  std::filesystem::path path_;
  const std::byte* map_ = nullptr;
  size_t map_bytes_ = 0;
  uint64_t data_offset_ = 0;
  std::vector<TensorInfo> tensors_;
  std::map<std::string, size_t> index_;
  std::map<std::string, std::string> metadata_;
};

// A checkpoint directory or file: model.safetensors, or model.safetensors.index.json + shards.
class SafetensorsCheckpoint {
 public:
  // `path`: a .safetensors file, an index .json, or a directory holding one of them.
  explicit SafetensorsCheckpoint(const std::filesystem::path& path);
  std::vector<std::string> names() const;  // sorted
  bool contains(const std::string& name) const;
  TensorView get(const std::string& name) const;  // throws SafetensorsError naming the tensor

 private:
  std::vector<std::unique_ptr<SafetensorsFile>> files_;
  std::map<std::string, const SafetensorsFile*> where_;
};

// Streams a safetensors file: the header (all names, dtypes, shapes) is fixed at construction,
// then each tensor's bytes are written in the declared order, possibly in several pieces, so the
// model never has to be in memory at once. The file appears atomically at finish() (written to
// "<path>.tmp", fsynced, renamed); destroying an unfinished writer removes the temporary file.
class SafetensorsWriter {
 public:
  struct Spec {
    std::string name;
    StDType dtype;
    std::vector<int64_t> shape;
  };
  SafetensorsWriter(const std::filesystem::path& path, std::vector<Spec> specs,
                    const std::map<std::string, std::string>& metadata = {});
  ~SafetensorsWriter();
  SafetensorsWriter(const SafetensorsWriter&) = delete;
  SafetensorsWriter& operator=(const SafetensorsWriter&) = delete;

  // Appends bytes of the current tensor; moves to the next one when it is complete. Throws
  // SafetensorsError if more bytes are given than the declared tensors hold.
  void append(std::span<const std::byte> bytes);
  // Convenience: the whole of tensor `name`, which must be the next one.
  void write(const std::string& name, std::span<const std::byte> bytes);
  // Throws SafetensorsError naming the first tensor not fully written.
  void finish();

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace strata::models
