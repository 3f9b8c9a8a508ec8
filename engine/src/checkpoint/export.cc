// Exporting fp32 master weights as a Hugging Face model directory, tensor by tensor, never holding
// the model (checkpoint.h): a checkpoint's, read from its chunks without an engine
// (export_checkpoint_hf), or a running engine's, each tensor's slices broadcast piece by piece from
// the ranks that hold them to the writing rank (export_engine_hf). One writer serves both.
#include <ATen/ops/empty.h>

#include <algorithm>
#include <functional>
#include <future>
#include <map>
#include <memory>
#include <optional>
#include <stdexcept>

#include "checkpoint/catalog.h"
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

// Whole tensors being put together from their parts: name -> (the whole tensor, elements in).
using Assembling = std::map<std::string, std::pair<at::Tensor, uint64_t>>;

// What `item` (read as `t`) completes: itself when it is whole; for a part, its whole tensor once
// its last part is in, else an undefined tensor (nothing to write yet).
at::Tensor complete(const Item& item, at::Tensor t, Assembling& assembling) {
  const ManifestTensor& it = item.t;
  if (!it.slot.origin.is_part()) return t;
  const std::string& name = it.slot.whole_name();
  auto& [whole, in] = assembling[name];
  if (!whole.defined()) whole = at::empty(it.slot.origin.whole_shape, t.options());
  whole.narrow(it.slot.origin.dim, it.slot.origin.begin, it.slot.shape[size_t(it.slot.origin.dim)]).copy_(t);
  if ((in += it.numel) != item.whole_numel) return at::Tensor();
  t = whole;
  assembling.erase(name);
  return t;
}

models::StDType st_type_of(at::ScalarType type) {
  return type == at::kFloat ? models::StDType::kF32 : type == at::kBFloat16 ? models::StDType::kBF16 : models::StDType::kF16;
}

// The writer of both exports: the plan's tensors in order, each from `read` (its elements flat,
// in any float type), converted to `out_type` (exactly: converting the parts and assembling them is
// assembling and converting), parts assembled into their whole tensors, GPT-2's Conv1D weights
// transposed. With `writer` null (a rank that does not write) `read` is still called for every
// tensor, in order, and nothing else is done; so it is after a failure to write, whose message
// goes to `failure` (read's own exceptions propagate).
ExportResult write_tensors(const ExportPlan& plan, const models::ModelConfig& mc, at::ScalarType out_type,
                           models::ShardedSafetensorsWriter* writer,
                           const std::function<at::Tensor(const ManifestTensor&)>& read,
                           const std::function<void(uint64_t, uint64_t)>& progress, std::string& failure) {
  ExportResult result;
  Assembling assembling;
  const auto attempt = [&](const std::function<void()>& f) {
    try {
      f();
    } catch (const std::exception& e) {
      failure = e.what();
      writer = nullptr;
    }
  };
  for (const Item& item : plan.items) {
    at::Tensor t = read(item.t);
    if (!writer) continue;
    attempt([&] {
      t = complete(item, t.to(out_type).view(item.t.slot.shape), assembling);
      if (!t.defined()) return;  // a part of a whole tensor not yet complete
      const std::string& name = item.t.slot.whole_name();
      if (models::hf_stores_transposed(mc, name)) t = t.t();
      t = t.contiguous();
      writer->write(name, {static_cast<const std::byte*>(t.data_ptr()), t.nbytes()});
      ++result.tensors;
      result.bytes += t.nbytes();
      if (progress) progress(result.bytes, plan.total);
    });
  }
  if (writer) attempt([&] { writer->finish(); });
  return result;
}

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
  const models::ModelConfig mc = models::parse_hf_config(m["model"].dump(), (dir / "manifest.json").string());
  ChunkCatalog catalog(dir, m);  // format 1-2: the chunks checked to tile every unit
  const ExportPlan plan = plan_export(m["units"], dir, mc, st_type);

  // Refused before any work: an existing, non-empty out_dir without `overwrite`.
  models::ExportDirectory out(out_dir, overwrite, "pass --force to replace its config.json and model.safetensors");
  const fs::path& tmp = out.tmp();
  models::ShardedSafetensorsWriter writer(tmp, plan.specs, shard_bytes, {{"format", "pt"}});
  if (on_weights_file) writer.on_shard_complete([&](const std::string& file) { on_weights_file(tmp / file); });
  ChunkReader reader(dir, catalog);
  TensorReader tensors(reader, catalog);
  std::string failure;
  const ExportResult result = write_tensors(
      plan, mc, out_type, &writer, [&](const ManifestTensor& t) { return tensors.read(t); }, progress, failure);
  if (!failure.empty()) throw std::runtime_error(failure);
  write_atomically(tmp / "config.json", mc.to_hf_json(dtype) + "\n");
  if (!tokenizer_from.empty()) models::copy_tokenizer_files(tokenizer_from, tmp);
  out.commit();
  return result;
}

namespace {

// Tensor `t` of the engine's units, its fp32 master elements in pieces of at most kPiece, each
// read by the rank whose slice holds it (read_state) and broadcast; the writing rank gathers them
// in `type`, the others get an undefined tensor. A collective.
at::Tensor gather_tensor(Engine& engine, Communicator& comm, const ManifestTensor& t, at::ScalarType type, bool writes,
                         at::Tensor& piece) {
  constexpr uint64_t kPiece = 16ull << 20;  // 64 MiB of fp32
  const UnitLayout& L = engine.partition().unit(t.unit);
  at::Tensor out = writes ? at::empty({int64_t(t.numel)}, at::TensorOptions().dtype(type)) : at::Tensor();
  if (!piece.defined()) piece = aligned_floats(int64_t(kPiece));
  for (uint64_t a = t.offset, end = t.offset + t.numel; a < end;) {
    const int owner = int(a / L.shard_numel);
    const uint64_t b = std::min({end, a + kPiece, L.shard_begin(owner) + L.shard_valid_numel(owner)});
    at::Tensor view = piece.narrow(0, 0, int64_t(b - a));
    if (comm.rank() == owner) engine.read_state(t.unit, state::kMaster, a - L.shard_begin(owner), b - a, view.data_ptr<float>());
    comm.broadcast(view, owner);
    if (writes) out.narrow(0, int64_t(a - t.offset), int64_t(b - a)).copy_(view);
    a = b;
  }
  return out;
}

}  // namespace

ExportResult export_engine_hf(Engine& engine, Communicator& comm, const fs::path& out_arg, const EngineExport& options) {
  fs::path out_dir = out_arg.lexically_normal();
  if (!out_dir.has_filename()) out_dir = out_dir.parent_path();
  const bool writes = comm.rank() == 0;
  const models::ModelConfig& mc = engine.model_config();
  const ExportPlan plan = plan_export(partition_json(engine.partition()), out_dir, mc, st_type_of(options.type));
  // Rank 0 writes. A failure there (a full disk) stops its writing, not its part in the
  // broadcasts, so that every rank finishes the export's collectives and learns of it at the end.
  std::string failure;
  std::optional<models::ExportDirectory> out;
  std::optional<models::ShardedSafetensorsWriter> writer;
  if (writes) {
    try {
      out.emplace(out_dir, options.overwrite, options.overwrite_hint);
      writer.emplace(out->tmp(), plan.specs, options.shard_bytes, std::map<std::string, std::string>{{"format", "pt"}});
      if (options.on_weights_file)
        writer->on_shard_complete([&, tmp = out->tmp()](const std::string& file) { options.on_weights_file(tmp / file); });
    } catch (const std::exception& e) {
      failure = e.what();
    }
  }
  // Read, not changed: the hold makes read_state see the device's queued update; the caller (the
  // training thread) runs no update meanwhile. An asynchronous save in flight is waited for first.
  auto hold = std::make_shared<StateHold>(engine.partition().num_units());
  engine.hold_state(hold);
  struct ReleaseAll {
    StateHold& h;
    ~ReleaseAll() { h.release_all(); }
  } release_all{*hold};
  const std::shared_future<void> update = engine.update_finished();
  if (update.valid()) update.get();
  at::Tensor piece;
  const bool writing = writes && failure.empty();
  ExportResult result = write_tensors(
      plan, mc, options.type, writing ? &*writer : nullptr,
      [&](const ManifestTensor& t) { return gather_tensor(engine, comm, t, options.type, writing, piece); },
      options.progress, failure);
  if (writing && failure.empty()) {
    try {
      write_atomically(out->tmp() / "config.json", mc.to_hf_json(models::hf_dtype_name(options.type)) + "\n");
      if (!options.tokenizer_from.empty()) result.tokenizer_files = models::copy_tokenizer_files(options.tokenizer_from, out->tmp());
      out->commit();
    } catch (const std::exception& e) {
      failure = e.what();
    }
  }
  if (!failure.empty()) throw std::runtime_error("export to " + out_dir.string() + ": " + failure);
  return result;
}

}  // namespace strata::engine
