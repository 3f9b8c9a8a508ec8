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

#include "checkpoint/format.h"
#include "strata/engine/checkpoint.h"
#include "strata/models/model_config.h"
#include "strata/models/sharded_safetensors.h"

namespace strata::engine::ckpt {

struct ExportItem {
  ManifestTensor t;
  uint64_t whole_numel;  // elements of the whole tensor it is (a part of)
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
ExportPlan plan_export(const json& units, const fs::path& dir, const models::ModelConfig& mc, models::StDType st_type);

models::StDType st_type_of(at::ScalarType type);

// Writes a plan's tensors as their elements arrive: each item's elements flat (any float type),
// converted to `out_type` (exactly: converting the parts and assembling them is assembling and
// converting), parts assembled into their whole tensors, GPT-2's Conv1D weights transposed. Items
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
  const std::string& failure() const { return failure_; }
  const ExportResult& result() const { return result_; }

 private:
  void attempt(const std::function<void()>& f);
  const ExportPlan& plan_;
  const models::ModelConfig& mc_;
  at::ScalarType out_type_;
  models::ShardedSafetensorsWriter* writer_;
  std::function<void(uint64_t, uint64_t)> progress_;
  std::map<std::string, std::pair<at::Tensor, uint64_t>> assembling_;  // whole name -> (tensor, elements in)
  std::string failure_;
  ExportResult result_;
};

}  // namespace strata::engine::ckpt
