// A second reader of the checkpoint format's chunk metadata, written from docs/FORMATS.md and not
// from the engine's code: the chunks of a checkpoint as format 2 listed them in its manifest
// ({"unit", "kind", "rank", "begin", "numel", "file", "offset", "crc32c"}), from a format 3
// manifest and its ranks' index files. Tests use it to find chunks to corrupt, to count them, and
// to write a checkpoint back in format 2.
#pragma once

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cstdint>
#include <functional>
#include <stdexcept>
#include <string>
#include <vector>

namespace strata::test {

inline std::vector<nlohmann::json> saved_chunks(const nlohmann::json& manifest,
                                                const std::function<std::string(int rank)>& index_of_rank) {
  using nlohmann::json;
  if (manifest.at("format").get<int>() < 3) return manifest.at("chunks").get<std::vector<json>>();
  const int world = manifest.at("world_size").get<int>();
  const uint64_t chunk = manifest.at("chunk_elements").get<uint64_t>();
  const uint64_t stride = (chunk * 4 + 4095) / 4096 * 4096;
  static const char* kKinds[] = {"master", "exp_avg", "exp_avg_sq"};
  std::vector<json> out;
  for (int q = 0; q < world; ++q) {
    char file[32];
    std::snprintf(file, sizeof file, "rank-%05d.data", q);
    const json index = json::parse(index_of_rank(q));
    for (const json& s : index.at("slices")) {
      const size_t u = s[0].get<size_t>();
      const uint64_t numel = manifest["units"][u]["numel"].get<uint64_t>();
      const uint64_t shard = manifest["shards"][u].get<uint64_t>();
      const uint64_t begin = uint64_t(q) * shard, valid = std::min(shard, numel - begin);
      const std::string crcs = s[3].get<std::string>();
      for (size_t i = 0; i * 8 < crcs.size(); ++i)
        out.push_back({{"unit", u},
                       {"kind", kKinds[s[1].get<int>()]},
                       {"rank", q},
                       {"begin", begin + i * chunk},
                       {"numel", std::min(chunk, valid - i * chunk)},
                       {"file", file},
                       {"offset", s[2].get<uint64_t>() + i * stride},
                       {"crc32c", std::stoul(crcs.substr(i * 8, 8), nullptr, 16)}});
    }
  }
  return out;
}

}  // namespace strata::test
