// `strata train`'s pieces, private to the strata executable: run_training (train.cc) calls them
// in the order of a run's phases. Every rank calls each function, on its training thread (the
// only thread here: the signal thread of train.cc touches none of this), unless its comment says
// "rank 0" (only the lead rank calls it, or only it does the work). "Collective": every rank
// calls it at the same point, as it meets the others there.
#pragma once

#include <ATen/core/Tensor.h>
#include <nlohmann/json.hpp>

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "strata/engine/checkpoint.h"
#include "strata/engine/checkpoint_store.h"
#include "strata/engine/comm.h"
#include "strata/engine/config.h"
#include "strata/engine/device.h"
#include "strata/engine/engine.h"
#include "strata/models/token_data.h"
#include "tensorboard.h"

namespace strata::cli::train {

// --- the run -----------------------------------------------------------------------------------

// The training samples and the evaluation samples (null without evaluation data).
struct DataSources {
  std::shared_ptr<const models::SampleSource> train, eval;
};

// What the phases after the engine's construction share: references to the objects run_training
// owns (they outlive every phase), and the facts every phase reads. The configuration no longer
// changes once the engine is built.
struct Run {
  const engine::TrainConfig& tc;
  const engine::DistEnv& env;
  engine::Communicator& comm;
  engine::Device& device;
  engine::Engine& eng;
  const engine::EngineConfig& ec;  // eng.config(): the "auto" placements resolved
  const models::ModelConfig& mc;
  const DataSources& data;
  models::BatchLoader& loader;
  uint64_t global_batch;  // sequences a step consumes over all ranks
  bool lead;              // rank 0: prints, writes the log, the TensorBoard events and the exports
  std::string frozen_base;  // frozen_base_of(tc): what checkpoints record of the frozen tensors' source
};

// --- train.cc ----------------------------------------------------------------------------------

// Collective, at every step boundary: the stop signal any rank got (0: go on).
int agreed_stop_signal(engine::Communicator& comm);

// --- train_data.cc -----------------------------------------------------------------------------

// The training and evaluation samples of the configuration (data.*): a held-out split taken
// from the training samples, the evaluation capped at data.eval_max_samples. `lead` (rank 0)
// warns of supervised examples cut at seq_len.
DataSources open_data(const engine::TrainConfig& tc, uint64_t vocab, bool lead);

// Collective (a barrier) when model.init_from is an object-store URL: the node's local rank 0
// mirrors the model into the cache (rank 0 prints what it fetches) and every rank points
// tc.init_from at the copy. Does nothing otherwise.
void fetch_init_model(engine::TrainConfig& tc, const engine::DistEnv& env, engine::Communicator& comm, bool lead);

// The model to train: model.init_from's weights, else the configured shape with deferred
// initialization (the engine places and initializes the weights).
std::unique_ptr<models::Decoder> make_model(const engine::TrainConfig& tc);

// --- train_resume.cc ---------------------------------------------------------------------------

// What rank 0 chose to start from, before the ranks meet (`dir` and `error` stay empty on the
// other ranks).
struct ResumeRequest {
  std::optional<std::filesystem::path> dir;  // a checkpoint directory or a stored checkpoint's URL
  std::string error;                         // why rank 0's choice failed; empty if it did not
  bool latest = false;  // --resume without --resume-from: a fresh start is said so
  std::string note;     // --resume: why `latest` was not followed, half-written saves found
};

// Before any collective: rank 0 chooses what the run starts from (--resume-from, --resume, or
// refuses a checkpoint directory or store that already holds committed checkpoints), keeping its
// error for agree_on_resume_point. On every rank, --resume-from without a checkpoint directory
// makes its parent the checkpoint directory (tier_checkpoints then applies; it may throw).
ResumeRequest choose_resume_point(engine::TrainConfig& tc, const engine::DistEnv& env,
                                  const std::optional<std::string>& resume_from);

// What every rank starts from once they have agreed.
struct ResumePoint {
  std::optional<std::filesystem::path> dir;  // none: step 0
  bool fresh_under_resume = false;           // --resume found nothing committed
  std::string frozen_base;                   // the checkpoint's (CheckpointMeta::frozen_base)
  std::string lora;                          // the checkpoint's (CheckpointMeta::lora)
  std::string note;                          // ResumeRequest::note (rank 0's; printed by the lead)
};

// With frozen tensors (model.trainable), where their values come from: the base model's
// fingerprint (models::model_fingerprint of init_from, once fetched), or the random
// initialization's seed and shape; empty when every tensor trains.
std::string frozen_base_of(const engine::TrainConfig& tc);

// Collective: rank 0's choice on every rank (its error thrown on every rank); the saved run's
// global batch kept through tc.engine.grad_accum, or changed only when asked (rank 0 prints the
// note of a change).
ResumePoint agree_on_resume_point(engine::Communicator& comm, engine::TrainConfig& tc,
                                  const engine::DistEnv& env, const ResumeRequest& request, bool lead);

// Where the steps start.
struct Start {
  int64_t first_step = 0;    // steps the loaded checkpoint holds; 0 without one
  std::string resumed_from;  // the checkpoint loaded; empty without one
  double load_seconds = 0;   // how long loading it took (every rank's load, ended by a barrier)
  std::string resume_note;   // ResumePoint::note, for the log's start line
};

// Collective with a resume point: loads it into the engine and moves the data position to it.
// Without one, rank 0 says that --resume starts at step 0. A checkpoint of frozen tensors whose
// base is not this run's (ResumePoint::frozen_base against Run::frozen_base) is refused, saying so,
// and so is one whose LoRA settings are not this run's.
Start load_resume_point(const Run& run, const ResumePoint& resume);

// --- train_checkpoints.cc ----------------------------------------------------------------------

// The name of the checkpoint saved after `steps` steps: "step-00000042".
std::string checkpoint_name(int64_t steps);

// An object-store run.checkpoint_dir (s3://...) means tiered saves: tc.checkpoint_upload becomes
// that URL and tc.checkpoint_dir the local directory (run.checkpoint_local_dir, else one in the
// cache). Throws when checkpoint_dir and checkpoint_upload name two stores.
void tier_checkpoints(engine::TrainConfig& tc);

// Output locations are tried before the first step: creates `dir` if missing and writes, syncs
// and removes a probe file in it; throws naming `what` and the error.
void check_writable(const std::filesystem::path& dir, const std::string& what);

// Throws naming `what` when the filesystem of `dir` has less than `need` bytes free (nothing
// when statvfs fails).
void check_free_space(const std::filesystem::path& dir, uint64_t need, const std::string& what);

// Room in the checkpoint directory for one checkpoint (fp32 master weights and two Adam
// moments: every rank's files in one directory), with the swap files already reserved.
void check_checkpoint_space(const engine::TrainConfig& tc, const models::ModelConfig& mc);

// The run's saves: asynchronous ones (committed at a later step boundary) unless
// run.async_checkpoint is false, the uploads of tiered saves, pruning. Every rank makes one and
// calls after_step and finish (collectives) at the same points; rank 0 prints what happens.
class Checkpoints {
 public:
  // The checkpointer, and with run.checkpoint_upload the uploader (rank 0 says where the
  // checkpoints go and what an earlier run's uploads left in the store). `saved_through`: the
  // steps the checkpoint resumed from holds (0 without one).
  Checkpoints(const Run& run, int64_t saved_through);
  Checkpoints(const Checkpoints&) = delete;
  Checkpoints& operator=(const Checkpoints&) = delete;

  // After step `steps_done`: commits a background save and an upload that completed, then
  // saves when run.save_every or the last step asks for it.
  void after_step(int64_t steps_done);
  // After the last step: commits the save in flight; a run stopped by a signal saves what no
  // checkpoint holds yet; waits for the last upload. True when that upload failed.
  bool finish(int stopped_by, int64_t steps_done);
  // Called with every committed checkpoint's directory, once it is durable (the run's log).
  void on_commit(std::function<void(const std::filesystem::path&)> f) { on_commit_ = std::move(f); }

 private:
  void committed(const std::optional<std::filesystem::path>& dir);
  void uploaded(const std::optional<std::string>& url);
  void save(int64_t steps_done, bool synchronous);

  const Run& run_;
  engine::CheckpointOptions options_;
  engine::AsyncCheckpointer checkpointer_;
  std::unique_ptr<engine::CheckpointUploader> uploader_;  // tiered saves only
  int64_t saved_through_;  // the steps the newest checkpoint (saved or resumed from) holds
  std::function<void(const std::filesystem::path&)> on_commit_;
};

// --- train_loop.cc -----------------------------------------------------------------------------

// How the steps went.
struct StepsDone {
  int stopped_by = 0;  // the signal that stopped the run early; 0: every step ran
  int64_t steps = 0;   // steps done, those before first_step included
  double tokens_total = 0, seconds_total = 0;
  std::vector<engine::TraceSpan> trace;  // with run.profile
};

class RunLog;
class Exporter;

// Collective: the steps from `first_step` to run.steps, each with its saves, log lines,
// evaluation and periodic export; stops early, on every rank after the same step, when a rank
// got a stop signal. `ids` holds a step's token ids.
StepsDone train_steps(const Run& run, Checkpoints& checkpoints, RunLog& log, Exporter& exporter, at::Tensor& ids,
                      int64_t first_step);

// --- train_log.cc ------------------------------------------------------------------------------

// One node's disks and network in a step: its ranks' swap reads and writes and what their
// collectives sent.
struct NodeTraffic {
  int64_t node = 0;
  uint64_t nvme_read = 0, nvme_write = 0, network = 0;
};

// Each node's traffic after each step, on every rank, nodes in the order of their number
// (DistEnv::node; a rank without one counts as node 0). Every rank adds its numbers into its
// node's row of a nodes x 4 table that one all-reduce sums: O(nodes) bytes a rank a step, not
// O(world). Empty on one node: the rank's own timeline says it all.
class NodeTrafficSum {
 public:
  // Collective (one all-reduce): the ranks agree on the table's size, the highest node number.
  NodeTrafficSum(engine::Communicator& comm, const engine::DistEnv& env);
  // Collective: every rank calls it after each step, with its own timeline.
  std::vector<NodeTraffic> operator()(const engine::StepTimeline& t);

 private:
  engine::Communicator& comm_;
  int64_t node_ = 0, nodes_ = 1;
};

// Rank 0 with a progress line, for EngineConfig::on_unit_placed: the placement of the initial
// weights (minutes for a large model), a line that updates on a terminal, else one line per
// tenth of the units.
std::function<void(size_t, size_t)> placement_progress();

// What rank 0 reports while the steps run: the JSON-lines log (run.log), the TensorBoard events
// (run.tensorboard_dir), the progress line and the per-step timeline (run.profile). On other
// ranks it holds nothing open and prints nothing.
class RunLog {
 public:
  // Rank 0: opens the log (appended to by a resumed run) with its start line, prints what the
  // run trains and how (`m0`: the memory before the first step), creates the event file.
  RunLog(const Run& run, const Start& start, const engine::MemoryReport& m0);
  RunLog(const RunLog&) = delete;
  RunLog& operator=(const RunLog&) = delete;

  // Rank 0, after step `step`: its timeline (run.profile), log line, scalars and progress line.
  void step(int64_t step, double lr, const engine::StepResult& r, const engine::MemoryReport& mem,
            const std::vector<NodeTraffic>& traffic);
  // Rank 0: the evaluation after `after_step` (loss over `tokens` targets, in `secs`).
  void eval(int64_t after_step, double loss, uint64_t tokens, double secs);
  // Rank 0: a checkpoint committed (durable), as a log line {"event": "committed", "checkpoint"}.
  void committed(const std::filesystem::path& dir);
  // After the steps: the events flushed; rank 0 ends the progress line and prints the speed.
  void finish(int64_t first_step, const StepsDone& done);

 private:
  void open_log(const Start& start);
  void print_banner(const Start& start, const engine::MemoryReport& m0) const;
  // A line that cannot be written (a full disk) stops the run: a log cut short would pass for a
  // complete one.
  void write(const nlohmann::json& line);
  nlohmann::json step_line(int64_t step, double lr, const engine::StepResult& r, const engine::MemoryReport& mem,
                           const std::vector<NodeTraffic>& traffic) const;
  nlohmann::json step_fields(int64_t step, double lr, const engine::StepResult& r, const engine::MemoryReport& mem,
                             const std::vector<NodeTraffic>& traffic) const;
  void step_scalars(int64_t step, double lr, const engine::StepResult& r, const engine::MemoryReport& mem);
  void print_progress(int64_t step, const engine::StepResult& r, const engine::MemoryReport& mem) const;

  const Run& run_;
  std::ofstream log_;
  std::unique_ptr<TensorBoardWriter> tensorboard_;
  bool tty_ = false;  // stderr is a terminal
};

// Writes the profile's Chrome trace (run.profile; FILE.rankN for rank N > 0); rank 0 says so.
void write_profile(const Run& run, const std::vector<engine::TraceSpan>& trace);

// --- train_export.cc ---------------------------------------------------------------------------

// Before the ranks meet: an object-store run.export (s3://...) is staged in a directory of the
// cache, then uploaded: tc.export_dir becomes that directory (cleared; returns the URL, else "").
// Refuses, before anything is built, an export directory or store that would be overwritten
// without run.export_overwrite, and an export directory whose parent is not writable.
std::string prepare_export(engine::TrainConfig& tc);

// The exports' dtype: run.export_dtype, or with "auto" the compute precision's (bf16 or fp32).
at::ScalarType export_dtype(const engine::TrainConfig& tc, const engine::EngineConfig& ec);

// Rank 0: room beside run.export for every export the run may write (the periodic ones stay); for
// an export to object storage (`to_store`), room for the shards staged at once by `world` ranks.
void check_export_space(const engine::TrainConfig& tc, const models::ModelConfig& mc, at::ScalarType type,
                        bool to_store, int world);

// `<export>-merged`: where run.export_merged writes a LoRA run's merged model beside its adapter.
std::filesystem::path merged_dir(const std::filesystem::path& export_dir);

// The run's Hugging Face exports: run.export after the last step and run.export_every's
// `<export>-step-N` beside it, each the weights of then with the tokenizer of init_from; of a
// LoRA run, PEFT adapter directories, and with run.export_merged the merged models beside them.
class Exporter {
 public:
  // `store`: prepare_export's URL ("" for none); `first_step`: a resumed run replaces the
  // periodic exports past its checkpoint (the interrupted run's, of the same weights).
  Exporter(const Run& run, at::ScalarType type, std::string store, int64_t first_step);

  // The periodic exports' directories, checked before the first step, not after hours of training.
  void check_periodic_dirs() const;
  // Whether run.export_every exports after step `step` (the last step's is run.export itself).
  bool periodic_due(int64_t step) const;
  // Collective: export_model into `<export>-step-<step>`.
  void export_periodic(int64_t step);
  // Collective: every rank gathers the weights, their writers write them into `dir` (and rank 0
  // uploads run.export's to the store), a LoRA run's merged model then into merged_dir(dir); every
  // rank learns whether each failed and throws if so.
  void export_model(const std::filesystem::path& dir, bool overwrite);

 private:
  void write(const std::filesystem::path& dir, bool overwrite, engine::ExportContent content);
  // Rank 0: the adapter export `adapter_dir` merged into init_from (run.export_merged on a 4-bit
  // base, run.export_merged_into).
  void write_merged_4bit(const std::filesystem::path& adapter_dir, bool overwrite);
  // Runs `f` (an export) and throws on every rank if it failed on any.
  void agree(const std::function<void()>& f);
  std::filesystem::path periodic_dir(int64_t step) const;

  const Run& run_;
  at::ScalarType type_;
  std::string store_;
  int64_t first_step_;
  bool replace_periodic_;
};

}  // namespace strata::cli::train
