// Checkpoints that cannot be trusted are never loaded or left behind: CRC32C, corrupt, missing,
// uncommitted and badly cut data are clear errors; output locations are checked before the first
// step; SIGKILL at any moment and a full disk leave the previous checkpoint whole.
#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>
#include <signal.h>
#include <sys/mount.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <atomic>
#include <cstring>
#include <fstream>
#include <functional>
#include <iomanip>
#include <numeric>
#include <thread>
#include <random>
#include <sstream>

#include "strata/engine/checkpoint.h"
#include "strata/engine/comm.h"
#include "strata/engine/config.h"
#include "strata/engine/config_parse.h"
#include "strata/engine/device.h"
#include "strata/engine/engine.h"
#include "strata/models/hf_io.h"
#include "strata/models/model_config.h"
#include "strata/models/safetensors.h"
#include "strata/models/token_data.h"
#include "strata/offload/crc32c.h"
#include "strata/offload/fault_injection.h"
#include "checkpoint_fixture.h"
#include "checkpoint_trainer.h"
#include "launched.h"
#include "saved_chunks.h"
#include "test_util.h"
#include "checkpoint_names.h"

namespace {

TEST(Crc32c, KnownValueAndIncremental) {
  const std::string s = "123456789";
  EXPECT_EQ(strata::offload::crc32c(s.data(), s.size()), 0xE3069283u);
  std::vector<unsigned char> big(100003);
  for (size_t i = 0; i < big.size(); ++i) big[i] = (unsigned char)(i * 2654435761u >> 13);
  const uint32_t whole = strata::offload::crc32c(big.data(), big.size());
  uint32_t parts = strata::offload::crc32c(big.data(), 77);
  parts = strata::offload::crc32c(big.data() + 77, big.size() - 77, parts);
  EXPECT_EQ(whole, parts);
  big[5000] ^= 1;
  EXPECT_NE(strata::offload::crc32c(big.data(), big.size()), whole);
}

// A manifest whose parts do not cover a whole tensor exactly once (a tile's part moved onto its
// neighbour's, or cut short) is refused, naming the tensor, before anything is read; so is a
// part whose shape is not its whole tensor's outside the cut. Tiled and whole-block saves are
// both format 3 (format 2 only marked tiled ones).
TEST(Checkpoint, PartsThatDoNotCoverTheirTensorAreRefused) {
  TempDir dir;
  json cfg = tiny_llama(1);
  cfg["placement"] = {{"tiling", {{"attention", 2}, {"mlp", 3}}}};
  const se::TrainConfig tiled = se::parse_train_config(cfg.dump(), "test");
  cfg["placement"] = {{"tiling", "off"}};
  const se::TrainConfig whole = se::parse_train_config(cfg.dump(), "test");
  Losses r;
  {
    Trainer a(tiled);
    a.train(1, r);
    a.save(dir.path(), "tiled");
    Trainer b(whole);
    b.train(1, r);
    b.save(dir.path(), "whole");
  }
  const auto manifest_of = [&](const std::string& name) { return json::parse(std::ifstream(dir / name / "manifest.json")); };
  EXPECT_EQ(manifest_of("tiled")["format"], 3);
  EXPECT_EQ(manifest_of("whole")["format"], 3);
  const auto load_with = [&](const std::function<void(json&)>& edit) {
    json m = manifest_of("tiled");
    edit(m);
    std::filesystem::copy(dir / "tiled", dir / "edited", std::filesystem::copy_options::recursive |
                                                            std::filesystem::copy_options::overwrite_existing);
    std::ofstream(dir / "edited" / "manifest.json") << m.dump();
    Trainer b(whole);
    try {
      b.load(dir / "edited");
    } catch (const std::exception& e) {
      return std::string(e.what());
    }
    return std::string("loaded");
  };
  EXPECT_EQ(load_with([](json&) {}), "loaded");
  // Unit 1 is block 0's first attention tile; its q_proj part moved by one row overlaps.
  const auto q_part = [](json& m) -> json& {
    for (json& t : m["units"][1]["tensors"])
      if (t.contains("of") && t["of"]["name"].get<std::string>().find("q_proj") != std::string::npos) return t;
    throw std::runtime_error("no q_proj part");
  };
  std::string why = load_with([&](json& m) { q_part(m)["of"]["begin"] = 1; });
  EXPECT_NE(why.find("the parts of model.layers.0.self_attn.q_proj.weight"), std::string::npos) << why;
  why = load_with([&](json& m) { q_part(m)["of"]["shape"][1] = 65; });
  EXPECT_NE(why.find("is not a part of model.layers.0.self_attn.q_proj.weight"), std::string::npos) << why;
}

TEST(Checkpoint, CorruptMissingAndUncommittedAreClearErrors) {
  TempDir dir;
  const se::TrainConfig tc = se::parse_train_config(tiny_llama(2).dump(), "test");
  Losses r;
  Trainer a(tc);
  a.train(2, r);
  a.save(dir.path(), "c1");
  const auto ck = dir.path() / "c1";
  const auto data = ck / "rank-00000.data";
  auto message = [&](const std::filesystem::path& d) {
    Trainer b(tc);
    try {
      b.load(d);
    } catch (const std::exception& e) {
      return std::string(e.what());
    }
    return std::string("loaded");
  };
  ASSERT_EQ(message(ck), "loaded");

  // A flipped byte anywhere in the data is detected, naming the file and chunk.
  const json manifest = json::parse(std::ifstream(ck / "manifest.json"));
  const std::vector<json> chunks = strata::test::saved_chunks(manifest, [&](int q) {
    std::ostringstream name;
    name << "rank-" << std::setw(5) << std::setfill('0') << q << ".index.json";
    std::ostringstream text;
    text << std::ifstream(ck / name.str()).rdbuf();
    return text.str();
  });
  std::mt19937 rng(7);
  for (int trial = 0; trial < 5; ++trial) {
    const json& c = chunks[rng() % chunks.size()];
    const uint64_t at = c["offset"].get<uint64_t>() + rng() % (c["numel"].get<uint64_t>() * 4);
    std::fstream f(data, std::ios::in | std::ios::out | std::ios::binary);
    f.seekg(int64_t(at));
    char byte;
    f.read(&byte, 1);
    const char flip = char(1 << (rng() % 8));
    byte ^= flip;
    f.seekp(int64_t(at));
    f.write(&byte, 1);
    f.close();
    const std::string m = message(ck);
    EXPECT_NE(m.find("corrupt"), std::string::npos) << m;
    EXPECT_NE(m.find("rank-00000.data at offset " + std::to_string(c["offset"].get<uint64_t>())), std::string::npos) << m;
    std::fstream g(data, std::ios::in | std::ios::out | std::ios::binary);  // flip it back
    g.seekg(int64_t(at));
    g.read(&byte, 1);
    byte = char(byte ^ flip);
    g.seekp(int64_t(at));
    g.write(&byte, 1);
  }

  ASSERT_EQ(message(ck), "loaded") << "the flipped bytes were not restored";
  std::filesystem::rename(data, ck / "moved.data");
  EXPECT_NE(message(ck).find("rank-00000.data is missing"), std::string::npos) << message(ck);
  std::filesystem::rename(ck / "moved.data", data);

  std::filesystem::rename(ck / "manifest.json", ck / "manifest.json.bak");
  EXPECT_NE(message(ck).find("never committed"), std::string::npos);
  EXPECT_FALSE(se::latest_checkpoint(dir.path()).has_value()) << "latest names an uncommitted checkpoint";
  std::filesystem::rename(ck / "manifest.json.bak", ck / "manifest.json");

  json other = tiny_llama(2);
  other["model"]["layers"] = 2;
  Trainer c(se::parse_train_config(other.dump(), "test"));
  try {
    c.load(ck);
    FAIL() << "loaded a checkpoint of another model";
  } catch (const std::exception& e) {
    EXPECT_NE(std::string(e.what()).find("different model"), std::string::npos) << e.what();
  }
}

// Every output location is tried before the first step, not found wanting after hours of
// training: a read-only or full checkpoint directory, a non-empty export directory (unless
// --export-overwrite, which keeps other files there), an export whose parent is read-only.
// Read-only and full filesystems are tmpfs mounts in a mount namespace of the test's own
// (as root: permissions do not stop root).
TEST(Checkpoint, OutputLocationsAreCheckedBeforeTheFirstStep) {
  TempDir dir;
  const std::string d = dir.path().string();
  if (std::system(("unshare -m sh -c 'mount -t tmpfs tmpfs " + d + "' > /dev/null 2>&1").c_str()) != 0)
    GTEST_SKIP() << "cannot mount a tmpfs in a mount namespace here (unshare -m needs root): not tested";
  std::filesystem::create_directories(dir / "small");
  std::filesystem::create_directories(dir / "ro");
  json j = tiny_llama(3);
  std::ofstream(dir / "cfg.json") << j.dump(2);
  const std::string mounts = "mount -t tmpfs -o size=256k tmpfs " + d + "/small && mount -t tmpfs -o ro tmpfs " + d +
                             "/ro && ";
  int n = 0;
  // Runs `strata train` with `args` in the namespace; its exit status, output in `out`.
  const auto train = [&](const std::string& args, std::string& out) {
    const auto log = dir / ("log" + std::to_string(++n) + ".jsonl"), txt = dir / ("out" + std::to_string(n) + ".txt");
    const int rc = run_quiet("unshare -m sh -c '" + mounts + STRATA_BIN + " train --config " + d +
                                 "/cfg.json --no-progress --log " + log.string() + " " + args + "'",
                             txt);
    out = read_file(txt);
    if (rc != 0) {
      EXPECT_TRUE(!std::filesystem::exists(log) || losses(log).empty()) << "trained before failing:\n" << out;
    }
    return rc;
  };
  std::string out;
  EXPECT_NE(train("--checkpoint-dir " + d + "/ro/ck", out), 0);
  EXPECT_NE(out.find("checkpoint directory " + d + "/ro/ck: cannot create it"), std::string::npos) << out;
  EXPECT_NE(train("--checkpoint-dir " + d + "/small/ck", out), 0);
  EXPECT_NE(out.find("checkpoint directory " + d + "/small/ck has "), std::string::npos) << out;
  EXPECT_NE(out.find("are needed"), std::string::npos) << out;
  EXPECT_NE(train("--export " + d + "/ro/model", out), 0);
  EXPECT_NE(out.find("the export's parent directory " + d + "/ro"), std::string::npos) << out;

  std::filesystem::create_directories(dir / "model");
  std::ofstream(dir / "model" / "tokenizer.json") << "{}";
  EXPECT_NE(train("--export " + d + "/model", out), 0);
  EXPECT_NE(out.find(d + "/model is not empty (tokenizer.json); set run.export_overwrite (--export-overwrite)"),
            std::string::npos)
      << out;
  ASSERT_EQ(train("--export " + d + "/model --export-overwrite", out), 0) << out;
  EXPECT_EQ(read_file(dir / "model" / "tokenizer.json"), "{}");
  EXPECT_EQ(sm::load_hf_model(dir / "model")->config().layers, 3);
  EXPECT_FALSE(std::filesystem::exists(dir / "model.export-tmp"));

  // Periodic exports stay, so the room checked is for all of them: one fits in the 1 MiB
  // filesystem, the three of run.export_every 1 over 3 steps do not.
  json every = tiny_llama(3);
  every["run"]["export_every"] = 1;
  std::ofstream(dir / "every.json") << every.dump(2);
  const uint64_t one = uint64_t(se::parse_train_config(every.dump(), "t").model.parameters()) * 4;
  ASSERT_LT(one, 1u << 20);
  ASSERT_GT(3 * one, 1u << 20);
  std::filesystem::create_directories(dir / "mib");
  const auto txt = dir / "every.txt";
  EXPECT_NE(run_quiet("unshare -m sh -c 'mount -t tmpfs -o size=1m tmpfs " + d + "/mib && " + STRATA_BIN +
                          " train --config " + d + "/every.json --no-progress --log \"\" --export " + d + "/mib/model'",
                      txt),
            0);
  out = read_file(txt);
  EXPECT_NE(out.find("the export's parent directory (3 exports) " + d + "/mib has "), std::string::npos) << out;
}

// SIGKILL at seeded random moments of a run that saves after every step: whatever the moment,
// `latest` names a checkpoint that verifies, every committed checkpoint verifies, and the next
// run resumes from it.
TEST(Checkpoint, SigkillAtRandomMomentsNeverLeavesABadCheckpoint) {
  TempDir dir;
  const auto root = dir / "ckpt", cfg_path = dir / "cfg.json";
  json j = tiny_llama(1000000);
  j["model"]["layers"] = 2;
  j["run"]["save_every"] = 1;
  j["run"]["keep_checkpoints"] = 3;
  j["run"]["log"] = "";
  std::ofstream(cfg_path) << j.dump(2);
  std::mt19937 rng(20261123);
  std::string last_latest;
  int advanced = 0;
  for (int trial = 0; trial < 50; ++trial) {
    ::unlink((dir / "trial.txt").c_str());  // the last trial's banner must not count
    pid_t pid = fork();
    ASSERT_GE(pid, 0);
    if (pid == 0) {
      freopen((dir / "trial.txt").c_str(), "w", stderr);
      execl(STRATA_BIN, STRATA_BIN, "train", "--config", cfg_path.c_str(), "--checkpoint-dir",
            root.c_str(), "--resume", "--no-progress", nullptr);
      _exit(127);
    }
    // Kill at a random moment once the run has committed its first save of this trial, whatever
    // the machine's load: a delay from fork or from the start banner mostly hit start-up (engine
    // build, checkpoint load) on a busy machine, never a save.
    const auto forked = std::chrono::steady_clock::now();
    while (read_file(dir / "trial.txt").find("committed") == std::string::npos &&
           std::chrono::steady_clock::now() - forked < std::chrono::seconds(60))
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    std::this_thread::sleep_for(std::chrono::milliseconds(rng() % 1000));
    kill(pid, SIGKILL);
    int st = 0;
    waitpid(pid, &st, 0);
    ASSERT_TRUE(WIFSIGNALED(st)) << "trial " << trial << " ended by itself:\n"
                                 << read_file(dir / "trial.txt");
    const auto latest = se::latest_checkpoint(root);
    if (!latest) {
      ASSERT_EQ(last_latest, "") << "trial " << trial << ": latest vanished";
      continue;
    }
    EXPECT_NO_THROW(se::verify_checkpoint(*latest)) << "trial " << trial;
    for (const auto& e : std::filesystem::directory_iterator(root))
      if (std::filesystem::exists(e.path() / "manifest.json")) {
        EXPECT_NO_THROW(se::verify_checkpoint(e.path())) << "trial " << trial << ": " << e.path();
      }
    if (latest->string() != last_latest) ++advanced;
    last_latest = latest->string();
  }
  EXPECT_GE(advanced, 25) << "training rarely got past start-up: the kills did not hit saves";
}

TEST(Checkpoint, FullDiskIsAClearErrorAndThePreviousCheckpointSurvives) {
  TempDir dir;
  if (mount("tmpfs", dir.path().c_str(), "tmpfs", 0, "size=2500k") != 0)
    GTEST_SKIP() << "cannot mount a small tmpfs here: " << std::strerror(errno);
  struct Unmount {
    const TempDir& d;
    ~Unmount() { umount2(d.path().c_str(), MNT_DETACH); }
  } unmount{dir};
  const se::TrainConfig tc = se::parse_train_config(tiny_llama(2).dump(), "test");
  Losses r;
  Trainer a(tc);
  a.train(1, r);
  a.save(dir.path(), "step-1");
  a.train(1, r);
  try {
    a.save(dir.path(), "step-2");
    FAIL() << "a second checkpoint fitted in the small file system; the test needs it not to";
  } catch (const std::exception& e) {
    EXPECT_NE(std::string(e.what()).find("No space left on device"), std::string::npos) << e.what();
  }
  const auto latest = se::latest_checkpoint(dir.path());
  ASSERT_TRUE(latest.has_value());
  EXPECT_EQ(latest->filename(), "step-1");
  EXPECT_NO_THROW(se::verify_checkpoint(*latest));
  EXPECT_FALSE(std::filesystem::exists(dir / "step-2" / "manifest.json"));
}

}  // namespace
