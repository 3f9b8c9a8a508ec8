// A transformer MLP over token chunks (the activation side of tiling): its intermediate
// activations ([tokens, intermediate]: the up and gate projections, the activation and their
// product, and in the backward their gradients) exist for one chunk of tokens at a time, in the
// forward and in the backward, instead of for the whole sequence. The forward keeps nothing but
// its inputs; the backward recomputes each chunk's intermediates and backpropagates through
// them, accumulating the weights' gradients in fp32 over the chunks.
//
// Numbers: each chunk's output is what the unchunked MLP computes for those tokens (row by row the
// same operations); the weights' gradients are sums over the chunks instead of one product over
// all tokens, so in fp32 only the order of sums differs (tests/tiling/chunked_mlp_test.cc), and in
// bf16/fp16 each chunk's product is also rounded before the fp32 sum.
//
// Memory beside the inputs and the gradients autograd returns: one chunk's intermediates and
// their gradients, and in bf16/fp16 an fp32 sum per weight's gradient (4 bytes a weight; in fp32
// the sum is the gradient returned). Costs one more forward of the MLP per backward (the
// recompute).
//
// Thread safety: a pure function of its arguments; autograd may run it on any thread.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>

namespace strata::tiling {

enum class MlpActivation { kSilu, kGelu, kGeluTanh };

// Weights in Strata's layout ([out, in]); undefined biases are absent. A gated MLP (Llama)
// computes down(act(gate(x)) * up(x)); without `gate` (GPT-2) down(act(up(x))).
// A LoRA adapter of one projection: W x + b + scaling * B (A x), A [r, in], B [out, r] (PEFT's
// order of operations). Undefined: none.
struct LowRank {
  at::Tensor a, b;
  double scaling = 0;
  bool defined() const { return a.defined(); }
};
struct MlpWeights {
  at::Tensor up, up_bias;      // [f, d], [f]
  at::Tensor gate, gate_bias;  // [f, d], [f], or undefined
  at::Tensor down, down_bias;  // [d, f], [d]
  LowRank up_lora, gate_lora, down_lora;  // plain_mlp only
  bool adapted() const { return up_lora.defined() || gate_lora.defined() || down_lora.defined(); }
};

// The activation of an MLP's up (or gate) projection, as every MLP here applies it.
at::Tensor mlp_activation(const at::Tensor& x, MlpActivation act);

// The MLP of `x` [..., d] in chunks of `token_chunk` rows of x viewed as [tokens, d] (the last may
// be shorter; token_chunk >= tokens computes it in one piece, still without keeping
// intermediates). Differentiable in x and every defined weight. Throws std::invalid_argument on
// mismatched shapes or dtypes and on token_chunk < 1.
at::Tensor chunked_mlp(const at::Tensor& x, const MlpWeights& w, MlpActivation act, int64_t token_chunk);

// The same computed the plain way (autograd keeps every intermediate): the oracle, and what a
// stage runs when its MLP is not chunked; the one of the two that takes LoRA adapters
// (chunked_mlp refuses them).
at::Tensor plain_mlp(const at::Tensor& x, const MlpWeights& w, MlpActivation act);

}  // namespace strata::tiling
