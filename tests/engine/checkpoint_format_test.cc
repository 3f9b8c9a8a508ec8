// Checkpoint format 3 (docs/FORMATS.md): the chunks follow from the manifest's shards, where they
// lie and their CRCs are in one index file per saving rank, read only for the ranks a reader reads
// and checked against the manifest; the formats before it still load, verify and export.
#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <array>
#include <set>
#include <algorithm>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "checkpoint/catalog.h"
#include "checkpoint/chunk_reader.h"
#include "checkpoint/exchange.h"
#include "checkpoint/format.h"
#include "checkpoint_trainer.h"
#include "saved_chunks.h"
#include "strata/engine/config_parse.h"
#include "strata/engine/checkpoint.h"
#include "strata/models/decoder.h"
#include "strata/models/hf_io.h"
#include "strata/models/safetensors.h"
#include "strata/offload/crc32c.h"
#include "test_util.h"

namespace se = strata::engine;
namespace sm = strata::models;
namespace ck = strata::engine::ckpt;
namespace fs = std::filesystem;
using nlohmann::json;
using strata::test::Losses;
using strata::test::TempDir;
using strata::test::read_file;
using strata::test::error_of;
using strata::test::Trainer;
using strata::test::expect_bitwise;
using strata::test::tiny_llama;

namespace {

constexpr int kKinds = 3;

void spit(const fs::path& p, const std::string& text) { std::ofstream(p, std::ios::binary) << text; }
std::string index_name(int q) { return ck::rank_name(q) + ".index.json"; }

// A format 3 checkpoint written by hand from the format's description, with small chunks so that
// slices have several: units of `numels` elements, `world` saving ranks, random values.
struct Synthetic {
  json manifest;
  std::vector<uint64_t> shard;
  std::vector<std::vector<std::vector<float>>> values;  // [unit][kind]: the unit's elements
  uint64_t data_bytes = 0;                             // all ranks' data files
};

Synthetic write_synthetic(const fs::path& dir, const std::vector<uint64_t>& numels, int world, uint64_t chunk) {
  Synthetic s;
  std::mt19937 rng(11);
  std::uniform_real_distribution<float> dist(-1, 1);
  json units = json::array(), ranks = json::array();
  for (size_t u = 0; u < numels.size(); ++u) {
    units.push_back({{"name", "unit" + std::to_string(u)}, {"numel", numels[u]},
                     {"tensors", {{{"name", "t" + std::to_string(u)}, {"shape", {numels[u]}}}}}});
    s.shard.push_back((numels[u] + uint64_t(world) - 1) / uint64_t(world) / 8 * 8 + 8);  // aligned to 8, padded
    s.values.emplace_back();
    for (int k = 0; k < kKinds; ++k) {
      s.values[u].emplace_back(numels[u]);
      for (float& x : s.values[u][size_t(k)]) x = dist(rng);
    }
  }
  for (int q = 0; q < world; ++q) {
    std::string data;
    std::vector<ck::SliceRecord> slices;
    for (size_t u = numels.size(); u-- > 0;)  // in another order than the units': readers go by offsets
      for (int k = 0; k < kKinds; ++k) {
        const uint64_t b = uint64_t(q) * s.shard[u];
        if (b >= numels[u]) continue;
        const uint64_t valid = std::min(s.shard[u], numels[u] - b);
        ck::SliceRecord r{u, k, data.size(), {}};
        for (uint64_t e = 0; e < valid; e += chunk) {
          const uint64_t n = std::min(chunk, valid - e);
          const float* from = s.values[u][size_t(k)].data() + b + e;
          r.crc32c.push_back(strata::offload::crc32c(from, n * 4));
          std::string bytes(reinterpret_cast<const char*>(from), n * 4);
          bytes.resize(ck::chunk_extent(n), '\0');
          data += bytes;
        }
        slices.push_back(std::move(r));
      }
    spit(dir / (ck::rank_name(q) + ".data"), data);
    s.data_bytes += data.size();
    const std::string index = ck::index_text(q, chunk, slices);
    spit(dir / index_name(q), index);
    ranks.push_back({{"data_bytes", data.size()}, {"index_bytes", index.size()},
                     {"index_crc32c", strata::offload::crc32c(index.data(), index.size())}});
  }
  s.manifest = {{"format", 3}, {"kind", "strata-checkpoint"}, {"world_size", world}, {"model", json::object()},
                {"units", units}, {"shards", s.shard}, {"chunk_elements", chunk}, {"ranks", ranks},
                {"state_kinds", {"master", "exp_avg", "exp_avg_sq"}},
                {"counters", {{"optimizer_step", 1}, {"loss_scale", 1.0}, {"good_steps", 0}}},
                {"train_steps", 1}, {"samples_consumed", 8}, {"global_batch", 8}};
  spit(dir / "manifest.json", s.manifest.dump(1));
  return s;
}

// Reads `chunks` through the catalog and checks every element against the values written.
void expect_values(ck::ChunkCatalog& catalog, const fs::path& dir, const std::vector<ck::Chunk>& chunks,
                   const Synthetic& s) {
  ck::ChunkReader reader(dir, catalog);
  std::vector<std::vector<float>> got;
  std::vector<ck::ChunkReader::Request> batch;
  got.reserve(chunks.size());
  for (const ck::Chunk& c : chunks) {
    got.emplace_back(c.numel);
    batch.push_back({c, got.back().data()});
  }
  reader.read(batch, 4);
  for (size_t i = 0; i < chunks.size(); ++i)
    ASSERT_EQ(std::memcmp(got[i].data(), s.values[chunks[i].unit][size_t(chunks[i].kind)].data() + chunks[i].begin,
                          chunks[i].numel * 4),
              0)
        << catalog.name(chunks[i]);
}

// Units of awkward sizes over 5 ranks: one so small that only rank 0 holds any of it, slices of
// one partial chunk and of several.
const std::vector<uint64_t> kNumels = {5, 1000, 12345, 777};

TEST(CheckpointCatalog, ChunksFollowFromTheShardsAndOnlyTheRanksReadHaveTheirIndexRead) {
  TempDir dir;
  const Synthetic s = write_synthetic(dir.path(), kNumels, 5, 300);
  ck::ChunkCatalog catalog(dir.path(), ck::parse_manifest(read_file(dir / "manifest.json"), "test"));
  uint64_t count = 0;
  for (size_t u = 0; u < kNumels.size(); ++u)
    for (int k = 0; k < kKinds; ++k) {
      uint64_t next = 0;
      for (const ck::Chunk& c : catalog.chunks(u, k)) {
        EXPECT_EQ(c.begin, next) << catalog.name(c);
        EXPECT_EQ(uint64_t(c.rank), c.begin / s.shard[u]) << catalog.name(c);
        EXPECT_LE(c.numel, 300u);
        EXPECT_LE(c.end(), uint64_t(c.rank + 1) * s.shard[u]) << "a chunk crosses its rank's slice";
        next = c.end();
        ++count;
      }
      EXPECT_EQ(next, kNumels[u]);
    }
  EXPECT_EQ(catalog.chunk_count(), count);
  EXPECT_EQ(catalog.index_bytes_read(), 0u) << "the chunks' places need no index";

  // Rank 3's slices, and a range straddling ranks 1 and 2 of unit 2: only those ranks' indexes.
  std::vector<ck::Chunk> of_3;
  for (size_t u = 0; u < kNumels.size(); ++u)
    for (int k = 0; k < kKinds; ++k)
      for (const ck::Chunk& c : catalog.overlapping(u, k, 3 * s.shard[u], 4 * s.shard[u])) of_3.push_back(c);
  ASSERT_FALSE(of_3.empty());
  expect_values(catalog, dir.path(), of_3, s);
  EXPECT_EQ(catalog.index_bytes_read(), fs::file_size(dir / index_name(3)));
  expect_values(catalog, dir.path(), catalog.overlapping(2, 1, 2 * s.shard[2] - 10, 2 * s.shard[2] + 10), s);
  EXPECT_EQ(catalog.index_bytes_read(),
            fs::file_size(dir / index_name(3)) + fs::file_size(dir / index_name(1)) + fs::file_size(dir / index_name(2)));

  // verify reads every chunk, rank by rank; describe counts them without reading an index.
  uint64_t elements = 0;
  for (uint64_t n : kNumels) elements += n * kKinds;
  EXPECT_EQ(se::verify_checkpoint(dir.path()), elements * 4);
  const std::string described = se::describe_checkpoint(dir.path());
  EXPECT_NE(described.find("format 3, saved by 5 ranks"), std::string::npos) << described;
  EXPECT_NE(described.find(std::to_string(count) + " chunks"), std::string::npos) << described;
}


TEST(CheckpointCatalog, AnIndexFileThatIsNotTheSavedOneIsRefusedNamingIt) {
  TempDir dir;
  const Synthetic s = write_synthetic(dir.path(), kNumels, 5, 300);
  const auto read_rank = [&](int q) {
    ck::ChunkCatalog catalog(dir.path(), ck::parse_manifest(read_file(dir / "manifest.json"), "test"));
    expect_values(catalog, dir.path(), catalog.of_rank(q), s);
  };
  const std::string good = read_file(dir / index_name(2));

  // One changed digit of one CRC: the manifest's CRC of the index catches it before any data.
  std::string bad = good;
  bad[bad.rfind('"') - 1] = bad[bad.rfind('"') - 1] == '0' ? '1' : '0';
  spit(dir / index_name(2), bad);
  std::string why = error_of([&] { read_rank(2); });
  EXPECT_NE(why.find("index file rank-00002.index.json is not the one saved"), std::string::npos) << why;
  EXPECT_NE(error_of([&] { se::verify_checkpoint(dir.path()); }).find("rank-00002.index.json"), std::string::npos);
  read_rank(1);  // the other ranks' metadata is untouched, and read alone

  // Missing.
  fs::remove(dir / index_name(2));
  why = error_of([&] { read_rank(2); });
  EXPECT_NE(why.find("index file rank-00002.index.json is missing"), std::string::npos) << why;

  // An index that matches the manifest's record but not the slices: one CRC too few for unit 2.
  json index = json::parse(good);
  for (json& slice : index["slices"])
    if (slice[0] == 2 && slice[1] == 0) slice[3] = slice[3].get<std::string>().substr(8);
  const std::string edited = index.dump();
  spit(dir / index_name(2), edited);
  json m = s.manifest;
  m["ranks"][2]["index_bytes"] = edited.size();
  m["ranks"][2]["index_crc32c"] = strata::offload::crc32c(edited.data(), edited.size());
  spit(dir / "manifest.json", m.dump());
  why = error_of([&] { read_rank(2); });
  EXPECT_NE(why.find("rank-00002.index.json: unit unit2 master has"), std::string::npos) << why;

  // A data file shorter than the manifest says is one this rank does not see (a load then asks
  // the rank that does); reading it is an error naming the chunk.
  spit(dir / index_name(2), good);
  spit(dir / "manifest.json", s.manifest.dump());
  read_rank(2);
  fs::resize_file(dir / (ck::rank_name(4) + ".data"), 4096);
  why = error_of([&] { read_rank(4); });
  EXPECT_NE(why.find("rank-00004.data at offset"), std::string::npos) << why;
}

// A checkpoint written by a binary of format 2 (the chunk list in the manifest, index files
// without units) still loads bitwise, verifies and exports alike. It is made from a format 3 save
// by the format's second reader (saved_chunks.h), as format 2 wrote it.
TEST(Checkpoint, FormatTwoCheckpointsStillLoadVerifyAndExport) {
  TempDir dir;
  const se::TrainConfig tc = se::parse_train_config(tiny_llama(2).dump(), "test");
  Losses r;
  Trainer a(tc);
  a.train(2, r);
  a.save(dir.path(), "new");
  const fs::path v3 = dir / "new", v2 = dir / "old";
  fs::create_directories(v2);
  json m = json::parse(read_file(v3 / "manifest.json"));
  ASSERT_EQ(m["format"], 3);
  ASSERT_FALSE(m.contains("chunks"));
  const std::vector<json> chunks = strata::test::saved_chunks(m, [&](int q) { return read_file(v3 / index_name(q)); });
  const int world = m["world_size"].get<int>();
  for (int q = 0; q < world; ++q) {
    fs::copy_file(v3 / (ck::rank_name(q) + ".data"), v2 / (ck::rank_name(q) + ".data"));
    json mine = json::array();
    for (const json& c : chunks)
      if (c["rank"] == q) mine.push_back(c);
    spit(v2 / index_name(q), json{{"format", 1}, {"rank", q}, {"chunks", mine}}.dump(1));
  }
  m["format"] = 2;
  m["chunks"] = chunks;
  for (const char* key : {"shards", "chunk_elements", "ranks"}) m.erase(key);
  spit(v2 / "manifest.json", m.dump(1));

  Trainer b(tc);
  b.load(v2);
  expect_bitwise(b.params(), a.params());
  EXPECT_EQ(se::verify_checkpoint(v2), se::verify_checkpoint(v3));
  const std::string d2 = se::describe_checkpoint(v2), d3 = se::describe_checkpoint(v3);
  EXPECT_EQ(d2.substr(d2.find(" chunks") - 3), d3.substr(d3.find(" chunks") - 3));
  se::export_checkpoint_hf(v2, dir / "hf2", "float32");
  se::export_checkpoint_hf(v3, dir / "hf3", "float32");
  EXPECT_EQ(read_file(dir / "hf2" / "model.safetensors"), read_file(dir / "hf3" / "model.safetensors"));
  // A chunk list that misses a chunk is refused before anything is read.
  m["chunks"].erase(m["chunks"].begin() + 1);
  spit(v2 / "manifest.json", m.dump(1));
  const std::string why = error_of([&] { b.load(v2); });
  EXPECT_NE(why.find("the manifest's chunks do not cover"), std::string::npos) << why;
}

// The node-local exchange's rounds (exchange.h), planned from random needs of awkward sizes: every
// need in one round, a chunk's needs together, and in each round every rank's reads, sends and
// receipts within their bounds (or one chunk alone over them); the same plan whatever the order of
// the needs; and ranks that share nothing share rounds.
TEST(CheckpointExchange, RoundsKeepEveryRankWithinItsBoundsAndRunDisjointRanksTogether) {
  std::mt19937 rng(20261129);
  for (int trial = 0; trial < 40; ++trial) {
    const int world = 2 + int(rng() % 9);
    const ck::ExchangeLimits limits{4 * (8 + rng() % 60), 4 * (8 + rng() % 60), 4 * (16 + rng() % 120)};
    std::vector<ck::ExchangeNeed> needs;
    std::map<std::pair<size_t, uint64_t>, int> server_of;  // (unit, begin) -> server
    for (size_t unit = 0; unit < 3; ++unit)
      for (uint64_t begin = 0, n = 0; begin < 400; begin += n) {
        n = 1 + rng() % 90;
        ck::Chunk c;
        c.unit = unit;
        c.kind = 0;
        c.begin = begin;
        c.numel = n;
        c.rank = int(rng() % 5);
        server_of[{unit, begin}] = int(rng() % uint32_t(world));
        for (uint64_t at = begin; at < begin + n;) {  // cut among owners
          const uint64_t len = std::min<uint64_t>(1 + rng() % 40, begin + n - at);
          needs.push_back({c, at, len, int(rng() % uint32_t(world)), rng() % 1000});
          at += len;
        }
      }
    const auto server = [&](const ck::Chunk& c) { return server_of.at({c.unit, c.begin}); };
    const ck::ExchangePlan plan = ck::plan_exchange(needs, server, world, limits);
    ASSERT_EQ(plan.needs.size(), needs.size());
    // [round][rank]: bytes read, sent, received, and how many chunks each is made of.
    std::map<std::pair<uint32_t, int>, std::array<uint64_t, 3>> bytes;
    std::map<std::pair<uint32_t, int>, std::array<std::set<std::pair<size_t, uint64_t>>, 3>> chunks;
    for (size_t i = 0; i < plan.needs.size(); ++i) {
      const ck::ExchangeNeed& n = plan.needs[i];
      const std::pair<size_t, uint64_t> id{n.chunk.unit, n.chunk.begin};
      ASSERT_LT(plan.round[i], plan.rounds);
      ASSERT_EQ(plan.server[i], server(n.chunk));
      if (i > 0 && plan.needs[i - 1].chunk == n.chunk) {
        EXPECT_EQ(plan.round[i], plan.round[i - 1]) << "a chunk's needs in two rounds";
      }
      const int q = plan.server[i];
      if (chunks[{plan.round[i], q}][0].insert(id).second) bytes[{plan.round[i], q}][0] += n.chunk.numel * 4;
      if (n.owner == q) continue;
      bytes[{plan.round[i], q}][1] += n.numel * 4;
      chunks[{plan.round[i], q}][1].insert(id);
      bytes[{plan.round[i], n.owner}][2] += n.numel * 4;
      chunks[{plan.round[i], n.owner}][2].insert(id);
    }
    const uint64_t cap[3] = {limits.read_bytes, limits.send_bytes, limits.receive_bytes};
    for (const auto& [at, b] : bytes)
      for (int role = 0; role < 3; ++role)
        EXPECT_TRUE(b[size_t(role)] <= cap[role] || chunks[at][size_t(role)].size() == 1)
            << "trial " << trial << " round " << at.first << " rank " << at.second << " role " << role << ": "
            << b[size_t(role)] << " bytes over " << cap[role];
    std::shuffle(needs.begin(), needs.end(), rng);
    const ck::ExchangePlan again = ck::plan_exchange(needs, server, world, limits);
    EXPECT_EQ(again.round, plan.round);
    EXPECT_EQ(again.rounds, plan.rounds);
  }
  // Four servers, each sending eight chunks of 100 elements to its own owner, one chunk a round
  // (bounds of 400 bytes): eight rounds, not 32.
  std::vector<ck::ExchangeNeed> needs;
  for (int s = 0; s < 4; ++s)
    for (int j = 0; j < 8; ++j) {
      ck::Chunk c;
      c.rank = s;
      c.begin = uint64_t(s * 8 + j) * 100;
      c.numel = 100;
      needs.push_back({c, c.begin, 100, 4 + s, 0});
    }
  const ck::ExchangePlan plan =
      ck::plan_exchange(needs, [](const ck::Chunk& c) { return c.rank; }, 8, ck::ExchangeLimits{400, 400, 400});
  EXPECT_EQ(plan.rounds, 8u);
}

}  // namespace
