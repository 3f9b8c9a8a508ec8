// Many MLPs of one shape, each over its own consecutive rows of the input, as grouped matrix
// products (libtorch's _grouped_mm): a mixture of experts' experts over the tokens sorted by
// expert. One product per projection for all groups instead of one per group, which is what a GPU
// needs when each expert's share of the tokens is small; the host device runs the same products.
//
// Numbers: group g's rows are plain_mlp of those rows with group g's weights, the outputs and
// every gradient within fp32 rounding of it (the products' sums run in another order;
// tests/tiling/grouped_mlp_test.cc).
//
// Memory: each projection stacks the groups' weights ([groups, out, in]) for its product only, in
// the forward and again in the backward (with their stacked gradients there); the graph keeps
// the groups' own tensors and the intermediates of all rows. An
// inner dimension whose rows are not a multiple of 16 bytes (the grouped product's alignment) is
// padded with zeros (the input's columns and the stacked weights, copies again), and so is the
// output's width.
//
// Thread safety: a pure function of its arguments; autograd may run it on any thread.
#pragma once

#include <ATen/core/Tensor.h>

#include <vector>

#include "strata/tiling/chunked_mlp.h"

namespace strata::tiling {

// Whether grouped_mlp takes this input: on the CPU any floating dtype; on CUDA bf16 only (what
// its grouped product supports). Where it does not, a caller runs plain_mlp group by group.
bool grouped_mlp_supported(const at::Tensor& x);

// `x` [rows, d] holds group g's rows at [ends[g-1], ends[g]) (ends [groups] int32 on x's device,
// cumulative, the last = rows; a group may be empty). `w[g]` is group g's weights: all of one
// shape, with a gate, without biases; LoRA adapters either on every group's projection or on
// none, with one scaling. Returns [rows, d_out], differentiable in x and every weight. Throws
// std::invalid_argument on shapes, dtypes or weights it does not take.
at::Tensor grouped_mlp(const at::Tensor& x, const std::vector<MlpWeights>& w, const at::Tensor& ends,
                       MlpActivation act);

}  // namespace strata::tiling
