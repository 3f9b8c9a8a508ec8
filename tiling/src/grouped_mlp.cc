#include "strata/tiling/grouped_mlp.h"

#include <ATen/ATen.h>
#include <torch/csrc/autograd/custom_function.h>

#include <algorithm>
#include <stdexcept>
#include <string>

namespace strata::tiling {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

[[noreturn]] void fail(const std::string& why) { throw std::invalid_argument("grouped_mlp: " + why); }

// The grouped product takes rows whose strides are multiples of 16 bytes: an inner dimension
// of another width is padded with zeros (which add nothing to the sums).
int64_t aligned(int64_t n, const at::Tensor& like) {
  const int64_t per = std::max<int64_t>(1, 16 / int64_t(like.element_size()));
  return (n + per - 1) / per * per;
}

at::Tensor padded_columns(const at::Tensor& t, int64_t width) {
  return t.size(-1) == width ? t : at::constant_pad_nd(t, {0, width - t.size(-1)});
}

// x [rows, in] times each group's [out, in] tensor, as one grouped product: the tensors stacked
// and viewed as [groups, in, out] (column-major within a group, as CUDA's kernel takes them).
// The stacked copy lives only inside the forward and inside the backward: the graph keeps the
// groups' own tensors, and the backward stacks them again (the copy is not in the memory model's
// per-token graph, so it must not outlive the call). Widths are padded as `aligned` says, and the
// output's gradient is padded before it reaches the backward's products.
struct GroupedLinear : public torch::autograd::Function<GroupedLinear> {
  static at::Tensor stacked(at::TensorList w, int64_t in, int64_t out) {
    const at::Tensor all = at::stack(w);  // the one copy where no padding is needed
    if (in == w.front().size(1) && out == w.front().size(0)) return all;
    return at::constant_pad_nd(all, {0, in - w.front().size(1), 0, out - w.front().size(0)});
  }
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& ends, at::TensorList w) {
    const int64_t in = aligned(x.size(1), x), out = aligned(w.front().size(0), x);
    variable_list keep{x, ends};
    keep.insert(keep.end(), w.begin(), w.end());
    ctx->save_for_backward(keep);
    return at::_grouped_mm(padded_columns(x, in), stacked(w, in, out).transpose(1, 2), ends)
        .narrow(1, 0, w.front().size(0));
  }
  static variable_list backward(AutogradContext* ctx, variable_list grad_out) {
    const variable_list saved = ctx->get_saved_variables();
    const at::Tensor& x = saved[0];
    const at::Tensor& ends = saved[1];
    const variable_list w(saved.begin() + 2, saved.end());
    const int64_t rows_in = x.size(1), rows_out = w.front().size(0);
    const int64_t in = aligned(rows_in, x), out = aligned(rows_out, x);
    const at::Tensor g = padded_columns(grad_out[0].contiguous(), out).contiguous();
    // dx = g W (each group's rows by its own weight), dW_g = g_g^T x_g.
    const at::Tensor dx = at::_grouped_mm(g, stacked(w, in, out), ends).narrow(1, 0, rows_in);
    const at::Tensor dw = at::_grouped_mm(g.t(), padded_columns(x, in).contiguous(), ends);  // [groups, out, in]
    variable_list grads{dx, at::Tensor()};
    for (size_t i = 0; i < w.size(); ++i) grads.push_back(dw[int64_t(i)].narrow(0, 0, rows_out).narrow(1, 0, rows_in));
    return grads;
  }
};

at::Tensor grouped(const at::Tensor& x, const std::vector<at::Tensor>& each, const at::Tensor& ends) {
  return GroupedLinear::apply(x, ends, at::TensorList(each));
}

// One projection of every group: x W_g^T (+ scaling B_g A_g x, PEFT's order of operations).
at::Tensor project(const at::Tensor& x, const std::vector<MlpWeights>& w, at::Tensor MlpWeights::*weight,
                   LowRank MlpWeights::*lora, const at::Tensor& ends) {
  std::vector<at::Tensor> ws, as, bs;
  for (const MlpWeights& g : w) {
    ws.push_back(g.*weight);
    if ((g.*lora).defined() != (w.front().*lora).defined() || (g.*lora).scaling != (w.front().*lora).scaling)
      fail("LoRA adapters on every group's projection with one scaling, or on none");
    if ((g.*lora).defined()) {
      as.push_back((g.*lora).a);
      bs.push_back((g.*lora).b);
    }
  }
  at::Tensor y = grouped(x, ws, ends);
  if (as.empty()) return y;
  return y + grouped(grouped(x, as, ends), bs, ends) * (w.front().*lora).scaling;
}

}  // namespace

bool grouped_mlp_supported(const at::Tensor& x) {
  if (x.is_cpu()) return at::isFloatingType(x.scalar_type());
  return x.is_cuda() && x.scalar_type() == at::kBFloat16;
}

at::Tensor grouped_mlp(const at::Tensor& x, const std::vector<MlpWeights>& w, const at::Tensor& ends,
                       MlpActivation act) {
  if (w.empty()) fail("no groups");
  if (!x.defined() || x.dim() != 2) fail("the input must be [rows, features]");
  if (!grouped_mlp_supported(x)) fail(std::string("no grouped product for ") + c10::toString(x.scalar_type()) + " on " + x.device().str());
  if (!ends.defined() || ends.dim() != 1 || ends.size(0) != int64_t(w.size()) || ends.scalar_type() != at::kInt ||
      ends.device() != x.device())
    fail("ends must be [" + std::to_string(w.size()) + "] int32 on the input's device");
  const MlpWeights& first = w.front();
  for (const MlpWeights& g : w) {
    if (!g.up.defined() || !g.gate.defined() || !g.down.defined()) fail("every group needs up, gate and down");
    if (g.up_bias.defined() || g.gate_bias.defined() || g.down_bias.defined()) fail("biases are not taken");
    if (g.up.sizes() != first.up.sizes() || g.gate.sizes() != first.up.sizes() || g.down.sizes() != first.down.sizes())
      fail("every group's weights must have one shape");
    for (const at::Tensor* t : {&g.up, &g.gate, &g.down})
      if (t->scalar_type() != x.scalar_type()) fail("every weight must have the input's dtype");
  }
  if (first.up.dim() != 2 || first.up.size(1) != x.size(1) || first.down.dim() != 2 ||
      first.down.size(1) != first.up.size(0))
    fail("up and gate must be [f, " + std::to_string(x.size(1)) + "], down [d, f]");
  const at::Tensor h = mlp_activation(project(x, w, &MlpWeights::gate, &MlpWeights::gate_lora, ends), act) *
                       project(x, w, &MlpWeights::up, &MlpWeights::up_lora, ends);
  return project(h, w, &MlpWeights::down, &MlpWeights::down_lora, ends);
}

}  // namespace strata::tiling
