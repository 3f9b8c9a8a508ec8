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

// bf16 compute (the GPU's case): the records sit in 2-byte elements (8-element aligned) and are
// quantized from the weights as bf16 holds them; each frozen weight read back after training is
// bitwise the dequantization (to bf16) of that quantization, the base in swap, with and without
// double quantization, and the adapters train (the loss falls). (Records cut across ranks' shards:
// the 2-rank case of tests/models/py/qlora_oracle.py.)
TEST(QuantizedBase, Bf16ComputeQuantizesFromBf16AndReadsBackItsOwnDequantization) {
  for (const bool double_quant : {false, true}) {
    SCOPED_TRACE(double_quant ? "double quantization" : "absmax in fp32");
    TempDir swap;
    json j = qlora_config("nf4");
    j["model"]["quantize"]["bnb_4bit_compute_dtype"] = "bfloat16";
    j["model"]["quantize"]["bnb_4bit_use_double_quant"] = double_quant;
    j["precision"] = {{"compute", "bf16"}};
    j["placement"] = {{"params", "nvme"}};
    j["offload"] = {{"nvme_dirs", {swap.path().string()}}};
    const se::TrainConfig tc = se::parse_train_config(j.dump(), "test");
    uint64_t peak = 0;
    const Trajectory got = run_in_process(tc, UINT64_MAX, &peak);
    EXPECT_LT(got.losses.back(), got.losses.front());
    const sm::QuantizedBase& q = tc.model.quantize;
    const strata::kernels::Quant4 type = strata::kernels::quant4_from_string(q.quant_type);
    sm::Decoder initial(tc.model, tc.init_seed);
    const sm::TrainableTensors trains(tc.engine.trainable);
    size_t checked = 0;
    for (auto& [n, p] : initial.hf_parameters()) {
      if (trains.trainable(n) || !sm::stored_4bit(tc.model, n)) continue;
      const at::Tensor w = p.detach().to(at::kBFloat16).contiguous();
      const int64_t blocks = strata::kernels::quant4_blocks(w.numel(), q.blocksize);
      std::vector<uint8_t> packed(size_t(strata::kernels::quant4_packed_bytes(w.numel())));
      at::Tensor absmax = at::empty({blocks}, at::kFloat), want = at::empty_like(w);
      if (!double_quant) {
        strata::kernels::quantize_4bit(w.const_data_ptr(), strata::kernels::DType::kBF16, w.numel(), type, q.blocksize,
                                       packed.data(), absmax.data_ptr<float>());
        strata::kernels::dequantize_4bit(packed.data(), absmax.data_ptr<float>(), w.numel(), type, q.blocksize,
                                         want.data_ptr(), strata::kernels::DType::kBF16);
      } else {
        strata::kernels::quant4_absmax(w.const_data_ptr(), strata::kernels::DType::kBF16, w.numel(), q.blocksize,
                                       absmax.data_ptr<float>());
        const float offset = absmax.mean().item<float>();
        std::vector<uint8_t> qabsmax(static_cast<size_t>(blocks));
        std::vector<float> nested(size_t(strata::kernels::quant4_nested_blocks(w.numel(), q.blocksize)));
        strata::kernels::quantize_4bit_nested(w.const_data_ptr(), strata::kernels::DType::kBF16, w.numel(), type,
                                              q.blocksize, offset, packed.data(), qabsmax.data(), nested.data());
        strata::kernels::dequantize_4bit_nested(packed.data(), qabsmax.data(), nested.data(), offset, w.numel(), type,
                                                q.blocksize, want.data_ptr(), strata::kernels::DType::kBF16);
      }
      ASSERT_TRUE(got.params.count(n)) << n;
      EXPECT_TRUE(at::equal(got.params.at(n), want.to(at::kFloat))) << n;
      ++checked;
    }
    EXPECT_EQ(checked, 7u * size_t(tc.model.layers));
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
