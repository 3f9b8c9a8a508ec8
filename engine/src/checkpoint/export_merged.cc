// Merged exports of a LoRA run (checkpoint.h): its adapters, from a checkpoint's chunks
// (export_checkpoint_merged) or from the run's PEFT adapter export (export_adapter_merged: a run on
// a 4-bit base), merged into a base model's weights read tensor by tensor from its files: as they
// are, or, for a 4-bit run, as the 4-bit weights it trained on dequantized (MergeInto).
#include <ATen/ATen.h>

#include <map>
#include <optional>
#include <stdexcept>
#include <string>

#include "checkpoint/export_plan.h"
#include "checkpoint/format.h"
#include "checkpoint/tensor_reader.h"
#include "strata/engine/checkpoint.h"
#include "strata/models/hf_io.h"
#include "strata/models/model_config.h"
#include "strata/models/model_shapes.h"
#include "strata/models/peft.h"
#include "strata/models/quant4_checkpoint.h"
#include "strata/models/safetensors.h"
#include "strata/models/sharded_safetensors.h"

namespace strata::engine {

using namespace ckpt;

namespace {

// A LoRA checkpoint's trained tensors, whole (each assembled from its parts where a tile holds a
// part): its adapters, and the modules it saved whole. Small beside the base.
struct TrainedTensors {
  std::map<std::string, at::Tensor> adapters, saved;
};

TrainedTensors read_trained_tensors(const fs::path& dir, const json& m, const models::ModelConfig& mc) {
  ChunkCatalog catalog(dir, m);
  const ExportPlan plan = plan_export(m["units"], dir, mc, models::StDType::kF32, ExportContent::kAdapter);
  ChunkReader reader(dir, catalog);
  TensorReader tensors(reader, catalog);
  TrainedTensors out;
  for (const ExportItem& item : plan.items) {
    const TensorSlot& slot = item.t.slot;
    at::Tensor t = tensors.read(item.t).view(slot.shape);
    std::map<std::string, at::Tensor>& into = models::is_adapter_tensor(slot.whole_name()) ? out.adapters : out.saved;
    if (!slot.origin.is_part()) {
      into[slot.whole_name()] = t;
      continue;
    }
    at::Tensor& whole = into[slot.whole_name()];
    if (!whole.defined()) whole = at::empty(slot.origin.whole_shape, t.options());
    whole.narrow(slot.origin.dim, slot.origin.begin, slot.shape[size_t(slot.origin.dim)]).copy_(t);
  }
  return out;
}

// A run's PEFT adapter export (adapter_model.safetensors, fp32): its adapters and the tensors of
// modules_to_save, in Strata's layout.
TrainedTensors read_adapter_directory(const fs::path& dir, const models::ModelConfig& mc) {
  const fs::path file = dir / models::kAdapterWeightsFile;
  const models::SafetensorsCheckpoint ckpt(file);
  TrainedTensors out;
  for (const std::string& name : models::tensor_names(mc)) {
    if (!models::in_adapter_export(mc, name)) continue;
    const std::string key = models::peft_key(mc, name);
    if (!ckpt.contains(key)) throw std::runtime_error(file.string() + ": no tensor '" + key + "'");
    const models::TensorView v = ckpt.get(key);
    if (v.info->dtype != models::StDType::kF32)
      throw std::runtime_error(file.string() + ": tensor '" + key + "' is not F32 (a run's adapter export is)");
    at::Tensor t = at::from_blob(const_cast<std::byte*>(v.data.data()), v.info->shape, at::kFloat).clone();
    if (models::hf_stores_transposed(mc, name)) t = t.t().contiguous();
    (models::is_adapter_tensor(name) ? out.adapters : out.saved)[name] = t;
  }
  return out;
}

// The merged model's tensors in the order a run's merged export writes them (its units: each
// stage's trainable tensors, then its frozen base tensors, in stage order), declared in `st_type`.
struct MergedLayout {
  std::vector<models::SafetensorsWriter::Spec> specs;
  uint64_t total = 0;  // bytes
};

MergedLayout merged_layout(const models::ModelConfig& mc, const models::SafetensorsCheckpoint& base,
                           const std::string& source, models::StDType st_type) {
  MergedLayout out;
  for (const auto& stage : models::stage_tensors(mc))
    for (const bool trains : {true, false})
      for (const models::StageTensor& x : stage) {
        if (models::is_adapter_tensor(x.tensor) || models::saved_whole(mc, x.tensor) != trains) continue;
        const std::vector<int64_t> shape = models::hf_tensor_shape(mc, base, x.tensor, source);
        out.specs.push_back({x.tensor, st_type, shape});
        uint64_t numel = 1;
        for (int64_t d : shape) numel *= uint64_t(d);
        out.total += numel * models::st_dtype_bytes(st_type);
      }
  return out;
}

// The adapters of `trained` (model `mc`, named in errors as `what`) merged into `base_dir`'s
// weights; with `requantize` (MergeInto::kDequantized) a weight the run stored in 4 bits that the
// base holds in 16 bits is quantized and dequantized first, as the run saw it.
ExportResult write_merged(const models::ModelConfig& mc, TrainedTensors trained, const std::string& what,
                          const std::optional<ManifestQuantization>& requantize, const fs::path& base_dir,
                          const fs::path& out_arg, const std::string& dtype,
                          const std::function<void(uint64_t, uint64_t)>& progress, bool overwrite,
                          const fs::path& tokenizer_from, uint64_t shard_bytes,
                          const std::function<void(const fs::path&)>& on_weights_file) {
  fs::path out_dir = out_arg.lexically_normal();
  if (!out_dir.has_filename()) out_dir = out_dir.parent_path();
  const at::ScalarType out_type = models::parse_export_dtype(dtype);
  const models::SafetensorsCheckpoint base(base_dir);
  const std::string source = base_dir.string();
  const MergedLayout layout = merged_layout(mc, base, source, st_type_of(out_type));
  models::ModelConfig quantized = mc;  // which weights the run stored in 4 bits
  if (requantize) quantized.quantize = requantize->q;

  models::ExportDirectory out(out_dir, overwrite, "pass --force to replace its config.json and model.safetensors");
  const fs::path& tmp = out.tmp();
  models::ShardedSafetensorsWriter writer(tmp, layout.specs, shard_bytes, {{"format", "pt"}});
  if (on_weights_file) writer.on_shard_complete([&](const std::string& file) { on_weights_file(tmp / file); });
  ExportResult result;
  std::map<std::string, at::Tensor>& adapters = trained.adapters;
  std::map<std::string, int64_t> merges;  // adapted module -> its weights merged so far
  for (const models::SafetensorsWriter::Spec& spec : layout.specs) {
    const std::string& name = spec.name;
    // fp32, Strata's layout: a module saved whole as it trained, the rest the base's.
    const auto saved = trained.saved.find(name);
    at::Tensor w = saved != trained.saved.end() ? saved->second : models::read_hf_tensor(mc, base, name, source);
    if (saved == trained.saved.end()) {
      if (models::saved_in_4bit(base, name)) {  // read as its dequantization
        ++result.dequantized;
      } else if (requantize && models::stored_4bit(quantized, name)) {
        w = models::quantized_dequantized(w, requantize->q, requantize->compute);
        ++result.dequantized;
      }
    }
    if (const std::optional<models::AdaptedWeight> adapted = models::adapted_weight(mc, name)) {
      const auto a = adapters.find(models::adapter_a_name(adapted->module));
      const auto b = adapters.find(models::adapter_b_name(adapted->module));
      if (a != adapters.end() && b != adapters.end()) {
        w = models::merged_weight(mc, *adapted, w, a->second, b->second);
        if (++merges[adapted->module] == models::adapted_weight_count(mc, adapted->module)) {
          adapters.erase(a);
          adapters.erase(b);
        }
      }
    }
    w = w.to(out_type);
    if (models::hf_stores_transposed(mc, name)) w = w.t();
    w = w.contiguous();
    writer.write(name, {static_cast<const std::byte*>(w.data_ptr()), w.nbytes()});
    ++result.tensors;
    result.bytes += w.nbytes();
    if (progress) progress(result.bytes, layout.total);
  }
  if (!adapters.empty())
    throw std::runtime_error(what + ": adapter " + adapters.begin()->first + " adapts no weight of the model");
  writer.finish();
  result.files = finish_export_directory(tmp, ExportContent::kMerged, mc, dtype, writer.shards(), "");
  if (!tokenizer_from.empty()) result.tokenizer_files = models::copy_tokenizer_files(tokenizer_from, tmp);
  out.commit();
  return result;
}

}  // namespace

MergeInto parse_merge_into(const std::string& name, const std::string& what) {
  if (name == "base") return MergeInto::kBase;
  if (name == "dequantized") return MergeInto::kDequantized;
  throw std::invalid_argument(what + " must be \"base\" or \"dequantized\", not \"" + name + "\"");
}

ExportResult export_checkpoint_merged(const fs::path& dir, const fs::path& base_dir, const fs::path& out_arg,
                                      const std::string& dtype, const std::function<void(uint64_t, uint64_t)>& progress,
                                      bool overwrite, const fs::path& tokenizer_from, uint64_t shard_bytes,
                                      const std::function<void(const fs::path&)>& on_weights_file, MergeInto into) {
  models::parse_export_dtype(dtype);
  const json m = read_manifest(dir);
  const models::ModelConfig mc = manifest_model(m, dir);
  if (!mc.lora.enabled())
    throw std::invalid_argument("checkpoint " + dir.string() + " has no LoRA adapters: export it without a base");
  const std::string want = m.value("frozen_base", std::string());
  const std::string have = models::model_fingerprint(base_dir);
  if (!models::trained_on(want, have))
    throw std::invalid_argument("checkpoint " + dir.string() + " trained on the base " + want + ", and " +
                                base_dir.string() + " is " + have + ": give the base it trained on");
  const std::optional<ManifestQuantization> q = manifest_quantization(m, dir);
  if (into == MergeInto::kDequantized && !q)
    throw std::invalid_argument("checkpoint " + dir.string() + " did not train on a 4-bit base (its manifest has no "
                                "\"quantize\"): there are no dequantized weights to merge into; merge into the base");
  return write_merged(mc, read_trained_tensors(dir, m, mc), "checkpoint " + dir.string(),
                      into == MergeInto::kDequantized ? q : std::nullopt, base_dir, out_arg, dtype, progress, overwrite,
                      tokenizer_from, shard_bytes, on_weights_file);
}

ExportResult export_adapter_merged(const fs::path& adapter_dir, const models::ModelConfig& mc, at::ScalarType compute,
                                   const fs::path& base_dir, const fs::path& out_dir, const std::string& dtype,
                                   MergeInto into, bool overwrite, uint64_t shard_bytes) {
  if (into == MergeInto::kDequantized && !mc.quantize.enabled())
    throw std::invalid_argument("a merge into the dequantized weights needs a 4-bit base (model.quantize)");
  std::optional<ManifestQuantization> q;
  if (into == MergeInto::kDequantized) q = ManifestQuantization{mc.quantize, compute};
  return write_merged(mc, read_adapter_directory(adapter_dir, mc), "the adapter export " + adapter_dir.string(), q,
                      base_dir, out_dir, dtype, {}, overwrite, base_dir, shard_bytes, {});
}

}  // namespace strata::engine
