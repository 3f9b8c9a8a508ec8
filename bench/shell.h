// Running other programs from the benchmarks (fio, python3, strata itself) through the shell.
#pragma once

#include <string>

namespace strata::bench {

// `s` as one single-quoted shell word, whatever it contains.
inline std::string shell_quote(const std::string& s) {
  std::string out = "'";
  for (char c : s) out += c == '\'' ? std::string("'\\''") : std::string(1, c);
  return out + "'";
}

}  // namespace strata::bench
