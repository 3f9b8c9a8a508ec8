#include "io_bench.h"

#include <sys/wait.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <iostream>
#include <mutex>
#include <nlohmann/json.hpp>
#include <numeric>
#include <random>
#include <stdexcept>

#include "shell.h"
#include "strata/offload/file.h"
#include "strata/offload/aligned_buffer.h"

namespace strata::bench {

namespace {

using Clock = std::chrono::steady_clock;
using offload::IoRequest;

bool is_random(const std::string& p) { return p == "randread" || p == "randwrite"; }
bool is_write(const std::string& p) { return p == "write" || p == "randwrite"; }

// Keeps queue_depth blocks in flight, each completion submitting the next block into the same
// buffer slot, like fio's io_uring engine does.
double strata_run(offload::IoEngine& io, const offload::File& file, const IoBenchOptions& o,
                  const std::string& pattern, std::vector<offload::AlignedBuffer>& slots) {
  const uint64_t blocks = o.file_bytes / o.block_bytes;
  std::vector<uint64_t> order(blocks);
  std::iota(order.begin(), order.end(), 0);
  if (is_random(pattern)) std::shuffle(order.begin(), order.end(), std::mt19937_64(42));
  const auto kind = is_write(pattern) ? IoRequest::Kind::kWrite : IoRequest::Kind::kRead;

  // Each slot runs a chain: a completion submits the slot's next block. The run ends when
  // every chain has ended (no block left, or an error), so no continuation outlives the locals.
  std::atomic<uint64_t> next{0};
  std::atomic<bool> failed{false};
  std::mutex mu;
  std::condition_variable cv;
  size_t active_chains = slots.size();
  std::string error;
  std::function<void(size_t)> issue = [&](size_t slot) {
    const uint64_t i = next.fetch_add(1);
    if (i >= blocks || failed) {
      std::lock_guard lock(mu);
      if (--active_chains == 0) cv.notify_all();
      return;
    }
    IoRequest r{kind, &file, order[i] * o.block_bytes, slots[slot].data(), o.block_bytes};
    io.submit({&r, 1})[0].then([&, slot](const offload::IoStatus& s) {
      if (!s.ok()) {
        std::lock_guard lock(mu);
        if (error.empty()) error = s.message();
        failed = true;
      }
      issue(slot);
    });
  };
  const auto t0 = Clock::now();
  for (size_t s = 0; s < slots.size(); ++s) issue(s);
  {
    std::unique_lock lock(mu);
    cv.wait(lock, [&] { return active_chains == 0; });
  }
  if (!error.empty()) throw offload::IoError(EIO, "bench io: " + error);
  const double seconds = std::chrono::duration<double>(Clock::now() - t0).count();
  return static_cast<double>(blocks * o.block_bytes) / seconds / 1e9;
}

// fio runs with the same kind of I/O as the engine: io_uring or, where the engine fell back to
// its thread pool, libaio; O_DIRECT whenever the engine had it.
struct FioMode {
  std::string ioengine = "io_uring";
  bool direct = true;
};

double fio_run(const IoBenchOptions& o, const FioMode& mode, const std::filesystem::path& file,
               const std::string& pattern) {
  const std::string cmd =
      shell_quote(o.fio) + " --name=strata-baseline --filename=" + shell_quote(file.string()) +
      " --size=" + std::to_string(o.file_bytes) + " --bs=" + std::to_string(o.block_bytes) +
      " --iodepth=" + std::to_string(o.queue_depth) + " --rw=" + pattern +
      " --direct=" + (mode.direct ? "1" : "0") + " --ioengine=" + mode.ioengine +
      " --numjobs=1 --randrepeat=1 --output-format=json 2>&1";
  FILE* pipe = popen(cmd.c_str(), "r");
  if (pipe == nullptr) throw std::runtime_error("bench io: cannot run fio: " + cmd);
  std::string out;
  char buf[4096];
  size_t n;
  while ((n = fread(buf, 1, sizeof buf, pipe)) > 0) out.append(buf, n);
  const int status = pclose(pipe);
  if (status != 0) {
    throw std::runtime_error("bench io: fio failed (exit " + std::to_string(WEXITSTATUS(status)) +
                             "): " + cmd + "\n" + out);
  }
  // fio may print notes before the JSON document.
  const auto start = out.find('{');
  if (start == std::string::npos) throw std::runtime_error("bench io: no JSON from fio:\n" + out);
  const auto j = nlohmann::json::parse(out.substr(start));
  const auto& job = j.at("jobs").at(0);
  const double bw = job.at(is_write(pattern) ? "write" : "read").at("bw_bytes").get<double>();
  return bw / 1e9;
}

}  // namespace

double fio_seconds(const std::string& fio, const std::filesystem::path& file, uint64_t bytes,
                   const std::string& pattern) {
  IoBenchOptions o;
  o.fio = fio;
  o.file_bytes = bytes;
  return double(bytes) / 1e9 / fio_run(o, FioMode{}, file, pattern);
}

std::vector<IoBenchResult> run_io_bench(const IoBenchOptions& o) {
  if (o.block_bytes == 0 || o.file_bytes < o.block_bytes || o.file_bytes % o.block_bytes != 0) {
    throw std::invalid_argument("bench io: size must be a positive multiple of the block size");
  }
  for (const auto& p : o.patterns) {
    if (p != "read" && p != "write" && p != "randread" && p != "randwrite") {
      throw std::invalid_argument("bench io: unknown pattern '" + p +
                                  "' (expected read, write, randread, randwrite)");
    }
  }
  std::filesystem::create_directories(o.dir);
  const auto strata_path = o.dir / "strata-io-bench.bin";
  const auto fio_path = o.dir / "fio-io-bench.bin";
  const bool with_fio = o.fio != "none";

  offload::IoEngineConfig cfg;
  cfg.backend = o.backend;
  cfg.queue_depth = o.queue_depth;
  cfg.block_bytes = o.block_bytes;
  auto io = offload::IoEngine::create(cfg);
  offload::AlignedBuffers pool;
  std::vector<offload::AlignedBuffer> slots;
  std::mt19937_64 rng(7);
  for (unsigned i = 0; i < o.queue_depth; ++i) {
    slots.push_back(pool.allocate(o.block_bytes));
    auto* words = reinterpret_cast<uint64_t*>(slots.back().data());
    for (size_t w = 0; w < o.block_bytes / 8; ++w) words[w] = rng();
  }

  FioMode fio_mode;
  if (io->backend() != offload::IoBackend::kIoUring) fio_mode.ioengine = "libaio";
  // Both files are fully written once before measuring, so that every pattern of both sides
  // runs on allocated, written blocks.
  {
    offload::File f = offload::File::open(strata_path, offload::OpenMode::kCreate);
    std::cerr << "bench io: preparing " << o.file_bytes / (1 << 20) << " MiB files in "
              << o.dir.string() << " (" << to_string(io->backend()) << ", "
              << (f.direct() ? "O_DIRECT" : "buffered: no O_DIRECT on this file system")
              << ")\n";
    fio_mode.direct = f.direct();
    strata_run(*io, f, o, "write", slots);
    if (with_fio) fio_run(o, fio_mode, fio_path, "write");
  }

  std::vector<IoBenchResult> results;
  const std::string fio_desc = "fio (" + fio_mode.ioengine + (fio_mode.direct ? ", O_DIRECT)" : ", buffered)");
  nlohmann::json summary = {{"metric", "io_bandwidth_GBps"},
                            {"baseline", with_fio ? fio_desc : "none"},
                            {"backend", to_string(io->backend())},
                            {"dir", std::filesystem::absolute(o.dir).string()},
                            {"file_bytes", o.file_bytes},
                            {"block_bytes", o.block_bytes},
                            {"queue_depth", o.queue_depth}};
  double min_ratio = 1e300;
  for (const auto& pattern : o.patterns) {
    std::cerr << "bench io: " << pattern << " (" << o.repeat << " run(s) per side)" << std::endl;
    IoBenchResult r{pattern};
    offload::File f = offload::File::open(strata_path, offload::OpenMode::kReadWrite);
    for (unsigned rep = 0; rep < o.repeat; ++rep) {
      r.strata_gbps = std::max(r.strata_gbps, strata_run(*io, f, o, pattern, slots));
      if (with_fio) r.fio_gbps = std::max(r.fio_gbps, fio_run(o, fio_mode, fio_path, pattern));
    }
    const double ratio = r.fio_gbps > 0 ? r.strata_gbps / r.fio_gbps : 0;
    nlohmann::json line = {{"metric", "io_" + pattern + "_GBps"},
                           {"value", r.strata_gbps},
                           {"baseline", with_fio ? "fio" : "none"},
                           {"baseline_value", r.fio_gbps},
                           {"ratio", ratio}};
    std::cout << line.dump() << std::endl;
    summary["value"][pattern] = r.strata_gbps;
    summary["baseline_value"][pattern] = r.fio_gbps;
    summary["ratio"][pattern] = ratio;
    min_ratio = std::min(min_ratio, ratio);
    results.push_back(r);
  }
  summary["min_ratio"] = with_fio ? min_ratio : 0.0;
  std::cout << summary.dump() << std::endl;
  if (!o.keep_files) {
    std::filesystem::remove(strata_path);
    std::filesystem::remove(fio_path);
  }
  return results;
}

}  // namespace strata::bench
