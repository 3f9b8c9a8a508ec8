#include "strata/tiling/chunked_mlp.h"

#include <ATen/ATen.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/custom_function.h>

#include <stdexcept>
#include <string>

namespace strata::tiling {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

std::optional<at::Tensor> opt(const at::Tensor& t) { return t.defined() ? std::optional<at::Tensor>(t) : std::nullopt; }

at::Tensor activate(const at::Tensor& x, MlpActivation act) { return mlp_activation(x, act); }

// The weights' order in the autograd function's inputs.
enum { kUp, kUpBias, kGate, kGateBias, kDown, kDownBias, kWeights };

at::Tensor mlp(const at::Tensor& x, const variable_list& w, MlpActivation act) {
  at::Tensor h = at::linear(x, w[kUp], opt(w[kUpBias]));
  h = w[kGate].defined() ? activate(at::linear(x, w[kGate], opt(w[kGateBias])), act) * h : activate(h, act);
  return at::linear(h, w[kDown], opt(w[kDownBias]));
}

using Opt = std::optional<at::Tensor>;

class ChunkedMlp : public torch::autograd::Function<ChunkedMlp> {
 public:
  // Absent weights (std::nullopt) are no inputs of autograd's.
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const Opt& up, const Opt& up_bias, const Opt& gate,
                            const Opt& gate_bias, const Opt& down, const Opt& down_bias, int64_t act, int64_t chunk) {
    const variable_list w{up.value_or(at::Tensor()),   up_bias.value_or(at::Tensor()),
                          gate.value_or(at::Tensor()), gate_bias.value_or(at::Tensor()),
                          down.value_or(at::Tensor()), down_bias.value_or(at::Tensor())};
    const int64_t d = x.size(-1), tokens = x.numel() / d;
    const at::Tensor rows = x.reshape({tokens, d});
    at::Tensor out = at::empty({tokens, w[kDown].size(0)}, x.options());
    for (int64_t n0 = 0; n0 < tokens; n0 += chunk) {
      const int64_t nt = std::min(chunk, tokens - n0);
      out.narrow(0, n0, nt).copy_(mlp(rows.narrow(0, n0, nt), w, MlpActivation(act)));
    }
    variable_list keep{x};
    keep.insert(keep.end(), w.begin(), w.end());
    ctx->save_for_backward(keep);
    ctx->saved_data["act"] = act;
    ctx->saved_data["chunk"] = chunk;
    std::vector<int64_t> shape = x.sizes().vec();
    shape.back() = w[kDown].size(0);
    return out.view(shape);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad_out) {
    const variable_list saved = ctx->get_saved_variables();
    const at::Tensor& x = saved[0];
    const auto act = MlpActivation(ctx->saved_data["act"].toInt());
    const int64_t chunk = ctx->saved_data["chunk"].toInt();
    const int64_t d = x.size(-1), tokens = x.numel() / d;
    const at::Tensor rows = x.reshape({tokens, d});
    const at::Tensor go = grad_out[0].reshape({tokens, -1});
    // Leaves for the recompute: the weights present, detached, and fp32 sums of their gradients.
    variable_list w(kWeights), sums(kWeights), leaves;
    std::vector<size_t> present;
    for (size_t i = 0; i < kWeights; ++i) {
      const at::Tensor& p = saved[1 + i];
      if (!p.defined()) continue;
      w[i] = p.detach().requires_grad_(true);
      sums[i] = at::zeros(p.sizes(), p.options().dtype(at::kFloat));
      leaves.push_back(w[i]);
      present.push_back(i);
    }
    at::Tensor dx = at::empty_like(rows);
    for (int64_t n0 = 0; n0 < tokens; n0 += chunk) {
      const int64_t nt = std::min(chunk, tokens - n0);
      at::AutoGradMode grad_on(true);
      at::Tensor xc = rows.narrow(0, n0, nt).detach().requires_grad_(true);
      const at::Tensor y = mlp(xc, w, act);
      variable_list inputs{xc};
      inputs.insert(inputs.end(), leaves.begin(), leaves.end());
      const variable_list g = torch::autograd::grad({y}, inputs, {go.narrow(0, n0, nt)});
      dx.narrow(0, n0, nt).copy_(g[0]);
      for (size_t k = 0; k < present.size(); ++k) sums[present[k]].add_(g[1 + k]);
    }
    variable_list out{dx.view(x.sizes())};
    for (size_t i = 0; i < kWeights; ++i)
      out.push_back(sums[i].defined() ? sums[i].to(saved[1 + i].scalar_type()) : at::Tensor());
    out.push_back(at::Tensor());  // act
    out.push_back(at::Tensor());  // chunk
    return out;
  }
};

void check(const at::Tensor& x, const MlpWeights& w) {
  const auto fail = [](const std::string& why) { throw std::invalid_argument("chunked_mlp: " + why); };
  if (!x.defined() || x.dim() < 1) fail("the input must have a feature dimension");
  if (!w.up.defined() || !w.down.defined()) fail("the up and down projections are required");
  const int64_t d = x.size(-1), f = w.up.size(0);
  if (w.up.dim() != 2 || w.up.size(1) != d) fail("up must be [f, " + std::to_string(d) + "]");
  if (w.gate.defined() && (w.gate.sizes() != w.up.sizes())) fail("gate must have up's shape");
  if (w.down.dim() != 2 || w.down.size(1) != f) fail("down must be [d, " + std::to_string(f) + "]");
  for (const at::Tensor* t : {&w.up, &w.up_bias, &w.gate, &w.gate_bias, &w.down, &w.down_bias})
    if (t->defined() && t->scalar_type() != x.scalar_type()) fail("every weight must have the input's dtype");
  if (w.up_bias.defined() && w.up_bias.numel() != f) fail("up_bias must have " + std::to_string(f) + " elements");
  if (w.gate_bias.defined() && w.gate_bias.numel() != f) fail("gate_bias must have " + std::to_string(f) + " elements");
  if (w.down_bias.defined() && w.down_bias.numel() != w.down.size(0)) fail("down_bias must match down's rows");
}

}  // namespace

at::Tensor mlp_activation(const at::Tensor& x, MlpActivation act) {
  switch (act) {
    case MlpActivation::kSilu: return at::silu(x);
    case MlpActivation::kGelu: return at::gelu(x, "none");
    case MlpActivation::kGeluTanh: return at::gelu(x, "tanh");
  }
  throw std::invalid_argument("mlp_activation: unknown activation");
}

at::Tensor chunked_mlp(const at::Tensor& x, const MlpWeights& w, MlpActivation act, int64_t token_chunk) {
  check(x, w);
  if (token_chunk < 1) throw std::invalid_argument("chunked_mlp: token_chunk must be >= 1");
  if (w.adapted()) throw std::invalid_argument("chunked_mlp: LoRA adapters are computed by plain_mlp only");
  return ChunkedMlp::apply(x, opt(w.up), opt(w.up_bias), opt(w.gate), opt(w.gate_bias), opt(w.down), opt(w.down_bias),
                           int64_t(act), token_chunk);
}

at::Tensor plain_mlp(const at::Tensor& x, const MlpWeights& w, MlpActivation act) {
  check(x, w);
  if (!w.adapted()) return mlp(x, {w.up, w.up_bias, w.gate, w.gate_bias, w.down, w.down_bias}, act);
  const auto linear = [](const at::Tensor& in, const at::Tensor& weight, const at::Tensor& bias, const LowRank& l) {
    at::Tensor y = at::linear(in, weight, opt(bias));
    return l.defined() ? y + at::linear(at::linear(in, l.a), l.b) * l.scaling : y;
  };
  at::Tensor h = linear(x, w.up, w.up_bias, w.up_lora);
  h = w.gate.defined() ? activate(linear(x, w.gate, w.gate_bias, w.gate_lora), act) * h : activate(h, act);
  return linear(h, w.down, w.down_bias, w.down_lora);
}

}  // namespace strata::tiling
