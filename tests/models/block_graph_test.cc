// Decoder::block_graph_bytes_per_token against what a block's forward with autograd really keeps:
// every CPU allocation goes through a counting allocator while the block runs, and what is still
// allocated afterwards (the output aside) is the graph's saved tensors. The estimate must not be
// below it (the engine budgets kept graphs with it) nor far above it (or it wastes the budget).
#include <ATen/ATen.h>
#include <c10/core/CPUAllocator.h>
#include <gtest/gtest.h>
#include <torch/autograd.h>

#include <atomic>
#include <mutex>
#include <unordered_map>

#include "strata/models/decoder.h"

namespace strata::models {
namespace {

// Wraps the default CPU allocator and counts the bytes alive. A DataPtr's context is its data
// pointer itself (the size is looked up), as Allocator::raw_allocate requires: oneDNN's bf16
// kernels take their scratch memory through it on CPUs with AVX-512 BF16.
class CountingAllocator final : public c10::Allocator {
 public:
  CountingAllocator() { instance = this; }
  c10::DataPtr allocate(size_t n) override {
    c10::DataPtr inner = inner_->allocate(n);
    void* data = inner.get();
    if (!data) return inner;  // zero bytes: nothing to count
    {
      std::lock_guard<std::mutex> lock(mu_);
      blocks_.emplace(data, Block{std::move(inner), n});
    }
    live_ += int64_t(n);
    return {data, data, &release, c10::Device(c10::kCPU)};
  }
  c10::DeleterFnPtr raw_deleter() const override { return &release; }
  void copy_data(void* dst, const void* src, size_t n) const override { default_copy_data(dst, src, n); }
  int64_t live() const { return live_.load(); }

 private:
  struct Block {
    c10::DataPtr inner;
    size_t bytes;
  };
  static void release(void* p) {
    Block b;
    {
      std::lock_guard<std::mutex> lock(instance->mu_);
      auto it = instance->blocks_.find(p);
      b = std::move(it->second);
      instance->blocks_.erase(it);
    }
    instance->live_ -= int64_t(b.bytes);
  }  // b.inner frees the memory
  static inline CountingAllocator* instance = nullptr;
  c10::Allocator* inner_ = c10::GetDefaultCPUAllocator();
  std::mutex mu_;
  std::unordered_map<void*, Block> blocks_;
  std::atomic<int64_t> live_{0};
};

struct Case {
  Arch arch;
  int64_t hidden, heads, kv_heads, intermediate, batch, seq;
  at::ScalarType dtype;
};

class BlockGraph : public ::testing::TestWithParam<Case> {};

TEST_P(BlockGraph, EstimateBoundsWhatAutogradKeeps) {
  const Case k = GetParam();
  ModelConfig c = preset(k.arch == Arch::kGpt2 ? "gpt2" : "llama-1b");
  c.layers = 1;
  c.hidden = k.hidden;
  c.heads = k.heads;
  c.kv_heads = k.kv_heads;
  c.head_dim = k.hidden / k.heads;
  c.intermediate = k.intermediate;
  c.vocab_size = 300;
  c.max_positions = 512;
  c.validate();
  Decoder m(c, 3);
  m.to(k.dtype);
  at::Tensor x = at::randn({k.batch, k.seq, k.hidden}).to(k.dtype).requires_grad_(true);

  static CountingAllocator counting;
  c10::Allocator* before_alloc = c10::GetCPUAllocator();
  c10::SetCPUAllocator(&counting, /*priority=*/100);
  const int64_t before = counting.live();
  at::Tensor y = m.block(0).forward(x);
  const int64_t kept = counting.live() - before - int64_t(y.nbytes()) + int64_t(x.nbytes());
  y.backward(at::ones_like(y));  // the graph is real: it runs
  y = at::Tensor();
  c10::SetCPUAllocator(before_alloc, 100);

  const double tokens = double(k.batch * k.seq);
  const double estimate = double(m.block_graph_bytes_per_token(c10::elementSize(k.dtype))) * tokens;
  EXPECT_GE(estimate, double(kept)) << "kept " << kept / tokens << " bytes a token";
  EXPECT_LE(estimate, 1.2 * double(kept)) << "kept " << kept / tokens << " bytes a token";
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, BlockGraph,
    ::testing::Values(Case{Arch::kGpt2, 192, 3, 3, 768, 2, 77, at::kFloat},
                      Case{Arch::kGpt2, 256, 4, 4, 1000, 3, 50, at::kBFloat16},
                      Case{Arch::kLlama, 256, 4, 2, 688, 2, 61, at::kFloat},
                      Case{Arch::kLlama, 256, 4, 2, 688, 2, 61, at::kBFloat16},
                      Case{Arch::kLlama, 128, 4, 4, 344, 1, 130, at::kBFloat16}),
    [](const ::testing::TestParamInfo<Case>& i) {
      return std::string(i.param.arch == Arch::kGpt2 ? "gpt2" : "llama") + "_" + std::to_string(i.param.hidden) +
             "_kv" + std::to_string(i.param.kv_heads) + (i.param.dtype == at::kFloat ? "_fp32" : "_bf16");
    });

}  // namespace
}  // namespace strata::models
