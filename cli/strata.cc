// The strata command-line program: one binary, one subcommand per job.
#include <chrono>
#include <csignal>
#include <cstdlib>
#include <malloc.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <iostream>
#include <sstream>
#include <string>
#include <vector>

#include "args.h"
#include "adam_bench.h"
#include "io_bench.h"
#include "step_bench.h"
#include "ckpt_bench.h"
#include "train_bench.h"
#include "tiling_bench.h"
#include "plan_bench.h"
#include "scale_bench.h"
#include "plot.h"
#include "strata/engine/device.h"
#include "train.h"
#include "plan.h"
#include "strata/engine/build_info.h"
#include "strata/engine/checkpoint.h"
#include "strata/engine/checkpoint_store.h"
#include "strata/offload/object_store.h"
#include "object_paths.h"

namespace {

constexpr const char* kUsage = R"(strata: train and fine-tune models larger than GPU memory

usage: strata <command> [options]

commands:
  train        train or fine-tune a model (JSON configuration, docs/CONFIG.md)
  launch       run N ranks of a command on this node (torchrun environment)
  plan         what fits where and how fast: Strata beside 3D parallelism on a cluster,
               the largest model each trains (--max-model); --calibrate measures this machine
  data prepare --tokenizer MODEL_DIR --output FILE.bin INPUTS...
               tokenize text files with a Hugging Face tokenizer into the token file
               `strata train` reads (data.format uint16/uint32; models/prepare_data.py)
  data prepare --chat --tokenizer MODEL_DIR --output FILE.sft CHATS.jsonl...
               prompt/response or chat-message JSONL into supervised examples with the
               tokenizer's chat template, loss on the responses only (data.format sft)
  plot LOG.jsonl -o OUT.png
               a PNG of a run's log: loss and eval loss, learning rate, tokens/s, memory
  ckpt inspect DIR   summary of a checkpoint (DIR: a checkpoint, or a root with `latest`; or
                     s3://bucket/prefix[/step-N]: a stored checkpoint, or a store's newest)
  ckpt verify DIR    read every chunk of a checkpoint and check its CRC32C and coverage
  ckpt export DIR OUT [--dtype float32|bfloat16|float16] [--force] [--tokenizer-from MODEL_DIR] [--shard-size SIZE]
                     (DIR or OUT may be s3:// URLs)
                     stream the master weights into a Hugging Face model directory
                     (config.json + safetensors, sharded above SIZE, default 5 GB) that transformers loads,
                     with MODEL_DIR's tokenizer files; a non-empty OUT needs --force (its
                     other files, e.g. a tokenizer, are kept)
  bench io     bandwidth of the NVMe I/O engine beside fio (same file system, block size,
               queue depth), sequential and random, read and write
  bench adam   CPU Adam kernel beside PyTorch's fused AdamW, torch::optim::AdamW and the
               memory-bandwidth bound, same threads
  bench step   the engine's training step beside plain libtorch on a model that fits
  bench ckpt   checkpoint save/restore bandwidth beside fio and torch::save/torch::load
  bench train  step time of `strata train` configurations beside plain PyTorch and FSDP2
               with CPU offload on the same GPT shape (bench/train_baseline.py)
  bench tiling the tiled LM head beside the untiled one: step-time overhead where both fit,
               and the largest vocabulary x tokens that trains in one device budget
  bench plan   `strata plan`'s predictions beside seven measured `strata train` runs on this
               machine (calibrated first): step time and per-tier memory errors
  bench scale  collectives, steps, saves and loads at 1-32 ranks on this machine; checkpoint
               metadata a load reads per rank, gpt-1t saved by 512 and 4096 ranks, beside format 2's
  version      versions of strata and libtorch, CUDA, CPU kernel ISA, I/O backends
  help         this text

`strata <command> --help` shows the options of a command.
)";

constexpr const char* kBenchIoUsage = R"(usage: strata bench io [options]

Measures the I/O engine (O_DIRECT, pinned buffers) and fio side by side on one directory and
prints one JSON line per pattern and a final summary JSON line.

options:
  --dir PATH         directory to test (default: strata-bench-io, created if missing)
  --size BYTES       file size per side (default 1G; suffixes K, M, G, T)
  --block BYTES      block size (default 1M)
  --qd N             queue depth (default 32)
  --backend NAME     auto | io_uring | threads (default auto)
  --patterns LIST    comma-separated: write,read,randwrite,randread (default: all four)
  --repeat N         runs per pattern and side, best reported (default 1)
  --fio PATH         fio executable, or "none" to skip the baseline (default fio)
  --keep             keep the test files
)";

constexpr const char* kBenchAdamUsage = R"(usage: strata bench adam [options]

Parameters per second of one AdamW step on a single partition, in one run and at one thread
count, for Strata's CPU kernel, ATen's fused AdamW and torch::optim::AdamW, with the bound set by
the bandwidth of a multi-threaded in-place streaming update over as many
bytes. Cases: fp32 everywhere; bf16 gradients in and a bf16 parameter copy out. Prints one JSON line per case and a final summary JSON line.

options:
  --params N     parameters in the partition (default 100000000)
  --threads N    threads for every side (default: all hardware threads)
  --steps N      timed steps per method, interleaved, median reported (default 9)
)";

std::vector<std::string> split(const std::string& s, char sep) {
  std::vector<std::string> out;
  std::stringstream ss(s);
  std::string item;
  while (std::getline(ss, item, sep)) {
    if (!item.empty()) out.push_back(item);
  }
  return out;
}

int bench_io(const std::vector<std::string>& argv) {
  for (const auto& a : argv) {
    if (a == "--help" || a == "-h") {
      std::cout << kBenchIoUsage;
      return 0;
    }
  }
  strata::cli::Args args(argv, {"dir", "size", "block", "qd", "backend", "patterns", "repeat", "fio"},
                         {"keep"});
  strata::bench::IoBenchOptions o;
  o.dir = args.get("dir", o.dir.string());
  o.file_bytes = args.size("size", o.file_bytes);
  o.block_bytes = args.size("block", o.block_bytes);
  o.queue_depth = args.count("qd", o.queue_depth);
  o.backend = strata::offload::parse_io_backend(args.get("backend", "auto"));
  if (args.has("patterns")) o.patterns = split(args.get("patterns", ""), ',');
  o.repeat = std::max(1u, args.count("repeat", o.repeat));
  o.fio = args.get("fio", o.fio);
  o.keep_files = args.has("keep");
  strata::bench::run_io_bench(o);
  return 0;
}

int bench_adam(const std::vector<std::string>& argv) {
  for (const auto& a : argv) {
    if (a == "--help" || a == "-h") {
      std::cout << kBenchAdamUsage;
      return 0;
    }
  }
  strata::cli::Args args(argv, {"params", "threads", "steps"}, {});
  strata::bench::AdamBenchOptions o;
  o.params = args.size("params", o.params);
  o.threads = args.count("threads", o.threads);
  o.steps = std::max(1u, args.count("steps", o.steps));
  if (o.params == 0) throw std::invalid_argument("--params must be positive");
  strata::bench::run_adam_bench(o);
  return 0;
}

constexpr const char* kBenchStepUsage = R"(usage: strata bench step [options]

The engine's fp32 training step (one rank, ZeRO-3 schedule, CPU AdamW) beside plain libtorch on
the same GPT-2-shaped model and data, with and without block recompute. The baseline is plain
libtorch doing what the engine does: no recompute when the engine keeps every block's graph
(--recompute none, or auto, which keeps them all where memory is unlimited), else every block
recomputed. Timed round-robin; medians; final JSON line.

  --layers N     transformer blocks (default 4)
  --hidden N     model width (default 256)
  --heads N      attention heads (default 4)
  --vocab N      vocabulary (default 8192)
  --seq N        tokens per sequence (default 128)
  --batch N      sequences per step (default 8)
  --steps N      timed steps per method (default 5)
  --threads N    threads for libtorch and the kernels (default: all)
  --overlap M    optimizer.overlap: forward (default: the Adam step during the next step's
                 forward), backward (during this step's backward) or off (after backward)
  --no-overlap   the same as --overlap off
  --placement P  host (default) or device: where the engine keeps every state kind and the
                 activation checkpoints (device: the host device's memory, no staging copies)
  --recompute R  placement.recompute: auto (default), none, all, or the number of blocks
                 recomputed
)";

constexpr const char* kBenchTilingUsage = R"(usage: strata bench tiling [options]

The engine's LM head with its logits cut into tiles (placement.tiling) beside the same engine
with them whole, in one run, fp32 on the host device:
  (a) the step time of a model that fits both ways, its head's logits tiled vs whole, its
      blocks cut into tiles vs whole, and its embedding and LM head in vocabulary tiles vs whole
      (target: at most 10% more each);
  (b) in one device budget, the largest vocabulary (doubling from 256 up to
      --capacity-max-vocab) for which the engine constructs and runs a training step of
      --capacity-tokens tokens, untiled vs tiling "auto", as logits elements (target: at least
      16x).
  (c) the blocks cut into tiles: in --hidden-budget, the largest hidden size (doubling from 128 up to
      --hidden-max) of a one-block GPT-2 that trains with whole blocks vs blocks cut "auto"
      (target: at least 8x).
  (d) long sequences: in --sequence-budget, the longest sequence (doubling from 256 up to
      --sequence-max) of a one-block GPT-2 of --sequence-hidden that trains with whole blocks
      and whole-sequence MLPs vs tiling "auto" (block tiles and MLP token chunks; no target:
      attention and the activations between stages still grow with the sequence).
A JSON line per part.

  --layers N            (a) transformer blocks (default 2)
  --hidden N            (a) model width (default 256)
  --heads N             (a) attention heads (default 4)
  --vocab N             (a) vocabulary (default 32768)
  --seq N               (a) tokens per sequence (default 256)
  --batch N             (a) sequences per step (default 4)
  --tiles N             (a) the head's tiles (default 16)
  --head-pass P         (a) the head's tiles in "two" passes (default) or "one" (head_pass;
                        then without the vocabulary-tile line, whose head runs in two)
  --attention-tiles N   (a) each block's attention tiles (default 2, at most --heads)
  --mlp-tiles N         (a) each block's MLP tiles (default 4)
  --vocab-tiles N       (a) the embedding's and LM head's vocabulary tiles (default 8)
  --steps N             (a) timed steps per side (default 5)
  --budget BYTES        (b) the device budget (default 64MiB)
  --capacity-hidden N   (b) model width (default 64)
  --capacity-tokens N   (b) tokens per step (default 4096)
  --capacity-max-vocab N (b) the largest vocabulary tried (default 262144)
  --hidden-budget BYTES (c) the device budget (default 16MiB)
  --hidden-tokens N     (c) tokens per step (default 64)
  --hidden-max N        (c) the largest hidden size tried (default 4096)
  --sequence-budget BYTES (d) the device budget (default 16MiB)
  --sequence-hidden N   (d) model width (default 128)
  --sequence-max N      (d) the longest sequence tried (default 65536)
  --threads N           threads for libtorch and the kernels (default: all)
  --device D            cpu (default: the host device) or cuda
  --compute P           precision.compute: fp32 (default) or bf16
  --parts LIST          which parts run, of a, b, c and d (default abcd)
)";

int bench_tiling(const std::vector<std::string>& argv) {
  for (const auto& a : argv)
    if (a == "--help" || a == "-h") {
      std::cout << kBenchTilingUsage;
      return 0;
    }
  strata::cli::Args args(argv, {"layers", "hidden", "heads", "vocab", "seq", "batch", "tiles", "attention-tiles",
                                "mlp-tiles", "vocab-tiles", "steps", "budget",
                                "capacity-hidden", "capacity-tokens", "capacity-max-vocab", "hidden-budget", "hidden-tokens", "hidden-max",
                                "sequence-budget", "sequence-hidden", "sequence-max",
                                "threads", "device", "compute", "head-pass", "parts"}, {});
  strata::bench::TilingBenchOptions o;
  o.layers = args.count("layers", unsigned(o.layers));
  o.hidden = args.count("hidden", unsigned(o.hidden));
  o.heads = args.count("heads", unsigned(o.heads));
  o.vocab = args.count("vocab", unsigned(o.vocab));
  o.seq = args.count("seq", unsigned(o.seq));
  o.batch = args.count("batch", unsigned(o.batch));
  o.tiles = args.count("tiles", unsigned(o.tiles));
  const std::string pass = args.get("head-pass", "two");
  if (pass != "one" && pass != "two") throw std::invalid_argument("bench tiling: --head-pass must be one or two, not " + pass);
  o.head_one_pass = pass == "one";
  o.attention_tiles = args.count("attention-tiles", unsigned(o.attention_tiles));
  o.mlp_tiles = args.count("mlp-tiles", unsigned(o.mlp_tiles));
  o.vocab_tiles = args.count("vocab-tiles", unsigned(o.vocab_tiles));
  o.steps = args.count("steps", o.steps);
  if (args.has("budget")) o.budget = strata::engine::parse_bytes(args.get("budget", ""));
  o.capacity_hidden = args.count("capacity-hidden", unsigned(o.capacity_hidden));
  o.capacity_tokens = args.count("capacity-tokens", unsigned(o.capacity_tokens));
  o.capacity_max_vocab = args.count("capacity-max-vocab", unsigned(o.capacity_max_vocab));
  if (args.has("hidden-budget")) o.hidden_budget = strata::engine::parse_bytes(args.get("hidden-budget", ""));
  o.hidden_tokens = args.count("hidden-tokens", unsigned(o.hidden_tokens));
  o.hidden_max = args.count("hidden-max", unsigned(o.hidden_max));
  if (args.has("sequence-budget")) o.sequence_budget = strata::engine::parse_bytes(args.get("sequence-budget", ""));
  o.sequence_hidden = args.count("sequence-hidden", unsigned(o.sequence_hidden));
  o.sequence_max = args.count("sequence-max", unsigned(o.sequence_max));
  o.threads = args.count("threads", o.threads);
  o.device = args.get("device", o.device);
  o.compute = args.get("compute", o.compute);
  o.parts = args.get("parts", o.parts);
  if (o.parts.empty() || o.parts.find_first_not_of("abcd") != std::string::npos)
    throw std::invalid_argument("bench tiling: --parts takes a, b, c and d, not " + o.parts);
  strata::bench::run_tiling_bench(o);
  return 0;
}

constexpr const char* kBenchPlanUsage = R"(usage: strata bench plan [options]

Calibrates this machine (`strata plan --calibrate`'s rounds, and one more after each run), then
runs seven `strata train` configurations on the host device (GPT and Llama shapes; state on the
host, on the device, master and moments in swap; optimizer after backward, overlapped with the
next forward, inside backward; 1 and 2 ranks; whole blocks and blocks in tiles) three times, the second pass in reverse order, and
prints each one's step time (the median of its passes' medians, and each pass's) and per-tier
memory beside `strata plan`'s
prediction for the same configuration, then one JSON line with the worst step-time error. Each
configuration then runs once more with the plan's device bytes as its device budget: the device
peak there is compared with the plan (the peak without a budget is shown beside).

  --dir DIR        work directory: configurations, logs, swap (default strata-bench-plan)
  --cluster FILE   use this cluster description instead of calibrating
  --steps N        steps per run, the first two left out (default 8)
  --quick          smaller models, one pass (a quicker check)
  --device D       cpu (default: the host device, 1 and 2 ranks) or cuda (GPU 0, bf16, larger
                   models, one rank; calibrates the GPU)
)";

int bench_plan(const std::vector<std::string>& argv) {
  for (const auto& a : argv)
    if (a == "--help" || a == "-h") {
      std::cout << kBenchPlanUsage;
      return 0;
    }
  strata::cli::Args args(argv, {"dir", "cluster", "steps", "device"}, {"quick"});
  strata::bench::PlanBenchOptions o;
  o.dir = args.get("dir", o.dir.string());
  o.cluster = args.get("cluster", "");
  o.steps = args.count("steps", unsigned(o.steps));
  o.quick = args.has("quick");
  o.device = args.get("device", o.device);
  if (o.steps < 3) throw std::invalid_argument("bench plan: --steps must be >= 3 (two warm-up steps are left out)");
  strata::bench::run_plan_bench(o);
  return 0;
}

constexpr const char* kBenchScaleUsage = R"(usage: strata bench scale [options]

How the engine's costs grow with the world size and the model, in three parts:
- the engine's all-gather and reduce-scatter at each world size of --worlds but 1 (processes of
  `strata launch` on this machine): seconds, and the bytes and write calls one rank sends;
- a tiny Llama trained 5 steps, saved and resumed at each world size: step, save and load
  seconds, collective bytes a step, the checkpoint's metadata bytes, peak RSS;
- the checkpoint metadata a load reads per rank as the world that saved it grows: the metadata
  of a checkpoint of the model (format 3, the engine's own writer, no data) saved by each size of
  --ranks, read as one rank of a load at that size reads it, in a fresh process (seconds, bytes,
  peak RSS); beside it, the same checkpoint in format 2 (every chunk in the manifest) at the
  first size.
Each part prints its growth exponents against the world size; the final JSON line is the
metadata part's.

  --worlds LIST    ranks on this machine, comma-separated (default 1,2,4,8,16,32; 0: skip the
                   first two parts)
  --bytes SIZE     the collectives' buffer (default 16MiB)
  --preset NAME    model preset (default gpt-1t)
  --ranks LIST     saving world sizes, comma-separated (default 512,4096)
  --dir DIR        where the metadata is written, then removed (default strata-bench-scale)
  --no-baseline    skip format 2 (a few hundred MB of JSON at gpt-1t)
)";

// "1,2,4" -> {1, 2, 4}; every size >= `least`.
std::vector<int> world_list(const std::string& list, const char* flag, int least) {
  std::vector<int> out;
  for (size_t at = 0; at <= list.size();) {
    const size_t comma = std::min(list.find(',', at), list.size());
    const int n = std::stoi(list.substr(at, comma - at));
    if (n < least)
      throw std::invalid_argument(std::string("bench scale: ") + flag + " takes world sizes >= " + std::to_string(least));
    out.push_back(n);
    at = comma + 1;
  }
  return out;
}

int bench_scale(const std::vector<std::string>& argv) {
  for (const auto& a : argv)
    if (a == "--help" || a == "-h") {
      std::cout << kBenchScaleUsage;
      return 0;
    }
  strata::cli::Args args(argv, {"preset", "ranks", "dir", "read-metadata", "rank", "worlds", "bytes", "iters"},
                         {"no-baseline", "collective-rank"});
  if (args.has("read-metadata"))
    return strata::bench::read_metadata_as_a_load(args.get("read-metadata", ""), int(args.count("rank", 0u)));
  strata::bench::ScaleBenchOptions o;
  if (args.has("bytes")) o.collective_bytes = args.size("bytes", o.collective_bytes);
  o.collective_iters = int(args.count("iters", unsigned(o.collective_iters)));
  if (o.collective_iters < 1) throw std::invalid_argument("bench scale: --iters must be at least 1");
  if (args.has("collective-rank")) return strata::bench::collective_rank(o.collective_bytes, o.collective_iters);
  o.preset = args.get("preset", o.preset);
  o.dir = args.get("dir", o.dir.string());
  o.baseline = !args.has("no-baseline");
  if (args.has("ranks")) o.saved_worlds = world_list(args.get("ranks", ""), "--ranks", 1);
  if (args.has("worlds")) {
    const std::string worlds = args.get("worlds", "");
    o.worlds = worlds == "0" ? std::vector<int>{} : world_list(worlds, "--worlds", 1);
  }
  strata::bench::run_scale_bench(o);
  return 0;
}

int bench_step(const std::vector<std::string>& argv) {
  for (const auto& a : argv)
    if (a == "--help" || a == "-h") {
      std::cout << kBenchStepUsage;
      return 0;
    }
  strata::cli::Args args(argv, {"layers", "hidden", "heads", "vocab", "seq", "batch", "steps", "threads", "placement", "recompute", "overlap"}, {"no-overlap"});
  strata::bench::StepBenchOptions o;
  o.layers = args.count("layers", unsigned(o.layers));
  o.hidden = args.count("hidden", unsigned(o.hidden));
  o.heads = args.count("heads", unsigned(o.heads));
  o.vocab = args.count("vocab", unsigned(o.vocab));
  o.seq = args.count("seq", unsigned(o.seq));
  o.batch = args.count("batch", unsigned(o.batch));
  o.steps = args.count("steps", o.steps);
  o.threads = args.count("threads", o.threads);
  o.overlap = args.has("no-overlap") ? "off" : args.get("overlap", o.overlap);
  o.placement = args.get("placement", o.placement);
  if (o.placement != "host" && o.placement != "device")
    throw std::invalid_argument("bench step: --placement must be host or device, not " + o.placement);
  o.recompute = args.get("recompute", o.recompute);
  strata::bench::run_step_bench(o);
  return 0;
}

}  // namespace

std::string python_interpreter();

int bench_ckpt(const std::vector<std::string>& argv) {
  for (const auto& a : argv)
    if (a == "--help" || a == "-h") {
      std::cout << "usage: strata bench ckpt [--dir PATH] [--preset NAME] [--layers N] [--hidden N --vocab N] [--rounds N]\n"
                   "                         [--fio PATH|none] [--store s3://bucket/prefix [--python PATH]]\n\n"
                   "Saves and restores the fp32 master and moments of an engine holding the model\n"
                   "(default gpt2, 124M parameters: 1.5 GB) in PATH (default strata-bench-ckpt),\n"
                   "beside fio's sequential write (+ fsync) / read (1 MiB, QD32) and\n"
                   "torch::save/torch::load, every side once per round (default 3 rounds, medians).\n"
                   "With --store: tiered saves instead: the upload of a committed checkpoint to the\n"
                   "store and the restore from it, beside boto3's transfer manager on the same data\n"
                   "file (same part size and concurrency; --python: an interpreter with boto3, default\n"
                   "$STRATA_PYTHON or the setup's), and the seconds a tiered save blocks training.\n";
      return 0;
    }
  strata::cli::Args args(argv, {"dir", "preset", "layers", "hidden", "vocab", "fio", "rounds", "store", "python"}, {});
  strata::bench::CkptBenchOptions o;
  o.dir = args.get("dir", o.dir.string());
  o.preset = args.get("preset", o.preset);
  o.layers = args.count("layers", 0);
  o.hidden = args.count("hidden", 0);
  o.vocab = args.count("vocab", o.vocab);
  o.fio = args.get("fio", o.fio);
  o.rounds = unsigned(args.count("rounds", o.rounds));
  if (o.rounds == 0) throw std::invalid_argument("bench ckpt: --rounds must be at least 1");
  o.store = args.get("store", "");
  if (!o.store.empty() && !strata::offload::is_object_store_url(o.store))
    throw std::invalid_argument("bench ckpt: --store must be an object-store URL (s3://bucket/prefix)");
  o.python = args.get("python", python_interpreter());
  o.baseline_script = STRATA_SOURCE_DIR "/bench/s3_baseline.py";
  strata::bench::run_ckpt_bench(o);
  return 0;
}

constexpr const char* kBenchTrainUsage = R"(usage: strata bench train --configs A.json[,B.json...] [options]

Runs each configuration as `strata train` in its own process, then PyTorch's baselines on the
same GPT-2 shape (bench/train_baseline.py: "plain", everything on the GPU with fused AdamW;
"fsdp2", FSDP2 + CPUOffloadPolicy with the fused CPU AdamW), and prints one JSON line per run
and a final JSON line with every median step time and every run/baseline ratio.

options:
  --configs LIST     comma-separated `strata train` configurations of one model shape
  --dir PATH         work directory: logs, traces, relative swap directories (default
                     strata-bench-train)
  --steps N          steps per run, warm-up included (default 6)
  --warmup N         first steps left out of the median (default 2)
  --baselines LIST   plain,fsdp2 (default), a subset, or none
  --python PATH      interpreter with torch (default $STRATA_PYTHON, else the one the build
                     was configured with, else python3)
  --script PATH      the baseline script (default: bench/train_baseline.py of this source tree)
  --profile          pass --profile to every run (a timeline line per step on stderr, and a
                     trace file per run in the work directory)
)";

// The interpreter of Strata's Python tools: $STRATA_PYTHON, else the one the build was
// configured with (the setup's virtual environment), else python3.
std::string python_interpreter() {
  const char* py = std::getenv("STRATA_PYTHON");
  const std::string built = STRATA_BUILD_PYTHON;
  return py && *py ? std::string(py) : !built.empty() ? built : "python3";
}

int bench_train(const std::vector<std::string>& argv) {
  for (const auto& a : argv)
    if (a == "--help" || a == "-h") {
      std::cout << kBenchTrainUsage;
      return 0;
    }
  strata::cli::Args args(argv, {"configs", "dir", "steps", "warmup", "baselines", "python", "script"}, {"profile"});
  strata::bench::TrainBenchOptions o;
  for (const std::string& c : split(args.get("configs", ""), ',')) o.configs.emplace_back(c);
  o.dir = args.get("dir", o.dir.string());
  o.steps = args.count("steps", unsigned(o.steps));
  o.warmup = args.count("warmup", unsigned(o.warmup));
  const std::string baselines = args.get("baselines", "plain,fsdp2");
  o.baselines = baselines == "none" ? std::vector<std::string>{} : split(baselines, ',');
  o.python = args.get("python", python_interpreter());
  o.script = args.get("script", STRATA_SOURCE_DIR "/bench/train_baseline.py");
  o.profile = args.has("profile");
  strata::bench::run_train_bench(o);
  return 0;
}

// A checkpoint directory, or the one a checkpoint root's `latest` names; in an object store
// (s3://...), a checkpoint's URL, or the newest committed one of a store's URL.
std::filesystem::path checkpoint_arg(const std::string& arg) {
  if (strata::offload::is_object_store_url(arg)) {
    try {
      strata::engine::read_checkpoint_meta(arg);
      return arg;
    } catch (const strata::offload::ObjectStoreError&) {
      throw;  // the store itself failed (credentials, network): say so
    } catch (const std::runtime_error&) {
      // not a committed checkpoint: perhaps the store holding them
    }
    if (auto newest = strata::engine::newest_stored_checkpoint(arg)) return *newest;
    throw std::runtime_error(arg + " is neither a committed checkpoint nor an object store holding one");
  }
  if (std::filesystem::exists(std::filesystem::path(arg) / "manifest.json")) return arg;
  if (auto latest = strata::engine::latest_checkpoint(arg)) return *latest;
  throw std::runtime_error(arg + " is neither a committed checkpoint nor a checkpoint root with a "
                                 "`latest` that names one");
}

int ckpt_export(const std::vector<std::string>& argv) {
  std::string dtype = "float32", tokenizer_from;
  uint64_t shard_bytes = strata::models::kDefaultShardBytes;  // as run.export_shard_size
  bool force = false;
  std::vector<std::string> pos;
  for (size_t i = 0; i < argv.size(); ++i) {
    if (argv[i] == "--force") force = true;
    else if (argv[i] == "--dtype" && i + 1 < argv.size()) dtype = argv[++i];
    else if (argv[i].starts_with("--dtype=")) dtype = argv[i].substr(8);
    else if (argv[i] == "--tokenizer-from" && i + 1 < argv.size()) tokenizer_from = argv[++i];
    else if (argv[i].starts_with("--tokenizer-from=")) tokenizer_from = argv[i].substr(17);
    else if (argv[i] == "--shard-size" && i + 1 < argv.size()) shard_bytes = strata::cli::parse_size(argv[++i]);
    else if (argv[i].starts_with("--shard-size=")) shard_bytes = strata::cli::parse_size(argv[i].substr(13));
    else if (argv[i].starts_with("-")) {
      std::cerr << "strata ckpt export: unknown option " << argv[i] << "\n";
      return 2;
    } else pos.push_back(argv[i]);
  }
  if (pos.size() != 2) {
    std::cerr << "usage: strata ckpt export DIR OUT [--dtype float32|bfloat16|float16] [--force] [--tokenizer-from MODEL_DIR] [--shard-size SIZE]\n";
    return 2;
  }
  const std::filesystem::path dir = checkpoint_arg(pos[0]);
  // OUT in object storage: staged in the cache, then uploaded (config.json last).
  const std::string out_url = strata::offload::is_object_store_url(pos[1]) ? pos[1] : "";
  if (!out_url.empty()) strata::cli::check_export_store(out_url, force, "pass --force to replace it");
  const std::string out = out_url.empty() ? pos[1] : strata::cli::cache_path("exports", out_url);
  const auto t0 = std::chrono::steady_clock::now();
  const bool tty = isatty(STDERR_FILENO);
  const auto r = strata::engine::export_checkpoint_hf(dir, out, dtype, [&](uint64_t done, uint64_t total) {
    if (tty) std::cerr << "\rexport " << done * 100 / std::max<uint64_t>(total, 1) << "% (" << done << " / " << total << " bytes)" << std::flush;
  }, force || !out_url.empty(), tokenizer_from, shard_bytes);
  if (tty) std::cerr << "\n";
  if (!out_url.empty()) strata::cli::upload_export(out, out_url);
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  std::cout << "exported " << dir.string() << " to " << pos[1] << ": " << r.tensors << " tensors, " << r.bytes
            << " bytes of " << dtype << " in " << s << " s\n";
  return 0;
}

int ckpt(const std::vector<std::string>& argv) {
  if (!argv.empty() && argv[0] == "export") return ckpt_export({argv.begin() + 1, argv.end()});
  if (argv.size() != 2 || (argv[0] != "inspect" && argv[0] != "verify")) {
    std::cerr << "usage: strata ckpt inspect|verify DIR\n       strata ckpt export DIR OUT [--dtype float32|bfloat16|float16] [--force] [--tokenizer-from MODEL_DIR] [--shard-size SIZE]\n";
    return 2;
  }
  const std::filesystem::path dir = checkpoint_arg(argv[1]);
  if (argv[0] == "inspect") {
    std::cout << strata::engine::describe_checkpoint(dir);
    return 0;
  }
  const auto t0 = std::chrono::steady_clock::now();
  const uint64_t bytes = strata::engine::verify_checkpoint(dir);
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  std::cout << "checkpoint " << dir.string() << ": OK (" << bytes << " bytes verified in " << s
            << " s)\n";
  return 0;
}

// `strata data prepare ...`: runs models/prepare_data.py in place of this process.
int data(const std::vector<std::string>& argv) {
  if (argv.empty() || argv[0] != "prepare") {
    std::cerr << "usage: strata data prepare --tokenizer MODEL_DIR --output FILE.bin INPUTS... "
                 "(--help for every option)\n";
    return 2;
  }
  const std::string py = python_interpreter(), script = STRATA_SOURCE_DIR "/models/prepare_data.py";
  std::vector<std::string> words = {py, script};
  words.insert(words.end(), argv.begin() + 1, argv.end());
  std::vector<char*> cargs;
  for (std::string& w : words) cargs.push_back(w.data());
  cargs.push_back(nullptr);
  execvp(py.c_str(), cargs.data());
  throw std::runtime_error("strata data prepare: cannot run " + py + " " + script + ": " + strerror(errno));
}

namespace {

// Training allocates and frees the same large buffers every step (autograd's intermediates,
// gathered units, gradient buffers). glibc serves blocks from 128 KiB up with fresh mmap()s and
// returns freed heap tops to the kernel, so each step faulted its memory in again: on the host
// device 430 thousand page faults in an 8-step run, about 5% of its time. Blocks up to 32 MiB
// (glibc's limit) come from the heap instead, and the heap keeps what it frees for the next step.
// A user's own malloc settings win: MALLOC_MMAP_THRESHOLD_, MALLOC_TRIM_THRESHOLD_,
// MALLOC_TOP_PAD_ or glibc.malloc tunables leave glibc as they set it.
void keep_freed_memory_for_reuse() {
  const char* tunables = std::getenv("GLIBC_TUNABLES");
  if (std::getenv("MALLOC_MMAP_THRESHOLD_") || std::getenv("MALLOC_TRIM_THRESHOLD_") || std::getenv("MALLOC_TOP_PAD_") ||
      (tunables && std::strstr(tunables, "glibc.malloc")))
    return;
  mallopt(M_MMAP_THRESHOLD, 32 << 20);
  mallopt(M_TRIM_THRESHOLD, 1 << 30);
  mallopt(M_TOP_PAD, 64 << 20);
}

}  // namespace

int main(int argc, char** argv) {
  // A peer rank that dies must surface as an error on the socket (EPIPE), not kill this rank
  // with SIGPIPE before it can say what happened.
  signal(SIGPIPE, SIG_IGN);
  keep_freed_memory_for_reuse();
  std::vector<std::string> args(argv + 1, argv + argc);
  try {
    if (args.empty() || args[0] == "help" || args[0] == "--help" || args[0] == "-h") {
      std::cout << kUsage;
      return args.empty() ? 2 : 0;
    }
    if (args[0] == "version" || args[0] == "--version") {
      std::cout << strata::engine::build_info();
      return 0;
    }
    if (args[0] == "train") return strata::cli::train_main({args.begin() + 1, args.end()});
    if (args[0] == "plan") return strata::cli::plan_command({args.begin() + 1, args.end()});
    if (args[0] == "launch") return strata::cli::launch_main({args.begin() + 1, args.end()});
    if (args[0] == "ckpt") return ckpt({args.begin() + 1, args.end()});
    if (args[0] == "data") return data({args.begin() + 1, args.end()});
    if (args[0] == "plot") return strata::cli::plot_main({args.begin() + 1, args.end()});
    if (args[0] == "bench") {
      if (args.size() >= 2 && args[1] == "io") return bench_io({args.begin() + 2, args.end()});
      if (args.size() >= 2 && args[1] == "adam") return bench_adam({args.begin() + 2, args.end()});
      if (args.size() >= 2 && args[1] == "step") return bench_step({args.begin() + 2, args.end()});
      if (args.size() >= 2 && args[1] == "ckpt") return bench_ckpt({args.begin() + 2, args.end()});
      if (args.size() >= 2 && args[1] == "train") return bench_train({args.begin() + 2, args.end()});
      if (args.size() >= 2 && args[1] == "tiling") return bench_tiling({args.begin() + 2, args.end()});
      if (args.size() >= 2 && args[1] == "plan") return bench_plan({args.begin() + 2, args.end()});
      if (args.size() >= 2 && args[1] == "scale") return bench_scale({args.begin() + 2, args.end()});
      std::cerr << "strata bench: expected a benchmark name (io, adam, step, ckpt, train, tiling, plan, scale)\n";
      return 2;
    }
    std::cerr << "strata: unknown command '" << args[0] << "'\n\n" << kUsage;
    return 2;
  } catch (const std::exception& e) {
    std::cerr << "strata: error: " << e.what() << "\n";
    return 1;
  }
}
