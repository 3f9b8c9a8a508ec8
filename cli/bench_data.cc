// `strata bench pack`: its command line (bench/pack_bench.h).
#include <stdexcept>
#include <string>
#include <vector>

#include "args.h"
#include "bench.h"
#include "bench_args.h"
#include "pack_bench.h"

namespace strata::cli {

constexpr const char* kBenchPackUsage = R"(usage: strata bench pack [options]

The packing of supervised examples into windows (data.pack: best fit decreasing, from the
examples' lengths alone) over synthetic chat-like lengths, beside its previous method (a multimap
of open bins), each in its own process: median seconds, peak memory above the lengths, and a
check that both make the same windows. Final JSON line (pack_seconds, the first count).

  --examples N[,N...]  example counts (default 1000000)
  --seq-len N          windows of N + 1 tokens (default 4096)
  --seed N             the lengths' and ties' seed (default 0)
  --rounds N           timed runs of each method (default 3)
  --file-examples N    also write a synthetic sft file of N examples (up to 4 x seq-len tokens)
                       and load and pack it as strata train does: seconds and peak memory
                       (default 0: not)
  --dir DIR            where that file goes (default /tmp/strata-bench-pack; removed after)
)";

int bench_pack(const std::vector<std::string>& argv) {
  if (printed_usage(argv, kBenchPackUsage)) return 0;
  strata::cli::Args args(argv, {"examples", "seq-len", "seed", "rounds", "file-examples", "dir"}, {});
  strata::bench::PackBenchOptions o;
  if (args.has("examples")) {
    o.examples.clear();
    const std::string list = args.get("examples", "");
    for (size_t at = 0; at <= list.size();) {
      const size_t comma = std::min(list.find(',', at), list.size());
      const std::string item = list.substr(at, comma - at);
      size_t used = 0;
      unsigned long long n = 0;
      try {
        n = std::stoull(item, &used);
      } catch (const std::exception&) {
        used = 0;
      }
      if (used != item.size() || item.empty() || n == 0)
        throw std::invalid_argument("--examples: expected counts >= 1 separated by commas, got '" + list + "'");
      o.examples.push_back(n);
      at = comma + 1;
    }
  }
  o.seq_len = args.size("seq-len", o.seq_len);
  o.seed = args.size("seed", o.seed);
  o.rounds = args.count("rounds", o.rounds);
  o.file_examples = args.size("file-examples", o.file_examples);
  o.dir = args.get("dir", o.dir);
  strata::bench::run_pack_bench(o);
  return 0;
}

}  // namespace strata::cli
