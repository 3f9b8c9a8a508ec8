// The training configuration: what `strata train --config FILE` reads (docs/CONFIG.md is the
// reference for every key). Unknown keys and invalid values are rejected with a message naming
// the key and the file.
// Thread safety: plain values.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "strata/engine/lr_schedule.h"
#include "strata/models/model_config.h"
#include "strata/offload/transfer_options.h"

namespace strata::offload {
class FaultInjector;
}

namespace strata::engine {

enum class Precision { kFp32, kBf16, kFp16 };
// Where a state kind lives between uses: GPU memory, host RAM (pinned on GPU machines), or NVMe
// swap files under offload.nvme_dirs (streamed through host buffers when used).
// kAuto: chosen by the engine at construction (placement.h), fastest tier first.
enum class Placement { kDevice, kHost, kNvme, kAuto };
// When the Adam update of host- or NVMe-placed optimizer state runs (optimizer.overlap). Every
// choice gives bitwise the same numbers; they differ in what the update overlaps.
enum class UpdateOverlap {
  kOff,       // after backward, before train_step returns
  kForward,   // on a thread during the next step's forward, unit by unit in forward order
  kBackward,  // on a thread during this step's backward, each unit as soon as its gradient is
              // final (no global clipping, no fp16 loss scaling: neither is known until the end)
};
const char* to_string(Precision p);
const char* to_string(Placement p);
const char* to_string(UpdateOverlap o);

// What the Engine needs.
struct EngineConfig {
  // Optimizer (AdamW when decoupled_weight_decay, else Adam with L2), as torch::optim names them.
  double lr = 1e-3, beta1 = 0.9, beta2 = 0.999, eps = 1e-8, weight_decay = 0.0;
  bool decoupled_weight_decay = true;
  // Tensors that get no weight decay (a second parameter group with weight_decay 0, as
  // transformers' Trainer makes one): biases, norm weights (the other 1-D tensors) and the
  // token and position embeddings (with the tied head), each by choice (optimizer.no_decay).
  bool no_decay_bias = false, no_decay_norm = false, no_decay_embedding = false;
  double clip_grad_norm = 0.0;  // 0: off
  // Applies with master weights off the device (a device-placed master is updated by one
  // asynchronous CUDA launch after backward). kBackward with grad_accum 1 also stores no
  // gradients (gradients_transient in placement.h).
  UpdateOverlap update_overlap = UpdateOverlap::kForward;
  bool profile = false;  // device-timed compute spans and a trace (Engine::take_trace)
  int64_t micro_batch = 1;      // sequences per micro-batch per rank
  int64_t grad_accum = 1;       // micro-batches per step
  int64_t seq_len = 64;
  Precision compute = Precision::kFp32;  // compute copies of the parameters
  Precision reduce = Precision::kFp32;   // gradient reduce-scatter (fp32 or bf16)
  double initial_loss_scale = 65536.0;   // fp16 only
  int64_t loss_scale_window = 1000;      // good steps before the fp16 loss scale doubles
  Placement params = Placement::kHost;   // compute-copy shards between uses
  Placement grads = Placement::kHost;    // fp32 gradient accumulation shards
  Placement master = Placement::kHost;   // fp32 master parameters
  Placement moments = Placement::kHost;  // Adam moments
  // Activation checkpoints (each block's input, kept from its forward to its recompute): device
  // memory (no copies), host RAM, or NVMe; kAuto: the device if they fit beside everything else,
  // else the host if they fit its budget, else NVMe (when nvme_dirs are set), else the host.
  Placement activations = Placement::kHost;
  // Blocks whose backward recomputes their forward from an activation checkpoint, the first ones
  // in forward order; every later block keeps its forward's autograd graph (its saved tensors and
  // its gathered parameters) on the device until its backward, which then runs without
  // recompute. kRecomputeAll: every block (the default); 0: none; kRecomputeAuto: as few as the
  // device budget holds beside the state and the working set (the resolved count:
  // Engine::config().recompute_blocks). Whole blocks, also when blocks are cut into tile stages.
  static constexpr int kRecomputeAll = 1 << 30, kRecomputeAuto = -1;
  int recompute_blocks = kRecomputeAll;
  // placement.tiling: the LM head's logits [micro_batch x seq_len, vocab] cut into at least this
  // many tiles (token chunks x vocabulary tiles, layout::logits_tiles), so that the loss never
  // holds more than one tile of them. kTilesAuto: the fewest that let the working set fit the
  // device (Engine::config() shows the count chosen); 1: untiled.
  static constexpr uint64_t kTilesAuto = 0;
  uint64_t head_tiles = kTilesAuto;
  // placement.tiling "head_pass": "one" cuts the head's logits into token chunks over the whole
  // vocabulary where the fp32 weight gradient they hold fits too, and computes each chunk's
  // gradients with its loss (no logits recomputed in the backward); "two" (the default): tiles
  // over vocabulary ranges, recomputed in the backward. On the development machine's CPU one
  // pass ran slower (its chunks of the whole vocabulary leave the cache, and its weight gradient
  // takes a rank-chunk update per chunk); not yet measured on a GPU, where it saves a product.
  bool head_one_pass = false;
  // placement.tiling for the blocks (models::LayerTiles): each block's attention cut into this
  // many groups of key/value heads and its MLP into this many slices of the intermediate
  // dimension, each tile a unit of its own. kTilesAuto: whole blocks when the working set fits
  // the device, else the fewest tiles that fit (both kinds cut in proportion to their
  // parameters); 1 and 1: whole blocks.
  uint64_t attention_tiles = kTilesAuto, mlp_tiles = kTilesAuto;
  // placement.tiling "vocab": the embedding and the LM head cut into this many ranges of
  // vocabulary rows, each a unit (or, tied, one unit for both) and a stage of its own, so that no
  // whole vocabulary x hidden weight is ever gathered. kTilesAuto: whole when the working set
  // fits the device, else the fewest (doubling) that fit; 1: whole.
  uint64_t vocab_tiles = kTilesAuto;
  // placement.tiling "mlp_tokens": every MLP (whole block or tile) run over chunks of this many
  // tokens, its intermediate activations one chunk at a time (tiling::chunked_mlp; the backward
  // recomputes them, about one more MLP forward a step). 0: the whole micro-batch at once.
  // kMlpChunkAuto: chunks of layout::auto_mlp_token_chunk tokens only where no tiling fits the device
  // without them (resolve_mlp_token_chunk), else whole.
  static constexpr int64_t kMlpChunkAuto = -1;
  int64_t mlp_token_chunk = kMlpChunkAuto;
  // model.trainable: patterns over the Hugging Face tensor names (models/trainable.h); the tensors
  // no pattern matches are frozen (only their compute copy: no gradient, no reduce-scatter, no
  // master weights or moments, nothing in a checkpoint). Empty: every tensor trains.
  std::vector<std::string> trainable;
  std::vector<std::string> nvme_dirs;     // swap directories (one per drive) for "nvme" placement
  unsigned io_queue_depth = 32;           // NVMe requests in flight
  // Construction progress (not in the JSON configuration): called on the constructing thread
  // after each unit's initial weights are in their shards (and swap files), with the units done
  // and their total; a large model spends minutes there.
  std::function<void(size_t done, size_t total)> on_unit_placed;
  // Planning only (not in the JSON configuration; `strata train --plan`): the engine resolves the
  // placement and stops there, allocating no state and materializing no weights. Only config(),
  // placement_report() and the optimizer_*_units() accessors mean something then; train_step
  // throws.
  bool plan_only = false;
  // Tests only (not in the JSON configuration): the swap I/O engine's fault injector.
  std::shared_ptr<offload::FaultInjector> io_fault_injector;
  uint64_t nvme_chunk_bytes = 64ull << 20;  // fp32 bytes per array per streamed optimizer chunk
  // Ranks sharing this machine's RAM and disks (not in the JSON configuration; `strata train`
  // passes DistEnv::local_world_size); 0: $LOCAL_WORLD_SIZE, else the world size.
  int local_ranks = 0;
  // Automatic placement: state bytes this rank may put in host RAM and on NVMe; 0: derived from
  // the machine (80% of MemAvailable, 95% of the free space of nvme_dirs, shared by local ranks).
  uint64_t host_budget = 0;
  uint64_t nvme_budget = 0;
  std::string device = "cpu";
  uint64_t device_budget = UINT64_MAX;   // bytes the engine may hold on the device
  int prefetch = 1;                      // units gathered ahead of the running one
  // device.prefetch "auto": start at one unit ahead and go one deeper after every step that
  // waited for parameters more than 2% of its time while that helps and the budget holds the
  // deeper window (PrefetchTuner in placement.h).
  bool prefetch_auto = false;
  unsigned cpu_threads = 0;              // optimizer kernel threads; 0: this rank's share (cpu_share.h)
  double timeout_s = 300;                // collectives and rendezvous
  void validate() const;                 // throws std::invalid_argument
};

struct TrainConfig {
  LrSchedule lr_schedule;  // optimizer.schedule; total_steps 0: run.steps (schedule())
  LrSchedule schedule() const {
    LrSchedule s = lr_schedule;
    if (s.total_steps == 0) s.total_steps = steps;
    return s;
  }
  models::ModelConfig model;
  std::string init_from;  // Hugging Face model directory, or empty for random init
  // model.quantize's bnb_4bit_compute_dtype as given ("float32", "bfloat16", "float16"; "": not
  // given): it must name precision.compute, the dtype the 4-bit weights are dequantized into.
  std::string quantize_compute_dtype;
  std::string adapter_from;  // PEFT LoRA adapter directory (model.adapter_from), or empty
  uint64_t init_seed = 0;
  std::string data_path = "/usr/share/common-licenses";
  std::string data_format = "bytes";  // bytes, uint16, uint32 (token windows) or sft (examples)
  uint64_t data_seed = 0;
  int64_t data_pad_id = 0;  // sft: the id after an example's end (out of the loss)
  // sft: examples packed into windows (models::PackedExamples), training and evaluation data
  // alike; default on for sft. An example longer than seq_len + 1 tokens is cut ("truncate") or
  // refuses the run ("refuse").
  bool data_pack = false;
  std::string data_overlong = "truncate";
  // Evaluation (data.eval_*): a held-out file, or the last eval_split of the training samples;
  // its loss every eval_every steps (0: only after the last step) over its first
  // eval_max_samples samples (0: all).
  std::string eval_path;
  std::string eval_format;  // default: data_format
  double eval_split = 0;
  int64_t eval_every = 0;
  int64_t eval_max_samples = 0;
  bool evaluates() const { return !eval_path.empty() || eval_split > 0; }
  int64_t steps = 20;
  std::string log_path = "strata-train.jsonl";
  bool progress = true;
  // Hugging Face safetensors + config.json after the last step; with model.lora, a PEFT adapter
  // directory (adapter_config.json + adapter_model.safetensors) instead.
  std::string export_dir;
  bool export_merged = false;  // LoRA: also the merged model (base + scaled B A) in <export_dir>-merged
  std::string export_merged_into = "base";  // a 4-bit base: "base" (init_from's weights) or "dequantized"
  bool export_overwrite = false;  // a non-empty export_dir is replaced (its other files kept)
  int64_t export_every = 0;  // also every N steps, into <export_dir>-step-N; 0: only at the end
  std::string export_dtype = "auto";  // float32, bfloat16, float16; auto: bf16 compute -> bfloat16
  uint64_t export_shard_bytes = 5000000000;  // models::kDefaultShardBytes: larger exports are sharded
  std::string tensorboard_dir;  // TensorBoard event files of the run's scalars; empty: none
  std::string profile_path;  // per-step timeline printed, Chrome trace written here; empty: off
  std::string checkpoint_dir;  // root of the checkpoints (checkpoint.h); empty: none
  int64_t save_every = 0;      // save every N steps (and after the last); 0: only after the last
  bool resume = false;         // start from <checkpoint_dir>/latest when there is one
  bool allow_batch_change = false;  // resume with another global batch than the checkpoint's
  int64_t keep_checkpoints = 0;  // keep only the N newest checkpoints; 0: keep all
  bool async_checkpoint = true;  // write in the background; the step blocks for the snapshot
  uint64_t checkpoint_staging = 0;  // CheckpointOptions::staging_bytes (0: from MemAvailable)
  // Tiered saves (checkpoint_store.h): each committed checkpoint is also uploaded to this object
  // store URL in the background; empty: none. A checkpoint_dir that is an object-store URL means
  // this, with the local copies in checkpoint_local_dir.
  std::string checkpoint_upload;
  std::string checkpoint_local_dir;  // local side of an s3:// checkpoint_dir; empty: a default
  int64_t keep_uploaded_checkpoints = 0;  // keep only the N newest in the store; 0: keep all
  // How checkpoints move to and from object storage: uploads' part size and the ranged reads'
  // largest request, and how many of either are in flight (run.checkpoint_part_size,
  // run.checkpoint_concurrency).
  offload::TransferOptions checkpoint_transfer;
  EngineConfig engine;
};

// Reading a configuration file: strata/engine/config_parse.h (strata::config).

}  // namespace strata::engine
