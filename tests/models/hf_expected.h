// Shared by the models tests against transformers (hf_oracle.py): running the oracle, a tensor of
// a model directory's expected.safetensors (input ids, logits), and the relative error the
// comparisons bound.
#pragma once

#include <ATen/ATen.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <sstream>
#include <string>

#include "strata/models/safetensors.h"

namespace strata::models::test_oracle {

// Runs a shell command quietly; when it fails, prints what it wrote (the oracle's error or its
// measured difference) to stderr, so that a failing comparison says why. Returns its status.
inline int run(const std::string& cmd) {
  const std::filesystem::path log = std::filesystem::temp_directory_path() /
                                    ("strata-oracle-" + std::to_string(::getpid()) + "-" + std::to_string(std::rand()));
  const int status = std::system((cmd + " >'" + log.string() + "' 2>&1").c_str());
  if (status != 0) {
    std::stringstream out;
    out << std::ifstream(log).rdbuf();
    std::cerr << "`" << cmd << "` failed (" << status << "):\n" << out.str() << "\n";
  }
  std::filesystem::remove(log);
  return status;
}

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
