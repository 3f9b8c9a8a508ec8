#include "strata/models/trainable.h"

#include <cctype>
#include <stdexcept>

namespace strata::models {

namespace {

std::invalid_argument malformed(const std::string& pattern, const std::string& why) {
  return std::invalid_argument("model.trainable: pattern \"" + pattern + "\": " + why);
}

// A range {A-B} at pattern[p] (p at '{'): its bounds and the position after '}'.
struct Range {
  unsigned long long lo = 0, hi = 0;
  size_t end = 0;
};

Range parse_range(const std::string& pattern, size_t p) {
  const size_t close = pattern.find('}', p);
  if (close == std::string::npos) throw malformed(pattern, "'{' without '}'");
  const std::string body = pattern.substr(p + 1, close - p - 1);
  const size_t dash = body.find('-');
  const auto number = [&](const std::string& s) {
    if (s.empty() || s.size() > 18) throw malformed(pattern, "a range is {A-B} with decimal numbers A <= B");
    for (char ch : s)
      if (!std::isdigit(static_cast<unsigned char>(ch)))
        throw malformed(pattern, "a range is {A-B} with decimal numbers A <= B");
    return std::stoull(s);
  };
  if (dash == std::string::npos) throw malformed(pattern, "a range is {A-B} with decimal numbers A <= B");
  Range r{number(body.substr(0, dash)), number(body.substr(dash + 1)), close + 1};
  if (r.lo > r.hi) throw malformed(pattern, "a range is {A-B} with decimal numbers A <= B");
  return r;
}

// Backtracking match of pattern[p..] against name[n..]; patterns are short, names too.
bool match_from(const std::string& pattern, size_t p, const std::string& name, size_t n) {
  while (p < pattern.size()) {
    const char c = pattern[p];
    if (c == '*') {
      for (size_t k = n; k <= name.size(); ++k)
        if (match_from(pattern, p + 1, name, k)) return true;
      return false;
    }
    if (c == '{') {
      const Range r = parse_range(pattern, p);
      size_t e = n;
      while (e < name.size() && std::isdigit(static_cast<unsigned char>(name[e]))) ++e;
      // Every prefix of the digits that is a number in range may be the match (the rest of the
      // pattern may begin with a digit).
      for (size_t k = n + 1; k <= e && k - n <= 18; ++k) {
        const unsigned long long v = std::stoull(name.substr(n, k - n));
        if (v >= r.lo && v <= r.hi && match_from(pattern, r.end, name, k)) return true;
      }
      return false;
    }
    if (c == '}') throw malformed(pattern, "'}' without '{'");
    if (n >= name.size() || name[n] != c) return false;
    ++p;
    ++n;
  }
  return n == name.size();
}

}  // namespace

TrainableTensors::TrainableTensors(std::vector<std::string> patterns) : patterns_(std::move(patterns)) {
  for (const std::string& p : patterns_) {
    if (p.empty()) throw malformed(p, "empty");
    // A malformed pattern fails now, not at the first tensor that reaches it.
    for (size_t i = 0; i < p.size(); ++i) {
      if (p[i] == '{') i = parse_range(p, i).end - 1;
      else if (p[i] == '}') throw malformed(p, "'}' without '{'");
    }
  }
}

bool TrainableTensors::matches(const std::string& pattern, const std::string& name) {
  return match_from(pattern, 0, name, 0);
}

bool TrainableTensors::trainable(const std::string& whole_name) const {
  if (patterns_.empty()) return true;
  for (const std::string& p : patterns_)
    if (matches(p, whole_name)) return true;
  return false;
}

void TrainableTensors::check_against(const std::vector<std::string>& names) const {
  if (patterns_.empty()) return;
  std::string unmatched;
  bool any = false;
  for (const std::string& p : patterns_) {
    bool hit = false;
    for (const std::string& n : names) hit = hit || matches(p, n);
    if (!hit) unmatched += (unmatched.empty() ? "\"" : ", \"") + p + "\"";
    any = any || hit;
  }
  if (!unmatched.empty())
    throw std::invalid_argument("model.trainable: " + unmatched + " match" +
                                (unmatched.find(',') == std::string::npos ? "es" : "") +
                                " no tensor of the model (names as in Hugging Face checkpoints, e.g. \"" +
                                (names.empty() ? std::string("?") : names.front()) + "\")");
  if (!any) throw std::invalid_argument("model.trainable: no tensor of the model trains");
}

}  // namespace strata::models
