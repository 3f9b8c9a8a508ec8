// What a step or an evaluation takes from its caller, checked before anything changes: token ids
// int64 [rows, seq_len + 1], and where given a loss mask uint8/bool [rows, seq_len] and examples'
// segments int64 [rows, seq_len]. Throws std::invalid_argument naming what is wrong.
// Thread safety: a pure function.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>

namespace strata::engine::runtime {

void check_step_inputs(const at::Tensor& ids, const at::Tensor& loss_mask, const at::Tensor& segments, int64_t rows,
                       int64_t seq_len);

}  // namespace strata::engine::runtime
