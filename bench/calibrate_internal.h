// Private to calibrate.cc and calibrate_host.cc: the timing helpers they share and the
// measurements taken once per calibration (RAM, the disk, the collectives between local ranks).
#pragma once

#include <chrono>
#include <cstdint>
#include <string>

namespace strata::bench::calibrate_detail {

using Clock = std::chrono::steady_clock;

// Seconds from t0 to now.
inline double since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

// Bytes of a /proc/meminfo entry ("MemTotal:"), 0 if it has none.
uint64_t meminfo(const char* key);

// The swap space's I/O path: the engine's I/O engine (io_uring, else its thread pool) at its
// default queue depth, direct I/O where the file system allows, 4 MiB requests over `bytes`:
// write (then fsync), read back, then read one half while writing the other (the optimizer's
// swap keeps reads and writes in flight together), bytes/s each.
struct DiskRates {
  double read = 0, write = 0, duplex = 0;
};
DiskRates disk_rates(const std::string& dir, uint64_t bytes, bool& direct);

// The engine's own collectives between two ranks of this machine, as `strata launch` runs them
// (Gloo over loopback TCP): an all-gather and a reduce-scatter of a `bytes` fp32 buffer, each
// rank a thread with its own Communicator. The rate: bytes each rank sends a second (half the
// buffer in each). Gloo's collectives run far below a plain TCP stream between two threads:
// 0.35-0.41 GB/s against 2-3.5 GB/s on the 2-core VM (2026-11-27). The CPU share: the process's
// CPU time over the timed repetitions (both ranks and Gloo's threads) divided by two ranks' wall
// time, the part of a collective that takes a core; the rest is waiting for the other rank
// (0.71-0.76 on an AVX2 VM, 2026-11-28). With --device cuda too: a GPU node's NCCL rate is not
// measured.
struct CollectiveRate {
  double bytes_per_s = 0, cpu_share = 1;
};
CollectiveRate local_collective_rate(uint64_t bytes);

}  // namespace strata::bench::calibrate_detail
