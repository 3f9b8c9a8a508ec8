// Minimal command-line parsing for the strata subcommands: `--key value` or `--key=value`,
// flags without a value, sizes with binary suffixes. Unknown options are errors.
#pragma once

#include <cstdint>
#include <map>
#include <set>
#include <stdexcept>
#include <string>
#include <vector>

namespace strata::cli {

class Args {
 public:
  // `valued`: options that take a value; `flags`: options that do not.
  Args(const std::vector<std::string>& argv, const std::set<std::string>& valued,
       const std::set<std::string>& flags);

  bool has(const std::string& key) const { return values_.count(key) != 0; }
  std::string get(const std::string& key, const std::string& fallback) const;
  // "4096", "64K", "1M", "2G", "1T" (binary multiples).
  uint64_t size(const std::string& key, uint64_t fallback) const;
  unsigned count(const std::string& key, unsigned fallback) const;

 private:
  std::map<std::string, std::string> values_;
};

uint64_t parse_size(const std::string& text);  // throws std::invalid_argument

}  // namespace strata::cli
