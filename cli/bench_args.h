// What the `strata bench` command lines share (bench.cc, bench_finetune.cc): --help, lists and the
// model's shape options. Internal to the strata program.
#pragma once

#include <iostream>
#include <sstream>
#include <string>
#include <vector>

#include "args.h"

namespace strata::cli {

// With --help or -h among `argv`: prints `usage` and says so.
inline bool printed_usage(const std::vector<std::string>& argv, const char* usage) {
  for (const auto& a : argv)
    if (a == "--help" || a == "-h") {
      std::cout << usage;
      return true;
    }
  return false;
}

inline std::vector<std::string> split(const std::string& s, char sep) {
  std::vector<std::string> out;
  std::stringstream ss(s);
  std::string item;
  while (std::getline(ss, item, sep)) {
    if (!item.empty()) out.push_back(item);
  }
  return out;
}

// The model's shape options that bench tiling, step, lora and sft share, over their defaults.
template <class Options>
void read_model_shape(const Args& args, Options& o) {
  o.layers = args.count("layers", unsigned(o.layers));
  o.hidden = args.count("hidden", unsigned(o.hidden));
  o.heads = args.count("heads", unsigned(o.heads));
  o.vocab = args.count("vocab", unsigned(o.vocab));
  o.seq = args.count("seq", unsigned(o.seq));
  o.batch = args.count("batch", unsigned(o.batch));
}

}  // namespace strata::cli
