// Object-store URLs where `strata` takes a path (model.init_from, run.export, checkpoint
// directories, `ckpt export`'s output): their local side in Strata's cache, and the upload of an
// export as it is written. Thread safety: none needed (the training thread, or rank 0 alone).
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <functional>
#include <iostream>
#include <memory>
#include <set>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "strata/offload/object_store.h"

namespace strata::cli {

// $STRATA_CACHE (default ~/.cache/strata)/<kind>/<the URL after its scheme>: where a model in a
// bucket is mirrored ("models"), an export is staged before its upload ("exports"), tiered
// saves keep their local copies ("checkpoints").
inline std::string cache_path(const std::string& kind, const std::string& url) {
  const char* cache = std::getenv("STRATA_CACHE");
  const char* home = std::getenv("HOME");
  const std::string base = cache && *cache ? std::string(cache) : std::string(home ? home : "/tmp") + "/.cache/strata";
  const size_t scheme = url.find("://");
  return base + "/" + kind + "/" + (scheme == std::string::npos ? url : url.substr(scheme + 3));
}

// Removes the regular files directly in `dir` (a staging directory of the cache), if any.
inline void clear_directory(const std::string& dir) {
  std::error_code ec;
  for (const auto& e : std::filesystem::directory_iterator(dir, ec))
    if (e.is_regular_file()) std::filesystem::remove(e.path(), ec);
}

// Refuses an export into a store prefix that already holds objects, unless `overwrite`.
inline void check_export_store(const std::string& url, bool overwrite, const std::string& hint) {
  const auto there = offload::open_object_store(url)->list("");
  if (!there.empty() && !overwrite)
    throw std::invalid_argument("export " + url + " already holds " + std::to_string(there.size()) + " object(s) (" +
                                there.front().key + (there.size() > 1 ? ", ..." : "") + "): " + hint);
}

// An export to object storage, uploaded as it is written: each weights file (a shard) goes up as
// soon as the writer completes it and leaves the staging directory, so staging holds the shards
// being written (one, or two while a tensor larger than the limit makes its own), not the model
// (engine::EngineExport::on_weights_file, export_checkpoint_hf's). In a run of several ranks each
// rank uploads the shards it writes (EngineExport::stage_on_every_rank), through its own
// ExportUpload. Before its first shard, each removes the store's config.json of an earlier
// export, so that no reader takes an old config beside new shards: an export that then fails
// leaves the prefix without a usable model (the earlier one's shards partly replaced). finish(),
// on rank 0 once every shard is up, uploads the rest of the staging directory (the index, the
// tokenizer), removes objects there that this export does not have (an earlier export's shards),
// and puts config.json last: a reader that finds it finds only this export's weights. The store
// is opened at first use, so that its errors are the export's (inside the export's collectives).
// One thread.
class ExportUpload {
 public:
  // `descriptor`: the file uploaded last, once the weights are up (config.json; a PEFT adapter's
  // adapter_config.json).
  explicit ExportUpload(std::string url, std::string descriptor = "config.json")
      : url_(std::move(url)), descriptor_(std::move(descriptor)) {}

  // Uploads `file` under its name, then removes it.
  void weights_file(const std::filesystem::path& file) {
    offload::ObjectStore& s = store();
    if (uploaded_.empty()) s.remove(descriptor_);
    const std::string key = file.filename().string();
    bytes_ += offload::put_file(s, key, file.string()).size;
    uploaded_.insert(key);
    std::filesystem::remove(file);
  }
  std::function<void(const std::filesystem::path&)> on_weights_file() {
    return [this](const std::filesystem::path& f) { weights_file(f); };
  }

  // After the export committed into `dir` (the staging directory); `weights` are the export's
  // weights files (engine::ExportResult::files), uploaded by whichever rank wrote them.
  void finish(const std::string& dir, const std::vector<std::string>& weights) {
    offload::ObjectStore& s = store();
    std::vector<std::string> names;
    for (const auto& e : std::filesystem::directory_iterator(dir))
      if (e.is_regular_file() && e.path().filename() != descriptor_) names.push_back(e.path().filename().string());
    std::sort(names.begin(), names.end());
    s.remove(descriptor_);  // an earlier export's, when no shard went up before
    for (const std::string& name : names) {
      bytes_ += offload::put_file(s, name, dir + "/" + name).size;
      uploaded_.insert(name);
    }
    std::set<std::string> ours = uploaded_;
    ours.insert(weights.begin(), weights.end());
    std::size_t stale = 0;
    for (const auto& o : s.list(""))
      if (o.key.find('/') == std::string::npos && o.key != descriptor_ && !ours.count(o.key)) {
        s.remove(o.key);
        ++stale;
      }
    const std::size_t streamed = ours.size() - names.size();
    bytes_ += offload::put_file(s, descriptor_, dir + "/" + descriptor_).size;
    std::cerr << "strata: uploaded the export to " << s.url() << " ("
              << (streamed ? std::to_string(streamed) + " weights file(s) as they were written, " : "")
              << double(bytes_) / (1 << 20) << " MiB from this process"
              << (stale ? ", " + std::to_string(stale) + " stale object(s) of an earlier export removed" : "") << ")\n";
  }

 private:
  offload::ObjectStore& store() {
    if (!store_) store_ = offload::open_object_store(url_);
    return *store_;
  }
  std::string url_, descriptor_;
  std::unique_ptr<offload::ObjectStore> store_;
  std::set<std::string> uploaded_;
  uint64_t bytes_ = 0;
};

}  // namespace strata::cli
