// Exporting a checkpoint's fp32 master weights as a Hugging Face model directory, tensor by
// tensor, without an engine and without holding the model (checkpoint.h).
#include <ATen/ops/empty.h>

#include <algorithm>
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
  const json& units = m["units"];

  // The master chunks of each unit, sorted, must tile the unit exactly.
  std::vector<std::vector<const json*>> unit_chunks = chunks_by_unit(m, dir, /*kind=*/0);
  for (size_t u = 0; u < units.size(); ++u)
    if (!sort_and_check_tiling(unit_chunks[u], units[u]["numel"].get<uint64_t>()))
      throw std::runtime_error("checkpoint " + dir.string() + ": the master chunks of unit " +
                               units[u]["name"].get<std::string>() + " do not cover it exactly");

  // Tensors in unit order, packed in their unit as the partition packs them.
  struct Item {
    size_t unit;
    uint64_t offset, numel;
    std::string name;
    std::vector<int64_t> shape;  // Strata's
    bool transposed;
  };
  std::vector<Item> items;
  std::vector<models::SafetensorsWriter::Spec> specs;
  uint64_t total = 0;
  for (size_t u = 0; u < units.size(); ++u) {
    uint64_t offset = 0;
    for (const json& t : units[u]["tensors"]) {
      Item it{u, offset, 1, t["name"].get<std::string>(), t["shape"].get<std::vector<int64_t>>(), false};
      for (int64_t d : it.shape) it.numel *= uint64_t(d);
      it.transposed = models::hf_stores_transposed(mc, it.name);
      std::vector<int64_t> hf_shape = it.shape;
      if (it.transposed) std::swap(hf_shape[0], hf_shape[1]);
      specs.push_back({it.name, st_type, hf_shape});
      total += it.numel * models::st_dtype_bytes(st_type);
      offset += it.numel;
      items.push_back(std::move(it));
    }
    if (offset != units[u]["numel"].get<uint64_t>())
      throw std::runtime_error("checkpoint " + dir.string() + ": the tensors of unit " +
                               units[u]["name"].get<std::string>() + " do not add up to its size");
  }

  // Refused before any work: an existing, non-empty out_dir without `overwrite`.
  models::ExportDirectory out(out_dir, overwrite, "pass --force to replace its config.json and model.safetensors");
  const fs::path& tmp = out.tmp();
  models::ShardedSafetensorsWriter writer(tmp, specs, models::kDefaultShardBytes, {{"format", "pt"}});
  ChunkReader reader(dir, m);
  // Each tensor from the chunks it overlaps, a window of them read at a time; the last chunk
  // read is kept, as it may straddle into the next tensor.
  constexpr size_t kWindow = 16;  // chunks in flight: 64 MiB
  struct Loaded {
    const json* chunk = nullptr;
    at::Tensor data;
  };
  Loaded kept;
  ExportResult result;
  for (const Item& it : items) {
    at::Tensor full = at::empty({int64_t(it.numel)}, at::TensorOptions().dtype(at::kFloat));
    const uint64_t lo = it.offset, hi = it.offset + it.numel;
    const auto place = [&](const Loaded& l) {
      const uint64_t b = (*l.chunk)["begin"].get<uint64_t>(), e = b + (*l.chunk)["numel"].get<uint64_t>();
      const uint64_t from = std::max(b, lo), to = std::min(e, hi);
      full.narrow(0, int64_t(from - lo), int64_t(to - from)).copy_(l.data.narrow(0, int64_t(from - b), int64_t(to - from)));
    };
    std::vector<const json*> need;
    for (const json* c : unit_chunks[it.unit]) {
      const uint64_t b = (*c)["begin"].get<uint64_t>(), e = b + (*c)["numel"].get<uint64_t>();
      if (e > lo && b < hi) need.push_back(c);
    }
    for (size_t i = 0; i < need.size(); i += kWindow) {
      std::vector<Loaded> window;
      std::vector<ChunkReader::Request> batch;
      for (size_t j = i; j < std::min(need.size(), i + kWindow); ++j) {
        if (kept.chunk == need[j]) {
          place(kept);
          continue;
        }
        Loaded l{need[j], aligned_floats(int64_t((*need[j])["numel"].get<uint64_t>()))};
        batch.push_back({l.chunk, l.data.data_ptr<float>()});
        window.push_back(std::move(l));
      }
      reader.read(batch, kWindow);
      for (const Loaded& l : window) place(l);
      if (!window.empty()) kept = std::move(window.back());
    }
    at::Tensor t = full.view(it.shape);
    if (it.transposed) t = t.t();
    t = t.to(out_type).contiguous();
    writer.write(it.name, {static_cast<const std::byte*>(t.data_ptr()), t.nbytes()});
    ++result.tensors;
    result.bytes += t.nbytes();
    if (progress) progress(result.bytes, total);
  }
  writer.finish();
  write_atomically(tmp / "config.json", mc.to_hf_json(dtype) + "\n");
  if (!tokenizer_from.empty()) models::copy_tokenizer_files(tokenizer_from, tmp);
  out.commit();
  return result;
}

}  // namespace strata::engine
