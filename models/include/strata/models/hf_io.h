// Hugging Face checkpoints in and out: config.json + safetensors (single file or sharded).
//
// Name mapping: Strata names its parameters as Hugging Face does (GPT2LMHeadModel,
// LlamaForCausalLM). GPT-2 checkpoints saved from GPT2Model have no "transformer." prefix; both
// are accepted. GPT-2's Conv1D weights (attn.c_attn, attn.c_proj, mlp.c_fc, mlp.c_proj) are stored
// [in, out] by Hugging Face and [out, in] by Strata: transposed on load and on export. Causal-mask
// buffers of old GPT-2 checkpoints (attn.bias, attn.masked_bias) are ignored, and so is an
// lm_head.weight in a checkpoint of a tied model.
//
// Errors (std::runtime_error / SafetensorsError) name the file and tensor: missing tensors,
// unexpected tensors, shape mismatches, dtypes that are not floating point.
#pragma once

#include <filesystem>
#include <memory>

#include "strata/models/decoder.h"
#include "strata/models/safetensors.h"

namespace strata::models {

// True for the tensors Hugging Face stores transposed relative to Strata (GPT-2's Conv1D
// weights), so that exporters that do not hold a Decoder (strata ckpt export) agree with
// export_hf_model.
bool hf_stores_transposed(const ModelConfig& config, const std::string& hf_name);

// `source` (the checkpoint's path) is named in every error.
void load_hf_weights(Decoder& model, const SafetensorsCheckpoint& checkpoint,
                     const std::string& source);
// config.json + weights from `dir`.
std::unique_ptr<Decoder> load_hf_model(const std::filesystem::path& dir);
// Writes dir/config.json and dir/model.safetensors, streaming one tensor at a time (each in the
// model's dtype, copied to the CPU one at a time if the model is on a GPU). `dir` is created if
// missing.
void export_hf_model(Decoder& model, const std::filesystem::path& dir);

}  // namespace strata::models
