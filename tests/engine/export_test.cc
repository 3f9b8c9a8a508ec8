// The Hugging Face export of a running engine (export_engine_hf, checkpoint.h): every tensor
// bitwise as the gathered model's export, at one rank and at three; shards shared among the ranks
// that see the directory, written by rank 0 alone where they do not, staged on every rank for an
// upload; a failure on one rank thrown on every rank.
#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "checkpoint_trainer.h"
#include "forked_ranks.h"
#include "strata/engine/config_parse.h"
#include "strata/engine/checkpoint.h"
#include "strata/models/decoder.h"
#include "strata/models/hf_io.h"
#include "strata/models/safetensors.h"
#include "strata/models/sharded_safetensors.h"
#include "test_util.h"

namespace se = strata::engine;
namespace sm = strata::models;
namespace fs = std::filesystem;
using nlohmann::json;
using strata::test::Losses;
using strata::test::TempDir;
using strata::test::read_file;
using strata::test::error_of;
using strata::test::Trainer;
using strata::test::tiny_llama;

namespace {

// The engine's weights gathered whole and written as a model (the export before streaming).
void export_gathered(Trainer& a, const se::TrainConfig& tc, const fs::path& out, at::ScalarType type) {
  sm::Decoder before(tc.model, 0, sm::Decoder::Init::kDeferred);
  {
    at::NoGradGuard no_grad;
    std::map<std::string, at::Tensor> by_name;
    for (auto& [n, t] : a.engine().gather_parameters()) by_name[n] = t;
    for (auto& [n, t] : before.hf_parameters()) t.copy_(by_name.at(n));
  }
  sm::export_hf_model(before, out, type);
}

// Tensors that differ (name, dtype, shape or bytes) between two exported directories.
int tensors_differing(const fs::path& want_dir, const fs::path& got_dir) {
  const sm::SafetensorsCheckpoint want(want_dir), got(got_dir);
  EXPECT_EQ(got.names(), want.names());
  if (got.names() != want.names()) return 1000;
  int bad = 0;
  for (const std::string& name : want.names()) {
    const sm::TensorView w = want.get(name), g = got.get(name);
    const bool same = g.info->dtype == w.info->dtype && g.info->shape == w.info->shape &&
                      g.data.size() == w.data.size() && std::memcmp(g.data.data(), w.data.data(), w.data.size()) == 0;
    EXPECT_TRUE(same) << got_dir << ": " << name;
    bad += !same;
  }
  return bad;
}

// The streamed export of a running engine (export_engine_hf: tensor by tensor, gathered in
// pieces) writes every tensor bitwise as the export before it did (every unit all-gathered
// whole, copied into a model and written by models::export_hf_model), in fp32 and bf16, with the
// state on the host or in swap, whole blocks or tiles; and its refusal of a non-empty directory
// leaves the engine usable.
void engine_export_matches(json cfg) {
  TempDir dir, swap;
  if (cfg.contains("placement") && cfg["placement"].contains("master"))
    cfg["offload"] = {{"nvme_dirs", {swap.path().string()}}, {"optimizer_chunk", "16KiB"}};
  const se::TrainConfig tc = se::parse_train_config(cfg.dump(), "test");
  Losses r;
  Trainer a(tc);
  a.train(2, r);
  for (const at::ScalarType type : {at::kFloat, at::kBFloat16}) {
    const std::string tag = type == at::kFloat ? "f32" : "bf16";
    export_gathered(a, tc, dir / ("gathered-" + tag), type);
    se::EngineExport options;
    options.type = type;
    options.shard_bytes = 20000;  // several shards
    const se::ExportResult done = se::export_engine_hf(a.engine(), a.comm(), dir / ("streamed-" + tag), options);
    EXPECT_GT(done.tensors, 0u);
    EXPECT_TRUE(fs::exists(dir / ("streamed-" + tag) / "model.safetensors.index.json")) << "not sharded";
    EXPECT_GT(done.files.size(), 2u);
    for (const std::string& f : done.files) EXPECT_TRUE(fs::exists(dir / ("streamed-" + tag) / f)) << f;
    EXPECT_EQ(tensors_differing(dir / ("gathered-" + tag), dir / ("streamed-" + tag)), 0);
    EXPECT_EQ(read_file(dir / ("gathered-" + tag) / "config.json"), read_file(dir / ("streamed-" + tag) / "config.json"));
  }
  const std::string why = error_of([&] { se::export_engine_hf(a.engine(), a.comm(), dir / "streamed-f32", {}); });
  EXPECT_NE(why.find("is not empty"), std::string::npos) << why;
  a.train(1, r);  // the hold was released
}


TEST(EngineExport, StreamedExportEqualsTheGatheredOneWholeBlocks) { engine_export_matches(tiny_llama(3)); }

TEST(EngineExport, StreamedExportEqualsTheGatheredOneTiledWithStateInSwap) {
  json cfg = tiny_llama(3);
  cfg["placement"] = {{"tiling", {{"attention", 2}, {"mlp", 3}, {"vocab", 2}}}, {"params", "host"}, {"grads", "host"},
                      {"master", "nvme"}, {"moments", "nvme"}};
  engine_export_matches(cfg);
}

// Three ranks export a run's weights (tiled blocks, so whole tensors are assembled from parts):
// - into a directory every rank sees: shard s written by rank s % 3 (its on_weights_file called
//   there, and only there);
// - where the others name other directories (as ranks on node-local disks would see none of rank
//   0's): rank 0 writes every shard, nothing appears in the others' directories;
// - staged on every rank for an upload, each rank naming its own staging directory: each shard
//   "uploaded" (moved away) by its writer, the others' staging directories gone at the end;
// in fp32 and bf16. Every set of files is byte for byte the set one writer writes, and its
// tensors are the gathered model's, bit for bit. An export into a non-empty directory fails on
// every rank, naming rank 0's reason, and the engine trains on.
TEST(EngineExport, RanksThatSeeTheDirectoryShareTheShardsByteForByte) {
  TempDir dir;
  json cfg = tiny_llama(3);
  cfg["batch"]["micro_batch"] = 1;
  cfg["placement"] = {{"tiling", {{"attention", 2}, {"mlp", 3}, {"vocab", 2}}}};
  const se::TrainConfig tc = se::parse_train_config(cfg.dump(), "test");
  constexpr int kWorld = 3;
  strata::test::expect_forked_ranks(kWorld, [&](const se::DistEnv& env) {
    const int rank = env.rank;
    Trainer a(tc, se::Communicator::create(env, std::chrono::seconds(60)));
    Losses r;
    a.train(2, r);
    int bad = 0;  // a forked rank's failures count through its exit status
    const auto check = [&](bool ok, const std::string& what) {
      if (!ok) std::fprintf(stderr, "rank %d: %s\n", rank, what.c_str());
      bad += !ok;
    };
    const auto sorted = [](std::vector<std::string> v) {
      std::sort(v.begin(), v.end());  // a shard of one large tensor completes before the open one
      return v;
    };
    for (const at::ScalarType type : {at::kFloat, at::kBFloat16}) {
      const std::string tag = type == at::kFloat ? "f32" : "bf16";
      const auto own = [&](const std::string& name) { return dir / (name + "-" + tag + "-rank" + std::to_string(rank)); };
      if (rank == 0) fs::create_directories(dir / ("uploaded-" + tag));
      export_gathered(a, tc, rank == 0 ? dir / ("gathered-" + tag) : own("gathered"), type);
      se::EngineExport options;
      options.type = type;
      options.shard_bytes = 20000;  // several shards
      std::vector<std::string> written;
      options.on_weights_file = [&](const fs::path& f) { written.push_back(f.filename().string()); };
      const se::ExportResult shared = se::export_engine_hf(a.engine(), a.comm(), dir / ("shared-" + tag), options);
      const std::vector<std::string>& files = shared.files;
      check(files.size() > 4 && files.back() == "model.safetensors.index.json", tag + ": not sharded");
      const std::vector<std::string> shards(files.begin(), files.end() - 1);
      std::vector<std::string> mine;
      for (size_t s = 0; s < shards.size(); ++s)
        if (int(s % kWorld) == rank) mine.push_back(shards[s]);
      check(sorted(written) == mine, tag + ": a shared directory's shards are not written by rank shard % 3");

      written.clear();
      se::export_engine_hf(a.engine(), a.comm(), rank == 0 ? dir / ("alone-" + tag) : own("alone"), options);
      check(sorted(written) == (rank == 0 ? shards : std::vector<std::string>()),
            tag + ": where the others do not see it, rank 0 does not write every shard alone");
      check(rank == 0 || (!fs::exists(own("alone")) && !fs::exists(sm::ExportDirectory::temporary(own("alone")))),
            tag + ": a rank that writes nothing left a directory");

      options.stage_on_every_rank = true;
      options.on_weights_file = [&](const fs::path& f) { fs::rename(f, dir / ("uploaded-" + tag) / f.filename()); };
      const fs::path staged = rank == 0 ? dir / ("staged-" + tag) : own("staged");
      se::export_engine_hf(a.engine(), a.comm(), staged, options);
      check(rank == 0 || (!fs::exists(staged) && !fs::exists(sm::ExportDirectory::temporary(staged))),
            tag + ": a rank's own staging directory stayed");
      a.comm().barrier();
      if (rank == 0) {
        for (const std::string& f : files) {
          const std::string want = read_file(dir / ("alone-" + tag) / f);
          check(!want.empty() && read_file(dir / ("shared-" + tag) / f) == want, tag + ": shared " + f + " differs");
          const fs::path up = f == files.back() ? staged / f : dir / ("uploaded-" + tag) / f;
          check(read_file(up) == want, tag + ": " + up.string() + " differs");
        }
        for (const std::string set : {"shared-", "alone-"}) {
          check(tensors_differing(dir / ("gathered-" + tag), dir / (set + tag)) == 0, tag + ": " + set + " tensors differ");
          check(read_file(dir / ("gathered-" + tag) / "config.json") == read_file(dir / (set + tag) / "config.json"),
                tag + ": " + set + " config.json differs");
        }
        size_t left = 0;  // the staged directory: the index and config.json, the shards went up
        for (const auto& e : fs::directory_iterator(staged)) left += e.is_regular_file();
        check(left == 2, tag + ": the staged directory holds " + std::to_string(left) + " files, not 2");
      }
    }
    const std::string why = error_of([&] { se::export_engine_hf(a.engine(), a.comm(), dir / "shared-f32", {}); });
    check(why.find(rank == 0 ? "is not empty" : "rank 0: export: ") != std::string::npos, "the refusal: " + why);
    a.train(1, r);  // the hold was released, the ranks still agree
    return bad;
  });
}

}  // namespace
