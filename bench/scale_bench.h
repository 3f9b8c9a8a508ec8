// `strata bench scale`, its checkpoint-metadata part: how the metadata a checkpoint load reads
// grows with the model and with the world that saved it.
//
// For a model preset (default gpt-1t) it synthesizes a checkpoint's metadata as `saved_worlds`
// ranks would save it (format 3: the manifest and every rank's index file, with the engine's own
// writer; no data), and reads it the way a load at the same world size does on one rank (the
// manifest, then the index files of the saving ranks whose chunks overlap that rank's slices), in
// a fresh process so that its peak RSS is the reading's. Beside it, the baseline: the same
// checkpoint's metadata in format 2 (every chunk listed in the manifest, which every rank
// received and parsed), synthesized and read the same way. It prints the bytes, seconds and peak
// RSS of each, the whole checkpoint's metadata bytes, their growth exponents against the world
// size, and a final JSON line: metric load_metadata_bytes_per_rank_<preset>_<first world>.
//
// Not yet here (issue #44): step, collective, save and load times against world size.
#pragma once

#include <filesystem>
#include <string>
#include <vector>

namespace strata::bench {

struct ScaleBenchOptions {
  std::filesystem::path dir = "strata-bench-scale";  // the synthesized metadata (removed after)
  std::string preset = "gpt-1t";
  std::vector<int> saved_worlds = {512, 4096};
  bool baseline = true;  // format 2 at the first world size (a few hundred MB of JSON)
};

void run_scale_bench(const ScaleBenchOptions& options);

// The child process: reads checkpoint `dir`'s metadata as rank `rank` of a load at the saved
// world size does, and prints {"bytes", "seconds", "chunks"} as one JSON line.
int read_metadata_as_a_load(const std::filesystem::path& dir, int rank);

}  // namespace strata::bench
