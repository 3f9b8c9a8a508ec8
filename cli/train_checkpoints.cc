// `strata train`: where checkpoints go, and the run's saves, uploads and pruning (train_parts.h).
#include "train_parts.h"

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <exception>
#include <iostream>
#include <stdexcept>
#include <string>

#include <fcntl.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include "object_paths.h"
#include "strata/engine/bytes.h"
#include "strata/offload/file.h"
#include "strata/offload/object_store.h"

namespace strata::cli::train {

// The local directory of tiered saves: run.checkpoint_local_dir, else $STRATA_CACHE (default
// ~/.cache/strata)/checkpoints/<URL after its scheme>.
void tier_checkpoints(engine::TrainConfig& tc) {
  if (!offload::is_object_store_url(tc.checkpoint_dir)) return;
  if (!tc.checkpoint_upload.empty() && tc.checkpoint_upload != tc.checkpoint_dir)
    throw std::invalid_argument("run.checkpoint_dir " + tc.checkpoint_dir + " and run.checkpoint_upload " +
                                tc.checkpoint_upload + " name two stores; give one");
  tc.checkpoint_upload = tc.checkpoint_dir;
  if (!tc.checkpoint_local_dir.empty()) {
    tc.checkpoint_dir = tc.checkpoint_local_dir;
    return;
  }
  tc.checkpoint_dir = cache_path("checkpoints", tc.checkpoint_upload);
}

// A read-only or missing directory found at the first save, or at the export after the last
// step, would cost the run.
void check_writable(const std::filesystem::path& dir, const std::string& what) {
  try {
    // Durably: a checkpoint in a root whose own entry a power cut can erase is not saved.
    offload::create_directories_durably(dir);
  } catch (const std::exception& e) {
    throw std::runtime_error(what + " " + dir.string() + ": cannot create it: " + e.what());
  }
  const std::filesystem::path probe = dir / (".strata-write-test-" + std::to_string(getpid()));
  const int fd = ::open(probe.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0600);
  const bool ok = fd >= 0 && ::write(fd, "x", 1) == 1 && ::fsync(fd) == 0;
  const int err = errno;
  if (fd >= 0) ::close(fd);
  ::unlink(probe.c_str());
  if (!ok) throw std::runtime_error(what + " " + dir.string() + " is not writable: " + std::strerror(err));
}

// Called once the swap files are reserved (they may share the filesystem).
void check_free_space(const std::filesystem::path& dir, uint64_t need, const std::string& what) {
  struct statvfs st {};
  if (::statvfs(dir.c_str(), &st) != 0) return;  // checked writable before; nothing more to learn
  const uint64_t free = uint64_t(st.f_bavail) * uint64_t(st.f_frsize);
  if (free < need)
    throw std::runtime_error(what + " " + dir.string() + " has " + engine::format_bytes(free) + " free, and " +
                             engine::format_bytes(need) + " are needed");
}

void check_checkpoint_space(const engine::TrainConfig& tc, const models::ModelConfig& mc) {
  if (!tc.checkpoint_dir.empty())
    check_free_space(tc.checkpoint_dir, uint64_t(mc.parameters()) * engine::state::kSavedKinds * 4,
                     "checkpoint directory");
}

namespace {

engine::CheckpointOptions checkpoint_options(const engine::TrainConfig& tc) {
  engine::CheckpointOptions options;
  options.staging_bytes = tc.checkpoint_staging;
  return options;
}

// Rank 0: where tiered saves go, and what the uploader found of an earlier run's uploads.
void report_uploader(const engine::TrainConfig& tc, const engine::CheckpointUploader& uploader) {
  std::cerr << "strata train: checkpoints are saved in " << tc.checkpoint_dir << " and uploaded to "
            << uploader.store_url() << "\n";
  const auto& left = uploader.aborted_leftovers();
  if (!left.empty()) {
    std::cerr << "strata train: aborted " << left.size() << " incomplete upload" << (left.size() > 1 ? "s" : "")
              << " an earlier run left in " << uploader.store_url() << " (" << left.front().key
              << (left.size() > 1 ? ", ..." : "") << "): the store drops their parts\n";
  }
  if (!uploader.leftover_error().empty())
    std::cerr << "strata train: warning: could not look for incomplete uploads an earlier run left: "
              << uploader.leftover_error() << "\n";
}

}  // namespace

// Tiered saves: every committed checkpoint goes up to the store in the background.
Checkpoints::Checkpoints(const Run& run, int64_t saved_through)
    : run_(run), options_(checkpoint_options(run.tc)), checkpointer_(run.comm, options_),
      saved_through_(saved_through) {
  if (run.tc.checkpoint_upload.empty()) return;
  uploader_ = std::make_unique<engine::CheckpointUploader>(run.comm, run.tc.checkpoint_upload,
                                                           run.tc.checkpoint_transfer);
  if (run.lead) report_uploader(run.tc, *uploader_);
}

void Checkpoints::after_step(int64_t steps_done) {
  const engine::TrainConfig& tc = run_.tc;
  committed(checkpointer_.poll());
  if (uploader_) uploaded(uploader_->poll());
  const bool save_now = !tc.checkpoint_dir.empty() &&
                        (steps_done == tc.steps || (tc.save_every > 0 && steps_done % tc.save_every == 0));
  if (save_now) save(steps_done, !tc.async_checkpoint);
}

bool Checkpoints::finish(int stopped_by, int64_t steps_done) {
  committed(checkpointer_.finish());
  if (stopped_by != 0) {
    // Every rank stops after the same step; what a checkpoint directory can keep is kept.
    const bool keep = !run_.tc.checkpoint_dir.empty() && steps_done > saved_through_;
    if (keep) save(steps_done, /*synchronous=*/true);
  }
  bool final_upload_failed = false;
  if (uploader_ && uploader_->in_flight()) {
    if (run_.lead) std::cerr << "strata train: waiting for the upload to " << uploader_->store_url() << "\n";
    const auto url = uploader_->finish();
    uploaded(url);
    final_upload_failed = !url;  // the last checkpoint is only local: the run does not end well
  }
  return final_upload_failed;
}

void Checkpoints::uploaded(const std::optional<std::string>& url) {
  if (!uploader_) return;
  const engine::TrainConfig& tc = run_.tc;
  const bool lead = run_.lead;
  const std::string nl = tc.progress && isatty(STDERR_FILENO) ? "\n" : "";
  if (!url) {
    if (!uploader_->last_error().empty() && lead) std::cerr << nl << "strata train: warning: " << uploader_->last_error() << "\n";
    return;
  }
  if (lead) {
    std::cerr << nl << "strata train: uploaded " << *url << " (" << double(uploader_->last_bytes()) / (1 << 20)
              << " MiB from this rank in " << uploader_->last_seconds() << " s)\n";
    if (!uploader_->last_warning().empty()) std::cerr << "strata train: warning: " << uploader_->last_warning() << "\n";
  }
  if (tc.keep_uploaded_checkpoints > 0) {
    try {  // collective: every rank gets the same outcome
      engine::prune_stored_checkpoints(run_.comm, tc.checkpoint_upload, size_t(tc.keep_uploaded_checkpoints));
    } catch (const engine::CommError&) {
      throw;
    } catch (const std::exception& e) {
      if (lead) std::cerr << "strata train: warning: " << e.what() << " (training goes on)\n";
    }
  }
}

void Checkpoints::committed(const std::optional<std::filesystem::path>& dir) {
  if (!dir) return;
  if (run_.lead)
    std::cerr << (run_.tc.progress && isatty(STDERR_FILENO) ? "\n" : "") << "strata train: committed "
              << dir->string() << "\n";
  if (on_commit_) on_commit_(*dir);
  if (uploader_) {
    // An upload still in flight is finished (and committed) first; then this one starts,
    // before pruning, which never removes the checkpoint being uploaded (the newest).
    if (uploader_->in_flight()) uploaded(uploader_->finish());
    uploader_->start(*dir);
  }
  // Retention, and the half-written directories a crash left, once this commit is durable
  // (keep_checkpoints 0 keeps every committed one). Its failure costs disk space, not a
  // checkpoint: every rank gets the same outcome, and training goes on.
  try {
    engine::prune_checkpoints(run_.comm, run_.tc.checkpoint_dir,
                              size_t(std::max<int64_t>(0, run_.tc.keep_checkpoints)));
  } catch (const engine::CommError&) {
    throw;
  } catch (const std::exception& e) {
    if (run_.lead) std::cerr << "strata train: warning: " << e.what() << " (training goes on)\n";
  }
}

std::string checkpoint_name(int64_t steps) {
  char name[32];
  snprintf(name, sizeof name, "step-%08lld", (long long)steps);
  return name;
}

void Checkpoints::save(int64_t steps_done, bool synchronous) {
  const engine::TrainConfig& tc = run_.tc;
  const std::string name = checkpoint_name(steps_done);
  engine::CheckpointMeta meta{steps_done, run_.loader.position(), run_.global_batch};
  meta.frozen_base = run_.frozen_base;
  meta.data_pack = run_.data.train->packed();
  saved_through_ = steps_done;
  if (synchronous) {
    const auto t0 = std::chrono::steady_clock::now();
    const std::filesystem::path dir =
        engine::save_checkpoint(run_.eng, run_.comm, tc.checkpoint_dir, name, meta, options_);
    if (run_.lead)
      std::cerr << (tc.progress && isatty(STDERR_FILENO) ? "\n" : "") << "strata train: saved " << name
                << " (training blocked "
                << std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() << " s)\n";
    committed(dir);
    return;
  }
  // One save at a time: the one in flight is committed (and reported) first.
  const auto t0 = std::chrono::steady_clock::now();
  committed(checkpointer_.finish());
  const double waited = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  const double blocked = waited + checkpointer_.start(run_.eng, tc.checkpoint_dir, name, meta);
  if (run_.lead)
    std::cerr << (tc.progress && isatty(STDERR_FILENO) ? "\n" : "") << "strata train: saving "
              << name << " in the background (training blocked " << blocked << " s)\n";
}

}  // namespace strata::cli::train
