// Checkpoints: every rank writes its own slices through the I/O engine; one manifest, written
// last and atomically, commits the checkpoint; a checkpoint loads at any world size.
//
// Layout under a root directory:
//   <root>/latest                          name of the newest committed checkpoint
//   <root>/<name>/rank-RRRRR.data          rank R's fp32 master, exp_avg, exp_avg_sq slices
//                                          (real elements only), chunks of <= 4 MiB at 4 KiB
//                                          aligned offsets
//   <root>/<name>/rank-RRRRR.index.json    rank R's chunks with their CRC32C
//   <root>/<name>/manifest.json            written last: format, model partition, every chunk
//                                          of every rank with its CRC32C, counters, data position
// The commit protocol is written at the top of engine/src/checkpoint/commit.cc and in
// docs/FORMATS.md.
//
// Errors: std::runtime_error naming the checkpoint, the file and the chunk (missing manifest,
// missing or short file, CRC mismatch, a model that does not match); IoError from the disk
// (ENOSPC names the file). A failed save leaves earlier checkpoints and `latest` untouched.
// Thread safety: collectives; every rank calls save/load in the same order.
#pragma once

#include <cstdint>
#include <filesystem>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "strata/engine/comm.h"
#include "strata/engine/engine.h"
#include "strata/models/sharded_safetensors.h"
#include "strata/offload/fault_injection.h"
#include "strata/offload/object_store.h"

namespace strata::engine {

struct CheckpointMeta {
  int64_t train_steps = 0;          // steps of the training loop done (skipped ones included)
  uint64_t samples_consumed = 0;    // global data position (BatchLoader::position())
  uint64_t global_batch = 0;        // sequences a step consumed over all ranks; 0: not known
  int world_size = 0;               // of the save (filled when read; ignored when saving)
  // Where the frozen tensors' values come from (model.trainable), as the caller fingerprints it
  // (strata train: the base model's config and safetensors headers and sizes, or the random
  // seed); saved in the manifest when any unit is frozen, since the checkpoint does not hold
  // them. A resume must check that its base has the same fingerprint. Empty: nothing frozen.
  std::string frozen_base;
  // Read back only: the manifest's LoRA settings (an adapter_config.json's text, models/peft.h;
  // saved from the engine's model config), "" when the model has no adapters.
  std::string lora;
  // Whether the samples were packed examples (data.pack): a resume must cut the data into the
  // same samples for samples_consumed to mean the same. Absent from older manifests: false.
  bool data_pack = false;
};

struct CheckpointOptions {
  // Host memory through which the writer copies host- and device-resident slices out (an
  // asynchronous save: all of them; a synchronous one writes host-resident slices straight from
  // the state and stages only device-resident ones), in 4 MiB chunks, each reused once its write
  // is done. 0: as much as the slices need, within the RAM available at the save (MemAvailable)
  // less a reserve of max(2 GiB, 10% of RAM); at least 8 MiB. A staging smaller than the state
  // bounds host memory, and the updates after the save wait for the disk instead
  // (StepTimeline::wait_checkpoint).
  uint64_t staging_bytes = 0;
  // Tests: called by the writer (its thread) just before it releases a unit to the engine.
  std::function<void(size_t unit, const StateHold& hold)> before_release;
  // Tests: the writer's I/O engine consults it on every completion (fault_injection.h).
  std::shared_ptr<offload::FaultInjector> io_fault_injector;
};

// What one rank's part of a committed save took.
struct SaveReport {
  uint64_t data_bytes = 0;          // this rank's data file (aligned chunks)
  uint64_t staging_peak_bytes = 0;  // staging buffers allocated at once, at most
};

// Collective: saves `engine`'s state as <root>/<name> and points <root>/latest at it.
// Returns the checkpoint's directory.
std::filesystem::path save_checkpoint(Engine& engine, Communicator& comm,
                                      const std::filesystem::path& root, const std::string& name,
                                      const CheckpointMeta& meta, const CheckpointOptions& options = {});

// Asynchronous saves. start() blocks only to record the snapshot's instant (counters, data
// position, a StateHold on every unit; with device-resident state, a synchronize of the compute
// stream): a background writer then copies the state of that instant out unit by unit, in the
// order of the engine's next update (Engine::update_order), and releases each unit as soon as
// it is copied: NVMe-resident slices file to file inside the kernel, host- and device-resident
// ones into the staging memory (CheckpointOptions::staging_bytes), written from there. The
// engine's next update of a unit waits for its release, so nothing the save needs changes under
// it and training goes on meanwhile. poll(), called by every rank at the same point of every
// step, commits the save (manifest, latest) once every rank's writes are done. One save at a
// time: start() with a save in flight throws std::logic_error (finishing it there would commit
// it out of the caller's sight: call finish() first and report what it returns). The engine
// must outlive a save in flight.
// Destroying the checkpointer with a save in flight waits for its writer and leaves the save
// uncommitted (never loaded).
// Thread safety: the training thread calls everything; collectives inside.
class AsyncCheckpointer {
 public:
  explicit AsyncCheckpointer(Communicator& comm, CheckpointOptions options = {});
  ~AsyncCheckpointer();
  // Collective. Returns the seconds the caller was blocked.
  double start(Engine& engine, const std::filesystem::path& root, const std::string& name,
               const CheckpointMeta& meta);
  // Collective: the committed checkpoint's directory if the save in flight completed now.
  std::optional<std::filesystem::path> poll();
  // Collective: waits for the save in flight, commits it.
  std::optional<std::filesystem::path> finish();
  bool in_flight() const { return pending_ != nullptr; }
  // This rank's report of the last save committed by poll() or finish().
  const SaveReport& last_report() const { return last_report_; }

 private:
  struct Pending;
  std::optional<std::filesystem::path> complete();
  Communicator& comm_;
  CheckpointOptions options_;
  std::unique_ptr<Pending> pending_;
  SaveReport last_report_;
};

// Collective: loads a committed checkpoint directory (any world size) into `engine`. If it
// throws (corrupt chunk, missing file), the engine's state is undefined: load again or rebuild.
// Only rank 0 reads the manifest (every rank gets it over the communicator), so the checkpoint
// may be on disks each node sees differently (node-local): each rank reads the data files it
// sees, and when some rank lacks a file it needs, every chunk goes from a rank that sees its
// file to the ranks that own it, over the communicator (bit for bit). A data file no rank sees
// is an error on every rank naming the file and the directory each host looked in. From object
// storage, `transfer` sizes the ranged reads (runs of adjacent chunks up to part_bytes,
// `concurrency` in flight).
CheckpointMeta load_checkpoint(Engine& engine, Communicator& comm,
                               const std::filesystem::path& checkpoint_dir,
                               const offload::TransferOptions& transfer = {});

// Reads every chunk of a committed checkpoint and checks its CRC32C and that the chunks cover
// every unit's state exactly. Throws std::runtime_error naming the first bad chunk; returns the
// number of bytes checked. Needs no engine: any process can run it (`strata ckpt verify`).
uint64_t verify_checkpoint(const std::filesystem::path& checkpoint_dir);

// A human-readable summary of a checkpoint's manifest (`strata ckpt inspect`).
std::string describe_checkpoint(const std::filesystem::path& checkpoint_dir);

// Streams the fp32 master weights of a committed checkpoint into a Hugging Face model directory:
// out_dir/config.json and out_dir/model.safetensors (written atomically) with every tensor in
// `dtype` ("float32", "bfloat16" or "float16"; round to nearest even), in the names and layout
// transformers loads. Holds one tensor plus a bounded window of 4 MiB chunks in memory, never
// the model; every chunk read is checked against its CRC32C. Needs no engine and works for a
// checkpoint of any world size (`strata ckpt export`). `progress`, if set, is called after each
// tensor with the bytes written so far and the total. Throws std::invalid_argument for a bad
// dtype, std::runtime_error naming the chunk for corrupt or missing data.
struct ExportResult {
  uint64_t tensors = 0;  // written by this process (export_engine_hf: by this rank)
  uint64_t bytes = 0;    // tensor bytes written, likewise
  // export_checkpoint_merged: the base's weights saved in 4 bits, merged into their dequantization.
  uint64_t dequantized = 0;
  std::vector<std::string> tokenizer_files;  // copied in from `tokenizer_from`
  // The weights files of the whole export (shards, then the index when there is one), whichever
  // rank wrote them; known on every rank.
  std::vector<std::string> files;
};
// The files are written into a temporary directory beside out_dir (`<out_dir>.export-tmp`) and
// renamed into out_dir once complete, so a failed export leaves out_dir as it was. An out_dir that
// exists and is not empty is refused (std::runtime_error naming what is in it) unless
// `overwrite`: then config.json and the weights are replaced and every other file there (a
// tokenizer, say) is kept. Weights above models::kDefaultShardBytes are sharded with an index.
// `tokenizer_from` (a Hugging Face model directory, e.g. the run's model.init_from): its
// tokenizer files and generation_config.json are copied in (models::copy_tokenizer_files).
// `on_weights_file`, if set, is called with each weights file (a shard, in the temporary
// directory) as soon as it is complete; it may move the file away (an upload to object storage):
// the commit then moves what is left. Its exceptions fail the export.
ExportResult export_checkpoint_hf(const std::filesystem::path& checkpoint_dir,
                                  const std::filesystem::path& out_dir, const std::string& dtype,
                                  const std::function<void(uint64_t, uint64_t)>& progress = {},
                                  bool overwrite = false, const std::filesystem::path& tokenizer_from = {},
                                  uint64_t shard_bytes = models::kDefaultShardBytes,
                                  const std::function<void(const std::filesystem::path&)>& on_weights_file = {});
// A LoRA checkpoint (its manifest has "lora"; it holds the adapters alone) exports as a PEFT adapter
// directory instead: out_dir/adapter_config.json and out_dir/adapter_model.safetensors, one file
// whatever shard_bytes (peft loads no other), in fp32 whatever `dtype`, no tokenizer files. export_checkpoint_merged writes
// the merged model given its base.

// A LoRA checkpoint's merged model: the Hugging Face model in `base_dir` (the one it trained on:
// its models::model_fingerprint must be the manifest's frozen_base, else std::invalid_argument
// naming both) with the checkpoint's adapters merged into the weights they adapt
// (models::merged_weight, fp32, then `dtype`), written as export_checkpoint_hf writes a model,
// tensor by tensor in the order a run's merged export writes them (the files are the same when
// the run computed in the base's precision or finer and did not tile the vocabulary). Holds
// the adapters and one base tensor. Throws std::invalid_argument for a checkpoint without LoRA.
//
// What a run on a 4-bit base (model.quantize) merges into: kBase, the base's weights as its files
// hold them (a 16-bit base: its own, the better choice for quality; a base saved in 4 bits: their
// dequantization); kDequantized, the 4-bit weights the run trained on, dequantized (a 16-bit base
// quantized again as the run quantized it at load, with the manifest's "quantize": what peft's
// merge on the 4-bit model adds to before bitsandbytes quantizes it again). kDequantized for a
// checkpoint that did not train on a 4-bit base is refused. ExportResult::dequantized counts the
// weights merged into a dequantization.
enum class MergeInto { kBase, kDequantized };
// "base" / "dequantized" (run.export_merged_into, `strata ckpt export --merge-into`);
// std::invalid_argument naming `what` otherwise.
MergeInto parse_merge_into(const std::string& name, const std::string& what);
ExportResult export_checkpoint_merged(const std::filesystem::path& checkpoint_dir, const std::filesystem::path& base_dir,
                                      const std::filesystem::path& out_dir, const std::string& dtype,
                                      const std::function<void(uint64_t, uint64_t)>& progress = {},
                                      bool overwrite = false, const std::filesystem::path& tokenizer_from = {},
                                      uint64_t shard_bytes = models::kDefaultShardBytes,
                                      const std::function<void(const std::filesystem::path&)>& on_weights_file = {},
                                      MergeInto into = MergeInto::kBase);
// The same from a run's PEFT adapter export `adapter_dir` of model `mc` (run.export_merged on a
// 4-bit base, whose merge reads the base's files rather than the engine's 4-bit records), which
// trained on `base_dir` computing in `compute`.
ExportResult export_adapter_merged(const std::filesystem::path& adapter_dir, const models::ModelConfig& mc,
                                   at::ScalarType compute, const std::filesystem::path& base_dir,
                                   const std::filesystem::path& out_dir, const std::string& dtype, MergeInto into,
                                   bool overwrite, uint64_t shard_bytes);

// Collective: the engine's weights now (fp32 masters) as a Hugging Face model directory, as
// export_checkpoint_hf writes a checkpoint's, streamed: tensor by tensor in unit order, the files
// byte for byte the same whatever the world size. Each shard has one writing rank, which gathers
// its tensors' elements from the ranks whose slices hold them (read where the slice lives:
// device, host or swap) by all-to-alls in rounds: a writer receives at most one piece of 64 MiB
// a round, a rank sends at most 64 MiB, and a rank sends only its own elements (O(its share)).
//
// Who writes: rank 0 prepares `<out_dir>.export-tmp` and leaves a mark there. Where every rank
// finds the mark (a directory every rank sees), shard i is written by rank i % world; otherwise
// by rank 0 alone. With `stage_on_every_rank` (an export to object storage, staged in each node's
// cache) each rank stages its shards in its own `<out_dir>.export-tmp`, created where it is
// missing, and on_weights_file must move each one away (upload it). Rank 0 writes the index,
// config.json and the tokenizer, and commits (renames the files into out_dir).
//
// What is written (`content`): the model; or, of a LoRA model, its PEFT adapter directory
// (adapter_config.json + one adapter_model.safetensors, the adapters alone, written by rank 0);
// or the merged model (a Hugging Face model directory of the base weights with the adapters
// merged in, models::merged_weight in fp32: each adapter travels to the writer of the weight it
// adapts). A LoRA model's kModel export and a kAdapter/kMerged export without LoRA are refused.
//
// Memory: a writer holds one tensor in the export type (two for a transposed one, a tiled
// tensor's whole; a merged weight and its adapters in fp32) and a piece; every rank two rounds of the pieces it sends (128 MiB): it reads
// the next round's (on a thread of its own) while a round travels and is written.
// Waits for an asynchronous save in flight, then holds the state while it reads (hold_state).
// Call on the training thread of every rank. A failure on any rank (a full disk, an existing
// out_dir without `overwrite`, a read from swap) is thrown on every rank alike once every rank has
// done the export's collectives (the failing rank's message, named by rank elsewhere).
enum class ExportContent { kModel, kAdapter, kMerged };
struct EngineExport {
  ExportContent content = ExportContent::kModel;
  std::string base_model;  // kAdapter: adapter_config.json's base_model_name_or_path ("" : none)
  at::ScalarType type = at::kFloat;
  uint64_t shard_bytes = models::kDefaultShardBytes;
  bool overwrite = false;
  std::string overwrite_hint;            // how to overwrite, in the refusal of a non-empty out_dir
  std::filesystem::path tokenizer_from;  // a Hugging Face directory whose tokenizer files are copied in
  std::function<void(uint64_t done, uint64_t total)> progress;  // bytes gathered by every writer, on rank 0
  // On the rank that wrote it, each weights file as soon as it is complete (as
  // export_checkpoint_hf's); the index, on rank 0, is not one.
  std::function<void(const std::filesystem::path& file)> on_weights_file;
  bool stage_on_every_rank = false;
};
ExportResult export_engine_hf(Engine& engine, Communicator& comm, const std::filesystem::path& out_dir,
                              const EngineExport& options);

// Collective, with no save in flight: deletes all but the `keep` newest committed checkpoints
// under `root` (by name order; the latest is always kept; `keep` 0 keeps every one), and every
// step directory without a manifest (a save a crash cut short) but one `latest` names, as rank 0
// sees them. Rank 0 un-commits each committed one (removes its manifest and fsyncs its
// directory) first; each rank then removes the files of them it sees (node-local disks
// included), and the root is fsynced. Throws std::runtime_error on every rank alike when a rank
// failed (an un-commit that failed removes no file).
void prune_checkpoints(Communicator& comm, const std::filesystem::path& root, size_t keep);

// The checkpoint <root>/latest names, if there is one with a manifest.
std::optional<std::filesystem::path> latest_checkpoint(const std::filesystem::path& root);

// The committed checkpoints under `root` (directories with a manifest), sorted by name.
std::vector<std::filesystem::path> committed_checkpoints(const std::filesystem::path& root);

// Why the checkpoint directory `dir` cannot be resumed from ("does not exist", "has no
// manifest.json (never committed)", a file missing, short or unlike the manifest's record of its
// size and CRC32C), or "" when it is complete. Cheap: reads the manifest and the index files, and
// the data files' sizes (their chunks' CRCs are checked as the load reads them). Files of ranks
// other than 0 that this host does not see are taken to be on other hosts' disks.
std::string incomplete_checkpoint(const std::filesystem::path& dir);

// What `--resume` starts from under `root` (reads only: nothing is removed). `latest`'s
// checkpoint when it is complete; else, `latest` missing, unreadable, or naming a directory that
// is missing or incomplete (after a power cut it can lag or lead), the newest complete committed
// checkpoint, with `note` saying which and why; std::nullopt when `root` holds neither `latest`
// nor a committed checkpoint (a first run, or one whose first save never committed). Throws
// std::runtime_error saying what it found when there is a `latest` or a manifest but no complete
// checkpoint. `note` also names the half-written step directories found (a crash's leftovers).
struct ResumeFinding {
  std::optional<std::filesystem::path> dir;
  std::string note;
};
ResumeFinding find_resume_point(const std::filesystem::path& root);


// Collective, before the engine is built: what a resumed run starts from, as rank 0 chose it
// (`rank0_choice`: a checkpoint directory or stored checkpoint's URL, nullopt for a fresh start;
// `rank0_error`: non-empty when rank 0's choice failed, thrown on every rank as
// std::runtime_error). Other ranks' arguments are ignored: with node-local disks only rank 0's
// holds the manifest and `latest`, and a store that lags can show ranks different newest
// checkpoints. `meta` is read by rank 0 and travels with the choice.
struct ResumeChoice {
  std::optional<std::filesystem::path> dir;
  CheckpointMeta meta;
};
ResumeChoice agree_resume_point(Communicator& comm, const std::optional<std::filesystem::path>& rank0_choice,
                                const std::string& rank0_error);

// The training position a committed checkpoint holds, read from its manifest alone (no engine:
// a run reads it before building one). A checkpoint written before the manifest recorded the
// global batch gets samples_consumed / train_steps when that divides, else 0.
CheckpointMeta read_checkpoint_meta(const std::filesystem::path& checkpoint_dir);

// The batch a resumed run trains with. The checkpoint's data position counts sequences, so a
// different global batch (micro_batch x grad_accum x world size) from here on means other samples
// per step than the saved run took: at another world size, grad_accum is changed to keep the saved
// global batch when it divides evenly (the note says so); otherwise a different global batch is
// refused (std::invalid_argument naming both and the way out) unless `allow_change`, and then the
// note says what changed. `saved.global_batch` 0 (not known): nothing is checked.
struct ResumeBatch {
  int64_t grad_accum = 1;
  std::string note;  // for the user; empty when the batch is the saved one
};
ResumeBatch resume_batch(const CheckpointMeta& saved, int64_t micro_batch, int64_t grad_accum, int world_size,
                         bool allow_change);

}  // namespace strata::engine
