// Weights saved in 4 bits by transformers + bitsandbytes (save_pretrained of a model loaded with
// BitsAndBytesConfig(load_in_4bit=True): the "bnb-4bit" checkpoints published on the Hub).
//
// A weight W of n elements saved so is a uint8 tensor W [(n + 1) / 2, 1] of packed codes with,
// beside it:
//   W.absmax             fp32 [blocks] (uint8 [blocks] with double quantization: the qabsmax)
//   W.quant_map          fp32 [16], the 4-bit code table (must be bitsandbytes' NF4 or FP4)
//   W.quant_state.bitsandbytes__<nf4|fp4>
//                        uint8: JSON {quant_type, blocksize, dtype, shape[, nested_blocksize,
//                        nested_offset]}
//   W.nested_absmax      fp32 [nested blocks] (double quantization)
//   W.nested_quant_map   fp32 [256], bitsandbytes' dynamic 8-bit map (double quantization)
// These are exactly the parts of Strata's 4-bit record (quantized_base.h), so the engine copies
// them into its record without a round trip through 16 bits (read_quant4_record), and any other
// reader gets the dequantization in fp32 (dequantize_saved_4bit: what bitsandbytes'
// dequantize_4bit gives in fp32).
//
// Errors: std::runtime_error naming `source` (the checkpoint) and the tensor: a statistic missing,
// a size, dtype or quant_state that does not match, a code table that is not bitsandbytes', a
// quantization other than the one asked for. Thread safety: pure functions over the mapped files.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstddef>
#include <span>
#include <string>
#include <vector>

#include "strata/models/quantized_base.h"
#include "strata/models/safetensors.h"

namespace strata::models {

// The weight whose statistic checkpoint key `key` is (".absmax", ".quant_map", ".nested_absmax",
// ".nested_quant_map", ".quant_state.bitsandbytes__*" removed), or "" when it is none.
std::string quant4_statistic_of(const std::string& key);
// Whether weight `key` is saved in 4 bits (its quant_state is there).
bool saved_in_4bit(const SafetensorsCheckpoint& ckpt, const std::string& key);

// A saved 4-bit weight's settings and shape (its quant_state), every statistic checked present
// with its size and dtype, the code tables bitsandbytes'.
struct SavedQuant4 {
  QuantizedBase settings;     // quant_type, double_quant, blocksize (skip_modules untouched)
  std::vector<int64_t> shape;  // the weight's, as Hugging Face stores it ([out, in])
  float offset = 0;            // double quantization's nested_offset
};
SavedQuant4 read_quant4_state(const SafetensorsCheckpoint& ckpt, const std::string& key, const std::string& source);

// The record (quant4_record(numel, q).bytes() bytes) of weight `key`, saved with the settings of
// `q` (quant type, double quantization, block size; else refused naming both).
void read_quant4_record(const SafetensorsCheckpoint& ckpt, const std::string& key, const QuantizedBase& q,
                        std::span<std::byte> record, const std::string& source);

// Weight `key` dequantized into fp32, in its saved shape.
at::Tensor dequantize_saved_4bit(const SafetensorsCheckpoint& ckpt, const std::string& key, const std::string& source);

// The record of a weight as a run with `q` stores it, in libtorch (the engine quantizes its base at
// load with these; a merge into the dequantized weights repeats them). `w`: contiguous, on the CPU,
// in the compute dtype (fp32, bf16 or fp16). quant4_offset: double quantization's offset as
// bitsandbytes takes it (torch's fp32 mean of the blocks' absmax; 0 without double quantization).
// quantize_record: `w` into `record` (quant4_record(w.numel(), q).bytes() bytes) as bitsandbytes'
// quantize_4bit does, around `offset`. dequantize_record: a record of out.numel() elements into
// `out` (contiguous, CPU, fp32/bf16/fp16).
float quant4_offset(const at::Tensor& w, const QuantizedBase& q);
void quantize_record(const at::Tensor& w, const QuantizedBase& q, float offset, std::span<std::byte> record);
void dequantize_record(std::span<const std::byte> record, const QuantizedBase& q, const at::Tensor& out);
// What a run with `q` computing in `compute` trains on for the weight whose 16-bit value is `w`:
// w in `compute`, quantized, dequantized, in fp32 (single-process offsets: see docs/FORMATS.md).
at::Tensor quantized_dequantized(const at::Tensor& w, const QuantizedBase& q, at::ScalarType compute);

}  // namespace strata::models
