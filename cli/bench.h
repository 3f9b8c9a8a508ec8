// `strata bench NAME [options]`: the benchmarks (bench/), each run beside its baseline, ending
// with a JSON line (docs/PERFORMANCE.md).
#pragma once

#include <string>
#include <vector>

namespace strata::cli {

// `args`: what follows `strata bench`. Returns the exit status; throws on bad options.
int bench_main(const std::vector<std::string>& args);

// The interpreter of Strata's Python tools (the benchmarks' baselines, `strata data`):
// $STRATA_PYTHON, else the one the build was configured with, else python3.
std::string python_interpreter();

// `strata bench lora`, `strata bench qlora` and `strata bench sft` (bench_finetune.cc), `strata bench moe` (bench_moe.cc).
// quant_type "nf4"/"fp4": `strata bench qlora`'s run (its options parsed by bench_qlora).
int bench_lora(const std::vector<std::string>& argv, const std::string& quant_type = "");
int bench_qlora(const std::vector<std::string>& argv);
int bench_sft(const std::vector<std::string>& argv);
int bench_moe(const std::vector<std::string>& argv);
// `strata bench pack` (bench_data.cc).
int bench_pack(const std::vector<std::string>& argv);

}  // namespace strata::cli
