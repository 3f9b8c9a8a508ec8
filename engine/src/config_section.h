// One object section of the JSON configuration, read key by key (config_parse.cc): each read
// checks the value's type and names the key in its error; at the section's end, a key nobody read
// is refused. Errors: std::invalid_argument "<source>: <section>.<key> <why>".
#pragma once

#include <nlohmann/json.hpp>

#include <exception>
#include <initializer_list>
#include <limits>
#include <set>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <utility>

#include "strata/engine/bytes.h"

namespace strata::engine::config_json {

using nlohmann::json;

// Reads one object section, rejecting keys it does not know.
class Section {
 public:
  Section(const json& j, std::string path, const std::string& source)
      : j_(j), path_(std::move(path)), source_(source) {
    if (!j_.is_object()) fail("", "must be an object");
  }
  ~Section() noexcept(false) {
    if (std::uncaught_exceptions()) return;
    for (auto it = j_.begin(); it != j_.end(); ++it)
      if (!seen_.count(it.key())) fail(it.key(), "is not a known key (see docs/CONFIG.md)");
  }
  const json* get(const std::string& key) {
    seen_.insert(key);
    auto it = j_.find(key);
    return it == j_.end() ? nullptr : &*it;
  }
  template <typename T>
  void read(const std::string& key, T& out) {
    const json* v = get(key);
    if (!v) return;
    try {
      if constexpr (std::is_same_v<T, bool>) {
        if (!v->is_boolean()) throw std::invalid_argument("");
      } else if constexpr (std::is_same_v<T, std::string>) {
        if (!v->is_string()) throw std::invalid_argument("");
      } else if constexpr (std::is_integral_v<T>) {
        if (!v->is_number_integer()) throw std::invalid_argument("");
        if (std::is_unsigned_v<T> ? !v->is_number_unsigned() : !v->is_number_integer())
          throw std::invalid_argument("");
        if (std::is_unsigned_v<T> ? v->get<uint64_t>() > uint64_t(std::numeric_limits<T>::max())
                                  : (v->get<int64_t>() > int64_t(std::numeric_limits<T>::max()) ||
                                     v->get<int64_t>() < int64_t(std::numeric_limits<T>::min())))
          throw std::invalid_argument("");
      } else {
        if (!v->is_number()) throw std::invalid_argument("");
      }
      out = v->get<T>();
    } catch (const std::exception&) {
      fail(key, "has the wrong type: " + v->dump());
    }
  }
  void read_bytes(const std::string& key, uint64_t& out) {
    const json* v = get(key);
    if (!v) return;
    try {
      if (v->is_number_unsigned()) out = v->get<uint64_t>();
      else if (v->is_string()) out = parse_bytes(v->get<std::string>());
      else throw std::invalid_argument("a byte count or a string like \"512MiB\"");
    } catch (const std::exception& e) {
      fail(key, std::string("is not a byte size: ") + v->dump());
    }
  }
  template <typename E>
  void read_enum(const std::string& key, E& out, std::initializer_list<std::pair<const char*, E>> names) {
    const json* v = get(key);
    if (!v) return;
    std::string all;
    for (auto& [n, e] : names) {
      if (v->is_string() && v->get<std::string>() == n) {
        out = e;
        return;
      }
      all += std::string(all.empty() ? "" : ", ") + n;
    }
    fail(key, "must be one of " + all + ", not " + v->dump());
  }
  const std::string& source() const { return source_; }
  [[noreturn]] void fail(const std::string& key, const std::string& msg) const {
    throw std::invalid_argument(source_ + ": " + path_ + (key.empty() ? "" : "." + key) + " " + msg);
  }

 private:
  const json& j_;
  std::string path_;
  const std::string& source_;
  std::set<std::string> seen_;
};

}  // namespace strata::engine::config_json

namespace strata::engine {
struct TrainConfig;
// config_lora.cc: the model section's `lora` and `adapter_from` into c.model.lora, c.adapter_from
// and, with LoRA, c.engine.trainable (the adapters alone).
void read_lora(config_json::Section& s, TrainConfig& c);
// config_quantize.cc: the model section's `quantize` (bitsandbytes' BitsAndBytesConfig) into
// c.model.quantize and c.quantize_compute_dtype, after what trains is known. `saved`: init_from's
// config.json quantization_config (a checkpoint saved in 4 bits), or null.
void read_quantize(config_json::Section& s, TrainConfig& c, const config_json::json* saved);
// config_model.cc: the model section (the model, its shape, LoRA through read_lora, what trains)
// into c.model, c.init_from, c.init_seed and c.engine.trainable.
void read_model(config_json::Section& s, TrainConfig& c);
}  // namespace strata::engine
