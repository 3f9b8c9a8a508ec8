// Shared by the models tests against transformers (hf_oracle.py): a tensor of a model directory's
// expected.safetensors (input ids, logits), and the relative error the comparisons bound.
#pragma once

#include <ATen/ATen.h>

#include <filesystem>
#include <string>

#include "strata/models/safetensors.h"

namespace strata::models::test_oracle {

// max |got - want| / max |want|.
inline double relative_error(const at::Tensor& got, const at::Tensor& want) {
  return ((got - want).abs().max() / want.abs().max()).item<double>();
}

// Tensor `name` of dir/expected.safetensors (int64 ids or fp32 values), copied.
inline at::Tensor expected(const std::filesystem::path& dir, const std::string& name) {
  SafetensorsFile f(dir / "expected.safetensors");
  const TensorView v = f.get(name);
  const auto dtype = v.info->dtype == StDType::kI64 ? at::kLong : at::kFloat;
  return at::from_blob(const_cast<std::byte*>(v.data.data()), v.info->shape, dtype).clone();
}

}  // namespace strata::models::test_oracle
