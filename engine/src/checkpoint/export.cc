// Exporting fp32 master weights as a Hugging Face model directory, tensor by tensor, never holding
// the model (checkpoint.h): a checkpoint's, read from its chunks without an engine
// (export_checkpoint_hf, here), or a running engine's (export_engine.cc). Both write through the
// plan and sink here (export_plan.h).
#include <ATen/ops/empty.h>

#include <algorithm>
#include <functional>
#include <map>
#include <stdexcept>

#include "checkpoint/catalog.h"
#include "checkpoint/chunk_reader.h"
#include "checkpoint/export_plan.h"
#include "checkpoint/format.h"
#include "strata/engine/checkpoint.h"
#include "strata/models/hf_io.h"
#include "strata/models/model_config.h"
#include "strata/models/safetensors.h"
#include "strata/models/sharded_safetensors.h"

namespace strata::engine {

namespace ckpt {

ExportPlan plan_export(const json& units, const fs::path& dir, const models::ModelConfig& mc, models::StDType st_type) {
  ExportPlan plan;
  std::map<std::string, uint64_t> filled;
  std::vector<ManifestTensor> tensors = manifest_tensors(units, dir.string());
  check_whole_coverage(tensors, dir.string());
  for (ManifestTensor& t : tensors) {
    uint64_t whole = 1;
    for (int64_t d : t.slot.whole_shape()) whole *= uint64_t(d);
    const std::string name = t.slot.whole_name();
    std::vector<int64_t> hf_shape = t.slot.whole_shape();
    plan.items.push_back({std::move(t), whole});
    if ((filled[name] += plan.items.back().t.numel) != whole) continue;
    if (models::hf_stores_transposed(mc, name)) std::swap(hf_shape[0], hf_shape[1]);
    plan.specs.push_back({name, st_type, hf_shape});
    plan.total += whole * models::st_dtype_bytes(st_type);
  }
  for (const auto& [name, n] : filled)
    if (std::none_of(plan.specs.begin(), plan.specs.end(), [&](const auto& sp) { return sp.name == name; }))
      throw std::runtime_error("checkpoint " + dir.string() + ": the parts of " + name + " do not make it whole");
  return plan;
}

models::StDType st_type_of(at::ScalarType type) {
  return type == at::kFloat ? models::StDType::kF32 : type == at::kBFloat16 ? models::StDType::kBF16 : models::StDType::kF16;
}

void ExportSink::attempt(const std::function<void()>& f) {
  try {
    f();
  } catch (const std::exception& e) {
    failure_ = e.what();
    writer_ = nullptr;
  }
}

void ExportSink::put(size_t item_index, at::Tensor t) {
  if (!writer_) return;
  attempt([&] {
    const ExportItem& item = plan_.items[item_index];
    const ManifestTensor& it = item.t;
    t = t.to(out_type_).view(it.slot.shape);
    const std::string& name = it.slot.whole_name();
    if (it.slot.origin.is_part()) {  // into its whole tensor, written once its last part is in
      auto& [whole, in] = assembling_[name];
      if (!whole.defined()) whole = at::empty(it.slot.origin.whole_shape, t.options());
      whole.narrow(it.slot.origin.dim, it.slot.origin.begin, it.slot.shape[size_t(it.slot.origin.dim)]).copy_(t);
      if ((in += it.numel) != item.whole_numel) return;
      t = whole;
      assembling_.erase(name);
    }
    if (models::hf_stores_transposed(mc_, name)) t = t.t();
    t = t.contiguous();
    writer_->write(name, {static_cast<const std::byte*>(t.data_ptr()), t.nbytes()});
    ++result_.tensors;
    result_.bytes += t.nbytes();
    if (progress_) progress_(result_.bytes, plan_.total);
  });
}

void ExportSink::finish() {
  if (writer_) attempt([&] { writer_->finish(); });
}

}  // namespace ckpt

using namespace ckpt;

namespace {

// Each tensor from the chunks it overlaps, a window of them read at a time; the last chunk read
// is kept, as it may straddle into the next tensor. Tensors are read in manifest order.
class TensorReader {
 public:
  TensorReader(ChunkReader& reader, const ChunkCatalog& catalog) : reader_(reader), catalog_(catalog) {}

  // The tensor's elements, flat.
  at::Tensor read(const ManifestTensor& it) {
    at::Tensor full = at::empty({int64_t(it.numel)}, at::TensorOptions().dtype(at::kFloat));
    const uint64_t lo = it.offset, hi = it.offset + it.numel;
    const auto place = [&](const Loaded& l) {
      const uint64_t b = l.chunk.begin, e = l.chunk.end();
      const uint64_t from = std::max(b, lo), to = std::min(e, hi);
      full.narrow(0, int64_t(from - lo), int64_t(to - from)).copy_(l.data.narrow(0, int64_t(from - b), int64_t(to - from)));
    };
    const std::vector<Chunk> need = catalog_.overlapping(it.unit, /*kind=master*/ 0, lo, hi);
    for (size_t i = 0; i < need.size(); i += kWindow) {
      std::vector<Loaded> window;
      std::vector<ChunkReader::Request> batch;
      for (size_t j = i; j < std::min(need.size(), i + kWindow); ++j) {
        if (kept_.data.defined() && kept_.chunk == need[j]) {
          place(kept_);
          continue;
        }
        Loaded l{need[j], aligned_floats(int64_t(need[j].numel))};
        batch.push_back({l.chunk, l.data.data_ptr<float>()});
        window.push_back(std::move(l));
      }
      reader_.read(batch, kWindow);
      for (const Loaded& l : window) place(l);
      if (!window.empty()) kept_ = std::move(window.back());
    }
    return full;
  }

 private:
  static constexpr size_t kWindow = 16;  // chunks in flight: 64 MiB
  struct Loaded {
    Chunk chunk;
    at::Tensor data;
  };
  ChunkReader& reader_;
  const ChunkCatalog& catalog_;
  Loaded kept_;
};

}  // namespace

ExportResult export_checkpoint_hf(const fs::path& dir, const fs::path& out_arg, const std::string& dtype,
                                  const std::function<void(uint64_t, uint64_t)>& progress, bool overwrite,
                                  const fs::path& tokenizer_from, uint64_t shard_bytes,
                                  const std::function<void(const fs::path&)>& on_weights_file) {
  if (!tokenizer_from.empty() && !fs::is_regular_file(tokenizer_from / "config.json") &&
      !fs::is_regular_file(tokenizer_from / "tokenizer.json") && !fs::is_regular_file(tokenizer_from / "tokenizer_config.json"))
    throw std::invalid_argument("export: " + tokenizer_from.string() + " is not a Hugging Face model or tokenizer directory");
  fs::path out_dir = out_arg.lexically_normal();  // "hf-model/": the temporary beside it, not in it
  if (!out_dir.has_filename()) out_dir = out_dir.parent_path();
  const at::ScalarType out_type = models::parse_export_dtype(dtype);
  const models::StDType st_type = st_type_of(out_type);

  const json m = read_manifest(dir);
  if (m.contains("frozen_base"))
    throw std::invalid_argument("checkpoint " + dir.string() + " holds only the tensors that trained (model.trainable); "
                                "the frozen ones are its base's (" + m["frozen_base"].get<std::string>() +
                                "), which `strata ckpt export` does not read: export from the run (run.export)");  const models::ModelConfig mc = models::parse_hf_config(m["model"].dump(), (dir / "manifest.json").string());
  ChunkCatalog catalog(dir, m);  // format 1-2: the chunks checked to tile every unit
  const ExportPlan plan = plan_export(m["units"], dir, mc, st_type);

  // Refused before any work: an existing, non-empty out_dir without `overwrite`.
  models::ExportDirectory out(out_dir, overwrite, "pass --force to replace its config.json and model.safetensors");
  const fs::path& tmp = out.tmp();
  models::ShardedSafetensorsWriter writer(tmp, plan.specs, shard_bytes, {{"format", "pt"}});
  if (on_weights_file) writer.on_shard_complete([&](const std::string& file) { on_weights_file(tmp / file); });
  ChunkReader reader(dir, catalog);
  TensorReader tensors(reader, catalog);
  ExportSink sink(plan, mc, out_type, &writer, progress);
  for (size_t i = 0; i < plan.items.size() && sink.writing(); ++i) sink.put(i, tensors.read(plan.items[i].t));
  sink.finish();
  if (!sink.failure().empty()) throw std::runtime_error(sink.failure());
  ExportResult result = sink.result();
  result.files = writer.files();
  write_atomically(tmp / "config.json", mc.to_hf_json(dtype) + "\n");
  if (!tokenizer_from.empty()) models::copy_tokenizer_files(tokenizer_from, tmp);
  out.commit();
  return result;
}

}  // namespace strata::engine
