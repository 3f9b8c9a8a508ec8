#include "ckpt_bench.h"

#include <ATen/ATen.h>
#include <fcntl.h>
#include <torch/serialize.h>
#include <unistd.h>

#include <chrono>
#include <iostream>
#include <nlohmann/json.hpp>

#include "io_bench.h"
#include "strata/engine/checkpoint.h"
#include "strata/engine/comm.h"
#include "strata/engine/device.h"
#include "strata/engine/engine.h"

namespace strata::bench {
namespace {

namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

// Drops a file's pages from the page cache (it was fsynced), so that a read comes from the disk.
void drop_cache(const fs::path& p) {
  int fd = ::open(p.c_str(), O_RDONLY);
  if (fd < 0) return;
  ::fdatasync(fd);
  ::posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED);
  ::close(fd);
}

void fsync_file(const fs::path& p) {
  int fd = ::open(p.c_str(), O_RDONLY);
  if (fd < 0) throw std::runtime_error("bench ckpt: cannot open " + p.string());
  ::fsync(fd);
  ::close(fd);
}

// Removes a flat directory (std::filesystem::remove_all must not be called in binaries that link
// libtorch: docs/ARCHITECTURE.md, Build).
void remove_flat_dir(const fs::path& d) {
  if (!fs::exists(d)) return;
  for (const auto& e : fs::directory_iterator(d)) ::unlink(e.path().c_str());
  ::rmdir(d.c_str());
}

}  // namespace

void run_ckpt_bench(const CkptBenchOptions& o) {
  fs::create_directories(o.dir);
  models::ModelConfig mc = models::preset(o.preset);
  if (o.layers > 0) mc.layers = o.layers;
  engine::EngineConfig ec;
  auto comm = engine::Communicator::create(engine::DistEnv{}, std::chrono::seconds(60));
  auto dev = engine::Device::create_host(UINT64_MAX);
  std::cerr << "bench ckpt: building " << mc.name << " (" << mc.parameters() / 1e6
            << "M parameters) in " << o.dir.string() << std::endl;
  engine::Engine eng(std::make_unique<models::Decoder>(mc, 1), ec, *comm, *dev);
  // Non-trivial moments: fill them as a trained model would have them.
  for (size_t u = 0; u < eng.partition().num_units(); ++u) {
    eng.state_slice(u, engine::Engine::StateKind::kExpAvg).normal_(0, 1e-3);
    eng.state_slice(u, engine::Engine::StateKind::kExpAvgSq).uniform_(0, 1e-6);
  }
  const double bytes = double(mc.parameters()) * 12;

  // Strata: save (synchronous, fsynced, committed), then restore from a cold page cache.
  const fs::path root = o.dir / "strata";
  remove_flat_dir(root / "bench");
  ::unlink((root / "latest").c_str());
  auto t0 = Clock::now();
  const fs::path ck = engine::save_checkpoint(eng, *comm, root, "bench", {0, 0});
  const double save_s = seconds_since(t0);
  for (const auto& e : fs::directory_iterator(ck)) drop_cache(e.path());
  t0 = Clock::now();
  engine::load_checkpoint(eng, *comm, ck);
  const double load_s = seconds_since(t0);

  // torch::save / torch::load of the same slices (fsync included on the save side).
  std::vector<at::Tensor> tensors;
  for (size_t u = 0; u < eng.partition().num_units(); ++u)
    for (int k = 0; k < engine::Engine::kStateKinds; ++k)
      tensors.push_back(eng.state_slice(u, engine::Engine::StateKind(k)));
  const fs::path tfile = o.dir / "torch-save.pt";
  t0 = Clock::now();
  torch::save(tensors, tfile.string());
  fsync_file(tfile);
  const double tsave_s = seconds_since(t0);
  drop_cache(tfile);
  std::vector<at::Tensor> back;
  t0 = Clock::now();
  torch::load(back, tfile.string());
  const double tload_s = seconds_since(t0);
  fs::remove(tfile);
  remove_flat_dir(ck);
  ::unlink((root / "latest").c_str());

  // fio on the same directory: sequential write and read, 1 MiB, QD32.
  double fio_w = 0, fio_r = 0;
  if (o.fio != "none") {
    IoBenchOptions io;
    io.dir = o.dir / "fio";
    io.file_bytes = uint64_t(bytes) / (1 << 20) * (1 << 20);
    io.patterns = {"write", "read"};
    io.fio = o.fio;
    for (const IoBenchResult& r : run_io_bench(io))
      (r.pattern == "write" ? fio_w : fio_r) = r.fio_gbps;
  }
  const double save = bytes / save_s / 1e9, load = bytes / load_s / 1e9;
  const double tsave = bytes / tsave_s / 1e9, tload = bytes / tload_s / 1e9;
  nlohmann::json j = {
      {"metric", "checkpoint_GBps"},
      {"bytes", bytes},
      {"parameters", mc.parameters()},
      {"value", {{"save", save}, {"restore", load}}},
      {"baseline", o.fio != "none" ? "fio sequential write/read, 1 MiB, QD32, same directory" : "none"},
      {"baseline_value", {{"save", fio_w}, {"restore", fio_r}}},
      {"ratio", {{"save", fio_w > 0 ? save / fio_w : 0}, {"restore", fio_r > 0 ? load / fio_r : 0}}},
      {"torch_GBps", {{"save", tsave}, {"restore", tload}}},
      {"ratio_vs_torch", {{"save", save / tsave}, {"restore", load / tload}}}};
  std::cout << j.dump() << std::endl;
}

}  // namespace strata::bench
