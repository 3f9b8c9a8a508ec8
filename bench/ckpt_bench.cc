#include "ckpt_bench.h"

#include <ATen/ATen.h>
#include <fcntl.h>
#include <torch/serialize.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <iostream>
#include <nlohmann/json.hpp>

#include "bench_model.h"
#include "flat_dir.h"
#include "io_bench.h"
#include "shell.h"
#include "timing.h"
#include "strata/engine/checkpoint.h"
#include "strata/engine/checkpoint_store.h"
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

// Tiered saves: the save as the training loop does it (asynchronous local save, then the
// upload), the upload's and the restore's bandwidth, beside boto3 on the same data file.
void run_store_bench(const CkptBenchOptions& o, engine::Engine& eng, engine::Communicator& comm, double bytes) {
  const offload::TransferOptions transfer;  // the defaults a run uses
  std::vector<double> blocked, upload, restore, b_up, b_down;
  const fs::path root = o.dir / "tiered";
  {
    // A fresh server is slow to take its first large upload (its store grows): an untimed one
    // first, so that neither side's first round pays for it.
    auto store = offload::open_object_store(o.store);
    const std::string key = "bench-" + std::to_string(::getpid()) + "-warm-up";
    offload::put_object(*store, key, std::vector<std::byte>(256ull << 20, std::byte{1}), transfer);
    store->remove(key);
  }
  for (unsigned round = 0; round < o.rounds; ++round) {
    std::cerr << "bench ckpt: store round " << round + 1 << "/" << o.rounds << std::endl;
    const std::string name = "bench-" + std::to_string(::getpid()) + "-" + std::to_string(round);
    engine::AsyncCheckpointer async(comm);
    engine::CheckpointUploader up(comm, o.store, transfer);
    double b = async.start(eng, root, name, {0, 0});
    const auto dir = async.finish();  // a run goes on training meanwhile; here it waits
    if (!dir) throw std::runtime_error("bench ckpt: the local save did not commit");
    // Strata and boto3 take turns going first: the store slows as it fills with deleted data it
    // has not collected yet, and the side that always went second would pay for that. Each
    // upload reads the data file from the disk, as after a save (written with direct I/O).
    const fs::path data = *dir / "rank-00000.data";
    const auto run_boto3 = [&] {
      drop_cache(data);
      const std::string cmd = shell_quote(o.python) + " " + shell_quote(o.baseline_script) + " --file " +
                              shell_quote(data.string()) + " --url " + shell_quote(o.store + "/boto3-" + name) +
                              " --part-bytes " + std::to_string(transfer.part_bytes) + " --concurrency " +
                              std::to_string(transfer.concurrency);
      const nlohmann::json r = nlohmann::json::parse(run_capture(cmd, "bench ckpt"));
      b_up.push_back(r["bytes"].get<double>() / r["upload_s"].get<double>() / 1e6);
      b_down.push_back(r["bytes"].get<double>() / r["download_s"].get<double>() / 1e6);
    };
    if (round % 2 == 1) run_boto3();
    drop_cache(data);
    auto t0 = Clock::now();
    up.start(*dir);
    b += seconds_since(t0);
    blocked.push_back(b);
    const auto url = up.finish();
    if (!url) throw std::runtime_error("bench ckpt: " + up.last_error());
    upload.push_back(double(up.last_bytes()) / up.last_seconds() / 1e6);
    t0 = Clock::now();
    engine::load_checkpoint(eng, comm, *url, transfer);
    restore.push_back(bytes / seconds_since(t0) / 1e6);
    if (round % 2 == 0) run_boto3();

    engine::prune_stored_checkpoints(comm, o.store, 1);  // keeps this round's, removed next
    remove_flat_dir(*dir);
    ::unlink((root / "latest").c_str());
  }
  // The last round's stored checkpoint goes too.
  {
    auto store = offload::open_object_store(o.store);
    for (const auto& obj : store->list("bench-" + std::to_string(::getpid()) + "-")) {
      if (obj.key.ends_with("/manifest.json")) store->remove(obj.key);
    }
    for (const auto& obj : store->list("bench-" + std::to_string(::getpid()) + "-")) store->remove(obj.key);
  }
  auto ratio = [](double a, double c) { return c > 0 ? a / c : 0.0; };
  const double u = median(upload), r = median(restore), bu = median(b_up), bd = median(b_down);
  nlohmann::json j = {
      {"metric", "checkpoint_store_MBps"},
      {"store", o.store},
      {"bytes", bytes},
      {"rounds", o.rounds},
      {"part_bytes", transfer.part_bytes},
      {"concurrency", transfer.concurrency},
      {"value", {{"save", u}, {"restore", r}}},
      {"baseline", "boto3 transfer manager, same data file, part size and concurrency (upload_file, download_fileobj)"},
      {"baseline_value", {{"save", bu}, {"restore", bd}}},
      {"ratio", {{"save", ratio(u, bu)}, {"restore", ratio(r, bd)}}},
      {"tiered_blocked_s", median(blocked)},
      {"tiered_blocked_target_s", 0.5},
      {"runs_MBps", {{"save", upload}, {"restore", restore}, {"boto3_save", b_up}, {"boto3_restore", b_down}}}};
  std::cout << j.dump() << std::endl;
}

}  // namespace

void run_ckpt_bench(const CkptBenchOptions& o) {
  fs::create_directories(o.dir);
  models::ModelConfig mc = o.hidden > 0 ? gpt2_shape("gpt2-" + std::to_string(o.hidden), o.layers > 0 ? o.layers : 12,
                                                    o.hidden, std::max<int64_t>(1, o.hidden / 64), o.vocab, 1024)
                                         : models::preset(o.preset);
  if (o.layers > 0) mc.layers = o.layers;
  engine::EngineConfig ec;
  auto comm = engine::Communicator::create(engine::DistEnv{}, std::chrono::seconds(60));
  auto dev = engine::Device::create_host(UINT64_MAX);
  std::cerr << "bench ckpt: building " << mc.name << " (" << mc.parameters() / 1e6
            << "M parameters) in " << o.dir.string() << std::endl;
  engine::Engine eng(std::make_unique<models::Decoder>(mc, 1), ec, *comm, *dev);
  // Non-trivial moments: fill them as a trained model would have them.
  for (size_t u = 0; u < eng.partition().num_units(); ++u) {
    eng.state_slice(u, engine::state::kExpAvg).normal_(0, 1e-3);
    eng.state_slice(u, engine::state::kExpAvgSq).uniform_(0, 1e-6);
  }
  const double bytes = double(mc.parameters()) * 12;
  if (!o.store.empty()) {
    run_store_bench(o, eng, *comm, bytes);
    return;
  }
  const uint64_t fio_bytes = uint64_t(bytes) / (1 << 20) * (1 << 20);
  const bool with_fio = o.fio != "none";
  const fs::path root = o.dir / "strata";
  const fs::path tfile = o.dir / "torch-save.pt";
  const fs::path fio_file = o.dir / "fio-ckpt-bench.bin";

  // Every side runs once per round, round after round, so that a disk whose speed drifts (a
  // virtual disk behind a host cache) moves all of them alike; medians are reported.
  std::vector<double> save, load, tsave, tload, fio_w, fio_w_durable, fio_r;
  std::vector<double> sync_seconds, async_blocked, async_save;
  uint64_t async_staging_peak = 0;
  for (unsigned round = 0; round < o.rounds; ++round) {
    std::cerr << "bench ckpt: round " << round + 1 << "/" << o.rounds << std::endl;
    // Strata: save (synchronous, fsynced, committed), then restore from a cold page cache.
    remove_flat_dir(root / "bench");
    ::unlink((root / "latest").c_str());
    auto t0 = Clock::now();
    const fs::path ck = engine::save_checkpoint(eng, *comm, root, "bench", {0, 0});
    sync_seconds.push_back(seconds_since(t0));
    save.push_back(bytes / sync_seconds.back() / 1e9);
    for (const auto& e : fs::directory_iterator(ck)) drop_cache(e.path());
    t0 = Clock::now();
    engine::load_checkpoint(eng, *comm, ck);
    load.push_back(bytes / seconds_since(t0) / 1e9);
    remove_flat_dir(ck);
    ::unlink((root / "latest").c_str());

    // The same save in the background: what the training thread is blocked for (start), and
    // the save's own time to its commit (the writer copies the host state out through staging
    // buffers, then writes it).
    {
      engine::AsyncCheckpointer async(*comm);
      t0 = Clock::now();
      async_blocked.push_back(async.start(eng, root, "bench-async", {0, 0}));
      async.finish();
      async_save.push_back(bytes / seconds_since(t0) / 1e9);
      async_staging_peak = std::max(async_staging_peak, async.last_report().staging_peak_bytes);
      remove_flat_dir(root / "bench-async");
      ::unlink((root / "latest").c_str());
    }

    // fio: sequential write, then the fsync that makes it as durable as a committed checkpoint
    // (fio's number without it is reported too), then sequential read, 1 MiB, QD32, O_DIRECT.
    if (with_fio) {
      ::unlink(fio_file.c_str());
      const double w = fio_seconds(o.fio, fio_file, fio_bytes, "write");
      t0 = Clock::now();
      fsync_file(fio_file);
      const double sync = seconds_since(t0);
      fio_w.push_back(double(fio_bytes) / w / 1e9);
      fio_w_durable.push_back(double(fio_bytes) / (w + sync) / 1e9);
      fio_r.push_back(double(fio_bytes) / fio_seconds(o.fio, fio_file, fio_bytes, "read") / 1e9);
      ::unlink(fio_file.c_str());
    }

    // torch::save / torch::load of the same slices (fsync included on the save side).
    std::vector<at::Tensor> tensors;
    for (size_t u = 0; u < eng.partition().num_units(); ++u)
      for (int k = 0; k < engine::state::kSavedKinds; ++k)
        tensors.push_back(eng.state_slice(u, engine::state::Kind(k)));
    t0 = Clock::now();
    torch::save(tensors, tfile.string());
    fsync_file(tfile);
    tsave.push_back(bytes / seconds_since(t0) / 1e9);
    drop_cache(tfile);
    std::vector<at::Tensor> back;
    t0 = Clock::now();
    torch::load(back, tfile.string());
    tload.push_back(bytes / seconds_since(t0) / 1e9);
    ::unlink(tfile.c_str());
  }

  const double s = median(save), l = median(load), ts = median(tsave), tl = median(tload);
  const double fw = median(fio_w_durable), fr = median(fio_r), fw_nosync = median(fio_w);
  auto ratio = [](double a, double b) { return b > 0 ? a / b : 0.0; };
  nlohmann::json j = {
      {"metric", "checkpoint_GBps"},
      {"bytes", bytes},
      {"parameters", mc.parameters()},
      {"rounds", o.rounds},
      {"value", {{"save", s}, {"restore", l}}},
      {"baseline", with_fio ? "fio sequential write + fsync / read, 1 MiB, QD32, O_DIRECT, same directory" : "none"},
      {"baseline_value", {{"save", fw}, {"restore", fr}}},
      {"ratio", {{"save", ratio(s, fw)}, {"restore", ratio(l, fr)}}},
      {"fio_write_without_fsync_GBps", fw_nosync},
      {"ratio_save_vs_fio_without_fsync", ratio(s, fw_nosync)},
      {"torch_GBps", {{"save", ts}, {"restore", tl}}},
      {"ratio_vs_torch", {{"save", ratio(s, ts)}, {"restore", ratio(l, tl)}}},
      // The asynchronous save's blocking part beside the synchronous save it replaces.
      {"async", {{"blocked_s", median(async_blocked)}, {"sync_save_s", median(sync_seconds)},
                 {"ratio_blocked_vs_sync", ratio(median(async_blocked), median(sync_seconds))},
                 {"save_GBps", median(async_save)}, {"blocked_target_s", 0.5},
                 {"staging_peak_bytes", async_staging_peak}}},
      {"runs_GBps", {{"save", save}, {"restore", load}, {"fio_write_fsync", fio_w_durable},
                     {"fio_write", fio_w}, {"fio_read", fio_r}, {"torch_save", tsave}, {"torch_load", tload},
                     {"async_save", async_save}}},
                    {"async_blocked_s", async_blocked}};
  std::cout << j.dump() << std::endl;
}

}  // namespace strata::bench
