// Shared by the checkpoint suites (checkpoint_*_test.cc): a tensor read back from a safetensors
// file, and a command whose output goes to a file.
#pragma once

#include <ATen/ATen.h>
#include <sys/wait.h>

#include <cstddef>
#include <cstdlib>
#include <filesystem>
#include <string>

#include "strata/models/safetensors.h"

namespace strata::test {

namespace sm = strata::models;

inline at::Tensor st_tensor(const sm::SafetensorsFile& f, const std::string& name) {
  const sm::TensorView v = f.get(name);
  const auto dtype = v.info->dtype == sm::StDType::kBF16  ? at::kBFloat16
                     : v.info->dtype == sm::StDType::kF16 ? at::kHalf
                     : v.info->dtype == sm::StDType::kI64 ? at::kLong
                                                          : at::kFloat;
  return at::from_blob(const_cast<std::byte*>(v.data.data()), v.info->shape, dtype).clone();
}

// Runs `cmd` with its stdout and stderr in `out`; its exit status (-1: it did not exit).
inline int run_quiet(const std::string& cmd, const std::filesystem::path& out) {
  const int st = std::system((cmd + " > " + out.string() + " 2>&1").c_str());
  return WIFEXITED(st) ? WEXITSTATUS(st) : -1;
}

}  // namespace strata::test
