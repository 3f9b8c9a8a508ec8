// What reads a checkpoint without an engine (checkpoint.h): verify, describe, the latest and the
// committed checkpoints, the resume point, the saved position, and the batch a resume keeps.
#include <algorithm>
#include <fstream>
#include <optional>
#include <sstream>
#include <stdexcept>
#include <string>
#include <system_error>
#include <vector>

#include "checkpoint/catalog.h"
#include "checkpoint/chunk_reader.h"
#include "checkpoint/format.h"
#include "strata/engine/checkpoint.h"

namespace strata::engine {

using namespace ckpt;

uint64_t verify_checkpoint(const fs::path& dir) {
  const json m = read_manifest(dir);
  // A format 1-2 manifest's chunks are checked to cover every (unit, kind) here; format 3's
  // index files, one saving rank at a time below, to describe exactly that rank's slices.
  ChunkCatalog catalog(dir, m);
  ChunkReader reader(dir, catalog);
  // Every chunk read and checked, a window of them at a time (one buffer each).
  constexpr size_t kWindow = 16;
  std::vector<at::Tensor> buffers;
  std::vector<ChunkReader::Request> batch;
  uint64_t bytes = 0;
  for (int q = 0; q < catalog.saved_world(); ++q) {
    const std::vector<Chunk> chunks = catalog.of_rank(q);
    for (size_t i = 0; i < chunks.size(); i += kWindow) {
      batch.clear();
      for (size_t j = i; j < std::min(chunks.size(), i + kWindow); ++j) {
        const size_t slot = j - i;
        const int64_t n = int64_t(chunks[j].numel);
        if (buffers.size() <= slot) buffers.push_back(aligned_floats(int64_t(kChunkElements)));
        if (buffers[slot].numel() < n) buffers[slot] = aligned_floats(n);
        batch.push_back({chunks[j], buffers[slot].data_ptr<float>()});
        bytes += uint64_t(n) * 4;
      }
      reader.read(batch, kWindow);
    }
  }
  return bytes;
}

std::string describe_checkpoint(const fs::path& dir) {
  const json m = read_manifest(dir);
  const ChunkCatalog catalog(dir, m);
  uint64_t params = 0;
  for (const json& u : m["units"]) params += u["numel"].get<uint64_t>();
  std::ostringstream out;
  out << "checkpoint " << dir.string() << "\n"
      << "  format " << m["format"] << ", saved by " << m["world_size"] << " ranks\n"
      << "  model " << m["model"].value("model_type", "?") << ", " << params << " parameters in "
      << m["units"].size() << " units\n"
      << "  train steps " << m["train_steps"] << ", optimizer steps "
      << m["counters"]["optimizer_step"] << ", loss scale " << m["counters"]["loss_scale"]
      << ", samples consumed " << m["samples_consumed"] << "\n"
      << "  " << catalog.chunk_count() << " chunks, " << params * 12 << " bytes of fp32 master and moments\n";
  return out.str();
}

std::optional<fs::path> latest_checkpoint(const fs::path& root) {
  std::ifstream in(root / "latest");
  if (!in) return std::nullopt;
  std::string name;
  std::getline(in, name);
  if (name.empty() || !fs::exists(root / name / "manifest.json")) return std::nullopt;
  return root / name;
}

std::vector<fs::path> committed_checkpoints(const fs::path& root) {
  std::vector<fs::path> out;
  std::error_code ec;
  if (!fs::is_directory(root, ec)) return out;
  for (const auto& e : fs::directory_iterator(root, ec))
    if (e.is_directory() && fs::exists(e.path() / "manifest.json")) out.push_back(e.path());
  std::sort(out.begin(), out.end());
  return out;
}

std::optional<fs::path> resume_point(const fs::path& root) {
  const std::vector<fs::path> committed = committed_checkpoints(root);
  const auto found = [&] {
    if (committed.empty()) return std::string(" (no committed checkpoint there)");
    std::string names;
    for (const fs::path& c : committed) names += (names.empty() ? "" : ", ") + c.filename().string();
    return " (committed there: " + names + "; resume from one of them with --resume-from " +
           committed.back().string() + ")";
  };
  const fs::path latest_file = root / "latest";
  std::error_code ec;
  if (!fs::exists(latest_file, ec)) {
    if (committed.empty()) return std::nullopt;
    throw std::runtime_error("cannot resume from " + root.string() + ": it has no `latest` file" + found());
  }
  std::ifstream in(latest_file);
  std::string name;
  if (!in || !std::getline(in, name))
    throw std::runtime_error("cannot resume from " + root.string() + ": " + latest_file.string() +
                             " cannot be read or is empty" + found());
  if (name.empty() || name.find('/') != std::string::npos)
    throw std::runtime_error("cannot resume from " + root.string() + ": " + latest_file.string() + " names '" + name +
                             "', not a checkpoint directory" + found());
  if (!fs::exists(root / name / "manifest.json", ec))
    throw std::runtime_error("cannot resume from " + root.string() + ": `latest` names " + name + ", but " +
                             (root / name).string() +
                             (fs::exists(root / name, ec) ? " has no manifest.json (never committed)" : " does not exist") +
                             found());
  return root / name;
}

CheckpointMeta read_checkpoint_meta(const fs::path& dir) { return ckpt::checkpoint_meta(read_manifest(dir), dir); }

ResumeBatch resume_batch(const CheckpointMeta& saved, int64_t micro_batch, int64_t grad_accum, int world_size,
                         bool allow_change) {
  const uint64_t per_accum = uint64_t(micro_batch) * uint64_t(world_size);
  const uint64_t now = per_accum * uint64_t(grad_accum);
  if (saved.global_batch == 0 || saved.global_batch == now) return {grad_accum, ""};
  const std::string was = "the checkpoint was saved at world size " + std::to_string(saved.world_size) +
                          " with a global batch of " + std::to_string(saved.global_batch) + " sequences";
  if (saved.world_size != world_size && saved.global_batch % per_accum == 0) {
    const int64_t kept = int64_t(saved.global_batch / per_accum);
    return {kept, was + "; at world size " + std::to_string(world_size) + " batch.grad_accum " +
                      std::to_string(grad_accum) + " -> " + std::to_string(kept) + " keeps it (micro_batch " +
                      std::to_string(micro_batch) + ")"};
  }
  const std::string change = "world size " + std::to_string(world_size) + " x micro_batch " +
                             std::to_string(micro_batch) + " x grad_accum " + std::to_string(grad_accum) + " = " +
                             std::to_string(now);
  if (!allow_change)
    throw std::invalid_argument(
        was + ", this run's is " + change + " (and no grad_accum keeps " + std::to_string(saved.global_batch) +
        " at this world size and micro_batch): the steps from here on would take other samples than the "
        "saved run. Set a micro_batch and grad_accum that make " + std::to_string(saved.global_batch) +
        ", or allow the change with --allow-batch-change (run.allow_batch_change)");
  return {grad_accum, was + "; this run's is " + change + " (allowed by run.allow_batch_change)"};
}

}  // namespace strata::engine
