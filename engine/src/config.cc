#include "strata/engine/config.h"

#include <nlohmann/json.hpp>

#include <fstream>
#include <limits>
#include <set>
#include <sstream>
#include <stdexcept>

#include "strata/engine/bytes.h"
#include "strata/offload/object_store.h"

namespace strata::engine {

const char* to_string(Precision p) {
  switch (p) {
    case Precision::kFp32: return "fp32";
    case Precision::kBf16: return "bf16";
    case Precision::kFp16: return "fp16";
  }
  return "?";
}
const char* to_string(Placement p) {
  switch (p) {
    case Placement::kDevice: return "device";
    case Placement::kHost: return "host";
    case Placement::kNvme: return "nvme";
    case Placement::kAuto: return "auto";
  }
  return "?";
}

const char* to_string(UpdateOverlap o) {
  switch (o) {
    case UpdateOverlap::kOff: return "off";
    case UpdateOverlap::kForward: return "forward";
    case UpdateOverlap::kBackward: return "backward";
  }
  return "?";
}

void EngineConfig::validate() const {
  auto bad = [](const std::string& m) { throw std::invalid_argument(m); };
  if (!(lr >= 0)) bad("optimizer.lr must be >= 0");
  if (!(beta1 >= 0 && beta1 < 1) || !(beta2 >= 0 && beta2 < 1))
    bad("optimizer.betas must be in [0, 1)");
  if (!(eps > 0)) bad("optimizer.eps must be > 0");
  if (!(weight_decay >= 0)) bad("optimizer.weight_decay must be >= 0");
  if (!(clip_grad_norm >= 0)) bad("optimizer.clip_grad_norm must be >= 0 (0: off)");
  if (update_overlap == UpdateOverlap::kBackward && clip_grad_norm > 0)
    bad("optimizer.overlap \"backward\" needs optimizer.clip_grad_norm 0: clipping scales every "
        "update by the global gradient norm, which is known only after the whole backward");
  if (update_overlap == UpdateOverlap::kBackward && compute == Precision::kFp16)
    bad("optimizer.overlap \"backward\" cannot run with precision.compute fp16: the loss scaler "
        "skips a step whose gradients overflow, which is known only after the whole backward");
  if (micro_batch < 1) bad("batch.micro_batch must be >= 1");
  if (grad_accum < 1) bad("batch.grad_accum must be >= 1");
  if (seq_len < 1) bad("data.seq_len must be >= 1");
  if (mlp_token_chunk < kMlpChunkAuto) bad("placement.tiling.mlp_tokens must be \"auto\", \"off\" or >= 1 tokens");
  if (reduce == Precision::kFp16) bad("precision.reduce must be fp32 or bf16");
  if (!(initial_loss_scale > 0)) bad("precision.initial_loss_scale must be > 0");
  if (loss_scale_window < 1) bad("precision.loss_scale_window must be >= 1");
  if (device != "cpu" && device != "cuda")
    bad("device.type must be \"cpu\" or \"cuda\", not \"" + device + "\"");
  const auto A = Placement::kAuto;
  if (moments != master && moments != A && master != A)
    bad("placement.moments and placement.master must be the same: the optimizer updates them "
        "together where they live");
  if (grads != A && master != A && grads != master && !(master == Placement::kNvme && grads == Placement::kHost))
    bad("placement.grads must be placement.master's (or \"host\" with master on \"nvme\"): the "
        "optimizer runs where the master weights live and reads the gradients there");
  const bool nvme = params == Placement::kNvme || grads == Placement::kNvme || master == Placement::kNvme ||
                    activations == Placement::kNvme;
  if (nvme && nvme_dirs.empty())
    bad("a placement is \"nvme\" but offload.nvme_dirs is empty: name at least one directory");
  if (io_queue_depth < 1 || io_queue_depth > 4096) bad("offload.queue_depth must be in 1..4096");
  if (nvme_chunk_bytes < 4096) bad("offload.optimizer_chunk must be >= 4KiB");
  if (device_budget == 0) bad("device.budget must be > 0");
  if (prefetch < 0) bad("device.prefetch must be >= 0");
  if (recompute_blocks < kRecomputeAuto) bad("placement.recompute must be >= 0 blocks");
  if (!(timeout_s > 0)) bad("distributed.timeout_s must be > 0");
}

namespace {

using nlohmann::json;

// Reads one object section, rejecting keys it does not know.
class Section {
 public:
  Section(const json& j, std::string path, const std::string& source)
      : j_(j), path_(std::move(path)), source_(source) {
    if (!j_.is_object()) fail("", "must be an object");
  }
  ~Section() noexcept(false) {
    if (std::uncaught_exceptions()) return;
    for (auto it = j_.begin(); it != j_.end(); ++it)
      if (!seen_.count(it.key())) fail(it.key(), "is not a known key (see docs/CONFIG.md)");
  }
  const json* get(const std::string& key) {
    seen_.insert(key);
    auto it = j_.find(key);
    return it == j_.end() ? nullptr : &*it;
  }
  template <typename T>
  void read(const std::string& key, T& out) {
    const json* v = get(key);
    if (!v) return;
    try {
      if constexpr (std::is_same_v<T, bool>) {
        if (!v->is_boolean()) throw std::invalid_argument("");
      } else if constexpr (std::is_same_v<T, std::string>) {
        if (!v->is_string()) throw std::invalid_argument("");
      } else if constexpr (std::is_integral_v<T>) {
        if (!v->is_number_integer()) throw std::invalid_argument("");
        if (std::is_unsigned_v<T> ? !v->is_number_unsigned() : !v->is_number_integer())
          throw std::invalid_argument("");
        if (std::is_unsigned_v<T> ? v->get<uint64_t>() > uint64_t(std::numeric_limits<T>::max())
                                  : (v->get<int64_t>() > int64_t(std::numeric_limits<T>::max()) ||
                                     v->get<int64_t>() < int64_t(std::numeric_limits<T>::min())))
          throw std::invalid_argument("");
      } else {
        if (!v->is_number()) throw std::invalid_argument("");
      }
      out = v->get<T>();
    } catch (const std::exception&) {
      fail(key, "has the wrong type: " + v->dump());
    }
  }
  void read_bytes(const std::string& key, uint64_t& out) {
    const json* v = get(key);
    if (!v) return;
    try {
      if (v->is_number_unsigned()) out = v->get<uint64_t>();
      else if (v->is_string()) out = parse_bytes(v->get<std::string>());
      else throw std::invalid_argument("a byte count or a string like \"512MiB\"");
    } catch (const std::exception& e) {
      fail(key, std::string("is not a byte size: ") + v->dump());
    }
  }
  template <typename E>
  void read_enum(const std::string& key, E& out, std::initializer_list<std::pair<const char*, E>> names) {
    const json* v = get(key);
    if (!v) return;
    std::string all;
    for (auto& [n, e] : names) {
      if (v->is_string() && v->get<std::string>() == n) {
        out = e;
        return;
      }
      all += std::string(all.empty() ? "" : ", ") + n;
    }
    fail(key, "must be one of " + all + ", not " + v->dump());
  }
  [[noreturn]] void fail(const std::string& key, const std::string& msg) const {
    throw std::invalid_argument(source_ + ": " + path_ + (key.empty() ? "" : "." + key) + " " + msg);
  }

 private:
  const json& j_;
  std::string path_;
  const std::string& source_;
  std::set<std::string> seen_;
};

}  // namespace

TrainConfig parse_train_config(const std::string& text, const std::string& source) {
  json root;
  try {
    root = json::parse(text);
  } catch (const std::exception& e) {
    throw std::invalid_argument(source + ": not valid JSON: " + e.what());
  }
  TrainConfig c;
  EngineConfig& e = c.engine;
  Section top(root, "(top)", source);
  {
    const json* m = top.get("model");
    json empty = json::object();
    Section s(m ? *m : empty, "model", source);
    std::string preset_name = "gpt2", hf_config;
    s.read("preset", preset_name);
    s.read("hf_config", hf_config);
    s.read("init_from", c.init_from);
    s.read("seed", c.init_seed);
    const char* source_key = "preset";
    if (!c.init_from.empty()) {
      if (!hf_config.empty()) s.fail("hf_config", "cannot be combined with init_from");
      hf_config = c.init_from + "/config.json";
      source_key = "init_from";
    } else if (!hf_config.empty()) {
      source_key = "hf_config";
    }
    try {
      if (hf_config.empty()) {
        c.model = models::preset(preset_name);
      } else if (offload::is_object_store_url(c.init_from)) {
        // A model in a bucket: its config.json read from there (the weights are fetched later).
        const std::vector<std::byte> text = offload::open_object_store(c.init_from)->get_all("config.json");
        c.model = models::parse_hf_config(std::string(reinterpret_cast<const char*>(text.data()), text.size()),
                                          hf_config);
      } else {
        c.model = models::load_hf_config(hf_config);
      }
    } catch (const std::exception& ex) {
      s.fail(source_key, ex.what());
    }
    models::ModelConfig& mc = c.model;
    static const char* kShapeKeys[] = {"layers", "hidden", "heads", "kv_heads", "intermediate",
                                       "vocab_size", "max_positions", "tie_embeddings"};
    if (!c.init_from.empty())
      for (const char* k : kShapeKeys)
        if (s.get(k)) s.fail(k, "cannot be combined with model.init_from (the checkpoint fixes the shape)");
    int64_t layers = mc.layers, hidden = mc.hidden, heads = mc.heads, kv = -1, inter = -1,
            vocab = mc.vocab_size, maxpos = mc.max_positions;
    s.read("layers", layers);
    s.read("hidden", hidden);
    s.read("heads", heads);
    s.read("kv_heads", kv);
    s.read("intermediate", inter);
    s.read("vocab_size", vocab);
    s.read("max_positions", maxpos);
    s.read("tie_embeddings", mc.tie_embeddings);
    const bool reshaped = hidden != mc.hidden || heads != mc.heads;
    mc.layers = layers;
    mc.vocab_size = vocab;
    mc.max_positions = maxpos;
    if (reshaped) {
      if (heads <= 0 || hidden % heads != 0)
        s.fail("hidden", "must be a multiple of model.heads (head_dim = hidden / heads)");
      mc.hidden = hidden;
      mc.heads = heads;
      mc.head_dim = hidden / heads;
      if (kv < 0) mc.kv_heads = mc.arch == models::Arch::kGpt2 ? heads : std::min(mc.kv_heads, heads);
      if (inter < 0) mc.intermediate = 4 * hidden;
    }
    if (kv >= 0) mc.kv_heads = kv;
    if (inter >= 0) mc.intermediate = inter;
    try {
      mc.validate();
    } catch (const std::exception& ex) {
      s.fail("", ex.what());
    }
  }
  const json* d = top.get("data");
  if (!c.init_from.empty() && !(d && d->is_object() && d->contains("path")))
    throw std::invalid_argument(
        source + ": model.init_from is set but data.path is not: the pretrained model would be "
        "fine-tuned on the default data (the raw bytes of /usr/share/common-licenses, whose byte "
        "values are valid ids of any vocabulary). Give data.path: a token file made with the "
        "model's tokenizer (strata data prepare), with data.format to match");
  if (d) {
    Section s(*d, "data", source);
    s.read("path", c.data_path);
    const auto check_format = [&](const char* key, const std::string& f) {
      if (f != "bytes" && f != "uint16" && f != "uint32" && f != "sft")
        s.fail(key, "must be one of bytes, uint16, uint32, sft, not \"" + f + "\"");
    };
    s.read("format", c.data_format);
    check_format("format", c.data_format);
    s.read("seq_len", e.seq_len);
    s.read("seed", c.data_seed);
    s.read("pad_id", c.data_pad_id);
    if (c.data_pad_id < 0) s.fail("pad_id", "must be >= 0");
    s.read("eval_path", c.eval_path);
    c.eval_format = c.data_format;
    s.read("eval_format", c.eval_format);
    check_format("eval_format", c.eval_format);
    s.read("eval_split", c.eval_split);
    if (!(c.eval_split >= 0 && c.eval_split < 1)) s.fail("eval_split", "must be in [0, 1)");
    if (c.eval_split > 0 && !c.eval_path.empty())
      s.fail("eval_split", "and eval_path both name evaluation data: give one");
    s.read("eval_every", c.eval_every);
    if (c.eval_every < 0) s.fail("eval_every", "must be >= 0 (0: only after the last step)");
    s.read("eval_max_samples", c.eval_max_samples);
    if (c.eval_max_samples < 0) s.fail("eval_max_samples", "must be >= 0 (0: all)");
    if ((c.eval_every > 0 || c.eval_max_samples > 0) && c.eval_path.empty() && c.eval_split == 0)
      s.fail(c.eval_every > 0 ? "eval_every" : "eval_max_samples",
             "is set but there is no evaluation data: give eval_path or eval_split");
  }
  if (const json* b = top.get("batch")) {
    Section s(*b, "batch", source);
    s.read("micro_batch", e.micro_batch);
    s.read("grad_accum", e.grad_accum);
  }
  if (const json* o = top.get("optimizer")) {
    Section s(*o, "optimizer", source);
    s.read_enum("type", e.decoupled_weight_decay, {{"adamw", true}, {"adam", false}});
    s.read("lr", e.lr);
    if (const json* betas = s.get("betas")) {
      if (!betas->is_array() || betas->size() != 2 || !(*betas)[0].is_number() ||
          !(*betas)[1].is_number())
        s.fail("betas", "must be an array of two numbers");
      e.beta1 = (*betas)[0].get<double>();
      e.beta2 = (*betas)[1].get<double>();
    }
    s.read("eps", e.eps);
    if (const json* sch = s.get("schedule")) {
      Section ss(*sch, "optimizer.schedule", source);
      LrSchedule& ls = c.lr_schedule;
      ss.read_enum("decay", ls.decay,
                   {{"constant", LrSchedule::Decay::kConstant}, {"linear", LrSchedule::Decay::kLinear},
                    {"cosine", LrSchedule::Decay::kCosine}});
      ss.read("warmup_steps", ls.warmup_steps);
      ss.read("total_steps", ls.total_steps);
      ss.read("min_lr_ratio", ls.min_lr_ratio);
      if (ls.warmup_steps < 0) ss.fail("warmup_steps", "must be >= 0");
      if (ls.total_steps < 0) ss.fail("total_steps", "must be >= 0 (0: run.steps)");
      if (!(ls.min_lr_ratio >= 0 && ls.min_lr_ratio <= 1)) ss.fail("min_lr_ratio", "must be in [0, 1]");
    }
    s.read("weight_decay", e.weight_decay);
    if (const json* nd = s.get("no_decay")) {
      if (!nd->is_array()) s.fail("no_decay", "must be an array of \"bias\", \"norm\", \"embedding\"");
      for (const json& k : *nd) {
        if (k == "bias") e.no_decay_bias = true;
        else if (k == "norm") e.no_decay_norm = true;
        else if (k == "embedding") e.no_decay_embedding = true;
        else s.fail("no_decay", "must hold only \"bias\", \"norm\" and \"embedding\", not " + k.dump());
      }
    }
    s.read("clip_grad_norm", e.clip_grad_norm);
    if (const json* v = s.get("overlap")) {
      if (v->is_boolean()) e.update_overlap = v->get<bool>() ? UpdateOverlap::kForward : UpdateOverlap::kOff;
      else if (*v == "off") e.update_overlap = UpdateOverlap::kOff;
      else if (*v == "forward") e.update_overlap = UpdateOverlap::kForward;
      else if (*v == "backward") e.update_overlap = UpdateOverlap::kBackward;
      else s.fail("overlap", "must be true (\"forward\"), false (\"off\") or \"backward\", not " + v->dump());
    }
  }
  if (const json* p = top.get("precision")) {
    Section s(*p, "precision", source);
    s.read_enum("compute", e.compute,
                {{"fp32", Precision::kFp32}, {"bf16", Precision::kBf16}, {"fp16", Precision::kFp16}});
    s.read_enum("reduce", e.reduce, {{"fp32", Precision::kFp32}, {"bf16", Precision::kBf16}});
    s.read("initial_loss_scale", e.initial_loss_scale);
    s.read("loss_scale_window", e.loss_scale_window);
  }
  if (const json* p = top.get("placement")) {
    Section s(*p, "placement", source);
    std::initializer_list<std::pair<const char*, Placement>> names = {
        {"device", Placement::kDevice}, {"host", Placement::kHost}, {"nvme", Placement::kNvme},
        {"auto", Placement::kAuto}};
    s.read_enum("params", e.params, names);
    s.read_enum("grads", e.grads, names);
    s.read_enum("master", e.master, names);
    s.read_enum("moments", e.moments, names);
    s.read_enum("activations", e.activations, names);
    if (const json* v = s.get("recompute")) {
      const std::string what = v->is_string() ? v->get<std::string>() : "";
      if (what == "all") e.recompute_blocks = EngineConfig::kRecomputeAll;
      else if (what == "none") e.recompute_blocks = 0;
      else if (what == "auto") e.recompute_blocks = EngineConfig::kRecomputeAuto;
      else if (v->is_number_integer() && v->get<int64_t>() >= 0 && v->get<int64_t>() < EngineConfig::kRecomputeAll)
        e.recompute_blocks = int(v->get<int64_t>());
      else
        s.fail("recompute", "must be \"all\", \"none\", \"auto\" or the number of blocks recomputed (an "
                            "integer >= 0), not " + v->dump());
    }
    // "auto", "off", or per layer kind: {"head" | "attention" | "mlp" | "vocab": "auto" | "off" | tiles}.
    if (const json* v = s.get("tiling")) {
      const auto count = [&](const json& x, const std::string& key) -> uint64_t {
        if (x == "auto") return EngineConfig::kTilesAuto;
        if (x == "off") return 1;
        if (x.is_number_integer() && x.get<int64_t>() >= 1) return x.get<uint64_t>();
        s.fail(key, "must be \"auto\", \"off\" or a number of tiles >= 1, not " + x.dump());
        return 0;
      };
      if (v->is_string()) {
        e.head_tiles = e.attention_tiles = e.mlp_tiles = e.vocab_tiles = count(*v, "tiling");
        e.mlp_token_chunk = *v == "off" ? 0 : EngineConfig::kMlpChunkAuto;
      } else if (v->is_object()) {
        for (auto it = v->begin(); it != v->end(); ++it)
          if (it.key() == "head") e.head_tiles = count(it.value(), "tiling.head");
          else if (it.key() == "attention") e.attention_tiles = count(it.value(), "tiling.attention");
          else if (it.key() == "mlp") e.mlp_tiles = count(it.value(), "tiling.mlp");
          else if (it.key() == "vocab") e.vocab_tiles = count(it.value(), "tiling.vocab");
          else if (it.key() == "head_pass") {
            const json& x = it.value();
            if (x == "one") e.head_one_pass = true;
            else if (x == "two") e.head_one_pass = false;
            else s.fail("tiling.head_pass", "must be \"one\" or \"two\", not " + x.dump());
          }
          else if (it.key() == "mlp_tokens") {
            const json& x = it.value();
            if (x == "off") e.mlp_token_chunk = 0;
            else if (x == "auto") e.mlp_token_chunk = EngineConfig::kMlpChunkAuto;
            else if (x.is_number_integer() && x.get<int64_t>() >= 1) e.mlp_token_chunk = x.get<int64_t>();
            else s.fail("tiling.mlp_tokens", "must be \"auto\", \"off\" or a number of tokens >= 1, not " + x.dump());
          }
          else s.fail("tiling." + it.key(), "is not a layer kind that is tiled: \"head\", \"attention\", \"mlp\", "
                                            "\"vocab\", \"head_pass\" and \"mlp_tokens\" are");
      } else {
        s.fail("tiling", "must be \"auto\", \"off\" or an object {\"head\": tiles, \"attention\": tiles, \"mlp\": tiles, \"vocab\": tiles}, not " +
                             v->dump());
      }
    }
  }
  if (const json* d = top.get("device")) {
    Section s(*d, "device", source);
    s.read("type", e.device);
    s.read_bytes("budget", e.device_budget);
    if (const json* v = s.get("prefetch"); v && v->is_string()) {
      if (v->get<std::string>() != "auto") s.fail("prefetch", "must be an integer >= 0 or \"auto\", not " + v->dump());
      e.prefetch_auto = true;
      e.prefetch = 1;
    } else {
      s.read("prefetch", e.prefetch);
    }
    s.read("cpu_threads", e.cpu_threads);
  }
  if (const json* o = top.get("offload")) {
    Section s(*o, "offload", source);
    if (const json* dirs = s.get("nvme_dirs")) {
      if (!dirs->is_array()) s.fail("nvme_dirs", "must be an array of directory paths");
      for (const json& d : *dirs) {
        if (!d.is_string() || d.get<std::string>().empty())
          s.fail("nvme_dirs", "must hold non-empty strings, not " + d.dump());
        e.nvme_dirs.push_back(d.get<std::string>());
      }
    }
    s.read("queue_depth", e.io_queue_depth);
    s.read_bytes("optimizer_chunk", e.nvme_chunk_bytes);
    s.read_bytes("host_budget", e.host_budget);
    s.read_bytes("nvme_budget", e.nvme_budget);
  }
  if (const json* d = top.get("distributed")) {
    Section s(*d, "distributed", source);
    s.read("timeout_s", e.timeout_s);
  }
  if (const json* r = top.get("run")) {
    Section s(*r, "run", source);
    s.read("steps", c.steps);
    s.read("log", c.log_path);
    s.read("progress", c.progress);
    s.read("export", c.export_dir);
    s.read("export_overwrite", c.export_overwrite);
    s.read("export_every", c.export_every);
    if (c.export_every < 0) s.fail("export_every", "must be >= 0 (0: only after the last step)");
    s.read("export_dtype", c.export_dtype);
    if (c.export_dtype != "auto" && c.export_dtype != "float32" && c.export_dtype != "bfloat16" &&
        c.export_dtype != "float16")
      s.fail("export_dtype", "must be auto, float32, bfloat16 or float16, not \"" + c.export_dtype + "\"");
    s.read_bytes("export_shard_size", c.export_shard_bytes);
    if (c.export_shard_bytes == 0) s.fail("export_shard_size", "must be > 0");
    s.read("tensorboard", c.tensorboard_dir);
    s.read("profile", c.profile_path);
    s.read("checkpoint_dir", c.checkpoint_dir);
    s.read("save_every", c.save_every);
    s.read("resume", c.resume);
    s.read("allow_batch_change", c.allow_batch_change);
    s.read("keep_checkpoints", c.keep_checkpoints);
    s.read("async_checkpoint", c.async_checkpoint);
    s.read_bytes("checkpoint_staging", c.checkpoint_staging);
    s.read("checkpoint_upload", c.checkpoint_upload);
    s.read("checkpoint_local_dir", c.checkpoint_local_dir);
    s.read("keep_uploaded_checkpoints", c.keep_uploaded_checkpoints);
    s.read_bytes("checkpoint_part_size", c.checkpoint_transfer.part_bytes);
    // S3 takes parts of up to 5 GiB (and at least 5 MiB but the last: the driver raises smaller).
    if (c.checkpoint_transfer.part_bytes == 0 || c.checkpoint_transfer.part_bytes > (5ull << 30))
      s.fail("checkpoint_part_size", "must be > 0 and at most 5 GiB (S3's largest part)");
    s.read("checkpoint_concurrency", c.checkpoint_transfer.concurrency);
    // A client keeps at most 64 idle connections: more in flight would reconnect every request.
    if (c.checkpoint_transfer.concurrency < 1 || c.checkpoint_transfer.concurrency > 64)
      s.fail("checkpoint_concurrency", "must be 1 to 64");
    // An upload holds a part per transfer in memory.
    if (c.checkpoint_transfer.part_bytes * uint64_t(c.checkpoint_transfer.concurrency) > (16ull << 30))
      s.fail("checkpoint_part_size", "times run.checkpoint_concurrency must be at most 16 GiB (an upload holds a part "
                                     "per transfer in memory)");
  }
  if (c.steps < 0) throw std::invalid_argument(source + ": run.steps must be >= 0");
  if (c.save_every < 0) throw std::invalid_argument(source + ": run.save_every must be >= 0");
  if (c.keep_checkpoints < 0)
    throw std::invalid_argument(source + ": run.keep_checkpoints must be >= 0 (0: keep all)");
  if (c.keep_uploaded_checkpoints < 0)
    throw std::invalid_argument(source + ": run.keep_uploaded_checkpoints must be >= 0 (0: keep all)");
  if (c.resume && c.checkpoint_dir.empty())
    throw std::invalid_argument(source + ": run.resume needs run.checkpoint_dir");
  if (e.seq_len > c.model.max_positions && c.model.arch == models::Arch::kGpt2)
    throw std::invalid_argument(source + ": data.seq_len " + std::to_string(e.seq_len) +
                                " exceeds model.max_positions " +
                                std::to_string(c.model.max_positions));
  try {
    c.model.check_sequence_length(e.seq_len);  // data.seq_len within a sliding window
    e.validate();
  } catch (const std::exception& ex) {
    throw std::invalid_argument(source + ": " + ex.what());
  }
  return c;
}

TrainConfig load_train_config(const std::string& path) {
  std::ifstream in(path);
  if (!in) throw std::invalid_argument("cannot open configuration " + path);
  std::stringstream ss;
  ss << in.rdbuf();
  return parse_train_config(ss.str(), path);
}

}  // namespace strata::engine
