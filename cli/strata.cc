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
#include <optional>
#include <string>
#include <vector>

#include "args.h"
#include "bench.h"
#include "plot.h"
#include "strata/engine/device.h"
#include "train.h"
#include "plan.h"
#include "strata/engine/build_info.h"
#include "strata/engine/checkpoint.h"
#include "strata/engine/checkpoint_store.h"
#include "strata/models/hf_io.h"
#include "strata/models/peft.h"
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
  data prepare --chat --tokenizer MODEL_DIR --output FILE.sft DATASET...
               conversations (parquet, arrow, JSON/JSONL, a datasets or Hub dataset
               directory; messages, ShareGPT, Alpaca, prompt/response) into supervised
               examples with the tokenizer's chat template, loss on every assistant turn
               (data.format sft); --workers N processes, --split, --schema, --column
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
                     other files, e.g. a tokenizer, are kept); a LoRA checkpoint: its PEFT
                     adapter, and with --base MODEL_DIR the merged model into OUT-merged
                     (--merge-into dequantized: a 4-bit run's adapters into the 4-bit weights
                     it trained on, dequantized; base, the default: MODEL_DIR's weights)
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
  bench lora   a LoRA step (frozen base, adapters on every block linear) beside the full
               fine-tune's: step time, model TFLOPS, device and host bytes
  bench qlora  the same LoRA step over a 4-bit (NF4/FP4) base beside the 16-bit base's: step
               time and the bytes each moves a step
  bench sft    supervised fine-tuning packed beside padded on log-normal chat lengths: real
               tokens a second and packing efficiency
  bench pack   the packing rule over millions of example lengths beside its previous method:
               seconds, peak memory, the same windows
  version      versions of strata and libtorch, CUDA, CPU kernel ISA, I/O backends
  help         this text

`strata <command> --help` shows the options of a command.
)";

}  // namespace

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

// `strata ckpt export`'s arguments; nullopt (said on stderr) when they are not valid.
struct ExportArgs {
  std::string dtype = "float32", tokenizer_from;
  std::filesystem::path base;  // a LoRA checkpoint's base: the merged model is written too
  strata::engine::MergeInto into = strata::engine::MergeInto::kBase;  // a 4-bit run's merge
  uint64_t shard_bytes = strata::models::kDefaultShardBytes;  // as run.export_shard_size
  bool force = false;
  std::vector<std::string> pos;
};

std::optional<ExportArgs> parse_export_args(const std::vector<std::string>& argv) {
  ExportArgs a;
  std::string merge_into = "base";
  for (size_t i = 0; i < argv.size(); ++i) {
    if (argv[i] == "--force") a.force = true;
    else if (argv[i] == "--dtype" && i + 1 < argv.size()) a.dtype = argv[++i];
    else if (argv[i].starts_with("--dtype=")) a.dtype = argv[i].substr(8);
    else if (argv[i] == "--base" && i + 1 < argv.size()) a.base = argv[++i];
    else if (argv[i].starts_with("--base=")) a.base = argv[i].substr(7);
    else if (argv[i] == "--merge-into" && i + 1 < argv.size()) merge_into = argv[++i];
    else if (argv[i].starts_with("--merge-into=")) merge_into = argv[i].substr(13);
    else if (argv[i] == "--tokenizer-from" && i + 1 < argv.size()) a.tokenizer_from = argv[++i];
    else if (argv[i].starts_with("--tokenizer-from=")) a.tokenizer_from = argv[i].substr(17);
    else if (argv[i] == "--shard-size" && i + 1 < argv.size()) a.shard_bytes = strata::cli::parse_size(argv[++i]);
    else if (argv[i].starts_with("--shard-size=")) a.shard_bytes = strata::cli::parse_size(argv[i].substr(13));
    else if (argv[i].starts_with("-")) {
      std::cerr << "strata ckpt export: unknown option " << argv[i] << "\n";
      return std::nullopt;
    } else a.pos.push_back(argv[i]);
  }
  if (a.pos.size() != 2) {
    std::cerr << "usage: strata ckpt export DIR OUT [--dtype float32|bfloat16|float16] [--force] [--tokenizer-from MODEL_DIR] [--shard-size SIZE] [--base MODEL_DIR [--merge-into base|dequantized]]\n";
    return std::nullopt;
  }
  a.into = strata::engine::parse_merge_into(merge_into, "--merge-into");
  if (a.base.empty() && a.into != strata::engine::MergeInto::kBase) {
    std::cerr << "strata ckpt export: --merge-into needs --base (the model the adapters merge into)\n";
    return std::nullopt;
  }
  return a;
}

int ckpt_export(const std::vector<std::string>& argv) {
  const std::optional<ExportArgs> args = parse_export_args(argv);
  if (!args) return 2;
  const auto& [dtype, tokenizer_from, base, into, shard_bytes, force, pos] = *args;
  const std::filesystem::path dir = checkpoint_arg(pos[0]);
  // A LoRA checkpoint exports as a PEFT adapter directory; with --base, the merged model as well,
  // into OUT-merged.
  const bool lora = !strata::engine::read_checkpoint_meta(dir).lora.empty();
  if (!base.empty() && !lora) {
    std::cerr << "strata ckpt export: --base merges a LoRA checkpoint's adapters, and " << dir.string()
              << " has none (it holds the whole model: export it without --base)\n";
    return 2;
  }
  // OUT in object storage: staged in the cache, each shard uploaded as it is written, config.json
  // (adapter_config.json) last.
  const std::string out_url = strata::offload::is_object_store_url(pos[1]) ? pos[1] : "";
  if (!out_url.empty() && !base.empty()) {
    std::cerr << "strata ckpt export: --base (the merged model) with an export to object storage is not supported: "
                 "export to a directory\n";
    return 2;
  }
  if (!out_url.empty()) strata::cli::check_export_store(out_url, force, "pass --force to replace it");
  const std::string out = out_url.empty() ? pos[1] : strata::cli::cache_path("exports", out_url);
  std::optional<strata::cli::ExportUpload> upload;
  if (!out_url.empty()) {
    upload.emplace(out_url, lora ? strata::models::kAdapterConfigFile : "config.json");
    strata::cli::clear_directory(out);  // nothing of an earlier staged export is uploaded again
  }
  const bool tty = isatty(STDERR_FILENO);
  // The merged model first: a base that is not the checkpoint's is refused before anything is
  // written, and so is an OUT that would be refused after it.
  if (!base.empty()) {
    strata::models::ExportDirectory::check(out, force, "pass --force to replace its files");
    const std::filesystem::path merged = strata::models::ExportDirectory::beside(out, "-merged");
    const auto t1 = std::chrono::steady_clock::now();
    const auto m = strata::engine::export_checkpoint_merged(dir, base, merged, dtype, [&](uint64_t done, uint64_t total) {
      if (tty) std::cerr << "\rmerged " << done * 100 / std::max<uint64_t>(total, 1) << "% (" << done << " / " << total << " bytes)" << std::flush;
    }, force, tokenizer_from.empty() ? base : std::filesystem::path(tokenizer_from), shard_bytes, {}, into);
    if (tty) std::cerr << "\n";
    std::cout << "merged " << dir.string() << "'s adapter into " << base.string() << ": " << merged.string() << ", "
              << m.tensors << " tensors, " << m.bytes << " bytes of " << dtype << " in "
              << std::chrono::duration<double>(std::chrono::steady_clock::now() - t1).count() << " s"
              << (m.dequantized ? " (" + std::to_string(m.dequantized) + " weights merged into their dequantized 4-bit values)"
                                : std::string(" (into the base's 16-bit weights)"))
              << "\n";
  }
  const auto t0 = std::chrono::steady_clock::now();
  const auto r = strata::engine::export_checkpoint_hf(dir, out, dtype, [&](uint64_t done, uint64_t total) {
    if (tty) std::cerr << "\rexport " << done * 100 / std::max<uint64_t>(total, 1) << "% (" << done << " / " << total << " bytes)" << std::flush;
  }, force || !out_url.empty(), tokenizer_from, shard_bytes,
     upload ? upload->on_weights_file() : std::function<void(const std::filesystem::path&)>());
  if (tty) std::cerr << "\n";
  if (upload) upload->finish(out, r.files);
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  std::cout << "exported " << dir.string() << (lora ? "'s LoRA adapter (PEFT)" : "") << " to " << pos[1] << ": "
            << r.tensors << " tensors, " << r.bytes << " bytes of " << dtype << " in " << s << " s\n";
  return 0;
}

int ckpt(const std::vector<std::string>& argv) {
  if (!argv.empty() && argv[0] == "export") return ckpt_export({argv.begin() + 1, argv.end()});
  if (argv.size() != 2 || (argv[0] != "inspect" && argv[0] != "verify")) {
    std::cerr << "usage: strata ckpt inspect|verify DIR\n       strata ckpt export DIR OUT [--dtype float32|bfloat16|float16] [--force] [--tokenizer-from MODEL_DIR] [--shard-size SIZE] [--base MODEL_DIR [--merge-into base|dequantized]]\n";
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
  const std::string py = strata::cli::python_interpreter(), script = STRATA_SOURCE_DIR "/models/prepare_data.py";
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
    if (args[0] == "bench") return strata::cli::bench_main({args.begin() + 1, args.end()});
    std::cerr << "strata: unknown command '" << args[0] << "'\n\n" << kUsage;
    return 2;
  } catch (const std::exception& e) {
    std::cerr << "strata: error: " << e.what() << "\n";
    return 1;
  }
}
