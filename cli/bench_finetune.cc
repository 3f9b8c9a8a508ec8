// `strata bench lora` and `strata bench sft`: the fine-tuning benchmarks' command lines
// (bench/lora_bench.h, bench/sft_bench.h).
#include <iostream>
#include <stdexcept>
#include <string>
#include <vector>

#include "args.h"
#include "bench.h"
#include "bench_args.h"
#include "lora_bench.h"
#include "sft_bench.h"
#include "strata/engine/bytes.h"

namespace strata::cli {

constexpr const char* kBenchLoraUsage = R"(usage: strata bench lora [options]

A LoRA step beside the full fine-tune's in one run: the same Llama-shaped model (random init),
the same placement, LoRA r --r on every linear layer of the blocks (all-linear), the base frozen.
A JSON line per side (step seconds, tokens/s, model TFLOPS with 4 FLOPs a frozen parameter and 6 a
trainable one, device peak, host and swap state bytes), then the final line: lora_step_s with
full_finetune_step_s as its baseline, and both sides' host state bytes.

  --layers N         transformer blocks (default 4)
  --hidden N         model width (default 1024)
  --heads N          attention heads (default 16)
  --kv-heads N       key/value heads (default 4)
  --intermediate N   MLP width (default 2816)
  --vocab N          vocabulary (default 8192)
  --seq N            tokens per sequence (default 256)
  --batch N          sequences per step (default 2)
  --r N              LoRA rank (default 16; lora_alpha twice it)
  --steps N          timed steps per side (default 3)
  --params P         where the compute copies live: device, host (default), nvme or auto
  --state P          gradients, master weights and moments: device, host (default), nvme or auto
  --nvme-dirs A,B    swap directories for nvme
  --device D         cpu (default: the host device) or cuda
  --budget BYTES     the device budget (default: none)
  --compute P        fp32 (default) or bf16
  --no-recompute     keep every block's activations (default: recompute)
  --no-baseline      the LoRA side alone (a model whose full fine-tune does not fit)
  --threads N        threads for libtorch and the kernels (default: all)
)";

int bench_lora(const std::vector<std::string>& argv, const std::string& quant_type) {
  if (quant_type.empty() && printed_usage(argv, kBenchLoraUsage)) return 0;
  strata::cli::Args args(argv, {"layers", "hidden", "heads", "kv-heads", "intermediate", "vocab", "seq", "batch", "r",
                                "steps", "params", "state", "nvme-dirs", "device", "budget", "compute", "threads"},
                         {"no-recompute", "no-baseline"});
  strata::bench::LoraBenchOptions o;
  read_model_shape(args, o);
  o.kv_heads = args.count("kv-heads", unsigned(o.kv_heads));
  o.intermediate = args.count("intermediate", unsigned(o.intermediate));
  o.r = args.count("r", unsigned(o.r));
  o.alpha = 2.0 * double(o.r);
  o.steps = args.count("steps", o.steps);
  o.params = args.get("params", o.params);
  o.state = args.get("state", o.state);
  if (args.has("nvme-dirs")) o.nvme_dirs = split(args.get("nvme-dirs", ""), ',');
  o.device = args.get("device", o.device);
  if (args.has("budget")) o.budget = strata::engine::parse_bytes(args.get("budget", ""));
  o.compute = args.get("compute", o.compute);
  o.recompute = !args.has("no-recompute");
  o.baseline = !args.has("no-baseline");
  o.threads = args.count("threads", o.threads);
  o.qlora = !quant_type.empty();
  if (o.qlora) o.quant_type = quant_type;
  strata::bench::run_lora_bench(o);
  return 0;
}

constexpr const char* kBenchQloraUsage = R"(usage: strata bench qlora [options]

The same LoRA step over a 4-bit base (model.quantize: the blocks' linear weights in NF4 or FP4,
bitsandbytes' blocks of 64) beside it over the compute dtype's base, one run, the same
Llama-shaped model (random init) and placement. A JSON line per side (step seconds, tokens/s, model
TFLOPS, device peak, host and swap state bytes, the bytes its last step moved host to device and
read from swap), then the final line: qlora_step_s with lora_<compute>_base_step_s as its
baseline (their ratio also as qlora_step_vs_<compute>_base) and both sides' bytes.

Takes the options of `strata bench lora` (--layers ... --threads; --no-baseline runs the 4-bit
side alone), and:
  --quant-type T     nf4 (default) or fp4
Run it with the base in host memory (--params host, the default) and in swap (--params nvme
--nvme-dirs D).
)";

int bench_qlora(const std::vector<std::string>& argv) {
  if (printed_usage(argv, kBenchQloraUsage)) return 0;
  std::vector<std::string> rest;
  std::string quant_type = "nf4";
  for (size_t i = 0; i < argv.size(); ++i) {
    if (argv[i] == "--quant-type" && i + 1 < argv.size()) quant_type = argv[++i];
    else rest.push_back(argv[i]);
  }
  if (quant_type != "nf4" && quant_type != "fp4")
    throw std::invalid_argument("strata bench qlora: --quant-type must be nf4 or fp4, not " + quant_type);
  return bench_lora(rest, quant_type);
}

constexpr const char* kBenchSftUsage = R"(usage: strata bench sft [options]

Supervised fine-tuning packed (data.pack) beside padded (one example a window) in one run, the
same Llama-shaped model (random init) and engine. The benchmark makes 4096 chat examples whose
lengths follow a fixed log-normal spread (median 200 tokens, 1% over 1500; cut at seq + 1), the
first third of each a prompt out of the loss. A JSON line per side (windows, packing efficiency:
real tokens over window tokens, step seconds, real tokens a second), then the final line:
sft_real_tokens_per_s (packed) with padded_real_tokens_per_s as its baseline.

  --layers N         transformer blocks (default 2)
  --hidden N         model width (default 256)
  --heads N          attention heads (default 4)
  --kv-heads N       key/value heads (default 2)
  --intermediate N   MLP width (default 688)
  --vocab N          vocabulary (default 4096)
  --seq N            tokens per window (default 2048)
  --batch N          windows per step (default 2)
  --steps N          timed steps per side (default 3)
  --params P         where the compute copies and the state live: device (default), host, nvme, auto
  --device D         cpu (default: the host device) or cuda
  --compute P        fp32 (default) or bf16
  --dir DIR          where the examples file is written (default: a temporary directory, removed)
  --threads N        threads for libtorch and the kernels (default: all)
)";

int bench_sft(const std::vector<std::string>& argv) {
  if (printed_usage(argv, kBenchSftUsage)) return 0;
  Args args(argv, {"layers", "hidden", "heads", "kv-heads", "intermediate", "vocab", "seq", "batch", "steps",
                   "params", "device", "compute", "dir", "threads"},
            {});
  bench::SftBenchOptions o;
  read_model_shape(args, o);
  o.kv_heads = args.count("kv-heads", unsigned(o.kv_heads));
  o.intermediate = args.count("intermediate", unsigned(o.intermediate));
  o.steps = args.count("steps", o.steps);
  o.params = args.get("params", o.params);
  o.device = args.get("device", o.device);
  o.compute = args.get("compute", o.compute);
  o.dir = args.get("dir", "");
  o.threads = args.count("threads", o.threads);
  bench::run_sft_bench(o);
  return 0;
}

}  // namespace strata::cli
