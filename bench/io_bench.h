// `strata bench io`: sequential and random read/write bandwidth of the I/O engine on a
// directory, measured beside fio with the same file size, block size, queue depth and O_DIRECT
// on the same file system, in the same run.
#pragma once

#include <cstdint>
#include <filesystem>
#include <string>
#include <vector>

#include "strata/offload/io_engine.h"

namespace strata::bench {

struct IoBenchOptions {
  std::filesystem::path dir = "strata-bench-io";
  uint64_t file_bytes = 1ull << 30;
  uint64_t block_bytes = 1ull << 20;
  unsigned queue_depth = 32;
  offload::IoBackend backend = offload::IoBackend::kAuto;
  std::vector<std::string> patterns{"write", "read", "randwrite", "randread"};
  unsigned repeat = 1;          // runs per pattern and side; the best is reported
  std::string fio = "fio";      // fio executable, or "none" to skip the baseline
  bool keep_files = false;
};

struct IoBenchResult {
  std::string pattern;
  double strata_gbps = 0;  // 1e9 bytes per second
  double fio_gbps = 0;     // 0 if fio did not run
};

// Runs the benchmark, printing progress to stderr and one JSON line per pattern plus a final
// summary JSON line to stdout. Throws on I/O errors or if fio fails.
std::vector<IoBenchResult> run_io_bench(const IoBenchOptions& options);

// One fio run on `file`: `pattern` ("read", "write", "randread", "randwrite") over `bytes` in
// 1 MiB blocks at queue depth 32, io_uring, O_DIRECT. Returns what fio reports in seconds of
// its own clock (process start and file layout excluded). Throws if fio fails.
double fio_seconds(const std::string& fio, const std::filesystem::path& file, uint64_t bytes,
                   const std::string& pattern);

}  // namespace strata::bench
