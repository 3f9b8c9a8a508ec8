// `strata train`: the run's Hugging Face exports (train_parts.h).
#include "train_parts.h"

#include <ATen/ops/tensor.h>

#include <algorithm>
#include <chrono>
#include <exception>
#include <functional>
#include <iostream>
#include <map>
#include <optional>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include <unistd.h>

#include "object_paths.h"
#include "strata/engine/precision_dtype.h"
#include "strata/models/hf_io.h"
#include "strata/models/model_shapes.h"
#include "strata/models/peft.h"
#include "strata/offload/object_store.h"

namespace strata::cli::train {
namespace {

constexpr const char* kExportOverwriteHint =
    "set run.export_overwrite (--export-overwrite) to replace its config.json and model.safetensors, or give "
    "another run.export";

}  // namespace

std::filesystem::path merged_dir(const std::filesystem::path& export_dir) {
  return models::ExportDirectory::beside(export_dir, "-merged");
}

std::string prepare_export(engine::TrainConfig& tc) {
  // An export to object storage (run.export s3://...) is staged in a local directory of the
  // cache, each shard uploaded as soon as it is written (ExportUpload).
  std::string export_store;
  if (offload::is_object_store_url(tc.export_dir)) {
    if (tc.export_every > 0)
      throw std::invalid_argument("run.export_every with an export to object storage (" + tc.export_dir +
                                  ") is not supported: export to a directory, or only at the end");
    if (tc.export_merged)
      throw std::invalid_argument("run.export_merged with an export to object storage (" + tc.export_dir +
                                  ") is not supported: export to a directory");
    check_export_store(tc.export_dir, tc.export_overwrite, kExportOverwriteHint);
    export_store = tc.export_dir;
    tc.export_dir = cache_path("exports", export_store);
    tc.export_overwrite = true;  // the staging directory is the cache's
    clear_directory(tc.export_dir);  // nothing of an earlier staged export is uploaded again
  }
  if (!tc.export_dir.empty()) {
    models::ExportDirectory::check(tc.export_dir, tc.export_overwrite, kExportOverwriteHint);
    if (tc.export_merged) models::ExportDirectory::check(merged_dir(tc.export_dir), tc.export_overwrite, kExportOverwriteHint);
    check_writable(models::ExportDirectory::temporary(tc.export_dir).parent_path(), "the export's parent directory");
  }
  return export_store;
}

at::ScalarType export_dtype(const engine::TrainConfig& tc, const engine::EngineConfig& ec) {
  return tc.export_dtype != "auto"                ? models::parse_export_dtype(tc.export_dtype)
         : ec.compute == engine::Precision::kBf16 ? at::kBFloat16
                                                  : at::kFloat;
}

// In the export's dtype. Staged for an object store, a node's disk holds at most two shards of
// each of its ranks (those being written), never more than the model.
void check_export_space(const engine::TrainConfig& tc, const models::ModelConfig& mc, at::ScalarType type,
                        bool to_store, int world) {
  if (tc.export_dir.empty()) return;
  const uint64_t exports = 1 + (tc.export_every > 0 && tc.steps > 0 ? uint64_t((tc.steps - 1) / tc.export_every) : 0);
  // A LoRA run writes its adapters (small) and the tensors of modules_to_save, in fp32, and with
  // export_merged the merged model.
  const uint64_t model_bytes = uint64_t(mc.parameters()) * uint64_t(at::elementSize(type));
  uint64_t saved = 0;
  for (const auto& stage : models::stage_tensors(mc))
    for (const models::StageTensor& x : stage) saved += models::saved_whole(mc, x.tensor) ? x.numel : 0;
  const uint64_t adapter_bytes = (uint64_t(models::adapter_parameters(mc)) + saved) * 4;
  uint64_t need = (mc.lora.enabled() ? adapter_bytes + (tc.export_merged ? model_bytes : 0) : model_bytes) * exports;
  if (to_store) need = std::min(need, 2 * tc.export_shard_bytes * uint64_t(world));
  check_free_space(models::ExportDirectory::temporary(tc.export_dir).parent_path(), need,
                   to_store        ? "the export's staging directory"
                   : exports == 1 ? "the export's parent directory"
                                  : "the export's parent directory (" + std::to_string(exports) + " exports)");
}

Exporter::Exporter(const Run& run, at::ScalarType type, std::string store, int64_t first_step)
    : run_(run), type_(type), store_(std::move(store)), first_step_(first_step),
      replace_periodic_(run.tc.export_overwrite || first_step > 0) {}

void Exporter::check_periodic_dirs() const {
  const engine::TrainConfig& tc = run_.tc;
  for (int64_t k = first_step_ + 1; tc.export_every > 0 && k < tc.steps; ++k)
    if (k % tc.export_every == 0) {
      models::ExportDirectory::check(periodic_dir(k), replace_periodic_, kExportOverwriteHint);
      if (tc.export_merged) models::ExportDirectory::check(merged_dir(periodic_dir(k)), replace_periodic_, kExportOverwriteHint);
    }
}

bool Exporter::periodic_due(int64_t step) const {
  const engine::TrainConfig& tc = run_.tc;
  return tc.export_every > 0 && step % tc.export_every == 0 && step < tc.steps;
}

void Exporter::export_periodic(int64_t step) { export_model(periodic_dir(step), replace_periodic_); }

std::filesystem::path Exporter::periodic_dir(int64_t step) const {
  return models::ExportDirectory::beside(run_.tc.export_dir, "-step-" + std::to_string(step));
}

// Every rank learns whether the export failed anywhere (export_engine_hf agrees on its own
// failures; rank 0's upload of the rest comes after it), so that a failed export stops every rank
// at once instead of leaving them in the next step's collectives.
void Exporter::export_model(const std::filesystem::path& dir, bool overwrite) {
  const bool lora = run_.mc.lora.enabled();
  agree([&] { write(dir, overwrite, lora ? engine::ExportContent::kAdapter : engine::ExportContent::kModel); });
  if (!lora || !run_.tc.export_merged) return;
  if (!run_.mc.quantize.enabled()) {
    agree([&] { write(merged_dir(dir), overwrite, engine::ExportContent::kMerged); });
    return;
  }
  // A 4-bit base: the engine holds its weights as 4-bit records, so rank 0 merges the adapter
  // export just written into init_from's weights (as its files hold them, or dequantized).
  agree([&] {
    if (run_.lead) write_merged_4bit(dir, overwrite);
  });
}

void Exporter::write_merged_4bit(const std::filesystem::path& adapter_dir, bool overwrite) {
  const engine::TrainConfig& tc = run_.tc;
  const auto t0 = std::chrono::steady_clock::now();
  const engine::MergeInto into = engine::parse_merge_into(tc.export_merged_into, "run.export_merged_into");
  const engine::ExportResult done =
      engine::export_adapter_merged(adapter_dir, run_.mc, engine::scalar_type(run_.ec.compute), tc.init_from, merged_dir(adapter_dir),
                                    models::hf_dtype_name(type_), into, overwrite, tc.export_shard_bytes);
  std::cerr << (tc.progress && isatty(STDERR_FILENO) ? "\r\033[K" : "") << "strata train: exported the merged model to "
            << merged_dir(adapter_dir).string() << " (" << models::hf_dtype_name(type_) << ", "
            << (done.dequantized ? "merged into the dequantized 4-bit weights (" + std::to_string(done.dequantized) +
                                       " of them)"
                                 : std::string("merged into the 16-bit base init_from"))
            << ", " << std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() << " s)\n";
}

void Exporter::agree(const std::function<void()>& f) {
  std::string failure;
  try {
    f();
  } catch (const engine::CommError&) {
    throw;  // a peer is gone: nothing to agree on
  } catch (const std::exception& e) {
    failure = e.what();
  }
  at::Tensor failed = at::tensor({failure.empty() ? 0.0 : 1.0}, at::TensorOptions().dtype(at::kDouble));
  run_.comm.all_reduce(failed, engine::ReduceOp::kSum);
  if (failed.item<double>() > 0)
    throw std::runtime_error(!failure.empty() ? failure : "the export failed on rank 0 (rank 0 says why)");
}

// A Hugging Face model directory of the weights now, with the tokenizer and generation config of
// init_from: streamed tensor by tensor to the ranks that write its shards (engine::export_engine_hf,
// a collective).
void Exporter::write(const std::filesystem::path& dir, bool overwrite, engine::ExportContent content) {
  const engine::TrainConfig& tc = run_.tc;
  const auto t0 = std::chrono::steady_clock::now();
  engine::EngineExport options;
  options.content = content;
  options.base_model = tc.init_from;
  options.type = type_;
  options.shard_bytes = tc.export_shard_bytes;
  options.overwrite = overwrite;
  options.overwrite_hint = kExportOverwriteHint;
  options.tokenizer_from = tc.init_from;
  // To object storage: each rank uploads the shards it writes as it writes them, rank 0 the rest.
  std::optional<ExportUpload> upload;
  if (!store_.empty() && dir == std::filesystem::path(tc.export_dir)) {
    upload.emplace(store_, content == engine::ExportContent::kAdapter ? models::kAdapterConfigFile : "config.json");
    options.on_weights_file = upload->on_weights_file();
    options.stage_on_every_rank = true;
  }
  const engine::ExportResult done = engine::export_engine_hf(run_.eng, run_.comm, dir, options);
  if (!run_.lead) return;
  std::cerr << (tc.progress && isatty(STDERR_FILENO) ? "\r\033[K" : "") << "strata train: exported "
            << (content == engine::ExportContent::kAdapter  ? "the LoRA adapter (PEFT) to "
                : content == engine::ExportContent::kMerged ? "the merged model to "
                                                            : "")
            << dir.string()
            << " (" << (content == engine::ExportContent::kAdapter ? "float32" : models::hf_dtype_name(type_))
            << (done.tokenizer_files.empty() ? "" : ", with the tokenizer of init_from") << ", "
            << std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() << " s)\n";
  if (upload) upload->finish(dir.string(), done.files);
}

}  // namespace strata::cli::train
