// Object-store URLs where `strata` takes a path (model.init_from, run.export, checkpoint
// directories, `ckpt export`'s output): their local side in Strata's cache, and the upload of an
// export. Thread safety: none needed (the training thread, or rank 0 alone).
#pragma once

#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <iostream>
#include <stdexcept>
#include <string>

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

// Uploads the export staged in `dir` to `url`, config.json last (a reader that finds it finds
// the weights), then removes objects there that the export does not have (an earlier export's
// shards). Prints what it did.
inline void upload_export(const std::string& dir, const std::string& url) {
  auto store = offload::open_object_store(url);
  const uint64_t bytes = offload::upload_directory(*store, dir, "config.json");
  std::size_t stale = 0;
  for (const auto& o : store->list(""))
    if (o.key.find('/') == std::string::npos && !std::filesystem::exists(std::filesystem::path(dir) / o.key)) {
      store->remove(o.key);
      ++stale;
    }
  std::cerr << "strata: uploaded the export to " << store->url() << " (" << double(bytes) / (1 << 20) << " MiB"
            << (stale ? ", " + std::to_string(stale) + " stale object(s) of an earlier export removed" : "") << ")\n";
}

}  // namespace strata::cli
