// Exporting fp32 master weights as a Hugging Face model directory, tensor by tensor, never holding
// the model (checkpoint.h): a checkpoint's, read from its chunks without an engine
// (export_checkpoint_hf, here), or a running engine's (export_engine.cc). Both write through the
// plan and sink here (export_plan.h).
#include <ATen/ops/empty.h>

#include <algorithm>
#include <functional>
#include <map>
#include <set>
#include <stdexcept>

#include "checkpoint/catalog.h"
#include "checkpoint/chunk_reader.h"
#include "checkpoint/export_plan.h"
#include "checkpoint/format.h"
#include "checkpoint/tensor_reader.h"
#include "strata/engine/checkpoint.h"
#include "strata/models/hf_io.h"
#include "strata/models/model_config.h"
#include "strata/models/model_shapes.h"
#include "strata/models/peft.h"
#include "strata/models/safetensors.h"
#include "strata/models/sharded_safetensors.h"

namespace strata::engine {

namespace ckpt {

ExportPlan plan_export(const json& units, const fs::path& dir, const models::ModelConfig& mc, models::StDType st_type,
                       ExportContent content) {
  const bool lora = mc.lora.enabled();
  if (lora && content == ExportContent::kModel)
    throw std::invalid_argument("export of " + dir.string() + ": a LoRA model exports as a PEFT adapter directory or "
                                "as the merged model, not as a model holding its adapters");
  if (!lora && content != ExportContent::kModel)
    throw std::invalid_argument("export of " + dir.string() + ": the model has no LoRA adapters (model.lora)");
  ExportPlan plan;
  std::map<std::string, uint64_t> filled;
  std::set<std::string> complete;
  std::map<std::string, size_t> inputs;  // kMerged: adapted module -> its adapter tensors seen so far
  std::set<std::string> merged;          // kMerged: adapted modules whose weights have begun
  std::vector<ManifestTensor> tensors = manifest_tensors(units, dir.string());
  // A 4-bit base's weights (model.quantize) are no values an export writes: the adapters go alone.
  const auto record = [](const ManifestTensor& t) { return t.slot.quantized; };
  if (std::any_of(tensors.begin(), tensors.end(), record)) {
    if (content != ExportContent::kAdapter)
      throw std::invalid_argument("export of " + dir.string() + ": a 4-bit base (model.quantize) exports its adapter "
                                  "alone; merge it into the 16-bit base with `strata ckpt export --base`");
    tensors.erase(std::remove_if(tensors.begin(), tensors.end(), record), tensors.end());
  }
  check_whole_coverage(tensors, dir.string());
  for (ManifestTensor& t : tensors) {
    uint64_t whole = 1;
    for (int64_t d : t.slot.whole_shape()) whole *= uint64_t(d);
    const std::string name = t.slot.whole_name();
    const bool adapter = models::is_adapter_tensor(name);
    if (content == ExportContent::kAdapter && !models::in_adapter_export(mc, name)) continue;
    std::vector<int64_t> hf_shape = t.slot.whole_shape();
    ExportItem item{std::move(t), whole};
    if (content == ExportContent::kMerged && adapter) {
      item.merge_into = models::adapted_module(name);
      item.fp32 = true;
      if (item.t.slot.origin.is_part() || merged.count(item.merge_into))
        throw std::runtime_error("export of " + dir.string() + ": adapter " + name +
                                 " is not whole before the weights it adapts (merging needs it first)");
      ++inputs[item.merge_into];
      plan.items.push_back(std::move(item));
      continue;
    }
    item.key = content == ExportContent::kAdapter ? models::peft_key(mc, name) : name;
    if (content == ExportContent::kMerged)
      if (const auto w = models::adapted_weight(mc, name); w && inputs.count(w->module)) {
        item.fp32 = true;
        merged.insert(w->module);
      }
    plan.items.push_back(std::move(item));
    if ((filled[name] += plan.items.back().t.numel) != whole) continue;
    if (models::hf_stores_transposed(mc, name)) std::swap(hf_shape[0], hf_shape[1]);
    plan.specs.push_back({plan.items.back().key, st_type, hf_shape});
    complete.insert(name);
    plan.total += whole * models::st_dtype_bytes(st_type);
  }
  for (const auto& [name, n] : filled)
    if (!complete.count(name))
      throw std::runtime_error("checkpoint " + dir.string() + ": the parts of " + name + " do not make it whole");
  for (const auto& [module, n] : inputs)
    if (n != 2 || !merged.count(module))
      throw std::runtime_error("export of " + dir.string() + ": " + module + " has " + std::to_string(n) +
                               " adapter tensors" + (merged.count(module) ? "" : " and no weight in the model"));
  return plan;
}

models::StDType st_type_of(at::ScalarType type) {
  return type == at::kFloat ? models::StDType::kF32 : type == at::kBFloat16 ? models::StDType::kBF16 : models::StDType::kF16;
}

uint64_t shard_limit(ExportContent content, uint64_t shard_bytes) {
  return content == ExportContent::kAdapter ? UINT64_MAX : shard_bytes;
}

at::ScalarType export_type(ExportContent content, at::ScalarType asked) {
  return content == ExportContent::kAdapter ? at::kFloat : asked;
}

models::ExportKind directory_kind(ExportContent content) {
  return content == ExportContent::kAdapter ? models::ExportKind::kAdapter : models::ExportKind::kModel;
}

std::vector<std::string> finish_export_directory(const fs::path& tmp, ExportContent content, const models::ModelConfig& mc,
                                                 const std::string& dtype, size_t shards, const std::string& base_model) {
  if (content != ExportContent::kAdapter) {
    write_atomically(tmp / "config.json", mc.to_hf_json(dtype) + "\n");
    return models::shard_set_files(shards);
  }
  fs::rename(tmp / models::shard_file_name(0, 1), tmp / models::kAdapterWeightsFile);
  write_atomically(tmp / models::kAdapterConfigFile, models::peft_adapter_config_json(mc, base_model) + "\n");
  return {models::kAdapterWeightsFile};
}

void ExportSink::attempt(const std::function<void()>& f) {
  if (!failure_.attempt(f)) writer_ = nullptr;
}

void ExportSink::put(size_t item_index, at::Tensor t) {
  if (!writer_) return;
  attempt([&] {
    const ExportItem& item = plan_.items[item_index];
    const ManifestTensor& it = item.t;
    t = t.to(item.fp32 ? at::kFloat : out_type_).view(it.slot.shape);
    const std::string& name = it.slot.whole_name();
    if (!item.merge_into.empty()) {  // an adapter: kept until its weight comes (plan_export: whole, first)
      adapters_[name] = t;
      return;
    }
    if (it.slot.origin.is_part()) {  // into its whole tensor, written once its last part is in
      auto& [whole, in] = assembling_[name];
      if (!whole.defined()) whole = at::empty(it.slot.origin.whole_shape, t.options());
      whole.narrow(it.slot.origin.dim, it.slot.origin.begin, it.slot.shape[size_t(it.slot.origin.dim)]).copy_(t);
      if ((in += it.numel) != item.whole_numel) return;
      t = whole;
      assembling_.erase(name);
    }
    if (item.fp32) {  // a merge's weight: its adapters are in
      const std::optional<models::AdaptedWeight> w = models::adapted_weight(mc_, name);
      const auto a = w ? adapters_.find(models::adapter_a_name(w->module)) : adapters_.end();
      const auto b = w ? adapters_.find(models::adapter_b_name(w->module)) : adapters_.end();
      if (a == adapters_.end() || b == adapters_.end())
        throw std::runtime_error("export: the adapters of " + name + " did not come before it");
      t = models::merged_weight(mc_, *w, t, a->second, b->second).to(out_type_);
      // An expert tensor's adapters serve each of its experts' weights: kept until the last.
      if (++merges_[w->module] == models::adapted_weight_count(mc_, w->module)) {
        adapters_.erase(a);
        adapters_.erase(b);
      }
    }
    if (models::hf_stores_transposed(mc_, name)) t = t.t();
    t = t.contiguous();
    writer_->write(item.key, {static_cast<const std::byte*>(t.data_ptr()), t.nbytes()});
    ++result_.tensors;
    result_.bytes += t.nbytes();
    if (progress_) progress_(result_.bytes, plan_.total);
  });
}

void ExportSink::finish() {
  if (writer_ && !adapters_.empty())
    attempt([&] { throw std::runtime_error("export: adapter " + adapters_.begin()->first + " without its weight"); });
  if (writer_) attempt([&] { writer_->finish(); });
}

}  // namespace ckpt

using namespace ckpt;

models::ModelConfig ckpt::manifest_model(const json& m, const fs::path& dir) {
  const std::string source = (dir / "manifest.json").string();
  models::ModelConfig mc = models::parse_hf_config(m["model"].dump(), source);
  if (m.contains("lora")) mc.lora = models::parse_lora_settings(m["lora"].dump(), source + " (\"lora\")", models::LoraSettingsFrom::kAdapterConfig);
  return mc;
}


ExportResult export_checkpoint_hf(const fs::path& dir, const fs::path& out_arg, const std::string& dtype,
                                  const std::function<void(uint64_t, uint64_t)>& progress, bool overwrite,
                                  const fs::path& tokenizer_from, uint64_t shard_bytes,
                                  const std::function<void(const fs::path&)>& on_weights_file) {
  if (!tokenizer_from.empty() && !fs::is_regular_file(tokenizer_from / "config.json") &&
      !fs::is_regular_file(tokenizer_from / "tokenizer.json") && !fs::is_regular_file(tokenizer_from / "tokenizer_config.json"))
    throw std::invalid_argument("export: " + tokenizer_from.string() + " is not a Hugging Face model or tokenizer directory");
  fs::path out_dir = out_arg.lexically_normal();  // "hf-model/": the temporary beside it, not in it
  if (!out_dir.has_filename()) out_dir = out_dir.parent_path();
  const json m = read_manifest(dir);
  const models::ModelConfig mc = manifest_model(m, dir);
  const ExportContent content = mc.lora.enabled() ? ExportContent::kAdapter : ExportContent::kModel;
  const at::ScalarType out_type = export_type(content, models::parse_export_dtype(dtype));
  const models::StDType st_type = st_type_of(out_type);
  if (m.contains("frozen_base") && content == ExportContent::kModel)
    throw std::invalid_argument("checkpoint " + dir.string() + " holds only the tensors that trained (model.trainable); "
                                "the frozen ones are its base's (" + m["frozen_base"].get<std::string>() +
                                "), which `strata ckpt export` does not read: export from the run (run.export)");
  ChunkCatalog catalog(dir, m);  // format 1-2: the chunks checked to tile every unit
  const ExportPlan plan = plan_export(m["units"], dir, mc, st_type, content);

  // Refused before any work: an existing, non-empty out_dir without `overwrite`.
  models::ExportDirectory out(out_dir, overwrite, "pass --force to replace its config.json and model.safetensors",
                              directory_kind(content));
  const fs::path& tmp = out.tmp();
  models::ShardedSafetensorsWriter writer(tmp, plan.specs, shard_limit(content, shard_bytes), {{"format", "pt"}});
  // An adapter's one file is renamed when complete: the caller's upload takes it from out_dir.
  if (on_weights_file && content == ExportContent::kModel)
    writer.on_shard_complete([&](const std::string& file) { on_weights_file(tmp / file); });
  ChunkReader reader(dir, catalog);
  TensorReader tensors(reader, catalog);
  ExportSink sink(plan, mc, out_type, &writer, progress);
  for (size_t i = 0; i < plan.items.size() && sink.writing(); ++i) sink.put(i, tensors.read(plan.items[i].t));
  sink.finish();
  if (!sink.failure().empty()) throw std::runtime_error(sink.failure());
  ExportResult result = sink.result();
  result.files = finish_export_directory(tmp, content, mc, models::hf_dtype_name(out_type), writer.shards(), "");
  if (!tokenizer_from.empty() && content == ExportContent::kModel)
    result.tokenizer_files = models::copy_tokenizer_files(tokenizer_from, tmp);
  out.commit();
  return result;
}

}  // namespace strata::engine
