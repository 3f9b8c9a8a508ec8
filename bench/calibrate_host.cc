// `strata plan --calibrate`'s measurements of the machine around the compute device, taken once
// per calibration: RAM (/proc/meminfo), the disk through the engine's I/O engine, and the
// engine's collectives between two local ranks. See calibrate_internal.h.
#include <ATen/ATen.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <exception>
#include <filesystem>
#include <fstream>
#include <memory>
#include <span>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "calibrate_internal.h"
#include "strata/engine/comm.h"
#include "strata/offload/file.h"
#include "strata/offload/io_engine.h"

namespace strata::bench::calibrate_detail {

uint64_t meminfo(const char* key) {
  std::ifstream in("/proc/meminfo");
  std::string k, unit;
  uint64_t kb = 0;
  while (in >> k >> kb >> unit)
    if (k == key) return kb * 1024;
  return 0;
}

DiskRates disk_rates(const std::string& dir, uint64_t bytes, bool& direct) {
  const std::filesystem::path path = std::filesystem::path(dir) / ".strata-calibrate.tmp";
  constexpr size_t kBlock = 4 << 20;
  bytes = std::max<uint64_t>(2 * kBlock, bytes / (2 * kBlock) * (2 * kBlock));
  auto io = offload::IoEngine::create();
  offload::File f = offload::File::open(path, offload::OpenMode::kTruncate);
  direct = f.direct();
  void* raw = nullptr;
  if (posix_memalign(&raw, 4096, 2 * kBlock)) throw std::bad_alloc();
  std::unique_ptr<void, decltype(&std::free)> buf(raw, &std::free);
  std::memset(raw, 0x5a, 2 * kBlock);
  const std::span<std::byte> out(static_cast<std::byte*>(raw), kBlock),
      in(static_cast<std::byte*>(raw) + kBlock, kBlock);
  enum class Mode { kWrite, kRead, kBoth };
  const auto run = [&](Mode mode) {
    std::vector<offload::IoFuture> pending;
    const auto t0 = Clock::now();
    for (uint64_t i = 0; i < bytes / kBlock; ++i) {
      if (mode != Mode::kBoth) {
        pending.push_back(mode == Mode::kWrite ? io->write(f, i * kBlock, out) : io->read(f, i * kBlock, in));
        continue;
      }
      // Together: a read of the first half, then a write of the second, alternately.
      const uint64_t at = i / 2 * kBlock;
      pending.push_back(i % 2 ? io->write(f, bytes / 2 + at, out) : io->read(f, at, in));
    }
    for (const offload::IoFuture& p : pending) p.get();
    if (mode != Mode::kRead && !direct) f.sync();  // direct writes have reached the device, as swap writes do
    return double(bytes) / since(t0);
  };
  DiskRates r;
  r.write = run(Mode::kWrite);
  r.read = run(Mode::kRead);
  r.duplex = run(Mode::kBoth);
  std::filesystem::remove(path);
  return r;
}

namespace {

double process_cpu_seconds() {
  timespec t{};
  if (clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &t) != 0) throw std::runtime_error(std::string("calibrate: clock_gettime: ") + std::strerror(errno));
  return double(t.tv_sec) + 1e-9 * double(t.tv_nsec);
}

}  // namespace

CollectiveRate local_collective_rate(uint64_t bytes) {
  const int port = engine::free_loopback_port();
  const int64_t n = int64_t(bytes / 8) * 2;  // even
  constexpr int kReps = 3;
  std::array<double, 2> seconds{};
  double cpu = 0;  // the process's CPU seconds over the timed repetitions (rank 0 reads it)
  std::array<std::exception_ptr, 2> error;
  const auto rank_main = [&](int r) {
    try {
      engine::DistEnv env;
      env.rank = env.local_rank = r;
      env.world_size = env.local_world_size = 2;
      env.master_addr = "127.0.0.1";
      env.master_port = port;
      const auto comm = engine::Communicator::create(env, std::chrono::seconds(120));
      at::Tensor full = at::ones({n}), shard = at::empty({n / 2});
      const auto once = [&] {
        comm->all_gather(full, full.narrow(0, r * (n / 2), n / 2))->wait();
        comm->reduce_scatter(shard, full)->wait();
      };
      once();  // connections made, buffers allocated
      comm->barrier();
      // Rank 0 reads the process's clock and the wall clock between the same two barriers, so
      // the CPU time and the time it is divided by cover the same window.
      const double cpu0 = process_cpu_seconds();
      const auto t0 = Clock::now();
      for (int i = 0; i < kReps; ++i) once();
      comm->barrier();  // both ranks done
      seconds[size_t(r)] = since(t0) / kReps;
      if (r == 0) cpu = process_cpu_seconds() - cpu0;
    } catch (...) {
      error[size_t(r)] = std::current_exception();
    }
  };
  std::thread other(rank_main, 1);
  rank_main(0);
  other.join();
  for (const std::exception_ptr& e : error)
    if (e) std::rethrow_exception(e);
  CollectiveRate out;
  out.bytes_per_s = 2.0 * double(n / 2) * 4 / std::max(seconds[0], seconds[1]);
  out.cpu_share = std::clamp(cpu / (2 * seconds[0] * kReps), 0.05, 1.0);
  return out;
}

}  // namespace strata::bench::calibrate_detail
