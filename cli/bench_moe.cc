// `strata bench moe`: its command line (bench/moe_bench.h).
#include <string>
#include <vector>

#include "args.h"
#include "bench.h"
#include "bench_args.h"
#include "moe_bench.h"

namespace strata::cli {

constexpr const char* kBenchMoeUsage = R"(usage: strata bench moe [options]

A mixture of experts' fp32 training step (Mixtral's blocks, one rank, host device) beside a dense
Llama of the same shape whose MLP is top-k x the expert width (the same active parameters but the
routers), both through the engine, same data, timed round-robin; then the dispatch alone (one
MoE MLP forward and backward) beside transformers' loop over the experts. Medians; final JSON line
(moe_step_vs_dense_active).

  --layers N     transformer blocks (default 4)
  --hidden N     model width (default 256)
  --heads N      attention heads (default 4)
  --vocab N      vocabulary (default 8192)
  --seq N        tokens per sequence (default 128)
  --batch N      sequences per step (default 8)
  --experts N    experts per block (default 8)
  --top-k N      experts a token uses (default 2)
  --expert-intermediate N  each expert's width (default 384)
  --steps N      timed steps per side (default 5)
  --threads N    threads (default: every hardware thread)
)";

int bench_moe(const std::vector<std::string>& argv) {
  if (printed_usage(argv, kBenchMoeUsage)) return 0;
  strata::cli::Args args(argv, {"layers", "hidden", "heads", "vocab", "seq", "batch", "experts", "top-k",
                                "expert-intermediate", "steps", "threads"}, {});
  strata::bench::MoeBenchOptions o;
  read_model_shape(args, o);
  o.experts = args.count("experts", unsigned(o.experts));
  o.top_k = args.count("top-k", unsigned(o.top_k));
  o.expert_intermediate = args.count("expert-intermediate", unsigned(o.expert_intermediate));
  o.steps = args.count("steps", o.steps);
  o.threads = args.count("threads", o.threads);
  strata::bench::run_moe_bench(o);
  return 0;
}

}  // namespace strata::cli
