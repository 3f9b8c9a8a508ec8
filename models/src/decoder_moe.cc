// A sparse block's mixture of experts: routing, dispatch and combine (strata/models/moe.h).
#include <ATen/ops/bincount.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/softmax.h>
#include <ATen/ops/topk.h>
#include <ATen/ops/zeros.h>

#include <stdexcept>
#include <string>

#include "decoder_stages.h"
#include "strata/models/moe.h"
#include "strata/tiling/grouped_mlp.h"

namespace strata::models {

Routing route(const ModelConfig& c, const at::Tensor& logits) {
  Routing r;
  r.probabilities = at::softmax(logits, -1, at::kFloat);
  std::tie(r.weight, r.choice) = r.probabilities.topk(c.moe.top_k, -1);  // torch.topk's order and ties
  if (c.moe.norm_topk) r.weight = r.weight / r.weight.sum(-1, /*keepdim=*/true);
  // Mixtral multiplies an expert's output by the fp32 weight and rounds the product; Qwen3-MoE
  // rounds the weights to the model's dtype first.
  if (c.hf_type == "qwen3_moe") r.weight = r.weight.to(logits.scalar_type());
  return r;
}

void routing_stats(const ModelConfig& c, const Routing& r, RouterStats& stats, const at::Tensor& padding) {
  if (!padding.defined()) {
    stats.probability_sum = r.probabilities.sum(0);
    stats.selections = at::bincount(r.choice.reshape(-1), {}, c.moe.experts).to(at::kFloat);
    stats.tokens = r.choice.size(0);
    return;
  }
  const at::Tensor real = padding.reshape(-1).logical_not().to(r.probabilities.device());
  stats.probability_sum = (r.probabilities * real.unsqueeze(1).to(at::kFloat)).sum(0);
  stats.selections = at::bincount(r.choice.index_select(0, real.nonzero().view(-1)).reshape(-1), {}, c.moe.experts)
                         .to(at::kFloat);
  stats.tokens = r.choice.size(0) - padding.sum().item<int64_t>();  // the padding is on the host
}

at::Tensor experts_mlp(const ModelConfig& c, const at::Tensor& x, const Routing& r,
                       const std::vector<tiling::MlpWeights>& experts, int64_t first) {
  const int64_t d = x.size(-1), k = c.moe.top_k, tokens = x.size(0), count_here = int64_t(experts.size());
  if (first < 0 || count_here < 1 || first + count_here > c.moe.experts)
    throw std::invalid_argument("experts_mlp: experts [" + std::to_string(first) + ", " +
                                std::to_string(first + count_here) + ") of a model of " +
                                std::to_string(c.moe.experts));
  const at::Tensor flat = r.choice.reshape(-1);  // pair p = token p / k, its choice p % k
  // The pairs that chose one of these experts, sorted by expert, stably (each expert's tokens in
  // token order).
  at::Tensor order, chosen;
  if (count_here == c.moe.experts) {
    chosen = flat;
    order = std::get<1>(flat.sort(/*stable=*/true, 0, /*descending=*/false));
  } else {
    const at::Tensor here = (flat.ge(first).logical_and(flat.lt(first + count_here))).nonzero().view(-1);
    chosen = flat.index_select(0, here);
    order = here.index_select(0, std::get<1>(chosen.sort(/*stable=*/true, 0, false)));
  }
  if (chosen.numel() == 0) return at::zeros_like(x);  // no token chose these experts
  const at::Tensor counts = at::bincount(chosen - first, {}, count_here);  // each expert's rows, in order
  const at::Tensor xs = x.index_select(0, order.div(k, "floor"));
  at::Tensor y;
  if (tiling::grouped_mlp_supported(xs)) {
    // One grouped product a projection for all these experts (no device sync for the segments).
    y = tiling::grouped_mlp(xs, experts, counts.cumsum(0).to(at::kInt), detail::mlp_activation(c));
  } else {  // expert by expert (CUDA without bf16)
    const at::Tensor on_host = counts.cpu();  // the segments (a device sync on a GPU)
    const int64_t* count = on_host.data_ptr<int64_t>();
    std::vector<at::Tensor> ys;
    int64_t begin = 0;
    for (int64_t e = 0; e < count_here; ++e) {
      if (count[e] == 0) continue;
      ys.push_back(detail::mlp(c, xs.narrow(0, begin, count[e]), experts[size_t(e)], 0));
      begin += count[e];
    }
    y = ys.size() == 1 ? ys[0] : at::cat(ys);
  }
  y = (y * r.weight.reshape(-1).index_select(0, order).unsqueeze(-1)).to(x.scalar_type());
  // Combine: back to pair order (each pair written once), then each token's k outputs summed.
  const at::Tensor pairs = at::zeros({tokens * k, d}, y.options()).index_copy(0, order, y);
  return pairs.view({tokens, k, d}).sum(1);
}

tiling::LowRank expert_adapter(const tiling::LowRank& fused, int64_t experts, int64_t expert, int64_t row_begin,
                               int64_t rows) {
  const int64_t r = fused.a.size(0) / experts;
  tiling::LowRank l = fused;
  l.a = fused.a.narrow(0, expert * r, r);
  l.b = fused.b.narrow(0, row_begin, rows).view({rows, r, experts}).select(2, expert);
  return l;
}

at::Tensor moe_mlp(const ModelConfig& c, const at::Tensor& n, const at::Tensor& router,
                   const std::vector<tiling::MlpWeights>& experts, RouterStats& stats, const at::Tensor& padding) {
  if (int64_t(experts.size()) != c.moe.experts)
    throw std::invalid_argument("moe_mlp: " + std::to_string(experts.size()) + " experts' weights for a model of " +
                                std::to_string(c.moe.experts));
  const at::Tensor x = n.reshape({-1, n.size(-1)});
  const Routing r = route(c, detail::dense(x, router));
  routing_stats(c, r, stats, padding);
  return experts_mlp(c, x, r, experts, 0).view(n.sizes());
}

}  // namespace strata::models
