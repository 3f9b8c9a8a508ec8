// `strata bench scale`: how the engine's costs grow with the world size and the model.
//
// World sizes (scale_world.cc), on this machine, every rank a process of `strata launch`:
// - the engine's all-gather and reduce-scatter (Communicator) on one buffer: seconds, and the
//   bytes and write calls each rank sends, counted by the kernel (/proc/self/io), against
//   (world - 1) / world of the buffer;
// - a tiny Llama trained, saved and resumed: step time, rank 0's collective bytes a step, save
//   and load seconds, the checkpoint's metadata bytes, rank 0's peak RSS saving and loading.
// Each figure's growth exponent against the world size (a least-squares slope in log-log).
// Then the many-rank tests at 32 ranks (tests/engine/many_ranks_test.cc, Ranks32.*), which stay
// out of CI: each one's result and seconds, recorded in the final JSON line.
//
// Checkpoint metadata of a large model (scale_bench.cc): for a model preset (default gpt-1t) it
// synthesizes a checkpoint's metadata as `saved_worlds` ranks would save it (format 3: the
// manifest and every rank's index file, with the engine's own writer; no data), and reads it the
// way a load at the same world size does on one rank (the manifest, then the index files of the
// saving ranks whose chunks overlap that rank's slices), in a fresh process so that its peak RSS
// is the reading's. Beside it, the baseline: the same checkpoint's metadata in format 2 (every
// chunk listed in the manifest, which every rank received and parsed), synthesized and read the
// same way. It prints the bytes, seconds and peak RSS of each, the whole checkpoint's metadata
// bytes, their growth exponents against the world size, and a final JSON line: metric
// load_metadata_bytes_per_rank_<preset>_<first world>.
#pragma once

#include <filesystem>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

namespace strata::bench {

struct ScaleBenchOptions {
  std::filesystem::path dir = "strata-bench-scale";  // the synthesized metadata (removed after)
  std::string preset = "gpt-1t";
  std::vector<int> saved_worlds = {512, 4096};
  bool baseline = true;  // format 2 at the first world size (a few hundred MB of JSON)
  std::vector<int> worlds = {1, 2, 4, 8, 16, 32};  // ranks on this machine; empty: metadata only
  uint64_t collective_bytes = 16ull << 20;          // the collectives' whole buffer
  int collective_iters = 5;
  // The 32-rank tests (many_ranks_tests, Ranks32.*): "auto" runs the binary of the build tree
  // this strata belongs to (<its directory>/tests/many_ranks_tests) when there is one and the
  // world-size parts run, "off" skips them, anything else is the binary's path.
  std::string many_rank_tests = "auto";
};

void run_scale_bench(const ScaleBenchOptions& options);

// The world-size parts (called by run_scale_bench before the metadata part).
void run_world_scaling(const ScaleBenchOptions& options);

// Runs the 32-rank tests (options.many_rank_tests) and prints each one's result and seconds;
// returns {"passed", "failed", "seconds"} for the final JSON line, or null when skipped.
nlohmann::json run_many_rank_tests(const ScaleBenchOptions& options);

// A figure's growth exponent: the least-squares slope of log(y) against log(x) over the points
// with x > 1 (one rank has no collectives to grow) and y > 0; NaN with fewer than two such points.
// For two points, log(y1 / y0) / log(x1 / x0).
double growth_exponent(const std::vector<double>& x, const std::vector<double>& y);

// The child process of the collectives part: one rank (DistEnv::from_env) all-gathers and
// reduce-scatters a buffer of `buffer_bytes` fp32 `iters` times each, and prints what it sent and
// how long it took, per collective, as one JSON line.
int collective_rank(uint64_t buffer_bytes, int iters);

// The child process: reads checkpoint `dir`'s metadata as rank `rank` of a load at the saved
// world size does, and prints {"bytes", "seconds", "chunks"} as one JSON line.
int read_metadata_as_a_load(const std::filesystem::path& dir, int rank);

}  // namespace strata::bench
