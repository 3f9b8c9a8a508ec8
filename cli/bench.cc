// `strata bench NAME`: the benchmarks' command lines (bench/), each beside its baseline.
#include "bench.h"

#include <cstdlib>
#include <filesystem>
#include <iostream>
#include <stdexcept>
#include <string>
#include <vector>

#include "adam_bench.h"
#include "args.h"
#include "bench_args.h"
#include "ckpt_bench.h"
#include "io_bench.h"
#include "plan_bench.h"
#include "scale_bench.h"
#include "step_bench.h"
#include "tiling_bench.h"
#include "train_bench.h"
#include "strata/engine/bytes.h"
#include "strata/offload/object_store.h"

namespace strata::cli {

// The interpreter of Strata's Python tools: $STRATA_PYTHON, else the one the build was
// configured with (the setup's virtual environment), else python3.
std::string python_interpreter() {
  const char* py = std::getenv("STRATA_PYTHON");
  const std::string built = STRATA_BUILD_PYTHON;
  return py && *py ? std::string(py) : !built.empty() ? built : "python3";
}

namespace {

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
  if (printed_usage(argv, kBenchTilingUsage)) return 0;
  strata::cli::Args args(argv, {"layers", "hidden", "heads", "vocab", "seq", "batch", "tiles", "attention-tiles",
                                "mlp-tiles", "vocab-tiles", "steps", "budget",
                                "capacity-hidden", "capacity-tokens", "capacity-max-vocab", "hidden-budget", "hidden-tokens", "hidden-max",
                                "sequence-budget", "sequence-hidden", "sequence-max",
                                "threads", "device", "compute", "head-pass", "parts"}, {});
  strata::bench::TilingBenchOptions o;
  read_model_shape(args, o);
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
  if (printed_usage(argv, kBenchPlanUsage)) return 0;
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
Each part prints its growth exponents against the world size. Between the second and the third,
the 32-rank tests (Ranks32.*, out of CI: 2-4 min and 12 GB of RAM on 2 cores), when the test
binary was built and --worlds is not 0. The final JSON line is the metadata part's, with the tests' results
("ranks32_tests").

  --worlds LIST    ranks on this machine, comma-separated (default 1,2,4,8,16,32; 0: skip the
                   first two parts)
  --bytes SIZE     the collectives' buffer (default 16MiB)
  --preset NAME    model preset (default gpt-1t)
  --ranks LIST     saving world sizes, comma-separated (default 512,4096)
  --dir DIR        where the metadata is written, then removed (default strata-bench-scale)
  --no-baseline    skip format 2 (a few hundred MB of JSON at gpt-1t)
  --many-rank-tests PATH|auto|off
                   the 32-rank tests' binary (default auto: tests/many_ranks_tests beside this
                   strata, skipped when absent; off: skip)
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
  if (printed_usage(argv, kBenchScaleUsage)) return 0;
  strata::cli::Args args(argv, {"preset", "ranks", "dir", "read-metadata", "rank", "worlds", "bytes", "iters",
                                 "many-rank-tests"},
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
  o.many_rank_tests = args.get("many-rank-tests", o.many_rank_tests);
  if (args.has("ranks")) o.saved_worlds = world_list(args.get("ranks", ""), "--ranks", 1);
  if (args.has("worlds")) {
    const std::string worlds = args.get("worlds", "");
    o.worlds = worlds == "0" ? std::vector<int>{} : world_list(worlds, "--worlds", 1);
  }
  strata::bench::run_scale_bench(o);
  return 0;
}

int bench_step(const std::vector<std::string>& argv) {
  if (printed_usage(argv, kBenchStepUsage)) return 0;
  strata::cli::Args args(argv, {"layers", "hidden", "heads", "vocab", "seq", "batch", "steps", "threads", "placement", "recompute", "overlap"}, {"no-overlap"});
  strata::bench::StepBenchOptions o;
  read_model_shape(args, o);
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

int bench_train(const std::vector<std::string>& argv) {
  if (printed_usage(argv, kBenchTrainUsage)) return 0;
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

}  // namespace

int bench_main(const std::vector<std::string>& args) {
  if (args.size() >= 1 && args[0] == "io") return bench_io({args.begin() + 1, args.end()});
  if (args.size() >= 1 && args[0] == "adam") return bench_adam({args.begin() + 1, args.end()});
  if (args.size() >= 1 && args[0] == "step") return bench_step({args.begin() + 1, args.end()});
  if (args.size() >= 1 && args[0] == "ckpt") return bench_ckpt({args.begin() + 1, args.end()});
  if (args.size() >= 1 && args[0] == "train") return bench_train({args.begin() + 1, args.end()});
  if (args.size() >= 1 && args[0] == "tiling") return bench_tiling({args.begin() + 1, args.end()});
  if (args.size() >= 1 && args[0] == "plan") return bench_plan({args.begin() + 1, args.end()});
  if (args.size() >= 1 && args[0] == "scale") return bench_scale({args.begin() + 1, args.end()});
  if (args.size() >= 1 && args[0] == "lora") return bench_lora({args.begin() + 1, args.end()});
  if (args.size() >= 1 && args[0] == "qlora") return bench_qlora({args.begin() + 1, args.end()});
  if (args.size() >= 1 && args[0] == "sft") return bench_sft({args.begin() + 1, args.end()});
  if (args.size() >= 1 && args[0] == "moe") return bench_moe({args.begin() + 1, args.end()});
  if (args.size() >= 1 && args[0] == "pack") return bench_pack({args.begin() + 1, args.end()});
  std::cerr << "strata bench: expected a benchmark name (io, adam, step, ckpt, train, tiling, plan, scale, lora, qlora, sft, moe, "
               "pack)\n";
  return 2;
}

}  // namespace strata::cli
