// Safetensors headers: the dtypes, and the parsing and validation of a header (see
// safetensors.h). Files and checkpoints are read in safetensors_read.cc, written in
// safetensors_write.cc; safetensors_internal.h holds what the three share.
#include "strata/models/safetensors.h"

#include <algorithm>
#include <limits>
#include <nlohmann/json.hpp>
#include <string>
#include <system_error>
#include <unordered_set>
#include <utility>

#include "safetensors_internal.h"

namespace strata::models {

using namespace safetensors_detail;

namespace safetensors_detail {

[[noreturn]] void fail(const std::string& file, const std::string& what) {
  throw SafetensorsError(file + ": " + what);
}

[[noreturn]] void fail_tensor(const std::string& file, const std::string& tensor,
                              const std::string& what) {
  throw SafetensorsError(file + ": tensor '" + tensor + "': " + what);
}

[[noreturn]] void fail_errno(const std::string& op, const fs::path& path, int err) {
  throw std::system_error(err, std::generic_category(), op + " " + path.string());
}

std::string shape_string(const std::vector<int64_t>& shape) {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + "]";
}

// numel * dtype size, or false if either overflows uint64. A zero dimension makes everything 0
// regardless of the other dimensions.
bool byte_size(const std::vector<int64_t>& shape, StDType dtype, uint64_t* numel,
               uint64_t* bytes) {
  uint64_t n = 1;
  if (std::find(shape.begin(), shape.end(), 0) != shape.end()) {
    n = 0;
  } else {
    for (int64_t d : shape) {
      const uint64_t u = static_cast<uint64_t>(d);
      if (n > std::numeric_limits<uint64_t>::max() / u) return false;
      n *= u;
    }
  }
  const uint64_t size = st_dtype_bytes(dtype);
  if (n > std::numeric_limits<uint64_t>::max() / size) return false;
  *numel = n;
  *bytes = n * size;
  return true;
}

}  // namespace safetensors_detail

namespace {

// A valid header nests three deep ({name: {shape: [..]}}); anything much deeper is garbage, and
// refusing it early bounds the parser's memory on hostile input.
constexpr int kMaxJsonDepth = 16;

// A JSON number that is a non-negative integer (not 3.0, not "3"), or false.
bool json_uint(const json& v, uint64_t* out) {
  if (v.is_number_unsigned()) {
    *out = v.get<uint64_t>();
    return true;
  }
  if (v.is_number_integer() && v.get<int64_t>() >= 0) {
    *out = static_cast<uint64_t>(v.get<int64_t>());
    return true;
  }
  return false;
}

TensorInfo parse_tensor(const std::string& file, const std::string& name, const json& entry,
                        uint64_t data_bytes) {
  if (!entry.is_object()) fail_tensor(file, name, "entry is " + std::string(entry.type_name()) +
                                                      ", not an object");
  TensorInfo info;
  info.name = name;

  const auto dt = entry.find("dtype");
  if (dt == entry.end() || !dt->is_string()) fail_tensor(file, name, "dtype missing or not a string");
  try {
    info.dtype = parse_st_dtype(dt->get<std::string>());
  } catch (const SafetensorsError& e) {
    fail_tensor(file, name, e.what());
  }

  const auto sh = entry.find("shape");
  if (sh == entry.end() || !sh->is_array()) fail_tensor(file, name, "shape missing or not an array");
  for (const json& d : *sh) {
    uint64_t u = 0;
    if (!json_uint(d, &u) || u > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
      fail_tensor(file, name, "shape " + sh->dump() + " is not a list of non-negative integers");
    }
    info.shape.push_back(static_cast<int64_t>(u));
  }

  const auto off = entry.find("data_offsets");
  uint64_t begin = 0, end = 0;
  if (off == entry.end() || !off->is_array() || off->size() != 2 || !json_uint((*off)[0], &begin) ||
      !json_uint((*off)[1], &end)) {
    fail_tensor(file, name,
                "data_offsets " + (off == entry.end() ? std::string("missing") : off->dump()) +
                    " is not a pair [begin, end] of non-negative integers");
  }
  const std::string range = "data_offsets [" + std::to_string(begin) + ", " + std::to_string(end) + ")";
  if (begin > end) fail_tensor(file, name, range + " end before they begin");
  if (end > data_bytes) {
    fail_tensor(file, name, range + " go beyond the data section of " + std::to_string(data_bytes) +
                                " bytes (truncated file?)");
  }
  info.begin = begin;
  info.end = end;

  uint64_t numel = 0, bytes = 0;
  if (!byte_size(info.shape, info.dtype, &numel, &bytes)) {
    fail_tensor(file, name, "shape " + shape_string(info.shape) + " of " + to_string(info.dtype) +
                                " overflows 64 bits");
  }
  if (bytes != info.bytes()) {
    fail_tensor(file, name, range + " hold " + std::to_string(info.bytes()) + " bytes but shape " +
                                shape_string(info.shape) + " of " + to_string(info.dtype) +
                                " needs " + std::to_string(bytes));
  }
  return info;
}

// Sorts tensors into file order (by data offset; JSON order among equal offsets) and checks that
// no two share a byte. Gaps between tensors are allowed.
void sort_and_check_overlaps(std::vector<TensorInfo>* tensors, const std::string& file) {
  std::stable_sort(tensors->begin(), tensors->end(), [](const TensorInfo& a, const TensorInfo& b) {
    return a.begin != b.begin ? a.begin < b.begin : a.end < b.end;
  });
  const TensorInfo* prev = nullptr;  // the last tensor holding at least one byte
  for (const TensorInfo& t : *tensors) {
    if (t.bytes() == 0) continue;  // holds no byte, overlaps nothing
    if (prev != nullptr && t.begin < prev->end) {
      fail_tensor(file, t.name,
                  "data_offsets [" + std::to_string(t.begin) + ", " + std::to_string(t.end) +
                      ") overlap tensor '" + prev->name + "' at [" + std::to_string(prev->begin) +
                      ", " + std::to_string(prev->end) + ")");
    }
    prev = &t;
  }
}

}  // namespace

namespace safetensors_detail {

// Parses JSON, rejecting duplicate top-level keys and deep nesting; records top-level key order.
json parse_json(const std::string& text, const std::string& file,
                std::vector<std::string>* key_order) {
  std::unordered_set<std::string> seen;
  auto callback = [&](int depth, json::parse_event_t event, json& parsed) {
    if ((event == json::parse_event_t::object_start ||
         event == json::parse_event_t::array_start) &&
        depth >= kMaxJsonDepth) {
      fail(file, "header JSON nests deeper than " + std::to_string(kMaxJsonDepth) + " levels");
    }
    if (event == json::parse_event_t::key && depth == 1 && key_order != nullptr) {
      const std::string& key = parsed.get_ref<const std::string&>();
      if (!seen.insert(key).second) fail(file, "header names '" + key + "' twice");
      key_order->push_back(key);
    }
    return true;
  };
  // nlohmann's lexer takes a NUL byte for the end of the input and would ignore what follows;
  // valid JSON never holds one (control characters in strings must be escaped).
  const size_t nul = text.find('\0');
  if (nul != std::string::npos) {
    fail(file, "header is not valid JSON: NUL byte at offset " + std::to_string(nul));
  }
  try {
    return json::parse(text, callback);
  } catch (const json::exception& e) {
    fail(file, std::string("header is not valid JSON: ") + e.what());
  }
}

}  // namespace safetensors_detail

const char* to_string(StDType dtype) {
  switch (dtype) {
    case StDType::kF64: return "F64";
    case StDType::kF32: return "F32";
    case StDType::kF16: return "F16";
    case StDType::kBF16: return "BF16";
    case StDType::kI64: return "I64";
    case StDType::kI32: return "I32";
    case StDType::kI16: return "I16";
    case StDType::kI8: return "I8";
    case StDType::kU8: return "U8";
    case StDType::kBool: return "BOOL";
  }
  return "?";
}

StDType parse_st_dtype(const std::string& name) {
  static const std::pair<const char*, StDType> kNames[] = {
      {"F64", StDType::kF64}, {"F32", StDType::kF32}, {"F16", StDType::kF16},
      {"BF16", StDType::kBF16}, {"I64", StDType::kI64}, {"I32", StDType::kI32},
      {"I16", StDType::kI16}, {"I8", StDType::kI8}, {"U8", StDType::kU8},
      {"BOOL", StDType::kBool}};
  for (const auto& [n, t] : kNames) {
    if (name == n) return t;
  }
  throw SafetensorsError("unknown dtype '" + name +
                         "' (supported: F64, F32, F16, BF16, I64, I32, I16, I8, U8, BOOL)");
}

size_t st_dtype_bytes(StDType dtype) {
  switch (dtype) {
    case StDType::kF64:
    case StDType::kI64: return 8;
    case StDType::kF32:
    case StDType::kI32: return 4;
    case StDType::kF16:
    case StDType::kBF16:
    case StDType::kI16: return 2;
    case StDType::kI8:
    case StDType::kU8:
    case StDType::kBool: return 1;
  }
  return 1;
}

uint64_t TensorInfo::numel() const {
  uint64_t n = 1;
  for (int64_t d : shape) n *= static_cast<uint64_t>(d);  // validated: no overflow unless 0
  return n;
}

std::vector<TensorInfo> parse_safetensors_header(const std::string& text, uint64_t data_bytes,
                                                 const std::string& file,
                                                 std::map<std::string, std::string>* metadata) {
  std::vector<std::string> order;
  const json root = parse_json(text, file, &order);
  if (!root.is_object()) {
    fail(file, std::string("header is a JSON ") + root.type_name() + ", not an object");
  }
  std::vector<TensorInfo> tensors;
  tensors.reserve(order.size());
  std::map<std::string, std::string> meta;
  for (const std::string& key : order) {
    const json& value = root.at(key);
    if (key == "__metadata__") {
      if (!value.is_object()) fail(file, "__metadata__ is not an object");
      for (const auto& [k, v] : value.items()) {
        if (!v.is_string()) fail(file, "__metadata__ value of '" + k + "' is not a string");
        meta.emplace(k, v.get<std::string>());
      }
      continue;
    }
    tensors.push_back(parse_tensor(file, key, value, data_bytes));
  }
  sort_and_check_overlaps(&tensors, file);
  if (metadata != nullptr) *metadata = std::move(meta);
  return tensors;
}

}  // namespace strata::models
