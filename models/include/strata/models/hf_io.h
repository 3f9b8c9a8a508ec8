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
#include <optional>
#include <string>
#include <vector>

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
// Tensor `name` of `checkpoint` in fp32 and Strata's layout (GPT-2's Conv1D weights transposed),
// a copy: what exporters that stream a base model read (export_checkpoint_merged).
at::Tensor read_hf_tensor(const ModelConfig& config, const SafetensorsCheckpoint& checkpoint, const std::string& name,
                          const std::string& source);
// Its shape as the file stores it (Hugging Face's layout), from the header.
std::vector<int64_t> hf_tensor_shape(const ModelConfig& config, const SafetensorsCheckpoint& checkpoint,
                                     const std::string& name, const std::string& source);
// Sources of initial values (Decoder::set_source), each holding its files mapped: a Hugging Face
// model directory's tensors (every tensor of `config` but LoRA adapters), and a PEFT LoRA adapter
// directory's (adapter_model.safetensors: the adapters, keys
// "base_model.model.<module>.lora_A.weight", and the tensors of modules_to_save,
// "base_model.model.<tensor>", which it gives instead of the base's). Each converted to fp32.
// Made, each checks the names: a tensor missing there, or one there the model does not take;
// a tensor's shape is checked when it loads. std::runtime_error naming the file and tensor.
Decoder::TensorSource hf_model_source(const ModelConfig& config, const std::filesystem::path& dir);
Decoder::TensorSource hf_model_source(const ModelConfig& config, std::shared_ptr<const SafetensorsCheckpoint> checkpoint,
                                      const std::string& source);
Decoder::TensorSource peft_adapter_source(const ModelConfig& config, const std::filesystem::path& dir);
// The model in `dir` (config.json + weights) with Init::kDeferred: its weights load as its stages
// are initialized, so a consumer that takes it stage by stage (the engine: one unit at a time,
// each dropped once placed) never holds more than a block of it in fp32 beside the mapped files.
// With `lora` its adapters are initialized as PEFT does (decoder.h), or from `adapter_dir`'s.
// `quantize`: the training configuration's 4-bit base (model.quantize). A weight saved in 4 bits
// (quant4_checkpoint.h) reads as its fp32 dequantization, or, where `quantize` stores it in 4 bits,
// as its record (Decoder::set_record_source: copied, not quantized again).
std::unique_ptr<Decoder> open_hf_model(const std::filesystem::path& dir, const ModelConfig::Lora& lora = {},
                                       const std::filesystem::path& adapter_dir = {},
                                       const QuantizedBase& quantize = {});
// The same, every stage loaded now.
std::unique_ptr<Decoder> load_hf_model(const std::filesystem::path& dir, const ModelConfig::Lora& lora = {});
// w + scaling * (b a), in fp32 and Strata's [out, in] layout: an adapter merged into the weight it
// adapts, in the order of PEFT's merge_and_unload (b a first, then scaled, then added).
at::Tensor merged_weight(const at::Tensor& w, const at::Tensor& a, const at::Tensor& b, double scaling);
// The same for weight `w` that `what` (adapted_weight) describes, from its module's whole
// adapters `a`, `b`: an expert's weight takes its expert's share (expert_adapter).
at::Tensor merged_weight(const ModelConfig& c, const AdaptedWeight& what, const at::Tensor& w, const at::Tensor& a,
                         const at::Tensor& b);
// transformers' name of a dtype ("float32", "bfloat16", "float16"), and back (throws
// std::invalid_argument for another name).
const char* hf_dtype_name(at::ScalarType t);
at::ScalarType parse_export_dtype(const std::string& name);
// Writes dir/config.json and the weights (model.safetensors, or shards of at most
// `max_shard_bytes` with model.safetensors.index.json: sharded_safetensors.h), streaming one
// tensor at a time, each converted to `dtype` (default: the model's) and copied to the CPU one
// at a time if the model is on a GPU. `dir` is created if missing.
void export_hf_model(Decoder& model, const std::filesystem::path& dir, std::optional<at::ScalarType> dtype = {},
                     uint64_t max_shard_bytes = UINT64_MAX);
// Copies the tokenizer's files (tokenizer.json, tokenizer_config.json, special_tokens_map.json,
// tokenizer.model, vocab.json, merges.txt, added_tokens.json, chat templates) and
// generation_config.json that exist in `from` into `to`; returns their names.
std::vector<std::string> copy_tokenizer_files(const std::filesystem::path& from, const std::filesystem::path& to);

// A Hugging Face model directory written whole or not at all, the one way every export goes
// (`strata ckpt export`, `run.export`): the files are written into `<out>.export-tmp` beside it
// (tmp()), and commit() syncs every file written, then removes `out`'s config.json and the weight
// files of an earlier export (model.safetensors, model-NNNNN-of-NNNNN.safetensors, the index)
// that the new one does not replace, renames the new files in, config.json last (so a
// config.json never describes weights that are not there), fsyncing `out` after each of these
// three phases (so that the order holds through a power cut; `out` and the temporary
// directory's missing parents are created with their entries fsynced); a failure
// before the removal, or destruction uncommitted, leaves `out` as it was. Files written into
// tmp() replace theirs in `out` (a tokenizer copied from the source model); other files in `out`
// are kept. Not thread safe; errors are std::runtime_error naming the path.
// An adapter directory (ExportKind::kAdapter, PEFT's) is committed alike, adapter_config.json
// taking config.json's part (its weights, one adapter_model.safetensors, replace theirs).
enum class ExportKind { kModel, kAdapter };
class ExportDirectory {
 public:
  // Refuses, before anything is written, an `out` that exists and is not a directory, or a
  // non-empty one unless `overwrite` (the message names what is in it and ends with
  // `how_to_overwrite`, e.g. "pass --force ..."). check() alone is the same test for a run that
  // exports only after hours of training.
  static void check(const std::filesystem::path& out, bool overwrite, const std::string& how_to_overwrite);
  ExportDirectory(const std::filesystem::path& out, bool overwrite, const std::string& how_to_overwrite,
                  ExportKind kind = ExportKind::kModel);
  // `<out><suffix>` beside `out`, absolute (a trailing '/' of `out` ignored): run.export_every's
  // `<out>-step-N`, and temporary().
  static std::filesystem::path beside(const std::filesystem::path& out, const std::string& suffix);
  // beside(out, ".export-tmp"): its parent must be writable.
  static std::filesystem::path temporary(const std::filesystem::path& out) { return beside(out, ".export-tmp"); }
  ExportDirectory(const ExportDirectory&) = delete;
  ExportDirectory& operator=(const ExportDirectory&) = delete;
  ~ExportDirectory();
  const std::filesystem::path& tmp() const { return tmp_; }
  void commit();

 private:
  std::filesystem::path out_, tmp_;
  ExportKind kind_;
  bool committed_ = false;
};

}  // namespace strata::models
