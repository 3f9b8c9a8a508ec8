// What both Hugging Face exports share (export.cc: a checkpoint's; export_engine.cc: a running
// engine's): the plan of what is written, and the sink that writes it.
//
// Ownership: the plan is a value; a sink writes through the caller's writer, which outlives it.
// Errors: a sink keeps its first failure (a full disk) and writes nothing more after it; the
// caller decides when to throw it (an engine's export first finishes its collectives).
// Thread safety: none; one thread per sink.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "checkpoint/commit.h"
#include "checkpoint/format.h"
#include "strata/engine/checkpoint.h"
#include "strata/models/hf_io.h"
#include "strata/models/model_config.h"
#include "strata/models/sharded_safetensors.h"

namespace strata::engine::ckpt {

struct ExportItem {
  ManifestTensor t;
  uint64_t whole_numel;  // elements of the whole tensor it is (a part of)
  std::string key;       // its whole tensor's name in the file ("" : not written, merged into merge_into)
  std::string merge_into;  // a merge's adapter: the module whose weights it is merged into
  bool fp32 = false;       // arrives in fp32 (a merge's adapter or weight), not in the export type
};
// What is written: the manifest's tensors in order (items), and the whole tensors the file
// declares (specs), in the order they complete.
struct ExportPlan {
  std::vector<ExportItem> items;
  std::vector<models::SafetensorsWriter::Spec> specs;
  uint64_t total = 0;  // bytes of every whole tensor in the output type
};

// Tensors in unit order, packed in their unit as the partition packs them (`units`: a manifest's
// or partition_json's). A block tile's part goes into its whole tensor, which is written once its
// last part is in. Throws std::runtime_error (naming `dir`) when parts do not make a whole.
// `content` (checkpoint.h): kModel every tensor; kAdapter the adapters alone, keyed as PEFT keys
// them; kMerged the rest, each adapted weight's adapters first as merge inputs (a unit order
// where an adapter follows its weight is refused). A LoRA model's kModel is refused, as are
// kAdapter and kMerged without LoRA (std::invalid_argument).
ExportPlan plan_export(const json& units, const fs::path& dir, const models::ModelConfig& mc, models::StDType st_type,
                       ExportContent content = ExportContent::kModel);

models::StDType st_type_of(at::ScalarType type);

// What both exports write around the weights, by content: the shard limit (a PEFT adapter is one
// file, which peft requires), and the directory's kind.
uint64_t shard_limit(ExportContent content, uint64_t shard_bytes);
// The dtype written: `asked`, except for an adapter, written in fp32 whatever was asked (PEFT keeps
// adapters in fp32; rounded, base + adapter would no longer be the merged export).
at::ScalarType export_type(ExportContent content, at::ScalarType asked);
models::ExportKind directory_kind(ExportContent content);
// Completes the temporary directory `tmp` of an export whose writer has finished: kModel and
// kMerged get config.json (weights in `dtype`, transformers' name); kAdapter its one weights file
// renamed adapter_model.safetensors and adapter_config.json (`base_model` its
// base_model_name_or_path). Returns the weights files (ExportResult::files).
std::vector<std::string> finish_export_directory(const fs::path& tmp, ExportContent content, const models::ModelConfig& mc,
                                                 const std::string& dtype, size_t shards, const std::string& base_model);

// Writes a plan's tensors as their elements arrive: each item's elements flat (any float type),
// converted to `out_type` (exactly: converting the parts and assembling them is assembling and
// converting), parts assembled into their whole tensors, GPT-2's Conv1D weights transposed; a
// merge's adapters kept (fp32) until their weight comes, merged into it (models::merged_weight)
// before it is converted. Items
// come in plan order; a writer of some shards only (ShardedSafetensorsWriter::Part) gets the
// items of its shards' tensors, a whole tensor's parts all together. With `writer` null, or
// after a failure, put() does nothing.
class ExportSink {
 public:
  ExportSink(const ExportPlan& plan, const models::ModelConfig& mc, at::ScalarType out_type,
             models::ShardedSafetensorsWriter* writer, std::function<void(uint64_t, uint64_t)> progress = {})
      : plan_(plan), mc_(mc), out_type_(out_type), writer_(writer), progress_(std::move(progress)) {}

  void put(size_t item, at::Tensor t);
  // The writer's finish() (its last shard, the index where it writes one).
  void finish();
  bool writing() const { return writer_ != nullptr; }
  const std::string& failure() const { return failure_.message(); }  // "" when none
  const ExportResult& result() const { return result_; }

 private:
  void attempt(const std::function<void()>& f);  // f, or on its failure no more writing
  const ExportPlan& plan_;
  const models::ModelConfig& mc_;
  at::ScalarType out_type_;
  models::ShardedSafetensorsWriter* writer_;
  std::function<void(uint64_t, uint64_t)> progress_;
  std::map<std::string, std::pair<at::Tensor, uint64_t>> assembling_;  // whole name -> (tensor, elements in)
  std::map<std::string, at::Tensor> adapters_;  // a merge's adapters waiting for their weights, by name
  std::map<std::string, int64_t> merges_;        // adapted module -> its weights merged so far
  FirstFailure failure_;
  ExportResult result_;
};

}  // namespace strata::engine::ckpt
