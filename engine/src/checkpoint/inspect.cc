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
#include "strata/offload/crc32c.h"
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

std::string incomplete_checkpoint(const fs::path& dir) {
  std::error_code ec;
  if (!fs::is_directory(dir, ec)) return "does not exist";
  if (!fs::exists(dir / "manifest.json", ec)) return "has no manifest.json (never committed)";
  json m;
  try {
    m = read_manifest(dir);
  } catch (const std::exception& e) {
    return std::string("has a manifest that cannot be read: ") + e.what();
  }
  if (!m.contains("ranks")) return "";  // format 1-2: the manifest holds the chunks; load checks them
  const json& ranks = m["ranks"];
  for (size_t q = 0; q < ranks.size(); ++q) {
    const fs::path data = dir / (rank_name(int(q)) + ".data"), index = dir / (rank_name(int(q)) + ".index.json");
    // Files of other ranks may be on disks this host does not see (node-local): judged where seen.
    const bool must_see = q == 0;
    if (!fs::exists(index, ec) || !fs::exists(data, ec)) {
      if (must_see || fs::exists(index, ec) || fs::exists(data, ec))
        return "lacks " + (fs::exists(index, ec) ? data : index).filename().string();
      continue;
    }
    const uint64_t want_data = ranks[q].value("data_bytes", uint64_t(0));
    if (fs::file_size(data, ec) < want_data)
      return "has " + data.filename().string() + " of " + std::to_string(fs::file_size(data, ec)) +
             " bytes, short of its " + std::to_string(want_data);
    const std::string text = read_text(index);
    if (text.size() != ranks[q].value("index_bytes", uint64_t(0)) ||
        offload::crc32c(text.data(), text.size()) != ranks[q].value("index_crc32c", uint32_t(0)))
      return "has " + index.filename().string() + " unlike the manifest's record of it (size or CRC32C)";
  }
  return "";
}

ResumeFinding find_resume_point(const fs::path& root) {
  ResumeFinding found;
  std::error_code ec;
  const std::vector<std::string> half = step_directories(root).half_written;
  std::string half_note;
  for (const std::string& h : half) half_note += (half_note.empty() ? "" : ", ") + h;
  if (!half_note.empty())
    half_note = root.string() + " holds " + std::to_string(half.size()) + " half-written save" +
                (half.size() > 1 ? "s" : "") + " (" + half_note + ": never committed, never loaded; the next " +
                "save removes them)";

  // `latest`, when it leads to a complete checkpoint.
  const fs::path latest_file = root / "latest";
  std::string why_not;  // why `latest` was not followed
  std::string name;
  if (!fs::exists(latest_file, ec)) {
    why_not = "it has no `latest` file";
  } else {
    std::ifstream in(latest_file);
    if (!in || !std::getline(in, name) || name.empty()) why_not = latest_file.string() + " cannot be read or is empty";
    else if (name.find('/') != std::string::npos || name == "." || name == "..")
      why_not = latest_file.string() + " names '" + name + "', not a checkpoint directory";
    else if (const std::string bad = incomplete_checkpoint(root / name); !bad.empty())
      why_not = "`latest` names " + name + ", but " + (root / name).string() + " " + bad;
  }
  if (why_not.empty()) {
    found.dir = root / name;
    found.note = half_note;
    return found;
  }
  // The newest committed checkpoint that is complete (after a power cut `latest` can lag).
  const std::vector<fs::path> committed = committed_checkpoints(root);
  std::string refused;
  for (auto c = committed.rbegin(); c != committed.rend(); ++c) {
    if (c->filename().string() == name) continue;  // judged above
    if (const std::string bad = incomplete_checkpoint(*c); !bad.empty()) {
      refused += "; " + c->filename().string() + " " + bad;
      continue;
    }
    found.dir = *c;
    found.note = "cannot follow `latest` in " + root.string() + ": " + why_not + "; resuming from " +
                 c->filename().string() + ", the newest complete checkpoint there" + refused +
                 (half_note.empty() ? "" : "; " + half_note);
    return found;
  }
  // Nothing to resume: a first run (or one whose first save never committed) starts at step 0;
  // a `latest` or a manifest with no complete checkpoint behind it is an error, lest a run that
  // had saved start over unnoticed.
  if (!fs::exists(latest_file, ec) && committed.empty()) {
    found.note = half_note;
    return found;
  }
  throw std::runtime_error("cannot resume from " + root.string() + ": " + why_not +
                           (committed.empty() ? std::string("; no committed checkpoint there")
                                              : "; and no committed checkpoint there is complete" + refused) +
                           (half_note.empty() ? "" : "; " + half_note));
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
