// `strata train`: what a run starts from (train_parts.h). Decided before anything is built; a
// committed checkpoint is never overwritten by a run that did not load it. Rank 0 alone chooses
// (its error, if any, reaches every rank once they have met): with node-local checkpoint disks
// only rank 0's holds `latest` and the manifests.
#include "train_parts.h"

#include "strata/models/peft.h"
#include "strata/models/sharded_safetensors.h"

#include <algorithm>
#include <chrono>
#include <exception>
#include <filesystem>
#include <functional>
#include <iostream>
#include <optional>
#include <sstream>
#include <stdexcept>
#include <string>

#include "strata/engine/checkpoint.h"
#include "strata/engine/checkpoint_store.h"
#include "strata/offload/object_store.h"

namespace strata::cli::train {
namespace {

// Rank 0 runs `choose`; what it throws is kept in `error`, for every rank to throw once they meet.
void on_rank0(const engine::DistEnv& env, std::string& error, const std::function<void()>& choose) {
  if (env.rank != 0) return;
  try {
    choose();
  } catch (const std::exception& e) {
    error = e.what();
  }
}

// --resume-from: a committed checkpoint directory, or a stored checkpoint's URL.
void check_resume_from(const std::filesystem::path& from) {
  if (offload::is_object_store_url(from.string()))
    engine::read_checkpoint_meta(from);  // throws, saying why, unless committed
  else if (!std::filesystem::exists(from / "manifest.json"))
    throw std::invalid_argument("--resume-from " + from.string() +
                                ": not a committed checkpoint directory (no manifest.json)");
}

// --resume-from into the directory whose `latest` names a later complete checkpoint: the run
// would reach the save of that name after training for it and be refused there (the latest
// checkpoint is never saved over by a run that did not load it), so it is refused now.
void refuse_saving_over_latest(const engine::TrainConfig& tc, const std::filesystem::path& from) {
  if (tc.checkpoint_dir.empty() || offload::is_object_store_url(from.string())) return;
  const auto latest = engine::latest_checkpoint(tc.checkpoint_dir);
  std::error_code ec;
  if (!latest || !engine::incomplete_checkpoint(*latest).empty() || std::filesystem::equivalent(*latest, from, ec))
    return;
  for (int64_t s = engine::read_checkpoint_meta(from).train_steps + 1; s <= tc.steps; ++s) {
    if (s != tc.steps && (tc.save_every <= 0 || s % tc.save_every != 0)) continue;
    if (latest->filename().string() != checkpoint_name(s)) continue;
    throw std::invalid_argument("--resume-from " + from.string() + ": this run would save " + checkpoint_name(s) +
                                " over " + latest->string() + ", the latest checkpoint there (saved later by the "
                                "run you resume), which a run that did not load it never replaces: give this "
                                "run another --checkpoint-dir, or continue from the latest with --resume");
  }
}

// --resume: the checkpoint `latest` names (or, where it cannot be followed, the newest complete
// one, `note` saying so), or the store's newest when it holds more steps.
void choose_latest(const engine::TrainConfig& tc, std::optional<std::filesystem::path>& dir, std::string& note) {
  std::string local_error;  // with a store, the local directory failing is not the end
  try {
    engine::ResumeFinding found = engine::find_resume_point(tc.checkpoint_dir);
    dir = found.dir;
    note = found.note;
  } catch (const std::runtime_error& e) {
    if (tc.checkpoint_upload.empty()) throw;
    local_error = e.what();
  }
  if (!tc.checkpoint_upload.empty()) {
    // The store may hold a newer one (saved on another machine, or the local copy pruned).
    const auto stored = engine::newest_stored_checkpoint(tc.checkpoint_upload);
    if (stored && (!dir || engine::read_checkpoint_meta(*stored).train_steps >
                               engine::read_checkpoint_meta(*dir).train_steps)) {
      dir = std::filesystem::path(*stored);
      const std::string why = local_error.empty() ? note : local_error;
      note = why.empty() ? "" : why + "; the store holds a newer checkpoint: resuming from " + *stored;
    } else if (!local_error.empty()) {
      throw std::runtime_error(local_error + "; and the store " + tc.checkpoint_upload + " holds none");
    }
  }
}

// A run from step 0 with a checkpoint directory: refused where committed checkpoints are.
void refuse_committed(const engine::TrainConfig& tc) {
  const auto committed = engine::committed_checkpoints(tc.checkpoint_dir);
  if (!committed.empty())
    throw std::invalid_argument("checkpoint directory " + tc.checkpoint_dir + " already holds " +
                                std::to_string(committed.size()) + " committed checkpoint(s) (the newest " +
                                committed.back().filename().string() +
                                "): continue from them with --resume (or --resume-from DIR), or give "
                                "another --checkpoint-dir; a run that did not load them would overwrite them");
  if (!tc.checkpoint_upload.empty()) {
    const auto stored = engine::stored_checkpoints(tc.checkpoint_upload);
    if (!stored.empty())
      throw std::invalid_argument("the checkpoint store " + tc.checkpoint_upload + " already holds " +
                                  std::to_string(stored.size()) + " committed checkpoint(s) (the newest " +
                                  stored.back() + "): continue from them with --resume, or upload elsewhere; a "
                                  "run that did not load them would replace them");
  }
}

}  // namespace

ResumeRequest choose_resume_point(engine::TrainConfig& tc, const engine::DistEnv& env,
                                  const std::optional<std::string>& resume_from) {
  ResumeRequest request;
  if (resume_from) {
    const std::filesystem::path from(*resume_from);
    on_rank0(env, request.error, [&] {
      request.dir = from;
      check_resume_from(from);
    });
    if (tc.checkpoint_dir.empty()) tc.checkpoint_dir = from.parent_path().string();
    tier_checkpoints(tc);
    if (request.error.empty()) on_rank0(env, request.error, [&] { refuse_saving_over_latest(tc, from); });
  } else if (tc.resume) {
    request.latest = true;
    on_rank0(env, request.error, [&] { choose_latest(tc, request.dir, request.note); });
  } else if (!tc.checkpoint_dir.empty()) {
    on_rank0(env, request.error, [&] { refuse_committed(tc); });
  }
  return request;
}

ResumePoint agree_on_resume_point(engine::Communicator& comm, engine::TrainConfig& tc,
                                  const engine::DistEnv& env, const ResumeRequest& request, bool lead) {
  ResumePoint point;
  const engine::ResumeChoice choice = engine::agree_resume_point(comm, request.dir, request.error);
  point.dir = choice.dir;
  point.fresh_under_resume = request.latest && !point.dir;
  point.note = request.note;  // rank 0's (the lead's)
  if (!point.note.empty() && lead) std::cerr << "strata train: " << point.note << "\n";
  point.frozen_base = choice.meta.frozen_base;
  point.lora = choice.meta.lora;
  if (point.dir) {
    const engine::ResumeBatch rb = engine::resume_batch(choice.meta, tc.engine.micro_batch, tc.engine.grad_accum,
                                                        env.world_size, tc.allow_batch_change);
    tc.engine.grad_accum = rb.grad_accum;
    if (!rb.note.empty() && lead) std::cerr << "strata train: " << rb.note << "\n";
    // The data position counts samples: the resumed run must cut the data into the same ones.
    if (choice.meta.data_pack != tc.data_pack && (tc.data_format == "sft" || choice.meta.data_pack)) {
      if (lead)
        std::cerr << "strata train: checkpoint " << point.dir->string() << " trained on "
                  << (choice.meta.data_pack ? "packed" : "unpacked") << " examples: resuming "
                  << (choice.meta.data_pack ? "packed" : "unpacked") << " (data.pack " << (tc.data_pack ? "true" : "false")
                  << " is for fresh runs)\n";
      tc.data_pack = choice.meta.data_pack;
    }
  }
  return point;
}

Start load_resume_point(const Run& run, const ResumePoint& resume) {
  Start start;
  start.resume_note = resume.note;
  if (resume.dir) {
    // The checkpoint holds the trainable tensors alone: the frozen ones must be the base it
    // trained beside (every rank decides alike: both fingerprints are the same everywhere).
    if (resume.frozen_base != run.frozen_base)
      throw std::runtime_error(
          "checkpoint " + resume.dir->string() + " " +
          (resume.frozen_base.empty() ? std::string("froze no tensor")
                                      : "was trained beside the frozen base " + resume.frozen_base) +
          ", but this run's " +
          (run.frozen_base.empty() ? std::string("trains every tensor") : "frozen base is " + run.frozen_base) +
          ": resume with the same model.init_from (or seed) and model.trainable");
    // Adapters of another rank, scaling or targets would train another model from here.
    const models::ModelConfig::Lora& l = run.mc.lora;
    const models::ModelConfig::Lora saved =
        resume.lora.empty() ? models::ModelConfig::Lora{}
                            : models::parse_lora_settings(resume.lora, resume.dir->string() + "/manifest.json", models::LoraSettingsFrom::kAdapterConfig);
    const auto describe = [](const models::ModelConfig::Lora& x) {
      if (!x.enabled()) return std::string("no LoRA adapters");
      std::string targets;
      for (const std::string& t : x.target_modules) targets += (targets.empty() ? "" : ",") + t;
      std::ostringstream alpha;
      alpha << x.alpha;
      std::string saved;
      for (const std::string& t : x.modules_to_save) saved += (saved.empty() ? "" : ",") + t;
      return "LoRA r " + std::to_string(x.r) + ", lora_alpha " + alpha.str() + (x.rslora ? ", use_rslora" : "") +
             ", target_modules " + targets + (saved.empty() ? "" : ", modules_to_save " + saved);
    };
    const auto sorted = [](std::vector<std::string> v) {
      std::sort(v.begin(), v.end());
      return v;
    };
    // A LoRA checkpoint written before the manifest recorded its settings has none: it resumes
    // with this run's (its units, checked on load, must hold this run's adapters).
    const bool unrecorded = resume.lora.empty() && l.enabled() && !resume.frozen_base.empty();
    if (unrecorded && run.lead)
      std::cerr << "strata train: checkpoint " << resume.dir->string()
                << " records no LoRA settings (saved before they were recorded): resuming with this run's "
                << describe(l) << "\n";
    if (!unrecorded && (saved.r != l.r || (l.enabled() && (saved.alpha != l.alpha || saved.rslora != l.rslora ||
                                                           sorted(saved.target_modules) != sorted(l.target_modules) ||
                                                           sorted(saved.modules_to_save) != sorted(l.modules_to_save)))))
      throw std::runtime_error("checkpoint " + resume.dir->string() + " trained " + describe(saved) +
                               ", but this run has " + describe(l) + ": resume with the same model.lora");
    const auto t0 = std::chrono::steady_clock::now();
    const engine::CheckpointMeta meta =
        engine::load_checkpoint(run.eng, run.comm, *resume.dir, run.tc.checkpoint_transfer);
    start.load_seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    run.loader.set_position(meta.samples_consumed);
    start.first_step = meta.train_steps;
    start.resumed_from = resume.dir->string();
  } else if (resume.fresh_under_resume && run.lead) {
    std::cerr << "strata train: no committed checkpoint under " << run.tc.checkpoint_dir
              << " yet: starting at step 0\n";
  }
  return start;
}

std::string frozen_base_of(const engine::TrainConfig& tc) {
  if (tc.engine.trainable.empty()) return "";
  const models::ModelConfig& c = tc.model;
  if (!tc.init_from.empty()) return models::base_fingerprint(models::model_fingerprint(tc.init_from), c.quantize);
  // A random base: the same shape and seed give the same values.
  return models::base_fingerprint("random init of " + c.name + " (" + std::to_string(c.layers) + " layers x " +
                                      std::to_string(c.hidden) + ", vocabulary " + std::to_string(c.vocab_size) +
                                      "), seed " + std::to_string(tc.init_seed),
                                  c.quantize);
}

}  // namespace strata::cli::train
