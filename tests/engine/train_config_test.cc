// The training configuration as parsed: the documented defaults, every key reaching its field,
// the documented example and the shipped configurations, enum names, and byte sizes.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <future>
#include <map>
#include <stdexcept>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include <sys/wait.h>
#include <unistd.h>

#include "strata/engine/comm.h"
#include "strata/engine/config.h"
#include "strata/engine/config_parse.h"
#include "strata/engine/cpu_share.h"
#include "strata/engine/device.h"
#include "strata/engine/partition.h"
#include "strata/models/model_config.h"
#include "test_util.h"
#include "thrown_message.h"

namespace strata::engine {
namespace {

using test::contains;
using test::thrown_message;

// ---------------------------------------------------------------------------------------------
// Byte sizes

TEST(ByteSizes, ParseUnitsAndSpaces) {
  EXPECT_EQ(parse_bytes("512MiB"), 512ull << 20);
  EXPECT_EQ(parse_bytes("2GB"), 2000000000ull);
  EXPECT_EQ(parse_bytes("1.5GiB"), 3ull << 29);
  EXPECT_EQ(parse_bytes("4096"), 4096ull);
  EXPECT_EQ(parse_bytes("64 KiB"), 65536ull);
  EXPECT_EQ(parse_bytes("7B"), 7ull);
  EXPECT_EQ(parse_bytes("3kB"), 3000ull);
  EXPECT_EQ(parse_bytes("3KB"), 3000ull);
  EXPECT_EQ(parse_bytes("1TiB"), 1ull << 40);
  EXPECT_EQ(parse_bytes("0"), 0ull);
}

TEST(ByteSizes, JunkIsRejected) {
  for (const char* junk : {"12Q", "", "-1MiB", "abc", "MiB", "1.5.5GiB", "12 MiB extra", "nan",
                           "inf"}) {
    EXPECT_THROW(parse_bytes(junk), std::invalid_argument) << '"' << junk << '"';
  }
  const std::string msg = thrown_message<std::invalid_argument>([] { parse_bytes("12Q"); });
  EXPECT_TRUE(contains(msg, "12Q")) << msg;
}

TEST(ByteSizes, FormatUsesBinaryUnitsAndParsesBack) {
  EXPECT_EQ(format_bytes(0), "0 B");
  EXPECT_EQ(format_bytes(1023), "1023 B");
  EXPECT_EQ(format_bytes(1024), "1.00 KiB");
  EXPECT_EQ(format_bytes(1536), "1.50 KiB");
  EXPECT_EQ(format_bytes(512ull << 20), "512.00 MiB");
  EXPECT_EQ(format_bytes(3ull << 29), "1.50 GiB");
  for (uint64_t v : {0ull, 1023ull, 4096ull, 1536ull, 512ull << 20, 3ull << 29, 5ull << 40})
    EXPECT_EQ(parse_bytes(format_bytes(v)), v) << format_bytes(v);
}

// ---------------------------------------------------------------------------------------------
// Training configuration

// The example of docs/CONFIG.md.
constexpr const char* kTinyGpt2Config = R"({
  "model": {"preset": "gpt2", "layers": 6, "hidden": 64, "heads": 4,
            "vocab_size": 256, "max_positions": 64, "seed": 0},
  "data": {"path": "/usr/share/common-licenses", "format": "bytes", "seq_len": 32, "seed": 0},
  "batch": {"micro_batch": 2, "grad_accum": 2},
  "optimizer": {"type": "adamw", "lr": 0.001, "betas": [0.9, 0.999], "eps": 1e-8,
                "weight_decay": 0.0, "clip_grad_norm": 1.0},
  "precision": {"compute": "fp32", "reduce": "fp32"},
  "placement": {"params": "host", "grads": "host", "master": "host", "moments": "host"},
  "device": {"type": "cpu", "budget": "1MiB", "prefetch": 1, "cpu_threads": 0},
  "distributed": {"timeout_s": 300},
  "run": {"steps": 20, "log": "tiny.jsonl", "progress": true, "export": ""}
})";

TEST(TrainConfig, EmptyObjectGivesTheDocumentedDefaults) {
  const TrainConfig c = parse_train_config("{}", "test.json");
  EXPECT_EQ(c.model.name, "gpt2");
  EXPECT_EQ(c.model.arch, models::Arch::kGpt2);
  EXPECT_EQ(c.model.layers, 12);
  EXPECT_EQ(c.model.hidden, 768);
  EXPECT_EQ(c.model.heads, 12);
  EXPECT_EQ(c.model.kv_heads, 12);
  EXPECT_EQ(c.model.head_dim, 64);
  EXPECT_EQ(c.model.intermediate, 3072);
  EXPECT_EQ(c.model.vocab_size, 50257);
  EXPECT_EQ(c.model.max_positions, 1024);
  EXPECT_TRUE(c.model.tie_embeddings);
  EXPECT_EQ(c.init_from, "");
  EXPECT_EQ(c.init_seed, 0u);
  EXPECT_EQ(c.data_path, "/usr/share/common-licenses");
  EXPECT_EQ(c.data_format, "bytes");
  EXPECT_EQ(c.data_seed, 0u);
  EXPECT_EQ(c.steps, 20);
  EXPECT_EQ(c.log_path, "strata-train.jsonl");
  EXPECT_TRUE(c.progress);
  EXPECT_EQ(c.export_dir, "");

  const EngineConfig& e = c.engine;
  EXPECT_DOUBLE_EQ(e.lr, 1e-3);
  EXPECT_DOUBLE_EQ(e.beta1, 0.9);
  EXPECT_DOUBLE_EQ(e.beta2, 0.999);
  EXPECT_DOUBLE_EQ(e.eps, 1e-8);
  EXPECT_DOUBLE_EQ(e.weight_decay, 0.0);
  EXPECT_TRUE(e.decoupled_weight_decay);
  EXPECT_DOUBLE_EQ(e.clip_grad_norm, 0.0);
  EXPECT_EQ(e.update_overlap, UpdateOverlap::kForward);
  EXPECT_EQ(e.micro_batch, 1);
  EXPECT_EQ(e.grad_accum, 1);
  EXPECT_EQ(e.seq_len, 64);
  EXPECT_EQ(e.compute, Precision::kFp32);
  EXPECT_EQ(e.reduce, Precision::kFp32);
  EXPECT_DOUBLE_EQ(e.initial_loss_scale, 65536.0);
  EXPECT_EQ(e.loss_scale_window, 1000);
  EXPECT_EQ(e.params, Placement::kHost);
  EXPECT_EQ(e.grads, Placement::kHost);
  EXPECT_EQ(e.master, Placement::kHost);
  EXPECT_EQ(e.moments, Placement::kHost);
  EXPECT_EQ(e.device, "cpu");
  EXPECT_EQ(e.device_budget, UINT64_MAX);
  EXPECT_EQ(e.prefetch, 1);
  EXPECT_EQ(e.recompute_blocks, EngineConfig::kRecomputeAll);
  EXPECT_EQ(e.cpu_threads, 0u);
  EXPECT_DOUBLE_EQ(e.timeout_s, 300.0);

  // Empty sections change nothing.
  const TrainConfig s = parse_train_config(
      R"({"model": {}, "data": {}, "batch": {}, "optimizer": {}, "precision": {},
          "placement": {}, "device": {}, "distributed": {}, "run": {}})",
      "test.json");
  EXPECT_EQ(s.model.hidden, 768);
  EXPECT_EQ(s.steps, 20);
  EXPECT_EQ(s.engine.device_budget, UINT64_MAX);
}

TEST(TrainConfig, TinyGpt2ExampleParsesWithItsOverrides) {
  const TrainConfig c = parse_train_config(kTinyGpt2Config, "test.json");
  EXPECT_EQ(c.model.name, "gpt2");
  EXPECT_EQ(c.model.arch, models::Arch::kGpt2);
  EXPECT_EQ(c.model.layers, 6);
  EXPECT_EQ(c.model.hidden, 64);
  EXPECT_EQ(c.model.heads, 4);
  EXPECT_EQ(c.model.kv_heads, 4);
  EXPECT_EQ(c.model.head_dim, 16);
  EXPECT_EQ(c.model.intermediate, 256);
  EXPECT_EQ(c.model.vocab_size, 256);
  EXPECT_EQ(c.model.max_positions, 64);
  EXPECT_EQ(c.engine.seq_len, 32);
  EXPECT_EQ(c.engine.micro_batch, 2);
  EXPECT_EQ(c.engine.grad_accum, 2);
  EXPECT_DOUBLE_EQ(c.engine.clip_grad_norm, 1.0);
  EXPECT_EQ(c.engine.device_budget, uint64_t(1) << 20);
  EXPECT_EQ(c.log_path, "tiny.jsonl");
  EXPECT_EQ(c.steps, 20);
}

TEST(TrainConfig, EveryKeyReachesItsField) {
  const TrainConfig c = parse_train_config(R"({
    "model": {"preset": "gpt2", "seed": 7, "tie_embeddings": false},
    "data": {"path": "/data/tokens.bin", "format": "uint16", "seq_len": 128, "seed": 9},
    "batch": {"micro_batch": 3, "grad_accum": 5},
    "optimizer": {"type": "adam", "lr": 0.25, "betas": [0.5, 0.75], "eps": 1e-6,
                  "weight_decay": 0.125, "clip_grad_norm": 2},
    "precision": {"compute": "fp16", "reduce": "bf16", "initial_loss_scale": 1024,
                  "loss_scale_window": 50},
    "placement": {"params": "device", "grads": "host", "master": "host", "moments": "host",
                  "activations": "device", "recompute": 3},
    "device": {"budget": 1048576, "prefetch": 0, "cpu_threads": 6},
    "distributed": {"timeout_s": 12.5},
    "run": {"steps": 0, "log": "", "progress": false, "export": "out",
            "checkpoint_part_size": "32MiB", "checkpoint_concurrency": 3}
  })", "test.json");
  EXPECT_EQ(c.init_seed, 7u);
  EXPECT_EQ(c.checkpoint_transfer.part_bytes, 32ull << 20);
  EXPECT_EQ(c.checkpoint_transfer.concurrency, 3);
  EXPECT_FALSE(c.model.tie_embeddings);
  EXPECT_EQ(c.data_path, "/data/tokens.bin");
  EXPECT_EQ(c.data_format, "uint16");
  EXPECT_EQ(c.engine.seq_len, 128);
  EXPECT_EQ(c.data_seed, 9u);
  EXPECT_EQ(c.engine.micro_batch, 3);
  EXPECT_EQ(c.engine.grad_accum, 5);
  EXPECT_FALSE(c.engine.decoupled_weight_decay);
  EXPECT_DOUBLE_EQ(c.engine.lr, 0.25);
  EXPECT_DOUBLE_EQ(c.engine.beta1, 0.5);
  EXPECT_DOUBLE_EQ(c.engine.beta2, 0.75);
  EXPECT_DOUBLE_EQ(c.engine.eps, 1e-6);
  EXPECT_DOUBLE_EQ(c.engine.weight_decay, 0.125);
  EXPECT_DOUBLE_EQ(c.engine.clip_grad_norm, 2.0);
  EXPECT_EQ(c.engine.compute, Precision::kFp16);
  EXPECT_EQ(c.engine.reduce, Precision::kBf16);
  EXPECT_DOUBLE_EQ(c.engine.initial_loss_scale, 1024.0);
  EXPECT_EQ(c.engine.loss_scale_window, 50);
  EXPECT_EQ(c.engine.params, Placement::kDevice);
  EXPECT_EQ(c.engine.grads, Placement::kHost);
  EXPECT_EQ(c.engine.master, Placement::kHost);
  EXPECT_EQ(c.engine.activations, Placement::kDevice);
  EXPECT_EQ(c.engine.recompute_blocks, 3);
  EXPECT_FALSE(c.engine.prefetch_auto);
  EXPECT_EQ(c.engine.moments, Placement::kHost);
  EXPECT_EQ(c.engine.device_budget, 1048576u);
  EXPECT_EQ(c.engine.prefetch, 0);
  EXPECT_EQ(c.engine.cpu_threads, 6u);
  EXPECT_DOUBLE_EQ(c.engine.timeout_s, 12.5);
  EXPECT_EQ(c.steps, 0);
  EXPECT_EQ(c.log_path, "");
  EXPECT_FALSE(c.progress);
  EXPECT_EQ(c.export_dir, "out");
}

// placement.tiling.head_pass: "two" (the default) or "one"; anything else is refused by name.
TEST(TrainConfig, HeadPassIsOneOrTwo) {
  EXPECT_FALSE(parse_train_config("{}", "t.json").engine.head_one_pass);
  EXPECT_TRUE(parse_train_config(R"({"placement": {"tiling": {"head": 4, "head_pass": "one"}}})", "t.json")
                  .engine.head_one_pass);
  EXPECT_FALSE(parse_train_config(R"({"placement": {"tiling": {"head_pass": "two"}}})", "t.json").engine.head_one_pass);
  try {
    parse_train_config(R"({"placement": {"tiling": {"head_pass": 1}}})", "t.json");
    ADD_FAILURE() << "accepted head_pass 1";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("tiling.head_pass"), std::string::npos) << e.what();
  }
}

TEST(TrainConfig, RecomputeTakesAllNoneAutoOrABlockCount) {
  auto recompute_of = [](const std::string& value) {
    return parse_train_config(R"({"placement": {"recompute": )" + value + "}}", "test.json").engine.recompute_blocks;
  };
  EXPECT_EQ(recompute_of(R"("all")"), EngineConfig::kRecomputeAll);
  EXPECT_EQ(recompute_of(R"("none")"), 0);
  EXPECT_EQ(recompute_of(R"("auto")"), EngineConfig::kRecomputeAuto);
  EXPECT_EQ(recompute_of("0"), 0);
  EXPECT_EQ(recompute_of("7"), 7);
}

TEST(TrainConfig, ReshapingDerivesHeadDimKvHeadsAndIntermediate) {
  // Llama: kv_heads is capped at the new head count, intermediate becomes 4 * hidden.
  const TrainConfig llama = parse_train_config(
      R"({"model": {"preset": "llama-1b", "hidden": 512, "heads": 4}})", "test.json");
  EXPECT_EQ(llama.model.arch, models::Arch::kLlama);
  EXPECT_EQ(llama.model.head_dim, 128);
  EXPECT_EQ(llama.model.kv_heads, 4);
  EXPECT_EQ(llama.model.intermediate, 2048);
  // Explicit values win.
  const TrainConfig gqa = parse_train_config(
      R"({"model": {"preset": "llama-1b", "hidden": 512, "heads": 8, "kv_heads": 2,
                    "intermediate": 1000}})",
      "test.json");
  EXPECT_EQ(gqa.model.head_dim, 64);
  EXPECT_EQ(gqa.model.kv_heads, 2);
  EXPECT_EQ(gqa.model.intermediate, 1000);
  // Only layers changed: head_dim, kv_heads and intermediate stay the preset's.
  const TrainConfig deeper = parse_train_config(R"({"model": {"layers": 2}})", "test.json");
  EXPECT_EQ(deeper.model.layers, 2);
  EXPECT_EQ(deeper.model.head_dim, 64);
  EXPECT_EQ(deeper.model.intermediate, 3072);
  // seq_len above max_positions is a GPT-2 limit only (Llama uses rotary embeddings).
  EXPECT_NO_THROW(parse_train_config(
      R"({"model": {"preset": "llama-1b"}, "data": {"seq_len": 100000}})", "test.json"));
}

TEST(TrainConfig, LoadNamesTheFileInItsErrors) {
  test::TempDir dir;
  const std::string path = (dir / "typo.json").string();
  {
    std::ofstream out(path);
    out << R"({"batch": {"micro_batch": 2, "grad_acum": 4}})";
  }
  const std::string msg = thrown_message<std::invalid_argument>([&] { load_train_config(path); });
  EXPECT_EQ(msg.rfind(path + ": ", 0), 0u) << msg;
  EXPECT_TRUE(contains(msg, "batch.grad_acum")) << msg;

  const std::string good = (dir / "tiny.json").string();
  {
    std::ofstream out(good);
    out << kTinyGpt2Config;
  }
  EXPECT_EQ(load_train_config(good).model.hidden, 64);

  const std::string absent = (dir / "absent.json").string();
  const std::string missing =
      thrown_message<std::invalid_argument>([&] { load_train_config(absent); });
  EXPECT_TRUE(contains(missing, absent)) << missing;
}

TEST(TrainConfig, EnumNamesRoundTrip) {
  EXPECT_STREQ(to_string(Precision::kFp32), "fp32");
  EXPECT_STREQ(to_string(Precision::kBf16), "bf16");
  EXPECT_STREQ(to_string(Precision::kFp16), "fp16");
  EXPECT_STREQ(to_string(Placement::kDevice), "device");
  EXPECT_STREQ(to_string(Placement::kHost), "host");
  EXPECT_STREQ(to_string(UpdateOverlap::kOff), "off");
  EXPECT_STREQ(to_string(UpdateOverlap::kForward), "forward");
  EXPECT_STREQ(to_string(UpdateOverlap::kBackward), "backward");
}

// The configurations shipped in the repository (the main job's, the GPU benchmarks') stay valid
// as the schema changes.
// A configuration that fine-tunes (model.init_from, a path relative to where it runs: the quick
// start's model is made by its first lines) parses here beside a model config.json written there.
TEST(TrainConfig, EveryShippedConfigurationParses) {
  test::TempDir cwd;
  const std::filesystem::path was = std::filesystem::current_path();
  std::filesystem::current_path(cwd.path());
  size_t parsed = 0;
  for (const char* dir : {"configs", "bench/configs"})
    for (const auto& f : std::filesystem::directory_iterator(std::filesystem::path(STRATA_SOURCE_DIR) / dir)) {
      if (f.path().extension() != ".json") continue;
      SCOPED_TRACE(f.path().string());
      std::ifstream in(f.path());
      const nlohmann::json j = nlohmann::json::parse(in);
      if (j.contains("model") && j["model"].contains("init_from")) {
        const std::filesystem::path model = j["model"]["init_from"].get<std::string>();
        ASSERT_TRUE(model.is_relative()) << "a shipped configuration must not name a machine's path";
        std::filesystem::create_directories(model);
        models::ModelConfig c = models::preset("llama-1b");
        c.layers = 2;
        std::ofstream(model / "config.json") << c.to_hf_json();
      }
      EXPECT_NO_THROW(load_train_config(f.path().string()));
      ++parsed;
    }
  std::filesystem::current_path(was);
  EXPECT_GE(parsed, 11u);
}

}  // namespace
}  // namespace strata::engine
