#include "strata/models/hf_io.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include <fstream>
#include <set>
#include <stdexcept>

namespace strata::models {

bool hf_stores_transposed(const ModelConfig& c, const std::string& name) {
  if (c.arch != Arch::kGpt2 || !name.ends_with(".weight")) return false;
  for (const char* s : {".attn.c_attn.", ".attn.c_proj.", ".mlp.c_fc.", ".mlp.c_proj."}) {
    if (name.find(s) != std::string::npos) return true;
  }
  return false;
}

namespace {

bool is_conv1d(const ModelConfig& c, const std::string& name) { return hf_stores_transposed(c, name); }

at::ScalarType to_aten(StDType t, const std::string& where) {
  switch (t) {
    case StDType::kF32: return at::kFloat;
    case StDType::kF16: return at::kHalf;
    case StDType::kBF16: return at::kBFloat16;
    case StDType::kF64: return at::kDouble;
    default: throw std::runtime_error(where + ": dtype " + to_string(t) + " is not floating point");
  }
}

StDType to_st(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return StDType::kF32;
    case at::kHalf: return StDType::kF16;
    case at::kBFloat16: return StDType::kBF16;
    case at::kDouble: return StDType::kF64;
    default: throw std::runtime_error("export: unsupported parameter dtype");
  }
}

std::string shape_str(at::IntArrayRef s) {
  std::string out = "[";
  for (size_t i = 0; i < s.size(); ++i) out += (i ? ", " : "") + std::to_string(s[i]);
  return out + "]";
}

}  // namespace

void load_hf_weights(Decoder& model, const SafetensorsCheckpoint& ckpt, const std::string& source) {
  const ModelConfig& c = model.config();
  std::set<std::string> used;
  at::NoGradGuard no_grad;
  for (auto& [name, param] : model.hf_parameters()) {
    std::string key = name;
    if (!ckpt.contains(key) && c.arch == Arch::kGpt2 && name.starts_with("transformer.")) {
      key = name.substr(std::string("transformer.").size());
    }
    if (!ckpt.contains(key)) throw std::runtime_error(source + ": no tensor '" + name + "'");
    used.insert(key);
    const TensorView v = ckpt.get(key);
    const bool transpose = is_conv1d(c, name);
    std::vector<int64_t> want(param.sizes().begin(), param.sizes().end());
    if (transpose) std::swap(want[0], want[1]);
    if (v.info->shape != want) {
      throw std::runtime_error(source + ": tensor '" + key + "' has shape " + shape_str(v.info->shape) +
                               ", the model (" + c.name + ") expects " + shape_str(want));
    }
    at::Tensor src = at::from_blob(const_cast<std::byte*>(v.data.data()), want,
                                   at::TensorOptions().dtype(to_aten(v.info->dtype, source + ": tensor '" + key + "'")));
    param.copy_(transpose ? src.t() : src);
  }
  std::vector<std::string> unexpected;
  for (const std::string& n : ckpt.names()) {
    if (used.count(n)) continue;
    if (n.ends_with(".attn.bias") || n.ends_with(".attn.masked_bias")) continue;  // GPT-2 masks
    if (n == "lm_head.weight" && c.tie_embeddings) continue;
    unexpected.push_back(n);
  }
  if (!unexpected.empty()) {
    std::string list;
    for (size_t i = 0; i < unexpected.size() && i < 5; ++i) list += (i ? ", " : "") + unexpected[i];
    throw std::runtime_error(source + ": " + std::to_string(unexpected.size()) +
                             " unexpected tensors for a " + c.name + " model: " + list);
  }
}

std::unique_ptr<Decoder> load_hf_model(const std::filesystem::path& dir) {
  const ModelConfig c = load_hf_config(dir / "config.json");
  auto model = std::make_unique<Decoder>(c);
  load_hf_weights(*model, SafetensorsCheckpoint(dir), dir.string());
  return model;
}

void export_hf_model(Decoder& model, const std::filesystem::path& dir) {
  std::filesystem::create_directories(dir);
  const ModelConfig& c = model.config();
  auto params = model.hf_parameters();
  std::vector<SafetensorsWriter::Spec> specs;
  for (auto& [name, p] : params) {
    std::vector<int64_t> shape(p.sizes().begin(), p.sizes().end());
    if (is_conv1d(c, name)) std::swap(shape[0], shape[1]);
    specs.push_back({name, to_st(p.scalar_type()), shape});
  }
  SafetensorsWriter w(dir / "model.safetensors", specs, {{"format", "pt"}});
  for (auto& [name, p] : params) {
    const at::Tensor t = (is_conv1d(c, name) ? p.detach().t() : p.detach()).contiguous().cpu();
    w.write(name, {static_cast<const std::byte*>(t.data_ptr()), t.nbytes()});
  }
  w.finish();
  const at::ScalarType t = params.front().second.scalar_type();
  const char* dtype = t == at::kBFloat16 ? "bfloat16"
                      : t == at::kHalf     ? "float16"
                      : t == at::kDouble   ? "float64"
                                           : "float32";
  std::ofstream cfg(dir / "config.json");
  cfg << c.to_hf_json(dtype) << "\n";
  if (!cfg.flush()) throw std::runtime_error("cannot write " + (dir / "config.json").string());
}

void ExportDirectory::check(const std::filesystem::path& out, bool overwrite, const std::string& how_to_overwrite) {
  namespace fs = std::filesystem;
  std::error_code ec;
  if (fs::exists(out, ec) && !fs::is_directory(out, ec))
    throw std::runtime_error("export: " + out.string() + " exists and is not a directory");
  if (overwrite || !fs::is_directory(out, ec) || fs::is_empty(out, ec)) return;
  std::string names;
  size_t n = 0;
  for (const auto& e : fs::directory_iterator(out))
    if (n++ < 4) names += (names.empty() ? "" : ", ") + e.path().filename().string();
  throw std::runtime_error("export: " + out.string() + " is not empty (" + names + (n > 4 ? ", ..." : "") + "); " +
                           how_to_overwrite);
}

std::filesystem::path ExportDirectory::temporary(const std::filesystem::path& out) {
  std::filesystem::path p = std::filesystem::absolute(out).lexically_normal();
  if (p.filename().empty()) p = p.parent_path();
  return p.string() + ".export-tmp";
}

ExportDirectory::ExportDirectory(const std::filesystem::path& out, bool overwrite, const std::string& how_to_overwrite)
    : out_(out), tmp_(temporary(out)) {
  check(out_, overwrite, how_to_overwrite);
  std::filesystem::remove_all(tmp_);  // a crashed export's leftovers
  std::filesystem::create_directories(tmp_);
}

ExportDirectory::~ExportDirectory() {
  std::error_code ignored;
  if (!committed_) std::filesystem::remove_all(tmp_, ignored);
}

void ExportDirectory::commit() {
  namespace fs = std::filesystem;
  fs::create_directories(out_);
  for (const char* name : {"model.safetensors", "config.json"}) fs::rename(tmp_ / name, out_ / name);
  const int fd = ::open(out_.c_str(), O_RDONLY | O_DIRECTORY);
  if (fd < 0 || ::fsync(fd) != 0) {
    const int err = errno;
    if (fd >= 0) ::close(fd);
    throw std::runtime_error("export: cannot sync the directory " + out_.string() + ": " + std::strerror(err));
  }
  ::close(fd);
  fs::remove(tmp_);
  committed_ = true;
}

}  // namespace strata::models
