// Private to safetensors.cc (header parsing and validation), safetensors_read.cc (files and
// checkpoints) and safetensors_write.cc (the writer): the limits and the error helpers they share.
#pragma once

#include <cstdint>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "strata/models/safetensors.h"

namespace strata::models::safetensors_detail {

using nlohmann::json;
namespace fs = std::filesystem;

// The safetensors library refuses headers above 100 MB; so do we (and we never allocate for a
// header before checking its length against the file).
constexpr uint64_t kMaxHeaderBytes = 100'000'000;

// SafetensorsError "file: what".
[[noreturn]] void fail(const std::string& file, const std::string& what);
// SafetensorsError "file: tensor 'tensor': what".
[[noreturn]] void fail_tensor(const std::string& file, const std::string& tensor,
                              const std::string& what);
// std::system_error(err) "op path".
[[noreturn]] void fail_errno(const std::string& op, const fs::path& path, int err);

// "[d0, d1, ...]".
std::string shape_string(const std::vector<int64_t>& shape);

// numel * dtype size, or false if either overflows uint64. A zero dimension makes everything 0
// regardless of the other dimensions.
bool byte_size(const std::vector<int64_t>& shape, StDType dtype, uint64_t* numel,
               uint64_t* bytes);

// Parses JSON, rejecting duplicate top-level keys and deep nesting; records top-level key order
// (when key_order is not null). Errors are SafetensorsError naming `file`.
json parse_json(const std::string& text, const std::string& file,
                std::vector<std::string>* key_order);

}  // namespace strata::models::safetensors_detail
