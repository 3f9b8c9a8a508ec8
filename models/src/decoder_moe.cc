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

namespace strata::models {

at::Tensor moe_mlp(const ModelConfig& c, const at::Tensor& n, const at::Tensor& router,
                   const std::vector<tiling::MlpWeights>& experts, RouterStats& stats) {
  const int64_t d = n.size(-1), k = c.moe.top_k, E = c.moe.experts;
  if (int64_t(experts.size()) != E)
    throw std::invalid_argument("moe_mlp: " + std::to_string(experts.size()) + " experts' weights for a model of " +
                                std::to_string(E));
  const at::Tensor x = n.reshape({-1, d});
  const int64_t tokens = x.size(0);
  const at::Tensor probs = at::softmax(detail::dense(x, router), -1, at::kFloat);
  auto [weight, choice] = probs.topk(k, -1);  // [tokens, k] each, torch.topk's order and ties
  if (c.moe.norm_topk) weight = weight / weight.sum(-1, /*keepdim=*/true);
  // Mixtral multiplies an expert's output by the fp32 weight and rounds the product; Qwen3-MoE
  // rounds the weights to the model's dtype first.
  if (c.hf_type == "qwen3_moe") weight = weight.to(x.scalar_type());

  const at::Tensor flat = choice.reshape(-1);  // pair p = token p / k, its choice p % k
  const at::Tensor counts = at::bincount(flat, {}, E);
  stats.probability_sum = probs.sum(0);
  stats.selections = counts.to(at::kFloat);
  stats.tokens = tokens;

  // Dispatch: the pairs sorted by expert, stably (each expert's tokens in token order).
  const at::Tensor order = std::get<1>(flat.sort(/*stable=*/true, 0, /*descending=*/false));
  const at::Tensor xs = x.index_select(0, order.div(k, "floor"));
  const at::Tensor host_counts = counts.cpu();  // the segments' bounds (a device sync on a GPU)
  const int64_t* count = host_counts.data_ptr<int64_t>();
  std::vector<at::Tensor> ys;
  int64_t begin = 0;
  for (int64_t e = 0; e < E; ++e) {
    if (count[e] == 0) continue;
    ys.push_back(detail::mlp(c, xs.narrow(0, begin, count[e]), experts.at(size_t(e)), 0));
    begin += count[e];
  }
  at::Tensor y = ys.size() == 1 ? ys[0] : at::cat(ys);
  y = (y * weight.reshape(-1).index_select(0, order).unsqueeze(-1)).to(x.scalar_type());
  // Combine: back to pair order (each pair written once), then each token's k outputs summed.
  const at::Tensor pairs = at::zeros({tokens * k, d}, y.options()).index_copy(0, order, y);
  return pairs.view({tokens, k, d}).sum(1).view(n.sizes());
}

}  // namespace strata::models
