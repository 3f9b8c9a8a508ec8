#include "args.h"

namespace strata::cli {

Args::Args(const std::vector<std::string>& argv, const std::set<std::string>& valued,
           const std::set<std::string>& flags) {
  for (size_t i = 0; i < argv.size(); ++i) {
    std::string a = argv[i];
    if (a.rfind("--", 0) != 0) throw std::invalid_argument("unexpected argument '" + a + "'");
    std::string key = a.substr(2), value;
    const auto eq = key.find('=');
    const bool inline_value = eq != std::string::npos;
    if (inline_value) {
      value = key.substr(eq + 1);
      key = key.substr(0, eq);
    }
    if (flags.count(key)) {
      if (inline_value) throw std::invalid_argument("option --" + key + " takes no value");
      values_[key] = "1";
    } else if (valued.count(key)) {
      if (!inline_value) {
        if (i + 1 >= argv.size()) throw std::invalid_argument("option --" + key + " needs a value");
        value = argv[++i];
      }
      values_[key] = value;
    } else {
      throw std::invalid_argument("unknown option --" + key);
    }
  }
}

std::string Args::get(const std::string& key, const std::string& fallback) const {
  auto it = values_.find(key);
  return it == values_.end() ? fallback : it->second;
}

uint64_t parse_size(const std::string& text) {
  size_t pos = 0;
  unsigned long long v = 0;
  try {
    v = std::stoull(text, &pos);
  } catch (const std::exception&) {
    throw std::invalid_argument("'" + text + "' is not a size (examples: 4096, 64K, 1M, 2G)");
  }
  std::string suffix = text.substr(pos);
  uint64_t mult = 1;
  if (suffix == "" || suffix == "B") mult = 1;
  else if (suffix == "K" || suffix == "KiB") mult = 1ull << 10;
  else if (suffix == "M" || suffix == "MiB") mult = 1ull << 20;
  else if (suffix == "G" || suffix == "GiB") mult = 1ull << 30;
  else if (suffix == "T" || suffix == "TiB") mult = 1ull << 40;
  else throw std::invalid_argument("'" + text + "': unknown size suffix '" + suffix + "'");
  return v * mult;
}

uint64_t Args::size(const std::string& key, uint64_t fallback) const {
  return has(key) ? parse_size(get(key, "")) : fallback;
}

unsigned Args::count(const std::string& key, unsigned fallback) const {
  if (!has(key)) return fallback;
  const std::string v = get(key, "");
  size_t pos = 0;
  unsigned long n = 0;
  try {
    n = std::stoul(v, &pos);
  } catch (const std::exception&) {
    pos = 0;
  }
  if (pos != v.size() || v.empty() || v[0] == '-' || v[0] == '+' || n > 0xFFFFFFFFul) {
    throw std::invalid_argument("--" + key + " expects a whole number, got '" + v + "'");
  }
  return static_cast<unsigned>(n);
}

}  // namespace strata::cli
