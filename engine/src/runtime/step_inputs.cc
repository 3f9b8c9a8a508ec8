// A step's inputs checked (step_inputs.h).
#include "runtime/step_inputs.h"

#include <stdexcept>
#include <string>

namespace strata::engine::runtime {

void check_step_inputs(const at::Tensor& ids, const at::Tensor& loss_mask, const at::Tensor& segments, int64_t rows,
                       int64_t seq_len) {
  const int64_t T = seq_len;
  if (ids.dim() != 2 || ids.size(0) != rows || ids.size(1) != T + 1 || ids.scalar_type() != at::kLong)
    throw std::invalid_argument("train_step: ids must be int64 [" + std::to_string(rows) +
                                " (grad_accum * micro_batch for a step), seq_len + 1 = " + std::to_string(T + 1) + "]");
  if (loss_mask.defined() &&
      (loss_mask.dim() != 2 || loss_mask.size(0) != rows || loss_mask.size(1) != T ||
       (loss_mask.scalar_type() != at::kByte && loss_mask.scalar_type() != at::kBool)))
    throw std::invalid_argument("train_step: loss_mask must be uint8 or bool [" + std::to_string(rows) +
                                ", seq_len = " + std::to_string(T) + "]");
  if (segments.defined() && (segments.dim() != 2 || segments.size(0) != rows || segments.size(1) != T ||
                             segments.scalar_type() != at::kLong))
    throw std::invalid_argument("train_step: segments must be int64 [" + std::to_string(rows) +
                                ", seq_len = " + std::to_string(T) + "]");
}

}  // namespace strata::engine::runtime
