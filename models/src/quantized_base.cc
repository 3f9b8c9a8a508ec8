#include "strata/models/quantized_base.h"

#include <regex>
#include <stdexcept>

#include "strata/models/model_config.h"
#include "strata/models/model_shapes.h"

namespace strata::models {

// transformers' should_convert_module: a pattern matches from the start up to a module boundary
// (the match ends at a "." or the name's end, or its last character is a "."), as a regular
// expression, or is a suffix of the name.
bool QuantizedBase::skips(const std::string& module) const {
  for (const std::string& p : skip_modules) {
    if (module.size() >= p.size() && module.compare(module.size() - p.size(), p.size(), p) == 0) return true;
    try {
      const std::regex re("^(?:" + p + ")(?=\\.|$)");
      if (std::regex_search(module, re)) return true;
      // A match ending just after a "." (Python's lookbehind, which std::regex lacks): any prefix
      // of the name that ends with a "." and the pattern matches whole.
      const std::regex whole("(?:" + p + ")");
      for (size_t k = 1; k <= module.size(); ++k)
        if (module[k - 1] == '.' && std::regex_match(module.begin(), module.begin() + std::ptrdiff_t(k), whole))
          return true;
    } catch (const std::regex_error&) {
      throw std::invalid_argument("model.quantize.llm_int8_skip_modules: \"" + p + "\" is not a regular expression");
    }
  }
  return false;
}

std::string QuantizedBase::describe() const {
  if (!enabled()) return "";
  std::string kept;
  for (const std::string& m : skip_modules) kept += (kept.empty() ? "" : " ") + m;
  return quant_type + ", blocks of " + std::to_string(blocksize) + (double_quant ? ", double quantization" : "") +
         (kept.empty() ? "" : ", " + kept + " kept");
}

namespace {
const std::string kIn4Bits = " in 4 bits (";
}

std::string base_fingerprint(const std::string& base, const QuantizedBase& q) {
  return q.enabled() ? base + kIn4Bits + q.describe() + ")" : base;
}

bool trained_on(const std::string& recorded, const std::string& base) {
  return recorded == base || (recorded.size() > base.size() && recorded.compare(0, base.size(), base) == 0 &&
                              recorded.compare(base.size(), kIn4Bits.size(), kIn4Bits) == 0);
}

bool stored_4bit(const ModelConfig& c, const std::string& name) {
  if (!c.quantize.enabled()) return false;
  static const std::string kWeight = ".weight";
  if (name.size() <= kWeight.size() || name.compare(name.size() - kWeight.size(), kWeight.size(), kWeight) != 0)
    return false;
  const std::string module = name.substr(0, name.size() - kWeight.size());
  for (int64_t i = 0; i < c.layers; ++i) {
    const std::string prefix = block_prefix(c, i);
    if (module.compare(0, prefix.size(), prefix) != 0) continue;
    for (const BlockLinear& l : block_linears(c))
      if (module.size() == prefix.size() + l.module.size() && module.compare(prefix.size(), std::string::npos, l.module) == 0)
        return !(c.sparse(i) && !l.attention) && !c.quantize.skips(module);
    return false;
  }
  return false;
}

Quant4Record quant4_record(uint64_t numel, const QuantizedBase& q) {
  const uint64_t blocks = (numel + uint64_t(q.blocksize) - 1) / uint64_t(q.blocksize);
  if (!q.double_quant) return {0, 0, blocks * 4, (numel + 1) / 2};
  return {4, (blocks + 255) / 256 * 4, blocks, (numel + 1) / 2};
}

StoredTensor stored_tensor(const ModelConfig& c, const std::string& whole_name, uint64_t numel, bool frozen,
                           uint64_t elem_bytes) {
  if (!frozen || !stored_4bit(c, whole_name)) return {numel, 1, false};
  const uint64_t bytes = quant4_record(numel, c.quantize).bytes();
  return {(bytes + elem_bytes - 1) / elem_bytes, kQuant4RecordAlignBytes / elem_bytes, true};
}

}  // namespace strata::models
