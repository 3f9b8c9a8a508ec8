#include "strata/models/quant4_checkpoint.h"

#include <ATen/ATen.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <cstring>
#include <stdexcept>

#include "strata/kernels/quant4.h"

namespace strata::models {

namespace {

const std::string kState = ".quant_state.bitsandbytes__";

std::string shape_text(const std::vector<int64_t>& s) {
  std::string out = "[";
  for (size_t i = 0; i < s.size(); ++i) out += (i ? ", " : "") + std::to_string(s[i]);
  return out + "]";
}

// Tensor `key` of the checkpoint, checked to be `dtype` with `numel` elements.
TensorView part(const SafetensorsCheckpoint& ckpt, const std::string& key, StDType dtype, uint64_t numel,
                const std::string& source) {
  if (!ckpt.contains(key))
    throw std::runtime_error(source + ": no tensor '" + key + "' (a weight saved in 4 bits needs it beside it)");
  TensorView v = ckpt.get(key);
  if (v.info->dtype != dtype || v.info->numel() != numel)
    throw std::runtime_error(source + ": tensor '" + key + "' is " + to_string(v.info->dtype) + " " +
                             shape_text(v.info->shape) + ", expected " + to_string(dtype) + " of " +
                             std::to_string(numel) + " elements");
  return v;
}

// The saved code table holds Strata's (bitsandbytes') values (FP4's zero at index 8 is saved +0,
// which Strata decodes as bitsandbytes' scalar CPU kernel does: kernels/quant4.h).
void check_table(const TensorView& v, const float* want, size_t n, const std::string& key, const std::string& what,
                 const std::string& source) {
  std::vector<float> saved(n);
  std::memcpy(saved.data(), v.data.data(), n * sizeof(float));  // the file's bytes are not aligned
  if (!std::equal(saved.begin(), saved.end(), want))
    throw std::runtime_error(source + ": tensor '" + key + "' is not bitsandbytes' " + what +
                             " table (a custom code table is not supported)");
}

std::string state_key(const SafetensorsCheckpoint& ckpt, const std::string& key) {
  for (const char* t : {"nf4", "fp4"})
    if (ckpt.contains(key + kState + t)) return key + kState + t;
  return "";
}

}  // namespace

std::string quant4_statistic_of(const std::string& key) {
  for (const std::string s : {".nested_absmax", ".nested_quant_map", ".absmax", ".quant_map"})
    if (key.ends_with(s)) return key.substr(0, key.size() - s.size());
  const size_t at = key.rfind(kState);
  return at == std::string::npos ? "" : key.substr(0, at);
}

bool saved_in_4bit(const SafetensorsCheckpoint& ckpt, const std::string& key) { return !state_key(ckpt, key).empty(); }

SavedQuant4 read_quant4_state(const SafetensorsCheckpoint& ckpt, const std::string& key, const std::string& source) {
  const std::string sk = state_key(ckpt, key);
  if (sk.empty()) throw std::runtime_error(source + ": tensor '" + key + "' is not saved in 4 bits (no quant_state)");
  const TensorView sv = ckpt.get(sk);
  if (sv.info->dtype != StDType::kU8)
    throw std::runtime_error(source + ": tensor '" + sk + "' is " + to_string(sv.info->dtype) + ", not U8 (JSON bytes)");
  SavedQuant4 out;
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(std::string(reinterpret_cast<const char*>(sv.data.data()), sv.data.size()));
    out.settings.load_in_4bit = true;
    out.settings.quant_type = j.at("quant_type").get<std::string>();
    out.settings.blocksize = j.at("blocksize").get<int64_t>();
    out.shape = j.at("shape").get<std::vector<int64_t>>();
    out.settings.double_quant = j.contains("nested_offset");
    if (out.settings.double_quant) {
      out.offset = j.at("nested_offset").get<float>();
      if (j.at("nested_blocksize").get<int64_t>() != kernels::kQuant4NestedBlocksize)
        throw std::runtime_error("nested_blocksize " + j.at("nested_blocksize").dump() + " is not " +
                                 std::to_string(kernels::kQuant4NestedBlocksize));
    }
  } catch (const std::exception& e) {
    throw std::runtime_error(source + ": tensor '" + sk + "' is not a bitsandbytes quant_state: " + e.what());
  }
  if (sk.compare(sk.size() - 3, 3, out.settings.quant_type) != 0)
    throw std::runtime_error(source + ": tensor '" + sk + "' says quant_type \"" + out.settings.quant_type + "\"");
  const kernels::Quant4 type = kernels::quant4_from_string(out.settings.quant_type);
  const int64_t bs = out.settings.blocksize;
  if (bs < 32 || bs > 4096 || (bs & (bs - 1)) != 0)
    throw std::runtime_error(source + ": tensor '" + sk + "' has blocksize " + std::to_string(bs));
  int64_t n = 1;
  for (int64_t d : out.shape) {
    if (d < 1) throw std::runtime_error(source + ": tensor '" + sk + "' has shape " + shape_text(out.shape));
    n *= d;
  }
  part(ckpt, key, StDType::kU8, uint64_t(kernels::quant4_packed_bytes(n)), source);
  const uint64_t blocks = uint64_t(kernels::quant4_blocks(n, bs));
  part(ckpt, key + ".absmax", out.settings.double_quant ? StDType::kU8 : StDType::kF32, blocks, source);
  check_table(part(ckpt, key + ".quant_map", StDType::kF32, 16, source), kernels::quant4_codes(type), 16,
              key + ".quant_map", out.settings.quant_type, source);
  if (out.settings.double_quant) {
    part(ckpt, key + ".nested_absmax", StDType::kF32, uint64_t(kernels::quant4_nested_blocks(n, bs)), source);
    check_table(part(ckpt, key + ".nested_quant_map", StDType::kF32, 256, source), kernels::dynamic_map_8bit(), 256,
                key + ".nested_quant_map", "dynamic 8-bit", source);
  }
  return out;
}

namespace {

// The record of weight `key`, whose quant_state `s` read_quant4_state has checked, into `record`.
void copy_record(const SafetensorsCheckpoint& ckpt, const std::string& key, const SavedQuant4& s,
                 std::span<std::byte> record) {
  uint64_t n = 1;
  for (int64_t d : s.shape) n *= uint64_t(d);
  const Quant4Record r = quant4_record(n, s.settings);
  if (record.size() < r.bytes())
    throw std::logic_error("read_quant4_record: a record of " + std::to_string(record.size()) + " bytes for " +
                           std::to_string(r.bytes()));
  const auto copy = [&](uint64_t at, const std::string& k, uint64_t bytes) {
    std::memcpy(record.data() + at, ckpt.get(k).data.data(), bytes);
  };
  if (s.settings.double_quant) {
    std::memcpy(record.data(), &s.offset, sizeof(float));
    copy(r.nested_at(), key + ".nested_absmax", r.nested_bytes);
  }
  copy(r.absmax_at(), key + ".absmax", r.absmax_bytes);
  copy(r.packed_at(), key, r.packed_bytes);
}

}  // namespace

void read_quant4_record(const SafetensorsCheckpoint& ckpt, const std::string& key, const QuantizedBase& q,
                        std::span<std::byte> record, const std::string& source) {
  const SavedQuant4 s = read_quant4_state(ckpt, key, source);
  if (s.settings.quant_type != q.quant_type || s.settings.double_quant != q.double_quant ||
      s.settings.blocksize != q.blocksize)
    throw std::runtime_error(source + ": tensor '" + key + "' is saved in " + s.settings.describe() +
                             ", the run's model.quantize is " + q.describe());
  copy_record(ckpt, key, s, record);
}

at::Tensor dequantize_saved_4bit(const SafetensorsCheckpoint& ckpt, const std::string& key, const std::string& source) {
  const SavedQuant4 s = read_quant4_state(ckpt, key, source);
  int64_t n = 1;
  for (int64_t d : s.shape) n *= d;
  // Copied into a record first: a safetensors file does not align its tensors' bytes.
  at::Tensor record = at::empty({int64_t(quant4_record(uint64_t(n), s.settings).bytes())}, at::kByte);
  copy_record(ckpt, key, s, {static_cast<std::byte*>(record.data_ptr()), size_t(record.numel())});
  at::Tensor out = at::empty(s.shape, at::kFloat);
  dequantize_record({static_cast<const std::byte*>(record.const_data_ptr()), size_t(record.numel())}, s.settings, out);
  return out;
}

namespace {

kernels::DType kernel_dtype(at::ScalarType t) {
  if (t == at::kFloat) return kernels::DType::kF32;
  if (t == at::kBFloat16) return kernels::DType::kBF16;
  if (t == at::kHalf) return kernels::DType::kF16;
  throw std::invalid_argument(std::string("4-bit weights: dtype ") + at::toString(t) + " is not fp32, bf16 or fp16");
}

void check_cpu(const at::Tensor& t, const char* what) {
  if (!t.is_cpu() || !t.is_contiguous()) throw std::invalid_argument(std::string(what) + ": a contiguous CPU tensor");
}

}  // namespace

float quant4_offset(const at::Tensor& w, const QuantizedBase& q) {
  if (!q.double_quant) return 0;
  check_cpu(w, "quant4_offset");
  at::Tensor absmax = at::empty({kernels::quant4_blocks(w.numel(), q.blocksize)}, at::kFloat);
  kernels::quant4_absmax(w.const_data_ptr(), kernel_dtype(w.scalar_type()), w.numel(), q.blocksize,
                         absmax.data_ptr<float>());
  return at::mean(absmax).item<float>();
}

void quantize_record(const at::Tensor& w, const QuantizedBase& q, float offset, std::span<std::byte> record) {
  check_cpu(w, "quantize_record");
  const Quant4Record r = quant4_record(uint64_t(w.numel()), q);
  if (record.size() < r.bytes()) throw std::logic_error("quantize_record: the record is too short");
  const kernels::Quant4 type = kernels::quant4_from_string(q.quant_type);
  auto* packed = reinterpret_cast<uint8_t*>(record.data() + r.packed_at());
  std::byte* absmax = record.data() + r.absmax_at();
  if (!q.double_quant) {
    kernels::quantize_4bit(w.const_data_ptr(), kernel_dtype(w.scalar_type()), w.numel(), type, q.blocksize, packed,
                           reinterpret_cast<float*>(absmax));
    return;
  }
  std::memcpy(record.data(), &offset, sizeof(float));
  kernels::quantize_4bit_nested(w.const_data_ptr(), kernel_dtype(w.scalar_type()), w.numel(), type, q.blocksize,
                                offset, packed, reinterpret_cast<uint8_t*>(absmax),
                                reinterpret_cast<float*>(record.data() + r.nested_at()));
}

void dequantize_record(std::span<const std::byte> record, const QuantizedBase& q, const at::Tensor& out) {
  check_cpu(out, "dequantize_record");
  const Quant4Record r = quant4_record(uint64_t(out.numel()), q);
  if (record.size() < r.bytes()) throw std::logic_error("dequantize_record: the record is too short");
  const kernels::Quant4 type = kernels::quant4_from_string(q.quant_type);
  const auto* packed = reinterpret_cast<const uint8_t*>(record.data() + r.packed_at());
  const std::byte* absmax = record.data() + r.absmax_at();
  if (!q.double_quant) {
    kernels::dequantize_4bit(packed, reinterpret_cast<const float*>(absmax), out.numel(), type, q.blocksize,
                             out.data_ptr(), kernel_dtype(out.scalar_type()));
    return;
  }
  float offset = 0;
  std::memcpy(&offset, record.data(), sizeof(float));
  kernels::dequantize_4bit_nested(packed, reinterpret_cast<const uint8_t*>(absmax),
                                  reinterpret_cast<const float*>(record.data() + r.nested_at()), offset, out.numel(),
                                  type, q.blocksize, out.data_ptr(), kernel_dtype(out.scalar_type()));
}

at::Tensor quantized_dequantized(const at::Tensor& w, const QuantizedBase& q, at::ScalarType compute) {
  const at::Tensor c = w.to(at::kCPU, compute).contiguous();
  at::Tensor record = at::zeros({int64_t(quant4_record(uint64_t(c.numel()), q).bytes())}, at::kByte);
  const std::span<std::byte> bytes{static_cast<std::byte*>(record.data_ptr()), size_t(record.numel())};
  quantize_record(c, q, quant4_offset(c, q), bytes);
  at::Tensor out = at::empty(c.sizes(), at::TensorOptions().dtype(compute));
  dequantize_record(bytes, q, out);
  return out.to(at::kFloat);
}

}  // namespace strata::models
