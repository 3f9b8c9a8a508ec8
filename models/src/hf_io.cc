#include "strata/models/hf_io.h"

#include "strata/models/moe.h"
#include "strata/models/peft.h"
#include "strata/models/quant4_checkpoint.h"
#include "strata/models/sharded_safetensors.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include <fstream>
#include <set>
#include <stdexcept>
#include <vector>

namespace strata::models {

bool hf_stores_transposed(const ModelConfig& c, const std::string& name) {
  // LoRA adapters are nn.Linear weights in PEFT, GPT-2's too (fan_in_fan_out concerns merging).
  if (c.arch != Arch::kGpt2 || !name.ends_with(".weight") || is_adapter_tensor(name)) return false;
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

// The checkpoint's key of tensor `name`: GPT-2 checkpoints saved from GPT2Model have no
// "transformer." prefix.
std::string hf_key(const ModelConfig& c, const SafetensorsCheckpoint& ckpt, const std::string& name,
                   const std::string& source) {
  std::string key = name;
  if (!ckpt.contains(key) && c.arch == Arch::kGpt2 && name.starts_with("transformer."))
    key = name.substr(std::string("transformer.").size());
  if (!ckpt.contains(key)) throw std::runtime_error(source + ": no tensor '" + name + "'");
  return key;
}

}  // namespace

at::Tensor read_hf_tensor(const ModelConfig& c, const SafetensorsCheckpoint& ckpt, const std::string& name,
                          const std::string& source) {
  const std::string key = hf_key(c, ckpt, name, source);
  at::Tensor f;
  if (saved_in_4bit(ckpt, key)) {
    f = dequantize_saved_4bit(ckpt, key, source);
  } else {
    const TensorView v = ckpt.get(key);
    const at::Tensor src =
        at::from_blob(const_cast<std::byte*>(v.data.data()), v.info->shape,
                      at::TensorOptions().dtype(to_aten(v.info->dtype, source + ": tensor '" + key + "'")));
    f = src.to(at::kFloat, /*non_blocking=*/false, /*copy=*/true);
  }
  return is_conv1d(c, name) ? f.t().contiguous() : f;
}

std::vector<int64_t> hf_tensor_shape(const ModelConfig& c, const SafetensorsCheckpoint& ckpt, const std::string& name,
                                     const std::string& source) {
  const std::string key = hf_key(c, ckpt, name, source);
  return saved_in_4bit(ckpt, key) ? read_quant4_state(ckpt, key, source).shape : ckpt.get(key).info->shape;
}

namespace {

// The checkpoint's key `key` into `dst` (fp32, Strata's layout), its shape checked: `tensor` is
// the model's name of it, `what` how an error names the model's side.
void copy_tensor(const ModelConfig& c, const SafetensorsCheckpoint& ckpt, const std::string& key,
                 const std::string& tensor, at::Tensor& dst, const std::string& source, const std::string& what) {
  const bool transpose = is_conv1d(c, tensor);
  std::vector<int64_t> want(dst.sizes().begin(), dst.sizes().end());
  if (transpose) std::swap(want[0], want[1]);
  at::NoGradGuard no_grad;
  const TensorView v = ckpt.get(key);
  const at::Tensor src = saved_in_4bit(ckpt, key)  // read as its dequantization
                             ? dequantize_saved_4bit(ckpt, key, source)
                             : at::from_blob(const_cast<std::byte*>(v.data.data()), v.info->shape,
                                             at::TensorOptions().dtype(to_aten(v.info->dtype, source + ": tensor '" + key + "'")));
  if (src.sizes() != at::IntArrayRef(want))
    throw std::runtime_error(source + ": tensor '" + key + "' has shape " + shape_str(src.sizes()) + ", " + what +
                             " expects " + shape_str(want));
  dst.copy_(transpose ? src.t() : src);
}

// Every tensor of the model but its adapters is in the checkpoint (the first missing one named),
// and nothing else is (the unexpected ones counted, the first five named).
void check_model_tensors(const ModelConfig& c, const SafetensorsCheckpoint& ckpt, const std::string& source) {
  std::set<std::string> used;
  for (const std::string& name : tensor_names(c))
    if (!is_adapter_tensor(name)) used.insert(hf_key(c, ckpt, name, source));
  std::vector<std::string> unexpected;
  for (const std::string& n : ckpt.names()) {
    if (used.count(n)) continue;
    if (const std::string w = quant4_statistic_of(n); !w.empty() && used.count(w) && saved_in_4bit(ckpt, w)) continue;
    if (n.ends_with(".attn.bias") || n.ends_with(".attn.masked_bias")) continue;  // GPT-2 masks
    if (n == "lm_head.weight" && c.tie_embeddings) continue;
    unexpected.push_back(n);
  }
  if (!unexpected.empty()) {
    std::string list;
    for (size_t i = 0; i < unexpected.size() && i < 5; ++i) list += (i ? ", " : "") + unexpected[i];
    throw std::runtime_error(source + ": " + std::to_string(unexpected.size()) + " unexpected tensors for a " + c.name +
                             " model: " + list);
  }
}

// Every tensor of a PEFT adapter directory the model takes from it (adapters, modules_to_save)
// is there, and nothing else is.
void check_adapter_tensors(const ModelConfig& c, const SafetensorsCheckpoint& ckpt, const std::string& source) {
  std::set<std::string> used;
  for (const std::string& name : tensor_names(c)) {
    if (!in_adapter_export(c, name)) continue;
    const std::string key = peft_key(c, name);
    if (!ckpt.contains(key))
      throw std::runtime_error(source + ": no " +
                               (is_adapter_tensor(name) ? "adapter tensor" : "tensor of model.lora's modules_to_save") +
                               " '" + key + "'");
    used.insert(key);
  }
  for (const std::string& n : ckpt.names())
    if (!used.count(n))
      throw std::runtime_error(source + ": tensor '" + n + "' is no adapter of this model nor a tensor of its " +
                               "modules_to_save (model.lora)");
}

}  // namespace

void load_hf_weights(Decoder& model, const SafetensorsCheckpoint& ckpt, const std::string& source) {
  const ModelConfig& c = model.config();
  check_model_tensors(c, ckpt, source);
  for (auto& [name, param] : model.hf_parameters())
    if (!is_adapter_tensor(name))  // LoRA: initialized, or the adapter directory's
      copy_tensor(c, ckpt, hf_key(c, ckpt, name, source), name, param, source, "the model (" + c.name + ")");
}

Decoder::TensorSource hf_model_source(const ModelConfig& c, const std::filesystem::path& dir) {
  return hf_model_source(c, std::make_shared<const SafetensorsCheckpoint>(dir), dir.string());
}

namespace {

// The 4-bit weights a model with c.quantize stores that `ckpt` holds saved in 4 bits, as records.
Decoder::RecordSource saved_records(const ModelConfig& c, std::shared_ptr<const SafetensorsCheckpoint> ckpt,
                                    const std::string& source) {
  Decoder::RecordSource r;
  r.holds = [c, ckpt](const std::string& name) { return stored_4bit(c, name) && saved_in_4bit(*ckpt, name); };
  r.read = [c, ckpt, source](const std::string& name, std::span<std::byte> record) {
    read_quant4_record(*ckpt, name, c.quantize, record, source);
  };
  return r;
}

}  // namespace

Decoder::TensorSource hf_model_source(const ModelConfig& c, std::shared_ptr<const SafetensorsCheckpoint> ckpt,
                                      const std::string& source) {
  check_model_tensors(c, *ckpt, source);
  return [c, ckpt, source](const std::string& name, at::Tensor& whole) {
    if (is_adapter_tensor(name)) return false;
    copy_tensor(c, *ckpt, hf_key(c, *ckpt, name, source), name, whole, source, "the model (" + c.name + ")");
    return true;
  };
}

Decoder::TensorSource peft_adapter_source(const ModelConfig& c, const std::filesystem::path& dir) {
  const std::filesystem::path file = dir / kAdapterWeightsFile;
  auto ckpt = std::make_shared<const SafetensorsCheckpoint>(file);
  const std::string source = file.string();
  check_adapter_tensors(c, *ckpt, source);
  return [c, ckpt, source](const std::string& name, at::Tensor& whole) {
    if (!in_adapter_export(c, name)) return false;
    const std::string what = is_adapter_tensor(name) ? "the model's adapter (r " + std::to_string(c.lora.r) + ")"
                                                     : std::string("the model");
    copy_tensor(c, *ckpt, peft_key(c, name), name, whole, source, what);
    return true;
  };
}

std::unique_ptr<Decoder> open_hf_model(const std::filesystem::path& dir, const ModelConfig::Lora& lora,
                                       const std::filesystem::path& adapter_dir, const QuantizedBase& quantize) {
  ModelConfig c = load_hf_config(dir / "config.json");
  c.lora = lora;
  c.quantize = quantize;
  auto model = std::make_unique<Decoder>(c, 0, Decoder::Init::kDeferred);
  auto ckpt = std::make_shared<const SafetensorsCheckpoint>(dir);
  Decoder::TensorSource base = hf_model_source(model->config(), ckpt, dir.string());
  if (quantize.enabled()) model->set_record_source(saved_records(model->config(), ckpt, dir.string()));
  if (adapter_dir.empty()) {
    model->set_source(std::move(base));
  } else {
    Decoder::TensorSource adapter = peft_adapter_source(model->config(), adapter_dir);
    model->set_source([base, adapter](const std::string& name, at::Tensor& whole) {
      return adapter(name, whole) || base(name, whole);
    });
  }
  return model;
}

std::unique_ptr<Decoder> load_hf_model(const std::filesystem::path& dir, const ModelConfig::Lora& lora) {
  std::unique_ptr<Decoder> model = open_hf_model(dir, lora);
  model->initialize_through(model->stages().size() - 1);
  return model;
}

const char* hf_dtype_name(at::ScalarType t) {
  return t == at::kBFloat16 ? "bfloat16" : t == at::kHalf ? "float16" : t == at::kDouble ? "float64" : "float32";
}

at::ScalarType parse_export_dtype(const std::string& name) {
  if (name == "float32") return at::kFloat;
  if (name == "bfloat16") return at::kBFloat16;
  if (name == "float16") return at::kHalf;
  throw std::invalid_argument("export dtype '" + name + "' is not float32, bfloat16 or float16");
}

void export_hf_model(Decoder& model, const std::filesystem::path& dir, std::optional<at::ScalarType> dtype,
                     uint64_t max_shard_bytes) {
  std::filesystem::create_directories(dir);
  const ModelConfig& c = model.config();
  auto params = model.hf_parameters();
  const at::ScalarType out_type = dtype.value_or(params.front().second.scalar_type());
  std::vector<SafetensorsWriter::Spec> specs;
  for (auto& [name, p] : params) {
    std::vector<int64_t> shape(p.sizes().begin(), p.sizes().end());
    if (is_conv1d(c, name)) std::swap(shape[0], shape[1]);
    specs.push_back({name, to_st(out_type), shape});
  }
  ShardedSafetensorsWriter w(dir, specs, max_shard_bytes, {{"format", "pt"}});
  for (auto& [name, p] : params) {
    const at::Tensor t = (is_conv1d(c, name) ? p.detach().t() : p.detach()).to(at::kCPU, out_type).contiguous();
    w.write(name, {static_cast<const std::byte*>(t.data_ptr()), t.nbytes()});
  }
  w.finish();
  std::ofstream cfg(dir / "config.json");
  cfg << c.to_hf_json(hf_dtype_name(out_type)) << "\n";
  if (!cfg.flush()) throw std::runtime_error("cannot write " + (dir / "config.json").string());
}

std::vector<std::string> copy_tokenizer_files(const std::filesystem::path& from, const std::filesystem::path& to) {
  namespace fs = std::filesystem;
  static const char* kFiles[] = {"tokenizer.json",     "tokenizer_config.json", "special_tokens_map.json",
                                 "tokenizer.model",    "vocab.json",            "merges.txt",
                                 "added_tokens.json",  "chat_template.jinja",   "chat_template.json",
                                 "generation_config.json"};
  std::vector<std::string> copied;
  for (const char* name : kFiles) {
    std::error_code ec;
    if (!fs::is_regular_file(from / name, ec)) continue;
    fs::copy_file(from / name, to / name, fs::copy_options::overwrite_existing);
    copied.push_back(name);
  }
  return copied;
}

namespace {
// The directory's entries made durable (a power cut keeps a rename or removal only after this).
void sync_directory(const std::filesystem::path& dir) {
  const int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0 || ::fsync(fd) != 0) {
    const int err = errno;
    if (fd >= 0) ::close(fd);
    throw std::runtime_error("export: cannot sync the directory " + dir.string() + ": " + std::strerror(err));
  }
  ::close(fd);
}
// mkdir -p whose every created level's entry is durable (its parent fsynced).
void create_directories_durably(const std::filesystem::path& dir) {
  namespace fs = std::filesystem;
  std::vector<fs::path> missing;
  for (fs::path at = fs::absolute(dir).lexically_normal(); !at.empty() && !fs::exists(at); at = at.parent_path()) {
    missing.push_back(at);
    if (at == at.parent_path()) break;
  }
  for (auto level = missing.rbegin(); level != missing.rend(); ++level) {
    fs::create_directory(*level);
    sync_directory(level->parent_path());
  }
}
}  // namespace

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

std::filesystem::path ExportDirectory::beside(const std::filesystem::path& out, const std::string& suffix) {
  std::filesystem::path p = std::filesystem::absolute(out).lexically_normal();
  if (p.filename().empty()) p = p.parent_path();
  return p.string() + suffix;
}

ExportDirectory::ExportDirectory(const std::filesystem::path& out, bool overwrite, const std::string& how_to_overwrite,
                                 ExportKind kind)
    : out_(out), tmp_(temporary(out)), kind_(kind) {
  check(out_, overwrite, how_to_overwrite);
  std::filesystem::remove_all(tmp_);  // a crashed export's leftovers
  create_directories_durably(tmp_);  // and so `out`'s parents, made here when missing
}

ExportDirectory::~ExportDirectory() {
  std::error_code ignored;
  if (!committed_) std::filesystem::remove_all(tmp_, ignored);
}

namespace {
// A weights file of an export: model.safetensors, its index, or a shard as transformers names
// them (model-00001-of-00003.safetensors); other files (model-lora.safetensors) are not ours.
bool is_export_weights(const std::string& n) {
  if (n == "model.safetensors" || n == "model.safetensors.index.json") return true;
  if (n.size() != std::string("model-00001-of-00003.safetensors").size() || !n.starts_with("model-") ||
      !n.ends_with(".safetensors") || n.substr(11, 4) != "-of-")
    return false;
  for (size_t i : {6u, 7u, 8u, 9u, 10u, 15u, 16u, 17u, 18u, 19u})
    if (n[i] < '0' || n[i] > '9') return false;
  return true;
}
}  // namespace


void ExportDirectory::commit() {
  namespace fs = std::filesystem;
  // Every file's data on disk first (the shards are already): a failure here leaves `out` as it
  // was.
  for (const auto& e : fs::directory_iterator(tmp_)) {
    const int f = ::open(e.path().c_str(), O_RDONLY);
    if (f < 0 || ::fsync(f) != 0) {
      const int err = errno;
      if (f >= 0) ::close(f);
      throw std::runtime_error("export: cannot sync " + e.path().string() + ": " + std::strerror(err));
    }
    ::close(f);
  }
  create_directories_durably(out_);
  // From here a crash (a power cut included) leaves no config.json describing weights that are
  // not there: the old config goes first, then weight files of an earlier export in another
  // sharding (transformers would read the wrong set), those removals made durable, then the new
  // files arrive and are made durable, config.json last.
  // An earlier export of the other kind goes too: a directory holding both a model and an adapter
  // would load as whichever its reader looks for first.
  const std::string descriptor = kind_ == ExportKind::kModel ? "config.json" : kAdapterConfigFile;
  const std::string other = kind_ == ExportKind::kModel ? kAdapterConfigFile : "config.json";
  fs::remove(out_ / descriptor);
  fs::remove(out_ / other);
  sync_directory(out_);  // no weight file goes while a descriptor naming it can come back
  for (const auto& e : fs::directory_iterator(out_)) {
    const std::string n = e.path().filename().string();
    const bool weights = is_export_weights(n) || n == kAdapterWeightsFile;
    if (weights && !fs::exists(tmp_ / n)) fs::remove(e.path());
  }
  sync_directory(out_);
  for (const auto& e : fs::directory_iterator(tmp_))
    if (e.path().filename() != descriptor) fs::rename(e.path(), out_ / e.path().filename());
  sync_directory(out_);
  fs::rename(tmp_ / descriptor, out_ / descriptor);
  sync_directory(out_);
  fs::remove(tmp_);
  committed_ = true;
}

at::Tensor merged_weight(const at::Tensor& w, const at::Tensor& a, const at::Tensor& b, double scaling) {
  return w.to(at::kFloat) + b.to(at::kFloat).matmul(a.to(at::kFloat)) * scaling;
}

at::Tensor merged_weight(const ModelConfig& c, const AdaptedWeight& what, const at::Tensor& w, const at::Tensor& a,
                         const at::Tensor& b) {
  if (what.expert < 0) return merged_weight(w, a, b, c.lora.scaling());
  const tiling::LowRank l = expert_adapter({a, b, c.lora.scaling()}, c.moe.experts, what.expert, what.row_begin, what.rows);
  return merged_weight(w, l.a, l.b, l.scaling);
}

}  // namespace strata::models
