#include "scale_bench.h"

#include "flat_dir.h"

#include <nlohmann/json.hpp>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <iostream>
#include <random>
#include <stdexcept>

#include "checkpoint/catalog.h"
#include "checkpoint/format.h"
#include "strata/engine/partition.h"
#include "strata/models/model_config.h"
#include "strata/models/model_shapes.h"
#include "strata/offload/crc32c.h"

namespace strata::bench {

namespace fs = std::filesystem;
namespace ck = engine::ckpt;
using nlohmann::json;

namespace {

// The model's units as the engine cuts it (whole blocks), one flat tensor each.
engine::Partition model_partition(const models::ModelConfig& mc, int world) {
  std::vector<std::pair<std::string, std::vector<engine::TensorSpec>>> specs;
  const std::vector<uint64_t> params = models::stage_parameters(mc);
  for (size_t s = 0; s < params.size(); ++s) {
    if (params[s] == 0) continue;
    const std::string name = models::stage_name(mc, {}, s);
    specs.push_back({name, {engine::TensorSpec{name + ".flat", {int64_t(params[s])}, {}}}});
  }
  return engine::Partition(specs, world);
}

json manifest_head(const models::ModelConfig& mc, const engine::Partition& part) {
  return {{"kind", "strata-checkpoint"},
          {"world_size", part.world_size()},
          {"model", json::parse(mc.to_hf_json("float32"))},
          {"units", ck::partition_json(part)},
          {"state_kinds", {"master", "exp_avg", "exp_avg_sq"}},
          {"counters", {{"optimizer_step", 100}, {"loss_scale", 1.0}, {"good_steps", 0}}},
          {"train_steps", 100},
          {"samples_consumed", 51200},
          {"global_batch", 512}};
}

struct Written {
  uint64_t manifest_bytes = 0, index_bytes = 0, chunks = 0;
};

// Format 3, as save.cc writes it: a slice per (unit, kind) a rank holds, its chunks one after the
// other in the data file (not written), CRCs random.
Written write_format3(const fs::path& dir, const models::ModelConfig& mc, const engine::Partition& part) {
  fs::create_directories(dir);
  std::mt19937 rng(5);
  Written w;
  json ranks = json::array();
  for (int q = 0; q < part.world_size(); ++q) {
    std::vector<ck::SliceRecord> slices;
    uint64_t offset = 0;
    for (size_t u = 0; u < part.num_units(); ++u)
      for (int k = 0; k < 3; ++k) {
        const uint64_t valid = part.unit(u).shard_valid_numel(q);
        if (valid == 0) continue;
        ck::SliceRecord s{u, k, offset, {}};
        for (uint64_t e = 0; e < valid; e += ck::kChunkElements) {
          s.crc32c.push_back(uint32_t(rng()));
          offset += ck::chunk_extent(std::min(ck::kChunkElements, valid - e));
        }
        w.chunks += s.crc32c.size();
        slices.push_back(std::move(s));
      }
    const std::string index = ck::index_text(q, ck::kChunkElements, slices);
    std::ofstream(dir / (ck::rank_name(q) + ".index.json"), std::ios::binary) << index;
    w.index_bytes += index.size();
    ranks.push_back({{"data_bytes", offset}, {"index_bytes", index.size()},
                     {"index_crc32c", offload::crc32c(index.data(), index.size())}});
  }
  json m = manifest_head(mc, part);
  m["format"] = 3;
  json shards = json::array();
  for (size_t u = 0; u < part.num_units(); ++u) shards.push_back(part.unit(u).shard_numel);
  m["shards"] = shards;
  m["chunk_elements"] = ck::kChunkElements;
  m["ranks"] = ranks;
  const std::string text = m.dump(1);
  std::ofstream(dir / "manifest.json", std::ios::binary) << text;
  w.manifest_bytes = text.size();
  return w;
}

// Format 2, as the binaries before format 3 wrote it: the same chunks, each listed in the manifest
// (compact JSON; they wrote it indented, which is larger).
uint64_t write_format2(const fs::path& dir, const models::ModelConfig& mc, const engine::Partition& part) {
  fs::create_directories(dir);
  json m = manifest_head(mc, part);
  m["format"] = 2;
  std::string head = m.dump();
  head.pop_back();  // the closing brace: the chunk list goes before it
  std::ofstream out(dir / "manifest.json", std::ios::binary);
  out << head << ",\"chunks\":[";
  std::mt19937 rng(5);
  static const char* kKinds[] = {"master", "exp_avg", "exp_avg_sq"};
  uint64_t bytes = head.size() + 12;
  bool first = true;
  char line[320];
  for (int q = 0; q < part.world_size(); ++q) {
    uint64_t offset = 0;
    for (size_t u = 0; u < part.num_units(); ++u)
      for (int k = 0; k < 3; ++k) {
        const engine::UnitLayout& L = part.unit(u);
        const uint64_t valid = L.shard_valid_numel(q);
        for (uint64_t e = 0; e < valid; e += ck::kChunkElements) {
          const uint64_t n = std::min(ck::kChunkElements, valid - e);
          const int len = std::snprintf(
              line, sizeof line,
              "%s{\"begin\":%llu,\"crc32c\":%u,\"file\":\"rank-%05d.data\",\"kind\":\"%s\",\"numel\":%llu,"
              "\"offset\":%llu,\"rank\":%d,\"unit\":%zu}",
              first ? "" : ",", static_cast<unsigned long long>(L.shard_begin(q) + e), unsigned(rng()), q, kKinds[k],
              static_cast<unsigned long long>(n), static_cast<unsigned long long>(offset), q, u);
          out.write(line, len);
          bytes += uint64_t(len);
          first = false;
          offset += ck::chunk_extent(n);
        }
      }
  }
  out << "]}";
  return bytes;
}

struct Reading {
  uint64_t bytes = 0, chunks = 0, peak_rss = 0;
  double seconds = 0;
  uint64_t rss_before = 0;  // the reading process's resident bytes before it read anything
  double added_mib() const { return (double(peak_rss) - double(rss_before)) / 1048576.0; }
};

// Runs this program's `bench scale --read-metadata DIR --rank R` in a fresh process: its output
// (the bytes it read, its seconds, its resident bytes before and at the peak of the reading).
Reading read_in_child(const fs::path& dir, int rank) {
  int fds[2];
  if (::pipe(fds) != 0) throw std::runtime_error("bench scale: pipe failed");
  const std::string dir_s = dir.string(), rank_s = std::to_string(rank);
  const pid_t pid = ::fork();
  if (pid < 0) throw std::runtime_error("bench scale: fork failed");
  if (pid == 0) {
    ::dup2(fds[1], 1);
    ::close(fds[0]);
    ::close(fds[1]);
    const char* argv[] = {"strata", "bench", "scale", "--read-metadata", dir_s.c_str(), "--rank", rank_s.c_str(), nullptr};
    ::execv("/proc/self/exe", const_cast<char* const*>(argv));
    ::_exit(127);
  }
  ::close(fds[1]);
  std::string out;
  char buf[4096];
  for (ssize_t n; (n = ::read(fds[0], buf, sizeof buf)) > 0;) out.append(buf, size_t(n));
  ::close(fds[0]);
  int status = 0;
  ::waitpid(pid, &status, 0);
  if (!WIFEXITED(status) || WEXITSTATUS(status) != 0)
    throw std::runtime_error("bench scale: reading " + dir_s + " failed: " + out);
  const json j = json::parse(out.substr(out.rfind('{')));
  return {j["bytes"].get<uint64_t>(), j["chunks"].get<uint64_t>(), j["rss_peak"].get<uint64_t>(),
          j["seconds"].get<double>(), j["rss_before"].get<uint64_t>()};
}

}  // namespace

// This process's resident bytes (`what`: "VmRSS:" now, "VmHWM:" the peak), from /proc/self/status.
uint64_t resident_bytes(const std::string& what) {
  std::ifstream in("/proc/self/status");
  std::string key;
  uint64_t kb = 0;
  while (in >> key) {
    if (key == what) {
      in >> kb;
      return kb * 1024;
    }
    std::getline(in, key);
  }
  return 0;
}

int read_metadata_as_a_load(const fs::path& dir, int rank) {
  // The peak is reset first (clear_refs 5), so that the peak below is the reading's: the
  // program's own pages (libtorch's among them) plus what the reading adds.
  std::ofstream("/proc/self/clear_refs") << "5";
  const uint64_t rss_before = resident_bytes("VmRSS:");
  const auto t0 = std::chrono::steady_clock::now();
  const std::string text = ck::read_text(dir / "manifest.json");
  const json m = ck::parse_manifest(text, dir.string());
  // As a load: the units (and the whole tensors they hold) checked, this rank's slices at the
  // saved world size, every chunk overlapping them placed (format 3: its saving rank's index read).
  const std::vector<ck::ManifestTensor> tensors = ck::manifest_tensors(m["units"], dir.string());
  ck::check_whole_coverage(tensors, dir.string());
  std::vector<std::pair<std::string, std::vector<engine::TensorSpec>>> specs;
  for (const ck::ManifestTensor& t : tensors) {
    if (specs.size() <= t.unit) specs.resize(t.unit + 1);
    specs[t.unit].first = m["units"][t.unit]["name"].get<std::string>();
    specs[t.unit].second.push_back({t.slot.name, t.slot.shape, t.slot.origin});
  }
  const engine::Partition part(specs, m["world_size"].get<int>());
  ck::ChunkCatalog catalog(dir, m);
  uint64_t chunks = 0;
  for (size_t u = 0; u < part.num_units(); ++u) {
    const engine::UnitLayout& L = part.unit(u);
    for (int k = 0; k < 3; ++k)
      for (const ck::Chunk& c : catalog.overlapping(u, k, L.shard_begin(rank), L.shard_begin(rank) + L.shard_valid_numel(rank))) {
        catalog.place(c);
        ++chunks;
      }
  }
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  std::cout << json{{"bytes", text.size() + catalog.index_bytes_read()}, {"seconds", seconds}, {"chunks", chunks},
                    {"rss_before", rss_before}, {"rss_peak", resident_bytes("VmHWM:")}}.dump()
            << std::endl;
  return 0;
}

void run_scale_bench(const ScaleBenchOptions& o) {
  if (o.saved_worlds.empty()) throw std::invalid_argument("bench scale: no world sizes");
  run_world_scaling(o);
  const json many_ranks = run_many_rank_tests(o);
  const models::ModelConfig mc = models::preset(o.preset);
  std::string tag = o.preset;
  if (tag.rfind("gpt-", 0) == 0) tag = tag.substr(4);
  std::cout << "checkpoint metadata of " << o.preset << " (" << mc.parameters() / 1e9
            << "B parameters), read as rank world/2 of a load at the saved world size does\n";
  struct Row {
    int world;
    Written written;
    Reading read;
  };
  std::vector<Row> rows;
  for (int world : o.saved_worlds) {
    const engine::Partition part = model_partition(mc, world);
    const fs::path dir = o.dir / ("format3-" + std::to_string(world));
    remove_flat_dir(dir);
    const Written w = write_format3(dir, mc, part);
    const Reading r = read_in_child(dir, world / 2);
    remove_flat_dir(dir);
    std::printf("  format 3, saved by %5d ranks: %zu units, %llu chunks; manifest %.2f MB, index files %.2f MB in all; "
                "a rank's load reads %.3f MB (%llu chunks placed) in %.3f s, peak RSS %.0f MiB (%.0f MiB above the "
                "program's own before reading)\n",
                world, part.num_units(), static_cast<unsigned long long>(w.chunks), w.manifest_bytes / 1e6,
                w.index_bytes / 1e6, r.bytes / 1e6, static_cast<unsigned long long>(r.chunks), r.seconds,
                r.peak_rss / 1048576.0, r.added_mib());
    rows.push_back({world, w, r});
  }
  for (size_t i = 1; i < rows.size(); ++i)
    std::printf("  growth from %d to %d ranks (exponent of the world size): per-rank load bytes %.2f, load seconds "
                "%.2f, whole checkpoint's metadata %.2f\n",
                rows[0].world, rows[i].world,
                growth_exponent({double(rows[0].world), double(rows[i].world)},
                                {double(rows[0].read.bytes), double(rows[i].read.bytes)}),
                growth_exponent({double(rows[0].world), double(rows[i].world)},
                                {rows[0].read.seconds, rows[i].read.seconds}),
                growth_exponent({double(rows[0].world), double(rows[i].world)},
                                {double(rows[0].written.manifest_bytes + rows[0].written.index_bytes),
                                 double(rows[i].written.manifest_bytes + rows[i].written.index_bytes)}));
  const Row& first = rows.front();
  json line = {{"metric", "load_metadata_bytes_per_rank_" + tag + "_" + std::to_string(first.world)},
               {"value", first.read.bytes},
               {"seconds", first.read.seconds},
               {"peak_rss_bytes", first.read.peak_rss},
               {"rss_added_bytes", first.read.peak_rss - std::min(first.read.peak_rss, first.read.rss_before)},
               {"whole_metadata_bytes", first.written.manifest_bytes + first.written.index_bytes}};
  if (o.baseline) {
    const engine::Partition part = model_partition(mc, first.world);
    const fs::path dir = o.dir / ("format2-" + std::to_string(first.world));
    remove_flat_dir(dir);
    const uint64_t bytes = write_format2(dir, mc, part);
    const Reading r = read_in_child(dir, first.world / 2);
    remove_flat_dir(dir);
    std::printf("  format 2, saved by %5d ranks: manifest %.1f MB (every chunk listed; every rank receives and "
                "parses it) read in %.2f s, peak RSS %.0f MiB (%.0f MiB above the program's own)\n",
                first.world, bytes / 1e6, r.seconds, r.peak_rss / 1048576.0, r.added_mib());
    line["baseline"] = "format 2: the manifest listing every chunk, which every rank received and parsed";
    line["baseline_value"] = r.bytes;
    line["baseline_seconds"] = r.seconds;
    line["baseline_peak_rss_bytes"] = r.peak_rss;
    line["baseline_rss_added_bytes"] = r.peak_rss - std::min(r.peak_rss, r.rss_before);
    line["ratio"] = double(first.read.bytes) / double(r.bytes);
  }
  if (!many_ranks.is_null()) line["ranks32_tests"] = many_ranks;
  ::rmdir(o.dir.c_str());
  std::cout << line.dump() << std::endl;
}

}  // namespace strata::bench
