// parse_train_config: the JSON configuration read section by section (docs/CONFIG.md).
#include "strata/engine/config.h"
#include "strata/engine/config_parse.h"

#include <algorithm>
#include <fstream>
#include <sstream>
#include <stdexcept>

#include "config_section.h"
#include "strata/models/model_shapes.h"
#include "strata/models/trainable.h"
#include "strata/offload/object_store.h"

namespace strata::engine {

namespace {

using config_json::json;
using config_json::Section;


// data: training and evaluation data.
void read_data(Section& s, TrainConfig& c) {
  s.read("path", c.data_path);
  const auto check_format = [&](const char* key, const std::string& f) {
    if (f != "bytes" && f != "uint16" && f != "uint32" && f != "sft")
      s.fail(key, "must be one of bytes, uint16, uint32, sft, not \"" + f + "\"");
  };
  s.read("format", c.data_format);
  check_format("format", c.data_format);
  s.read("seq_len", c.engine.seq_len);
  s.read("seed", c.data_seed);
  s.read("pad_id", c.data_pad_id);
  if (c.data_pad_id < 0) s.fail("pad_id", "must be >= 0");
  s.read("eval_path", c.eval_path);
  c.eval_format = c.data_format;
  s.read("eval_format", c.eval_format);
  check_format("eval_format", c.eval_format);
  c.data_pack = c.data_format == "sft";
  s.read("pack", c.data_pack);
  if (c.data_pack && c.data_format != "sft" && c.eval_format != "sft")
    s.fail("pack", "packs supervised examples (format \"sft\"); token windows (\"" + c.data_format +
                       "\") are already full");
  s.read("overlong", c.data_overlong);
  if (c.data_overlong != "truncate" && c.data_overlong != "refuse")
    s.fail("overlong", "must be \"truncate\" or \"refuse\", not \"" + c.data_overlong + "\"");
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

// batch.
void read_batch(Section& s, EngineConfig& e) {
  s.read("micro_batch", e.micro_batch);
  s.read("grad_accum", e.grad_accum);
}

// optimizer, with its learning-rate schedule.
void read_optimizer(Section& s, TrainConfig& c, const std::string& source) {
  EngineConfig& e = c.engine;
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

// precision.
void read_precision(Section& s, EngineConfig& e) {
  s.read_enum("compute", e.compute,
              {{"fp32", Precision::kFp32}, {"bf16", Precision::kBf16}, {"fp16", Precision::kFp16}});
  s.read_enum("reduce", e.reduce, {{"fp32", Precision::kFp32}, {"bf16", Precision::kBf16}});
  s.read("initial_loss_scale", e.initial_loss_scale);
  s.read("loss_scale_window", e.loss_scale_window);
}

// placement.tiling: "auto", "off", or per layer kind {"head" | "attention" | "mlp" | "vocab": "auto" | "off" | tiles}, with "head_pass" and "mlp_tokens".
void read_tiling(Section& s, const json& v, EngineConfig& e) {
  const auto count = [&](const json& x, const std::string& key) -> uint64_t {
    if (x == "auto") return EngineConfig::kTilesAuto;
    if (x == "off") return 1;
    if (x.is_number_integer() && x.get<int64_t>() >= 1) return x.get<uint64_t>();
    s.fail(key, "must be \"auto\", \"off\" or a number of tiles >= 1, not " + x.dump());
    return 0;
  };
  if (v.is_string()) {
    e.head_tiles = e.attention_tiles = e.mlp_tiles = e.vocab_tiles = count(v, "tiling");
    e.mlp_token_chunk = v == "off" ? 0 : EngineConfig::kMlpChunkAuto;
  } else if (v.is_object()) {
    for (auto it = v.begin(); it != v.end(); ++it)
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
                         v.dump());
  }
}

// placement: each kind's tier, recompute, activation checkpoints, tiling.
void read_placement(Section& s, EngineConfig& e) {
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
  if (const json* v = s.get("tiling")) read_tiling(s, *v, e);
}

// device.
void read_device(Section& s, EngineConfig& e) {
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

// offload: swap directories, I/O and budgets.
void read_offload(Section& s, EngineConfig& e) {
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

// run: steps, logs, exports and checkpoints.
void read_run(Section& s, TrainConfig& c) {
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
  s.read("export_merged", c.export_merged);
  s.read("export_merged_into", c.export_merged_into);
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

// What no one section can check alone.
void check_run(const TrainConfig& c, const std::string& source) {
  if (c.steps < 0) throw std::invalid_argument(source + ": run.steps must be >= 0");
  if (c.save_every < 0) throw std::invalid_argument(source + ": run.save_every must be >= 0");
  if (c.keep_checkpoints < 0)
    throw std::invalid_argument(source + ": run.keep_checkpoints must be >= 0 (0: keep all)");
  if (c.keep_uploaded_checkpoints < 0)
    throw std::invalid_argument(source + ": run.keep_uploaded_checkpoints must be >= 0 (0: keep all)");
  if (c.resume && c.checkpoint_dir.empty())
    throw std::invalid_argument(source + ": run.resume needs run.checkpoint_dir");
  if (c.export_merged && !c.model.lora.enabled())
    throw std::invalid_argument(source + ": run.export_merged merges LoRA adapters, and model.lora is not set "
                                         "(run.export alone writes the model)");
  if (c.export_merged && c.export_dir.empty())
    throw std::invalid_argument(source + ": run.export_merged writes <run.export>-merged, and run.export is not set");
  if (c.model.quantize.enabled()) {
    const char* compute = c.engine.compute == Precision::kFp32   ? "float32"
                          : c.engine.compute == Precision::kBf16 ? "bfloat16"
                                                                 : "float16";
    if (!c.quantize_compute_dtype.empty() && c.quantize_compute_dtype != compute)
      throw std::invalid_argument(source + ": model.quantize.bnb_4bit_compute_dtype \"" + c.quantize_compute_dtype +
                                  "\" is not precision.compute (\"" + compute +
                                  "\"): the 4-bit weights are dequantized into the compute dtype");
    if (!c.export_dir.empty() && !c.model.lora.enabled())
      throw std::invalid_argument(source + ": run.export with a 4-bit base (model.quantize) and no model.lora: the "
                                           "frozen 4-bit weights cannot be exported yet (a LoRA run exports its adapter)");
  }
  if (c.export_merged && c.model.quantize.enabled() && c.init_from.empty())
    throw std::invalid_argument(source + ": run.export_merged with a 4-bit base merges into model.init_from's "
                                         "weights, and model.init_from is not set");
  if (c.export_merged_into != "base" && c.export_merged_into != "dequantized")
    throw std::invalid_argument(source + ": run.export_merged_into must be \"base\" or \"dequantized\", not \"" +
                                c.export_merged_into + "\"");
  if (c.export_merged_into == "dequantized" && !c.model.quantize.enabled())
    throw std::invalid_argument(source + ": run.export_merged_into \"dequantized\" merges into a 4-bit base's "
                                         "dequantized weights, and model.quantize is not set");
  if (c.engine.seq_len > c.model.max_positions && c.model.arch == models::Arch::kGpt2)
    throw std::invalid_argument(source + ": data.seq_len " + std::to_string(c.engine.seq_len) +
                                " exceeds model.max_positions " +
                                std::to_string(c.model.max_positions));
  try {
    c.engine.validate();
  } catch (const std::exception& ex) {
    throw std::invalid_argument(source + ": " + ex.what());
  }
}

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
    const json empty = json::object();
    Section s(m ? *m : empty, "model", source);
    read_model(s, c);
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
    read_data(s, c);
  }
  // Each section read by its own function, in this order (the first error found is the one told).
  const auto section = [&](const char* key, const auto& read) {
    if (const json* v = top.get(key)) {
      Section s(*v, key, source);
      read(s);
    }
  };
  section("batch", [&](Section& s) { read_batch(s, e); });
  section("optimizer", [&](Section& s) { read_optimizer(s, c, source); });
  section("precision", [&](Section& s) { read_precision(s, e); });
  section("placement", [&](Section& s) { read_placement(s, e); });
  section("device", [&](Section& s) { read_device(s, e); });
  section("offload", [&](Section& s) { read_offload(s, e); });
  section("distributed", [&](Section& s) { s.read("timeout_s", e.timeout_s); });
  section("run", [&](Section& s) { read_run(s, c); });
  check_run(c, source);
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
