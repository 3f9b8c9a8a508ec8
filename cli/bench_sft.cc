// `strata bench sft`: its command line (bench/sft_bench.h).
#include <iostream>
#include <string>
#include <vector>

#include "args.h"
#include "bench.h"
#include "sft_bench.h"

namespace strata::cli {

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
  for (const auto& a : argv)
    if (a == "--help" || a == "-h") {
      std::cout << kBenchSftUsage;
      return 0;
    }
  Args args(argv, {"layers", "hidden", "heads", "kv-heads", "intermediate", "vocab", "seq", "batch", "steps",
                   "params", "device", "compute", "dir", "threads"},
            {});
  bench::SftBenchOptions o;
  o.layers = args.count("layers", unsigned(o.layers));
  o.hidden = args.count("hidden", unsigned(o.hidden));
  o.heads = args.count("heads", unsigned(o.heads));
  o.kv_heads = args.count("kv-heads", unsigned(o.kv_heads));
  o.intermediate = args.count("intermediate", unsigned(o.intermediate));
  o.vocab = args.count("vocab", unsigned(o.vocab));
  o.seq = args.count("seq", unsigned(o.seq));
  o.batch = args.count("batch", unsigned(o.batch));
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
