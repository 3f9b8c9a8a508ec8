// A 4-bit base (model.quantize) in the engine: LoRA over it follows plain libtorch over the same
// model whose frozen linear weights are their own NF4/FP4 dequantization, with the 4-bit records
// on the device, in host memory and in swap; the frozen units hold the 4-bit bytes, not 16-bit
// ones; and what cannot work is refused. (Against transformers + peft + bitsandbytes themselves:
// tests/models/py/qlora_oracle.py.)
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "equivalence.h"
#include "strata/engine/config_parse.h"
#include "strata/engine/partition.h"
#include "test_util.h"
#include "thrown_message.h"

namespace se = strata::engine;
namespace sm = strata::models;
using nlohmann::json;
using strata::test::TempDir;
using namespace strata::test;

namespace {

// A tiny Llama of awkward sizes (weights of 1568 to 4648 elements: partial last blocks) with LoRA
// on every block linear.
json qlora_config(const std::string& quant_type) {
  json j = tiny_config(true, 3);
  j["model"]["hidden"] = 56;
  j["model"]["intermediate"] = 83;
  j["model"]["lora"] = {{"r", 4}, {"lora_alpha", 8},
                        {"target_modules", {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}}};
  j["model"]["quantize"] = {{"load_in_4bit", true}, {"bnb_4bit_quant_type", quant_type},
                            {"bnb_4bit_compute_dtype", "float32"}};
  j["run"]["steps"] = 6;
  return j;
}

// Bytes of one rank's frozen shards.
uint64_t frozen_bytes(const se::TrainConfig& tc) {
  auto comm = se::Communicator::create(se::DistEnv{}, std::chrono::seconds(30));
  auto dev = se::Device::create("cpu", 0, UINT64_MAX);
  se::EngineConfig e = tc.engine;
  e.plan_only = true;
  se::Engine eng(std::make_unique<sm::Decoder>(tc.model, tc.init_seed, sm::Decoder::Init::kDeferred), e, *comm, *dev);
  uint64_t bytes = 0;
  for (const se::UnitLayout& u : eng.partition().units())
    if (u.frozen) bytes += u.shard_numel * 4;
  return bytes;
}

TEST(QuantizedBase, LoraOverA4BitBaseMatchesTorchOverItsDequantizedWeightsOnEveryTier) {
  for (const std::string type : {"nf4", "fp4", "nf4 double"})
    for (const char* where : {"device", "host", "nvme"}) {
      SCOPED_TRACE(type + ", 4-bit base on " + where);
      TempDir swap;
      json j = qlora_config(type.substr(0, 3));
      j["model"]["quantize"]["bnb_4bit_use_double_quant"] = type.size() > 3;
      j["placement"] = {{"params", where}};
      if (std::string(where) == "nvme") j["offload"] = {{"nvme_dirs", {swap.path().string()}}};
      const se::TrainConfig tc = se::parse_train_config(j.dump(), "test");
      uint64_t peak = 0;
      const Trajectory got = run_in_process(tc, UINT64_MAX, &peak);
      // The frozen weights read back (dequantized) are the reference's, and LoRA's trajectory its.
      expect_close(got, reference(tc, 1), 1e-5);
    }
}

TEST(QuantizedBase, FrozenUnitsHoldTheFourBitBytes) {
  json j = qlora_config("nf4");
  const se::TrainConfig quantized = se::parse_train_config(j.dump(), "test");
  j["model"].erase("quantize");
  const se::TrainConfig sixteen = se::parse_train_config(j.dump(), "test");
  // Per block linear: 4 bits an element and a 4-byte absmax a block of 64 (0.5625 bytes) against 4
  // bytes; the norms stay fp32, and the unit's padding to 1024 elements counts on both sides.
  uint64_t linear = 0;
  for (const sm::BlockLinear& l : sm::block_linears(quantized.model)) linear += uint64_t(l.in * l.out);
  linear *= uint64_t(quantized.model.layers);
  const uint64_t q = frozen_bytes(quantized), full = frozen_bytes(sixteen);
  EXPECT_LE(full - q, linear * 4 - linear * 9 / 16 + 3 * 4096) << q << " vs " << full;
  EXPECT_GE(full - q, linear * 4 - linear * 9 / 16 - 3 * 2 * 4096) << q << " vs " << full;
  EXPECT_LT(double(q), 0.45 * double(full));
}

TEST(QuantizedBase, BlockTilesAreRefused) {
  json j = qlora_config("nf4");
  j["placement"] = {{"tiling", {{"attention", 1}, {"mlp", 2}}}};
  const se::TrainConfig tc = se::parse_train_config(j.dump(), "test");
  uint64_t peak = 0;
  const std::string msg = thrown_message<std::invalid_argument>([&] { run_in_process(tc, UINT64_MAX, &peak); });
  EXPECT_NE(msg.find("4-bit base"), std::string::npos) << msg;
}

}  // namespace
