// A 4-bit frozen base (QLoRA): which tensors are stored in 4 bits, and how their bytes sit in a
// unit's flat buffer. The settings are bitsandbytes' BitsAndBytesConfig (model.quantize, read by
// config_quantize.cc; docs/CONFIG.md), the blocks are its `quantize_4bit`'s
// (kernels/quant4.h, bitwise on the CPU).
//
// Which tensors: the weight of every block linear (block_linears: q, k, v, o, gate, up, down)
// that transformers would turn into a bitsandbytes Linear4bit, unless llm_int8_skip_modules names
// its module (transformers' should_convert_module rule: a pattern matching the module's name
// from its start up to a "." boundary, as a regular expression, or as a suffix). Biases, norms,
// embeddings and the head stay in the compute dtype (bitsandbytes keeps the same). A 4-bit tensor
// is always frozen: the caller decides frozen-ness (model.trainable), this header only whether a
// frozen tensor is stored in 4 bits.
//
// The record (docs/FORMATS.md "4-bit blocks"): a 4-bit tensor of n elements occupies, in its
// unit's flat buffer of the compute dtype, a record starting on a 16-byte boundary of the buffer:
// the absmax of its blocks (fp32, quant4_blocks(n, blocksize) of them), then the packed codes
// (quant4_packed_bytes(n) bytes), padded to whole elements; with double quantization the offset
// (fp32) and the nested absmax (fp32, one per 256 blocks) first, and the absmax as uint8 qabsmax. Every rank's shard, every tier and the
// all-gather move those bytes as they move any compute copy; only the stage's binding dequantizes.
//
// Pure functions; thread-safe. Errors: std::invalid_argument naming the setting.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace strata::models {

struct ModelConfig;

struct QuantizedBase {
  bool load_in_4bit = false;
  std::string quant_type = "nf4";  // bnb_4bit_quant_type: "nf4" or "fp4"
  bool double_quant = false;       // bnb_4bit_use_double_quant: the absmax quantized to 8 bits
  int64_t blocksize = 64;          // bitsandbytes' 4-bit block, as transformers uses it
  // llm_int8_skip_modules: modules kept in the compute dtype (transformers' default: the head).
  std::vector<std::string> skip_modules = {"lm_head"};
  bool enabled() const { return load_in_4bit; }
  // Whether llm_int8_skip_modules keeps the module `module` ("model.layers.0.mlp.down_proj").
  bool skips(const std::string& module) const;
  // "nf4, blocks of 64" (the log and the base's fingerprint); "" when not enabled.
  std::string describe() const;
};

// The frozen base's fingerprint a checkpoint records (model_fingerprint of its 16-bit files, with
// the quantization when `q` is enabled), and whether a recorded one names the base whose
// fingerprint is `base` (in 16 bits or quantized from it: the adapters merge into either).
std::string base_fingerprint(const std::string& base, const QuantizedBase& q);
bool trained_on(const std::string& recorded, const std::string& base);

// Whether the whole tensor `name` of `c` is a block linear's weight that c.quantize stores in 4
// bits when frozen (false when c.quantize is not enabled).
bool stored_4bit(const ModelConfig& c, const std::string& name);

// A 4-bit tensor's record: its parts' bytes, in this order (fp32 parts first, so each is aligned).
struct Quant4Record {
  uint64_t offset_bytes = 0;  // double quantization: the absmax' fp32 mean (bitsandbytes' offset)
  uint64_t nested_bytes = 0;  // double quantization: the fp32 absmax of each 256 blocks' qabsmax
  uint64_t absmax_bytes = 0;  // fp32 absmax a block; with double quantization uint8 qabsmax
  uint64_t packed_bytes = 0;  // the packed codes, two a byte
  uint64_t nested_at() const { return offset_bytes; }
  uint64_t absmax_at() const { return offset_bytes + nested_bytes; }
  uint64_t packed_at() const { return absmax_at() + absmax_bytes; }
  uint64_t bytes() const { return packed_at() + packed_bytes; }
};
Quant4Record quant4_record(uint64_t numel, const QuantizedBase& q);

// A tensor's place in a unit's flat buffer of `elem_bytes`-byte elements: the elements it
// occupies and the multiple of elements it starts on (a 4-bit record's, or the tensor's own
// elements starting anywhere). Partition and unit_shapes both lay a unit out with these.
struct StoredTensor {
  uint64_t numel = 0;
  uint64_t align = 1;
  bool quantized = false;
};
constexpr uint64_t kQuant4RecordAlignBytes = 16;
StoredTensor stored_tensor(const ModelConfig& c, const std::string& whole_name, uint64_t numel, bool frozen,
                           uint64_t elem_bytes);
// Where a tensor stored as `t` starts after a unit's first `end` elements.
inline uint64_t stored_start(uint64_t end, const StoredTensor& t) { return (end + t.align - 1) / t.align * t.align; }

}  // namespace strata::models
