// Exporting a checkpoint's fp32 master weights as a Hugging Face model directory, tensor by
// tensor, without an engine and without holding the model (checkpoint.h).
#include <ATen/ops/empty.h>

#include <algorithm>
#include <map>
#include <stdexcept>

#include "checkpoint/chunk_reader.h"
#include "checkpoint/format.h"
#include "strata/engine/checkpoint.h"
#include "strata/models/hf_io.h"
#include "strata/models/model_config.h"
#include "strata/models/safetensors.h"
#include "strata/models/sharded_safetensors.h"

namespace strata::engine {
using namespace ckpt;

namespace {

// The master chunks of each unit, sorted; they must tile the unit exactly.
std::vector<std::vector<const json*>> master_chunks(const json& m, const fs::path& dir) {
  const json& units = m["units"];
  std::vector<std::vector<const json*>> unit_chunks = chunks_by_unit(m, dir, /*kind=*/0);
  for (size_t u = 0; u < units.size(); ++u)
    if (!sort_and_check_cover(unit_chunks[u], units[u]["numel"].get<uint64_t>()))
      throw std::runtime_error("checkpoint " + dir.string() + ": the master chunks of unit " +
                               units[u]["name"].get<std::string>() + " do not cover it exactly");
  return unit_chunks;
}

struct Item {
  ManifestTensor t;
  uint64_t whole_numel;  // elements of the whole tensor it is (a part of)
};
// What is written: the manifest's tensors in order, and the whole tensors the file declares.
struct ExportPlan {
  std::vector<Item> items;
  std::vector<models::SafetensorsWriter::Spec> specs;
  uint64_t total = 0;  // bytes of every whole tensor in the output type
};

// Tensors in unit order, packed in their unit as the partition packs them. A block tile's part
// goes into its whole tensor, which is written once its last part is in: the file declares the
// whole tensors in the order they complete.
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

// Each tensor from the chunks it overlaps, a window of them read at a time; the last chunk read
// is kept, as it may straddle into the next tensor. Tensors are read in manifest order.
class TensorReader {
 public:
  TensorReader(ChunkReader& reader, const std::vector<std::vector<const json*>>& unit_chunks)
      : reader_(reader), unit_chunks_(unit_chunks) {}

  // The tensor's elements, flat.
  at::Tensor read(const ManifestTensor& it) {
    at::Tensor full = at::empty({int64_t(it.numel)}, at::TensorOptions().dtype(at::kFloat));
    const uint64_t lo = it.offset, hi = it.offset + it.numel;
    const auto place = [&](const Loaded& l) {
      const uint64_t b = (*l.chunk)["begin"].get<uint64_t>(), e = b + (*l.chunk)["numel"].get<uint64_t>();
      const uint64_t from = std::max(b, lo), to = std::min(e, hi);
      full.narrow(0, int64_t(from - lo), int64_t(to - from)).copy_(l.data.narrow(0, int64_t(from - b), int64_t(to - from)));
    };
    std::vector<const json*> need;
    for (const json* c : unit_chunks_[it.unit]) {
      const uint64_t b = (*c)["begin"].get<uint64_t>(), e = b + (*c)["numel"].get<uint64_t>();
      if (e > lo && b < hi) need.push_back(c);
    }
    for (size_t i = 0; i < need.size(); i += kWindow) {
      std::vector<Loaded> window;
      std::vector<ChunkReader::Request> batch;
      for (size_t j = i; j < std::min(need.size(), i + kWindow); ++j) {
        if (kept_.chunk == need[j]) {
          place(kept_);
          continue;
        }
        Loaded l{need[j], aligned_floats(int64_t((*need[j])["numel"].get<uint64_t>()))};
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
    const json* chunk = nullptr;
    at::Tensor data;
  };
  ChunkReader& reader_;
  const std::vector<std::vector<const json*>>& unit_chunks_;  // master_chunks
  Loaded kept_;
};

// Whole tensors being put together from their parts: name -> (the whole tensor, elements in).
using Assembling = std::map<std::string, std::pair<at::Tensor, uint64_t>>;

// What `item` (read as `t`) completes: itself when it is whole; for a part, its whole tensor once
// its last part is in, else an undefined tensor (nothing to write yet).
at::Tensor complete(const Item& item, at::Tensor t, Assembling& assembling) {
  const ManifestTensor& it = item.t;
  if (!it.slot.origin.is_part()) return t;
  const std::string& name = it.slot.whole_name();
  auto& [whole, in] = assembling[name];
  if (!whole.defined()) whole = at::empty(it.slot.origin.whole_shape, at::kFloat);
  whole.narrow(it.slot.origin.dim, it.slot.origin.begin, it.slot.shape[size_t(it.slot.origin.dim)]).copy_(t);
  if ((in += it.numel) != item.whole_numel) return at::Tensor();
  t = whole;
  assembling.erase(name);
  return t;
}

}  // namespace

ExportResult export_checkpoint_hf(const fs::path& dir, const fs::path& out_arg, const std::string& dtype,
                                  const std::function<void(uint64_t, uint64_t)>& progress, bool overwrite,
                                  const fs::path& tokenizer_from) {
  if (!tokenizer_from.empty() && !fs::is_regular_file(tokenizer_from / "config.json") &&
      !fs::is_regular_file(tokenizer_from / "tokenizer.json") && !fs::is_regular_file(tokenizer_from / "tokenizer_config.json"))
    throw std::invalid_argument("export: " + tokenizer_from.string() + " is not a Hugging Face model or tokenizer directory");
  fs::path out_dir = out_arg.lexically_normal();  // "hf-model/": the temporary beside it, not in it
  if (!out_dir.has_filename()) out_dir = out_dir.parent_path();
  const at::ScalarType out_type = models::parse_export_dtype(dtype);
  const models::StDType st_type = out_type == at::kFloat      ? models::StDType::kF32
                                  : out_type == at::kBFloat16 ? models::StDType::kBF16
                                                              : models::StDType::kF16;

  const json m = read_manifest(dir);
  const models::ModelConfig mc = models::parse_hf_config(m["model"].dump(), (dir / "manifest.json").string());
  const std::vector<std::vector<const json*>> unit_chunks = master_chunks(m, dir);
  const ExportPlan plan = plan_export(m["units"], dir, mc, st_type);

  // Refused before any work: an existing, non-empty out_dir without `overwrite`.
  models::ExportDirectory out(out_dir, overwrite, "pass --force to replace its config.json and model.safetensors");
  const fs::path& tmp = out.tmp();
  models::ShardedSafetensorsWriter writer(tmp, plan.specs, models::kDefaultShardBytes, {{"format", "pt"}});
  ChunkReader reader(dir, m);
  TensorReader tensors(reader, unit_chunks);
  ExportResult result;
  Assembling assembling;
  for (const Item& item : plan.items) {
    at::Tensor t = complete(item, tensors.read(item.t).view(item.t.slot.shape), assembling);
    if (!t.defined()) continue;  // a part of a whole tensor not yet complete
    const std::string& name = item.t.slot.whole_name();
    if (models::hf_stores_transposed(mc, name)) t = t.t();
    t = t.to(out_type).contiguous();
    writer.write(name, {static_cast<const std::byte*>(t.data_ptr()), t.nbytes()});
    ++result.tensors;
    result.bytes += t.nbytes();
    if (progress) progress(result.bytes, plan.total);
  }
  writer.finish();
  write_atomically(tmp / "config.json", mc.to_hf_json(dtype) + "\n");
  if (!tokenizer_from.empty()) models::copy_tokenizer_files(tokenizer_from, tmp);
  out.commit();
  return result;
}

}  // namespace strata::engine
